//! Unified-memory mode (Gemini_UM): the labels that opt a pod in, and what its two memory
//! figures are. In this mode the hook turns the pod's device allocations into managed memory,
//! so the pod may hold more than its GPU-resident share: `gpu_mem` becomes the share of the
//! GPU's memory the pod is expected to keep resident (what the extender books against the
//! GPU, with overcommit), and `gpu_mem_managed` the ceiling of everything it may allocate
//! (what gem-schd enforces, with `CUDA_ERROR_OUT_OF_MEMORY` beyond it). The ceiling is never
//! unbounded: by default it is [`DEFAULT_MANAGED_FACTOR`] × the resident share, and at most
//! [`MAX_MANAGED_FACTOR`] × it.

use std::collections::BTreeMap;

use crate::labels::{GPU_MEM, LabelError, Rule};
use crate::quantity::parse_bytes;

/// `device` (default: allocations are ordinary device memory) or `unified`.
pub const GPU_MEM_MODE: &str = "sharedgpu/gpu_mem_mode";
/// Managed-memory ceiling per GPU (unified mode only), a Kubernetes quantity.
pub const GPU_MEM_MANAGED: &str = "sharedgpu/gpu_mem_managed";

/// Default managed ceiling, as a multiple of the resident share.
pub const DEFAULT_MANAGED_FACTOR: u64 = 2;
/// Largest managed ceiling, as a multiple of the resident share (page migration beyond a
/// few times the resident set is thrashing, not sharing).
pub const MAX_MANAGED_FACTOR: u64 = 8;

/// Environment variable the webhook sets in a unified-mode pod's containers (value `1`):
/// the hook's switch (docs/um.md).
pub const HOOK_UM_ENV: &str = "KUBESHARE_HOOK_UM";
/// Environment variable with the pod's resident share in bytes (from the allocation
/// record, via the downward API): the most the hook prefetches at a token grant.
pub const HOOK_UM_RESIDENT_ENV: &str = "KUBESHARE_UM_RESIDENT_BYTES";

/// A pod's unified-memory request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UmSpec {
    /// The managed ceiling written in `gpu_mem_managed`; `None`: the default multiple.
    pub managed: Option<u64>,
}

impl UmSpec {
    /// The managed ceiling for a resident share of `resident` bytes.
    pub fn ceiling(&self, resident: u64) -> u64 {
        match self.managed {
            Some(m) => m.clamp(
                resident,
                resident.saturating_mul(MAX_MANAGED_FACTOR).max(resident),
            ),
            None => resident.saturating_mul(DEFAULT_MANAGED_FACTOR),
        }
    }
}

fn invalid(label: &str, value: &str, rule: Rule) -> LabelError {
    LabelError::Invalid {
        label: label.to_string(),
        value: value.to_string(),
        rule,
    }
}

/// Parses the unified-memory labels. `whole`: the pod asks for whole GPUs (no hook, so no
/// unified mode); `gpu_mem`: its `gpu_mem` label, parsed, when written.
pub(crate) fn parse(
    labels: &BTreeMap<String, String>,
    whole: bool,
    gpu_mem: Option<u64>,
) -> Result<Option<UmSpec>, LabelError> {
    let get = |k: &str| labels.get(k).map(String::as_str);
    let unified = match get(GPU_MEM_MODE) {
        None | Some("device") => false,
        Some("unified") => true,
        Some(v) => return Err(invalid(GPU_MEM_MODE, v, Rule::MemModeName)),
    };
    if unified && whole {
        return Err(invalid(GPU_MEM_MODE, "unified", Rule::UnifiedWithWhole));
    }
    let Some(m) = get(GPU_MEM_MANAGED) else {
        return Ok(unified.then_some(UmSpec { managed: None }));
    };
    if !unified {
        return Err(invalid(GPU_MEM_MANAGED, m, Rule::ManagedWithoutUnified));
    }
    let managed = match parse_bytes(m) {
        Ok(0) => return Err(invalid(GPU_MEM_MANAGED, m, Rule::MemoryZero)),
        Ok(b) => b,
        Err(e) => return Err(invalid(GPU_MEM_MANAGED, m, Rule::Memory(e))),
    };
    if let Some(r) = gpu_mem {
        if managed < r {
            return Err(invalid(
                GPU_MEM_MANAGED,
                m,
                Rule::ManagedBelowResident {
                    resident: labels.get(GPU_MEM).cloned().unwrap_or_default(),
                },
            ));
        }
        if managed > r.saturating_mul(MAX_MANAGED_FACTOR) {
            return Err(invalid(
                GPU_MEM_MANAGED,
                m,
                Rule::ManagedAboveFactor {
                    resident: labels.get(GPU_MEM).cloned().unwrap_or_default(),
                },
            ));
        }
    }
    Ok(Some(UmSpec {
        managed: Some(managed),
    }))
}

/// The labels that parse back to `um`.
pub(crate) fn to_labels(um: &Option<UmSpec>, put: &mut impl FnMut(&str, String)) {
    if let Some(u) = um {
        put(GPU_MEM_MODE, "unified".to_string());
        if let Some(m) = u.managed {
            put(GPU_MEM_MANAGED, m.to_string());
        }
    }
}
