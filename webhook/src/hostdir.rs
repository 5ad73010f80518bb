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

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec, VolumeMount};
use kubeshare_api::layout;

use crate::guard;
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

/// Refuses a pod (as the webhook will admit it, its own patch applied) that mounts
/// KubeShare's host directory other than through the webhook's two volumes as the
/// webhook mounts them.
pub(crate) fn check(spec: &PodSpec) -> Result<(), Denial> {
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
    for (at, c) in guard::containers(spec) {
        for m in c.volume_mounts.iter().flatten() {
            let Some(&(_, kind)) = ours.iter().find(|(n, _)| *n == m.name) else {
                continue;
            };
            let ok = match kind {
                Ours::Lib => lib_mount_ok(m),
                Ours::Run => run_mount_ok(m, &c),
            };
            if !ok {
                return Err(Denial::invalid(match kind {
                    Ours::Lib => format!(
                        "{}: volume {} (KubeShare's hook library, used by every pod of the node) may only be mounted read-only and whole",
                        at.label,
                        inject::LIB_VOLUME
                    ),
                    Ours::Run => format!(
                        "{}: volume {} holds every pod's GPU scheduler sockets; a container may mount only its own pod's directory of it: subPathExpr {}, with env {} read from the pod's {} and set nowhere else (the webhook adds both; a debug container may not mount it)",
                        at.label,
                        inject::RUN_VOLUME,
                        inject::RUN_SUB_PATH_EXPR,
                        inject::ENV_POD_UID,
                        inject::POD_UID_FIELD_PATH,
                    ),
                }));
            }
        }
    }
    Ok(())
}

fn empty(s: &Option<String>) -> bool {
    s.as_deref().unwrap_or_default().is_empty()
}

fn lib_mount_ok(m: &VolumeMount) -> bool {
    m.read_only == Some(true) && empty(&m.sub_path) && empty(&m.sub_path_expr)
}

fn run_mount_ok(m: &VolumeMount, c: &Container) -> bool {
    m.sub_path_expr.as_deref() == Some(inject::RUN_SUB_PATH_EXPR)
        && empty(&m.sub_path)
        && pod_uid_env_ok(c.env.as_deref().unwrap_or_default())
}

/// `KUBESHARE_POD_UID` is set, and every entry of that name reads the pod's UID (the
/// kubelet expands `subPathExpr` with the container's env; without an entry, an
/// `envFrom` could supply another pod's UID).
fn pod_uid_env_ok(env: &[EnvVar]) -> bool {
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
