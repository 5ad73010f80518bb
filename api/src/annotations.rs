//! The allocation annotations the extender writes on a pod at bind, before the Binding.
//!
//! They are the single source of truth for who holds what: the extender rebuilds its
//! books from them after a restart, and the node daemon writes its configs from them.

use std::collections::BTreeMap;

use crate::inventory::is_valid_gpu_uuid;

/// Comma-separated GPU UUIDs, in device order. Also what `NVIDIA_VISIBLE_DEVICES`
/// resolves to through the downward API.
pub const GPU_UUID: &str = "sharedgpu/gpu_uuid";
/// Effective memory cap per GPU, bytes.
pub const GPU_MEM: &str = "sharedgpu/gpu_mem";
/// Model of the chosen GPU(s).
pub const GPU_MODEL: &str = "sharedgpu/gpu_model";
/// The node the allocation was made on (guards against a pod bound elsewhere).
pub const NODE: &str = "sharedgpu/node";

/// What a pod was given.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Allocation {
    pub node: String,
    pub gpu_uuids: Vec<String>,
    pub gpu_mem: u64,
    pub gpu_model: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    #[error("annotation {key} is missing")]
    Missing { key: &'static str },
    #[error("annotation {key}={value:?}: {why}")]
    Invalid {
        key: &'static str,
        value: String,
        why: &'static str,
    },
}

impl Allocation {
    pub fn to_annotations(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (NODE.to_string(), self.node.clone()),
            (GPU_UUID.to_string(), self.gpu_uuids.join(",")),
            (GPU_MEM.to_string(), self.gpu_mem.to_string()),
            (GPU_MODEL.to_string(), self.gpu_model.clone()),
        ])
    }

    /// `Ok(None)` when the pod has no allocation yet (no `gpu_uuid` annotation).
    pub fn from_annotations(
        annotations: &BTreeMap<String, String>,
    ) -> Result<Option<Allocation>, AllocationError> {
        let Some(uuids) = annotations.get(GPU_UUID) else {
            return Ok(None);
        };
        let get = |key: &'static str| annotations.get(key).ok_or(AllocationError::Missing { key });
        // Tolerate KubeShare 2.0's trailing comma.
        let gpu_uuids: Vec<String> = uuids
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let bad_uuids = |why| AllocationError::Invalid {
            key: GPU_UUID,
            value: uuids.clone(),
            why,
        };
        if gpu_uuids.is_empty() {
            return Err(bad_uuids("no GPU UUID"));
        }
        if !gpu_uuids.iter().all(|u| is_valid_gpu_uuid(u)) {
            return Err(bad_uuids("not a list of GPU UUIDs"));
        }
        let mem_s = get(GPU_MEM)?;
        let gpu_mem = mem_s.parse().map_err(|_| AllocationError::Invalid {
            key: GPU_MEM,
            value: mem_s.clone(),
            why: "not a byte count",
        })?;
        Ok(Some(Allocation {
            node: get(NODE)?.clone(),
            gpu_uuids,
            gpu_mem,
            gpu_model: get(GPU_MODEL)?.clone(),
        }))
    }
}
