//! Dynamic Resource Allocation (DRA, `resource.k8s.io/v1`): the names KubeShare's DRA
//! driver publishes and the opaque configuration a ResourceClaim hands it.
//!
//! With consumable capacity (KEP-5075) a GPU is one device that many claims share: each
//! claim books `compute` (thousandths of the GPU's time) and `memory` (bytes), and the
//! stock kube-scheduler keeps the sums within the device. What consumable capacity
//! cannot say — a limit above the booked share, unified-memory mode — travels as
//! [`ShareConfig`], the claim's `config[].opaque.parameters` for driver
//! [`DRIVER_NAME`]. Its values are read with the same parsers as the `sharedgpu/*`
//! labels ([`Milli`], [`parse_bytes`], [`UmSpec`]) and resolve into the same
//! [`GpuDemand`], so a claim and a labelled pod that ask for the same share mean the
//! same thing everywhere after scheduling (docs/dra.md).

use std::fmt;

use serde_json::{Map, Value};

use crate::labels::{
    GPU_LIMIT, GPU_MEM, GPU_REQUEST, GpuDemand, GpuShare, MAX_PRIORITY, PRIORITY as PRIORITY_LABEL,
    parse_priority,
};
use crate::milli::{Milli, MilliParseError};
use crate::quantity::{QuantityError, parse_bytes};
use crate::um::{GPU_MEM_MANAGED, GPU_MEM_MODE, MAX_MANAGED_FACTOR, UmSpec};

/// The driver name: ResourceSlices, the DeviceClass and opaque configs carry it.
pub const DRIVER_NAME: &str = "gpu.kubeshare.io";
/// The DeviceClass the chart installs; claims name it as `deviceClassName`.
pub const DEVICE_CLASS: &str = DRIVER_NAME;
/// `apiVersion` of [`ShareConfig`].
pub const CONFIG_API_VERSION: &str = "gpu.kubeshare.io/v1alpha1";
/// `kind` of [`ShareConfig`].
pub const CONFIG_KIND: &str = "GpuShareConfig";
/// The consumable capacity of a GPU's time, in thousandths ([`COMPUTE_UNITS`] per GPU).
pub const COMPUTE: &str = "compute";
/// The consumable capacity of a GPU's memory, in bytes.
pub const MEMORY: &str = "memory";
/// `compute` of one whole GPU: shares are counted in thousandths, as [`Milli`] counts them.
pub const COMPUTE_UNITS: u16 = 1000;

/// The node's ResourceSlice annotation naming the uid of the pod with claims bound there
/// last. The node daemon sets it so that the update wakes pods kube-scheduler refused
/// while that pod's claim counted twice (docs/dra.md, "Two claims that fill a GPU at once").
pub const ANNOTATION_CLAIM_POD_BOUND: &str = "gpu.kubeshare.io/claim-pod-bound";

/// The device attribute holding the GPU's NVML UUID (a string).
pub const ATTR_UUID: &str = "uuid";
/// Memory is booked in MiB steps: fine enough for any share, and the step NVIDIA's and
/// HAMi's drivers use.
pub const MEMORY_STEP: u64 = 1 << 20;

/// The device name of the GPU at NVML index `index` in its node's pool (the pool is
/// named after the node). The node daemon names its devices so and the extender reads
/// a claim's allocation back with [`device_index`], so both sides agree on which GPU a
/// claim holds even without the slice at hand.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The NVML index of a device named by [`device_name`]; `None` for any other name.
pub fn device_index(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("gpu-")?;
    // `gpu-01` is no name device_name writes.
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A GPU's `memory` capacity as published: its bytes rounded down to whole [`MEMORY_STEP`]s.
pub fn device_memory(gpu_memory: u64) -> u64 {
    gpu_memory / MEMORY_STEP * MEMORY_STEP
}

/// What label pods (placed by the extender) leave of one GPU for claims: the `compute`
/// and `memory` capacities the node daemon publishes for the device. `label_milli` is
/// the sum of the label pods' requests on the GPU in thousandths, `label_mem` the sum
/// of their memory bookings in bytes. A GPU the label pods fill leaves 0: no claim fits
/// beside them (the node daemon then leaves the device out of its slice). The extender books the other way round (label pods on top of the
/// claims), so the two sums together stay within one GPU.
pub fn capacity_left(gpu_memory: u64, label_milli: u32, label_mem: u64) -> (u16, u64) {
    let compute = u32::from(COMPUTE_UNITS).saturating_sub(label_milli) as u16;
    // Rounded down to a whole step: what a claim books is a whole number of steps.
    let memory = device_memory(device_memory(gpu_memory).saturating_sub(label_mem));
    (compute, memory)
}

/// The fields of [`ShareConfig`] as written in JSON.
pub mod field {
    pub const API_VERSION: &str = "apiVersion";
    pub const KIND: &str = "kind";
    pub const REQUEST: &str = "request";
    pub const LIMIT: &str = "limit";
    pub const MEMORY: &str = "memory";
    pub const MEMORY_MODE: &str = "memoryMode";
    pub const MANAGED_MEMORY: &str = "managedMemory";
    pub const PRIORITY: &str = "priority";
    /// Every field, in the order they are checked.
    pub const ALL: [&str; 8] = [
        API_VERSION,
        KIND,
        REQUEST,
        LIMIT,
        MEMORY,
        MEMORY_MODE,
        MANAGED_MEMORY,
        PRIORITY,
    ];
}

/// A claim's share of one GPU as its opaque configuration states it. Every field is
/// optional: a claim without a config books its `compute` and `memory` capacity requests
/// and is capped at them ([`ShareConfig::resolve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ShareConfig {
    /// The guaranteed share; when written it must equal the claim's `compute` request
    /// (what the scheduler booked), so the two cannot drift apart.
    pub request: Option<Milli>,
    /// The ceiling of the share (work-conserving bursts up to it); default: the request.
    pub limit: Option<Milli>,
    /// The memory cap, bytes; when written it must equal the claim's `memory` request.
    pub memory: Option<u64>,
    /// Unified-memory mode (docs/um.md); `None`: device memory.
    pub um: Option<UmSpec>,
    /// gem-schd's class, as `sharedgpu/priority`: 0 (the default) opportunistic, 1–100
    /// guaranteed ([`crate::ClientClass::of_priority`]).
    pub priority: Option<u8>,
}

/// What the scheduler allocated to a claim on one GPU (`consumedCapacity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Consumed {
    pub compute: Milli,
    pub memory: u64,
}

/// The rule a config field broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigRule {
    /// Not the string this field must hold; the string says which.
    MustBe(&'static str),
    /// A share that is not a decimal (or a JSON number) from 0 to 1 with at most 3 places.
    Share(MilliParseError),
    /// A byte count that is not a Kubernetes quantity or a whole JSON number.
    Quantity(QuantityError),
    NotStringOrNumber,
    LimitZero,
    RequestAboveLimit {
        limit: Milli,
    },
    MemoryZero,
    MemMode,
    ManagedWithoutUnified,
    ManagedBelowResident {
        resident: u64,
    },
    ManagedAboveFactor {
        resident: u64,
    },
    /// `request` differs from the `compute` the scheduler booked.
    RequestNotBooked {
        compute: Milli,
    },
    /// `limit` is below the `compute` the scheduler booked.
    LimitBelowBooked {
        compute: Milli,
    },
    /// `memory` differs from the `memory` the scheduler booked.
    MemoryNotBooked {
        memory: u64,
    },
    /// Not a whole number from 0 to 100.
    Priority,
    Unknown,
}

impl fmt::Display for ConfigRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use field::*;
        match self {
            ConfigRule::MustBe(want) => write!(f, "must be {want:?}"),
            ConfigRule::Share(MilliParseError::AboveOne) => write!(
                f,
                "must be at most 1.0 (one claim request is a share of one GPU; ask for more GPUs with the request's count)"
            ),
            ConfigRule::Share(MilliParseError::TooPrecise) => write!(
                f,
                "at most 3 decimal places are allowed (shares are counted in thousandths of a GPU)"
            ),
            ConfigRule::Share(MilliParseError::Negative) => write!(f, "must not be negative"),
            ConfigRule::Share(MilliParseError::NotANumber) => write!(
                f,
                "must be a decimal from 0 to 1.0 with at most 3 decimal places, as a string such as \"0.5\" or a number such as 0.5"
            ),
            ConfigRule::Quantity(e) => write!(f, "{e}"),
            ConfigRule::NotStringOrNumber => write!(
                f,
                "must be a string (such as \"0.5\" or \"4Gi\") or a number"
            ),
            ConfigRule::LimitZero => write!(f, "must be greater than 0"),
            ConfigRule::RequestAboveLimit { limit } => {
                write!(f, "must not exceed {LIMIT}={limit}")
            }
            ConfigRule::MemoryZero => write!(f, "must be greater than 0"),
            ConfigRule::MemMode => write!(
                f,
                "must be \"device\" (ordinary GPU memory, the default) or \"unified\" (managed memory that may exceed the GPU-resident share; docs/um.md)"
            ),
            ConfigRule::ManagedWithoutUnified => write!(
                f,
                "is the managed-memory ceiling of unified-memory mode; set {MEMORY_MODE}=\"unified\" as well, or remove it"
            ),
            ConfigRule::ManagedBelowResident { resident } => write!(
                f,
                "must be at least {MEMORY}={resident} bytes (the ceiling of all managed memory includes the GPU-resident share)"
            ),
            ConfigRule::ManagedAboveFactor { resident } => write!(
                f,
                "must be at most {MAX_MANAGED_FACTOR} × {MEMORY}={resident} bytes (beyond that the pod would spend its time migrating pages)"
            ),
            ConfigRule::RequestNotBooked { compute } => write!(
                f,
                "must equal the claim's capacity request {COMPUTE}={} (the share the scheduler booked); leave {REQUEST} out to take it from there",
                compute.get()
            ),
            ConfigRule::LimitBelowBooked { compute } => write!(
                f,
                "must be at least the claim's capacity request {COMPUTE}={} (the share the scheduler booked)",
                compute.get()
            ),
            ConfigRule::MemoryNotBooked { memory } => write!(
                f,
                "must equal the claim's capacity request {}={memory} (the bytes the scheduler booked); leave {MEMORY} out to take it from there",
                crate::dra::MEMORY
            ),
            ConfigRule::Priority => write!(
                f,
                "must be a whole number from 0 to {MAX_PRIORITY}, as a string such as \"50\" or a number such as 50 (0 = opportunistic, the default; 1-{MAX_PRIORITY} = guaranteed; as the sharedgpu/priority label)"
            ),
            ConfigRule::Unknown => write!(
                f,
                "unknown field (a typo?); known fields are {}",
                ALL.join(", ")
            ),
        }
    }
}

/// Why a claim's opaque configuration was refused. Field errors name the field and the
/// value as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("the {DRIVER_NAME} config is not JSON: {0}")]
    NotJson(String),
    #[error("the {DRIVER_NAME} config must be a JSON object")]
    NotObject,
    #[error("the {DRIVER_NAME} config needs {field}: {CONFIG_API_VERSION_OR_KIND}")]
    Missing { field: &'static str },
    #[error("{field}={value}: {rule}")]
    Invalid {
        field: String,
        value: String,
        rule: ConfigRule,
    },
}

/// The message for a missing `apiVersion` or `kind`.
const CONFIG_API_VERSION_OR_KIND: &str =
    "write apiVersion: gpu.kubeshare.io/v1alpha1 and kind: GpuShareConfig";

impl ConfigError {
    /// The field the user must fix, when one is to blame.
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } => Some(field),
            ConfigError::Missing { field } => Some(field),
            _ => None,
        }
    }
}

fn invalid(field: &str, value: &Value, rule: ConfigRule) -> ConfigError {
    let value = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    ConfigError::Invalid {
        field: field.to_string(),
        value,
        rule,
    }
}

/// A share written as a string (`"0.5"`) or a JSON number (`0.5`, `1`).
fn share(field: &str, v: &Value) -> Result<Milli, ConfigError> {
    let text = match v {
        Value::String(s) => s.clone(),
        // serde_json prints a float in its shortest round-trip form (`0.3`, not
        // `0.29999…`), so a number reads exactly as it was written.
        Value::Number(n) => n.to_string(),
        _ => return Err(invalid(field, v, ConfigRule::NotStringOrNumber)),
    };
    Milli::parse(&text).map_err(|e| invalid(field, v, ConfigRule::Share(e)))
}

/// A byte count written as a quantity string (`"4Gi"`) or a whole JSON number.
fn bytes(field: &str, v: &Value) -> Result<u64, ConfigError> {
    let b = match v {
        Value::String(s) => parse_bytes(s),
        Value::Number(n) => match n.as_u64() {
            Some(b) => Ok(b),
            None if n.as_i64().is_some_and(|i| i < 0) => Err(QuantityError::Negative),
            None => parse_bytes(&n.to_string()),
        },
        _ => return Err(invalid(field, v, ConfigRule::NotStringOrNumber)),
    }
    .map_err(|e| invalid(field, v, ConfigRule::Quantity(e)))?;
    if b == 0 {
        return Err(invalid(field, v, ConfigRule::MemoryZero));
    }
    Ok(b)
}

impl ShareConfig {
    /// Parses and validates a claim's `opaque.parameters` (JSON). Never panics.
    pub fn parse(json: &[u8]) -> Result<ShareConfig, ConfigError> {
        let v: Value =
            serde_json::from_slice(json).map_err(|e| ConfigError::NotJson(e.to_string()))?;
        ShareConfig::from_value(&v)
    }

    /// [`ShareConfig::parse`] of an already decoded JSON value.
    pub fn from_value(v: &Value) -> Result<ShareConfig, ConfigError> {
        use field::*;
        let Value::Object(o) = v else {
            return Err(ConfigError::NotObject);
        };
        if let Some(k) = o.keys().find(|k| !ALL.contains(&k.as_str())) {
            return Err(invalid(k, &o[k], ConfigRule::Unknown));
        }
        for (f, want) in [(API_VERSION, CONFIG_API_VERSION), (KIND, CONFIG_KIND)] {
            match o.get(f) {
                None => return Err(ConfigError::Missing { field: f }),
                Some(Value::String(s)) if s == want => {}
                Some(other) => return Err(invalid(f, other, ConfigRule::MustBe(want))),
            }
        }
        let request = o.get(REQUEST).map(|v| share(REQUEST, v)).transpose()?;
        let limit = o.get(LIMIT).map(|v| share(LIMIT, v)).transpose()?;
        if let Some(l) = limit
            && l == Milli::ZERO
        {
            return Err(invalid(LIMIT, &o[LIMIT], ConfigRule::LimitZero));
        }
        if let (Some(r), Some(l)) = (request, limit)
            && r > l
        {
            return Err(invalid(
                REQUEST,
                &o[REQUEST],
                ConfigRule::RequestAboveLimit { limit: l },
            ));
        }
        let memory = o.get(MEMORY).map(|v| bytes(MEMORY, v)).transpose()?;
        let unified = match o.get(MEMORY_MODE) {
            None => false,
            Some(Value::String(s)) if s == "device" => false,
            Some(Value::String(s)) if s == "unified" => true,
            Some(other) => return Err(invalid(MEMORY_MODE, other, ConfigRule::MemMode)),
        };
        let um = match o.get(MANAGED_MEMORY) {
            None => unified.then_some(UmSpec { managed: None }),
            Some(v) if !unified => {
                return Err(invalid(
                    MANAGED_MEMORY,
                    v,
                    ConfigRule::ManagedWithoutUnified,
                ));
            }
            Some(v) => {
                let managed = bytes(MANAGED_MEMORY, v)?;
                if let Some(resident) = memory {
                    if managed < resident {
                        return Err(invalid(
                            MANAGED_MEMORY,
                            v,
                            ConfigRule::ManagedBelowResident { resident },
                        ));
                    }
                    if managed > resident.saturating_mul(MAX_MANAGED_FACTOR) {
                        return Err(invalid(
                            MANAGED_MEMORY,
                            v,
                            ConfigRule::ManagedAboveFactor { resident },
                        ));
                    }
                }
                Some(UmSpec {
                    managed: Some(managed),
                })
            }
        };
        let priority = match o.get(PRIORITY) {
            None => None,
            Some(v) => {
                let text = match v {
                    Value::String(s) => Some(s.clone()),
                    Value::Number(n) => Some(n.to_string()),
                    _ => None,
                };
                Some(
                    text.as_deref()
                        .and_then(parse_priority)
                        .ok_or_else(|| invalid(PRIORITY, v, ConfigRule::Priority))?,
                )
            }
        };
        Ok(ShareConfig {
            request,
            limit,
            memory,
            um,
            priority,
        })
    }

    /// The canonical JSON (what [`ShareConfig::parse`] reads back to the same value):
    /// shares as decimal strings, byte counts as decimal strings.
    pub fn to_value(&self) -> Value {
        use field::*;
        let mut o = Map::new();
        o.insert(API_VERSION.into(), CONFIG_API_VERSION.into());
        o.insert(KIND.into(), CONFIG_KIND.into());
        if let Some(r) = self.request {
            o.insert(REQUEST.into(), r.to_string().into());
        }
        if let Some(l) = self.limit {
            o.insert(LIMIT.into(), l.to_string().into());
        }
        if let Some(m) = self.memory {
            o.insert(MEMORY.into(), m.to_string().into());
        }
        if let Some(u) = self.um {
            o.insert(MEMORY_MODE.into(), "unified".into());
            if let Some(m) = u.managed {
                o.insert(MANAGED_MEMORY.into(), m.to_string().into());
            }
        }
        if let Some(p) = self.priority {
            o.insert(PRIORITY.into(), p.to_string().into());
        }
        Value::Object(o)
    }

    /// The `sharedgpu/*` labels that state the same share (fields left out are left
    /// out): the label a field corresponds to, for documentation and for checking that
    /// both paths apply the same rules.
    pub fn to_labels(&self) -> std::collections::BTreeMap<String, String> {
        let mut l = std::collections::BTreeMap::new();
        if let Some(r) = self.request {
            l.insert(GPU_REQUEST.to_string(), r.to_string());
        }
        if let Some(v) = self.limit {
            l.insert(GPU_LIMIT.to_string(), v.to_string());
        }
        if let Some(m) = self.memory {
            l.insert(GPU_MEM.to_string(), m.to_string());
        }
        if let Some(u) = self.um {
            l.insert(GPU_MEM_MODE.to_string(), "unified".to_string());
            if let Some(m) = u.managed {
                l.insert(GPU_MEM_MANAGED.to_string(), m.to_string());
            }
        }
        // The label's default, 0, is left out, as GpuDemand::to_labels does.
        if let Some(p) = self.priority.filter(|p| *p != 0) {
            l.insert(PRIORITY_LABEL.to_string(), p.to_string());
        }
        l
    }

    /// The share one claim holds on one GPU, from what the scheduler allocated
    /// (`consumed`) and this config: request = the booked `compute`, limit = the
    /// config's limit (default: the request), memory cap = the booked `memory`. A field
    /// the config writes must agree with the booking, or the claim is refused at the
    /// node rather than run with a share the scheduler did not count.
    pub fn resolve(&self, consumed: Consumed) -> Result<GpuDemand, ConfigError> {
        use field::*;
        let shown = |v: String| Value::String(v);
        if let Some(r) = self.request
            && r != consumed.compute
        {
            return Err(invalid(
                REQUEST,
                &shown(r.to_string()),
                ConfigRule::RequestNotBooked {
                    compute: consumed.compute,
                },
            ));
        }
        let limit = self.limit.unwrap_or(consumed.compute);
        if limit < consumed.compute {
            return Err(invalid(
                LIMIT,
                &shown(limit.to_string()),
                ConfigRule::LimitBelowBooked {
                    compute: consumed.compute,
                },
            ));
        }
        if limit == Milli::ZERO {
            return Err(invalid(
                LIMIT,
                &shown(limit.to_string()),
                ConfigRule::LimitZero,
            ));
        }
        if let Some(m) = self.memory
            && m != consumed.memory
        {
            return Err(invalid(
                MEMORY,
                &shown(m.to_string()),
                ConfigRule::MemoryNotBooked {
                    memory: consumed.memory,
                },
            ));
        }
        if consumed.memory == 0 {
            return Err(invalid(MEMORY, &shown("0".into()), ConfigRule::MemoryZero));
        }
        Ok(GpuDemand {
            share: GpuShare::Fraction {
                request: consumed.compute,
                limit,
                count: 1,
            },
            mem: Some(consumed.memory),
            model: None,
            priority: self.priority.unwrap_or(0),
            group: None,
            affinity: None,
            anti_affinity: None,
            exclusion: None,
            um: self.um,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn device_names_round_trip() {
        for i in [0, 1, 7, 10, 4_000_000_000] {
            assert_eq!(device_index(&device_name(i)), Some(i));
        }
        for bad in [
            "gpu-",
            "gpu-01",
            "gpu-x",
            "gpu--1",
            "gpu-+1",
            "GPU-0",
            "mig-0",
            "gpu-99999999999",
        ] {
            assert_eq!(device_index(bad), None, "{bad}");
        }
    }

    #[test]
    fn label_pods_leave_the_rest() {
        let gib = 1u64 << 30;
        assert_eq!(capacity_left(16 * gib + 5, 0, 0), (1000, 16 * gib));
        assert_eq!(capacity_left(16 * gib, 700, 4 * gib), (300, 12 * gib));
        // Memory not in whole MiB leaves the whole MiB below.
        assert_eq!(
            capacity_left(16 * gib, 0, 1),
            (1000, 16 * gib - MEMORY_STEP)
        );
        // Overbooked by labels (a record from before): nothing left, never negative.
        assert_eq!(capacity_left(gib, 1500, 2 * gib), (0, 0));
    }

    fn cfg(extra: Value) -> Value {
        let mut v = json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND});
        if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
            o.extend(e);
        }
        v
    }

    fn m(v: u16) -> Milli {
        Milli::new(v).unwrap()
    }

    fn err(extra: Value) -> ConfigError {
        ShareConfig::from_value(&cfg(extra.clone())).expect_err(&extra.to_string())
    }

    #[test]
    fn valid_configs() {
        let c = ShareConfig::from_value(&cfg(json!({}))).unwrap();
        assert_eq!(c, ShareConfig::default());
        let c = ShareConfig::from_value(&cfg(
            json!({"request": "0.3", "limit": 0.6, "memory": "4Gi"}),
        ))
        .unwrap();
        assert_eq!(
            c,
            ShareConfig {
                request: Some(m(300)),
                limit: Some(m(600)),
                memory: Some(4 << 30),
                um: None,
                priority: None,
            }
        );
        let c = ShareConfig::from_value(&cfg(json!({"priority": "50"}))).unwrap();
        assert_eq!(c.priority, Some(50));
        let c = ShareConfig::from_value(&cfg(json!({"priority": 0}))).unwrap();
        assert_eq!(c.priority, Some(0));
        let c = ShareConfig::from_value(&cfg(json!({"limit": 1, "memory": 1073741824,
            "memoryMode": "unified", "managedMemory": "8Gi"})))
        .unwrap();
        assert_eq!(c.limit, Some(Milli::ONE));
        assert_eq!(c.memory, Some(1 << 30));
        assert_eq!(
            c.um,
            Some(UmSpec {
                managed: Some(8 << 30)
            })
        );
        let c = ShareConfig::from_value(&cfg(json!({"memoryMode": "unified"}))).unwrap();
        assert_eq!(c.um, Some(UmSpec { managed: None }));
        let c = ShareConfig::from_value(&cfg(json!({"memoryMode": "device"}))).unwrap();
        assert_eq!(c.um, None);
    }

    #[test]
    fn errors_name_the_field_and_value() {
        let cases: Vec<(Value, &str, &str)> = vec![
            (
                json!({"request": "1.5"}),
                "request",
                "request=1.5: must be at most 1.0",
            ),
            (
                json!({"request": -0.5}),
                "request",
                "request=-0.5: must not be negative",
            ),
            (
                json!({"limit": "0.1234"}),
                "limit",
                "limit=0.1234: at most 3 decimal places",
            ),
            (
                json!({"limit": ".5"}),
                "limit",
                "limit=.5: must be a decimal",
            ),
            (
                json!({"limit": true}),
                "limit",
                "limit=true: must be a string",
            ),
            (
                json!({"limit": "0"}),
                "limit",
                "limit=0: must be greater than 0",
            ),
            (
                json!({"request": "0.7", "limit": "0.5"}),
                "request",
                "request=0.7: must not exceed limit=0.5",
            ),
            (
                json!({"memory": "4GB"}),
                "memory",
                "memory=4GB: unknown suffix",
            ),
            (
                json!({"memory": "0"}),
                "memory",
                "memory=0: must be greater than 0",
            ),
            (
                json!({"memory": -1}),
                "memory",
                "memory=-1: must not be negative",
            ),
            (
                json!({"memory": 1.5}),
                "memory",
                "memory=1.5: is not a whole number",
            ),
            (
                json!({"memoryMode": "managed"}),
                "memoryMode",
                "memoryMode=managed: must be",
            ),
            (
                json!({"managedMemory": "8Gi"}),
                "managedMemory",
                "managedMemory=8Gi: is the managed-memory ceiling",
            ),
            (
                json!({"memoryMode": "unified", "memory": "4Gi", "managedMemory": "2Gi"}),
                "managedMemory",
                "must be at least memory=4294967296",
            ),
            (
                json!({"memoryMode": "unified", "memory": "1Gi", "managedMemory": "9Gi"}),
                "managedMemory",
                "must be at most 8 × memory",
            ),
            (json!({"gpu_limit": "0.5"}), "gpu_limit", "unknown field"),
            (
                json!({"priority": "101"}),
                "priority",
                "priority=101: must be a whole number from 0 to 100",
            ),
            (
                json!({"priority": -1}),
                "priority",
                "priority=-1: must be a whole number from 0 to 100",
            ),
            (
                json!({"priority": 1.5}),
                "priority",
                "priority=1.5: must be a whole number",
            ),
            (
                json!({"priority": true}),
                "priority",
                "priority=true: must be",
            ),
        ];
        for (extra, field, msg) in cases {
            let e = err(extra.clone());
            assert_eq!(e.field(), Some(field), "{extra}: {e}");
            assert!(e.to_string().contains(msg), "{extra}: {e}");
        }
        let e = ShareConfig::from_value(&json!({"kind": CONFIG_KIND})).unwrap_err();
        assert_eq!(e.field(), Some("apiVersion"), "{e}");
        let e =
            ShareConfig::from_value(&json!({"apiVersion": "v1", "kind": CONFIG_KIND})).unwrap_err();
        assert!(
            e.to_string()
                .contains("apiVersion=v1: must be \"gpu.kubeshare.io/v1alpha1\""),
            "{e}"
        );
        let e = ShareConfig::from_value(&json!({"apiVersion": CONFIG_API_VERSION})).unwrap_err();
        assert_eq!(e.field(), Some("kind"), "{e}");
        assert_eq!(ShareConfig::parse(b"[1]"), Err(ConfigError::NotObject));
        assert!(matches!(
            ShareConfig::parse(b"{"),
            Err(ConfigError::NotJson(_))
        ));
    }

    #[test]
    fn resolve_books_capacity_and_checks_agreement() {
        let consumed = Consumed {
            compute: m(300),
            memory: 4 << 30,
        };
        // No config: capped at the booking, limit = request.
        let d = ShareConfig::default().resolve(consumed).unwrap();
        assert_eq!(
            d.share,
            GpuShare::Fraction {
                request: m(300),
                limit: m(300),
                count: 1
            }
        );
        assert_eq!(d.mem, Some(4 << 30));
        // A limit above the booking: a burstable share.
        let c = ShareConfig {
            request: Some(m(300)),
            limit: Some(m(600)),
            memory: Some(4 << 30),
            um: None,
            priority: Some(7),
        };
        assert_eq!(c.resolve(consumed).unwrap().limit_per_gpu(), m(600));
        assert_eq!(c.resolve(consumed).unwrap().priority, 7);
        assert_eq!(
            ShareConfig::default().resolve(consumed).unwrap().priority,
            0
        );
        // Disagreements are refused, naming the field.
        let bad = ShareConfig {
            request: Some(m(200)),
            ..c
        };
        let e = bad.resolve(consumed).unwrap_err();
        assert_eq!(e.field(), Some("request"));
        assert!(e.to_string().contains("compute=300"), "{e}");
        let bad = ShareConfig {
            request: None,
            limit: Some(m(200)),
            ..c
        };
        assert_eq!(bad.resolve(consumed).unwrap_err().field(), Some("limit"));
        let bad = ShareConfig {
            memory: Some(1 << 30),
            ..c
        };
        assert_eq!(bad.resolve(consumed).unwrap_err().field(), Some("memory"));
        // A request of 0 with no limit has no share to run with.
        let zero = Consumed {
            compute: Milli::ZERO,
            memory: 1,
        };
        assert_eq!(
            ShareConfig::default().resolve(zero).unwrap_err().field(),
            Some("limit")
        );
    }
}
