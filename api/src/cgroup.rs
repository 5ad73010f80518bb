//! Which pod a process belongs to, from its cgroups as the kubelet lays them out (pure, no
//! I/O: the callers read `/proc/<pid>/cgroup`). gem-schd uses it to check that a process
//! connecting to a pod's socket runs in that pod; the node daemon, to name the pod of a
//! process that uses a GPU without gem-schd knowing it.
//!
//! The kubelet puts each pod in a cgroup named after its UID, under a QoS class:
//!
//! ```text
//! cgroupfs driver:  [<root>]/kubepods/pod<uid>/<container>                   (Guaranteed)
//!                   [<root>]/kubepods/burstable/pod<uid>/<container>
//!                   [<root>]/kubepods/besteffort/pod<uid>/<container>
//! systemd driver:   /kubepods.slice/kubepods-pod<uid_>.slice/cri-containerd-<id>.scope
//!                   /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/…
//!                   /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/…
//! ```
//!
//! (systemd writes the UID's dashes as underscores). A process in a private cgroup namespace
//! sees other processes' paths relative to its own root (`/../../kubepods/…`); only the
//! components from `kubepods` on matter, so that works too.

/// The pod UID in one cgroup path, if the path lies inside a pod's cgroup.
pub fn pod_uid_in_path(path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    parts
        .iter()
        .enumerate()
        .find_map(|(i, part)| pod_component(&parts[..i], part))
}

/// The pod UID of a process from the text of its `/proc/<pid>/cgroup` (one line
/// `ID:CONTROLLERS:PATH` per hierarchy). `None` when no line names a pod, or when lines name
/// different pods (a process half-moved between pods is nobody's).
pub fn pod_uid_of_process(proc_cgroup: &str) -> Option<String> {
    let mut found: Option<String> = None;
    for line in proc_cgroup.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        if let Some(uid) = pod_uid_in_path(path) {
            match &found {
                Some(f) if *f != uid => return None,
                _ => found = Some(uid),
            }
        }
    }
    found
}

/// `part` as a pod's cgroup below `parents`, in either driver's naming.
fn pod_component(parents: &[&str], part: &str) -> Option<String> {
    let parent = parents.last().copied()?;
    if let Some(uid) = part.strip_prefix("pod") {
        // cgroupfs: pod<uid> right under kubepods, or under kubepods/<qos>. Otherwise it may
        // still be a systemd slice whose cgroup root's prefix starts with "pod".
        let grandparent = parents.len().checked_sub(2).map(|i| parents[i]);
        let placed = parent == "kubepods"
            || (matches!(parent, "burstable" | "besteffort") && grandparent == Some("kubepods"));
        if placed && is_uid(uid, '-') {
            return Some(uid.to_string());
        }
    }
    // systemd: <slice>-pod<uid_>.slice right under <slice>.slice, where <slice> is
    // kubepods or kubepods-<qos>, possibly after a prefix of the kubelet's cgroup root.
    let name = part.strip_suffix(".slice")?;
    let (slice, uid) = name.rsplit_once("-pod")?;
    let qos_ok = slice.ends_with("kubepods")
        || slice.ends_with("kubepods-burstable")
        || slice.ends_with("kubepods-besteffort");
    let parent_ok = parent.strip_suffix(".slice") == Some(slice);
    (qos_ok && parent_ok && is_uid(uid, '_')).then(|| uid.replace('_', "-"))
}

/// A pod UID as the kubelet names it: an RFC 4122 UUID from the API server (36 characters)
/// or a static pod's 32-hex-digit hash, lower case; `sep` is the dash as the driver writes it.
fn is_uid(s: &str, sep: char) -> bool {
    let hex = s.chars().filter(|c| *c != sep).count();
    hex == 32
        && (s.len() == 32 || s.len() == 36)
        && s.chars()
            .all(|c| c == sep || c.is_ascii_digit() || ('a'..='f').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UID: &str = "6f1c2d3e-4a5b-4c6d-8e7f-0123456789ab";

    #[test]
    fn cgroupfs_layouts() {
        for p in [
            format!("/kubepods/pod{UID}/0123abcd"),
            format!("/kubepods/burstable/pod{UID}/0123abcd"),
            format!("/kubepods/besteffort/pod{UID}/0123abcd"),
            format!("/ks-node-1/kubepods/besteffort/pod{UID}/0123abcd"),
            format!("/../../kubepods/burstable/pod{UID}"),
            format!("/kubepods/burstable/pod{UID}"),
        ] {
            assert_eq!(pod_uid_in_path(&p).as_deref(), Some(UID), "{p}");
        }
    }

    #[test]
    fn systemd_layouts() {
        let u = UID.replace('-', "_");
        for p in [
            format!("/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-0a1b.scope"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-0a1b.scope"
            ),
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/crio-0a1b.scope"
            ),
            format!(
                "/ks.slice/ks-kubepods.slice/ks-kubepods-besteffort.slice/ks-kubepods-besteffort-pod{u}.slice"
            ),
            // A cgroup root whose prefix starts with "pod": the slice is not a cgroupfs pod<uid>.
            format!("/pod-kubepods.slice/pod-kubepods-pod{u}.slice"),
        ] {
            assert_eq!(pod_uid_in_path(&p).as_deref(), Some(UID), "{p}");
        }
    }

    #[test]
    fn paths_outside_pods_name_none() {
        for p in [
            "/",
            "",
            "/user.slice/user-0.slice/session-1.scope",
            "/system.slice/containerd.service",
            "/kubepods",
            "/kubepods/burstable",
            "/kubepods.slice/kubepods-burstable.slice",
            // pod<uid> not under kubepods (or its QoS classes)
            &format!("/docker/pod{UID}"),
            &format!("/burstable/pod{UID}"),
            // not a UID
            "/kubepods/podcast/x",
            "/kubepods/burstable/pod1234",
            &format!("/kubepods/burstable/pod{}", UID.to_uppercase()),
            // systemd slice under the wrong parent
            &format!(
                "/kubepods.slice/kubepods-besteffort-pod{}.slice",
                UID.replace('-', "_")
            ),
        ] {
            assert_eq!(pod_uid_in_path(p), None, "{p}");
        }
    }

    #[test]
    fn static_pod_hash_uid() {
        let h = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            pod_uid_in_path(&format!("/kubepods/burstable/pod{h}/c")).as_deref(),
            Some(h)
        );
    }

    #[test]
    fn proc_cgroup_of_cgroup_v1_and_v2() {
        let v1 = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/abc\n\
             11:memory:/kubepods/besteffort/pod{UID}/abc\n\
             1:name=systemd:/\n0::/\n"
        );
        assert_eq!(pod_uid_of_process(&v1).as_deref(), Some(UID));
        let v2 = format!("0::/kubepods/burstable/pod{UID}/abc\n");
        assert_eq!(pod_uid_of_process(&v2).as_deref(), Some(UID));
        assert_eq!(pod_uid_of_process("0::/user.slice\n"), None);
        assert_eq!(pod_uid_of_process(""), None);
        // Two pods: nobody's.
        let other = "0123abcd-4a5b-4c6d-8e7f-0123456789ab";
        let split = format!("12:pids:/kubepods/pod{UID}/a\n11:memory:/kubepods/pod{other}/b\n");
        assert_eq!(pod_uid_of_process(&split), None);
    }

    fn uid_strategy() -> impl Strategy<Value = String> {
        "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    }

    proptest! {
        #[test]
        fn every_kubelet_layout_names_its_pod(
            uid in uid_strategy(),
            systemd in any::<bool>(),
            qos in 0usize..3,
            prefix in proptest::option::of("[a-z]{1,8}"),
            ns_up in 0usize..3,
            container in proptest::option::of("[0-9a-f]{1,64}"),
            controllers in "[a-z_,=]{0,20}",
        ) {
            let q = ["", "burstable", "besteffort"][qos];
            let mut parts: Vec<String> = vec![];
            if systemd {
                let p = prefix.as_ref().map(|p| format!("{p}-")).unwrap_or_default();
                parts.push(format!("{p}kubepods.slice"));
                let mut slice = format!("{p}kubepods");
                if !q.is_empty() {
                    slice = format!("{slice}-{q}");
                    parts.push(format!("{slice}.slice"));
                }
                parts.push(format!("{slice}-pod{}.slice", uid.replace('-', "_")));
                if let Some(c) = &container {
                    parts.push(format!("cri-containerd-{c}.scope"));
                }
            } else {
                if let Some(p) = &prefix {
                    parts.push(p.clone());
                }
                parts.push("kubepods".into());
                if !q.is_empty() {
                    parts.push(q.into());
                }
                parts.push(format!("pod{uid}"));
                if let Some(c) = &container {
                    parts.push(c.clone());
                }
            }
            let up = "/..".repeat(ns_up);
            let path = format!("{up}/{}", parts.join("/"));
            prop_assert_eq!(pod_uid_in_path(&path), Some(uid.clone()), "{}", path);
            let text = format!("0::{path}\n3:{controllers}:{path}\n1:name=systemd:/\n");
            prop_assert_eq!(pod_uid_of_process(&text), Some(uid), "{}", text);
        }

        #[test]
        fn any_text_parses_without_panicking(s in "\\PC{0,300}") {
            let _ = pod_uid_of_process(&s);
            let _ = pod_uid_in_path(&s);
        }

        #[test]
        fn a_found_uid_is_always_well_formed(s in "(/(kubepods|burstable|pod[0-9a-f_-]{30,38}|[a-z._-]{1,12}))*") {
            if let Some(u) = pod_uid_in_path(&s) {
                prop_assert!(is_uid(&u, '-'), "{} from {}", u, s);
            }
        }
    }
}
