//! The state every part of the extender shares: the books under their mutex,
//! whether the watches have synced, the API client and its permits, binds in
//! flight, and the event recorder. The HTTP routes (`server.rs`), bind's task
//! (`binding.rs`) and the background tasks (`tasks.rs`) all work on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event as KEvent, EventType, Recorder, Reporter};
use tokio::sync::{Notify, Semaphore, watch};
use tracing::debug;

use crate::backpressure::ApiQueue;
use crate::error::BindFailed;
use crate::metrics::Metrics;
use crate::placement::{Cluster, Config, PodRef, PreemptOrder};
use crate::ratelimit::TokenBucket;

/// Deadlines of bind and of the background checks.
#[derive(Debug, Clone)]
pub struct Timing {
    /// A bind call (gate wait and API retries included) answers within this: below
    /// kube-scheduler's extender `httpTimeout` (10 s in `hack/cluster.sh` and
    /// `manifests/kube-scheduler.yaml`), so the scheduler hears the outcome.
    pub bind_timeout: Duration,
    /// Longest wait of a group member's bind for the group's quorum (part of
    /// `bind_timeout`; the rest is left for the Binding).
    pub gang_wait: Duration,
    /// An assumed booking not seen in the watch this long after its bind ended is
    /// checked with a GET of the pod.
    pub assume_check: Duration,
    /// Most concurrent API calls (Bindings, GETs, wake-ups).
    pub api_concurrency: usize,
    /// Period of the timer (expiry of reservations, assumed-booking checks).
    pub tick: Duration,
    /// Rate of the informational "GpuAllocated" events (burst [`ALLOCATED_EVENTS_BURST`]).
    pub allocated_events_per_s: f64,
    /// The filter verb holds a pod while the oldest API call waiting for a slot has
    /// waited longer than this (`backpressure.rs`); zero turns the hold off.
    pub filter_hold_after: Duration,
    /// The longest a filter call is held.
    pub filter_hold_max: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            bind_timeout: Duration::from_secs(8),
            gang_wait: Duration::from_secs(5),
            assume_check: Duration::from_secs(15),
            api_concurrency: 64,
            tick: Duration::from_millis(500),
            allocated_events_per_s: ALLOCATED_EVENTS_PER_S,
            filter_hold_after: Duration::from_secs(2),
            filter_hold_max: Duration::from_secs(3),
        }
    }
}

/// The answer of a bind, shared by the calls that wait for it.
pub(crate) type BindAnswer = Option<Result<String, BindFailed>>;

/// Everything the handlers share.
pub struct Shared {
    cluster: Mutex<Cluster>,
    pub(crate) nodes_synced: AtomicBool,
    pub(crate) pods_synced: AtomicBool,
    /// The ResourceClaim and ResourceSlice watches have listed (or the API serves no
    /// `resource.k8s.io/v1`): what claims hold is in the books.
    pub(crate) claims_synced: AtomicBool,
    /// Background tasks that are not running (ended, restarting): not ready.
    pub(crate) tasks_down: AtomicUsize,
    pub metrics: Metrics,
    /// For API calls: no built-in retries (ours end before the bind deadline).
    pub(crate) client: Option<Client>,
    recorder: Option<Recorder>,
    start: Instant,
    pub(crate) timing: Timing,
    /// Binds in flight, by pod UID: a retried bind waits for the running one.
    pub(crate) inflight: Mutex<HashMap<String, watch::Receiver<BindAnswer>>>,
    pub(crate) api_permits: Semaphore,
    /// API calls waiting for one of `api_permits`, for the filter's back-pressure.
    pub(crate) api_queue: ApiQueue,
    /// Woken when group members are released or freed.
    pub(crate) gate: Notify,
    /// "GpuAllocated" events (informational, one per bind): at most
    /// `Timing::allocated_events_per_s` with a burst of [`ALLOCATED_EVENTS_BURST`];
    /// failures are always reported.
    allocated_events: Mutex<TokenBucket>,
    /// Preemptions the filter decided, for `preemption.rs` to carry out.
    pub(crate) preempt_orders: Mutex<Vec<PreemptOrder>>,
}

/// Rate of the informational "GpuAllocated" events (a backlog binds hundreds of pods a
/// second; each event is an API write fanned out to every event watcher). The record
/// annotations and kube-scheduler's own "Scheduled" event say the same.
pub const ALLOCATED_EVENTS_PER_S: f64 = 5.0;
pub const ALLOCATED_EVENTS_BURST: u32 = 50;

impl Shared {
    /// The state of an extender: with `client`, events are published on pods
    /// (as `instance`); without, nothing is (the benchmark, HTTP tests).
    pub(crate) fn new(
        client: Option<Client>,
        placement: Config,
        timing: Timing,
        instance: Option<String>,
    ) -> Shared {
        let recorder = client.clone().map(|c| {
            Recorder::new(
                c,
                Reporter {
                    controller: "kubeshare-scheduler-extender".into(),
                    instance,
                },
            )
        });
        let events_per_s = timing.allocated_events_per_s;
        Shared {
            cluster: Mutex::new(Cluster::new(placement)),
            nodes_synced: AtomicBool::new(false),
            pods_synced: AtomicBool::new(false),
            claims_synced: AtomicBool::new(false),
            tasks_down: AtomicUsize::new(0),
            metrics: Metrics::default(),
            client,
            recorder,
            start: Instant::now(),
            api_permits: Semaphore::new(timing.api_concurrency.max(1)),
            api_queue: ApiQueue::default(),
            timing,
            inflight: Mutex::new(HashMap::new()),
            gate: Notify::new(),
            allocated_events: Mutex::new(TokenBucket::new(events_per_s, ALLOCATED_EVENTS_BURST, 0)),
            preempt_orders: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Cluster> {
        // A panic while holding the lock is a bug; the books are still usable.
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The wall clock, milliseconds since the Unix epoch: for what outlives the
    /// process (the preemption records), where [`Shared::now_ms`] starts over.
    pub fn wall_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    /// At the first decision (filter or bind) once the watches have listed:
    /// carries on the preemptions another extender recorded on pods (evictions it
    /// had not posted are queued for `preemption.rs`). At the first decision, not
    /// at the sync: a standby extender of a pair takes up what the active one left
    /// when kube-scheduler first calls it, after a failover. Cheap after the first.
    pub(crate) fn resume(&self, c: &mut Cluster) {
        if !self.synced() {
            return;
        }
        let r = c.resume_preemptions(self.now_ms(), self.wall_ms());
        for _ in 0..r.count {
            self.metrics
                .count("kubeshare_extender_preemptions_total", "resumed");
        }
        if !r.orders.is_empty() {
            self.preempt_orders
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(r.orders);
        }
    }

    /// Whether the watches have listed (since their last restart) and every
    /// background task runs; no answer is given before.
    pub fn synced(&self) -> bool {
        self.nodes_synced.load(Ordering::Acquire)
            && self.pods_synced.load(Ordering::Acquire)
            && self.claims_synced.load(Ordering::Acquire)
            && self.tasks_down.load(Ordering::Acquire) == 0
    }

    /// Marks the state synced without watches (the benchmark and tests of the pure path).
    pub fn mark_synced(&self) {
        self.nodes_synced.store(true, Ordering::Release);
        self.pods_synced.store(true, Ordering::Release);
        self.claims_synced.store(true, Ordering::Release);
    }

    /// Runs `f` on the books.
    pub fn with_cluster<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> R {
        f(&mut self.lock())
    }

    /// Whether an informational "GpuAllocated" event may be published now (the
    /// rate limit has a token left).
    pub(crate) fn allocated_event_allowed(&self) -> bool {
        let now = self.now_ms();
        self.allocated_events
            .lock()
            .map(|mut b| b.take(now))
            .unwrap_or(false)
    }

    /// Publishes an event on pod (namespace, name, uid), in the background.
    pub(crate) fn pod_event(
        &self,
        pod: (&str, &str, &str),
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        self.pod_event_about(pod, None, warning, reason, action, note);
    }

    /// Publishes an event on pod (namespace, name, uid) that names another pod
    /// as its related object (a preemptor and its victims), in the background.
    pub(crate) fn pod_event_about(
        &self,
        (namespace, name, uid): (&str, &str, &str),
        related: Option<&PodRef>,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let Some(rec) = self.recorder.clone() else {
            return;
        };
        let pod_ref = |namespace: &str, name: &str, uid: &str| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            uid: Some(uid.to_string()),
            ..ObjectReference::default()
        };
        let reference = pod_ref(namespace, name, uid);
        let secondary = related.map(|r| pod_ref(&r.namespace, &r.name, &r.uid));
        let ev = KEvent {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            // Events cap the note at 1 kB.
            note: Some(note.chars().take(1000).collect()),
            action: action.into(),
            secondary,
        };
        tokio::spawn(async move {
            if let Err(e) = rec.publish(&ev, &reference).await {
                debug!(error = %e, "could not publish an event");
            }
        });
    }
}
