//! Placement: which node and which GPU(s) a KubeShare pod gets.
//!
//! Pure decision logic: no I/O and no clock (callers pass `now_ms`), and
//! deterministic (explicit tie-breaks; no answer depends on a hash map's
//! order), so it is unit- and property-tested on its own. The books are
//! integers (milli-units, bytes) held per GPU and updated incrementally from
//! *bookings*: one per pod, either observed (the pod's allocation annotations,
//! the source of truth), assumed (bound by us, not yet seen in the watch) or
//! reserved (coscheduling: capacity held for a group member that has not been
//! bound yet).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use kubeshare_api::{Allocation, GpuDemand, GpuInfo, GpuShare, Granted};
use memo::Verdict;

mod assume;
mod books;
mod claimed;
mod error;
mod fit;
mod memo;
mod nodes;
mod preempt;
mod refused;
mod views;
pub use books::RecordProblem;
pub use error::{
    BindRefused, BooksInconsistent, FitError, Gib, GpuMisfit, GpuWhy, GroupWait, NodeProblem,
    Preempting, RecordError,
};
pub use preempt::{
    PREEMPTION_ANNOTATION, PodRef, PreemptOrder, PreemptRecord, Preemptor, Resumed, VictimCost,
};

/// What the watch (or a filter request) tells us about one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodInfo {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub node_name: Option<String>,
    /// Succeeded or Failed: it holds nothing any more.
    pub terminal: bool,
    /// `Ok(None)`: the pod asks for no GPU. `Err`: labels that break a rule.
    pub demand: Result<Option<GpuDemand>, String>,
    /// The allocation record (`Err` when malformed).
    pub allocation: Result<Option<Allocation>, String>,
    /// `metadata.resourceVersion` as a number (`None` when absent or not numeric):
    /// an event older than what is held is ignored.
    pub resource_version: Option<u64>,
    /// A KubeShare pod (our scheduler name or `sharedgpu/gpu_*` labels): only its
    /// record is booked.
    pub kubeshare: bool,
    /// `spec.priority` (its PriorityClass's value; 0 when unset): a pod never
    /// preempts one with a higher value.
    pub pod_priority: i32,
    /// `metadata.deletionTimestamp` is set: it is leaving (it still holds its
    /// share until it is gone).
    pub terminating: bool,
    /// The preemption record the extender wrote on the pod before evicting for
    /// it ([`PREEMPTION_ANNOTATION`]); `None` when absent or malformed.
    pub preemption: Option<PreemptRecord>,
}

/// A coscheduling group: namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)
    }
}

/// Tunables of the placement.
#[derive(Debug, Clone)]
pub struct Config {
    /// How long capacity reserved for an admitted group's member is held.
    pub reservation_timeout_ms: u64,
    /// How far unified-memory pods may overcommit a GPU's memory, in thousandths
    /// (`--um-overcommit`; [`crate::um_fit`]).
    pub um_overcommit_milli: u32,
    /// Filter passes only the best this many fitting nodes (0: every fitting
    /// node). With 1, kube-scheduler takes the extender's node without scoring
    /// and without calling prioritize (`--filter-top`).
    pub filter_top: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            reservation_timeout_ms: 30_000,
            um_overcommit_milli: crate::um_fit::DEFAULT_UM_OVERCOMMIT_MILLI,
            filter_top: 0,
        }
    }
}

/// What bind's decision half answers.
#[derive(Debug, Clone, PartialEq)]
pub enum BindStep {
    /// Booked as assumed: write this record with the Binding.
    Go(Box<BindDecision>),
    /// A member of a group whose quorum has not reached bind yet: wait at the
    /// gate ([`Cluster::poll_gate`]) until the group is released or the wait ends.
    Wait,
}

/// What a filter call decided, for the wire reply and the metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FilterOutcome {
    pub passed: Vec<String>,
    pub failed: BTreeMap<String, String>,
    pub unresolvable: BTreeMap<String, String>,
    pub kind: FilterKind,
    /// No name fits, but the pod was nominated to a node outside them that does
    /// (so it does not preempt).
    pub fits_elsewhere: bool,
}

/// The kind of answer, as counted by the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FilterKind {
    /// Not a GPU pod: every node passes.
    #[default]
    NotGpu,
    /// Some node fits.
    Fits,
    /// No node fits.
    NoFit,
    /// The pod's labels are invalid.
    InvalidLabels,
    /// A coscheduling group that cannot start yet.
    GroupWaiting,
    /// The member of an admitted group, held to its reserved node.
    GroupReserved,
    /// A guaranteed pod that preempts: its victims are being evicted.
    Preempting,
}

impl FilterKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FilterKind::NotGpu => "not_gpu",
            FilterKind::Fits => "fits",
            FilterKind::NoFit => "no_fit",
            FilterKind::InvalidLabels => "invalid_labels",
            FilterKind::GroupWaiting => "group_waiting",
            FilterKind::GroupReserved => "group_reserved",
            FilterKind::Preempting => "preempting",
        }
    }
}

/// What bind decided: the allocation to write (None for a pod without GPUs).
#[derive(Debug, Clone, PartialEq)]
pub struct BindDecision {
    pub allocation: Option<Allocation>,
    /// Human summary for the pod's event.
    pub summary: String,
    /// The pod's `resourceVersion` and demand the decision was made from: the
    /// Binding carries the first as a precondition; on a conflict, a pod whose
    /// labels differ from the second is not bound.
    pub rv: Option<u64>,
    pub demand: Option<GpuDemand>,
}

/// The allocation of one GPU, for the metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuUsage {
    pub node: String,
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub used_milli: u32,
    /// Memory caps of device-mode pods.
    pub mem_used: u64,
    /// Resident shares of unified-memory pods (may overcommit: docs/um.md).
    pub um_resident: u64,
    pub mem_total: u64,
    pub holders: u32,
    /// What DRA ResourceClaims hold of it (`claimed.rs`): share in thousandths,
    /// memory in bytes (at most the GPU's), and how many claims.
    pub claimed_milli: u32,
    pub claimed_mem: u64,
    pub claims: u32,
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    /// From the pod's record, as the watch (or a GET) shows it.
    Observed,
    /// Booked by our bind at `since`; `settled` once the bind's API calls are over
    /// (then it is checked against the API after a deadline if still not observed);
    /// `bound` when the Binding was answered OK (not when its outcome is unknown).
    Assumed {
        since: u64,
        settled: bool,
        bound: bool,
    },
    /// Held for a group member until `deadline`; `at_gate` while its bind waits
    /// for the group's quorum.
    Reserved { deadline: u64, at_gate: bool },
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Tags {
    /// `namespace/tag`: affinity and anti-affinity are scoped to a namespace.
    affinity: Option<String>,
    anti: Option<String>,
    /// Cluster-wide: exclusion keeps parties apart, whatever their namespace.
    exclusion: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
struct Booking {
    node: String,
    gpus: Vec<String>,
    milli: u32,
    /// What is booked against each GPU's memory: the cap, or a unified-memory pod's
    /// resident share.
    mem: u64,
    /// Unified-memory mode: the managed ceiling (the record's `gpu_mem`); `None`: device mode.
    managed: Option<u64>,
    model: String,
    granted: Granted,
    tags: Tags,
    group: Option<GroupKey>,
    kind: Kind,
}

impl Booking {
    /// Same place and share (the kind aside).
    fn same_grant(&self, o: &Booking) -> bool {
        (
            &self.node,
            &self.gpus,
            self.milli,
            self.mem,
            self.managed,
            &self.model,
            self.granted,
        ) == (
            &o.node, &o.gpus, o.milli, o.mem, o.managed, &o.model, o.granted,
        )
    }
    fn on(&self, node: &str, uuid: &str) -> bool {
        self.node == node && self.gpus.iter().any(|u| u == uuid)
    }
    fn deadline(&self) -> Option<u64> {
        match self.kind {
            Kind::Observed | Kind::Assumed { .. } => None,
            Kind::Reserved { deadline, .. } => Some(deadline),
        }
    }
}

#[derive(Debug, Clone)]
struct PodEntry {
    namespace: String,
    name: String,
    node_name: Option<String>,
    demand: Result<Option<GpuDemand>, String>,
    group: Option<GroupKey>,
    /// The newest `resourceVersion` seen.
    rv: Option<u64>,
    /// The scheduler has asked us to filter it: it passed kube-scheduler's own
    /// checks somewhere. A group is admitted only on members that did.
    filtered: bool,
    /// The node we last asked kube-scheduler to try first for it (its
    /// `status.nominatedNodeName`): asked once per node, so a node that
    /// kube-scheduler's own filters reject cannot start a loop of retries.
    nominated: Option<String>,
    /// `spec.priority`: a preemptor never evicts a pod with a higher one.
    priority: i32,
    /// Nodes where evicting for this pod was refused (a PodDisruptionBudget),
    /// with the time until which its preemption leaves them out.
    blocked: BTreeMap<String, u64>,
    /// Being deleted: already leaving (a restarted extender does not evict it again).
    terminating: bool,
    /// Its preemption record, read back by a restarted extender.
    preemption: Option<PreemptRecord>,
}

/// A pending pod tied to one node (its group's reserved place, its affinity
/// tag's node) that kube-scheduler's search may not reach: the extender sets
/// the pod's `status.nominatedNodeName`, which kube-scheduler evaluates before
/// any other node, and wakes the pod.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Nomination {
    pub namespace: String,
    pub name: String,
    pub node: String,
}

/// What ResourceClaims hold of one GPU (the stock scheduler's bookings, `claimed.rs`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ClaimHold {
    milli: u32,
    mem: u64,
    /// The claims, `namespace/name`, comma-separated (for the reason a pod is refused).
    names: String,
    count: u32,
}

/// Room promised on a GPU to a preemptor whose victims are still leaving: what it
/// will take there beyond what its victims free (`preempt.rs`). Other pods see it
/// as used, so that the room the victims free is the preemptor's whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Promise {
    /// The preemptor's uid (its own evaluation does not count it).
    uid: String,
    /// `namespace/name`, for the reason a pod is refused.
    pod: String,
    milli: u32,
    /// Device memory.
    mem: u64,
}

#[derive(Debug, Clone)]
struct Gpu {
    info: GpuInfo,
    /// What ResourceClaims hold, on top of the label pods' bookings below.
    claimed: ClaimHold,
    /// Room promised to preemptors waiting for their victims.
    promised: Vec<Promise>,
    used: u32,
    /// Caps of device-mode pods.
    mem_used: u64,
    /// Resident shares of unified-memory pods.
    um_used: u64,
    holders: u32,
    affinity: BTreeMap<String, u32>,
    anti: BTreeMap<String, u32>,
    exclusion: BTreeMap<String, u32>,
}

#[derive(Debug, Clone)]
struct Node {
    /// Small and dense (freed ids are reused), so per-decision tables are
    /// vectors indexed by it rather than maps keyed by the name.
    id: u32,
    /// The books' version when this node or its books last changed: a
    /// verdict judged at this stamp still holds (`memo.rs`).
    stamp: u64,
    /// In NVML index order.
    gpus: Vec<Gpu>,
    by_uuid: HashMap<String, usize>,
}

/// foldhash: node names are hashed once or twice per node per decision, where
/// SipHash or a `BTreeMap`'s string compares took a tenth of the decision time.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The cluster as the extender sees it, and every decision it makes.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    cfg: Config,
    nodes: FastMap<String, Node>,
    /// Node ids given back by deleted nodes, reused first.
    free_ids: Vec<u32>,
    next_id: u32,
    /// Nodes we know but cannot place on, with the reason.
    node_problems: BTreeMap<String, NodeProblem>,
    pods: HashMap<String, PodEntry>,
    bookings: HashMap<String, Booking>,
    by_node: HashMap<String, BTreeSet<String>>,
    /// Group → member pod name → uid.
    groups: HashMap<GroupKey, BTreeMap<String, String>>,
    /// Affinity tag → (node, uuid) → number of holders.
    affinity: HashMap<String, BTreeMap<(String, String), u32>>,
    /// Reservations by deadline.
    timed: BTreeSet<(u64, String)>,
    /// Bumped on every change of the books or the nodes.
    version: u64,
    /// The last filter's raw scores, reused by the prioritize call that
    /// follows it when nothing changed in between.
    scores: Option<ScoreCache>,
    /// Verdicts of recent demands per node, reused while the node is unchanged.
    memo: memo::Memo,
    /// Record problems not yet reported.
    problems: Vec<RecordProblem>,
    /// Unbound members of groups whose places were freed, not yet woken.
    wake: Vec<(String, String)>,
    /// Pods tied to a node that kube-scheduler did not send, not yet nominated.
    nominate: Vec<Nomination>,
    /// Pods refused for room, woken when room frees on their nodes (`refused.rs`).
    refused: refused::Refused,
    /// Pods deleted or finished (bounded, oldest forgotten first).
    gone: HashSet<String>,
    gone_order: std::collections::VecDeque<String>,
    /// Preemptions under way, by the preemptor's uid (`preempt.rs`).
    preempting: HashMap<String, preempt::Preemption>,
    /// Victims being evicted → the preemptors waiting for them.
    evicting: HashMap<String, Vec<String>>,
    /// The newest `now_ms` a caller passed: the clock of what happens inside a
    /// watch event (a preemption completed by a victim's deletion).
    now_hint: u64,
    /// What ResourceClaims hold, by (node, device) (`claimed.rs`).
    claimed: crate::claims::Claimed,
    /// The preemptions of a previous extender have been taken up
    /// ([`Cluster::resume_preemptions`]): once, before the first decision.
    resumed: bool,
}

#[derive(Debug, Clone)]
struct ScoreCache {
    uid: String,
    version: u64,
    demand: GpuDemand,
    /// Raw score by node id; `NO_SCORE` for nodes that did not pass.
    raw: Vec<u64>,
}

const NO_SCORE: u64 = u64::MAX;

/// kube-scheduler's `minFeasibleNodesToFind`: it looks for at least this many
/// feasible nodes (when the cluster has them) before it calls the extender.
const SEARCH_MIN_NODES: usize = 100;

/// One candidate answer for a pod on a node.
#[derive(Debug, Clone)]
struct Choice {
    /// Indexes into the node's GPU list, in device order (inline: one
    /// Choice per node evaluated, so no allocation each).
    gpus: smallvec::SmallVec<[usize; 8]>,
    mem: u64,
    /// Unified-memory mode: the managed ceiling.
    managed: Option<u64>,
    raw: u64,
}

/// A pod being placed.
struct Req<'a> {
    uid: &'a str,
    ns: &'a str,
    demand: &'a GpuDemand,
    group: Option<GroupKey>,
    /// Nodes holding other members of its group.
    group_nodes: HashSet<String>,
    /// Its own booking (an interrupted bind), which does not count against it.
    own: Option<&'a Booking>,
    /// Its tags as the books key them (namespace-scoped where they are).
    tags: Tags,
    /// (node, GPU) → share that pending pods of another affinity tag need there.
    protect: HashMap<(String, String), u32>,
    /// Where its affinity tag already lives (its own stale booking aside); computed
    /// once per request, not per node.
    tag_locs: Option<BTreeSet<(String, String)>>,
}

/// Why one GPU does not fit; the most promising failure is shown.
struct GpuFail {
    /// (checks passed, free share) – larger is closer to fitting.
    rank: (u8, u32),
    idx: u32,
    why: error::GpuWhy,
}

fn gib(bytes: u64) -> String {
    error::Gib(bytes).to_string()
}

fn group_key(ns: &str, d: &GpuDemand) -> Option<GroupKey> {
    d.group.as_ref().map(|g| GroupKey {
        namespace: ns.to_string(),
        name: g.name.clone(),
    })
}

fn tags_of(ns: &str, d: Option<&GpuDemand>) -> Tags {
    let Some(d) = d else {
        return Tags::default();
    };
    Tags {
        affinity: d.affinity.as_ref().map(|t| format!("{ns}/{t}")),
        anti: d.anti_affinity.as_ref().map(|t| format!("{ns}/{t}")),
        exclusion: d.exclusion.clone(),
    }
}

/// The node of a set of (node, GPU) places, when they are all on one.
fn single_node(l: &BTreeSet<(String, String)>) -> Option<String> {
    let first = &l.first()?.0;
    l.iter().all(|(n, _)| n == first).then(|| first.clone())
}

fn bump(m: &mut BTreeMap<String, u32>, k: &Option<String>, add: bool) {
    let Some(k) = k else { return };
    if add {
        *m.entry(k.clone()).or_default() += 1;
    } else if let Some(c) = m.get_mut(k) {
        *c = c.saturating_sub(1);
        if *c == 0 {
            m.remove(k);
        }
    }
}

/// Maps raw node scores (aligned with `names`) to the extender's 0..=10: the
/// best node (first by name on ties) gets 10, the others at most 9, so our
/// preference is never a coin toss.
fn scale_scores(names: &[String], raw: &[Option<u64>]) -> Vec<(String, i64)> {
    let fits = raw.iter().filter_map(|r| *r);
    let (Some(min), Some(max)) = (fits.clone().min(), fits.max()) else {
        return names.iter().map(|n| (n.clone(), 0)).collect();
    };
    let best = names
        .iter()
        .zip(raw)
        .filter(|(_, r)| **r == Some(max))
        .map(|(n, _)| n.as_str())
        .min();
    names
        .iter()
        .zip(raw)
        .map(|(n, r)| {
            let s = match *r {
                None => 0,
                Some(_) if Some(n.as_str()) == best => 10,
                Some(_) if max == min => 9,
                Some(r) => ((u128::from(r - min) * 9) / u128::from(max - min)) as i64,
            };
            (n.clone(), s)
        })
        .collect()
}

impl Cluster {
    pub fn new(cfg: Config) -> Cluster {
        Cluster {
            cfg,
            ..Cluster::default()
        }
    }

    // ------------------------------------------------------------ decisions

    /// The extender's filter: which of `names` can take the pod.
    pub fn filter(&mut self, pod: &PodInfo, names: &[String], now_ms: u64) -> FilterOutcome {
        let w = self.expire(now_ms);
        self.wake.extend(w);
        let mut out = FilterOutcome::default();
        let demand = match &pod.demand {
            Ok(None) => {
                // Remembered so that its bind needs no GET of the pod when the
                // watch has not shown it yet (the watch forgets it once bound).
                self.note_pod(pod);
                out.passed = names.to_vec();
                return out;
            }
            Err(e) => {
                let msg = format!("invalid sharedgpu labels: {e}");
                out.unresolvable = names.iter().map(|n| (n.clone(), msg.clone())).collect();
                out.kind = FilterKind::InvalidLabels;
                return out;
            }
            Ok(Some(d)) => d.clone(),
        };
        self.note_pod(pod);
        if let Some(e) = self.pods.get_mut(&pod.uid) {
            e.filtered = true;
        }
        // A preemptor waits until its victims have left (then its room is
        // reserved, below).
        if let Some(wait) = self.preempt_waiting(&pod.uid) {
            let msg = wait.to_string();
            out.failed = names.iter().map(|n| (n.clone(), msg.clone())).collect();
            out.kind = FilterKind::Preempting;
            return out;
        }
        // A member of an admitted group (or a preemptor whose victims have left)
        // goes where its reservation is.
        if let Some(reserved) = self.reserved_node(&pod.uid) {
            if !names.contains(&reserved) {
                self.nominate_to(&pod.uid, &reserved);
            }
            return self.hold_to(names, &reserved, &demand);
        }
        if let (Some(spec), Some(key)) = (&demand.group, group_key(&pod.namespace, &demand)) {
            match self.admit_group(pod, spec, &key, names, now_ms) {
                Err(wait) => {
                    let msg = wait.to_string();
                    out.failed = names.iter().map(|n| (n.clone(), msg.clone())).collect();
                    out.kind = FilterKind::GroupWaiting;
                    return out;
                }
                Ok(Some(node)) => return self.hold_to(names, &node, &demand),
                Ok(None) => {}
            }
        }
        let mut memo = std::mem::take(&mut self.memo);
        let req = self.req(&pod.uid, &pod.namespace, &demand);
        let slot = memo.slot(&req);
        let mut raw = vec![NO_SCORE; self.next_id as usize];
        out.passed.reserve(names.len());
        for n in names {
            match memo.judge(self, &req, n, slot) {
                (Verdict::Fits(r), id) => {
                    if let Some(slot) = id.and_then(|id| raw.get_mut(id)) {
                        *slot = r;
                    }
                    out.passed.push(n.clone());
                }
                (Verdict::Fails(msg, true), _) => {
                    out.unresolvable.insert(n.clone(), msg);
                }
                (Verdict::Fails(msg, false), _) => {
                    out.failed.insert(n.clone(), msg);
                }
            }
        }
        // Fits none of the names sent: tied by its affinity tag to one node that
        // kube-scheduler did not send, or a fit outside the part of the cluster
        // its search covered.
        let elsewhere = match &req.tag_locs {
            _ if !out.passed.is_empty() => None,
            Some(l) => single_node(l).filter(|n| self.nodes.contains_key(n) && !names.contains(n)),
            None => self.best_unsent(&mut memo, &req, slot, names),
        };
        drop(req);
        self.memo = memo;
        if let Some(n) = elsewhere {
            self.nominate_to(&pod.uid, &n);
            out.fits_elsewhere = true;
        }
        self.keep_best(&mut out.passed, &raw);
        out.kind = if out.passed.is_empty() {
            FilterKind::NoFit
        } else {
            FilterKind::Fits
        };
        // Refused where room may free up: woken when it does, since the
        // event that freed it may have reached kube-scheduler before our watch.
        if out.passed.is_empty() && !out.failed.is_empty() {
            self.refused
                .refuse(&pod.uid, self.version, out.failed.keys());
        } else {
            self.refused.clear(&pod.uid);
        }
        self.scores = Some(ScoreCache {
            uid: pod.uid.clone(),
            version: self.version,
            demand,
            raw,
        });
        out
    }

    /// With `filter_top` set, keeps only the best fitting nodes: by raw score,
    /// then by name, as prioritize ranks them. The others are left out of the
    /// answer altogether (not failed): kube-scheduler drops them silently.
    fn keep_best(&self, passed: &mut Vec<String>, raw: &[u64]) {
        let top = self.cfg.filter_top;
        if top == 0 || passed.len() <= top {
            return;
        }
        let score = |n: &String| {
            self.nodes
                .get(n)
                .and_then(|node| raw.get(node.id as usize))
                .copied()
                .unwrap_or(0)
        };
        let mut ranked: Vec<(u64, String)> = passed.drain(..).map(|n| (score(&n), n)).collect();
        let by_rank = |a: &(u64, String), b: &(u64, String)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
        ranked.select_nth_unstable_by(top - 1, by_rank);
        ranked.truncate(top);
        ranked.sort_unstable_by(by_rank);
        passed.extend(ranked.into_iter().map(|(_, n)| n));
    }

    /// The best node outside `names` that fits, when kube-scheduler may have
    /// stopped its search early: it stops once it has found
    /// [`SEARCH_MIN_NODES`] (or `percentageOfNodesToScore` of the nodes)
    /// feasible, so a pod that fits few nodes (a rare model, a large share) may
    /// not be sent any of them. With fewer names it searched every node and the
    /// others failed its own filters: nothing to suggest.
    fn best_unsent(
        &self,
        memo: &mut memo::Memo,
        req: &Req,
        slot: Option<usize>,
        names: &[String],
    ) -> Option<String> {
        if names.len() < SEARCH_MIN_NODES || names.len() >= self.nodes.len() {
            return None;
        }
        let sent: HashSet<&str> = names.iter().map(String::as_str).collect();
        let mut best: Option<(u64, &String)> = None;
        for n in self.nodes.keys().filter(|n| !sent.contains(n.as_str())) {
            if let (Verdict::Fits(r), _) = memo.judge(self, req, n, slot)
                && best.is_none_or(|(br, bn)| r > br || (r == br && n < bn))
            {
                best = Some((r, n));
            }
        }
        best.map(|(_, n)| n.clone())
    }

    /// Asks kube-scheduler to try `node` first for pod `uid`, once per node.
    pub(super) fn nominate_to(&mut self, uid: &str, node: &str) {
        let Some(e) = self.pods.get_mut(uid) else {
            return;
        };
        if e.node_name.is_some() || e.nominated.as_deref() == Some(node) {
            return;
        }
        e.nominated = Some(node.to_string());
        self.nominate.push(Nomination {
            namespace: e.namespace.clone(),
            name: e.name.clone(),
            node: node.to_string(),
        });
    }

    /// Pods to nominate (and wake), since the last call.
    pub fn take_nominations(&mut self) -> Vec<Nomination> {
        let mut n = std::mem::take(&mut self.nominate);
        n.sort();
        n.dedup();
        n
    }

    fn reserved_node(&self, uid: &str) -> Option<String> {
        self.bookings
            .get(uid)
            .filter(|b| matches!(b.kind, Kind::Reserved { .. }))
            .map(|b| b.node.clone())
    }

    fn hold_to(&self, names: &[String], node: &str, d: &GpuDemand) -> FilterOutcome {
        let g = d.group.as_ref().map_or("", |g| g.name.as_str());
        let mut out = FilterOutcome {
            kind: FilterKind::GroupReserved,
            ..FilterOutcome::default()
        };
        for n in names {
            if n == node {
                out.passed.push(n.clone());
            } else {
                // Unresolvable: kube-scheduler's preemption has nothing to try here.
                out.unresolvable.insert(
                    n.clone(),
                    format!("group {g}: this member's place is reserved on {node}"),
                );
            }
        }
        out
    }

    /// The extender's prioritize: 0..=10 per node, 10 for the one we would pick.
    pub fn prioritize(&self, pod: &PodInfo, names: &[String]) -> Vec<(String, i64)> {
        let Ok(Some(demand)) = &pod.demand else {
            // Neutral: a pod without GPUs is not pulled towards GPU nodes.
            return names.iter().map(|n| (n.clone(), 0)).collect();
        };
        if let Some(node) = self.reserved_node(&pod.uid) {
            return names
                .iter()
                .map(|n| (n.clone(), if *n == node { 10 } else { 0 }))
                .collect();
        }
        let req = self.req(&pod.uid, &pod.namespace, demand);
        let cached = self
            .scores
            .as_ref()
            .filter(|c| c.uid == pod.uid && c.version == self.version && c.demand == *demand);
        let raw: Vec<Option<u64>> = names
            .iter()
            .map(|n| {
                let id = self.nodes.get(n).map(|node| node.id as usize);
                match cached.zip(id).and_then(|(c, id)| c.raw.get(id)) {
                    Some(&r) if r != NO_SCORE => Some(r),
                    _ => self.evaluate(&req, n).ok().map(|c| c.raw),
                }
            })
            .collect();
        scale_scores(names, &raw)
    }

    fn booking_for(&self, req: &Req, node: &str, c: &Choice, kind: Kind) -> Booking {
        let n = &self.nodes[node];
        Booking {
            node: node.to_string(),
            gpus: c
                .gpus
                .iter()
                .map(|&i| n.gpus[i].info.uuid.clone())
                .collect(),
            milli: u32::from(req.demand.request_per_gpu().get()),
            mem: c.mem,
            managed: c.managed,
            granted: match req.demand.share {
                GpuShare::Whole { .. } => Granted::Whole,
                GpuShare::Fraction { request, limit, .. } => Granted::Fraction { request, limit },
            },
            model: c
                .gpus
                .first()
                .map(|&i| n.gpus[i].info.model.clone())
                .unwrap_or_default(),
            tags: tags_of(req.ns, Some(req.demand)),
            group: req.group.clone(),
            kind,
        }
    }
}

#[cfg(test)]
mod tests;
