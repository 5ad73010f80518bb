//! Why placement says no: a pod that does not fit a node ([`FitError`]), a
//! group that cannot start yet ([`GroupWait`]), a bind it refuses
//! ([`BindRefused`]), a pod's allocation record it will not book
//! ([`RecordError`]), and a guaranteed pod that preempts ([`Preempting`]). Their messages are what users read: the failed-node
//! reasons kube-scheduler shows on a pod, and the pod's events.

use std::fmt;

use kubeshare_api::Milli;
use kubeshare_api::inventory::InventoryError;

use super::GroupKey;
use crate::um_fit;

/// A byte count shown in GiB with one decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gib(pub u64);

impl fmt::Display for Gib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} GiB", self.0 as f64 / f64::from(1u32 << 30))
    }
}

/// An overcommit factor in thousandths, shown as the flag writes it (`1.5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Factor(pub u32);

impl fmt::Display for Factor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&um_fit::factor_str(self.0))
    }
}

/// A share in thousandths, shown as a decimal (at most 1.0).
pub(super) fn milli(v: u32) -> Milli {
    Milli::new(v.min(1000) as u16).unwrap_or(Milli::ONE)
}

/// A node that is known but cannot take KubeShare pods.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeProblem {
    #[error("{node}: no KubeShare GPUs (no sharedgpu/inventory annotation)")]
    NoInventory { node: String },
    #[error("{node}: bad GPU inventory: {error}")]
    BadInventory { node: String, error: InventoryError },
}

/// Why a pod does not fit a node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    #[error("{0}")]
    Node(NodeProblem),
    #[error("{node}: not a KubeShare GPU node")]
    NotGpuNode { node: String },
    #[error("{node}: no {want} GPU (has {has})")]
    NoModel {
        node: String,
        want: String,
        has: String,
    },
    #[error("{node}: affinity tag {tag} lives on {place}")]
    TagElsewhere {
        node: String,
        tag: String,
        place: String,
    },
    #[error("{node}: the GPUs holding affinity tag {tag} have no room")]
    TagNoRoom { node: String, tag: String },
    #[error("{node}: affinity tag {tag} is held by GPUs that are not free")]
    TagNotFree { node: String, tag: String },
    #[error("{node}: {free} of {want} whole GPUs free{}", by_plugin(.held))]
    WholeNotFree {
        node: String,
        free: usize,
        want: usize,
        /// Eligible GPUs given whole to pods by the NVIDIA device plugin.
        held: usize,
    },
    /// A pod of several GPUs: fewer fit than it asks for.
    #[error("{node}: {fit} of {want} GPUs fit; {why}")]
    TooFewGpus {
        node: String,
        fit: usize,
        want: usize,
        why: GpuMisfit,
    },
    /// A pod of one GPU: none fits.
    #[error("{0}")]
    Gpu(GpuMisfit),
}

fn by_plugin(held: &usize) -> String {
    if *held > 0 {
        format!(" ({held} given whole to pods by the NVIDIA device plugin)")
    } else {
        String::new()
    }
}

impl FitError {
    /// No eviction on the node can make the pod fit there (kube-scheduler's
    /// preemption has nothing to try).
    pub fn unresolvable(&self) -> bool {
        match self {
            FitError::Node(_)
            | FitError::NotGpuNode { .. }
            | FitError::NoModel { .. }
            | FitError::TagElsewhere { .. } => true,
            FitError::TagNoRoom { .. }
            | FitError::TagNotFree { .. }
            | FitError::WholeNotFree { .. }
            | FitError::TooFewGpus { .. }
            | FitError::Gpu(_) => false,
        }
    }
}

/// Why the GPU closest to fitting does not take the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuMisfit {
    /// No GPU failed (the node has fewer eligible GPUs than the pod asks for).
    #[error("{node}: no GPU fits")]
    NoneFails { node: String },
    #[error("{node}/gpu {idx}: {why}")]
    Gpu { node: String, idx: u32, why: GpuWhy },
}

/// What keeps one GPU from taking the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuWhy {
    #[error("given whole to pod {0} by the NVIDIA device plugin")]
    HeldByPlugin(String),
    #[error("holds exclusion tag {held}, pod has {has}")]
    Exclusion { held: String, has: String },
    #[error("already holds a pod with anti-affinity tag {0}")]
    AntiAffinity(String),
    #[error("{free} free < {request} requested")]
    Share { free: Milli, request: Milli },
    #[error(
        "the memory cap would be 0 bytes (gpu_request 0 and no gpu_mem): set sharedgpu/gpu_mem"
    )]
    ZeroCap,
    #[error("{free} memory free < {need} requested")]
    Memory { free: Gib, need: Gib },
    #[error(
        "{free} of unified-memory room ({factor} × what device-mode pods leave) < {need} resident requested"
    )]
    UnifiedMemory {
        free: Gib,
        need: Gib,
        factor: Factor,
    },
    /// The GPU would not fit counting what ResourceClaims (the DRA driver's, placed by
    /// the stock scheduler) hold of it.
    #[error("{why}, counting {share} held by ResourceClaims {claims}")]
    Claimed {
        why: Box<GpuWhy>,
        share: Milli,
        claims: String,
    },
    /// The GPU would not fit counting the room promised to preemptors whose victims
    /// are still leaving.
    #[error("{why}, counting {share} promised to preempting pod(s) {pods}")]
    Promised {
        why: Box<GpuWhy>,
        share: Milli,
        pods: String,
    },
}

/// Why a coscheduling group cannot start yet (its members wait).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupWait {
    #[error("group {group}: starting; this member follows once {min} members run")]
    Starting { group: GroupKey, min: u32 },
    #[error("group {group}: {members} of {min} required members exist")]
    TooFew {
        group: GroupKey,
        members: u32,
        min: u32,
    },
    #[error("group {group}: {seen} of {min} required members have reached the scheduler")]
    NotSeen {
        group: GroupKey,
        seen: u32,
        min: u32,
    },
    #[error("group {group}: {placed} of {min} required members can be placed at once")]
    NoRoom {
        group: GroupKey,
        placed: u32,
        min: u32,
    },
}

/// Why bind's decision half refuses (nothing was booked for the pod).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindRefused {
    #[error("pod {uid} is not known to the extender yet")]
    UnknownPod { uid: String },
    #[error("invalid sharedgpu labels: {0}")]
    InvalidLabels(String),
    #[error("pod is already bound to {node}")]
    AlreadyBound { node: String },
    #[error("pod was bound to {node} by an earlier bind whose outcome is being checked")]
    BeingChecked { node: String },
    #[error("group member's place is reserved on {reserved}, not {asked}")]
    ReservedElsewhere { reserved: String, asked: String },
    #[error("the pod's labels changed since its place was planned")]
    LabelsChanged,
    #[error("group released without this member")]
    ReleasedWithout,
    #[error("the group's places were freed before enough members reached bind")]
    PlacesFreed,
    #[error(
        "group {group}: not started yet ({members} members exist, {bound} bound, {min} required)"
    )]
    NotStarted {
        group: GroupKey,
        members: u32,
        bound: u32,
        min: u32,
    },
    /// The member's wait at the gate ended before its group's quorum.
    #[error("waiting for the group's members at bind")]
    AtGate,
    #[error("group {group}: {at_bind} members at bind or bound, waiting for more")]
    GroupAtGate { group: GroupKey, at_bind: u32 },
    #[error(transparent)]
    DoesNotFit(#[from] FitError),
    #[error(transparent)]
    NotAddable(#[from] RecordError),
}

/// What is wrong with a pod's allocation record (reported, never booked silently).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("allocation record on a pod that is not a KubeShare pod (not booked): node {node}")]
    NotKubeShare { node: String },
    #[error("allocation record on a pod that is not bound (not booked)")]
    NotBound,
    #[error("allocation record names node {record} but the pod is bound to {bound}")]
    WrongNode { record: String, bound: String },
    #[error("bad allocation record: {0}")]
    Unparseable(String),
    #[error("allocation record changed after it was observed: keeping the first one")]
    Changed,
    #[error("allocation record differs from what this extender bound: keeping its own")]
    DiffersFromBind,
    #[error("allocation record removed from a bound pod: keeping its booking")]
    Removed,
    #[error(
        "bad allocation record: {mem} of memory cannot be added to the {booked} already booked on {node}/gpu {idx} (not booked)"
    )]
    NotAddable {
        mem: u64,
        booked: u64,
        node: String,
        idx: u32,
    },
}

impl RecordError {
    /// The label of `kubeshare_extender_record_problems_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            RecordError::NotAddable { .. } => "not_addable",
            RecordError::Changed | RecordError::DiffersFromBind | RecordError::Removed => {
                "tampered"
            }
            RecordError::NotKubeShare { .. } | RecordError::NotBound => "foreign",
            RecordError::WrongNode { .. } => "wrong_node",
            RecordError::Unparseable(_) => "unparseable",
        }
    }
}

/// The books disagree with a recount from the bookings, or a GPU is over its
/// share or memory (a bug: see [`super::Cluster::check_invariants`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BooksInconsistent(pub String);

impl From<BooksInconsistent> for String {
    fn from(e: BooksInconsistent) -> String {
        e.0
    }
}

/// What a guaranteed pod's filter answer says while it preempts: the reason
/// kube-scheduler shows on the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Preempting {
    #[error(
        "{node}/gpu {gpus}: preempting: evicting {count} opportunistic pod(s) ({victims}) to make room for this pod"
    )]
    Evicting {
        node: String,
        gpus: String,
        count: usize,
        victims: String,
    },
    #[error(
        "preempting: waiting for {waiting} of the {total} opportunistic pod(s) evicted for this pod to leave {node}"
    )]
    Waiting {
        node: String,
        waiting: usize,
        total: usize,
    },
}
