//! Kubernetes objects to what placement needs: pure parsing, no I/O.
//!
//! Labels go through `kubeshare_api::GpuDemand::from_labels` (the one label
//! parser), annotations through `kubeshare_api::Allocation::from_annotations`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kubeshare_api::inventory::INVENTORY_ANNOTATION;
use kubeshare_api::{Allocation, GpuDemand, NodeInventory, is_kubeshare_pod};
use serde::Deserialize;

use crate::placement::PodInfo;

/// The parts of a v1.Pod the extender reads; unknown fields are skipped, so a
/// filter request does not pay for decoding whole container specs.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<WirePodSpec>,
    #[serde(default)]
    pub status: Option<WirePodStatus>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WirePodSpec {
    #[serde(default)]
    pub scheduler_name: Option<String>,
    #[serde(default)]
    pub node_name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePodStatus {
    #[serde(default)]
    pub phase: Option<String>,
}

/// Builds a [`PodInfo`] from a pod's metadata, scheduler name, node name and phase.
pub fn pod_info(
    meta: &ObjectMeta,
    scheduler: Option<&str>,
    node_name: Option<&str>,
    phase: Option<&str>,
) -> PodInfo {
    let empty = BTreeMap::new();
    let labels = meta.labels.as_ref().unwrap_or(&empty);
    let annotations = meta.annotations.as_ref().unwrap_or(&empty);
    PodInfo {
        uid: meta.uid.clone().unwrap_or_default(),
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        node_name: node_name.filter(|n| !n.is_empty()).map(String::from),
        terminal: matches!(phase, Some("Succeeded" | "Failed")),
        demand: GpuDemand::from_labels(labels).map_err(|e| e.to_string()),
        allocation: Allocation::from_annotations(annotations).map_err(|e| e.to_string()),
        resource_version: meta
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok()),
        kubeshare: is_kubeshare_pod(scheduler, labels),
    }
}

impl WirePod {
    pub fn info(&self) -> PodInfo {
        pod_info(
            &self.metadata,
            self.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()),
            self.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            self.status.as_ref().and_then(|s| s.phase.as_deref()),
        )
    }
}

pub fn pod_info_of(p: &Pod) -> PodInfo {
    pod_info(
        &p.metadata,
        p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()),
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
    )
}

/// The node's GPU inventory: `Ok(None)` when it publishes none.
pub fn node_inventory(n: &Node) -> Result<Option<NodeInventory>, String> {
    match n
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(INVENTORY_ANNOTATION))
    {
        None => Ok(None),
        Some(json) => NodeInventory::parse(json)
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_pod_reads_labels_annotations_and_phase() {
        let j = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "labels": {"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"},
                "annotations": {"sharedgpu/gpu_uuid": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",
                    "sharedgpu/gpu_mem": "100", "sharedgpu/gpu_model": "M", "sharedgpu/node": "n1",
                    "sharedgpu/granted_request": "0.5", "sharedgpu/granted_limit": "1.0",
                    "sharedgpu/record_version": "1"},
                "resourceVersion": "42"},
            "spec": {"schedulerName": "kubeshare-scheduler", "nodeName": "n1",
                "containers": [{"name": "c", "image": "x"}]},
            "status": {"phase": "Succeeded"}
        });
        let p: WirePod = serde_json::from_value(j).unwrap();
        let i = p.info();
        assert_eq!(i.uid, "u1");
        assert_eq!(i.node_name.as_deref(), Some("n1"));
        assert!(i.terminal);
        let d = i.demand.unwrap().unwrap();
        assert_eq!(d.request_per_gpu().get(), 500);
        assert_eq!(i.allocation.unwrap().unwrap().gpu_mem, 100);
        assert_eq!(i.resource_version, Some(42));
        assert!(i.kubeshare);
    }

    #[test]
    fn bad_labels_and_annotations_are_errors_not_panics() {
        let j = serde_json::json!({"metadata": {"name": "p",
            "labels": {"sharedgpu/gpu_request": "lots"},
            "annotations": {"sharedgpu/gpu_uuid": "nope"}}});
        let i: PodInfo = serde_json::from_value::<WirePod>(j).unwrap().info();
        assert!(i.demand.unwrap_err().contains("gpu_"));
        assert!(i.allocation.is_err());
    }
}
