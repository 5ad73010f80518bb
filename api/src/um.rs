//! Unified-memory mode (Gemini_UM): the labels that opt a pod in, and what its two memory
//! figures are. In this mode the hook turns the pod's device allocations into managed memory,
//! so the pod may hold more than its GPU-resident share: `gpu_mem` becomes the share of the
//! GPU's memory the pod is expected to keep resident (what the extender books against the
//! GPU, with overcommit), and `gpu_mem_managed` the ceiling of everything it may allocate
//! (what gem-schd enforces, with `CUDA_ERROR_OUT_OF_MEMORY` beyond it). The ceiling is never
//! unbounded: by default it is [`DEFAULT_MANAGED_FACTOR`] × the resident share, and at most
//! [`MAX_MANAGED_FACTOR`] × it.

use std::collections::BTreeMap;

use crate::annotations::AllocationError;
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

/// Allocation-record annotation of a unified-mode pod: its GPU-resident share per GPU, bytes
/// (canonical decimal), written by the extender beside the record. In unified mode the
/// record's `sharedgpu/gpu_mem` is the managed **ceiling** (what gem-schd enforces, so the
/// node daemon writes it unchanged into the resource-config); this one is what the extender
/// books against the GPU and the hook's prefetch budget (`KUBESHARE_UM_RESIDENT_BYTES`, set
/// from it through the downward API). Absent: a device-mode pod.
pub const GPU_MEM_RESIDENT: &str = "sharedgpu/gpu_mem_resident";

/// The resident share in a pod's record: `Ok(None)` for a device-mode pod, `Err` when the
/// annotation is not in the form the extender writes or exceeds the ceiling (`gpu_mem`).
pub fn resident_from_annotations(
    annotations: &std::collections::BTreeMap<String, String>,
    ceiling: u64,
) -> Result<Option<u64>, AllocationError> {
    let Some(v) = annotations.get(GPU_MEM_RESIDENT) else {
        return Ok(None);
    };
    let invalid = |why| AllocationError::Invalid {
        key: GPU_MEM_RESIDENT,
        value: v.clone(),
        why,
    };
    let r: u64 = v
        .parse()
        .ok()
        .filter(|r: &u64| r.to_string() == *v)
        .ok_or_else(|| invalid("not a byte count"))?;
    if r == 0 || r > ceiling {
        return Err(invalid(
            "the resident share must be above 0 and at most the record's gpu_mem (the ceiling)",
        ));
    }
    Ok(Some(r))
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn resident_annotation() {
        let m = |v: &str| BTreeMap::from([(GPU_MEM_RESIDENT.to_string(), v.to_string())]);
        assert_eq!(resident_from_annotations(&BTreeMap::new(), 10), Ok(None));
        assert_eq!(resident_from_annotations(&m("10"), 10), Ok(Some(10)));
        assert_eq!(
            resident_from_annotations(&m("18446744073709551615"), u64::MAX),
            Ok(Some(u64::MAX))
        );
        for bad in ["11", "0", "05", "1Gi", "", "-1", "18446744073709551616"] {
            let e = resident_from_annotations(&m(bad), 10).unwrap_err();
            assert!(e.to_string().contains(GPU_MEM_RESIDENT), "{bad}: {e}");
        }
    }
}
