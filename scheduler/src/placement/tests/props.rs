//! Property tests: interleavings of pods, nodes, restarts and stale events never overcommit a
//! GPU, and placement is deterministic.

use super::*;

// ---------------------------------------------------------------- properties

const KINDS: &[&[(&str, &str)]] = &[
    &[("gpu_request", "0.25"), ("gpu_limit", "0.5")],
    &[("gpu_request", "0.5"), ("gpu_limit", "1.0")],
    &[("gpu_request", "0.7"), ("gpu_limit", "1.0")],
    &[("gpu_request", "1.0"), ("gpu_limit", "1.0")],
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "0.3"),
        ("gpu_mem", "30Gi"),
    ],
    &[
        ("gpu_request", "0.3"),
        ("gpu_limit", "0.3"),
        ("gpu_count", "2"),
    ],
    &[("gpu_request", "2"), ("gpu_limit", "2")],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("priority", "50"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_affinity", "a"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_anti-affinity", "b"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "x"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "y"),
    ],
    &[
        ("gpu_request", "0.4"),
        ("gpu_limit", "1"),
        ("gpu_model", "B"),
    ],
    &[
        ("gpu_request", "0.4"),
        ("gpu_limit", "1"),
        ("group_name", "g"),
        ("group_headcount", "3"),
        ("group_threshold", "0.67"),
    ],
    &[],
    // Unified memory: resident shares that overcommit a 40 GiB GPU after two or three.
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("gpu_mem", "18Gi"),
        ("gpu_mem_mode", "unified"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("gpu_mem", "30Gi"),
        ("gpu_mem_mode", "unified"),
        ("gpu_mem_managed", "40Gi"),
    ],
    // Device mode with a large cap, to meet unified pods on the same GPUs.
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("gpu_mem", "25Gi"),
    ],
];

#[derive(Debug, Clone)]
enum Op {
    Create(usize),
    /// Filter, prioritize, and bind's decision (booked as assumed); the Binding
    /// is still to come (`Post`).
    Schedule(usize),
    /// The Binding of one decided bind: 0 done, 1 refused (a bind failing between
    /// decision and Binding), 2 outcome unknown but landed, 3 unknown, not landed.
    Post(usize, u8),
    /// A pending pod's labels change (between a decision and its Binding, say).
    Relabel(usize, usize),
    Deliver(usize),
    /// An old event of some pod delivered again (a stale watch event).
    Replay(usize),
    /// A bogus event: a bound pod's record tampered with (0 unparseable, 1 another
    /// GPU, 2 gpu_mem = u64::MAX); the stored record stays (admission refused it).
    Tamper(usize, u8),
    /// The watch relists: the queue is lost, a snapshot of the API is listed (it
    /// may predate binds in flight).
    Relist,
    /// Members waiting at the gate give up (their HTTP call times out).
    GiveUp,
    Delete(usize),
    Finish(usize),
    Restart,
    Tick(u64),
    /// A node's update that leaves its GPUs as they were (a heartbeat; the GPUs
    /// listed in reverse order when the flag is set).
    Heartbeat(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KINDS.len()).prop_map(Op::Create),
        6 => any::<usize>().prop_map(Op::Schedule),
        5 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)])
            .prop_map(|(k, o)| Op::Post(k, o)),
        1 => (any::<usize>(), 0..KINDS.len()).prop_map(|(k, n)| Op::Relabel(k, n)),
        3 => (1usize..4).prop_map(Op::Deliver),
        1 => any::<usize>().prop_map(Op::Replay),
        1 => (any::<usize>(), 0u8..3).prop_map(|(k, v)| Op::Tamper(k, v)),
        1 => Just(Op::Relist),
        1 => Just(Op::GiveUp),
        1 => any::<usize>().prop_map(Op::Delete),
        1 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Restart),
        1 => (1u64..40_000).prop_map(Op::Tick),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(k, r)| Op::Heartbeat(k, r)),
    ]
}

fn nodes() -> Vec<(String, NodeInventory)> {
    vec![
        ("n1".into(), inv(1, 2, "A", 40, &[])),
        ("n2".into(), inv(2, 2, "A", 40, &[(0, 1)])),
        ("n3".into(), inv(3, 4, "B", 80, &[(0, 1), (2, 3)])),
    ]
}

#[derive(Debug)]
enum Ev {
    Apply(Box<PodInfo>),
    Delete(String),
}

/// How long a settled assumed booking waits before it is checked against the API.
const CHECK_MS: u64 = 5_000;

/// The API server's truth, the watch's lag, and the extender's books.
struct World {
    api: BTreeMap<String, PodInfo>,
    /// Last resourceVersion handed out.
    rv: u64,
    queue: std::collections::VecDeque<Ev>,
    /// Every event ever sent, for replays.
    hist: Vec<PodInfo>,
    /// Binds decided, Binding not yet posted: (uid, node, decision).
    inflight: Vec<(String, String, BindDecision)>,
    /// Group members waiting at the gate: (uid, node).
    waiting: Vec<(String, String)>,
    c: Cluster,
    now: u64,
    next: u32,
    log: Vec<(String, String, Vec<String>)>,
}

impl World {
    fn new() -> World {
        let mut w = World {
            api: BTreeMap::new(),
            rv: 0,
            queue: Default::default(),
            hist: vec![],
            inflight: vec![],
            waiting: vec![],
            c: Cluster::new(Config::default()),
            now: 0,
            next: 0,
            log: vec![],
        };
        w.restart();
        w
    }

    /// Stores `p` with a new resourceVersion and sends its event.
    fn write(&mut self, mut p: PodInfo) {
        self.rv += 1;
        p.resource_version = Some(self.rv);
        self.hist.push(p.clone());
        self.api.insert(p.uid.clone(), p.clone());
        self.queue.push_back(Ev::Apply(Box::new(p)));
    }

    fn restart(&mut self) {
        // Binds in flight die with the process (their Binding never lands).
        self.inflight.clear();
        self.waiting.clear();
        self.c = Cluster::new(Config::default());
        // A new process sees only new events: nothing from before is replayed.
        self.queue.clear();
        self.hist.clear();
        for p in self.api.values() {
            self.c.apply_pod(p);
        }
        for (n, i) in nodes() {
            self.c.apply_node(&n, Ok(Some(i)));
        }
    }

    fn pick(&self, k: usize, pending: bool) -> Option<String> {
        let v: Vec<&String> = self
            .api
            .iter()
            .filter(|(_, p)| !pending || p.node_name.is_none())
            .map(|(u, _)| u)
            .collect();
        (!v.is_empty()).then(|| v[k % v.len()].clone())
    }

    /// What bind's task does after the decision: the Binding with the
    /// resourceVersion precondition, re-read on a conflict.
    fn post(&mut self, uid: &str, node: &str, d: &BindDecision, outcome: u8) {
        let (demand, rv) = (d.demand.clone(), d.rv);
        let Some(cur) = self.api.get(uid).cloned() else {
            self.c.rollback(uid);
            return;
        };
        if cur.node_name.is_some() {
            self.c.rollback(uid);
            return;
        }
        if rv != cur.resource_version {
            // 409: read the pod; labels changed → give up; else retry, same decision.
            self.c.note_pod(&cur);
            if cur.demand.clone().ok().flatten() != demand {
                self.c.rollback(uid);
                return;
            }
        }
        match outcome {
            1 => self.c.rollback(uid),
            3 => self.c.settle(uid, self.now, false),
            _ => {
                let mut q = cur.clone();
                // The record is granted from the labels the pod has at this write.
                if let (Some(a), Ok(Some(dm))) = (&d.allocation, &q.demand) {
                    assert_eq!(a.granted.request_per_gpu(), dm.request_per_gpu());
                    assert_eq!(a.granted.limit_per_gpu(), dm.limit_per_gpu());
                    self.log
                        .push((uid.to_string(), node.to_string(), a.gpu_uuids.clone()));
                }
                q.node_name = Some(node.to_string());
                q.allocation = Ok(d.allocation.clone());
                self.write(q);
                self.c.settle(uid, self.now, outcome == 0);
            }
        }
    }

    fn poll_waiting(&mut self) {
        for (uid, node) in std::mem::take(&mut self.waiting) {
            match self.c.poll_gate(&uid, &node) {
                Ok(Some(d)) => self.inflight.push((uid, node, d)),
                Ok(None) => self.waiting.push((uid, node)),
                Err(_) => {}
            }
        }
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Create(kind) => {
                self.next += 1;
                let uid = format!("u{:04}", self.next);
                self.write(pod(&uid, KINDS[kind]));
            }
            Op::Schedule(k) => {
                let Some(uid) = self.pick(k, true) else {
                    return;
                };
                if self.inflight.iter().any(|f| f.0 == uid)
                    || self.waiting.iter().any(|f| f.0 == uid)
                {
                    return;
                }
                let p = self.api[&uid].clone();
                let names = self.c.node_names();
                let f = self.c.filter(&p, &names, self.now);
                if f.passed.is_empty() {
                    return;
                }
                let scores = self.c.prioritize(&p, &f.passed);
                let mut fresh = self.c.clone();
                fresh.scores = None;
                assert_eq!(
                    fresh.prioritize(&p, &f.passed),
                    scores,
                    "cached scores = fresh scores"
                );
                let best = scores
                    .iter()
                    .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
                    .map(|s| s.0.clone())
                    .unwrap();
                match self.c.bind(&uid, &best, self.now) {
                    Ok(BindStep::Go(d)) => self.inflight.push((uid, best, *d)),
                    Ok(BindStep::Wait) => self.waiting.push((uid, best)),
                    Err(_) => {}
                }
                self.poll_waiting();
            }
            Op::Post(k, outcome) => {
                if self.inflight.is_empty() {
                    return;
                }
                let (uid, node, d) = self.inflight.remove(k % self.inflight.len());
                self.post(&uid, &node, &d, outcome);
            }
            Op::Relabel(k, kind) => {
                if let Some(uid) = self.pick(k, true) {
                    let mut q = pod(&uid, KINDS[kind]);
                    q.allocation = self.api[&uid].allocation.clone();
                    self.write(q);
                }
            }
            Op::Deliver(n) => {
                for _ in 0..n {
                    match self.queue.pop_front() {
                        Some(Ev::Apply(p)) => self.c.apply_pod(&p),
                        Some(Ev::Delete(u)) => self.c.delete_pod(&u),
                        None => break,
                    }
                }
            }
            Op::Replay(k) => {
                if !self.hist.is_empty() {
                    let p = self.hist[k % self.hist.len()].clone();
                    self.c.apply_pod(&p);
                }
            }
            Op::Tamper(k, v) => {
                let bound: Vec<&PodInfo> = self
                    .api
                    .values()
                    .filter(|p| matches!(p.allocation, Ok(Some(_))))
                    .collect();
                if bound.is_empty() {
                    return;
                }
                let mut t = bound[k % bound.len()].clone();
                let Ok(Some(mut a)) = t.allocation.clone() else {
                    return;
                };
                match v {
                    0 => {
                        t.allocation =
                            Err("annotation sharedgpu/gpu_mem=\"x\": not a byte count".into())
                    }
                    1 => {
                        let (_, i) = nodes().into_iter().find(|(n, _)| *n == a.node).unwrap();
                        a.gpu_uuids = i
                            .gpus
                            .iter()
                            .rev()
                            .take(a.gpu_uuids.len())
                            .map(|g| g.uuid.clone())
                            .collect();
                        t.allocation = Ok(Some(a));
                    }
                    _ => {
                        a.gpu_mem = u64::MAX;
                        t.allocation = Ok(Some(a));
                    }
                }
                self.rv += 1;
                t.resource_version = Some(self.rv);
                // Refused by admission: the API keeps the real record, but the
                // extender sees the attempt (defence in depth).
                self.api.get_mut(&t.uid).unwrap().resource_version = Some(self.rv);
                self.queue.push_back(Ev::Apply(Box::new(t)));
            }
            Op::Relist => {
                // The new stream starts at the list: nothing older comes after it.
                self.queue.clear();
                self.hist.clear();
                let snap: Vec<PodInfo> = self.api.values().cloned().collect();
                for p in &snap {
                    self.c.apply_pod(p);
                }
                self.c
                    .retain_pods(&snap.iter().map(|p| p.uid.clone()).collect());
            }
            Op::GiveUp => {
                for (uid, _) in std::mem::take(&mut self.waiting) {
                    self.c.leave_gate(&uid);
                }
            }
            Op::Delete(k) => {
                if let Some(uid) = self.pick(k, false) {
                    self.api.remove(&uid);
                    self.queue.push_back(Ev::Delete(uid));
                }
            }
            Op::Finish(k) => {
                if let Some(uid) = self.pick(k, false) {
                    let mut p = self.api[&uid].clone();
                    p.terminal = true;
                    self.write(p);
                    self.api.remove(&uid);
                }
            }
            Op::Restart => self.restart(),
            Op::Heartbeat(k, reversed) => {
                let all = nodes();
                let (n, mut i) = all[k % all.len()].clone();
                if reversed {
                    i.gpus.reverse();
                }
                self.c.apply_node(&n, Ok(Some(i)));
            }
            Op::Tick(ms) => {
                self.now += ms;
                self.c.expire(self.now);
                for (uid, _, _) in self.c.due_checks(self.now, CHECK_MS) {
                    if self.inflight.iter().any(|f| f.0 == uid) {
                        continue;
                    }
                    let fresh = self.api.get(&uid).cloned();
                    self.c.confirm(&uid, fresh.as_ref());
                }
                self.poll_waiting();
            }
        }
    }

    /// The truth: what bound pods' records say, summed per GPU.
    fn check(&self) -> Result<(), String> {
        self.c.check_invariants()?;
        // The filter's memo never changes an answer: every pending pod gets the
        // same verdicts with the memo as from a cluster that never memoised.
        let names = self.c.node_names();
        for p in self.api.values().filter(|p| p.node_name.is_none()) {
            let mut fresh = self.c.clone();
            fresh.memo = Default::default();
            let want = fresh.filter(p, &names, self.now);
            let got = self.c.clone().filter(p, &names, self.now);
            if got != want {
                return Err(format!(
                    "{}: memoised filter {got:?} != fresh {want:?}",
                    p.uid
                ));
            }
        }
        let caps: HashMap<String, u64> = nodes()
            .into_iter()
            .flat_map(|(_, i)| i.gpus.into_iter().map(|g| (g.uuid, g.memory)))
            .collect();
        // Per GPU: milli, device-mode caps, unified-memory resident shares.
        let mut used: HashMap<String, (u32, u64, u64)> = HashMap::new();
        for p in self.api.values() {
            if let Ok(Some(a)) = &p.allocation {
                let mut seen = HashSet::new();
                for u in &a.gpu_uuids {
                    if !seen.insert(u) {
                        return Err(format!("{} holds {u} twice", p.uid));
                    }
                    let e = used.entry(u.clone()).or_default();
                    e.0 += u32::from(a.granted.request_per_gpu().get());
                    match a.gpu_mem_resident {
                        None => e.1 += a.gpu_mem,
                        Some(r) => e.2 += r,
                    }
                }
            }
        }
        let factor = u128::from(Config::default().um_overcommit_milli);
        for (u, (m, d, um)) in used {
            let cap = caps[&u];
            // Device-mode caps never overcommit; unified-memory shares stay within the
            // factor of what they leave.
            if m > 1000 || d > cap || u128::from(um) * 1000 > factor * u128::from(cap - d) {
                return Err(format!(
                    "{u}: {m} milli, {d} bytes of device caps, {um} of unified shares given out of {cap}"
                ));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_gpu_is_ever_overcommitted(ops in proptest::collection::vec(op(), 1..150)) {
        let mut w = World::new();
        for o in &ops {
            w.step(o);
            if let Err(e) = w.check() {
                return Err(TestCaseError::fail(format!("after {o:?}: {e}")));
            }
        }
        // Finish the binds, catch up with the watch and the checks, restart: the
        // books agree with the truth.
        while !w.inflight.is_empty() {
            w.step(&Op::Post(0, 0));
        }
        w.step(&Op::GiveUp);
        w.step(&Op::Deliver(usize::MAX / 2));
        w.step(&Op::Tick(CHECK_MS));
        w.step(&Op::Deliver(usize::MAX / 2));
        let before: Vec<(String, u32, u64, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used, g.um_resident)).collect();
        let reserved = w.c.booking_counts().2;
        w.restart();
        let after: Vec<(String, u32, u64, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used, g.um_resident)).collect();
        if reserved == 0 {
            prop_assert_eq!(before, after);
        }
    }

    #[test]
    fn placement_is_deterministic(ops in proptest::collection::vec(op(), 1..80)) {
        let mut a = World::new();
        let mut b = World::new();
        for o in &ops {
            a.step(o);
            b.step(o);
        }
        prop_assert_eq!(&a.log, &b.log);
        prop_assert_eq!(a.c.usage(), b.c.usage());
    }
}
