//! KubeShare's host directory through the webhook: the path logic by property (a
//! hostPath whose normalised form is the directory, a parent of it or anything under it
//! reaches it; nothing else does, however it is spelled), and the pods it refuses and
//! admits (through the AdmissionReview wire path).

mod common;

use common::{denial, frac_labels, mutate, pod_with};
use kubeshare_webhook::hostdir::{HOST_DIR, components, normalise, reaches};
use proptest::prelude::*;
use serde_json::{Value, json};

/// The directory's components: ["var", "lib", "kubeshare"].
fn dir() -> Vec<&'static str> {
    components(HOST_DIR)
}

/// Spells a normalised path in one of many equivalent ways: doubled slashes, `.`
/// components, detours `x/..`, a leading `/..`, a trailing slash.
fn spell(parts: &[String], noise: &[u8]) -> String {
    let mut out = String::new();
    let mut k = noise.iter().copied().cycle();
    if k.next() == Some(1) {
        out.push_str("/..");
    }
    for p in parts {
        match k.next().unwrap_or(0) % 5 {
            0 => out.push('/'),
            1 => out.push_str("//"),
            2 => out.push_str("/./"),
            3 => out.push_str("/detour/../"),
            _ => out.push_str("/x/y/../../"),
        }
        out.push_str(p);
    }
    if k.next().unwrap_or(0) % 2 == 1 || parts.is_empty() {
        out.push('/');
    }
    out
}

/// A normalised path that reaches the directory: a prefix of it (0..=3 components)
/// or the directory followed by anything.
fn reaching() -> impl Strategy<Value = Vec<String>> {
    (
        0..=3usize,
        proptest::collection::vec("[a-z0-9.-]{1,8}", 0..4),
    )
        .prop_map(|(n, tail)| {
            let d = dir();
            let mut p: Vec<String> = d[..n].iter().map(|s| s.to_string()).collect();
            if n == d.len() {
                p.extend(tail.into_iter().filter(|c| c != "." && c != ".."));
            }
            p
        })
}

/// A normalised path that does not: it leaves the directory's components at some
/// depth with a name that differs.
fn elsewhere() -> impl Strategy<Value = Vec<String>> {
    (
        0..3usize,
        "[a-z0-9-]{1,12}",
        proptest::collection::vec("[a-z0-9-]{1,8}", 0..4),
    )
        .prop_filter_map("same component", |(n, other, tail)| {
            let d = dir();
            if other == d[n] {
                return None;
            }
            let mut p: Vec<String> = d[..n].iter().map(|s| s.to_string()).collect();
            p.push(other);
            p.extend(tail);
            Some(p)
        })
}

proptest! {
    #[test]
    fn every_spelling_of_a_parent_or_descendant_reaches_the_directory(
        parts in reaching(),
        noise in proptest::collection::vec(0u8..5, 1..16),
    ) {
        let path = spell(&parts, &noise);
        prop_assert_eq!(normalise(&path), format!("/{}", parts.join("/")));
        prop_assert!(reaches(&path, HOST_DIR), "{path}");
    }

    #[test]
    fn every_spelling_of_another_path_does_not(
        parts in elsewhere(),
        noise in proptest::collection::vec(0u8..5, 1..16),
    ) {
        let path = spell(&parts, &noise);
        prop_assert_eq!(normalise(&path), format!("/{}", parts.join("/")));
        prop_assert!(!reaches(&path, HOST_DIR), "{path}");
    }

    /// Through the webhook: a plain pod with such a hostPath is refused with the
    /// reason; with another hostPath it is admitted.
    #[test]
    fn the_webhook_refuses_exactly_the_reaching_host_paths(
        parts in prop_oneof![reaching().prop_map(|p| (p, true)), elsewhere().prop_map(|p| (p, false))],
        noise in proptest::collection::vec(0u8..5, 1..16),
    ) {
        let (parts, reach) = parts;
        let path = spell(&parts, &noise);
        let pod = plain_with_host_path("h", &path);
        if reach {
            let m = denial(&pod);
            prop_assert!(m.contains(&format!("volume h: hostPath {path} reaches /var/lib/kubeshare, KubeShare's host directory")), "{m}");
        } else {
            mutate(&pod);
        }
    }
}

fn plain_with_host_path(name: &str, path: &str) -> Value {
    pod_with(
        json!({"app": "web"}),
        json!({
            "containers": [{"name": "c", "image": "x", "volumeMounts": [{"name": name, "mountPath": "/host"}]}],
            "volumes": [{"name": name, "hostPath": {"path": path}}],
        }),
    )
}

const DIR_MSG: &str = "reaches /var/lib/kubeshare, KubeShare's host directory, which holds every pod's GPU scheduler socket and config: a pod may not mount it, a parent of it or anything under it";

#[test]
fn host_paths_into_the_directory_are_refused_with_the_reason() {
    for path in [
        "/var/lib/kubeshare",
        "/var/lib/kubeshare/pods",
        "/var/lib/kubeshare/gpus/GPU-1",
        "/",
        "/var/lib/",
        "/var/lib//kubeshare/./pods/",
    ] {
        let m = denial(&plain_with_host_path("peek", path));
        assert_eq!(
            m,
            format!(
                "volume peek: hostPath {path} {DIR_MSG} (a fractional GPU pod gets what it needs of it from KubeShare, as volumes kubeshare-lib and kubeshare-run)"
            )
        );
    }
    // Also on KubeShare pods, whole or fractional.
    for labels in [
        frac_labels(),
        json!({"sharedgpu/gpu_request": "1", "sharedgpu/gpu_limit": "1"}),
    ] {
        let pod = pod_with(
            labels,
            json!({"containers": [{"name": "c", "image": "x"}],
                   "volumes": [{"name": "all", "hostPath": {"path": "/var/lib"}}]}),
        );
        assert!(denial(&pod).contains(DIR_MSG));
    }
    // Other host paths stay the pod's business (Pod Security decides on them).
    let pod = mutate(&plain_with_host_path("logs", "/var/log"));
    assert_eq!(pod["spec"]["volumes"][0]["hostPath"]["path"], "/var/log");
}

#[test]
fn the_webhooks_own_volumes_pass_only_as_it_mounts_them() {
    // A fractional pod gets them and is admitted.
    let pod = mutate(&pod_with(
        frac_labels(),
        json!({"initContainers": [{"name": "i", "image": "x"}], "containers": [{"name": "c", "image": "x"}]}),
    ));
    assert_eq!(pod["spec"]["volumes"].as_array().map(Vec::len), Some(2));
    // Admitted again as it is now (an empty patch), the whole rule is applied to it:
    // what the webhook adds passes (the webhook skips the check for its own additions).
    assert_eq!(mutate(&pod), pod);

    // A second mount of the socket volume without the per-pod subPathExpr.
    let m = denial(&pod_with(
        frac_labels(),
        json!({"containers": [{"name": "c", "image": "x", "volumeMounts": [
            {"name": "kubeshare-run", "mountPath": "/kubeshare/run", "subPathExpr": "$(KUBESHARE_POD_UID)"},
            {"name": "kubeshare-run", "mountPath": "/all"}]}],
               "volumes": [{"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods", "type": "Directory"}}]}),
    ));
    assert!(
        m.starts_with("container \"c\": volume kubeshare-run holds every pod's GPU scheduler sockets; a container may mount only its own pod's directory of it: subPathExpr $(KUBESHARE_POD_UID), with env KUBESHARE_POD_UID read from the pod's metadata.uid"),
        "{m}"
    );
    // A plain pod that copies the volume with the subPathExpr but takes the UID from envFrom.
    let m = denial(&pod_with(
        json!({"app": "web"}),
        json!({"containers": [{"name": "c", "image": "x",
                "envFrom": [{"configMapRef": {"name": "victim"}}],
                "volumeMounts": [{"name": "kubeshare-run", "mountPath": "/s", "subPathExpr": "$(KUBESHARE_POD_UID)"}]}],
               "volumes": [{"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods"}}]}),
    ));
    assert!(
        m.contains("volume kubeshare-run holds every pod's GPU scheduler sockets"),
        "{m}"
    );
    // ... or sets it to a literal UID.
    let m = denial(&pod_with(
        json!({"app": "web"}),
        json!({"containers": [{"name": "c", "image": "x",
                "env": [{"name": "KUBESHARE_POD_UID", "value": "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e01"}],
                "volumeMounts": [{"name": "kubeshare-run", "mountPath": "/s", "subPathExpr": "$(KUBESHARE_POD_UID)"}]}],
               "volumes": [{"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods"}}]}),
    ));
    assert!(
        m.contains("volume kubeshare-run holds every pod's GPU scheduler sockets"),
        "{m}"
    );
    // The hook library, writable.
    let m = denial(&pod_with(
        json!({"app": "web"}),
        json!({"containers": [{"name": "c", "image": "x",
                "volumeMounts": [{"name": "kubeshare-lib", "mountPath": "/l"}]}],
               "volumes": [{"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib"}}]}),
    ));
    assert_eq!(
        m,
        "container \"c\": volume kubeshare-lib (KubeShare's hook library, used by every pod of the node) may only be mounted read-only and whole"
    );
    // The socket volume's path under another name.
    let m = denial(&plain_with_host_path("sockets", "/var/lib/kubeshare/pods"));
    assert!(
        m.starts_with("volume sockets: hostPath /var/lib/kubeshare/pods reaches"),
        "{m}"
    );
}

#[test]
fn a_debug_container_may_not_mount_the_socket_volume() {
    use kubeshare_webhook::review::{Mode, answer};
    let pod = mutate(&pod_with(
        frac_labels(),
        json!({"containers": [{"name": "c", "image": "x"}]}),
    ));
    let mut new = pod.clone();
    new["spec"]["ephemeralContainers"] = json!([{"name": "debug", "image": "x",
        "volumeMounts": [{"name": "kubeshare-run", "mountPath": "/s"}]}]);
    let body = request_body_ephemeral(&new, &pod);
    let a = answer(&body, Mode::Mutate).expect("a well-formed review");
    let r: Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(r["response"]["allowed"], false, "{r}");
    let m = r["response"]["status"]["message"].as_str().unwrap();
    assert!(
        m.starts_with("ephemeral container \"debug\": volume kubeshare-run holds every pod's GPU scheduler sockets"),
        "{m}"
    );
    // Without the mount, the debug container is admitted.
    new["spec"]["ephemeralContainers"][0]
        .as_object_mut()
        .unwrap()
        .remove("volumeMounts");
    let a = answer(&request_body_ephemeral(&new, &pod), Mode::Mutate).unwrap();
    let r: Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(r["response"]["allowed"], true, "{r}");
}

fn request_body_ephemeral(new: &Value, old: &Value) -> Vec<u8> {
    kubeshare_webhook::review::request_body_sub(
        "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e02",
        "UPDATE",
        Some("ephemeralcontainers"),
        "ns1",
        Some(new),
        Some(old),
    )
}

/// The admission policy that holds the same rule while the webhook is down names the
/// same directory and volumes (it is CEL in the chart; the webhook takes them from
/// `kubeshare_api::layout`).
#[test]
fn the_admission_policy_names_the_same_directory_and_volumes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../manifests/admission-policy.yaml"
    ))
    .unwrap();
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
    let policy = docs
        .iter()
        .find(|d| {
            d["kind"] == "ValidatingAdmissionPolicy"
                && d["metadata"]["name"] == "kubeshare-host-dir"
        })
        .expect("policy kubeshare-host-dir");
    let vars = policy["spec"]["variables"].as_array().unwrap();
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .and_then(|v| v["expression"].as_str())
            .unwrap_or_else(|| panic!("variable {name}"))
            .to_string()
    };
    assert_eq!(var("dir"), format!("'{HOST_DIR}'"));
    use kubeshare_webhook::inject;
    let lib = inject::LIB_HOST_PATH.strip_prefix(HOST_DIR).unwrap();
    let run = inject::RUN_HOST_PATH.strip_prefix(HOST_DIR).unwrap();
    assert!(var("lib").contains(&format!(
        "v.name == '{}' && v.path == variables.dir + '{lib}'",
        inject::LIB_VOLUME
    )));
    assert!(var("run").contains(&format!(
        "v.name == '{}' && v.path == variables.dir + '{run}'",
        inject::RUN_VOLUME
    )));
    let bad = var("badContainers");
    assert!(bad.contains(&format!("m.subPathExpr == '{}'", inject::RUN_SUB_PATH_EXPR)));
    assert!(bad.contains(&format!("e.name == '{}'", inject::ENV_POD_UID)));
    assert!(bad.contains(&format!(
        "e.valueFrom.fieldRef.fieldPath == '{}'",
        inject::POD_UID_FIELD_PATH
    )));
}
