//! Errors of the test rig.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while finding, starting or using the test cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid cluster description: {source}")]
    ClusterJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("the cluster in {0} is not up (no `ready` marker; run hack/cluster.sh up)")]
    NotReady(PathBuf),
    #[error("the cluster has no kubeconfig for identity {0}")]
    UnknownIdentity(String),
    #[error("`{command}` failed ({status}); see {log}")]
    Script {
        command: String,
        status: String,
        log: PathBuf,
    },
    #[error("cannot start {command}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("timed out after {waited:?} waiting for {what}; last seen: {last}")]
    Timeout {
        what: String,
        waited: Duration,
        last: String,
    },
    #[error("{0}")]
    Other(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
