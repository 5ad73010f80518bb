//! Publishing the GPU inventory on the daemon's Node: the annotation the extender
//! reads, and the labels users and selectors see.
//!
//! The change is a JSON merge patch that names only our keys, so other labels and
//! annotations on the Node are never touched; nothing is sent when the Node already
//! says the right thing.

use std::collections::BTreeMap;

use kubeshare_api::NodeInventory;
use kubeshare_api::inventory::{COUNT_LABEL, ENABLED_LABEL, INVENTORY_ANNOTATION, MODEL_LABEL};
use serde_json::{Map, Value, json};

/// The labels this daemon owns on its Node.
pub const OWNED_LABELS: [&str; 3] = [ENABLED_LABEL, COUNT_LABEL, MODEL_LABEL];

/// The merge patch that makes the Node's labels and annotations publish `inventory`,
/// or `None` when they already do.
pub fn inventory_patch(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
    inventory: &NodeInventory,
) -> Option<Value> {
    let want = inventory.node_labels();
    let mut label_patch = Map::new();
    for key in OWNED_LABELS {
        match (labels.get(key), want.get(key)) {
            (cur, Some(w)) if cur != Some(w) => {
                label_patch.insert(key.to_string(), Value::String(w.clone()));
            }
            // A label we own that no longer applies (no GPUs: no model) is removed.
            (Some(_), None) => {
                label_patch.insert(key.to_string(), Value::Null);
            }
            _ => {}
        }
    }
    let json_text = inventory.to_json();
    let mut ann_patch = Map::new();
    if annotations.get(INVENTORY_ANNOTATION) != Some(&json_text) {
        ann_patch.insert(INVENTORY_ANNOTATION.to_string(), Value::String(json_text));
    }
    if label_patch.is_empty() && ann_patch.is_empty() {
        return None;
    }
    let mut meta = Map::new();
    if !label_patch.is_empty() {
        meta.insert("labels".into(), Value::Object(label_patch));
    }
    if !ann_patch.is_empty() {
        meta.insert("annotations".into(), Value::Object(ann_patch));
    }
    Some(json!({ "metadata": meta }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;

    fn inv(models: &[&str]) -> NodeInventory {
        NodeInventory {
            gpus: models
                .iter()
                .enumerate()
                .map(|(i, m)| GpuInfo {
                    uuid: format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"),
                    index: i as u32,
                    model: m.to_string(),
                    memory: 1 << 30,
                    numa_node: None,
                    nvlink_peers: vec![],
                })
                .collect(),
        }
    }

    #[test]
    fn patch_names_only_our_keys_and_only_changes() {
        let i = inv(&["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3"]);
        let labels = BTreeMap::from([("kubernetes.io/hostname".to_string(), "n".to_string())]);
        let p = inventory_patch(&labels, &BTreeMap::new(), &i).unwrap();
        assert_eq!(
            p,
            json!({"metadata": {
                "labels": {
                    "sharedgpu/enabled": "true",
                    "sharedgpu/gpu_count": "2",
                    "sharedgpu/gpu_model": "NVIDIA-H100-80GB-HBM3",
                },
                "annotations": {"sharedgpu/inventory": i.to_json()},
            }})
        );
        // Once applied, nothing more to send.
        let mut l2 = labels.clone();
        l2.extend(i.node_labels());
        let a2 = BTreeMap::from([(INVENTORY_ANNOTATION.to_string(), i.to_json())]);
        assert_eq!(inventory_patch(&l2, &a2, &i), None);

        // Only the annotation changed (memory): only the annotation is sent.
        let mut j = i.clone();
        j.gpus[0].memory += 1;
        assert_eq!(
            inventory_patch(&l2, &a2, &j),
            Some(json!({"metadata": {"annotations": {"sharedgpu/inventory": j.to_json()}}}))
        );

        // Mixed models; then no GPUs at all: the model label is removed, not left stale.
        let mixed = inv(&["A", "B"]);
        let p = inventory_patch(&l2, &a2, &mixed).unwrap();
        assert_eq!(p["metadata"]["labels"]["sharedgpu/gpu_model"], "mixed");
        let none = inv(&[]);
        let p = inventory_patch(&l2, &a2, &none).unwrap();
        assert_eq!(p["metadata"]["labels"]["sharedgpu/gpu_model"], Value::Null);
        assert_eq!(p["metadata"]["labels"]["sharedgpu/gpu_count"], "0");
        assert!(
            p["metadata"]["labels"]
                .get("kubernetes.io/hostname")
                .is_none()
        );
    }
}
