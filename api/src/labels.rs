//! The `sharedgpu/*` pod labels, parsed once into a typed [`GpuDemand`].
//!
//! Every rule of docs/design.md's label table is enforced here, and every violation is a
//! [`LabelError`] that names the label, its value and the rule in words a user can act
//! on. The webhook shows these messages when it denies a pod; the extender and the node
//! daemon only ever see a `GpuDemand`.

use std::collections::BTreeMap;
use std::fmt;

use crate::milli::{Milli, MilliParseError, parse_decimal_milli};
use crate::quantity::{QuantityError, parse_bytes};
use crate::um::{GPU_MEM_MANAGED, GPU_MEM_MODE, MAX_MANAGED_FACTOR, UmSpec};

/// How a share must be written; appended to the "not a number" rules, because the
/// forms people try (`.5`, `+0.5`, `1.`, ` 0.5`) look like numbers but are not valid
/// label values.
const SHARE_FORM: &str = "written with digits on both sides of any decimal point and no sign or spaces, such as 0.5 (not .5, +0.5, 1. or ' 0.5', which are not valid label values either)";

pub const GPU_REQUEST: &str = "sharedgpu/gpu_request";
pub const GPU_LIMIT: &str = "sharedgpu/gpu_limit";
pub const GPU_MEM: &str = "sharedgpu/gpu_mem";
pub const GPU_COUNT: &str = "sharedgpu/gpu_count";
pub const GPU_MODEL: &str = "sharedgpu/gpu_model";
pub const PRIORITY: &str = "sharedgpu/priority";
pub const GROUP_NAME: &str = "sharedgpu/group_name";
/// KubeShare 2.0's README spelled the group label this way; accepted as an alias.
pub const POD_GROUP_NAME: &str = "sharedgpu/pod_group_name";
pub const GROUP_HEADCOUNT: &str = "sharedgpu/group_headcount";
pub const GROUP_THRESHOLD: &str = "sharedgpu/group_threshold";
pub const SCHED_AFFINITY: &str = "sharedgpu/sched_affinity";
pub const SCHED_ANTI_AFFINITY: &str = "sharedgpu/sched_anti-affinity";
pub const SCHED_EXCLUSION: &str = "sharedgpu/sched_exclusion";
/// Read by KubeShare 2.0's aggregator but ignored by its scheduler.
pub const OBSOLETE_MIN_AVAILABLE: &str = "sharedgpu/min_available";

/// Every label a pod may carry, in the order they are checked.
pub const KNOWN_LABELS: [&str; 15] = [
    GPU_REQUEST,
    GPU_LIMIT,
    GPU_MEM,
    GPU_MEM_MODE,
    GPU_MEM_MANAGED,
    GPU_COUNT,
    GPU_MODEL,
    PRIORITY,
    GROUP_NAME,
    POD_GROUP_NAME,
    GROUP_HEADCOUNT,
    GROUP_THRESHOLD,
    SCHED_AFFINITY,
    SCHED_ANTI_AFFINITY,
    SCHED_EXCLUSION,
];

/// Most whole GPUs one pod may ask for.
pub const MAX_WHOLE_GPUS: u16 = 64;
/// Most fractional GPUs (`gpu_count`) one pod may ask for.
pub const MAX_GPU_COUNT: u8 = 16;
/// Largest coscheduling group.
pub const MAX_GROUP_HEADCOUNT: u32 = 10_000;
/// Highest `priority`.
pub const MAX_PRIORITY: u8 = 100;

/// How much GPU a pod asks for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuShare {
    /// `count` GPUs, each shared: guaranteed `request`, at most `limit` of its time.
    Fraction {
        request: Milli,
        limit: Milli,
        count: u8,
    },
    /// `gpus` whole GPUs, exclusively (gpu_request = gpu_limit = N > 1).
    Whole { gpus: u16 },
}

/// A coscheduling group: the group starts only when `min_members()` can all be placed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupSpec {
    pub name: String,
    pub headcount: u32,
    pub threshold: Milli,
}

impl GroupSpec {
    /// ⌈threshold × headcount⌉, at least 1.
    pub fn min_members(&self) -> u32 {
        let t = u64::from(self.threshold.get());
        let n = (u64::from(self.headcount) * t).div_ceil(1000);
        u32::try_from(n.max(1)).unwrap_or(self.headcount)
    }
}

/// Everything a KubeShare pod asks of the scheduler, from its labels.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GpuDemand {
    pub share: GpuShare,
    /// Memory cap per GPU in bytes; `None` means ⌊request × the chosen GPU's memory⌋.
    pub mem: Option<u64>,
    pub model: Option<String>,
    /// 0 = opportunistic (pack), 1..=100 = guarantee (spread).
    pub priority: u8,
    pub group: Option<GroupSpec>,
    pub affinity: Option<String>,
    pub anti_affinity: Option<String>,
    pub exclusion: Option<String>,
    /// Unified-memory mode (`gpu_mem_mode=unified`, docs/um.md); `None`: device memory.
    pub um: Option<UmSpec>,
}

/// The rule a label value broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    RequestNotANumber,
    RequestFractionAboveOne,
    NotNegative,
    TooPrecise,
    TooManyWholeGpus,
    LimitNotANumber,
    LimitAboveOne,
    LimitZero,
    RequestAboveLimit {
        limit: String,
    },
    WholeLimitMismatch {
        request: String,
    },
    CountNotANumber,
    CountWithWhole,
    Memory(QuantityError),
    MemoryZero,
    /// Admission only: no `gpu_mem` and a request of 0, so the default cap,
    /// ⌊request × memory⌋, would be 0 bytes.
    MemoryWouldBeZero,
    /// Not a Kubernetes label value; the string says how to write it instead.
    NotLabelValue(&'static str),
    ModelName,
    PriorityRange,
    HeadcountRange,
    ThresholdRange,
    LabelValue,
    AliasConflict {
        other_label: &'static str,
        other_value: String,
    },
    Obsolete,
    Unknown,
    /// `gpu_mem_mode` is neither `device` nor `unified`.
    MemModeName,
    /// Whole GPUs run without the hook, so there is nothing to make managed.
    UnifiedWithWhole,
    ManagedWithoutUnified,
    ManagedBelowResident {
        resident: String,
    },
    ManagedAboveFactor {
        resident: String,
    },
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::RequestNotANumber => write!(
                f,
                "must be a decimal between 0.0 and 1.0, or a whole number of GPUs such as 2, {SHARE_FORM}"
            ),
            Rule::RequestFractionAboveOne => write!(
                f,
                "a fractional request must be at most 1.0; whole GPUs are written as an integer such as 2"
            ),
            Rule::NotNegative => write!(f, "must not be negative"),
            Rule::TooPrecise => write!(
                f,
                "at most 3 decimal places are allowed (shares are counted in thousandths of a GPU)"
            ),
            Rule::TooManyWholeGpus => {
                write!(
                    f,
                    "at most {MAX_WHOLE_GPUS} whole GPUs may be requested by one pod"
                )
            }
            Rule::LimitNotANumber => {
                write!(f, "must be a decimal between 0.0 and 1.0, {SHARE_FORM}")
            }
            Rule::LimitAboveOne => write!(
                f,
                "must be at most 1.0 for a fractional request; for whole GPUs set gpu_request and gpu_limit to the same integer"
            ),
            Rule::LimitZero => write!(f, "must be greater than 0"),
            Rule::RequestAboveLimit { limit } => {
                write!(f, "must not exceed {GPU_LIMIT}={limit}")
            }
            Rule::WholeLimitMismatch { request } => write!(
                f,
                "must equal {GPU_REQUEST}={request}: whole GPUs are not time-shared, so their limit is their request"
            ),
            Rule::CountNotANumber => {
                write!(f, "must be a whole number from 1 to {MAX_GPU_COUNT}")
            }
            Rule::CountWithWhole => write!(
                f,
                "only applies to a fractional gpu_request (at most 1.0); for whole GPUs set gpu_request to the number of GPUs"
            ),
            Rule::Memory(e) => write!(f, "{e}"),
            Rule::MemoryZero => write!(
                f,
                "must be greater than 0 (leave it out to get the request's share of the GPU's memory)"
            ),
            Rule::MemoryWouldBeZero => write!(
                f,
                "with a gpu_request of 0 and no {GPU_MEM}, the pod's GPU memory cap would be 0 bytes (the default cap is gpu_request × the GPU's memory), so every GPU allocation it makes would fail; set {GPU_MEM} (such as 4Gi) or a gpu_request above 0"
            ),
            Rule::NotLabelValue(hint) => write!(
                f,
                "is not a valid Kubernetes label value (at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit), so the apiserver would refuse it; {hint}"
            ),
            Rule::ModelName => write!(
                f,
                "must be a GPU model as NVML names it, spaces written as '-', such as NVIDIA-H100-80GB-HBM3"
            ),
            Rule::PriorityRange => write!(
                f,
                "must be a whole number from 0 to {MAX_PRIORITY} (0 = opportunistic, 1-{MAX_PRIORITY} = guaranteed)"
            ),
            Rule::HeadcountRange => {
                write!(f, "must be a whole number from 1 to {MAX_GROUP_HEADCOUNT}")
            }
            Rule::ThresholdRange => write!(
                f,
                "must be a decimal greater than 0 and at most 1.0 (the fraction of the group that must start together)"
            ),
            Rule::LabelValue => write!(
                f,
                "must be 1-63 characters of letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
            ),
            Rule::AliasConflict {
                other_label,
                other_value,
            } => write!(
                f,
                "conflicts with {other_label}={other_value}; set only one of them"
            ),
            Rule::Obsolete => write!(
                f,
                "is obsolete; use {GROUP_HEADCOUNT} and {GROUP_THRESHOLD}"
            ),
            Rule::MemModeName => write!(
                f,
                "must be `device` (ordinary GPU memory, the default) or `unified` (managed memory that may exceed the GPU-resident share; docs/um.md)"
            ),
            Rule::UnifiedWithWhole => write!(
                f,
                "applies to a fractional gpu_request (at most 1.0) only: whole GPUs run without the hook library, which makes allocations managed"
            ),
            Rule::ManagedWithoutUnified => write!(
                f,
                "is the managed-memory ceiling of unified-memory mode; set {GPU_MEM_MODE}=unified as well, or remove it"
            ),
            Rule::ManagedBelowResident { resident } => write!(
                f,
                "must be at least {GPU_MEM}={resident} (the ceiling of all the pod's managed memory includes its GPU-resident share)"
            ),
            Rule::ManagedAboveFactor { resident } => write!(
                f,
                "must be at most {MAX_MANAGED_FACTOR} × {GPU_MEM}={resident} (beyond that the pod would spend its time migrating pages)"
            ),
            Rule::Unknown => write!(
                f,
                "unknown KubeShare label (a typo?); known labels are gpu_request, gpu_limit, gpu_mem, gpu_mem_mode, gpu_mem_managed, gpu_count, gpu_model, priority, group_name, group_headcount, group_threshold, sched_affinity, sched_anti-affinity, sched_exclusion"
            ),
        }
    }
}

/// A label set that breaks a rule. The message names the label, the value and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("{label}={value}: {rule}")]
    Invalid {
        label: String,
        value: String,
        rule: Rule,
    },
    #[error("{label}={value}: {missing} is required as well{why}")]
    Missing {
        label: &'static str,
        value: String,
        missing: &'static str,
        why: &'static str,
    },
}

impl LabelError {
    /// The label the user must fix.
    pub fn label(&self) -> &str {
        match self {
            LabelError::Invalid { label, .. } => label,
            LabelError::Missing { label, .. } => label,
        }
    }
}

/// Whether KubeShare handles this pod: it names our scheduler or carries a
/// `sharedgpu/gpu_*` label.
pub fn is_kubeshare_pod(scheduler_name: Option<&str>, labels: &BTreeMap<String, String>) -> bool {
    scheduler_name == Some(crate::scheduler_name())
        || labels.keys().any(|k| k.starts_with("sharedgpu/gpu_"))
}

fn invalid(label: &str, value: &str, rule: Rule) -> LabelError {
    LabelError::Invalid {
        label: label.to_string(),
        value: value.to_string(),
        rule,
    }
}

/// A Kubernetes label value that is not empty.
fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A plain decimal integer: digits only (no sign, no spaces).
/// A priority as `sharedgpu/priority` (and a claim's config, `priority`) writes it: a
/// whole number from 0 to [`MAX_PRIORITY`].
pub(crate) fn parse_priority(s: &str) -> Option<u8> {
    parse_whole(s)
        .filter(|v| *v <= u64::from(MAX_PRIORITY))
        .map(|v| v as u8)
}

fn parse_whole(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 12 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The label error for a share that did not parse; `not_number` and `above_one` say what
/// the label expects.
fn share_error(
    label: &str,
    value: &str,
    e: MilliParseError,
    not_number: Rule,
    above_one: Rule,
) -> LabelError {
    let rule = match e {
        MilliParseError::NotANumber => not_number,
        MilliParseError::Negative => Rule::NotNegative,
        MilliParseError::TooPrecise => Rule::TooPrecise,
        MilliParseError::AboveOne => above_one,
    };
    invalid(label, value, rule)
}

/// `gpu_limit` of a fractional request.
fn parse_limit(limit_s: &str) -> Result<Milli, LabelError> {
    Milli::parse(limit_s).map_err(|e| {
        share_error(
            GPU_LIMIT,
            limit_s,
            e,
            Rule::LimitNotANumber,
            Rule::LimitAboveOne,
        )
    })
}

fn tag(labels: &BTreeMap<String, String>, key: &str) -> Result<Option<String>, LabelError> {
    match labels.get(key) {
        None => Ok(None),
        Some(v) if is_label_value(v) => Ok(Some(v.clone())),
        Some(v) => Err(invalid(key, v, Rule::LabelValue)),
    }
}

impl GpuDemand {
    /// Parses a pod's labels. `Ok(None)` when the pod carries no `sharedgpu/` label:
    /// it asks for no GPU.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Option<GpuDemand>, LabelError> {
        let ours: Vec<(&String, &String)> = labels
            .iter()
            .filter(|(k, _)| k.starts_with(crate::PREFIX))
            .collect();
        if ours.is_empty() {
            return Ok(None);
        }
        for (k, v) in &ours {
            if k.as_str() == OBSOLETE_MIN_AVAILABLE {
                return Err(invalid(k, v, Rule::Obsolete));
            }
            if !KNOWN_LABELS.contains(&k.as_str()) {
                return Err(invalid(k, v, Rule::Unknown));
            }
        }
        let get = |k: &str| labels.get(k).map(String::as_str);

        // gpu_limit is the label every GPU pod must carry.
        let Some(limit_s) = get(GPU_LIMIT) else {
            let (label, value) = ours
                .first()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .unwrap_or((GPU_REQUEST, ""));
            let label = KNOWN_LABELS
                .iter()
                .copied()
                .find(|k| *k == label)
                .unwrap_or(GPU_REQUEST);
            return Err(LabelError::Missing {
                label,
                value: value.to_string(),
                missing: GPU_LIMIT,
                why: " (the most of a GPU the pod may use; use the same value as gpu_request for a fixed share)",
            });
        };

        let share = match get(GPU_REQUEST) {
            None => {
                let limit = parse_limit(limit_s)?;
                fraction(limit_s, Milli::ZERO, limit, labels)?
            }
            Some(req_s) => {
                let req = parse_decimal_milli(req_s).map_err(|e| {
                    share_error(
                        GPU_REQUEST,
                        req_s,
                        e,
                        Rule::RequestNotANumber,
                        Rule::TooManyWholeGpus,
                    )
                })?;
                if req <= 1000 {
                    let request = Milli::new(req as u16).unwrap_or(Milli::ONE);
                    let limit = parse_limit(limit_s)?;
                    if request > limit {
                        return Err(invalid(
                            GPU_REQUEST,
                            req_s,
                            Rule::RequestAboveLimit {
                                limit: limit_s.to_string(),
                            },
                        ));
                    }
                    fraction(limit_s, request, limit, labels)?
                } else if req % 1000 != 0 {
                    return Err(invalid(GPU_REQUEST, req_s, Rule::RequestFractionAboveOne));
                } else {
                    let gpus = req / 1000;
                    if gpus > u64::from(MAX_WHOLE_GPUS) {
                        return Err(invalid(GPU_REQUEST, req_s, Rule::TooManyWholeGpus));
                    }
                    if parse_decimal_milli(limit_s).ok() != Some(req) {
                        return Err(invalid(
                            GPU_LIMIT,
                            limit_s,
                            Rule::WholeLimitMismatch {
                                request: req_s.to_string(),
                            },
                        ));
                    }
                    if let Some(c) = get(GPU_COUNT) {
                        return Err(invalid(GPU_COUNT, c, Rule::CountWithWhole));
                    }
                    GpuShare::Whole { gpus: gpus as u16 }
                }
            }
        };

        let mem = match get(GPU_MEM) {
            None => None,
            Some(s) if !s.is_empty() && !is_label_value(s) => {
                return Err(invalid(
                    GPU_MEM,
                    s,
                    Rule::NotLabelValue(
                        "write a quantity without sign or spaces and with digits on both sides of any decimal point, such as 0.5Gi or 512Mi",
                    ),
                ));
            }
            Some(s) => match parse_bytes(s) {
                Ok(0) => return Err(invalid(GPU_MEM, s, Rule::MemoryZero)),
                Ok(b) => Some(b),
                Err(e) => return Err(invalid(GPU_MEM, s, Rule::Memory(e))),
            },
        };

        let model = match get(GPU_MODEL) {
            None => None,
            Some(m) if is_label_value(m) => Some(m.to_string()),
            Some(m) => return Err(invalid(GPU_MODEL, m, Rule::ModelName)),
        };

        let priority = match get(PRIORITY) {
            None => 0,
            Some(p) => {
                parse_priority(p).ok_or_else(|| invalid(PRIORITY, p, Rule::PriorityRange))?
            }
        };

        let group = parse_group(labels)?;
        let um = crate::um::parse(labels, matches!(share, GpuShare::Whole { .. }), mem)?;

        Ok(Some(GpuDemand {
            share,
            mem,
            model,
            priority,
            group,
            affinity: tag(labels, SCHED_AFFINITY)?,
            anti_affinity: tag(labels, SCHED_ANTI_AFFINITY)?,
            exclusion: tag(labels, SCHED_EXCLUSION)?,
            um,
        }))
    }

    /// [`GpuDemand::from_labels`] plus the rules that only admission enforces (a pod
    /// already admitted, or created where admission is off, is still parsed as before):
    /// a fractional pod whose default memory cap would be 0 bytes (gpu_request 0 and no
    /// gpu_mem) is refused rather than started with a cap on which every allocation
    /// fails.
    pub fn from_labels_at_admission(
        labels: &BTreeMap<String, String>,
    ) -> Result<Option<GpuDemand>, LabelError> {
        let demand = GpuDemand::from_labels(labels)?;
        if let Some(d) = &demand
            && d.mem.is_none()
            && d.request_per_gpu() == Milli::ZERO
        {
            // Name the label that set the request to 0: gpu_request when written,
            // else gpu_limit (the request defaults to 0 beside it).
            let (label, value) = match labels.get(GPU_REQUEST) {
                Some(v) => (GPU_REQUEST, v.as_str()),
                None => (GPU_LIMIT, labels.get(GPU_LIMIT).map_or("", String::as_str)),
            };
            return Err(invalid(label, value, Rule::MemoryWouldBeZero));
        }
        Ok(demand)
    }

    /// The labels that parse back to this demand (canonical spelling).
    pub fn to_labels(&self) -> BTreeMap<String, String> {
        let mut l = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            l.insert(k.to_string(), v);
        };
        match &self.share {
            GpuShare::Fraction {
                request,
                limit,
                count,
            } => {
                put(GPU_REQUEST, request.to_string());
                put(GPU_LIMIT, limit.to_string());
                if *count != 1 {
                    put(GPU_COUNT, count.to_string());
                }
            }
            GpuShare::Whole { gpus } => {
                put(GPU_REQUEST, gpus.to_string());
                put(GPU_LIMIT, gpus.to_string());
            }
        }
        if let Some(m) = self.mem {
            put(GPU_MEM, m.to_string());
        }
        crate::um::to_labels(&self.um, &mut put);
        if let Some(m) = &self.model {
            put(GPU_MODEL, m.clone());
        }
        if self.priority != 0 {
            put(PRIORITY, self.priority.to_string());
        }
        if let Some(g) = &self.group {
            put(GROUP_NAME, g.name.clone());
            put(GROUP_HEADCOUNT, g.headcount.to_string());
            put(GROUP_THRESHOLD, g.threshold.to_string());
        }
        for (k, v) in [
            (SCHED_AFFINITY, &self.affinity),
            (SCHED_ANTI_AFFINITY, &self.anti_affinity),
            (SCHED_EXCLUSION, &self.exclusion),
        ] {
            if let Some(v) = v {
                put(k, v.clone());
            }
        }
        l
    }

    /// How many distinct GPUs the pod needs.
    pub fn gpu_count(&self) -> u16 {
        match self.share {
            GpuShare::Fraction { count, .. } => u16::from(count),
            GpuShare::Whole { gpus } => gpus,
        }
    }

    /// The guaranteed share it takes on each of its GPUs (a whole GPU is 1000).
    pub fn request_per_gpu(&self) -> Milli {
        match self.share {
            GpuShare::Fraction { request, .. } => request,
            GpuShare::Whole { .. } => Milli::ONE,
        }
    }

    /// The ceiling of its share on each GPU.
    pub fn limit_per_gpu(&self) -> Milli {
        match self.share {
            GpuShare::Fraction { limit, .. } => limit,
            GpuShare::Whole { .. } => Milli::ONE,
        }
    }

    /// Whole GPUs need no time-slicing and so no hook library.
    pub fn is_whole(&self) -> bool {
        matches!(self.share, GpuShare::Whole { .. })
    }

    /// Effective memory cap on a GPU of `gpu_memory` bytes: the label, else
    /// ⌊request × memory⌋ (a whole GPU gets all of it).
    pub fn mem_on(&self, gpu_memory: u64) -> u64 {
        if let Some(m) = self.mem {
            return m;
        }
        let r = u128::from(self.request_per_gpu().get());
        (u128::from(gpu_memory) * r / 1000) as u64
    }

    /// In unified-memory mode, the managed ceiling on a GPU of `gpu_memory` bytes (the
    /// resident share is [`GpuDemand::mem_on`]); `None` in device mode.
    pub fn managed_on(&self, gpu_memory: u64) -> Option<u64> {
        self.um.map(|u| u.ceiling(self.mem_on(gpu_memory)))
    }
}

fn fraction(
    limit_s: &str,
    request: Milli,
    limit: Milli,
    labels: &BTreeMap<String, String>,
) -> Result<GpuShare, LabelError> {
    if limit == Milli::ZERO {
        return Err(invalid(GPU_LIMIT, limit_s, Rule::LimitZero));
    }
    let count = match labels.get(GPU_COUNT) {
        None => 1,
        Some(c) => match parse_whole(c) {
            Some(n) if (1..=u64::from(MAX_GPU_COUNT)).contains(&n) => n as u8,
            _ => return Err(invalid(GPU_COUNT, c, Rule::CountNotANumber)),
        },
    };
    Ok(GpuShare::Fraction {
        request,
        limit,
        count,
    })
}

fn parse_group(labels: &BTreeMap<String, String>) -> Result<Option<GroupSpec>, LabelError> {
    let name = match (labels.get(GROUP_NAME), labels.get(POD_GROUP_NAME)) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                POD_GROUP_NAME,
                b,
                Rule::AliasConflict {
                    other_label: GROUP_NAME,
                    other_value: a.clone(),
                },
            ));
        }
        (Some(a), _) => Some((GROUP_NAME, a)),
        (None, Some(b)) => Some((POD_GROUP_NAME, b)),
        (None, None) => None,
    };
    let headcount = labels.get(GROUP_HEADCOUNT);
    let threshold = labels.get(GROUP_THRESHOLD);
    const WHY: &str =
        " (coscheduling needs group_name, group_headcount and group_threshold together)";
    let (name_label, name) = match (name, headcount, threshold) {
        (None, None, None) => return Ok(None),
        (Some(n), Some(_), Some(_)) => n,
        (Some((l, v)), None, _) => {
            return Err(missing(l, v, GROUP_HEADCOUNT, WHY));
        }
        (Some((l, v)), Some(_), None) => return Err(missing(l, v, GROUP_THRESHOLD, WHY)),
        (None, Some(h), _) => return Err(missing(GROUP_HEADCOUNT, h, GROUP_NAME, WHY)),
        (None, None, Some(t)) => return Err(missing(GROUP_THRESHOLD, t, GROUP_NAME, WHY)),
    };
    if !is_label_value(name) {
        return Err(invalid(name_label, name, Rule::LabelValue));
    }
    let (Some(h), Some(t)) = (headcount, threshold) else {
        return Ok(None);
    };
    let headcount = match parse_whole(h) {
        Some(n) if (1..=u64::from(MAX_GROUP_HEADCOUNT)).contains(&n) => n as u32,
        _ => return Err(invalid(GROUP_HEADCOUNT, h, Rule::HeadcountRange)),
    };
    let threshold = match Milli::parse(t) {
        Ok(m) if m > Milli::ZERO => m,
        Err(MilliParseError::TooPrecise) => {
            return Err(invalid(GROUP_THRESHOLD, t, Rule::TooPrecise));
        }
        _ => return Err(invalid(GROUP_THRESHOLD, t, Rule::ThresholdRange)),
    };
    Ok(Some(GroupSpec {
        name: name.clone(),
        headcount,
        threshold,
    }))
}

fn missing(
    label: &'static str,
    value: &str,
    missing: &'static str,
    why: &'static str,
) -> LabelError {
    LabelError::Missing {
        label,
        value: value.to_string(),
        missing,
        why,
    }
}
