//! The books: pods as the watch shows them, one booking per pod, and the per-GPU sums.
//!
//! Rules that keep the books true under a lagging or replayed watch:
//! - a bound pod is booked from its allocation record alone (granted share, GPUs,
//!   memory), never from its labels; a record is written once, with the Binding;
//! - an event older (by `resourceVersion`) than what we hold is ignored;
//! - an assumed booking (bound by us, not yet seen) is never undone by an event of
//!   the pod from before the bind, nor by a relist: only by the API's answer (a GET
//!   after a deadline) or by the pod bound without our record;
//! - a record that cannot be added (sums that would overflow), that changes after it
//!   was observed, or that does not parse is a [`RecordProblem`]: reported, never
//!   booked silently and never freeing what is booked.

use std::collections::{BTreeSet, HashMap, HashSet};

use kubeshare_api::{Allocation, GpuDemand, GroupSpec};

use super::{
    Booking, Cluster, Gpu, GroupKey, GroupWait, Kind, PodEntry, PodInfo, RecordError, Req,
    group_key, tags_of,
};

/// How many deleted or finished pods are remembered (to ignore their replays).
const GONE_KEPT: usize = 100_000;

/// Adds (or takes out) booking `b` on one of its GPUs: share, memory,
/// holders and tags. Sums were checked before an add (`account`); the same
/// function serves preemption's what-if copies of a node.
pub(super) fn book_gpu(g: &mut Gpu, b: &Booking, add: bool) {
    let mem = if b.managed.is_some() {
        &mut g.um_used
    } else {
        &mut g.mem_used
    };
    if add {
        g.used += b.milli;
        *mem += b.mem;
        g.holders += 1;
    } else {
        g.used = g.used.saturating_sub(b.milli);
        *mem = mem.saturating_sub(b.mem);
        g.holders = g.holders.saturating_sub(1);
    }
    super::bump(&mut g.affinity, &b.tags.affinity, add);
    super::bump(&mut g.anti, &b.tags.anti, add);
    super::bump(&mut g.exclusion, &b.tags.exclusion, add);
}

/// Something wrong with a pod's allocation record, for an event and a metric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordProblem {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub error: RecordError,
}

impl Cluster {
    // ------------------------------------------------------------ pods

    /// A Pod was added or changed (or listed).
    pub fn apply_pod(&mut self, p: &PodInfo) {
        if self.is_stale(p) || self.gone.contains(&p.uid) {
            return;
        }
        if p.terminal {
            self.delete_pod(&p.uid);
            return;
        }
        let has_record = !matches!(p.allocation, Ok(None));
        let relevant = !matches!(p.demand, Ok(None)) || has_record;
        if !relevant {
            if self.pods.contains_key(&p.uid) || self.bookings.contains_key(&p.uid) {
                self.forget_pod(&p.uid);
            }
            return;
        }
        self.note_pod(p);
        let bound = p.node_name.is_some();
        let record = match &p.allocation {
            Ok(Some(a)) if !p.kubeshare => {
                self.problem(
                    p,
                    RecordError::NotKubeShare {
                        node: a.node.clone(),
                    },
                );
                None
            }
            Ok(Some(a)) if p.node_name.as_deref() == Some(a.node.as_str()) => Some(a),
            Ok(Some(a)) => {
                // The Binding writes the record and the node at once: a record on an
                // unbound pod, or naming another node, was not written by us.
                if bound {
                    self.problem(
                        p,
                        RecordError::WrongNode {
                            record: a.node.clone(),
                            bound: p.node_name.clone().unwrap_or_default(),
                        },
                    );
                } else {
                    self.problem(p, RecordError::NotBound);
                }
                None
            }
            Err(e) => {
                if bound {
                    self.problem(p, RecordError::Unparseable(e.clone()));
                }
                None
            }
            Ok(None) => None,
        };
        let current = self.bookings.get(&p.uid).cloned();
        match record {
            Some(a) => {
                let b = self.booking_of_record(p, a);
                match current {
                    Some(old) if old.kind == Kind::Observed => {
                        if !old.same_grant(&b) {
                            self.problem(p, RecordError::Changed);
                        }
                    }
                    // Our Binding wrote exactly our decision: a different record
                    // was changed after it (no second bind can happen).
                    Some(old)
                        if matches!(old.kind, Kind::Assumed { .. }) && !old.same_grant(&b) =>
                    {
                        self.problem(p, RecordError::DiffersFromBind);
                        if let Some(bk) = self.bookings.get_mut(&p.uid) {
                            bk.kind = Kind::Observed;
                        }
                    }
                    // Ours confirmed, or a reservation, or none (a restart): the
                    // record is the truth.
                    _ => {
                        self.remove_booking(&p.uid);
                        if let Err(e) = self.add_booking(&p.uid, b) {
                            self.problem(p, e);
                        }
                    }
                }
            }
            None => match current.map(|b| b.kind) {
                Some(Kind::Observed) if bound => {
                    if matches!(p.allocation, Ok(None)) {
                        self.problem(p, RecordError::Removed);
                    }
                }
                Some(Kind::Observed) => {
                    self.remove_booking(&p.uid);
                }
                // Bound, but not with our record (another scheduler, or nodeName set
                // by hand): our bind did not happen, as the Binding carries the record.
                Some(Kind::Assumed { .. }) if bound && matches!(p.allocation, Ok(None)) => {
                    self.remove_booking(&p.uid);
                }
                // An event from before our bind (or a reservation): keep it.
                _ => {}
            },
        }
    }

    /// Whether the event is older than what we hold for the pod.
    fn is_stale(&self, p: &PodInfo) -> bool {
        match (self.pods.get(&p.uid).and_then(|e| e.rv), p.resource_version) {
            (Some(held), Some(rv)) => rv < held,
            _ => false,
        }
    }

    fn problem(&mut self, p: &PodInfo, error: RecordError) {
        self.problems.push(RecordProblem {
            uid: p.uid.clone(),
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            error,
        });
    }

    /// The record problems found since the last call (for events and metrics).
    pub fn take_problems(&mut self) -> Vec<RecordProblem> {
        std::mem::take(&mut self.problems)
    }

    fn booking_of_record(&self, p: &PodInfo, a: &Allocation) -> Booking {
        // Tags and group come from labels, which do not change after creation
        // (admission); the share and the GPUs come from the record alone.
        let demand = p.demand.as_ref().ok().and_then(|d| d.as_ref());
        Booking {
            node: a.node.clone(),
            gpus: a.gpu_uuids.clone(),
            milli: u32::from(a.granted.request_per_gpu().get()),
            // A unified-memory pod books its resident share; its `gpu_mem` is the ceiling.
            mem: a.gpu_mem_resident.unwrap_or(a.gpu_mem),
            managed: a.gpu_mem_resident.map(|_| a.gpu_mem),
            model: a.gpu_model.clone(),
            granted: a.granted,
            tags: tags_of(&p.namespace, demand),
            group: demand.and_then(|d| group_key(&p.namespace, d)),
            kind: Kind::Observed,
        }
    }

    /// Records a pod (for group counts and bind) without touching its booking.
    /// An older view of the pod than the one held is ignored.
    pub fn note_pod(&mut self, p: &PodInfo) {
        if self.is_stale(p) || self.gone.contains(&p.uid) {
            return;
        }
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
        if p.node_name.is_some() {
            self.refused.clear(&p.uid);
        }
        let old = self.pods.get(&p.uid);
        let rv = p.resource_version.or_else(|| old.and_then(|e| e.rv));
        let filtered = old.is_some_and(|e| e.filtered);
        let nominated = old.and_then(|e| e.nominated.clone());
        let blocked = old.map(|e| e.blocked.clone()).unwrap_or_default();
        self.pods.insert(
            p.uid.clone(),
            PodEntry {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                node_name: p.node_name.clone(),
                demand: p.demand.clone(),
                group: demand_group,
                rv,
                filtered,
                nominated,
                priority: p.pod_priority,
                blocked,
                terminating: p.terminating,
                preemption: p.preemption.clone(),
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

    /// The pod was deleted or has finished: it holds nothing, and no event of it
    /// (a replay, a stale list) brings it back. A UID is never reused, and a
    /// finished pod never runs again.
    pub fn delete_pod(&mut self, uid: &str) {
        if self.gone.insert(uid.to_string()) {
            self.gone_order.push_back(uid.to_string());
            if self.gone_order.len() > GONE_KEPT
                && let Some(old) = self.gone_order.pop_front()
            {
                self.gone.remove(&old);
            }
        }
        self.forget_pod(uid);
    }

    /// Gives back the table space a burst of pods left behind: a hash table keeps
    /// its capacity when entries leave, so after a 50,000-pod backlog drained, the
    /// per-pod tables alone held ~tens of MB. Cheap when nothing is
    /// sparse; the timer calls it before returning free heap to the system.
    pub fn compact(&mut self) {
        fn shrink<K: std::hash::Hash + Eq, V, S: std::hash::BuildHasher>(m: &mut HashMap<K, V, S>) {
            if m.capacity() > 4 * m.len().max(256) {
                m.shrink_to(2 * m.len());
            }
        }
        shrink(&mut self.pods);
        shrink(&mut self.bookings);
        shrink(&mut self.by_node);
        shrink(&mut self.affinity);
        shrink(&mut self.groups);
        self.refused.shrink();
        if self.gone.capacity() > 4 * self.gone.len().max(256) {
            self.gone.shrink_to(2 * self.gone.len());
        }
        if self.gone_order.capacity() > 4 * self.gone_order.len().max(256) {
            self.gone_order.shrink_to(2 * self.gone_order.len());
        }
    }

    /// Drops what we hold for a pod (it may come back: it no longer asks for a GPU,
    /// or a relist did not show it).
    fn forget_pod(&mut self, uid: &str) {
        self.abandon_preemption(uid);
        // A victim's room stays booked until its preemption's last victim has
        // left: then it goes to the preemptor whole, never piecemeal to others.
        if !self.victim_left(uid)
            && let Some(b) = self.remove_booking(uid)
        {
            self.refused.freed(&b.node, self.version);
        }
        self.refused.clear(uid);
        if let Some(e) = self.pods.remove(uid)
            && let Some(g) = e.group
        {
            self.leave_group(&g, &e.name);
        }
    }

    /// Keeps only these pods (after a relist). A relist never drops an assumed
    /// booking (its snapshot may predate our Binding: the assumed-booking check
    /// asks the API instead) nor a reservation (it expires on its own).
    pub fn retain_pods(&mut self, keep: &HashSet<String>) {
        let gone: Vec<String> = self
            .pods
            .keys()
            .chain(self.bookings.keys())
            .filter(|u| !keep.contains(*u))
            .filter(|u| {
                !matches!(
                    self.bookings.get(*u).map(|b| &b.kind),
                    Some(Kind::Reserved { .. } | Kind::Assumed { .. })
                )
            })
            .cloned()
            .collect();
        for u in gone {
            self.forget_pod(&u);
        }
    }

    // ------------------------------------------------------------ books

    /// Books `b`; refused (nothing booked) when a sum would overflow.
    pub(super) fn add_booking(&mut self, uid: &str, b: Booking) -> Result<(), RecordError> {
        self.account(&b, true)?;
        if let Some(d) = b.deadline() {
            self.timed.insert((d, uid.to_string()));
        }
        self.by_node
            .entry(b.node.clone())
            .or_default()
            .insert(uid.to_string());
        self.bookings.insert(uid.to_string(), b);
        Ok(())
    }

    pub(super) fn remove_booking(&mut self, uid: &str) -> Option<Booking> {
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
        // Subtracting what was added cannot fail.
        let _ = self.account(&b, false);
        Some(b)
    }

    /// Adds or subtracts a booking's share on the GPUs of its node (if known).
    /// Adding is all or nothing: every sum is checked before any is changed.
    pub(super) fn account(&mut self, b: &Booking, add: bool) -> Result<(), RecordError> {
        self.version += 1;
        let Some(node) = self.nodes.get_mut(&b.node) else {
            return Ok(());
        };
        node.stamp = self.version;
        if add {
            for uuid in &b.gpus {
                let Some(&i) = node.by_uuid.get(uuid) else {
                    continue;
                };
                let g = &node.gpus[i];
                let mem = if b.managed.is_some() {
                    g.um_used
                } else {
                    g.mem_used
                };
                if g.used.checked_add(b.milli).is_none()
                    || mem.checked_add(b.mem).is_none()
                    || g.holders.checked_add(1).is_none()
                {
                    return Err(RecordError::NotAddable {
                        mem: b.mem,
                        booked: mem,
                        node: b.node.clone(),
                        idx: g.info.index,
                    });
                }
            }
        }
        for uuid in &b.gpus {
            let Some(&i) = node.by_uuid.get(uuid) else {
                continue;
            };
            book_gpu(&mut node.gpus[i], b, add);
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
        Ok(())
    }

    /// Drops reservations whose time is up. A group's reservations go together:
    /// when one expires, every place held for the group is freed. Returns the
    /// unbound members of those groups, to wake (so they retry in seconds).
    pub fn expire(&mut self, now_ms: u64) -> Vec<(String, String)> {
        self.now_hint = self.now_hint.max(now_ms);
        self.expire_preemptions(now_ms);
        let mut groups = Vec::new();
        while let Some((d, uid)) = self.timed.first().cloned() {
            if d > now_ms {
                break;
            }
            if let Some(b) = self.remove_booking(&uid) {
                self.refused.freed(&b.node, self.version);
                if let Some(g) = b.group {
                    groups.push(g);
                }
            }
        }
        let mut wake = Vec::new();
        groups.sort();
        groups.dedup();
        for g in groups {
            wake.extend(self.free_group(&g));
        }
        wake
    }

    /// Frees every place held for group `g` (reservations, members waiting at the
    /// gate); returns its members that are not bound, to wake.
    pub fn free_group(&mut self, g: &GroupKey) -> Vec<(String, String)> {
        let members: Vec<String> = self
            .groups
            .get(g)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        let mut wake = Vec::new();
        for uid in members {
            if matches!(
                self.bookings.get(&uid).map(|b| &b.kind),
                Some(Kind::Reserved { .. })
            ) && let Some(b) = self.remove_booking(&uid)
            {
                self.refused.freed(&b.node, self.version);
            }
            if let Some(e) = self.pods.get(&uid)
                && e.node_name.is_none()
                && !self.bookings.contains_key(&uid)
            {
                wake.push((e.namespace.clone(), e.name.clone()));
            }
        }
        wake
    }

    // ------------------------------------------------------------ groups

    /// (members, bound, reserved, at the gate) of a group.
    pub(super) fn group_counts(&self, g: &GroupKey) -> (u32, u32, u32, u32) {
        let Some(m) = self.groups.get(g) else {
            return (0, 0, 0, 0);
        };
        let (mut bound, mut reserved, mut gate) = (0, 0, 0);
        for uid in m.values() {
            match self.bookings.get(uid).map(|b| &b.kind) {
                Some(Kind::Observed | Kind::Assumed { .. }) => bound += 1,
                Some(Kind::Reserved { at_gate, .. }) => {
                    reserved += 1;
                    gate += u32::from(*at_gate);
                }
                None => {}
            }
        }
        (m.len() as u32, bound, reserved, gate)
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

    pub(super) fn req<'a>(&'a self, uid: &'a str, ns: &'a str, demand: &'a GpuDemand) -> Req<'a> {
        let group = group_key(ns, demand);
        let group_nodes = self.group_nodes(&group, uid);
        let tags = tags_of(ns, Some(demand));
        let protect = self.pending_affinity_room(uid, tags.affinity.as_deref());
        let own = self.bookings.get(uid);
        let tag_locs = tags
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
        Req {
            uid,
            ns,
            demand,
            group,
            group_nodes,
            own,
            tags,
            protect,
            tag_locs,
        }
    }

    /// Room that pending pods of an affinity tag need on the GPUs where the tag
    /// lives (their only possible GPUs), leaving out the tag `except` (the pod's
    /// own) and the pod `uid` itself: other pods should not take it where another
    /// GPU fits, or the tag's pending members could never start.
    fn pending_affinity_room(
        &self,
        uid: &str,
        except: Option<&str>,
    ) -> HashMap<(String, String), u32> {
        let mut room: HashMap<(String, String), u32> = HashMap::new();
        if self.affinity.is_empty() {
            return room;
        }
        for (u, e) in &self.pods {
            if u == uid || e.node_name.is_some() || self.bookings.contains_key(u) {
                continue;
            }
            let Ok(Some(d)) = &e.demand else { continue };
            let Some(t) = &d.affinity else { continue };
            let key = format!("{}/{t}", e.namespace);
            if Some(key.as_str()) == except {
                continue;
            }
            if let Some(locs) = self.affinity.get(&key) {
                for loc in locs.keys() {
                    let r = room.entry(loc.clone()).or_default();
                    *r = r.saturating_add(u32::from(d.request_per_gpu().get()));
                }
            }
        }
        room
    }

    /// Coscheduling gate for an unadmitted group. `Ok(Some(node))`: this pod is
    /// reserved on `node`; `Ok(None)`: admitted, place it normally; `Err`: wait.
    pub(super) fn admit_group(
        &mut self,
        pod: &PodInfo,
        spec: &GroupSpec,
        key: &GroupKey,
        names: &[String],
        now_ms: u64,
    ) -> Result<Option<String>, GroupWait> {
        let min = spec.min_members();
        let (members, bound, reserved, _) = self.group_counts(key);
        if bound >= min {
            // Running: the others are placed like any pod (close to the group).
            return Ok(None);
        }
        if bound + reserved >= min {
            // Admitted without this member: it follows once the group runs.
            return Err(GroupWait::Starting {
                group: key.clone(),
                min,
            });
        }
        if members < min {
            return Err(GroupWait::TooFew {
                group: key.clone(),
                members,
                min,
            });
        }
        // Only members the scheduler has sent us count: one that no node can take
        // (a nodeSelector that matches nothing) never reaches the extender, and a
        // place held for it would be held in vain.
        let todo: Vec<String> = self
            .groups
            .get(key)
            .map(|m| {
                m.values()
                    .filter(|u| !self.bookings.contains_key(*u))
                    .filter(|u| self.pods.get(*u).is_some_and(|e| e.filtered))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let seen = bound + reserved + todo.len() as u32;
        if seen < min {
            return Err(GroupWait::NotSeen {
                group: key.clone(),
                seen,
                min,
            });
        }
        // Plan them all at once, in name order, holding what each takes.
        let deadline = now_ms.saturating_add(self.cfg.reservation_timeout_ms);
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
            // everyone's: a group's pods share one template (selectors, tolerations);
            // a member that cannot go there never reaches bind, and the gate at bind
            // then keeps every other member from starting.
            let req = self.req(&uid, &ns, &d);
            let best = names
                .iter()
                .filter_map(|n| self.evaluate(&req, n).ok().map(|c| (n, c)))
                .max_by(|(na, a), (nb, b)| a.raw.cmp(&b.raw).then(nb.cmp(na)));
            if let Some((node, c)) = best {
                let b = self.booking_for(
                    &req,
                    node,
                    &c,
                    Kind::Reserved {
                        deadline,
                        at_gate: false,
                    },
                );
                if self.add_booking(&uid, b).is_ok() {
                    planned.push(uid);
                }
            }
        }
        let placed = bound + reserved + planned.len() as u32;
        if placed < min {
            for u in &planned {
                self.remove_booking(u);
            }
            return Err(GroupWait::NoRoom {
                group: key.clone(),
                placed,
                min,
            });
        }
        // Admitted: the other members waiting in the scheduler's queue are woken,
        // so that they reach bind while this one waits there, each nominated to
        // its place: kube-scheduler tries that node first instead of hoping that
        // its search (a fraction of a large cluster's nodes) reaches it.
        for u in planned.iter().filter(|u| **u != pod.uid) {
            let node = self.bookings.get(u).map(|b| b.node.clone());
            if let Some(e) = self.pods.get(u) {
                self.wake.push((e.namespace.clone(), e.name.clone()));
            }
            if let Some(n) = node {
                self.nominate_to(u, &n);
            }
        }
        Ok(self.bookings.get(&pod.uid).map(|b| b.node.clone()))
    }
}
