//! The device plugin's decisions, free of I/O: which pod an `Allocate` call is for, which
//! CDI devices it gets, and what is remembered of the answers.
//!
//! The kubelet's `Allocate` names device IDs (slots of [`slot_ids`]), never the pod. It
//! admits the pods bound to its node one at a time, in the order its watch delivers them
//! (the order they were bound; a batch, such as its first list, oldest
//! `creationTimestamp` first), and calls `Allocate` once per container that asks for
//! the resource while it admits that pod; so the call is for the first pod in that order
//! bound here, not yet admitted, asking for the resource, whose containers have not all
//! been answered ([`select`]). HAMi's and Alibaba's gpushare device plugins answer the
//! same way (the oldest pending pod bound to the node).
//! What a pod gets is what its allocation record names, never the slots the kubelet
//! picked: `kubeshare.io/gpu=<uuid>` for each GPU of the record.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, Pod};
use kubeshare_api::{Allocation, annotations};
use serde::{Deserialize, Serialize};

/// The extended resource the webhook asks for and the plugin advertises.
pub const RESOURCE: &str = "kubeshare.io/gpu";

/// Slots advertised per GPU by default. The kubelet counts a device-plugin resource in
/// whole devices, one per container that asks, and KubeShare's extender already decides
/// who gets a share of which GPU; the slots only exist so that the kubelet calls
/// `Allocate`, and must never be what turns a pod away. 64 per GPU is more containers
/// than the extender places on one GPU in practice (each would be guaranteed under 1/64
/// of it) and more than the kubelet's default of 110 pods per node on a node of two or
/// more GPUs; `--cdi-slots-per-gpu` raises it.
pub const DEFAULT_SLOTS_PER_GPU: u32 = 64;

/// The device IDs advertised for `gpus` GPUs: interchangeable slots, since a pod's GPUs
/// come from its record and not from the IDs the kubelet picks.
pub fn slot_ids(gpus: usize, per_gpu: u32) -> Vec<String> {
    let n = gpus.saturating_mul(per_gpu as usize);
    (0..n).map(|i| format!("slot-{i}")).collect()
}

/// The CDI device name of a GPU (the spec names each GPU by its UUID too).
pub fn cdi_name(gpu_uuid: &str) -> String {
    format!("{}={gpu_uuid}", super::generate::KIND)
}

/// A pod bound to this node, as the plugin needs to see it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodInfo {
    pub uid: String,
    /// `namespace/name`.
    pub key: String,
    /// When the plugin's own watch of the node's pods first saw the pod bound here, as
    /// a sequence number: the kubelet's watch delivers pods in the same order, and admits
    /// them in it. 0 for pods already bound when the plugin started (order unknown:
    /// creationTimestamp decides, as the kubelet sorts a batch), `u64::MAX` for a pod the
    /// watch has not delivered yet (`Allocate` waits for it, see [`awaiting_arrival`];
    /// past that wait it ranks last).
    pub arrival: u64,
    /// `creationTimestamp`, seconds since the epoch.
    pub created: i64,
    pub node_name: Option<String>,
    pub phase: Option<String>,
    /// `status.startTime` is set: the kubelet has admitted the pod (it sets the time on
    /// its first sync after admission).
    pub started: bool,
    pub scheduler_name: Option<String>,
    pub annotations: BTreeMap<String, String>,
    /// Init and app containers whose limits ask for the resource: the kubelet calls
    /// `Allocate` once for each.
    pub gpu_containers: u32,
}

fn asks(c: &Container, resource: &str) -> bool {
    c.resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(resource))
        .is_some_and(|q| !matches!(q.0.trim(), "" | "0"))
}

impl PodInfo {
    /// The fields the plugin uses; `None` for an object without a UID.
    pub fn from_pod(pod: &Pod, resource: &str) -> Option<PodInfo> {
        let meta = &pod.metadata;
        let spec = pod.spec.as_ref();
        let containers = spec.map(|s| {
            s.init_containers
                .iter()
                .flatten()
                .chain(&s.containers)
                .filter(|c| asks(c, resource))
                .count()
        });
        Some(PodInfo {
            uid: meta.uid.clone()?,
            arrival: u64::MAX,
            key: format!(
                "{}/{}",
                meta.namespace.as_deref().unwrap_or_default(),
                meta.name.as_deref().unwrap_or_default()
            ),
            created: meta
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second())
                .unwrap_or_default(),
            node_name: spec.and_then(|s| s.node_name.clone()),
            phase: pod.status.as_ref().and_then(|s| s.phase.clone()),
            started: pod.status.as_ref().is_some_and(|s| s.start_time.is_some()),
            scheduler_name: spec.and_then(|s| s.scheduler_name.clone()),
            annotations: meta.annotations.clone().unwrap_or_default(),
            gpu_containers: u32::try_from(containers.unwrap_or(0)).unwrap_or(u32::MAX),
        })
    }

    /// Not admitted yet: the kubelet admits a pod before it reports a start time or any
    /// phase but Pending. (A pod past admission is never taken again, even if its
    /// answers were lost.)
    fn waiting(&self) -> bool {
        !self.started && matches!(self.phase.as_deref(), None | Some("Pending"))
    }

    fn finished(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }
}

/// What has been answered, kept across restarts of the daemon: pod UID → containers of
/// that pod answered so far. Without it a restarted daemon would take a pod it already
/// answered for the one the kubelet is admitting, and hand out the wrong GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answered {
    pub pods: BTreeMap<String, u32>,
}

impl Answered {
    pub fn count(&self, uid: &str) -> u32 {
        self.pods.get(uid).copied().unwrap_or(0)
    }

    /// One more container of `grant`'s pod answered.
    pub fn record(&mut self, grant: &Grant) {
        *self.pods.entry(grant.pod_uid.clone()).or_default() += 1;
    }

    /// Forgets the pods that are gone or finished (from a complete list of the node's
    /// pods); whether anything was forgotten.
    pub fn forget_gone(&mut self, pods: &[PodInfo]) -> bool {
        let live: BTreeSet<&str> = pods
            .iter()
            .filter(|p| !p.finished())
            .map(|p| p.uid.as_str())
            .collect();
        let before = self.pods.len();
        self.pods.retain(|uid, _| live.contains(uid.as_str()));
        self.pods.len() != before
    }
}

/// The order in which pods arrived on this node, kept from the plugin's own watch of
/// the node's pods (the pure bookkeeping; [`PodInfo::arrival`] says why).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Arrivals {
    seq: BTreeMap<String, u64>,
    next: u64,
    /// The watch's first list is complete: pods listed later arrived while it ran.
    listed_once: bool,
    /// The pods of the list in progress.
    listing: BTreeSet<String>,
}

impl Arrivals {
    /// A pod delivered by a watch event (bound here, or changed).
    pub fn arrived(&mut self, uid: &str) {
        if !self.seq.contains_key(uid) {
            self.next += 1;
            self.seq.insert(uid.to_string(), self.next);
        }
    }

    /// A pod of a (re)list: of unknown order when it is the first list.
    pub fn listed(&mut self, uid: &str) {
        self.listing.insert(uid.to_string());
        if !self.listed_once {
            self.seq.entry(uid.to_string()).or_insert(0);
        } else {
            self.arrived(uid);
        }
    }

    /// The (re)list is complete: pods it did not name are gone.
    pub fn list_done(&mut self) {
        let listing = std::mem::take(&mut self.listing);
        self.seq.retain(|uid, _| listing.contains(uid));
        self.listed_once = true;
    }

    pub fn gone(&mut self, uid: &str) {
        self.seq.remove(uid);
    }

    /// The pod's place ([`PodInfo::arrival`]).
    pub fn of(&self, uid: &str) -> u64 {
        self.seq.get(uid).copied().unwrap_or(u64::MAX)
    }
}

/// The answer for one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub pod_uid: String,
    pub pod_key: String,
    /// The record's GPUs, in its order.
    pub gpus: Vec<String>,
    /// Which of the pod's asking containers this is (1-based), and how many there are.
    pub container: u32,
    pub of: u32,
}

impl Grant {
    /// The CDI devices the runtime injects into the container.
    pub fn cdi_devices(&self) -> Vec<String> {
        self.gpus.iter().map(|g| cdi_name(g)).collect()
    }
}

/// Why `Allocate` is refused; the kubelet shows the message on the pod it was admitting
/// (which then fails with `UnexpectedAdmissionError`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "no pod bound to node {node} is waiting for {resource}: it is given only to pods placed by {scheduler} from sharedgpu/* labels, with their GPUs in an allocation record"
    )]
    NoPod {
        node: String,
        resource: String,
        scheduler: String,
    },
    #[error(
        "pod {pod} asks for {resource} but {why}: {resource} goes only to pods placed by {scheduler} from sharedgpu/* labels (the webhook adds it to them)"
    )]
    NoRecord {
        pod: String,
        resource: String,
        scheduler: String,
        why: String,
    },
    #[error("pod {pod}: its allocation record names GPU {gpu}, which node {node} does not have")]
    UnknownGpu {
        pod: String,
        gpu: String,
        node: String,
    },
}

/// What [`select`] needs besides the pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Context<'a> {
    pub node: &'a str,
    /// The scheduler whose Bindings write allocation records.
    pub scheduler: &'a str,
    pub resource: &'a str,
    /// The node's GPUs (UUIDs), the devices of its CDI spec.
    pub gpus: &'a BTreeSet<String>,
}

fn candidates<'a>(
    ctx: &'a Context,
    pods: &'a [PodInfo],
    answered: &'a Answered,
) -> impl Iterator<Item = &'a PodInfo> {
    pods.iter().filter(move |p| {
        p.node_name.as_deref() == Some(ctx.node)
            && p.waiting()
            && p.gpu_containers > answered.count(&p.uid)
    })
}

/// Whether a candidate of [`select`] has not been delivered by the plugin's watch yet:
/// then the order between candidates is not known, and `Allocate` waits for the watch
/// (pods bound within a second of each other, as a Job's are, differ only there).
pub fn awaiting_arrival(ctx: &Context, pods: &[PodInfo], answered: &Answered) -> bool {
    candidates(ctx, pods, answered).any(|p| p.arrival == u64::MAX)
}

/// The pod the kubelet is admitting when it calls `Allocate`, and what its next
/// container gets. Candidates: bound to this node, not admitted yet, with containers asking
/// for the resource that have not all been answered; the first to arrive (then the
/// oldest creationTimestamp, then name) is the one, as the kubelet admits in that order. A candidate without a
/// valid record is refused rather than skipped: it is the pod being admitted, and the
/// refusal tells its owner why it gets no GPU.
pub fn select(ctx: &Context, pods: &[PodInfo], answered: &Answered) -> Result<Grant, Refusal> {
    let pod = candidates(ctx, pods, answered)
        .min_by(|a, b| {
            (a.arrival, a.created, &a.key, &a.uid).cmp(&(b.arrival, b.created, &b.key, &b.uid))
        })
        .ok_or_else(|| Refusal::NoPod {
            node: ctx.node.to_string(),
            resource: ctx.resource.to_string(),
            scheduler: ctx.scheduler.to_string(),
        })?;
    let no_record = |why: String| Refusal::NoRecord {
        pod: pod.key.clone(),
        resource: ctx.resource.to_string(),
        scheduler: ctx.scheduler.to_string(),
        why,
    };
    let alloc = match Allocation::from_annotations(&pod.annotations) {
        Ok(Some(a)) => a,
        Ok(None) => {
            return Err(no_record(format!(
                "has no allocation record (annotation {})",
                annotations::GPU_UUID
            )));
        }
        Err(e) => return Err(no_record(format!("its allocation record is bad ({e})"))),
    };
    if alloc.node != ctx.node {
        return Err(no_record(format!(
            "its allocation record is for node {}",
            alloc.node
        )));
    }
    if pod.scheduler_name.as_deref() != Some(ctx.scheduler) {
        // Only the KubeShare scheduler's Bindings write a record: this one is forged.
        return Err(no_record(format!("was not scheduled by {}", ctx.scheduler)));
    }
    if let Some(gpu) = alloc.gpu_uuids.iter().find(|g| !ctx.gpus.contains(*g)) {
        return Err(Refusal::UnknownGpu {
            pod: pod.key.clone(),
            gpu: gpu.clone(),
            node: ctx.node.to_string(),
        });
    }
    Ok(Grant {
        pod_uid: pod.uid.clone(),
        pod_key: pod.key.clone(),
        gpus: alloc.gpu_uuids,
        container: answered.count(&pod.uid) + 1,
        of: pod.gpu_containers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::{Granted, Milli};
    use proptest::prelude::*;

    const NODE: &str = "n1";
    const SCHED: &str = "kubeshare-scheduler";
    const G: [&str; 3] = [
        "GPU-00000000-0000-4000-8000-000000000000",
        "GPU-11111111-1111-4111-8111-111111111111",
        "GPU-22222222-2222-4222-8222-222222222222",
    ];

    fn gpus() -> BTreeSet<String> {
        G.iter().map(|s| s.to_string()).collect()
    }

    fn record(gpus: &[&str]) -> BTreeMap<String, String> {
        Allocation {
            node: NODE.into(),
            gpu_uuids: gpus.iter().map(|s| s.to_string()).collect(),
            gpu_mem: 1 << 30,
            gpu_model: "NVIDIA-H100".into(),
            granted: Granted::Fraction {
                request: Milli::parse("0.3").unwrap(),
                limit: Milli::parse("0.5").unwrap(),
            },
            gpu_mem_resident: None,
        }
        .to_annotations()
    }

    fn pod(name: &str, created: i64, containers: u32, gpus: &[&str]) -> PodInfo {
        PodInfo {
            uid: format!("uid-{name}"),
            key: format!("ns/{name}"),
            arrival: 0,
            created,
            node_name: Some(NODE.into()),
            phase: Some("Pending".into()),
            started: false,
            scheduler_name: Some(SCHED.into()),
            annotations: if gpus.is_empty() {
                BTreeMap::new()
            } else {
                record(gpus)
            },
            gpu_containers: containers,
        }
    }

    fn pick(pods: &[PodInfo], answered: &Answered) -> Result<Grant, Refusal> {
        let g = gpus();
        let ctx = Context {
            node: NODE,
            scheduler: SCHED,
            resource: RESOURCE,
            gpus: &g,
        };
        select(&ctx, pods, answered)
    }

    #[test]
    fn slots_are_per_gpu_and_cdi_names_are_the_specs() {
        assert_eq!(
            slot_ids(2, 3),
            ["slot-0", "slot-1", "slot-2", "slot-3", "slot-4", "slot-5"]
        );
        assert!(slot_ids(0, 64).is_empty());
        assert_eq!(cdi_name(G[0]), format!("kubeshare.io/gpu={}", G[0]));
    }

    #[test]
    fn the_oldest_waiting_pod_gets_its_records_gpus_once_per_container() {
        let pods = [pod("new", 20, 1, &[G[1]]), pod("old", 10, 2, &[G[0], G[2]])];
        let mut a = Answered::default();
        let g = pick(&pods, &a).unwrap();
        assert_eq!((g.pod_key.as_str(), g.container, g.of), ("ns/old", 1, 2));
        assert_eq!(g.cdi_devices(), [cdi_name(G[0]), cdi_name(G[2])]);
        a.record(&g);
        let g = pick(&pods, &a).unwrap();
        assert_eq!((g.pod_key.as_str(), g.container), ("ns/old", 2));
        a.record(&g);
        let g = pick(&pods, &a).unwrap();
        assert_eq!(
            (g.pod_key.as_str(), g.gpus.as_slice()),
            ("ns/new", &[G[1].to_string()][..])
        );
        a.record(&g);
        assert!(matches!(pick(&pods, &a), Err(Refusal::NoPod { .. })));
    }

    #[test]
    fn pods_bound_in_one_second_are_answered_in_the_order_they_arrived() {
        // Created and bound in the same second: the names would put "gone" first, but
        // the kubelet admits "keep" first because it was bound (and delivered) first.
        let mut keep = pod("keep", 7, 1, &[G[0]]);
        keep.arrival = 3;
        let mut gone = pod("gone", 7, 1, &[G[1]]);
        gone.arrival = 4;
        let mut a = Answered::default();
        let g = pick(&[keep.clone(), gone.clone()], &a).unwrap();
        assert_eq!(g.pod_key, "ns/keep");
        a.record(&g);
        keep.started = true;
        let g = pick(&[keep.clone(), gone.clone()], &a).unwrap();
        assert_eq!(
            (g.pod_key.as_str(), g.gpus.as_slice()),
            ("ns/gone", &[G[1].to_string()][..])
        );
        // Known arrivals come before one the watch has not delivered yet, and pods of the
        // first list (0) before both, oldest first.
        let mut late = pod("late", 1, 1, &[G[0]]);
        late.arrival = u64::MAX;
        let listed = pod("listed", 9, 1, &[G[0]]);
        let pods = [late, gone, listed];
        assert_eq!(
            pick(&pods, &Answered::default()).unwrap().pod_key,
            "ns/listed"
        );
        assert_eq!(
            pick(&pods[..2], &Answered::default()).unwrap().pod_key,
            "ns/gone"
        );
        // The order is known only once the watch has delivered every candidate.
        let g = gpus();
        let ctx = Context {
            node: NODE,
            scheduler: SCHED,
            resource: RESOURCE,
            gpus: &g,
        };
        assert!(awaiting_arrival(&ctx, &pods, &Answered::default()));
        assert!(!awaiting_arrival(&ctx, &pods[1..], &Answered::default()));
        let mut done = Answered::default();
        done.pods.insert("uid-late".into(), 1);
        assert!(!awaiting_arrival(&ctx, &pods, &done));
    }

    #[test]
    fn arrivals_follow_the_watch() {
        let mut a = Arrivals::default();
        a.listed("old1");
        a.listed("old2");
        a.list_done();
        a.arrived("new1");
        a.arrived("new2");
        a.arrived("new1"); // an update, not an arrival
        assert_eq!(
            ["old1", "old2", "new1", "new2", "unseen"].map(|u| a.of(u)),
            [0, 0, 1, 2, u64::MAX]
        );
        // A relist after a watch error: the known keep their place, a newcomer comes
        // last, and what it does not name is gone.
        a.listed("new2");
        a.listed("old1");
        a.listed("new3");
        a.list_done();
        assert_eq!(
            ["old1", "new2", "new3", "new1"].map(|u| a.of(u)),
            [0, 2, 3, u64::MAX]
        );
        a.gone("new2");
        assert_eq!(a.of("new2"), u64::MAX);
    }

    #[test]
    fn running_finished_elsewhere_and_non_asking_pods_are_not_candidates() {
        let mut running = pod("running", 1, 1, &[G[0]]);
        running.phase = Some("Running".into());
        // Admitted, still in its init containers: Pending, but with a start time.
        let mut initing = pod("initing", 0, 2, &[G[0]]);
        initing.started = true;
        let mut done = pod("done", 2, 1, &[G[0]]);
        done.phase = Some("Succeeded".into());
        let mut other = pod("other", 3, 1, &[G[0]]);
        other.node_name = Some("n2".into());
        let plain = pod("plain", 4, 0, &[]);
        let pods = [
            running,
            initing,
            done,
            other,
            plain,
            pod("it", 9, 1, &[G[1]]),
        ];
        assert_eq!(pick(&pods, &Answered::default()).unwrap().pod_key, "ns/it");
        let e = pick(&pods[..5], &Answered::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no pod bound to node n1 is waiting for kubeshare.io/gpu: it is given only to pods placed by kubeshare-scheduler from sharedgpu/* labels, with their GPUs in an allocation record"
        );
    }

    #[test]
    fn a_pod_without_a_valid_record_is_refused_and_named() {
        let e = pick(&[pod("bare", 1, 1, &[])], &Answered::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "pod ns/bare asks for kubeshare.io/gpu but has no allocation record (annotation sharedgpu/gpu_uuid): kubeshare.io/gpu goes only to pods placed by kubeshare-scheduler from sharedgpu/* labels (the webhook adds it to them)"
        );
        let mut forged = pod("forged", 1, 1, &[G[0]]);
        forged.scheduler_name = Some("default-scheduler".into());
        assert!(
            pick(&[forged], &Answered::default())
                .unwrap_err()
                .to_string()
                .contains("was not scheduled by kubeshare-scheduler")
        );
        let mut moved = pod("moved", 1, 1, &[G[0]]);
        moved.annotations = {
            let mut r = record(&[G[0]]);
            r.insert(annotations::NODE.into(), "n2".into());
            r
        };
        assert!(
            pick(&[moved], &Answered::default())
                .unwrap_err()
                .to_string()
                .contains("is for node n2")
        );
        let mut broken = pod("broken", 1, 1, &[G[0]]);
        broken.annotations.remove(annotations::GPU_MEM);
        assert!(matches!(
            pick(&[broken], &Answered::default()),
            Err(Refusal::NoRecord { .. })
        ));
        let gone = "GPU-99999999-9999-4999-8999-999999999999";
        assert_eq!(
            pick(&[pod("lost", 1, 1, &[gone])], &Answered::default()),
            Err(Refusal::UnknownGpu {
                pod: "ns/lost".into(),
                gpu: gone.into(),
                node: NODE.into()
            })
        );
    }

    #[test]
    fn a_pod_deleted_half_answered_is_forgotten_and_the_next_one_is_answered() {
        let mut pods = vec![pod("a", 1, 2, &[G[0]]), pod("b", 2, 1, &[G[1]])];
        let mut a = Answered::default();
        let g = pick(&pods, &a).unwrap();
        assert_eq!(g.pod_key, "ns/a");
        a.record(&g);
        pods.remove(0);
        assert!(a.forget_gone(&pods));
        let g = pick(&pods, &a).unwrap();
        assert_eq!((g.pod_key.as_str(), g.container), ("ns/b", 1));
        assert_eq!(g.gpus, [G[1]]);
    }

    #[test]
    fn forgets_gone_and_finished_pods_only() {
        let mut a = Answered::default();
        for p in ["a", "b", "c"] {
            a.pods.insert(format!("uid-{p}"), 1);
        }
        let mut b = pod("b", 1, 1, &[G[0]]);
        b.phase = Some("Failed".into());
        let c = pod("c", 1, 1, &[G[0]]);
        assert!(a.forget_gone(&[b, c.clone()]));
        assert_eq!(a.pods, BTreeMap::from([("uid-c".to_string(), 1)]));
        assert!(!a.forget_gone(&[c]));
    }

    #[test]
    fn pod_info_counts_the_containers_that_ask() {
        let p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u",
                "creationTimestamp": "2026-01-02T03:04:05Z"},
            "spec": {
                "nodeName": NODE, "schedulerName": SCHED,
                "initContainers": [
                    {"name": "i1", "resources": {"limits": {RESOURCE: "1"}}},
                    {"name": "i2"}
                ],
                "containers": [
                    {"name": "a", "resources": {"limits": {RESOURCE: "1", "cpu": "1"}}},
                    {"name": "b", "resources": {"limits": {"cpu": "1"}}},
                    {"name": "c", "resources": {"limits": {RESOURCE: "0"}}},
                    {"name": "d", "resources": {"requests": {RESOURCE: "1"}}}
                ]
            },
            "status": {"phase": "Pending"}
        }))
        .unwrap();
        let mut started = p.clone();
        started.status.as_mut().unwrap().start_time = p.metadata.creation_timestamp.clone();
        assert!(!PodInfo::from_pod(&started, RESOURCE).unwrap().waiting());
        let i = PodInfo::from_pod(&p, RESOURCE).unwrap();
        assert_eq!(i.gpu_containers, 2);
        assert_eq!(i.key, "ns/p");
        assert_eq!(i.created, 1_767_323_045);
        assert_eq!(i.node_name.as_deref(), Some(NODE));
        assert!(i.waiting());
    }

    #[test]
    fn the_checkpoint_round_trips() {
        let mut a = Answered::default();
        a.pods.insert("u1".into(), 2);
        let text = serde_json::to_string(&a).unwrap();
        assert_eq!(text, r#"{"pods":{"u1":2}}"#);
        assert_eq!(serde_json::from_str::<Answered>(&text).unwrap(), a);
    }

    /// One pod of a simulated node: when it arrived (0: before the plugin started), its
    /// containers and the GPUs of its record (none: a pod asking for the resource
    /// without a record).
    #[derive(Debug, Clone)]
    struct Sim {
        arrival: u64,
        created: i64,
        containers: u32,
        gpus: Vec<usize>,
    }

    fn sims() -> impl Strategy<Value = Vec<Sim>> {
        prop::collection::vec(
            (
                0u64..4,
                0i64..5,
                1u32..4,
                prop::collection::vec(0usize..3, 0..3),
            )
                .prop_map(|(arrival, created, containers, mut gpus)| {
                    gpus.sort_unstable();
                    gpus.dedup();
                    Sim {
                        arrival,
                        created,
                        containers,
                        gpus,
                    }
                }),
            1..7,
        )
    }

    proptest! {
        /// Several pods bound at once, admitted by the kubelet one at a time in its
        /// order (as they arrived, a batch oldest first; a container at a time; pods
        /// created in one second bound in any order), with the daemon restarted at
        /// random points (the answers reloaded from their checkpoint) and a pod
        /// deleted before its turn: every container of a pod with a record gets
        /// exactly that record's GPUs, a pod without one is refused by name (and the
        /// kubelet fails it), a deleted pod is forgotten, and nothing is left over.
        #[test]
        fn every_container_gets_its_own_pods_gpus(
            sims in sims(),
            restarts in prop::collection::vec(any::<bool>(), 32),
            deleted in prop::option::of(0usize..7),
        ) {
            let mut pods: Vec<PodInfo> = sims
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let gpus: Vec<&str> = s.gpus.iter().map(|g| G[*g]).collect();
                    let mut p = pod(&format!("p{i}"), s.created, s.containers, &gpus);
                    // Distinct arrivals after the first list (0).
                    p.arrival = if s.arrival == 0 { 0 } else { s.arrival * 10 + i as u64 };
                    p
                })
                .collect();
            if let Some(d) = deleted.filter(|d| *d < pods.len()) {
                pods.remove(d);
            }
            // The kubelet's admission order.
            let mut order: Vec<usize> = (0..pods.len()).collect();
            order.sort_by(|a, b| {
                let k = |p: &PodInfo| (p.arrival, p.created, p.key.clone());
                k(&pods[*a]).cmp(&k(&pods[*b]))
            });
            let mut answered = Answered::default();
            let mut step = 0;
            for i in order {
                for c in 1..=pods[i].gpu_containers {
                    if restarts[step % restarts.len()] {
                        let text = serde_json::to_vec(&answered).unwrap();
                        answered = serde_json::from_slice(&text).unwrap();
                        prop_assert!(!answered.forget_gone(&pods));
                    }
                    step += 1;
                    let got = pick(&pods, &answered);
                    if pods[i].annotations.is_empty() {
                        let err = got.unwrap_err();
                        prop_assert!(err.to_string().contains(&pods[i].key), "{}", err);
                        pods[i].phase = Some("Failed".into());
                        break;
                    }
                    let g = got.unwrap();
                    prop_assert_eq!(&g.pod_key, &pods[i].key);
                    prop_assert_eq!(g.container, c);
                    let want: Vec<String> = sims[..]
                        .iter()
                        .enumerate()
                        .find(|(j, _)| format!("ns/p{j}") == pods[i].key)
                        .map(|(_, s)| s.gpus.iter().map(|g| G[*g].to_string()).collect())
                        .unwrap();
                    prop_assert_eq!(&g.gpus, &want);
                    answered.record(&g);
                }
                if pods[i].phase.as_deref() == Some("Pending") {
                    pods[i].started = true;
                    if restarts[step % restarts.len()] {
                        // Admitted, still in its init containers.
                        continue;
                    }
                    pods[i].phase = Some("Running".into());
                }
            }
            let none = matches!(pick(&pods, &answered), Err(Refusal::NoPod { .. }));
            prop_assert!(none);
            // Pods that were admitted keep their counts until they are gone.
            pods.retain(|p| p.started);
            let running = pods.len();
            answered.forget_gone(&pods);
            prop_assert_eq!(answered.pods.len(), running);
            pods.clear();
            answered.forget_gone(&pods);
            prop_assert!(answered.pods.is_empty());
        }
    }
}
