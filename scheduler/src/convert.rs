//! Kubernetes objects to what placement needs: pure parsing, no I/O.
//!
//! Labels go through `kubeshare_api::GpuDemand::from_labels` (the one label
//! parser), annotations through `kubeshare_api::Allocation::from_annotations`.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Resource;
use kubeshare_api::inventory::{INVENTORY_ANNOTATION, InventoryError};
use kubeshare_api::{Allocation, GpuDemand, NodeInventory, is_kubeshare_pod};
use serde::{Deserialize, Deserializer};

use crate::placement::{PREEMPTION_ANNOTATION, PodInfo, PreemptRecord};

/// The parts of a v1.Pod the extender reads; unknown fields are skipped, so a
/// filter request, a watch event or a GET does not pay for decoding whole
/// container specs and managed fields (decoding whole Pods was the largest
/// part of the extender's CPU per pod). It is the extender's `Pod` type
/// for the API too (`Api<WirePod>`, same URLs as `Api<Pod>`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePod {
    #[serde(default, deserialize_with = "wire_meta")]
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
    #[serde(default)]
    pub priority: Option<i32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct WirePodStatus {
    #[serde(default)]
    pub phase: Option<String>,
}

/// The metadata fields the extender reads. `managedFields`, the largest part of
/// a pod's metadata once a few writers have touched it, is skipped unparsed.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
}

fn wire_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<WireMeta>::deserialize(d)?;
    Ok(m.map(|m| ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        labels: m.labels,
        annotations: m.annotations,
        deletion_timestamp: m.deletion_timestamp,
        ..ObjectMeta::default()
    })
    .unwrap_or_default())
}

/// A Node as the extender watches it: metadata only. The inventory is an
/// annotation, so the API is asked for `PartialObjectMetadata` and sends none of
/// the status that kubelets (or kwok) rewrite at every heartbeat; managed fields
/// are skipped unparsed (decoding whole Nodes took an eighth of the extender's
/// CPU in a backlog).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct WireNode {
    #[serde(default, deserialize_with = "wire_meta")]
    pub metadata: ObjectMeta,
}

/// Reads `$wire` from the API where `$kind` is (same URLs; the watcher needs it).
macro_rules! read_as {
    ($wire:ty, $kind:ty, metadata_only: $meta:expr) => {
        impl Resource for $wire {
            type DynamicType = ();
            type Scope = <$kind as Resource>::Scope;

            fn kind(dt: &()) -> Cow<'_, str> {
                <$kind>::kind(dt)
            }
            fn group(dt: &()) -> Cow<'_, str> {
                <$kind>::group(dt)
            }
            fn version(dt: &()) -> Cow<'_, str> {
                <$kind>::version(dt)
            }
            fn plural(dt: &()) -> Cow<'_, str> {
                <$kind>::plural(dt)
            }
            fn metadata_api() -> bool {
                $meta
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
read_as!(WirePod, Pod, metadata_only: false);
read_as!(WireNode, Node, metadata_only: true);

impl WirePod {
    /// What placement needs of the pod: its identity, demand (labels), record
    /// (annotations), node and whether it finished.
    pub fn info(&self) -> PodInfo {
        let meta = &self.metadata;
        let spec = self.spec.as_ref();
        let phase = self.status.as_ref().and_then(|s| s.phase.as_deref());
        let empty = BTreeMap::new();
        let labels = meta.labels.as_ref().unwrap_or(&empty);
        let annotations = meta.annotations.as_ref().unwrap_or(&empty);
        PodInfo {
            uid: meta.uid.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            node_name: spec
                .and_then(|s| s.node_name.as_deref())
                .filter(|n| !n.is_empty())
                .map(String::from),
            terminal: matches!(phase, Some("Succeeded" | "Failed")),
            demand: GpuDemand::from_labels(labels).map_err(|e| e.to_string()),
            allocation: Allocation::from_annotations(annotations).map_err(|e| e.to_string()),
            resource_version: meta
                .resource_version
                .as_deref()
                .and_then(|v| v.parse().ok()),
            kubeshare: is_kubeshare_pod(spec.and_then(|s| s.scheduler_name.as_deref()), labels),
            pod_priority: spec.and_then(|s| s.priority).unwrap_or(0),
            terminating: meta.deletion_timestamp.is_some(),
            preemption: annotations
                .get(PREEMPTION_ANNOTATION)
                .and_then(|v| PreemptRecord::from_annotation(v)),
        }
    }
}

/// The node's GPU inventory, from its metadata (the extender watches nodes'
/// metadata only): `Ok(None)` when it publishes none.
pub fn node_inventory(meta: &ObjectMeta) -> Result<Option<NodeInventory>, InventoryError> {
    match meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(INVENTORY_ANNOTATION))
    {
        None => Ok(None),
        Some(json) => NodeInventory::parse(json).map(Some),
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
        assert!(!i.terminating);
        assert_eq!(i.preemption, None);
    }

    #[test]
    fn wire_pod_reads_deletion_and_the_preemption_record() {
        let rec = PreemptRecord {
            node: "n1".into(),
            gpus: vec![0],
            victims: vec!["v1".into(), "v2".into()],
            at: 1_700_000_000_000,
        };
        let j = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "deletionTimestamp": "2026-01-01T00:00:00Z",
                "annotations": {PREEMPTION_ANNOTATION: rec.to_annotation()}},
        });
        let i = serde_json::from_value::<WirePod>(j).unwrap().info();
        assert!(i.terminating);
        assert_eq!(i.preemption, Some(rec));
        // A record that does not parse is no record.
        let j = serde_json::json!({"metadata": {"uid": "u2",
            "annotations": {PREEMPTION_ANNOTATION: "{\"node\": 3}"}}});
        assert_eq!(
            serde_json::from_value::<WirePod>(j)
                .unwrap()
                .info()
                .preemption,
            None
        );
    }

    #[test]
    fn wire_pod_skips_managed_fields_and_reads_what_the_api_sends() {
        // A pod as the API sends it: managed fields, owner references, a null
        // metadata field, a container spec; only the read fields are kept.
        let j = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u2", "resourceVersion": "7",
                "generateName": null, "creationTimestamp": "2026-11-27T00:00:00Z",
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "j", "uid": "o"}],
                "labels": {"sharedgpu/gpu_request": "0.25", "sharedgpu/gpu_limit": "0.5"},
                "managedFields": [{"manager": "m", "operation": "Update", "apiVersion": "v1",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:containers": {"k:{\"name\":\"c\"}": {}}}}}]},
            "spec": {"schedulerName": "kubeshare-scheduler",
                "containers": [{"name": "c", "image": "x", "resources": {"limits": {"kubeshare.io/gpu-pod": "0"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]}
        });
        let p: WirePod = serde_json::from_value(j).unwrap();
        assert!(p.metadata.managed_fields.is_none() && p.metadata.owner_references.is_none());
        let i = p.info();
        assert_eq!(
            (i.uid.as_str(), i.namespace.as_str(), i.name.as_str()),
            ("u2", "ns", "p")
        );
        assert_eq!(i.resource_version, Some(7));
        assert!(i.kubeshare && !i.terminal && i.node_name.is_none());
        assert_eq!(i.demand.unwrap().unwrap().request_per_gpu().get(), 250);
        // Null or missing metadata is an empty one, not an error.
        let p: WirePod = serde_json::from_str(r#"{"metadata": null}"#).unwrap();
        assert_eq!(p.info().uid, "");
        // A wrongly typed field it reads is an error, not a panic.
        assert!(serde_json::from_str::<WirePod>(r#"{"metadata": {"labels": [1]}}"#).is_err());
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
