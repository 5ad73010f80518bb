//! Bind's decision half and what follows it in the books: the re-check and the
//! assumed booking, the coscheduling gate (members wait at bind until the group's
//! quorum is there, then are released together), settling, rolling back, and the
//! checks of assumed bookings against the API. Pure: no I/O, no clock.

use kubeshare_api::{Allocation, GpuShare, Granted};

use super::{
    BindDecision, BindRefused, BindStep, Booking, Cluster, GroupKey, Kind, PodInfo, gib, group_key,
};

impl Cluster {
    /// The extender's bind, decision half: re-checks the pod on `node` and books
    /// the GPUs it gets as assumed. The caller writes the record with the Binding,
    /// then calls [`Cluster::settle`] (done, or outcome unknown) or
    /// [`Cluster::rollback`] (it surely failed).
    ///
    /// A member of a group whose quorum has not reached bind waits at the gate
    /// ([`BindStep::Wait`]): no member is bound before ⌈threshold × headcount⌉
    /// members are placed and at bind; then they are released together.
    pub fn bind(&mut self, uid: &str, node: &str, now_ms: u64) -> Result<BindStep, BindRefused> {
        let w = self.expire(now_ms);
        self.wake.extend(w);
        let Some(e) = self.pods.get(uid).cloned() else {
            return Err(BindRefused::UnknownPod {
                uid: uid.to_string(),
            });
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
            Err(err) => return Err(BindRefused::InvalidLabels(err.clone())),
            Ok(Some(d)) => d.clone(),
        };
        match self
            .bookings
            .get(uid)
            .map(|b| (b.kind.clone(), b.node.clone()))
        {
            Some((Kind::Observed, n)) => {
                return Err(BindRefused::AlreadyBound { node: n });
            }
            Some((Kind::Assumed { .. }, n)) => {
                return Err(BindRefused::BeingChecked { node: n });
            }
            Some((Kind::Reserved { deadline, .. }, n)) => {
                if n != node {
                    return Err(BindRefused::ReservedElsewhere {
                        reserved: n,
                        asked: node.to_string(),
                    });
                }
                if !self.grant_matches(uid) {
                    self.remove_booking(uid);
                    return Err(BindRefused::LabelsChanged);
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
                    .ok_or(BindRefused::ReleasedWithout);
            }
            None => {}
        }
        if let (Some(spec), Some(key)) = (&demand.group, group_key(&e.namespace, &demand)) {
            let min = spec.min_members();
            let (members, bound, _, _) = self.group_counts(&key);
            if bound < min {
                return Err(BindRefused::NotStarted {
                    group: key,
                    members,
                    bound,
                    min,
                });
            }
        }
        let req = self.req(uid, &e.namespace, &demand);
        let choice = self.evaluate(&req, node)?;
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
    pub(super) fn assume_reserved(&mut self, uid: &str, now_ms: u64) -> BindDecision {
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
    pub fn poll_gate(&self, uid: &str, node: &str) -> Result<Option<BindDecision>, BindRefused> {
        if !self.grant_matches(uid) {
            return Err(BindRefused::LabelsChanged);
        }
        match self.bookings.get(uid) {
            Some(b) if b.node == node && matches!(b.kind, Kind::Assumed { settled: false, .. }) => {
                Ok(Some(self.decision(uid, node, b)))
            }
            Some(b) if matches!(b.kind, Kind::Reserved { at_gate: true, .. }) => Ok(None),
            _ => Err(BindRefused::PlacesFreed),
        }
    }

    /// Whether the pod's booking grants what its labels (as held) ask for.
    pub(super) fn grant_matches(&self, uid: &str) -> bool {
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
    /// reserved until the group's deadline. Returns why its bind fails.
    pub fn leave_gate(&mut self, uid: &str) -> BindRefused {
        let mut why = BindRefused::AtGate;
        if let Some(b) = self.bookings.get_mut(uid)
            && let Kind::Reserved { deadline, .. } = b.kind
        {
            b.kind = Kind::Reserved {
                deadline,
                at_gate: false,
            };
            if let Some(k) = b.group.clone() {
                let (_, bound, _, gate) = self.group_counts(&k);
                why = BindRefused::GroupAtGate {
                    group: k,
                    at_bind: bound + gate + 1,
                };
            }
        }
        why
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

    /// Pods to wake since the last call: group members whose group's places
    /// were freed, and pending pods refused for room where room has freed since.
    pub fn take_wake(&mut self) -> Vec<(String, String)> {
        let mut w = std::mem::take(&mut self.wake);
        for uid in self.refused.take() {
            if let Some(e) = self.pods.get(&uid)
                && e.node_name.is_none()
            {
                w.push((e.namespace.clone(), e.name.clone()));
            }
        }
        w.sort();
        w.dedup();
        w
    }

    pub(super) fn decision(&self, uid: &str, node: &str, b: &Booking) -> BindDecision {
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
                gpu_mem: b.managed.unwrap_or(b.mem),
                gpu_model: b.model.clone(),
                granted: b.granted,
                gpu_mem_resident: b.managed.map(|_| b.mem),
            }),
            summary: match b.managed {
                None => format!(
                    "{node}/gpu {} ({}): {share}, {} memory per GPU",
                    idx.join(","),
                    b.model,
                    gib(b.mem)
                ),
                Some(ceiling) => format!(
                    "{node}/gpu {} ({}): {share}, unified memory: {} resident, {} managed ceiling per GPU",
                    idx.join(","),
                    b.model,
                    gib(b.mem),
                    gib(ceiling)
                ),
            },
        }
    }
}
