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

use kubeshare_api::{Allocation, GpuDemand, GpuInfo, GpuShare, GroupSpec, Milli, NodeInventory};

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
    /// The allocation annotations (`Err` when malformed).
    pub allocation: Result<Option<Allocation>, String>,
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
    Observed,
    Assumed,
    Reserved { deadline: u64 },
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
    tags: Tags,
    group: Option<GroupKey>,
    kind: Kind,
}

impl Booking {
    fn on(&self, node: &str, uuid: &str) -> bool {
        self.node == node && self.gpus.iter().any(|u| u == uuid)
    }
    fn deadline(&self) -> Option<u64> {
        match self.kind {
            Kind::Observed => None,
            Kind::Assumed => None,
            Kind::Reserved { deadline } => Some(deadline),
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
                    if let Some(b) = self.bookings.get(&uid).cloned() {
                        self.account(&uid, &b, true);
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

    // ------------------------------------------------------------ pods

    /// A Pod was added or changed (or listed).
    pub fn apply_pod(&mut self, p: &PodInfo) {
        if p.terminal {
            self.delete_pod(&p.uid);
            return;
        }
        let has_alloc = matches!(p.allocation, Ok(Some(_)));
        let relevant = !matches!(p.demand, Ok(None)) || has_alloc;
        if !relevant {
            if self.pods.contains_key(&p.uid) || self.bookings.contains_key(&p.uid) {
                self.delete_pod(&p.uid);
            }
            return;
        }
        self.note_pod(p);
        match &p.allocation {
            Ok(Some(a)) => {
                let demand = p.demand.as_ref().ok().and_then(|d| d.as_ref());
                let b = Booking {
                    node: a.node.clone(),
                    gpus: a.gpu_uuids.clone(),
                    // Unknown demand: assume the worst, the whole GPU.
                    milli: demand.map_or(1000, |d| u32::from(d.request_per_gpu().get())),
                    mem: a.gpu_mem,
                    model: a.gpu_model.clone(),
                    tags: tags_of(&p.namespace, demand),
                    group: demand.and_then(|d| group_key(&p.namespace, d)),
                    kind: Kind::Observed,
                };
                if self.bookings.get(&p.uid) != Some(&b) {
                    self.remove_booking(&p.uid);
                    self.add_booking(&p.uid, b);
                }
            }
            // A watch event older than our own bind does not undo it.
            _ => {
                if matches!(
                    self.bookings.get(&p.uid).map(|b| &b.kind),
                    Some(Kind::Observed)
                ) {
                    self.remove_booking(&p.uid);
                }
            }
        }
    }

    /// Records a pod (for group counts and bind) without touching its booking.
    pub fn note_pod(&mut self, p: &PodInfo) {
        let demand_group = p
            .demand
            .as_ref()
            .ok()
            .and_then(|d| d.as_ref())
            .and_then(|d| group_key(&p.namespace, d));
        if let Some(old) = self.pods.get(&p.uid)
            && old.group != demand_group
            && let Some(g) = old.group.clone()
        {
            self.leave_group(&g, &old.name.clone());
        }
        if let Some(g) = &demand_group {
            self.groups
                .entry(g.clone())
                .or_default()
                .insert(p.name.clone(), p.uid.clone());
        }
        self.pods.insert(
            p.uid.clone(),
            PodEntry {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                node_name: p.node_name.clone(),
                demand: p.demand.clone(),
                group: demand_group,
            },
        );
    }

    pub fn knows_pod(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    fn leave_group(&mut self, g: &GroupKey, name: &str) {
        if let Some(m) = self.groups.get_mut(g) {
            m.remove(name);
            if m.is_empty() {
                self.groups.remove(g);
            }
        }
    }

    pub fn delete_pod(&mut self, uid: &str) {
        self.remove_booking(uid);
        if let Some(e) = self.pods.remove(uid)
            && let Some(g) = e.group
        {
            self.leave_group(&g, &e.name);
        }
    }

    /// Keeps only these pods (after a relist). Reservations stay: they expire
    /// on their own if the pod is really gone.
    pub fn retain_pods(&mut self, keep: &HashSet<String>) {
        let gone: Vec<String> = self
            .pods
            .keys()
            .chain(self.bookings.keys())
            .filter(|u| !keep.contains(*u))
            .filter(|u| {
                !matches!(
                    self.bookings.get(*u).map(|b| &b.kind),
                    Some(Kind::Reserved { .. })
                )
            })
            .cloned()
            .collect();
        for u in gone {
            self.delete_pod(&u);
        }
    }

    // ------------------------------------------------------------ books

    fn add_booking(&mut self, uid: &str, b: Booking) {
        if let Some(d) = b.deadline() {
            self.timed.insert((d, uid.to_string()));
        }
        self.by_node
            .entry(b.node.clone())
            .or_default()
            .insert(uid.to_string());
        self.account(uid, &b, true);
        self.bookings.insert(uid.to_string(), b);
    }

    fn remove_booking(&mut self, uid: &str) -> Option<Booking> {
        let b = self.bookings.remove(uid)?;
        if let Some(d) = b.deadline() {
            self.timed.remove(&(d, uid.to_string()));
        }
        if let Some(s) = self.by_node.get_mut(&b.node) {
            s.remove(uid);
            if s.is_empty() {
                self.by_node.remove(&b.node);
            }
        }
        self.account(uid, &b, false);
        Some(b)
    }

    /// Adds or subtracts a booking's share on the GPUs of its node (if known).
    fn account(&mut self, _uid: &str, b: &Booking, add: bool) {
        self.version += 1;
        let Some(node) = self.nodes.get_mut(&b.node) else {
            return;
        };
        for uuid in &b.gpus {
            let Some(&i) = node.by_uuid.get(uuid) else {
                continue;
            };
            let g = &mut node.gpus[i];
            if add {
                g.used += b.milli;
                g.mem_used += b.mem;
                g.holders += 1;
            } else {
                g.used = g.used.saturating_sub(b.milli);
                g.mem_used = g.mem_used.saturating_sub(b.mem);
                g.holders = g.holders.saturating_sub(1);
            }
            bump(&mut g.affinity, &b.tags.affinity, add);
            bump(&mut g.anti, &b.tags.anti, add);
            bump(&mut g.exclusion, &b.tags.exclusion, add);
            if let Some(t) = &b.tags.affinity {
                let locs = self.affinity.entry(t.clone()).or_default();
                let k = (b.node.clone(), uuid.clone());
                if add {
                    *locs.entry(k).or_default() += 1;
                } else if let Some(c) = locs.get_mut(&k) {
                    *c = c.saturating_sub(1);
                    if *c == 0 {
                        locs.remove(&k);
                    }
                }
                if locs.is_empty() {
                    self.affinity.remove(t);
                }
            }
        }
    }

    /// Drops reservations whose time is up.
    pub fn expire(&mut self, now_ms: u64) {
        while let Some((d, uid)) = self.timed.first().cloned() {
            if d > now_ms {
                break;
            }
            self.remove_booking(&uid);
        }
    }

    // ------------------------------------------------------------ groups

    /// (members, bound, reserved) of a group.
    fn group_counts(&self, g: &GroupKey) -> (u32, u32, u32) {
        let Some(m) = self.groups.get(g) else {
            return (0, 0, 0);
        };
        let (mut bound, mut reserved) = (0, 0);
        for uid in m.values() {
            match self.bookings.get(uid).map(|b| &b.kind) {
                Some(Kind::Observed | Kind::Assumed) => bound += 1,
                Some(Kind::Reserved { .. }) => reserved += 1,
                None => {}
            }
        }
        (m.len() as u32, bound, reserved)
    }

    fn group_nodes(&self, g: &Option<GroupKey>, except: &str) -> HashSet<String> {
        let Some(m) = g.as_ref().and_then(|g| self.groups.get(g)) else {
            return HashSet::new();
        };
        m.values()
            .filter(|u| u.as_str() != except)
            .filter_map(|u| self.bookings.get(u))
            .map(|b| b.node.clone())
            .collect()
    }

    fn req<'a>(&'a self, uid: &'a str, ns: &'a str, demand: &'a GpuDemand) -> Req<'a> {
        let group = group_key(ns, demand);
        let group_nodes = self.group_nodes(&group, uid);
        Req {
            ns,
            demand,
            group,
            group_nodes,
            own: self.bookings.get(uid),
            tags: tags_of(ns, Some(demand)),
        }
    }

    /// Coscheduling gate for an unadmitted group. `Ok(Some(node))`: this pod is
    /// reserved on `node`; `Ok(None)`: admitted, place it normally; `Err`: wait.
    fn admit_group(
        &mut self,
        pod: &PodInfo,
        spec: &GroupSpec,
        key: &GroupKey,
        names: &[String],
        now_ms: u64,
    ) -> Result<Option<String>, String> {
        let min = spec.min_members();
        let (members, bound, reserved) = self.group_counts(key);
        if bound + reserved >= min {
            return Ok(None);
        }
        if members < min {
            return Err(format!(
                "group {key}: {members} of {min} required members exist"
            ));
        }
        // Plan every unplaced member at once, in name order, holding what each takes.
        let todo: Vec<String> = self
            .groups
            .get(key)
            .map(|m| {
                m.values()
                    .filter(|u| !self.bookings.contains_key(*u))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let deadline = now_ms + self.cfg.reservation_timeout_ms;
        let mut planned: Vec<String> = Vec::new();
        for uid in todo {
            let Some(e) = self.pods.get(&uid) else {
                continue;
            };
            if e.node_name.is_some() {
                continue;
            }
            let Ok(Some(d)) = e.demand.clone() else {
                continue;
            };
            let ns = e.namespace.clone();
            // The nodes the scheduler found feasible for this member stand in for
            // everyone's: a group's pods share one template (selectors, tolerations),
            // and a member planned onto a node it cannot go to would hold it in vain.
            let req = self.req(&uid, &ns, &d);
            let best = names
                .iter()
                .filter_map(|n| self.evaluate(&req, n).ok().map(|c| (n, c)))
                .max_by(|(na, a), (nb, b)| a.raw.cmp(&b.raw).then(nb.cmp(na)));
            if let Some((node, c)) = best {
                let b = self.booking_for(&req, node, &c, Kind::Reserved { deadline });
                self.add_booking(&uid, b);
                planned.push(uid);
            }
        }
        let placed = bound + reserved + planned.len() as u32;
        if placed < min {
            for u in &planned {
                self.remove_booking(u);
            }
            return Err(format!(
                "group {key}: {placed} of {min} required members can be placed at once"
            ));
        }
        Ok(self.bookings.get(&pod.uid).map(|b| b.node.clone()))
    }

    // ------------------------------------------------------------ decisions

    /// The extender's filter: which of `names` can take the pod.
    pub fn filter(&mut self, pod: &PodInfo, names: &[String], now_ms: u64) -> FilterOutcome {
        self.expire(now_ms);
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
    /// the GPUs it gets as assumed. The caller writes the annotations and the
    /// Binding, and calls [`Cluster::rollback`] if either fails.
    pub fn bind(&mut self, uid: &str, node: &str, now_ms: u64) -> Result<BindDecision, String> {
        self.expire(now_ms);
        let Some(e) = self.pods.get(uid).cloned() else {
            return Err(format!("pod {uid} is not known to the extender yet"));
        };
        let demand = match &e.demand {
            Ok(None) => {
                return Ok(BindDecision {
                    allocation: None,
                    summary: "no GPU requested".into(),
                });
            }
            Err(err) => return Err(format!("invalid sharedgpu labels: {err}")),
            Ok(Some(d)) => d.clone(),
        };
        if let Some(b) = self.bookings.get(uid).cloned()
            && let Kind::Reserved { .. } = b.kind
        {
            if b.node != node {
                return Err(format!(
                    "group member's place is reserved on {}, not {node}",
                    b.node
                ));
            }
            self.remove_booking(uid);
            let b = Booking {
                kind: Kind::Assumed,
                ..b
            };
            let decision = self.decision(node, &b, &demand);
            self.add_booking(uid, b);
            return Ok(decision);
        }
        if let (Some(spec), Some(key)) = (&demand.group, group_key(&e.namespace, &demand)) {
            let min = spec.min_members();
            let (members, bound, reserved) = self.group_counts(&key);
            if bound + reserved < min {
                return Err(format!(
                    "group {key}: not admitted yet ({members} members exist, {bound} bound, {min} required)"
                ));
            }
        }
        let req = self.req(uid, &e.namespace, &demand);
        let choice = self.evaluate(&req, node).map_err(|(m, _)| m)?;
        let b = self.booking_for(&req, node, &choice, Kind::Assumed);
        let decision = self.decision(node, &b, &demand);
        self.remove_booking(uid);
        self.add_booking(uid, b);
        Ok(decision)
    }

    /// Undoes a bind whose annotations or Binding failed.
    pub fn rollback(&mut self, uid: &str) {
        if matches!(self.bookings.get(uid).map(|b| &b.kind), Some(Kind::Assumed)) {
            self.remove_booking(uid);
        }
    }

    fn decision(&self, node: &str, b: &Booking, d: &GpuDemand) -> BindDecision {
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
        let share = match d.share {
            GpuShare::Whole { gpus } => format!("{gpus} whole GPUs"),
            GpuShare::Fraction { request, limit, .. } => {
                format!("request {request}, limit {limit}")
            }
        };
        BindDecision {
            allocation: Some(Allocation {
                node: node.to_string(),
                gpu_uuids: b.gpus.clone(),
                gpu_mem: b.mem,
                gpu_model: b.model.clone(),
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
        let spread = d.priority > 0;
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
                    let tag = in_tag(b.0).cmp(&in_tag(a.0));
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
                Kind::Assumed => c.1 += 1,
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
        let mut fresh: HashMap<(String, String), (u32, u64, u32)> = HashMap::new();
        for b in self.bookings.values() {
            let Some(node) = self.nodes.get(&b.node) else {
                continue;
            };
            for u in &b.gpus {
                if node.by_uuid.contains_key(u) {
                    let e = fresh.entry((b.node.clone(), u.clone())).or_default();
                    e.0 += b.milli;
                    e.1 += b.mem;
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
                if (g.used, g.mem_used, g.holders) != want {
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
