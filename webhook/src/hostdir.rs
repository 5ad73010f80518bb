//! KubeShare's host directory ([`kubeshare_api::layout::DEFAULT_ROOT`]) holds every
//! pod's gem-schd socket and every GPU's config. A pod that mounts it, a parent of it
//! (`/` included) or anything under it could connect to another pod's socket and spend
//! that pod's share, or read every pod's config. So no pod the webhook admits mounts a
//! hostPath that reaches it, except the two volumes the webhook itself gives a
//! fractional pod, mounted as it mounts them: `kubeshare-lib` read-only, and
//! `kubeshare-run` narrowed to the pod's own directory by `subPathExpr
//! $(KUBESHARE_POD_UID)` with that variable read from the pod's UID.
//!
//! The ValidatingAdmissionPolicy `kubeshare-host-dir` (charts/kubeshare, admission-
//! policy.yaml) says the same in CEL and holds while the webhook is down. Pure logic.

use kubeshare_api::layout;
use serde::Deserialize;
use serde_json::Value;

use crate::inject;
use crate::plan::Denial;

/// The directory no pod may reach.
pub const HOST_DIR: &str = layout::DEFAULT_ROOT;

/// The components of `path` as the host resolves it lexically: empty and `.`
/// components dropped, `..` removes the one before it (and stays at `/` above it). A
/// relative path is taken from `/`, the kubelet's root: never more permissive.
pub fn components(path: &str) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

/// `path` normalised: absolute, single slashes, no `.` or `..`, no trailing slash.
pub fn normalise(path: &str) -> String {
    format!("/{}", components(path).join("/"))
}

/// Whether a hostPath at `path` reaches `dir`: the same directory, one of its parents
/// (so `/` reaches everything), or anything under it.
pub fn reaches(path: &str, dir: &str) -> bool {
    let (p, d) = (components(path), components(dir));
    let n = p.len().min(d.len());
    p[..n] == d[..n]
}

/// Which of the webhook's own volumes a volume is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ours {
    Lib,
    Run,
}

// The few fields of a pod spec the rule reads. Deserialized from the JSON on their
// own: a whole `PodSpec` (and copies of its containers) cost as much as the rest of
// an admission.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    volumes: Option<Vec<Vol>>,
    init_containers: Option<Vec<Ctr>>,
    containers: Option<Vec<Ctr>>,
    ephemeral_containers: Option<Vec<Ctr>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Vol {
    name: String,
    host_path: Option<HostPath>,
}

#[derive(Deserialize)]
struct HostPath {
    path: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Ctr {
    name: String,
    env: Option<Vec<Env>>,
    volume_mounts: Option<Vec<Mount>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Env {
    name: String,
    value: Option<String>,
    value_from: Option<EnvSource>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvSource {
    field_ref: Option<FieldRef>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FieldRef {
    field_path: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    name: String,
    read_only: Option<bool>,
    sub_path: Option<String>,
    sub_path_expr: Option<String>,
}

fn parse(spec: &Value) -> Result<Spec, Denial> {
    Spec::deserialize(spec).map_err(|e| Denial::bad_request(format!("spec is not a pod spec: {e}")))
}

/// Whether a pod spec as the user wrote it needs [`check`] on the patched pod: it has
/// a hostPath that reaches the directory, or a container mounts a volume named as the
/// webhook's. Otherwise what the patch adds is all there is of the directory, and that
/// passes by construction: the webhook's two volumes, mounted as it mounts them, in
/// the containers it also gives `KUBESHARE_POD_UID` from the pod's UID (the property
/// tests of props.rs check those). Saves copying and patching every GPU pod.
pub(crate) fn needs_check(spec: &Value) -> Result<bool, Denial> {
    let spec = parse(spec)?;
    let reaching = spec.volumes.iter().flatten().any(|v| {
        v.host_path
            .as_ref()
            .is_some_and(|h| reaches(&h.path, HOST_DIR))
    });
    let ours = [inject::LIB_VOLUME, inject::RUN_VOLUME];
    let mounts_ours = [
        &spec.init_containers,
        &spec.containers,
        &spec.ephemeral_containers,
    ]
    .into_iter()
    .flat_map(|l| l.iter().flatten())
    .flat_map(|c| c.volume_mounts.iter().flatten())
    .any(|m| ours.contains(&m.name.as_str()));
    Ok(reaching || mounts_ours)
}

/// Refuses a pod spec (JSON, as the webhook will admit it: its own patch applied) that
/// mounts KubeShare's host directory other than through the webhook's two volumes as
/// the webhook mounts them.
pub(crate) fn check(spec: &Value) -> Result<(), Denial> {
    let spec = parse(spec)?;
    let mut ours: Vec<(&str, Ours)> = Vec::new();
    for v in spec.volumes.iter().flatten() {
        let Some(hp) = v.host_path.as_ref() else {
            continue;
        };
        if !reaches(&hp.path, HOST_DIR) {
            continue;
        }
        let path = normalise(&hp.path);
        let kind = if v.name == inject::LIB_VOLUME && path == inject::LIB_HOST_PATH {
            Ours::Lib
        } else if v.name == inject::RUN_VOLUME && path == inject::RUN_HOST_PATH {
            Ours::Run
        } else {
            return Err(Denial::invalid(format!(
                "volume {name}: hostPath {raw} reaches {HOST_DIR}, KubeShare's host directory, which holds every pod's GPU scheduler socket and config: a pod may not mount it, a parent of it or anything under it (a fractional GPU pod gets what it needs of it from KubeShare, as volumes {lib} and {run})",
                name = v.name,
                raw = hp.path,
                lib = inject::LIB_VOLUME,
                run = inject::RUN_VOLUME,
            )));
        };
        ours.push((v.name.as_str(), kind));
    }
    if ours.is_empty() {
        return Ok(());
    }
    let groups = [
        ("init container", &spec.init_containers),
        ("container", &spec.containers),
        ("ephemeral container", &spec.ephemeral_containers),
    ];
    for (what, list) in groups {
        for c in list.iter().flatten() {
            for m in c.volume_mounts.iter().flatten() {
                let Some(&(_, kind)) = ours.iter().find(|(n, _)| *n == m.name) else {
                    continue;
                };
                let ok = match kind {
                    Ours::Lib => lib_mount_ok(m),
                    Ours::Run => run_mount_ok(m, c),
                };
                if !ok {
                    return Err(Denial::invalid(refusal(
                        kind,
                        &format!("{what} {:?}", c.name),
                    )));
                }
            }
        }
    }
    Ok(())
}

fn refusal(kind: Ours, label: &str) -> String {
    match kind {
        Ours::Lib => format!(
            "{label}: volume {} (KubeShare's hook library, used by every pod of the node) may only be mounted read-only and whole",
            inject::LIB_VOLUME
        ),
        Ours::Run => format!(
            "{label}: volume {} holds every pod's GPU scheduler sockets; a container may mount only its own pod's directory of it: subPathExpr {}, with env {} read from the pod's {} and set nowhere else (the webhook adds both; a debug container may not mount it)",
            inject::RUN_VOLUME,
            inject::RUN_SUB_PATH_EXPR,
            inject::ENV_POD_UID,
            inject::POD_UID_FIELD_PATH,
        ),
    }
}

fn empty(s: &Option<String>) -> bool {
    s.as_deref().unwrap_or_default().is_empty()
}

fn lib_mount_ok(m: &Mount) -> bool {
    m.read_only == Some(true) && empty(&m.sub_path) && empty(&m.sub_path_expr)
}

fn run_mount_ok(m: &Mount, c: &Ctr) -> bool {
    m.sub_path_expr.as_deref() == Some(inject::RUN_SUB_PATH_EXPR)
        && empty(&m.sub_path)
        && pod_uid_env_ok(c.env.as_deref().unwrap_or_default())
}

/// `KUBESHARE_POD_UID` is set, and every entry of that name reads the pod's UID (the
/// kubelet expands `subPathExpr` with the container's env; without an entry, an
/// `envFrom` could supply another pod's UID).
fn pod_uid_env_ok(env: &[Env]) -> bool {
    let mut same = env
        .iter()
        .filter(|e| e.name == inject::ENV_POD_UID)
        .peekable();
    same.peek().is_some()
        && same.all(|e| {
            empty(&e.value)
                && e.value_from
                    .as_ref()
                    .and_then(|s| s.field_ref.as_ref())
                    .is_some_and(|f| f.field_path == inject::POD_UID_FIELD_PATH)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalise_cleans_slashes_dots_and_backsteps() {
        assert_eq!(normalise("/var//lib/./kubeshare/"), "/var/lib/kubeshare");
        assert_eq!(normalise("/var/lib/x/../kubeshare"), "/var/lib/kubeshare");
        assert_eq!(normalise("/../.."), "/");
        assert_eq!(normalise(""), "/");
        assert_eq!(normalise("var/lib"), "/var/lib");
    }

    #[test]
    fn parents_the_directory_and_descendants_reach_it() {
        for p in [
            "/",
            "//",
            "/var",
            "/var/lib/",
            "/var/lib/kubeshare",
            "/var/lib/kubeshare/",
            "/var/lib/kubeshare/pods/uid",
            "/var//lib/kubeshare/gpus",
            "/var/lib/other/../kubeshare/pods",
            "/var/lib/kubeshare/pods/../../kubeshare",
            "/etc/../var/lib",
        ] {
            assert!(reaches(p, HOST_DIR), "{p}");
        }
        for p in [
            "/var/lib/kubelet",
            "/var/lib/kubeshare-test",
            "/var/lib/kubesharex/pods",
            "/var/lib/kubeshare/../kubelet",
            "/dev/nvidia0",
            "/etc",
            "/var/log",
        ] {
            assert!(!reaches(p, HOST_DIR), "{p}");
        }
    }

    #[test]
    fn the_webhooks_volumes_are_under_the_directory() {
        assert!(inject::LIB_HOST_PATH.starts_with(&format!("{HOST_DIR}/")));
        assert!(inject::RUN_HOST_PATH.starts_with(&format!("{HOST_DIR}/")));
        assert_eq!(normalise(inject::LIB_HOST_PATH), inject::LIB_HOST_PATH);
        assert_eq!(normalise(inject::RUN_HOST_PATH), inject::RUN_HOST_PATH);
    }
}
