//! The `sharedgpu` pod API, shared by every part of KubeShare.
//!
//! This crate is the one place where the contracts of `docs/design.md` live as types:
//! the pod labels (parsed once, into [`GpuDemand`]), the annotations the extender
//! writes at bind ([`Allocation`]), the GPU inventory a node daemon publishes on its
//! Node ([`NodeInventory`]), and Gemini's per-GPU resource-config file
//! ([`ResourceConfig`]), gem-schd's usage report ([`UsageReport`]) and the node's host
//! directory ([`Layout`]), the DRA driver's names and claim configuration ([`dra`]), and
//! which pod a process's cgroups put it in ([`cgroup`]). It does no I/O.

pub mod annotations;
pub mod cgroup;
pub mod dra;
pub mod inventory;
pub mod labels;
pub mod layout;
mod milli;
mod quantity;
pub mod resource_config;
pub mod scheduler_name;
pub mod um;
pub mod usage;

pub use annotations::{Allocation, AllocationError, Granted};
pub use inventory::{GpuInfo, InventoryError, NodeInventory};
pub use labels::{GpuDemand, GpuShare, GroupSpec, LabelError, is_kubeshare_pod};
pub use layout::Layout;
pub use milli::{Milli, MilliParseError};
pub use quantity::{ACCEPTED_FORMS, QuantityError, parse_bytes};
pub use resource_config::{ClientClass, ResourceConfig, ResourceConfigError, ResourceEntry};
pub use scheduler_name::{SCHEDULER_NAME_ENV, scheduler_name, set_scheduler_name};
pub use um::UmSpec;
pub use usage::{ClientUsage, Refusal, USAGE_FILE, UsageError, UsageReport};

/// The default name of the scheduler that places KubeShare pods ([`scheduler_name`] is
/// the one in force).
pub const SCHEDULER_NAME: &str = "kubeshare-scheduler";

/// The prefix of every KubeShare label and annotation.
pub const PREFIX: &str = "sharedgpu/";

/// The taint the node daemon puts on a GPU node it serves
/// (`kubeshare.io/gpu=shared:NoSchedule`): only pods that tolerate it are scheduled
/// there, and the webhook adds the toleration to KubeShare pods only.
pub const GPU_TAINT_KEY: &str = "kubeshare.io/gpu";
pub const GPU_TAINT_VALUE: &str = "shared";
pub const GPU_TAINT_EFFECT: &str = "NoSchedule";

/// The extended resource that marks a pod for the extender: the webhook adds
/// `kubeshare.io/gpu-pod: 0` ([`GPU_POD_MARK`]) to the first container of every
/// pod with a GPU demand, and kube-scheduler's `managedResources` sends only pods
/// that name it to the extender. Pods without GPUs are then placed by
/// kube-scheduler alone, at its own speed.
pub const GPU_POD_RESOURCE: &str = "kubeshare.io/gpu-pod";

/// The mark's quantity: zero. kube-scheduler picks the extender's pods by the
/// resource's name alone, whatever its quantity, while its resource filter
/// skips a zero request before checking the name (a formatted string and a
/// regular expression, for every pod on every node searched: ~0.7 ms per pod at
/// 1,000 nodes with a quantity of 1). Nothing counts a zero either: no node has
/// to advertise the resource and the kubelet admits the pod anywhere.
pub const GPU_POD_MARK: &str = "0";
