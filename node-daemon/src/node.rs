//! Publishing the GPU inventory on the daemon's Node: the annotation the extender
//! reads, the labels users and selectors see, and the GPU-node taint
//! `kubeshare.io/gpu=shared:NoSchedule` that keeps pods KubeShare gives no GPU off the
//! node (the webhook adds the toleration to KubeShare pods only).
//!
//! The inventory change is a JSON merge patch that names only our keys, so other labels
//! and annotations on the Node are never touched; nothing is sent when the Node already
//! says the right thing. Taints are a list that a merge patch would replace whole, so
//! the taint is added with a JSON Patch guarded by the Node's `resourceVersion`: a
//! concurrent change to the taints makes it fail (and retry), never lose that change.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Taint;
use kubeshare_api::inventory::{COUNT_LABEL, ENABLED_LABEL, INVENTORY_ANNOTATION, MODEL_LABEL};
use kubeshare_api::{GPU_TAINT_EFFECT, GPU_TAINT_KEY, GPU_TAINT_VALUE, NodeInventory};
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

/// The JSON Patch that puts `kubeshare.io/gpu=shared:NoSchedule` on a Node whose
/// taints are `taints` at `resource_version`, or `None` when it is there already. A taint
/// with our key and effect but another value is corrected (the webhook's toleration
/// matches the value). Other taints are kept as they are.
pub fn taint_patch(resource_version: &str, taints: &[Taint]) -> Option<Value> {
    let want = json!({"key": GPU_TAINT_KEY, "value": GPU_TAINT_VALUE, "effect": GPU_TAINT_EFFECT});
    let guard =
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": resource_version});
    let ours = taints
        .iter()
        .position(|t| t.key == GPU_TAINT_KEY && t.effect == GPU_TAINT_EFFECT);
    let op = match ours {
        Some(i) if taints[i].value.as_deref() == Some(GPU_TAINT_VALUE) => return None,
        Some(i) => {
            json!({"op": "replace", "path": format!("/spec/taints/{i}/value"), "value": GPU_TAINT_VALUE})
        }
        None if taints.is_empty() => json!({"op": "add", "path": "/spec/taints", "value": [want]}),
        None => json!({"op": "add", "path": "/spec/taints/-", "value": want}),
    };
    Some(json!([guard, op]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
        Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        }
    }

    /// Applies a taint patch the way the apiserver would (json-patch semantics).
    fn apply(rv: &str, taints: &[Taint], patch: &Value) -> Result<Vec<Taint>, String> {
        let mut node = json!({"metadata": {"resourceVersion": rv}, "spec": {}});
        if !taints.is_empty() {
            node["spec"]["taints"] = serde_json::to_value(taints).map_err(|e| e.to_string())?;
        }
        let p: json_patch::Patch =
            serde_json::from_value(patch.clone()).map_err(|e| e.to_string())?;
        json_patch::patch(&mut node, &p).map_err(|e| e.to_string())?;
        serde_json::from_value(node["spec"]["taints"].clone()).map_err(|e| e.to_string())
    }

    #[test]
    fn the_gpu_taint_is_added_once_and_other_taints_are_kept() {
        let ours = taint(GPU_TAINT_KEY, Some(GPU_TAINT_VALUE), GPU_TAINT_EFFECT);
        // No taints yet.
        let p = taint_patch("7", &[]).unwrap();
        assert_eq!(apply("7", &[], &p).unwrap(), vec![ours.clone()]);
        // Beside the GPU operator's taint, which stays.
        let nvidia = taint("nvidia.com/gpu", None, "NoSchedule");
        let p = taint_patch("8", std::slice::from_ref(&nvidia)).unwrap();
        assert_eq!(
            apply("8", std::slice::from_ref(&nvidia), &p).unwrap(),
            vec![nvidia.clone(), ours.clone()]
        );
        // Already there: nothing to send.
        assert_eq!(taint_patch("9", &[nvidia.clone(), ours.clone()]), None);
        // Our key with the wrong value is corrected in place.
        let wrong = taint(GPU_TAINT_KEY, Some("other"), GPU_TAINT_EFFECT);
        let p = taint_patch("10", &[nvidia.clone(), wrong.clone()]).unwrap();
        assert_eq!(
            apply("10", &[nvidia.clone(), wrong], &p).unwrap(),
            vec![nvidia.clone(), ours.clone()]
        );
        // Our key with another effect is someone else's taint: ours is added beside it.
        let exec = taint(GPU_TAINT_KEY, None, "NoExecute");
        let p = taint_patch("11", std::slice::from_ref(&exec)).unwrap();
        assert_eq!(
            apply("11", std::slice::from_ref(&exec), &p).unwrap(),
            vec![exec, ours]
        );
        // The Node changed since it was read: the patch fails instead of clobbering.
        let p = taint_patch("12", &[]).unwrap();
        assert!(apply("13", std::slice::from_ref(&nvidia), &p).is_err());
    }

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
                    held_by: None,
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
