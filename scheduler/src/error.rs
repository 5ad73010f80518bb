//! What can go wrong on the extender's API side: one API call ([`ApiError`]),
//! one eviction of a preemption ([`EvictFailed`]), and a bind as kube-scheduler is answered ([`BindFailed`]: the message it
//! shows, also the pod's `GpuBindFailed` event).

use crate::placement::BindRefused;

/// What the extender answers while its books are not to be trusted.
pub(crate) const NOT_SYNCED: &str = "kubeshare extender is not ready: node and pod state not synced (starting, or a watch is restarting)";

/// How an API call failed (retries included).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The apiserver answered no (4xx other than 429): nothing was written.
    #[error("{message}")]
    Refused { code: u16, message: String },
    /// Not known whether it was applied (timeout, connection, 5xx).
    #[error("{0}")]
    Unknown(String),
    /// The deadline came before any attempt could have been applied: none was sent
    /// (every API slot taken, as in a deep backlog) or each was turned away (429).
    /// Nothing was written, so a Binding's booking can be rolled back at once.
    #[error("{0}")]
    NotApplied(String),
}

/// Why a bind failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindFailed {
    #[error("{}", NOT_SYNCED)]
    NotSynced,
    /// A retried bind of a pod bound by an earlier one, to another node.
    #[error("pod is already bound to {bound}, not {asked}")]
    BoundElsewhere { bound: String, asked: String },
    #[error("bind task failed: {0}")]
    TaskFailed(String),
    #[error("bind ended without an answer")]
    NoAnswer,
    #[error("extender has no Kubernetes client")]
    NoClient,
    /// The pod, read because the watch had not shown it yet, is another one.
    #[error("pod {namespace}/{name} has uid {found}, not {asked}")]
    OtherUid {
        namespace: String,
        name: String,
        found: String,
        asked: String,
    },
    /// Placement refused: nothing was booked.
    #[error(transparent)]
    Refused(#[from] BindRefused),
    /// An API call failed before the Binding (reading the pod), or the Binding
    /// was refused or never sent: nothing was bound.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The Binding conflicted; the pod, read again, is gone.
    #[error("{conflict}; the pod is gone")]
    PodGone { conflict: String },
    #[error("{conflict}; the pod was replaced")]
    PodReplaced { conflict: String },
    #[error("{conflict}; the pod is bound to {node}")]
    BoundByOther { conflict: String, node: String },
    #[error("the pod's sharedgpu labels changed after the decision ({conflict}): rescheduling")]
    LabelsChanged { conflict: String },
    #[error("the pod kept changing under the Binding")]
    KeptChanging,
    /// The Binding may have been applied: the booking is kept for the check.
    #[error(
        "{0}; the Binding's outcome is unknown: the place stays booked until the pod is checked"
    )]
    OutcomeUnknown(String),
}

/// Why a preemption's eviction of a victim failed (the preemption is then
/// given up, and its pod searches again elsewhere).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvictFailed {
    /// HTTP 429 from the Eviction API: a PodDisruptionBudget forbids it now.
    #[error("evicting {pod} is not allowed now (a PodDisruptionBudget): {message}")]
    Blocked { pod: String, message: String },
    #[error("evicting {pod} was refused (HTTP {code}): {message}")]
    Refused {
        pod: String,
        code: u16,
        message: String,
    },
    #[error("evicting {pod}: {message}")]
    Unknown { pod: String, message: String },
}

impl EvictFailed {
    /// The metrics' outcome label.
    pub fn kind(&self) -> &'static str {
        match self {
            EvictFailed::Blocked { .. } => "blocked",
            EvictFailed::Refused { .. } | EvictFailed::Unknown { .. } => "failed",
        }
    }
}
