//! The GPU inventory a node daemon publishes on its Node, as the extender reads it.
//!
//! Stored as JSON in the Node annotation [`INVENTORY_ANNOTATION`], with labels that let
//! users and selectors see GPU nodes at a glance ([`NodeInventory::node_labels`]).

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

/// Node annotation holding the inventory JSON.
pub const INVENTORY_ANNOTATION: &str = "sharedgpu/inventory";
/// Node label: `true` on nodes whose daemon runs.
pub const ENABLED_LABEL: &str = "sharedgpu/enabled";
/// Node label: the model of the node's GPUs, or `mixed`.
pub const MODEL_LABEL: &str = "sharedgpu/gpu_model";
/// Node label: how many GPUs the node has.
pub const COUNT_LABEL: &str = "sharedgpu/gpu_count";

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuInfo {
    /// NVML UUID, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// NVML index on the node.
    pub index: u32,
    /// NVML name with spaces written as `-`.
    pub model: String,
    /// Total memory, bytes.
    pub memory: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// UUIDs of the GPUs this one reaches over NVLink.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink_peers: Vec<String>,
    /// `namespace/name` of a pod the kubelet gave this GPU whole through another
    /// device plugin (NVIDIA's `nvidia.com/gpu`), as the kubelet's PodResources API
    /// tells the node daemon. The extender places no KubeShare pod on such a GPU until
    /// the field is gone (docs/device-plugin.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
}

/// All GPUs of a node, in index order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeInventory {
    pub gpus: Vec<GpuInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    #[error("inventory is not valid JSON of the expected shape: {0}")]
    Json(String),
    #[error("GPU {index}: {why}")]
    Gpu { index: usize, why: String },
}

/// `GPU-` or `MIG-` followed by a hex UUID in 8-4-4-4-12 form.
pub fn is_valid_gpu_uuid(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("GPU-").or_else(|| s.strip_prefix("MIG-")) else {
        return false;
    };
    let groups: Vec<&str> = rest.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A model name as NVML spells it, spaces turned into `-` (`NVIDIA H100 80GB HBM3`).
pub fn model_from_nvml_name(name: &str) -> String {
    name.split_whitespace().collect::<Vec<_>>().join("-")
}

impl NodeInventory {
    /// Parses and validates the annotation's value.
    pub fn parse(json: &str) -> Result<NodeInventory, InventoryError> {
        let inv: NodeInventory =
            serde_json::from_str(json).map_err(|e| InventoryError::Json(e.to_string()))?;
        inv.validate()?;
        Ok(inv)
    }

    pub fn validate(&self) -> Result<(), InventoryError> {
        let mut uuids = HashSet::new();
        let mut indexes = HashSet::new();
        for (i, g) in self.gpus.iter().enumerate() {
            let fail = |why: String| InventoryError::Gpu { index: i, why };
            if !is_valid_gpu_uuid(&g.uuid) {
                return Err(fail(format!("{:?} is not a GPU UUID", g.uuid)));
            }
            if !uuids.insert(g.uuid.as_str()) {
                return Err(fail(format!("UUID {} appears twice", g.uuid)));
            }
            if !indexes.insert(g.index) {
                return Err(fail(format!("index {} appears twice", g.index)));
            }
            if g.model.is_empty() || g.model.chars().any(char::is_whitespace) {
                return Err(fail(format!(
                    "model {:?} must be non-empty with spaces written as '-'",
                    g.model
                )));
            }
            if g.memory == 0 {
                return Err(fail("memory must be greater than 0".into()));
            }
        }
        Ok(())
    }

    /// The annotation's value.
    pub fn to_json(&self) -> String {
        // Serializing plain structs of strings and integers cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn gpu(&self, uuid: &str) -> Option<&GpuInfo> {
        self.gpus.iter().find(|g| g.uuid == uuid)
    }

    /// Labels for the Node: enabled, count and model (`mixed` when models differ).
    pub fn node_labels(&self) -> BTreeMap<String, String> {
        let mut models: Vec<&str> = self.gpus.iter().map(|g| g.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        let model = match models.as_slice() {
            [] => None,
            [one] => Some(one.to_string()),
            _ => Some("mixed".to_string()),
        };
        let mut l = BTreeMap::from([
            (ENABLED_LABEL.to_string(), "true".to_string()),
            (COUNT_LABEL.to_string(), self.gpus.len().to_string()),
        ]);
        if let Some(m) = model {
            // A label value is at most 63 characters.
            l.insert(MODEL_LABEL.to_string(), m.chars().take(63).collect());
        }
        l
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u32) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"),
            index: i,
            model: "NVIDIA-H100-80GB-HBM3".into(),
            memory: 80 << 30,
            numa_node: Some(0),
            nvlink_peers: vec![],
            held_by: None,
        }
    }

    #[test]
    fn round_trip_and_validation() {
        let inv = NodeInventory {
            gpus: vec![gpu(0), gpu(1)],
        };
        assert_eq!(NodeInventory::parse(&inv.to_json()).unwrap(), inv);
        let dup = NodeInventory {
            gpus: vec![gpu(0), gpu(0)],
        };
        assert_eq!(
            NodeInventory::parse(&dup.to_json())
                .unwrap_err()
                .to_string(),
            "GPU 1: UUID GPU-00000000-aaaa-bbbb-cccc-dddddddddddd appears twice"
        );
        assert!(NodeInventory::parse("{\"gpus\": 3}").is_err());
        assert_eq!(inv.node_labels()[MODEL_LABEL], "NVIDIA-H100-80GB-HBM3");
        assert_eq!(
            model_from_nvml_name("NVIDIA H100 80GB HBM3"),
            "NVIDIA-H100-80GB-HBM3"
        );
        assert!(is_valid_gpu_uuid(
            "GPU-8d9e5c3a-1b2c-4d5e-8f90-0123456789ab"
        ));
        assert!(!is_valid_gpu_uuid(
            "GPU-8d9e5c3a-1b2c-4d5e-8f90-0123456789a"
        ));
    }
}
