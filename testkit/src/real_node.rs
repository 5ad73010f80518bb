//! The real node (hack/node.sh: containerd, kubelet, kube-proxy in their own
//! namespaces) that `hack/with-cluster.sh --node` starts beside the control plane,
//! with KubeShare installed on it with the Helm chart. Tests find it through
//! `KUBESHARE_NODE_DIR` and read the node's KubeShare host directory from the host.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, LogParams};

use crate::error::{Error, Result};
use crate::wait::wait_until;

/// Env var naming the node's directory (`RUN_DIR/node`, holding `node.env`).
pub const NODE_DIR_ENV: &str = "KUBESHARE_NODE_DIR";

/// The test workload image (hack/images.sh): `cuda-workload` on the fake
/// `libcuda.so.1`, busybox, and `NVIDIA_VISIBLE_DEVICES=all` set by the image as
/// CUDA images set it.
pub const WORKLOAD_IMAGE: &str = "docker.io/kubeshare/cuda-workload:latest";

/// Where KubeShare's host directory is on a node (docs/design.md, "Node side").
pub const NODE_KUBESHARE_ROOT: &str = kubeshare_api::layout::DEFAULT_ROOT;

/// A real node started by `hack/node.sh up`.
#[derive(Debug, Clone)]
pub struct RealNode {
    /// The Node's name.
    pub name: String,
    /// `RUN_DIR/node`.
    pub dir: PathBuf,
    /// The node's pod CIDR.
    pub pod_cidr: String,
    env: BTreeMap<String, String>,
}

impl RealNode {
    /// The node named by `KUBESHARE_NODE_DIR`; an error that says how to get one otherwise.
    pub fn from_env() -> Result<RealNode> {
        let dir = std::env::var_os(NODE_DIR_ENV).filter(|d| !d.is_empty()).ok_or_else(|| {
            Error::Other(format!(
                "{NODE_DIR_ENV} is not set: run under `hack/with-cluster.sh --node` (make node-test)"
            ))
        })?;
        RealNode::load(Path::new(&dir))
    }

    /// Reads `dir/node.env` (KEY=VALUE lines written by hack/node.sh).
    pub fn load(dir: &Path) -> Result<RealNode> {
        let path = dir.join("node.env");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let env = parse_env(&text);
        let get = |k: &str| {
            env.get(k)
                .cloned()
                .ok_or_else(|| Error::Other(format!("{}: no {k}", path.display())))
        };
        Ok(RealNode {
            name: get("NODE_NAME")?,
            pod_cidr: get("POD_CIDR")?,
            dir: dir.to_path_buf(),
            env,
        })
    }

    /// A value of node.env (NODE_ID, NODE_IP, HOST_IP, CGROUP, ...).
    pub fn env(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// The host path behind the node's `/var/lib/kubeshare/<rel>` (a bind mount
    /// inside the node's mount namespace).
    pub fn kubeshare_path(&self, rel: &str) -> PathBuf {
        self.dir.join("kubeshare").join(rel.trim_start_matches('/'))
    }

    /// The Gemini resource-config of a GPU as the node daemon wrote it, if any.
    pub fn resource_config(&self, gpu_uuid: &str) -> Option<String> {
        std::fs::read_to_string(self.layout().config(gpu_uuid)).ok()
    }

    /// A pod's socket directory on the node (`pods/<uid>`).
    pub fn pod_socket_dir(&self, pod_uid: &str) -> PathBuf {
        self.layout().pod_dir(pod_uid)
    }

    /// The node's KubeShare directory, as seen from the host.
    fn layout(&self) -> kubeshare_api::layout::Layout {
        kubeshare_api::layout::Layout::new(self.kubeshare_path(""))
    }
}

fn parse_env(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// The pod's phase ("Pending", "Running", "Succeeded", "Failed"), if reported.
pub fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Whether every container of the pod has started and is running.
pub fn pod_is_running(pod: &Pod) -> bool {
    pod_phase(pod) == "Running"
        && pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
}

/// The value of a pod annotation.
pub fn pod_annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// A container's log (stdout and stderr, as the kubelet keeps it).
pub async fn pod_logs(api: &Api<Pod>, pod: &str, container: &str) -> Result<String> {
    let lp = LogParams {
        container: Some(container.to_string()),
        ..LogParams::default()
    };
    Ok(api.logs(pod, &lp).await?)
}

/// Waits until the container's log holds `needle`; returns the whole log.
pub async fn wait_for_log(
    api: &Api<Pod>,
    pod: &str,
    container: &str,
    needle: &str,
    timeout: Duration,
) -> Result<String> {
    wait_until(
        &format!("log of {pod}/{container} to contain {needle:?}"),
        timeout,
        || async {
            match pod_logs(api, pod, container).await {
                Ok(log) if log.contains(needle) => Ok(Some(log)),
                Ok(log) => Err(format!("log so far: {}", tail(&log, 1500))),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await
}

/// Deletes the pods matching `selector` (empty: all) in the namespace and waits
/// until they are gone, so that their GPU shares are free again.
pub async fn delete_pods_and_wait(api: &Api<Pod>, selector: &str, timeout: Duration) -> Result<()> {
    let lp = if selector.is_empty() {
        ListParams::default()
    } else {
        ListParams::default().labels(selector)
    };
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    api.delete_collection(&dp, &lp).await?;
    wait_until("pods to be gone", timeout, || async {
        match api.list(&lp).await {
            Ok(l) if l.items.is_empty() => Ok(Some(())),
            Ok(l) => Err(format!("{} pods left", l.items.len())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
}

fn tail(s: &str, n: usize) -> &str {
    let start = s.len().saturating_sub(n);
    let mut i = start;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_env_is_parsed_and_paths_map_into_the_node_dir() {
        let d = std::env::temp_dir().join(format!("ks-node-env-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("node.env"),
            "NODE_ID=3\nNODE_NAME=kubeshare-node\nPOD_CIDR=10.244.3.0/24\nINIT_PID=42\n",
        )
        .unwrap();
        let n = RealNode::load(&d).unwrap();
        assert_eq!(n.name, "kubeshare-node");
        assert_eq!(n.pod_cidr, "10.244.3.0/24");
        assert_eq!(n.env("NODE_ID"), Some("3"));
        assert_eq!(n.kubeshare_path("/pods/u1"), d.join("kubeshare/pods/u1"));
        std::fs::write(d.join("node.env"), "NODE_ID=3\n").unwrap();
        let e = RealNode::load(&d).unwrap_err().to_string();
        assert!(e.contains("no NODE_NAME"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn tail_keeps_char_boundaries() {
        assert_eq!(tail("héllo", 4), "llo");
        assert_eq!(tail("ab", 10), "ab");
    }
}
