//! Test rig for KubeShare's integration tests: a handle on a real local Kubernetes
//! control plane (etcd, kube-apiserver, kube-controller-manager, the default
//! kube-scheduler, a second kube-scheduler with profile `kubeshare-scheduler` that
//! calls our extender, and kwok), started by `hack/cluster.sh`, plus helpers for
//! kwok Nodes, per-test namespaces and waiting on conditions, and a handle on the
//! real node (kubelet + containerd) of `hack/with-cluster.sh --node`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kubeshare_testkit::Error> {
//! use kubeshare_testkit::{Cluster, Identity, KwokNode, TestNamespace};
//! let cluster = Cluster::shared()?;             // KUBESHARE_TEST_CLUSTER, or start one
//! let client = cluster.client(Identity::Admin).await?;
//! let ns = TestNamespace::create(cluster, "my-test").await?;
//! let node = KwokNode::new(ns.unique_name("node")).cpu("8").memory("32Gi");
//! kubeshare_testkit::create_kwok_node(&client, &node).await?;
//! # Ok(()) }
//! ```

pub mod cgroups;
mod cluster;
pub mod dra;
mod error;
pub mod metrics;
mod namespace;
mod node;
mod real_node;
mod wait;

pub use cluster::{CLUSTER_ENV, Cluster, ClusterInfo, Identity, Ports, client_from_kubeconfig};
pub use error::Error;
pub use namespace::TestNamespace;
pub use node::{
    KWOK_NODE_LABEL, KwokNode, RUN_DURATION_ANNOTATION, create_kwok_node, delete_node,
    node_is_ready,
};
pub use real_node::{
    NODE_DIR_ENV, NODE_KUBESHARE_ROOT, RealNode, WORKLOAD_IMAGE, delete_pods_and_wait,
    pod_annotation, pod_is_running, pod_logs, pod_phase, wait_for_log,
};
pub use wait::{wait_for, wait_until};
