//! The allocation record: the `sharedgpu/*` annotations the extender writes on a pod
//! at bind, in the same write as the Binding (a `pods/binding` POST copies the
//! Binding's `metadata.annotations` onto the pod).
//!
//! The record is the single source of truth for who holds what: the extender rebuilds
//! its books from it after a restart and the node daemon writes its configs from it;
//! neither reads the labels of a bound pod. So it carries everything the node side
//! needs, the *granted* share included, and a version of its format. Parsing is
//! strict (canonical forms only): a record that was not written by the extender is
//! an error, never a guess.

use std::collections::BTreeMap;

use crate::Milli;
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
/// The granted guaranteed share per GPU (`0.5`), or the number of whole GPUs (`2`).
pub const GRANTED_REQUEST: &str = "sharedgpu/granted_request";
/// The granted ceiling per GPU (`1.0`), or the number of whole GPUs (`2`).
pub const GRANTED_LIMIT: &str = "sharedgpu/granted_limit";
/// The version of the record's format.
pub const RECORD_VERSION: &str = "sharedgpu/record_version";
/// The record format this crate writes and reads.
pub const CURRENT_RECORD_VERSION: u32 = 1;

/// Every key of the record, e.g. to remove it or to guard it at admission.
pub const RECORD_KEYS: [&str; 7] = [
    NODE,
    GPU_UUID,
    GPU_MEM,
    GPU_MODEL,
    GRANTED_REQUEST,
    GRANTED_LIMIT,
    RECORD_VERSION,
];

/// The share a pod was granted on each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Granted {
    /// Time-sliced: guaranteed `request`, at most `limit` of each GPU.
    Fraction { request: Milli, limit: Milli },
    /// Whole GPUs, exclusively (no time-slicing, no hook).
    Whole,
}

impl Granted {
    /// The guaranteed share booked on each GPU (a whole GPU is 1000).
    pub fn request_per_gpu(self) -> Milli {
        match self {
            Granted::Fraction { request, .. } => request,
            Granted::Whole => Milli::ONE,
        }
    }

    /// The ceiling on each GPU.
    pub fn limit_per_gpu(self) -> Milli {
        match self {
            Granted::Fraction { limit, .. } => limit,
            Granted::Whole => Milli::ONE,
        }
    }

    pub fn is_whole(self) -> bool {
        matches!(self, Granted::Whole)
    }
}

/// What a pod was given.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Allocation {
    pub node: String,
    pub gpu_uuids: Vec<String>,
    pub gpu_mem: u64,
    pub gpu_model: String,
    pub granted: Granted,
    /// Unified-memory mode (docs/um.md): the GPU-resident share per GPU, booked against the
    /// GPU; `gpu_mem` is then the managed ceiling gem-schd enforces. `None`: device mode.
    pub gpu_mem_resident: Option<u64>,
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

fn invalid(key: &'static str, value: &str, why: &'static str) -> AllocationError {
    AllocationError::Invalid {
        key,
        value: value.to_string(),
        why,
    }
}

/// A share in its canonical form only (`0.5`, `1.0`): what [`Milli`]'s `Display` writes.
fn canonical_milli(key: &'static str, s: &str) -> Result<Milli, AllocationError> {
    match Milli::parse(s) {
        Ok(m) if m.to_string() == s => Ok(m),
        _ => Err(invalid(
            key,
            s,
            "not a share written by the extender (0.0 to 1.0, e.g. 0.5)",
        )),
    }
}

/// A decimal integer in canonical form (no sign, no leading zeros, no spaces).
fn canonical_u64(s: &str) -> Option<u64> {
    let v: u64 = s.parse().ok()?;
    (v.to_string() == s).then_some(v)
}

impl Allocation {
    pub fn to_annotations(&self) -> BTreeMap<String, String> {
        let (request, limit) = match self.granted {
            Granted::Fraction { request, limit } => (request.to_string(), limit.to_string()),
            Granted::Whole => {
                let n = self.gpu_uuids.len().to_string();
                (n.clone(), n)
            }
        };
        let mut m = BTreeMap::from([
            (NODE.to_string(), self.node.clone()),
            (GPU_UUID.to_string(), self.gpu_uuids.join(",")),
            (GPU_MEM.to_string(), self.gpu_mem.to_string()),
            (GPU_MODEL.to_string(), self.gpu_model.clone()),
            (GRANTED_REQUEST.to_string(), request),
            (GRANTED_LIMIT.to_string(), limit),
            (
                RECORD_VERSION.to_string(),
                CURRENT_RECORD_VERSION.to_string(),
            ),
        ]);
        if let Some(r) = self.gpu_mem_resident {
            m.insert(crate::um::GPU_MEM_RESIDENT.to_string(), r.to_string());
        }
        m
    }

    /// `Ok(None)` when the pod has no record (no `sharedgpu/*` record annotation at
    /// all); `Err` when any part of it is missing or not in the form the extender writes.
    pub fn from_annotations(
        annotations: &BTreeMap<String, String>,
    ) -> Result<Option<Allocation>, AllocationError> {
        if !RECORD_KEYS
            .iter()
            .chain([&crate::um::GPU_MEM_RESIDENT])
            .any(|k| annotations.contains_key(*k))
        {
            return Ok(None);
        }
        let get = |key: &'static str| {
            annotations
                .get(key)
                .map(String::as_str)
                .ok_or(AllocationError::Missing { key })
        };
        let version = get(RECORD_VERSION)?;
        if canonical_u64(version) != Some(u64::from(CURRENT_RECORD_VERSION)) {
            return Err(invalid(
                RECORD_VERSION,
                version,
                "unknown record version (this build reads version 1)",
            ));
        }
        let uuids = get(GPU_UUID)?;
        let gpu_uuids: Vec<String> = uuids.split(',').map(String::from).collect();
        if !gpu_uuids.iter().all(|u| is_valid_gpu_uuid(u)) {
            return Err(invalid(GPU_UUID, uuids, "not a list of GPU UUIDs"));
        }
        let mut seen = std::collections::BTreeSet::new();
        if !gpu_uuids.iter().all(|u| seen.insert(u)) {
            return Err(invalid(GPU_UUID, uuids, "a GPU is listed twice"));
        }
        let mem_s = get(GPU_MEM)?;
        let gpu_mem =
            canonical_u64(mem_s).ok_or_else(|| invalid(GPU_MEM, mem_s, "not a byte count"))?;
        let node = get(NODE)?;
        if node.is_empty() {
            return Err(invalid(NODE, node, "empty node name"));
        }
        let req_s = get(GRANTED_REQUEST)?;
        let lim_s = get(GRANTED_LIMIT)?;
        let granted = if req_s.contains('.') {
            let request = canonical_milli(GRANTED_REQUEST, req_s)?;
            let limit = canonical_milli(GRANTED_LIMIT, lim_s)?;
            if limit < request {
                return Err(invalid(GRANTED_LIMIT, lim_s, "below the granted request"));
            }
            if limit == Milli::ZERO {
                return Err(invalid(GRANTED_LIMIT, lim_s, "a zero limit"));
            }
            Granted::Fraction { request, limit }
        } else {
            let n = gpu_uuids.len() as u64;
            if canonical_u64(req_s) != Some(n) || n < 2 {
                return Err(invalid(
                    GRANTED_REQUEST,
                    req_s,
                    "a whole-GPU grant must be the number of GPU UUIDs (2 or more)",
                ));
            }
            if lim_s != req_s {
                return Err(invalid(
                    GRANTED_LIMIT,
                    lim_s,
                    "a whole-GPU grant has limit = request",
                ));
            }
            Granted::Whole
        };
        let gpu_mem_resident = crate::um::resident_from_annotations(annotations, gpu_mem)?;
        if let (Some(r), Granted::Whole) = (gpu_mem_resident, granted) {
            return Err(invalid(
                crate::um::GPU_MEM_RESIDENT,
                &r.to_string(),
                "whole GPUs are never in unified-memory mode",
            ));
        }
        Ok(Some(Allocation {
            node: node.to_string(),
            gpu_uuids,
            gpu_mem,
            gpu_model: get(GPU_MODEL)?.to_string(),
            granted,
            gpu_mem_resident,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(i: u32) -> String {
        format!("GPU-{i:08x}-0000-0000-0000-000000000000")
    }

    fn half() -> Allocation {
        Allocation {
            node: "n1".into(),
            gpu_uuids: vec![u(0)],
            gpu_mem: 1 << 30,
            gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
            granted: Granted::Fraction {
                request: Milli::new(500).unwrap(),
                limit: Milli::ONE,
            },
            gpu_mem_resident: None,
        }
    }

    #[test]
    fn round_trips_fractions_and_whole_gpus() {
        let a = half();
        let m = a.to_annotations();
        assert_eq!(m[GRANTED_REQUEST], "0.5");
        assert_eq!(m[GRANTED_LIMIT], "1.0");
        assert_eq!(m[RECORD_VERSION], "1");
        assert_eq!(Allocation::from_annotations(&m), Ok(Some(a)));
        let w = Allocation {
            gpu_uuids: vec![u(0), u(1)],
            granted: Granted::Whole,
            ..half()
        };
        let m = w.to_annotations();
        assert_eq!(m[GRANTED_REQUEST], "2");
        assert_eq!(Allocation::from_annotations(&m), Ok(Some(w)));
        assert_eq!(Allocation::from_annotations(&BTreeMap::new()), Ok(None));
    }

    /// A unified-memory record carries its resident share beside the ceiling; a resident
    /// share alone, above the ceiling or on whole GPUs is an error naming it.
    #[test]
    fn unified_records_round_trip_and_bad_ones_are_errors() {
        let um = Allocation {
            gpu_mem: 4 << 30,
            gpu_mem_resident: Some(2 << 30),
            ..half()
        };
        let m = um.to_annotations();
        assert_eq!(m[crate::um::GPU_MEM_RESIDENT], (2u64 << 30).to_string());
        assert_eq!(Allocation::from_annotations(&m), Ok(Some(um.clone())));
        let key = crate::um::GPU_MEM_RESIDENT;
        let lone = BTreeMap::from([(key.to_string(), "1".to_string())]);
        assert!(Allocation::from_annotations(&lone).is_err());
        let mut above = m.clone();
        above.insert(key.to_string(), ((4u64 << 30) + 1).to_string());
        let e = Allocation::from_annotations(&above).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
        let whole = Allocation {
            gpu_uuids: vec![u(0), u(1)],
            granted: Granted::Whole,
            ..um
        };
        let e = Allocation::from_annotations(&whole.to_annotations()).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
    }

    fn with(k: &str, v: Option<&str>) -> Result<Option<Allocation>, AllocationError> {
        let mut m = half().to_annotations();
        match v {
            Some(v) => m.insert(k.to_string(), v.to_string()),
            None => m.remove(k),
        };
        Allocation::from_annotations(&m)
    }

    /// Review finding: a tampered or unparseable record (gpu_uuid edit, u64::MAX,
    /// hand-written values) is an error naming the annotation, never a guess.
    #[test]
    fn tampered_records_are_errors() {
        for (k, v) in [
            (GPU_UUID, "nope"),
            (GPU_UUID, ""),
            (GPU_UUID, "GPU-00000000-0000-0000-0000-000000000000,"),
            (
                GPU_UUID,
                "GPU-00000000-0000-0000-0000-000000000000,GPU-00000000-0000-0000-0000-000000000000",
            ),
            (GPU_MEM, "18446744073709551616"),
            (GPU_MEM, "+5"),
            (GPU_MEM, "05"),
            (GPU_MEM, "1Gi"),
            (GRANTED_REQUEST, ".5"),
            (GRANTED_REQUEST, " 0.5"),
            (GRANTED_REQUEST, "0.50"),
            (GRANTED_REQUEST, "1.5"),
            (GRANTED_REQUEST, "1"),
            (GRANTED_REQUEST, "3"),
            (GRANTED_LIMIT, "0.25"),
            (GRANTED_LIMIT, "0.0"),
            (RECORD_VERSION, "2"),
            (RECORD_VERSION, "01"),
            (NODE, ""),
        ] {
            let e = with(k, Some(v)).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v:?}: {e}");
        }
        for k in RECORD_KEYS {
            assert_eq!(
                with(k, None),
                Err(AllocationError::Missing { key: k }),
                "{k}"
            );
        }
        // A lone legacy annotation (or a forged one) is not "no record".
        let m = BTreeMap::from([(GPU_UUID.to_string(), u(0))]);
        assert!(Allocation::from_annotations(&m).is_err());
        // u64::MAX itself is a valid byte count; adding it up is the books' problem.
        assert_eq!(
            with(GPU_MEM, Some("18446744073709551615"))
                .unwrap()
                .unwrap()
                .gpu_mem,
            u64::MAX
        );
    }
}
