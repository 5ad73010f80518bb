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
//! While the victims leave, their room stays booked (they still run). When the
//! last one is gone, the room is reserved for the preemptor in the same step (a
//! `Reserved` booking, as a group member's place is) and the pod is nominated to
//! the node and woken: no other pod can take the room in between.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use kubeshare_api::GpuShare;

use super::books::book_gpu;
use super::{Cluster, FilterKind, FilterOutcome, Kind, Node, PodInfo, Preempting, Req};

/// The most what-if fit checks one search makes (a node of 8 GPUs holding 80
/// small pods has millions of victim sets; the first levels are what matter).
pub const SEARCH_BUDGET: usize = 20_000;

/// How long the books wait for a preemption's victims to leave (their graceful
/// termination) before they give the preemption up.
const PREEMPTION_TIMEOUT_MS: u64 = 120_000;

/// How long a node where an eviction was refused (a PodDisruptionBudget) is
/// left out of the pod's next searches.
const BLOCKED_MS: u64 = 30_000;

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

/// A preemption decided: what the extender evicts, and for whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptOrder {
    pub pod: PodRef,
    /// The preemptor's `sharedgpu/priority`.
    pub priority: u8,
    pub node: String,
    pub gpus: Vec<u32>,
    pub victims: Vec<PodRef>,
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
        if d.priority == 0 || d.group.is_some() || self.bookings.contains_key(&pod.uid) {
            return None;
        }
        let blocked = self.pods.get(&pod.uid).map(|e| &e.blocked);
        let units = self.victim_units(pod.pod_priority);
        if units.is_empty() {
            return None;
        }
        let req = self.req(&pod.uid, &pod.namespace, d);
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
                    let need = (u64::from(g.used) + request).saturating_sub(1000);
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

    /// Preemption for a guaranteed pod that fits none of `names`: plans it
    /// ([`Cluster::plan_preemption`]), marks the victims, nominates the pod to
    /// the node and returns what to evict. `out` (the filter's answer) then
    /// says so on that node.
    pub fn preempt(
        &mut self,
        pod: &PodInfo,
        names: &[String],
        now_ms: u64,
        out: &mut FilterOutcome,
    ) -> Option<PreemptOrder> {
        self.now_hint = self.now_hint.max(now_ms);
        if self.preempting.contains_key(&pod.uid) {
            return None;
        }
        let plan = self.plan_preemption(pod, names)?;
        let priority = pod.demand.as_ref().ok()?.as_ref()?.priority;
        let victims: Vec<PodRef> = plan
            .victims
            .iter()
            .map(|u| {
                let e = &self.pods[u];
                PodRef {
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    uid: u.clone(),
                }
            })
            .collect();
        for v in &plan.victims {
            self.evicting.insert(v.clone(), pod.uid.clone());
        }
        self.preempting.insert(
            pod.uid.clone(),
            Preemption {
                node: plan.node.clone(),
                waiting: plan.victims.iter().cloned().collect(),
                left: BTreeSet::new(),
                deadline: now_ms.saturating_add(PREEMPTION_TIMEOUT_MS),
            },
        );
        self.nominate_to(&pod.uid, &plan.node);
        let gpus: Vec<String> = plan.gpus.iter().map(u32::to_string).collect();
        let names: Vec<String> = victims.iter().map(PodRef::to_string).collect();
        out.unresolvable.remove(&plan.node);
        out.failed.insert(
            plan.node.clone(),
            Preempting::Evicting {
                node: plan.node.clone(),
                gpus: gpus.join(","),
                count: victims.len(),
                victims: names.join(", "),
            }
            .to_string(),
        );
        out.kind = FilterKind::Preempting;
        Some(PreemptOrder {
            pod: PodRef {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
            },
            priority,
            node: plan.node,
            gpus: plan.gpus,
            victims,
        })
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
    /// the room goes to the preemptor).
    pub(super) fn victim_left(&mut self, uid: &str) -> bool {
        let Some(p) = self.evicting.get(uid).cloned() else {
            return false;
        };
        let Some(pre) = self.preempting.get_mut(&p) else {
            self.evicting.remove(uid);
            return false;
        };
        pre.waiting.remove(uid);
        pre.left.insert(uid.to_string());
        if pre.waiting.is_empty() {
            self.complete_preemption(&p);
        }
        true
    }

    /// The last victim is gone: their room becomes the preemptor's reservation,
    /// and the preemptor is nominated there and woken.
    fn complete_preemption(&mut self, p: &str) {
        let Some(pre) = self.preempting.remove(p) else {
            return;
        };
        for v in &pre.left {
            self.evicting.remove(v);
            self.remove_booking(v);
        }
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
        let booking = self.evaluate(&req, &pre.node).ok().map(|c| {
            self.booking_for(
                &req,
                &pre.node,
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
            // Fits: nothing was added since the victims were booked, so no sum overflows.
            let _ = self.add_booking(p, b);
        }
        if let Some(e) = self.pods.get_mut(p) {
            e.nominated = None;
        }
        self.nominate_to(p, &pre.node);
    }

    /// Gives a preemption up (its pod is gone, its time is up, or an eviction was
    /// refused): victims not evicted stay; the room of those gone is freed.
    pub(super) fn abandon_preemption(&mut self, p: &str) {
        let Some(pre) = self.preempting.remove(p) else {
            return;
        };
        for v in pre.waiting.iter().chain(&pre.left) {
            self.evicting.remove(v);
        }
        for v in &pre.left {
            self.remove_booking(v);
        }
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

    /// An eviction for pod `uid` on `node` was refused (a PodDisruptionBudget, or
    /// the API): the preemption is given up, the node is left out of the pod's
    /// searches for a while, and the pod is woken to search elsewhere.
    pub fn preemption_refused(&mut self, uid: &str, node: &str, now_ms: u64) {
        self.now_hint = self.now_hint.max(now_ms);
        self.abandon_preemption(uid);
        if let Some(e) = self.pods.get_mut(uid) {
            e.blocked.retain(|_, t| *t > now_ms);
            e.blocked
                .insert(node.to_string(), now_ms.saturating_add(BLOCKED_MS));
        }
        self.wake_unbound(uid);
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
