//! kwok Nodes: Node objects that kwok (not a kubelet) keeps Ready, and whose
//! pods kwok "runs" by the rig's Stage objects (hack/cluster-stages.yaml).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};

use crate::error::Result;

/// kwok manages exactly the Nodes with this label (`--manage-nodes-with-label-selector=type=kwok`).
pub const KWOK_NODE_LABEL: (&str, &str) = ("type", "kwok");

/// Pod annotation (Go duration, e.g. `"30s"`): how long a Job's pod runs on a
/// kwok node before it succeeds. Default 1s.
pub const RUN_DURATION_ANNOTATION: &str = "kwok.kubeshare.io/run-duration";

/// A Node to create for kwok. Defaults: 32 CPUs, 256Gi memory, 110 pods.
#[derive(Debug, Clone)]
pub struct KwokNode {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// status.capacity (and status.allocatable): cpu, memory, pods and any extended resource.
    pub capacity: BTreeMap<String, String>,
}

impl KwokNode {
    pub fn new(name: impl Into<String>) -> Self {
        let capacity = [("cpu", "32"), ("memory", "256Gi"), ("pods", "110")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        KwokNode {
            name: name.into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            capacity,
        }
    }

    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn annotation(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn cpu(self, q: impl Into<String>) -> Self {
        self.resource("cpu", q)
    }

    pub fn memory(self, q: impl Into<String>) -> Self {
        self.resource("memory", q)
    }

    pub fn pods(self, q: impl Into<String>) -> Self {
        self.resource("pods", q)
    }

    /// Any capacity entry, e.g. an extended resource.
    pub fn resource(mut self, name: impl Into<String>, q: impl Into<String>) -> Self {
        self.capacity.insert(name.into(), q.into());
        self
    }

    /// The Node object: our labels plus `type=kwok` and `kubernetes.io/hostname`.
    pub fn to_node(&self) -> Node {
        let mut labels = self.labels.clone();
        labels.insert(KWOK_NODE_LABEL.0.into(), KWOK_NODE_LABEL.1.into());
        labels
            .entry("kubernetes.io/hostname".into())
            .or_insert_with(|| self.name.clone());
        labels
            .entry("kubernetes.io/os".into())
            .or_insert_with(|| "linux".into());
        let quantities: BTreeMap<String, Quantity> = self
            .capacity
            .iter()
            .map(|(k, v)| (k.clone(), Quantity(v.clone())))
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": self.annotations,
            },
            "status": {
                "capacity": quantities,
                "allocatable": quantities,
            }
        }))
        .unwrap_or_default()
    }
}

/// Creates the Node and sets its capacity/allocatable through the status
/// subresource (so the values hold whatever create does with status). kwok then
/// marks it Ready within a second or two; wait for that with
/// [`crate::wait_for`] and [`node_is_ready`] if the test needs it.
pub async fn create_kwok_node(client: &kube::Client, spec: &KwokNode) -> Result<Node> {
    let api: Api<Node> = Api::all(client.clone());
    let node = spec.to_node();
    api.create(&PostParams::default(), &node).await?;
    let status = serde_json::json!({ "status": {
        "capacity": node.status.as_ref().and_then(|s| s.capacity.clone()),
        "allocatable": node.status.as_ref().and_then(|s| s.allocatable.clone()),
    }});
    Ok(api
        .patch_status(&spec.name, &PatchParams::default(), &Patch::Merge(&status))
        .await?)
}

/// Deletes a Node; a missing Node is not an error.
pub async fn delete_node(client: &kube::Client, name: &str) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether the Node reports condition Ready=True.
pub fn node_is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_carries_kwok_label_hostname_and_capacity() {
        let n = KwokNode::new("n1")
            .label("sharedgpu/x", "y")
            .annotation("a", "b")
            .cpu("4")
            .resource("example.com/gpu", "2")
            .to_node();
        let labels = n.metadata.labels.unwrap();
        assert_eq!(labels["type"], "kwok");
        assert_eq!(labels["kubernetes.io/hostname"], "n1");
        assert_eq!(labels["sharedgpu/x"], "y");
        assert_eq!(n.metadata.annotations.unwrap()["a"], "b");
        let cap = n.status.unwrap().capacity.unwrap();
        assert_eq!(cap["cpu"], Quantity("4".into()));
        assert_eq!(cap["memory"], Quantity("256Gi".into()));
        assert_eq!(cap["example.com/gpu"], Quantity("2".into()));
    }

    #[test]
    fn kwok_label_wins_over_a_conflicting_user_label() {
        let n = KwokNode::new("n").label("type", "gpu").to_node();
        assert_eq!(n.metadata.labels.unwrap()["type"], "kwok");
    }
}
