//! Placement: which node and which GPU(s) a KubeShare pod gets.
//!
//! Pure decision logic: no I/O and no clock (callers pass `now_ms`), and
//! deterministic (ordered maps, explicit tie-breaks), so it is unit- and
//! property-tested on its own. The books are integers (milli-units, bytes) held
//! per GPU and updated incrementally from *bookings*: one per pod, either
//! observed (the pod's allocation annotations, the source of truth), assumed
//! (bound by us, not yet seen in the watch) or reserved (coscheduling: capacity
//! held for a group member that has not been bound yet).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use kubeshare_api::{Allocation, GpuDemand, GpuInfo, GpuShare, Granted, Milli, NodeInventory};

#[path = "placement_books.rs"]
mod books;
pub use books::RecordProblem;

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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            reservation_timeout_ms: 30_000,
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
    pub mem_used: u64,
    pub mem_total: u64,
    pub holders: u32,
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
    mem: u64,
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
            &self.model,
            self.granted,
        ) == (&o.node, &o.gpus, o.milli, o.mem, &o.model, o.granted)
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
}

#[derive(Debug, Clone)]
struct Gpu {
    info: GpuInfo,
    used: u32,
    mem_used: u64,
    holders: u32,
    affinity: BTreeMap<String, u32>,
    anti: BTreeMap<String, u32>,
    exclusion: BTreeMap<String, u32>,
}

#[derive(Debug, Clone)]
struct Node {
    /// In NVML index order.
    gpus: Vec<Gpu>,
    by_uuid: HashMap<String, usize>,
}

/// The cluster as the extender sees it, and every decision it makes.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    cfg: Config,
    nodes: BTreeMap<String, Node>,
    /// Nodes we know but cannot place on, with the reason.
    node_problems: BTreeMap<String, String>,
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
    /// Record problems not yet reported.
    problems: Vec<RecordProblem>,
    /// Unbound members of groups whose places were freed, not yet woken.
    wake: Vec<(String, String)>,
    /// Pods deleted or finished (bounded, oldest forgotten first).
    gone: HashSet<String>,
    gone_order: std::collections::VecDeque<String>,
}

#[derive(Debug, Clone)]
struct ScoreCache {
    uid: String,
    version: u64,
    demand: GpuDemand,
    raw: HashMap<String, u64>,
}

/// One candidate answer for a pod on a node.
#[derive(Debug, Clone)]
struct Choice {
    /// Indexes into the node's GPU list, in device order.
    gpus: Vec<usize>,
    mem: u64,
    raw: u64,
}

/// A pod being placed.
struct Req<'a> {
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
}

/// Why one GPU does not fit; the most promising failure is shown.
struct GpuFail {
    /// (checks passed, free share) – larger is closer to fitting.
    rank: (u8, u32),
    why: Why,
}

/// The numbers of a failure; formatted only for the one shown (filter is hot).
enum Why {
    Text(String),
    Share { idx: u32, free: u32 },
    Mem { idx: u32, free: u64, need: u64 },
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn milli(v: u32) -> String {
    Milli::new(v.min(1000) as u16)
        .unwrap_or(Milli::ONE)
        .to_string()
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

/// Maps raw node scores to the extender's 0..=10: the best node (first by name
/// on ties) gets 10, the others at most 9, so our preference is never a coin toss.
fn scale_scores(raw: &[(String, Option<u64>)]) -> Vec<(String, i64)> {
    let fits: Vec<u64> = raw.iter().filter_map(|(_, r)| *r).collect();
    let (Some(&min), Some(&max)) = (fits.iter().min(), fits.iter().max()) else {
        return raw.iter().map(|(n, _)| (n.clone(), 0)).collect();
    };
    let best = raw
        .iter()
        .filter(|(_, r)| *r == Some(max))
        .map(|(n, _)| n.as_str())
        .min();
    raw.iter()
        .map(|(n, r)| {
            let s = match r {
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

    // ------------------------------------------------------------ nodes

    /// A Node was added or changed. `Ok(None)`: it publishes no inventory.
    pub fn apply_node(&mut self, name: &str, inventory: Result<Option<NodeInventory>, String>) {
        self.detach_node(name);
        match inventory {
            Ok(Some(inv)) if !inv.gpus.is_empty() => {
                let mut gpus: Vec<Gpu> = inv
                    .gpus
                    .into_iter()
                    .map(|info| Gpu {
                        info,
                        used: 0,
                        mem_used: 0,
                        holders: 0,
                        affinity: BTreeMap::new(),
                        anti: BTreeMap::new(),
                        exclusion: BTreeMap::new(),
                    })
                    .collect();
                gpus.sort_by_key(|g| g.info.index);
                let by_uuid = gpus
                    .iter()
                    .enumerate()
                    .map(|(i, g)| (g.info.uuid.clone(), i))
                    .collect();
                self.nodes.insert(name.to_string(), Node { gpus, by_uuid });
                let uids: Vec<String> = self
                    .by_node
                    .get(name)
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default();
                for uid in uids {
                    if let Some(b) = self.bookings.get(&uid).cloned()
                        && let Err(e) = self.account(&b, true)
                    {
                        // Booked while the node was unknown, and cannot be added now.
                        self.bookings.remove(&uid);
                        if let Some(s) = self.by_node.get_mut(name) {
                            s.remove(&uid);
                        }
                        if let Some(d) = b.deadline() {
                            self.timed.remove(&(d, uid.clone()));
                        }
                        let (namespace, pname) = self
                            .pods
                            .get(&uid)
                            .map(|e| (e.namespace.clone(), e.name.clone()))
                            .unwrap_or_default();
                        self.problems.push(RecordProblem {
                            uid,
                            namespace,
                            name: pname,
                            message: e,
                        });
                    }
                }
            }
            Ok(_) => {
                self.node_problems.insert(
                    name.to_string(),
                    format!("{name}: no KubeShare GPUs (no sharedgpu/inventory annotation)"),
                );
            }
            Err(e) => {
                self.node_problems
                    .insert(name.to_string(), format!("{name}: bad GPU inventory: {e}"));
            }
        }
    }

    pub fn delete_node(&mut self, name: &str) {
        self.detach_node(name);
    }

    /// The names of every node we know, GPU or not.
    pub fn node_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .nodes
            .keys()
            .chain(self.node_problems.keys())
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Keeps only these nodes (after a relist).
    pub fn retain_nodes(&mut self, keep: &HashSet<String>) {
        for n in self.node_names() {
            if !keep.contains(&n) {
                self.detach_node(&n);
            }
        }
    }

    fn detach_node(&mut self, name: &str) {
        self.version += 1;
        self.node_problems.remove(name);
        if self.nodes.remove(name).is_some() {
            for locs in self.affinity.values_mut() {
                locs.retain(|(n, _), _| n != name);
            }
            self.affinity.retain(|_, l| !l.is_empty());
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
        // A member of an admitted group goes where its reservation is.
        if let Some(reserved) = self.reserved_node(&pod.uid) {
            return self.hold_to(names, &reserved, &demand);
        }
        if let (Some(spec), Some(key)) = (&demand.group, group_key(&pod.namespace, &demand)) {
            match self.admit_group(pod, spec, &key, names, now_ms) {
                Err(msg) => {
                    out.failed = names.iter().map(|n| (n.clone(), msg.clone())).collect();
                    out.kind = FilterKind::GroupWaiting;
                    return out;
                }
                Ok(Some(node)) => return self.hold_to(names, &node, &demand),
                Ok(None) => {}
            }
        }
        let req = self.req(&pod.uid, &pod.namespace, &demand);
        let mut raw = HashMap::new();
        for n in names {
            match self.evaluate(&req, n) {
                Ok(c) => {
                    raw.insert(n.clone(), c.raw);
                    out.passed.push(n.clone());
                }
                Err((msg, unresolvable)) => {
                    if unresolvable {
                        out.unresolvable.insert(n.clone(), msg);
                    } else {
                        out.failed.insert(n.clone(), msg);
                    }
                }
            }
        }
        out.kind = if out.passed.is_empty() {
            FilterKind::NoFit
        } else {
            FilterKind::Fits
        };
        self.scores = Some(ScoreCache {
            uid: pod.uid.clone(),
            version: self.version,
            demand,
            raw,
        });
        out
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
                out.failed.insert(
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
        let raw: Vec<(String, Option<u64>)> = names
            .iter()
            .map(|n| {
                let r = match cached.and_then(|c| c.raw.get(n)) {
                    Some(r) => Some(*r),
                    None => self.evaluate(&req, n).ok().map(|c| c.raw),
                };
                (n.clone(), r)
            })
            .collect();
        scale_scores(&raw)
    }

    /// The extender's bind, decision half: re-checks the pod on `node` and books
    /// the GPUs it gets as assumed. The caller writes the record with the Binding,
    /// then calls [`Cluster::settle`] (done, or outcome unknown) or
    /// [`Cluster::rollback`] (it surely failed).
    ///
    /// A member of a group whose quorum has not reached bind waits at the gate
    /// ([`BindStep::Wait`]): no member is bound before ⌈threshold × headcount⌉
    /// members are placed and at bind; then they are released together.
    pub fn bind(&mut self, uid: &str, node: &str, now_ms: u64) -> Result<BindStep, String> {
        let w = self.expire(now_ms);
        self.wake.extend(w);
        let Some(e) = self.pods.get(uid).cloned() else {
            return Err(format!("pod {uid} is not known to the extender yet"));
        };
        let demand = match &e.demand {
            Ok(None) => {
                return Ok(BindStep::Go(Box::new(BindDecision {
                    allocation: None,
                    summary: "no GPU requested".into(),
                    rv: e.rv,
                    demand: None,
                })));
            }
            Err(err) => return Err(format!("invalid sharedgpu labels: {err}")),
            Ok(Some(d)) => d.clone(),
        };
        match self
            .bookings
            .get(uid)
            .map(|b| (b.kind.clone(), b.node.clone()))
        {
            Some((Kind::Observed, n)) => {
                return Err(format!("pod is already bound to {n}"));
            }
            Some((Kind::Assumed { .. }, n)) => {
                return Err(format!(
                    "pod was bound to {n} by an earlier bind whose outcome is being checked"
                ));
            }
            Some((Kind::Reserved { deadline, .. }, n)) => {
                if n != node {
                    return Err(format!(
                        "group member's place is reserved on {n}, not {node}"
                    ));
                }
                if !self.grant_matches(uid) {
                    self.remove_booking(uid);
                    return Err("the pod's labels changed since its place was planned".into());
                }
                let key = group_key(&e.namespace, &demand);
                let min = demand.group.as_ref().map_or(0, |g| g.min_members());
                let (_, bound, _, gate) =
                    key.as_ref().map_or((0, 0, 0, 0), |k| self.group_counts(k));
                if bound >= min {
                    // The group is running: this member binds like any pod.
                    return Ok(BindStep::Go(Box::new(self.assume_reserved(uid, now_ms))));
                }
                if let Some(b) = self.bookings.get_mut(uid) {
                    b.kind = Kind::Reserved {
                        deadline,
                        at_gate: true,
                    };
                }
                if bound + gate + 1 < min {
                    return Ok(BindStep::Wait);
                }
                // Quorum at bind: release every member waiting at the gate, and
                // wake the members still queued (they now bind like any pod).
                if let Some(k) = key {
                    let members: Vec<String> = self
                        .groups
                        .get(&k)
                        .map(|m| m.values().cloned().collect())
                        .unwrap_or_default();
                    for u in members {
                        match self.bookings.get(&u).map(|b| &b.kind) {
                            Some(Kind::Reserved { at_gate: true, .. }) => {
                                self.assume_reserved(&u, now_ms);
                            }
                            Some(_) => {}
                            None => {
                                if let Some(e) = self.pods.get(&u)
                                    && e.node_name.is_none()
                                {
                                    self.wake.push((e.namespace.clone(), e.name.clone()));
                                }
                            }
                        }
                    }
                }
                return self
                    .poll_gate(uid, node)?
                    .map(|d| BindStep::Go(Box::new(d)))
                    .ok_or_else(|| "group released without this member".to_string());
            }
            None => {}
        }
        if let (Some(spec), Some(key)) = (&demand.group, group_key(&e.namespace, &demand)) {
            let min = spec.min_members();
            let (members, bound, _, _) = self.group_counts(&key);
            if bound < min {
                return Err(format!(
                    "group {key}: not started yet ({members} members exist, {bound} bound, {min} required)"
                ));
            }
        }
        let req = self.req(uid, &e.namespace, &demand);
        let choice = self.evaluate(&req, node).map_err(|(m, _)| m)?;
        let b = self.booking_for(
            &req,
            node,
            &choice,
            Kind::Assumed {
                since: now_ms,
                settled: false,
                bound: false,
            },
        );
        let decision = self.decision(uid, node, &b);
        self.add_booking(uid, b)?;
        Ok(BindStep::Go(Box::new(decision)))
    }

    /// A reserved member's place becomes an assumed booking (same GPUs).
    fn assume_reserved(&mut self, uid: &str, now_ms: u64) -> BindDecision {
        let Some(b) = self.remove_booking(uid) else {
            return BindDecision {
                allocation: None,
                summary: String::new(),
                rv: None,
                demand: None,
            };
        };
        let b = Booking {
            kind: Kind::Assumed {
                since: now_ms,
                settled: false,
                bound: false,
            },
            ..b
        };
        let d = self.decision(uid, &b.node.clone(), &b);
        // Removing then adding the same booking cannot overflow.
        let _ = self.add_booking(uid, b);
        d
    }

    /// For a member waiting at the gate: `Ok(Some(decision))` once its group is
    /// released, `Ok(None)` while it waits, `Err` when its place was freed.
    pub fn poll_gate(&self, uid: &str, node: &str) -> Result<Option<BindDecision>, String> {
        if !self.grant_matches(uid) {
            return Err("the pod's labels changed since its place was planned".into());
        }
        match self.bookings.get(uid) {
            Some(b) if b.node == node && matches!(b.kind, Kind::Assumed { settled: false, .. }) => {
                Ok(Some(self.decision(uid, node, b)))
            }
            Some(b) if matches!(b.kind, Kind::Reserved { at_gate: true, .. }) => Ok(None),
            _ => Err("the group's places were freed before enough members reached bind".into()),
        }
    }

    /// Whether the pod's booking grants what its labels (as held) ask for.
    fn grant_matches(&self, uid: &str) -> bool {
        let (Some(b), Some(e)) = (self.bookings.get(uid), self.pods.get(uid)) else {
            return false;
        };
        match &e.demand {
            Ok(Some(d)) => {
                let g = match d.share {
                    GpuShare::Whole { .. } => Granted::Whole,
                    GpuShare::Fraction { request, limit, .. } => {
                        Granted::Fraction { request, limit }
                    }
                };
                g == b.granted && usize::from(d.gpu_count()) == b.gpus.len()
            }
            _ => false,
        }
    }

    /// A member stops waiting at the gate (its bind call gave up). Its place stays
    /// reserved until the group's deadline.
    pub fn leave_gate(&mut self, uid: &str) -> String {
        let mut msg = "waiting for the group's members at bind".to_string();
        if let Some(b) = self.bookings.get_mut(uid)
            && let Kind::Reserved { deadline, .. } = b.kind
        {
            b.kind = Kind::Reserved {
                deadline,
                at_gate: false,
            };
            if let Some(k) = b.group.clone() {
                let (_, bound, _, gate) = self.group_counts(&k);
                msg = format!(
                    "group {k}: {} members at bind or bound, waiting for more",
                    bound + gate + 1
                );
            }
        }
        msg
    }

    /// The group of a pod, if it has one.
    pub fn group_of(&self, uid: &str) -> Option<GroupKey> {
        self.pods.get(uid).and_then(|e| e.group.clone())
    }

    /// The bind's API calls are over: `bound` when the Binding was answered OK,
    /// not when its outcome is unknown. From now on an assumed booking not yet
    /// observed is due for a check against the API.
    pub fn settle(&mut self, uid: &str, now_ms: u64, bound: bool) {
        if let Some(b) = self.bookings.get_mut(uid)
            && let Kind::Assumed { .. } = b.kind
        {
            b.kind = Kind::Assumed {
                since: now_ms,
                settled: true,
                bound,
            };
        }
    }

    /// Undoes a bind whose Binding surely failed.
    pub fn rollback(&mut self, uid: &str) {
        if matches!(
            self.bookings.get(uid).map(|b| &b.kind),
            Some(Kind::Assumed { .. })
        ) {
            self.remove_booking(uid);
        }
    }

    /// The node a pod is known to be bound to: its record was observed, or our
    /// Binding was answered OK. (Not while a Binding's outcome is unknown: a retried
    /// bind must not be told "bound" for a pod that may not be.)
    pub fn bound_node(&self, uid: &str) -> Option<String> {
        self.bookings
            .get(uid)
            .filter(|b| matches!(b.kind, Kind::Observed | Kind::Assumed { bound: true, .. }))
            .map(|b| b.node.clone())
    }

    /// Settled assumed bookings not observed within `after_ms`: (uid, namespace,
    /// name) to check with a GET. Each is re-armed, so it is asked about once per period.
    pub fn due_checks(&mut self, now_ms: u64, after_ms: u64) -> Vec<(String, String, String)> {
        let mut due = Vec::new();
        for (uid, b) in self.bookings.iter_mut() {
            if let Kind::Assumed {
                since,
                settled: true,
                bound,
            } = b.kind
                && since.saturating_add(after_ms) <= now_ms
            {
                b.kind = Kind::Assumed {
                    since: now_ms,
                    settled: true,
                    bound,
                };
                let (ns, name) = self
                    .pods
                    .get(uid)
                    .map(|e| (e.namespace.clone(), e.name.clone()))
                    .unwrap_or_default();
                due.push((uid.clone(), ns, name));
            }
        }
        due.sort();
        due
    }

    /// The API's answer about a pod with an assumed booking: `None` when it is gone
    /// (or another pod has its name). A settled assumed booking of a pod that the
    /// API shows unbound is dropped: its Binding did not happen.
    pub fn confirm(&mut self, uid: &str, fresh: Option<&PodInfo>) {
        match fresh {
            None => self.delete_pod(uid),
            Some(p) => {
                self.apply_pod(p);
                if p.node_name.is_none()
                    && matches!(
                        self.bookings.get(uid).map(|b| &b.kind),
                        Some(Kind::Assumed { settled: true, .. })
                    )
                {
                    self.remove_booking(uid);
                }
            }
        }
    }

    /// Group members to wake (their group's places were freed), since the last call.
    pub fn take_wake(&mut self) -> Vec<(String, String)> {
        let mut w = std::mem::take(&mut self.wake);
        w.sort();
        w.dedup();
        w
    }

    fn decision(&self, uid: &str, node: &str, b: &Booking) -> BindDecision {
        let idx: Vec<String> = self
            .nodes
            .get(node)
            .map(|n| {
                b.gpus
                    .iter()
                    .filter_map(|u| n.by_uuid.get(u).map(|&i| n.gpus[i].info.index.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let share = match b.granted {
            Granted::Whole => format!("{} whole GPUs", b.gpus.len()),
            Granted::Fraction { request, limit } => {
                format!("request {request}, limit {limit}")
            }
        };
        let (rv, demand) = self
            .pods
            .get(uid)
            .map(|e| (e.rv, e.demand.clone().ok().flatten()))
            .unwrap_or_default();
        BindDecision {
            rv,
            demand,
            allocation: Some(Allocation {
                node: node.to_string(),
                gpu_uuids: b.gpus.clone(),
                gpu_mem: b.mem,
                gpu_model: b.model.clone(),
                granted: b.granted,
            }),
            summary: format!(
                "{node}/gpu {} ({}): {share}, {} memory per GPU",
                idx.join(","),
                b.model,
                gib(b.mem)
            ),
        }
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

    /// Whether and how the pod fits on `node`. `Err((reason, unresolvable))`.
    fn evaluate(&self, req: &Req, node_name: &str) -> Result<Choice, (String, bool)> {
        let Some(node) = self.nodes.get(node_name) else {
            let msg = self
                .node_problems
                .get(node_name)
                .cloned()
                .unwrap_or_else(|| format!("{node_name}: not a KubeShare GPU node"));
            return Err((msg, true));
        };
        let d = req.demand;
        let own = req.own;
        // The pod's own stale booking (an interrupted bind) does not count against it.
        let mine = |uuid: &str| own.is_some_and(|b| b.on(node_name, uuid));
        let eligible: Vec<usize> = (0..node.gpus.len())
            .filter(|&i| {
                d.model
                    .as_ref()
                    .is_none_or(|m| node.gpus[i].info.model == *m)
            })
            .collect();
        if eligible.is_empty() {
            let mut models: Vec<&str> = node.gpus.iter().map(|g| g.info.model.as_str()).collect();
            models.dedup();
            return Err((
                format!(
                    "{node_name}: no {} GPU (has {})",
                    d.model.as_deref().unwrap_or("?"),
                    models.join(", ")
                ),
                true,
            ));
        }
        let group_bonus: u64 = if req.group_nodes.contains(node_name) {
            10_000_000
        } else {
            0
        };
        // Where the pod's affinity tag already lives (its own stale booking aside).
        let tag_locs: Option<BTreeSet<(String, String)>> = req
            .tags
            .affinity
            .as_ref()
            .and_then(|k| self.affinity.get(k))
            .map(|l| {
                let own_tag = own.and_then(|b| b.tags.affinity.as_ref()).is_some();
                l.iter()
                    .filter(|((n, u), c)| {
                        let mine_here = own_tag && own.is_some_and(|b| b.on(n, u));
                        **c > u32::from(mine_here)
                    })
                    .map(|(k, _)| k.clone())
                    .collect::<BTreeSet<_>>()
            })
            .filter(|s| !s.is_empty());
        let tag_gpus = tag_locs.as_ref();
        let in_tag = |i: usize| {
            tag_gpus.is_none_or(|l| {
                l.contains(&(node_name.to_string(), node.gpus[i].info.uuid.clone()))
            })
        };
        if let Some(l) = tag_gpus
            && !l.iter().any(|(n, _)| n == node_name)
        {
            let (n, u) = l.iter().next().cloned().unwrap_or_default();
            let where_ = self
                .nodes
                .get(&n)
                .and_then(|nn| nn.by_uuid.get(&u).map(|&i| nn.gpus[i].info.index))
                .map_or(n.clone(), |i| format!("{n}/gpu {i}"));
            return Err((
                format!(
                    "{node_name}: affinity tag {} lives on {where_}",
                    d.affinity.as_deref().unwrap_or("")
                ),
                false,
            ));
        }
        // Usage of GPU i, leaving out the pod's own booking.
        let usage = |i: usize| -> (u32, u64, u32) {
            let g = &node.gpus[i];
            match own.filter(|b| b.on(node_name, &g.info.uuid)) {
                Some(b) => (
                    g.used.saturating_sub(b.milli),
                    g.mem_used.saturating_sub(b.mem),
                    g.holders.saturating_sub(1),
                ),
                None => (g.used, g.mem_used, g.holders),
            }
        };
        let count_tag = |m: &BTreeMap<String, u32>, k: &str, i: usize, own_has: bool| -> u32 {
            let c = m.get(k).copied().unwrap_or(0);
            if own_has && mine(&node.gpus[i].info.uuid) {
                c.saturating_sub(1)
            } else {
                c
            }
        };
        let own_tags = own.map(|b| b.tags.clone()).unwrap_or_default();
        let tag_fail = |i: usize| -> Option<String> {
            let g = &node.gpus[i];
            let idx = g.info.index;
            if let Some(x) = &d.exclusion {
                for (other, _) in g.exclusion.iter().filter(|(t, _)| *t != x) {
                    let own_has = own_tags.exclusion.as_ref() == Some(other);
                    if count_tag(&g.exclusion, other, i, own_has) > 0 {
                        return Some(format!(
                            "{node_name}/gpu {idx}: holds exclusion tag {other}, pod has {x}"
                        ));
                    }
                }
            }
            if let (Some(t), Some(k)) = (&d.anti_affinity, &req.tags.anti) {
                let own_has = own_tags.anti.as_ref() == Some(k);
                if count_tag(&g.anti, k, i, own_has) > 0 {
                    return Some(format!(
                        "{node_name}/gpu {idx}: already holds a pod with anti-affinity tag {t}"
                    ));
                }
            }
            None
        };
        let n_gpus = node.gpus.len() as u64;
        // The first pod of an affinity tag takes the GPU with the most headroom,
        // so that the tag's later pods find room next to it.
        let spread = d.priority > 0 || (d.affinity.is_some() && tag_gpus.is_none());
        // Taking this GPU would eat the room pending pods of another tag need.
        let protected = |i: usize, used: u32| -> bool {
            req.protect
                .get(&(node_name.to_string(), node.gpus[i].info.uuid.clone()))
                .is_some_and(|&need| {
                    1000u32
                        .saturating_sub(used)
                        .saturating_sub(u32::from(d.request_per_gpu().get()))
                        < need
                })
        };
        match d.share {
            GpuShare::Fraction { request, count, .. } => {
                let r = u32::from(request.get());
                let mut fits: Vec<(usize, u32, u64, u64)> = Vec::with_capacity(eligible.len()); // (i, used, mem_free, need)
                let mut best_fail: Option<GpuFail> = None;
                let mut note = |f: GpuFail| {
                    if best_fail.as_ref().is_none_or(|b| f.rank > b.rank) {
                        best_fail = Some(f);
                    }
                };
                let mut need_cache: Option<(u64, u64)> = None;
                for &i in &eligible {
                    let g = &node.gpus[i];
                    let idx = g.info.index;
                    if let Some(m) = tag_fail(i) {
                        note(GpuFail {
                            rank: (0, 0),
                            why: Why::Text(m),
                        });
                        continue;
                    }
                    let (used, mem_used, _) = usage(i);
                    let free = 1000u32.saturating_sub(used);
                    if free < r {
                        note(GpuFail {
                            rank: (1, free),
                            why: Why::Share { idx, free },
                        });
                        continue;
                    }
                    // mem_on divides in u128; GPUs of a node mostly share one size.
                    let need = match need_cache {
                        Some((m, n)) if m == g.info.memory => n,
                        _ => {
                            let n = d.mem_on(g.info.memory);
                            need_cache = Some((g.info.memory, n));
                            n
                        }
                    };
                    if need == 0 {
                        // A 0-byte cap makes every allocation of the pod fail.
                        note(GpuFail {
                            rank: (2, free),
                            why: Why::Text(format!(
                                "{node_name}/gpu {idx}: the memory cap would be 0 bytes (gpu_request 0 and no gpu_mem): set sharedgpu/gpu_mem"
                            )),
                        });
                        continue;
                    }
                    let mem_free = g.info.memory.saturating_sub(mem_used);
                    if mem_free < need {
                        note(GpuFail {
                            rank: (2, free),
                            why: Why::Mem {
                                idx,
                                free: mem_free,
                                need,
                            },
                        });
                        continue;
                    }
                    fits.push((i, used, mem_free, need));
                }
                let want = usize::from(count);
                // Affinity: a GPU that holds the tag comes first and must be among the chosen.
                let tagged = fits.iter().any(|f| in_tag(f.0));
                if fits.len() < want || !tagged {
                    let why = match best_fail.map(|f| f.why) {
                        None => format!("{node_name}: no GPU fits"),
                        Some(Why::Text(m)) => m,
                        Some(Why::Share { idx, free }) => format!(
                            "{node_name}/gpu {idx}: {} free < {request} requested",
                            milli(free)
                        ),
                        Some(Why::Mem { idx, free, need }) => format!(
                            "{node_name}/gpu {idx}: {} memory free < {} requested",
                            gib(free),
                            gib(need)
                        ),
                    };
                    let msg = if !tagged && fits.len() >= want {
                        format!(
                            "{node_name}: the GPUs holding affinity tag {} have no room",
                            d.affinity.as_deref().unwrap_or("")
                        )
                    } else if want > 1 {
                        format!("{node_name}: {} of {want} GPUs fit; {why}", fits.len())
                    } else {
                        why
                    };
                    return Err((msg, false));
                }
                fits.sort_by(|a, b| {
                    let tag = in_tag(b.0)
                        .cmp(&in_tag(a.0))
                        .then(protected(a.0, a.1).cmp(&protected(b.0, b.1)));
                    let load = if spread {
                        a.1.cmp(&b.1).then(a.2.cmp(&b.2).reverse())
                    } else {
                        // Best fit: fullest GPU, then least memory left.
                        b.1.cmp(&a.1).then(a.2.cmp(&b.2))
                    };
                    tag.then(load).then(a.0.cmp(&b.0))
                });
                let chosen = &fits[..want];
                let mem = chosen.iter().map(|c| c.3).min().unwrap_or(0);
                let avg_used = chosen.iter().map(|c| u64::from(c.1)).sum::<u64>() / want as u64;
                let (mut node_busy, mut node_used) = (0u64, 0u64);
                for i in 0..node.gpus.len() {
                    let (u, _, h) = usage(i);
                    node_busy += u64::from(h > 0);
                    node_used += u64::from(u);
                }
                let raw = if spread {
                    (1000 - avg_used.min(1000)) * 1001
                        + (1000 * n_gpus - node_used.min(1000 * n_gpus)) / n_gpus
                } else {
                    avg_used.min(1000) * 1001 + node_busy * 1000 / n_gpus
                };
                let mut gpus: Vec<usize> = chosen.iter().map(|c| c.0).collect();
                gpus.sort_unstable();
                Ok(Choice {
                    gpus,
                    mem,
                    raw: group_bonus + raw,
                })
            }
            GpuShare::Whole { gpus: want } => {
                let want = usize::from(want);
                if let Some(l) = tag_gpus
                    && !l.is_empty()
                {
                    return Err((
                        format!(
                            "{node_name}: affinity tag {} is held by GPUs that are not free",
                            d.affinity.as_deref().unwrap_or("")
                        ),
                        false,
                    ));
                }
                let free: Vec<usize> = eligible
                    .iter()
                    .copied()
                    .filter(|&i| {
                        let (u, m, h) = usage(i);
                        u == 0 && m == 0 && h == 0
                    })
                    .collect();
                if free.len() < want {
                    return Err((
                        format!("{node_name}: {} of {want} whole GPUs free", free.len()),
                        false,
                    ));
                }
                let (chosen, linked) = nvlink_pick(&node.gpus, &free, want);
                let pairs = (want * want.saturating_sub(1) / 2) as u64;
                let nvq = (linked * 1000).checked_div(pairs).unwrap_or(1000);
                let free_after = (free.len() - want) as u64 * 1000 / n_gpus;
                let pack = if spread {
                    free_after
                } else {
                    1000 - free_after
                };
                let mem = chosen
                    .iter()
                    .map(|&i| node.gpus[i].info.memory)
                    .min()
                    .unwrap_or(0);
                Ok(Choice {
                    gpus: chosen,
                    mem,
                    raw: group_bonus + nvq * 1001 + pack,
                })
            }
        }
    }

    // ------------------------------------------------------------ views

    /// Every GPU with its allocation, in node and index order.
    pub fn usage(&self) -> Vec<GpuUsage> {
        self.nodes
            .iter()
            .flat_map(|(n, node)| {
                node.gpus.iter().map(move |g| GpuUsage {
                    node: n.clone(),
                    index: g.info.index,
                    uuid: g.info.uuid.clone(),
                    model: g.info.model.clone(),
                    used_milli: g.used,
                    mem_used: g.mem_used,
                    mem_total: g.info.memory,
                    holders: g.holders,
                })
            })
            .collect()
    }

    /// Number of bookings by kind: (observed, assumed, reserved).
    pub fn booking_counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for b in self.bookings.values() {
            match b.kind {
                Kind::Observed => c.0 += 1,
                Kind::Assumed { .. } => c.1 += 1,
                Kind::Reserved { .. } => c.2 += 1,
            }
        }
        c
    }

    /// The GPUs (node, uuids) booked for a pod, whatever the kind.
    pub fn booked(&self, uid: &str) -> Option<(String, Vec<String>)> {
        self.bookings
            .get(uid)
            .map(|b| (b.node.clone(), b.gpus.clone()))
    }

    /// Checks the books: they equal a recount from the bookings, and no GPU is
    /// over its share or memory. For tests and debugging.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut fresh: HashMap<(String, String), (u64, u128, u64)> = HashMap::new();
        for b in self.bookings.values() {
            let Some(node) = self.nodes.get(&b.node) else {
                continue;
            };
            for u in &b.gpus {
                if node.by_uuid.contains_key(u) {
                    let e = fresh.entry((b.node.clone(), u.clone())).or_default();
                    e.0 += u64::from(b.milli);
                    e.1 += u128::from(b.mem);
                    e.2 += 1;
                }
            }
        }
        for (n, node) in &self.nodes {
            for g in &node.gpus {
                let want = fresh
                    .get(&(n.clone(), g.info.uuid.clone()))
                    .copied()
                    .unwrap_or_default();
                let have = (
                    u64::from(g.used),
                    u128::from(g.mem_used),
                    u64::from(g.holders),
                );
                if have != want {
                    return Err(format!(
                        "{n}/gpu {}: books {:?} != recount {want:?}",
                        g.info.index,
                        (g.used, g.mem_used, g.holders)
                    ));
                }
                if g.used > 1000 {
                    return Err(format!("{n}/gpu {}: {} milli booked", g.info.index, g.used));
                }
                if g.mem_used > g.info.memory {
                    return Err(format!(
                        "{n}/gpu {}: {} of {} bytes booked",
                        g.info.index, g.mem_used, g.info.memory
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Picks `want` of the `free` GPUs with the most NVLink pairs among them:
/// greedy from each seed, ties to the lowest indexes. Returns (chosen, linked pairs).
fn nvlink_pick(gpus: &[Gpu], free: &[usize], want: usize) -> (Vec<usize>, u64) {
    let linked = |a: usize, b: usize| {
        gpus[a].info.nvlink_peers.contains(&gpus[b].info.uuid)
            || gpus[b].info.nvlink_peers.contains(&gpus[a].info.uuid)
    };
    let any_links = free.iter().any(|&i| !gpus[i].info.nvlink_peers.is_empty());
    if want == 0 || free.len() == want || !any_links {
        let chosen: Vec<usize> = free.iter().copied().take(want).collect();
        let mut n = 0;
        for (x, &a) in chosen.iter().enumerate() {
            n += chosen[x + 1..].iter().filter(|&&b| linked(a, b)).count() as u64;
        }
        return (chosen, n);
    }
    let mut best: Option<(u64, Vec<usize>)> = None;
    for &seed in free {
        let mut set = vec![seed];
        let mut pairs = 0u64;
        while set.len() < want {
            let next = free
                .iter()
                .copied()
                .filter(|i| !set.contains(i))
                .map(|i| (set.iter().filter(|&&s| linked(s, i)).count() as u64, i))
                .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((l, i)) = next else { break };
            pairs += l;
            set.push(i);
        }
        set.sort_unstable();
        if best
            .as_ref()
            .is_none_or(|(p, s)| pairs > *p || (pairs == *p && set < *s))
        {
            best = Some((pairs, set));
        }
    }
    best.map(|(p, s)| (s, p)).unwrap_or_default()
}
#[cfg(test)]
#[path = "placement_tests.rs"]
mod tests;
