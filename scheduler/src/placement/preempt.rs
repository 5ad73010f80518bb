//! Preemption for GPU shares: when a guaranteed pod (`sharedgpu/priority` 1–100)
//! fits nowhere, which opportunistic pods (priority 0) to evict and where, and
//! the books while they leave. Pure: the evictions and events are
//! `crate::preemption`'s.
//!
//! The choice ([`Cluster::plan_preemption`]) looks at the nodes kube-scheduler
//! sent (they passed its own filters) and, on each, at the sets of victims whose
//! removal makes the pod fit by the same checks as any placement (share, memory,
//! model, tags). A victim is an observed opportunistic pod whose `spec.priority`
//! is not above the preemptor's, not already being evicted; a group's members
//! are one unit, evicted together or not at all, and a group with any member
//! that may not be evicted is left alone. Among the sets that fit, the least
//! [`VictimCost`] wins (fewest pods, then the lowest top `spec.priority`, the
//! lowest sum of them, the least share evicted), then the node name, then the
//! victims' uids: deterministic. Sets are tried by increasing pod count, so the
//! chosen one is minimal: no proper subset (groups kept whole) would do. The
//! search makes at most [`SEARCH_BUDGET`] what-if checks; past it, no plan.
//!
//! A guaranteed group that cannot start preempts for its quorum at once
//! ([`Cluster::preempt`]): members that fit as the books are get held places,
//! the others the search above, one after another, on the books as they would be.
//!
//! While the victims leave, their room stays booked (they still run). When the
//! last one is gone, the room is reserved for the preemptor in the same step (a
//! `Reserved` booking, as a group member's place is) and the pod is nominated to
//! the node and woken: no other pod can take the room in between.
//!
//! Across a restart: before it evicts, the extender writes a [`PreemptRecord`] on
//! each preemptor ([`PREEMPTION_ANNOTATION`]). A new extender takes those records
//! up once, before its first decision ([`Cluster::resume_preemptions`]): victims
//! still there are waited for again (and evicted, unless already leaving), and when
//! none is left the room is reserved for the preemptor at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use kubeshare_api::{GpuDemand, GpuShare, GroupSpec};

use super::books::book_gpu;
use super::{
    Booking, Cluster, FilterKind, FilterOutcome, GroupKey, Kind, Node, PodInfo, Preempting,
    Promise, Req, group_key,
};

/// The most what-if fit checks one search makes (a node of 8 GPUs holding 80
/// small pods has millions of victim sets; the first levels are what matter).
pub const SEARCH_BUDGET: usize = 20_000;

/// How long the books wait for a preemption's victims to leave (their graceful
/// termination) before they give the preemption up.
pub(super) const PREEMPTION_TIMEOUT_MS: u64 = 120_000;

/// How long a node where an eviction was refused (a PodDisruptionBudget) is
/// left out of the pod's next searches.
const BLOCKED_MS: u64 = 30_000;

/// The annotation on a preemptor that records its preemption (JSON of a
/// [`PreemptRecord`]), written by the extender before the evictions, so that a
/// restarted extender carries the preemption on instead of starting another.
pub const PREEMPTION_ANNOTATION: &str = "sharedgpu/preemption";

/// What a preemptor was promised: the place its victims make room for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreemptRecord {
    pub node: String,
    /// GPU indexes, as planned.
    pub gpus: Vec<u32>,
    /// The victims' uids.
    pub victims: Vec<String>,
    /// When it was decided: wall-clock milliseconds since the Unix epoch (a
    /// record older than the preemption timeout is ignored).
    pub at: u64,
}

impl PreemptRecord {
    /// The records of an order's preemptors, decided at `at` (Unix ms).
    pub fn of_order(o: &PreemptOrder, at: u64) -> Vec<(PodRef, PreemptRecord)> {
        o.pods
            .iter()
            .map(|p| {
                (
                    p.pod.clone(),
                    PreemptRecord {
                        node: p.node.clone(),
                        gpus: p.gpus.clone(),
                        victims: o.victims.iter().map(|v| v.uid.clone()).collect(),
                        at,
                    },
                )
            })
            .collect()
    }

    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        // A struct of strings and integers: serialising cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads the annotation's value; `None` when it does not parse.
    pub fn from_annotation(v: &str) -> Option<PreemptRecord> {
        serde_json::from_str(v).ok()
    }
}

/// What [`Cluster::resume_preemptions`] took up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resumed {
    /// Preemptions carried on (waiting again, or reserved at once).
    pub count: usize,
    /// Evictions to post again: victims the records name that are still there
    /// and not leaving (the previous extender stopped before evicting them).
    pub orders: Vec<PreemptOrder>,
}

/// A pod, for events and the Eviction API.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How much a set of victims costs; compared field by field, smaller first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct VictimCost {
    /// Pods evicted (every member of a group counts).
    pub pods: usize,
    /// The highest `spec.priority` among them.
    pub top_priority: i32,
    /// The sum of their `spec.priority`.
    pub priority_sum: i64,
    /// The GPU share they hold, in thousandths, summed over their GPUs.
    pub share: u64,
}

impl VictimCost {
    fn add(self, o: VictimCost) -> VictimCost {
        VictimCost {
            pods: self.pods + o.pods,
            top_priority: if self.pods == 0 {
                o.top_priority
            } else {
                self.top_priority.max(o.top_priority)
            },
            priority_sum: self.priority_sum + o.priority_sum,
            share: self.share + o.share,
        }
    }
}

/// The search's answer: evict `victims` (uids, sorted) and the pod fits on
/// `node`, on the GPUs of index `gpus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub node: String,
    pub gpus: Vec<u32>,
    pub victims: Vec<String>,
    pub cost: VictimCost,
}

/// A preemptor and the place it gets once its victims are gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemptor {
    pub pod: PodRef,
    pub node: String,
    /// GPU indexes, as planned.
    pub gpus: Vec<u32>,
}

/// A preemption decided: what the extender evicts, and for whom (one pod, or
/// the members of a group that preempt together for the same victims).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptOrder {
    pub pods: Vec<Preemptor>,
    pub group: Option<GroupKey>,
    /// The preemptors' `sharedgpu/priority`.
    pub priority: u8,
    pub victims: Vec<PodRef>,
    /// Taken up from a record after a restart: the record and the `Preempting`
    /// event are already there; only the evictions are posted again.
    pub resumed: bool,
}

/// A preemption under way.
#[derive(Debug, Clone)]
pub(super) struct Preemption {
    node: String,
    /// Victims not gone yet.
    waiting: BTreeSet<String>,
    /// Victims gone, whose bookings are kept until the last one leaves.
    left: BTreeSet<String>,
    deadline: u64,
    /// Room promised on its node's GPUs while the victims leave: (GPU uuid,
    /// share, device memory) beyond what the victims free there.
    holds: Vec<(String, u32, u64)>,
}

/// Pods evicted together: one pod, or every booked member of a group.
#[derive(Debug, Clone)]
pub(super) struct Unit {
    pub(super) uids: Vec<String>,
    pub(super) cost: VictimCost,
    /// (node, GPU uuid) of every booking of its pods.
    places: BTreeSet<(String, String)>,
}

/// Where one search runs: a node, or one GPU of it (a pod of one fractional
/// GPU lands on one GPU, so only the units there can make room for it).
struct Scope<'a> {
    node: &'a str,
    /// The units it may evict (indexes into the search's units).
    units: Vec<usize>,
    /// For one GPU: its index in the node's list, and the share the victims
    /// must free at least there.
    gpu: Option<(usize, u64)>,
}

/// The best plan at one level of the search, with its full sort key.
type Best = (VictimCost, String, Vec<String>, Vec<u32>);

impl Cluster {
    /// The pure victim search: where evicting the fewest and least important
    /// opportunistic pods makes `pod` fit, among `names`. `None` when the pod
    /// may not preempt (opportunistic, a group member, already placed) or no
    /// set of victims makes room.
    pub fn plan_preemption(&self, pod: &PodInfo, names: &[String]) -> Option<Plan> {
        let Ok(Some(d)) = &pod.demand else {
            return None;
        };
        if d.group.is_some() {
            return None;
        }
        self.plan_for(&pod.uid, &pod.namespace, d, pod.pod_priority, names)
    }

    /// The search for one pod (a group member too).
    fn plan_for(
        &self,
        uid: &str,
        ns: &str,
        d: &GpuDemand,
        prio: i32,
        names: &[String],
    ) -> Option<Plan> {
        if d.priority == 0 || self.bookings.contains_key(uid) {
            return None;
        }
        let blocked = self.pods.get(uid).map(|e| &e.blocked);
        let units = self.victim_units(prio);
        if units.is_empty() {
            return None;
        }
        let req = self.req(uid, ns, d);
        let one_gpu = matches!(d.share, GpuShare::Fraction { count: 1, .. });
        let request = u64::from(d.request_per_gpu().get());
        let mut names: Vec<&String> = names.iter().collect();
        names.sort();
        names.dedup();
        let mut scopes = Vec::new();
        for n in names {
            let Some(node) = self.nodes.get(n) else {
                continue;
            };
            if blocked
                .and_then(|b| b.get(n))
                .is_some_and(|&t| t > self.now_hint)
            {
                continue;
            }
            let here: Vec<usize> = (0..units.len())
                .filter(|&u| units[u].places.iter().any(|(un, _)| un == n))
                .collect();
            if here.is_empty() {
                continue;
            }
            if !one_gpu {
                scopes.push(Scope {
                    node: n,
                    units: here,
                    gpu: None,
                });
                continue;
            }
            for (i, g) in node.gpus.iter().enumerate() {
                let on: Vec<usize> = here
                    .iter()
                    .copied()
                    .filter(|&u| units[u].places.contains(&(n.clone(), g.info.uuid.clone())))
                    .collect();
                if !on.is_empty() {
                    // Claims are not evicted: what they hold stays.
                    let need = (u64::from(g.used) + u64::from(g.claimed.milli) + request)
                        .saturating_sub(1000);
                    scopes.push(Scope {
                        node: n,
                        units: on,
                        gpu: Some((i, need)),
                    });
                }
            }
        }
        let most = scopes
            .iter()
            .map(|s| s.units.iter().map(|&u| units[u].cost.pods).sum::<usize>())
            .max()
            .unwrap_or(0);
        let mut budget = SEARCH_BUDGET;
        for k in 1..=most {
            let mut best: Option<Best> = None;
            for s in &scopes {
                self.search_level(&req, s, &units, k, &mut budget, &mut best);
            }
            if let Some((cost, node, victims, gpus)) = best {
                return Some(Plan {
                    node,
                    gpus,
                    victims,
                    cost,
                });
            }
            if budget == 0 {
                return None;
            }
        }
        None
    }

    /// Every set of `k` victim pods in scope `s` that makes room: the best
    /// (by cost, node, uids) goes to `best`.
    fn search_level(
        &self,
        req: &Req,
        s: &Scope,
        units: &[Unit],
        k: usize,
        budget: &mut usize,
        best: &mut Option<Best>,
    ) {
        let Some(node) = self.nodes.get(s.node) else {
            return;
        };
        let mut scratch = node.clone();
        let mut pick = Vec::new();
        let mut visit = |pick: &[usize], budget: &mut usize| -> bool {
            let cost = pick
                .iter()
                .fold(VictimCost::default(), |c, &u| c.add(units[u].cost));
            let mut uids: Vec<String> = pick
                .iter()
                .flat_map(|&u| units[u].uids.iter().cloned())
                .collect();
            uids.sort();
            if let Some(b) = best.as_ref()
                && (cost, s.node, &uids) >= (b.0, b.1.as_str(), &b.2)
            {
                return true;
            }
            if let Some((gi, need)) = s.gpu {
                let uuid = &node.gpus[gi].info.uuid;
                let freed: u64 = uids
                    .iter()
                    .filter_map(|u| self.bookings.get(u))
                    .filter(|b| b.on(s.node, uuid))
                    .map(|b| u64::from(b.milli))
                    .sum();
                if freed < need {
                    return true;
                }
            }
            if *budget == 0 {
                return false;
            }
            *budget -= 1;
            if let Some(gpus) = self.fits_without(req, s.node, &mut scratch, &uids) {
                *best = Some((cost, s.node.to_string(), uids, gpus));
            }
            true
        };
        combos(&s.units, units, 0, k, &mut pick, budget, &mut visit);
    }

    /// Whether the pod fits on `node_name` once the pods `uids` are gone: the
    /// GPU indexes it would get. `scratch` is a copy of the node's books, left
    /// as it was found.
    fn fits_without(
        &self,
        req: &Req,
        node_name: &str,
        scratch: &mut Node,
        uids: &[String],
    ) -> Option<Vec<u32>> {
        let mine = |add: bool, scratch: &mut Node| {
            for b in uids.iter().filter_map(|u| self.bookings.get(u)) {
                if b.node != node_name {
                    continue;
                }
                for uuid in &b.gpus {
                    if let Some(&i) = scratch.by_uuid.get(uuid) {
                        book_gpu(&mut scratch.gpus[i], b, add);
                    }
                }
            }
        };
        mine(false, scratch);
        let r = self
            .evaluate_on(req, node_name, scratch)
            .ok()
            .map(|c| c.gpus.iter().map(|&i| scratch.gpus[i].info.index).collect());
        mine(true, scratch);
        r
    }

    /// The pods a preemptor of `spec.priority` `prio` may evict, as units.
    pub(super) fn victim_units(&self, prio: i32) -> Vec<Unit> {
        let cost_of = |uid: &str| -> Option<VictimCost> {
            let b = self.bookings.get(uid)?;
            if b.kind != Kind::Observed || self.evicting.contains_key(uid) {
                return None;
            }
            let e = self.pods.get(uid)?;
            let Ok(Some(d)) = &e.demand else {
                return None;
            };
            (d.priority == 0 && e.priority <= prio).then(|| VictimCost {
                pods: 1,
                top_priority: e.priority,
                priority_sum: i64::from(e.priority),
                share: u64::from(b.milli) * b.gpus.len() as u64,
            })
        };
        let mut uids: Vec<&String> = self.bookings.keys().collect();
        uids.sort();
        let mut seen = BTreeSet::new();
        let mut units = Vec::new();
        for uid in uids {
            let members: Vec<String> = match &self.bookings[uid].group {
                None => vec![uid.clone()],
                Some(g) => {
                    if !seen.insert(g.clone()) {
                        continue;
                    }
                    self.groups
                        .get(g)
                        .map(|m| {
                            m.values()
                                .filter(|u| self.bookings.contains_key(*u))
                                .cloned()
                                .collect()
                        })
                        .unwrap_or_default()
                }
            };
            let costs: Option<Vec<VictimCost>> = members.iter().map(|u| cost_of(u)).collect();
            let Some(costs) = costs.filter(|c| !c.is_empty()) else {
                continue;
            };
            let mut uids = members;
            uids.sort();
            units.push(Unit {
                places: uids
                    .iter()
                    .filter_map(|u| self.bookings.get(u))
                    .flat_map(|b| b.gpus.iter().map(|g| (b.node.clone(), g.clone())))
                    .collect(),
                uids,
                cost: costs
                    .into_iter()
                    .fold(VictimCost::default(), VictimCost::add),
            });
        }
        units
    }

    /// Preemption for a guaranteed pod that fits none of `names` (or a member of
    /// a guaranteed group that cannot start): plans it, marks the victims,
    /// nominates the preemptors to their nodes and returns what to evict. `out`
    /// (the filter's answer) then says so.
    pub fn preempt(
        &mut self,
        pod: &PodInfo,
        names: &[String],
        now_ms: u64,
        out: &mut FilterOutcome,
    ) -> Option<PreemptOrder> {
        self.now_hint = self.now_hint.max(now_ms);
        let d = pod.demand.as_ref().ok()?.as_ref()?.clone();
        if d.priority == 0 || out.fits_elsewhere || self.preempting.contains_key(&pod.uid) {
            return None;
        }
        let order = match (&d.group, group_key(&pod.namespace, &d)) {
            (Some(spec), Some(key)) => self.preempt_group(&key, spec, d.priority, names, now_ms)?,
            _ => {
                let plan = self.plan_for(&pod.uid, &pod.namespace, &d, pod.pod_priority, names)?;
                let me = vec![(pod.uid.clone(), plan.node.clone(), plan.gpus.clone())];
                self.record_preemption(&me, &plan.victims, None, d.priority, now_ms)
            }
        };
        let victims: Vec<String> = order.victims.iter().map(PodRef::to_string).collect();
        for p in &order.pods {
            out.unresolvable.remove(&p.node);
            out.failed.insert(
                p.node.clone(),
                Preempting::Evicting {
                    node: p.node.clone(),
                    gpus: p
                        .gpus
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    count: victims.len(),
                    victims: victims.join(", "),
                }
                .to_string(),
            );
        }
        out.kind = FilterKind::Preempting;
        Some(order)
    }

    /// Marks the victims and the preemptors `(uid, node, gpus)`, which wait for
    /// all of `victims` to leave; nominates each preemptor to its node.
    fn record_preemption(
        &mut self,
        preemptors: &[(String, String, Vec<u32>)],
        victims: &[String],
        group: Option<GroupKey>,
        priority: u8,
        now_ms: u64,
    ) -> PreemptOrder {
        let pod_ref = |c: &Cluster, u: &str| {
            let e = &c.pods[u];
            PodRef {
                namespace: e.namespace.clone(),
                name: e.name.clone(),
                uid: u.to_string(),
            }
        };
        let order = PreemptOrder {
            pods: preemptors
                .iter()
                .map(|(u, node, gpus)| Preemptor {
                    pod: pod_ref(self, u),
                    node: node.clone(),
                    gpus: gpus.clone(),
                })
                .collect(),
            group,
            priority,
            victims: victims.iter().map(|v| pod_ref(self, v)).collect(),
            resumed: false,
        };
        for (u, node, gpus) in preemptors {
            for v in victims {
                self.evicting.entry(v.clone()).or_default().push(u.clone());
            }
            let waiting: BTreeSet<String> = victims.iter().cloned().collect();
            let holds = self.promise(u, node, gpus, &waiting);
            self.preempting.insert(
                u.clone(),
                Preemption {
                    node: node.clone(),
                    waiting,
                    left: BTreeSet::new(),
                    deadline: now_ms.saturating_add(PREEMPTION_TIMEOUT_MS),
                    holds,
                },
            );
            self.refresh_promises(node);
            self.nominate_to(u, node);
        }
        order
    }

    /// Takes up the preemptions that another extender recorded on pods
    /// ([`PreemptRecord`]); the first call does, later ones do nothing. The
    /// caller makes it once the watches have listed, before its first decision.
    /// `now_ms` is the books' clock, `wall_ms` the wall clock (Unix ms) the
    /// records' times are in. For each pending guaranteed pod with a record
    /// younger than the preemption timeout and nothing booked:
    ///
    /// - the victims it names that are still booked (and still victims a
    ///   preemptor may evict: opportunistic, of no higher `spec.priority`) are
    ///   waited for again, as if this extender had evicted them, and the rest of
    ///   its place is promised to it; those not already leaving are evicted
    ///   again (`orders`);
    /// - when none is left, the room is reserved for it at once, nominated and
    ///   woken, as when its last victim leaves.
    ///
    /// So the room the victims free goes to the preemptor, not to the next pod
    /// that asks, and no other victim is evicted for it.
    pub fn resume_preemptions(&mut self, now_ms: u64, wall_ms: u64) -> Resumed {
        let mut out = Resumed::default();
        if std::mem::replace(&mut self.resumed, true) {
            return out;
        }
        self.now_hint = self.now_hint.max(now_ms);
        let mut records: Vec<(String, PreemptRecord)> = self
            .pods
            .iter()
            .filter_map(|(u, e)| e.preemption.clone().map(|r| (u.clone(), r)))
            .collect();
        records.sort_by(|a, b| a.0.cmp(&b.0));
        for (p, r) in records {
            let Some(e) = self.pods.get(&p) else {
                continue;
            };
            let Ok(Some(d)) = &e.demand else {
                continue;
            };
            let age = wall_ms.saturating_sub(r.at);
            if d.priority == 0
                || e.node_name.is_some()
                || e.terminating
                || age >= PREEMPTION_TIMEOUT_MS
                || self.bookings.contains_key(&p)
                || self.preempting.contains_key(&p)
                || !self.nodes.contains_key(&r.node)
            {
                continue;
            }
            let (prio, priority) = (e.priority, d.priority);
            let waiting: BTreeSet<String> = r
                .victims
                .iter()
                .filter(|v| self.still_a_victim(v, prio))
                .cloned()
                .collect();
            out.count += 1;
            if waiting.is_empty() {
                self.reserve_preempted(&p, &r.node);
                continue;
            }
            let evict: Vec<PodRef> = waiting
                .iter()
                .filter(|v| self.pods.get(*v).is_some_and(|e| !e.terminating))
                .map(|v| PodRef {
                    namespace: self.pods[v].namespace.clone(),
                    name: self.pods[v].name.clone(),
                    uid: v.clone(),
                })
                .collect();
            for v in &waiting {
                self.evicting.entry(v.clone()).or_default().push(p.clone());
            }
            let holds = self.promise(&p, &r.node, &r.gpus, &waiting);
            self.preempting.insert(
                p.clone(),
                Preemption {
                    node: r.node.clone(),
                    waiting,
                    left: BTreeSet::new(),
                    deadline: now_ms.saturating_add(PREEMPTION_TIMEOUT_MS - age),
                    holds,
                },
            );
            self.refresh_promises(&r.node);
            self.nominate_to(&p, &r.node);
            if !evict.is_empty() {
                let e = &self.pods[&p];
                out.orders.push(PreemptOrder {
                    pods: vec![Preemptor {
                        pod: PodRef {
                            namespace: e.namespace.clone(),
                            name: e.name.clone(),
                            uid: p.clone(),
                        },
                        node: r.node.clone(),
                        gpus: r.gpus.clone(),
                    }],
                    group: e.group.clone(),
                    priority,
                    victims: evict,
                    resumed: true,
                });
            }
        }
        out
    }

    /// Whether `uid`, named by a record, may still be waited for (and evicted)
    /// for a preemptor of `spec.priority` `prio`: an observed opportunistic
    /// booking (on any node: a group of victims goes whole), of no higher
    /// `spec.priority`. Anything else a record names (gone, guaranteed, of a
    /// higher PriorityClass) is not touched.
    fn still_a_victim(&self, uid: &str, prio: i32) -> bool {
        let (Some(b), Some(e)) = (self.bookings.get(uid), self.pods.get(uid)) else {
            return false;
        };
        b.kind == Kind::Observed
            && e.priority <= prio
            && matches!(&e.demand, Ok(Some(d)) if d.priority == 0)
    }

    /// A guaranteed group that cannot start preempts for all its members at
    /// once. First the members that fit as the books are get their places
    /// (held until the preemption's deadline); then the others, in name order,
    /// each by the victim search on the books without the victims chosen so far
    /// and with the members placed so far, until ⌈threshold × headcount⌉ are
    /// placed. Not enough: nothing is held or evicted. Enough: every member
    /// that needs room waits for all the group's victims, then gets its place.
    fn preempt_group(
        &mut self,
        key: &GroupKey,
        spec: &GroupSpec,
        priority: u8,
        names: &[String],
        now_ms: u64,
    ) -> Option<PreemptOrder> {
        let min = spec.min_members();
        let (members, bound, reserved, _) = self.group_counts(key);
        if bound + reserved >= min || members < min {
            return None;
        }
        let all: Vec<String> = self.groups.get(key)?.values().cloned().collect();
        if all.iter().any(|u| self.preempting.contains_key(u)) {
            return None;
        }
        let todo: Vec<(String, String, GpuDemand, i32)> = all
            .iter()
            .filter(|u| !self.bookings.contains_key(*u))
            .filter_map(|u| {
                let e = self.pods.get(u)?;
                let d = e.demand.clone().ok()??;
                (e.filtered && e.node_name.is_none())
                    .then(|| (u.clone(), e.namespace.clone(), d, e.priority))
            })
            .collect();
        if bound + reserved + (todo.len() as u32) < min {
            return None;
        }
        let deadline = now_ms.saturating_add(PREEMPTION_TIMEOUT_MS);
        let held = Kind::Reserved {
            deadline,
            at_gate: false,
        };
        // Members that fit as the books are.
        let mut fit = Vec::new();
        let mut rest = Vec::new();
        for (u, ns, d, prio) in todo {
            let req = self.req(&u, &ns, &d);
            let best = names
                .iter()
                .filter_map(|n| self.evaluate(&req, n).ok().map(|c| (n, c)))
                .max_by(|(na, a), (nb, b)| a.raw.cmp(&b.raw).then(nb.cmp(na)))
                .map(|(n, c)| self.booking_for(&req, n, &c, held.clone()));
            drop(req);
            if best.is_some_and(|b| self.add_booking(&u, b).is_ok()) {
                fit.push(u);
            } else {
                rest.push((u, ns, d, prio));
            }
        }
        // The others, each with victims, on the books as they would be.
        let mut removed: Vec<(String, Booking)> = Vec::new();
        let mut planned: Vec<(String, String, Vec<u32>)> = Vec::new();
        for (u, ns, d, prio) in rest {
            if bound + reserved + (fit.len() + planned.len()) as u32 >= min {
                break;
            }
            let Some(plan) = self.plan_for(&u, &ns, &d, prio, names) else {
                continue;
            };
            for v in &plan.victims {
                if let Some(b) = self.remove_booking(v) {
                    removed.push((v.clone(), b));
                }
            }
            let req = self.req(&u, &ns, &d);
            let b = self
                .evaluate(&req, &plan.node)
                .ok()
                .map(|c| self.booking_for(&req, &plan.node, &c, held.clone()));
            drop(req);
            if let Some(b) = b
                && self.add_booking(&u, b).is_ok()
            {
                planned.push((u, plan.node, plan.gpus));
            }
        }
        // The victims still run: back into the books, and their room is not
        // the members' until they have left.
        for (u, ..) in &planned {
            self.remove_booking(u);
        }
        let victims: Vec<String> = removed.iter().map(|(v, _)| v.clone()).collect();
        for (v, b) in removed.into_iter().rev() {
            // Taken out just above: adding it back cannot overflow.
            let _ = self.add_booking(&v, b);
        }
        let placed = bound + reserved + (fit.len() + planned.len()) as u32;
        if placed < min || planned.is_empty() {
            for u in &fit {
                self.remove_booking(u);
            }
            return None;
        }
        for u in &fit {
            let node = self.bookings.get(u).map(|b| b.node.clone());
            self.wake_unbound(u);
            if let Some(n) = node {
                self.nominate_to(u, &n);
            }
        }
        let mut victims = victims;
        victims.sort();
        Some(self.record_preemption(&planned, &victims, Some(key.clone()), priority, now_ms))
    }

    /// While the pod's victims leave: why it waits.
    pub(super) fn preempt_waiting(&self, uid: &str) -> Option<Preempting> {
        self.preempting.get(uid).map(|p| Preempting::Waiting {
            node: p.node.clone(),
            waiting: p.waiting.len(),
            total: p.waiting.len() + p.left.len(),
        })
    }

    /// A pod left the books: when it is a victim of a preemption under way,
    /// returns true (its booking stays until the last victim leaves; then
    /// the room goes to the preemptors).
    pub(super) fn victim_left(&mut self, uid: &str) -> bool {
        let Some(ps) = self.evicting.get(uid).cloned() else {
            return false;
        };
        let mut keep = false;
        let mut done = Vec::new();
        for p in ps {
            if let Some(pre) = self.preempting.get_mut(&p) {
                keep = true;
                pre.waiting.remove(uid);
                pre.left.insert(uid.to_string());
                if pre.waiting.is_empty() {
                    done.push(p);
                }
            }
        }
        if !keep {
            self.evicting.remove(uid);
            return false;
        }
        self.complete_preemptions(&done);
        true
    }

    /// The last victims are gone: their room becomes the preemptors'
    /// reservations (in the order they were planned), and each preemptor is
    /// nominated there and woken.
    fn complete_preemptions(&mut self, done: &[String]) {
        let pres: Vec<(String, Preemption)> = done
            .iter()
            .filter_map(|p| self.preempting.remove(p).map(|pre| (p.clone(), pre)))
            .collect();
        for (p, pre) in &pres {
            for v in &pre.left {
                self.release_victim(v, p, true);
            }
        }
        let mut nodes: Vec<&str> = pres.iter().map(|(_, pre)| pre.node.as_str()).collect();
        nodes.sort_unstable();
        nodes.dedup();
        for n in nodes {
            self.refresh_promises(n);
        }
        for (p, pre) in pres {
            self.reserve_preempted(&p, &pre.node);
        }
    }

    /// Preemptor `p` no longer waits for victim `v`: when no preemption does,
    /// the mark goes, and (`gone`: it has left) its booking too.
    fn release_victim(&mut self, v: &str, p: &str, gone: bool) {
        let Some(l) = self.evicting.get_mut(v) else {
            return;
        };
        l.retain(|x| x != p);
        if l.is_empty() {
            self.evicting.remove(v);
            if gone {
                self.remove_booking(v);
            }
        }
    }

    /// The room preemptor `uid` will take on `node`'s GPUs of index `gpus`
    /// beyond what `victims` free there: (uuid, share, device memory) per GPU.
    /// Promised to it while the victims leave, so that no other pod takes the
    /// part of its place the victims do not hold (a free GPU beside them, the
    /// room left on theirs).
    fn promise(
        &self,
        uid: &str,
        node: &str,
        gpus: &[u32],
        victims: &BTreeSet<String>,
    ) -> Vec<(String, u32, u64)> {
        let (Some(n), Some(Ok(Some(d)))) =
            (self.nodes.get(node), self.pods.get(uid).map(|e| &e.demand))
        else {
            return Vec::new();
        };
        let whole = matches!(d.share, GpuShare::Whole { .. });
        let share = u32::from(d.request_per_gpu().get());
        let mut out = Vec::new();
        for g in n.gpus.iter().filter(|g| gpus.contains(&g.info.index)) {
            let mem = if whole {
                g.info.memory
            } else if d.managed_on(g.info.memory).is_none() {
                d.mem_on(g.info.memory)
            } else {
                0
            };
            let (vm, vmem) = victims
                .iter()
                .filter_map(|v| self.bookings.get(v))
                .filter(|b| b.on(node, &g.info.uuid))
                .fold((0u32, 0u64), |(m, b0), b| {
                    let dev = if b.managed.is_none() { b.mem } else { 0 };
                    (m.saturating_add(b.milli), b0.saturating_add(dev))
                });
            let hold = (share.saturating_sub(vm), mem.saturating_sub(vmem));
            if hold != (0, 0) {
                out.push((g.info.uuid.clone(), hold.0, hold.1));
            }
        }
        out
    }

    /// Sets each GPU of `node` (named `name`) to the room promised there to the
    /// preemptions under way.
    pub(super) fn attach_promises(&self, name: &str, node: &mut Node) {
        for g in &mut node.gpus {
            g.promised.clear();
        }
        let mut pres: Vec<(&String, &Preemption)> = self
            .preempting
            .iter()
            .filter(|(_, p)| p.node == name && !p.holds.is_empty())
            .collect();
        pres.sort_by_key(|(u, _)| *u);
        for (uid, pre) in pres {
            let pod = self
                .pods
                .get(uid)
                .map(|e| format!("{}/{}", e.namespace, e.name))
                .unwrap_or_default();
            for (uuid, milli, mem) in &pre.holds {
                if let Some(&i) = node.by_uuid.get(uuid) {
                    node.gpus[i].promised.push(Promise {
                        uid: uid.clone(),
                        pod: pod.clone(),
                        milli: *milli,
                        mem: *mem,
                    });
                }
            }
        }
    }

    /// The promises on `name`'s GPUs changed: set them, and give the node a new
    /// stamp so that no verdict judged without them is reused; pods refused
    /// there are woken when room is given back.
    fn refresh_promises(&mut self, name: &str) {
        self.refresh_gpus(
            name,
            |g| g.promised.clone(),
            Self::attach_promises,
            |before, after| after.len() < before.len(),
        );
    }

    fn reserve_preempted(&mut self, p: &str, node: &str) {
        let Some(e) = self.pods.get(p).cloned() else {
            return;
        };
        let Ok(Some(d)) = &e.demand else {
            return;
        };
        if e.node_name.is_some() || self.bookings.contains_key(p) {
            return;
        }
        let req = self.req(p, &e.namespace, d);
        let booking = self.evaluate(&req, node).ok().map(|c| {
            self.booking_for(
                &req,
                node,
                &c,
                Kind::Reserved {
                    deadline: self
                        .now_hint
                        .saturating_add(self.cfg.reservation_timeout_ms),
                    at_gate: false,
                },
            )
        });
        drop(req);
        if let Some(b) = booking {
            // Fits: add_booking only refuses sums that overflow.
            let _ = self.add_booking(p, b);
        }
        if let Some(e) = self.pods.get_mut(p) {
            e.nominated = None;
        }
        self.nominate_to(p, node);
    }

    /// Gives a preemption up (its pod is gone, its time is up, or an eviction was
    /// refused): victims not evicted stay; the room of those gone is freed.
    pub(super) fn abandon_preemption(&mut self, p: &str) {
        let Some(pre) = self.preempting.remove(p) else {
            return;
        };
        for v in &pre.waiting {
            self.release_victim(v, p, false);
        }
        for v in &pre.left {
            self.release_victim(v, p, true);
        }
        self.refresh_promises(&pre.node);
    }

    /// Preemptions whose victims did not leave in time are given up; their
    /// pods are woken to search again.
    pub(super) fn expire_preemptions(&mut self, now_ms: u64) {
        let due: Vec<String> = self
            .preempting
            .iter()
            .filter(|(_, p)| p.deadline <= now_ms)
            .map(|(u, _)| u.clone())
            .collect();
        for p in due {
            self.abandon_preemption(&p);
            self.wake_unbound(&p);
        }
    }

    /// An eviction of `order` was refused (a PodDisruptionBudget, or the API):
    /// the preemption is given up (a group's places held for it too), each
    /// preemptor's node is left out of its searches for a while, and the
    /// preemptors are woken to search elsewhere.
    pub fn preemption_refused(&mut self, order: &PreemptOrder, now_ms: u64) {
        self.now_hint = self.now_hint.max(now_ms);
        for p in &order.pods {
            self.abandon_preemption(&p.pod.uid);
            if let Some(e) = self.pods.get_mut(&p.pod.uid) {
                e.blocked.retain(|_, t| *t > now_ms);
                e.blocked
                    .insert(p.node.clone(), now_ms.saturating_add(BLOCKED_MS));
            }
            self.wake_unbound(&p.pod.uid);
        }
        if let Some(g) = &order.group {
            let w = self.free_group(g);
            self.wake.extend(w);
        }
    }

    fn wake_unbound(&mut self, uid: &str) {
        if let Some(e) = self.pods.get(uid)
            && e.node_name.is_none()
        {
            self.wake.push((e.namespace.clone(), e.name.clone()));
        }
    }

    /// Preemptions under way: preemptor uid → (node, victims not gone yet).
    pub fn preemptions(&self) -> BTreeMap<String, (String, Vec<String>)> {
        self.preempting
            .iter()
            .map(|(u, p)| {
                (
                    u.clone(),
                    (p.node.clone(), p.waiting.iter().cloned().collect()),
                )
            })
            .collect()
    }
}

/// Calls `visit` with every set of units (indexes into `all`, picked from
/// `scope` in order) whose pods number exactly `left`, until it answers false.
fn combos(
    scope: &[usize],
    all: &[Unit],
    start: usize,
    left: usize,
    pick: &mut Vec<usize>,
    budget: &mut usize,
    visit: &mut impl FnMut(&[usize], &mut usize) -> bool,
) -> bool {
    if left == 0 {
        return visit(pick, budget);
    }
    for i in start..scope.len() {
        let u = scope[i];
        let n = all[u].cost.pods;
        if n > left {
            continue;
        }
        pick.push(u);
        let go_on = combos(scope, all, i + 1, left - n, pick, budget, visit);
        pick.pop();
        if !go_on {
            return false;
        }
    }
    true
}
