//! The virtual-clock harness shared by the simulation tests (`sim.rs`, `sim_latency.rs`):
//! simulated clients that behave like the hook, a GPU that runs kernels in submission order
//! without preemption, and the measurements the tests assert on.
#![allow(dead_code)] // each test file uses its own part of the harness

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

pub use gem_schd::core::{Action, ClientClass, ClientSpec, Core, Micros, Params};

pub const MS: Micros = 1_000;
pub const S: Micros = 1_000_000;

/// What a client does.
#[derive(Debug, Clone)]
pub struct Pattern {
    /// Duration of one kernel.
    pub kernel_us: Micros,
    /// Kernels launched back to back per burst (then one synchronisation).
    pub kernels: u32,
    /// CPU time between the end of a burst and the next launch.
    pub gap_us: Micros,
    /// Intervals without any work.
    pub idle: Vec<(Micros, Micros)>,
    /// Launches a whole burst whenever its token is still valid, as the real hook lets it
    /// (the gate acts per launch and the CPU queues a burst far faster than the GPU runs
    /// it), instead of asking again when the burst does not fit what is left.
    pub blind: bool,
    /// CPU time per kernel launch (0: a burst is queued at once). With it, each kernel of a
    /// burst is launched on its own through the gate, like PyTorch through the hook: the CPU
    /// runs ahead of the GPU (when this is shorter than a kernel) and the queue grows with
    /// the hold; a launch past the deadline drains the queue, then asks again.
    pub launch_us: Micros,
}

impl Pattern {
    pub fn long() -> Self {
        Pattern {
            kernel_us: 20 * MS,
            kernels: 1,
            gap_us: 50,
            idle: vec![],
            blind: false,
            launch_us: 0,
        }
    }
    pub fn tiny() -> Self {
        Pattern {
            kernel_us: 50,
            kernels: 20,
            gap_us: 10,
            idle: vec![],
            blind: false,
            launch_us: 0,
        }
    }
    pub fn medium() -> Self {
        Pattern {
            kernel_us: 700,
            kernels: 4,
            gap_us: 30,
            idle: vec![],
            blind: false,
            launch_us: 0,
        }
    }
    /// Like the GPU benchmark's matmul tenant: 20 × 1.7 ms kernels, then a sync.
    pub fn matmul() -> Self {
        Pattern {
            kernel_us: 1_700,
            kernels: 20,
            gap_us: 300,
            idle: vec![],
            blind: false,
            launch_us: 0,
        }
    }
    pub fn absent() -> Self {
        Pattern {
            idle: vec![(0, Micros::MAX)],
            ..Pattern::long()
        }
    }
    /// Fraction of its time this pattern keeps the GPU busy when it runs alone.
    /// The scheduler charges the time a client holds the token, CPU gaps between its
    /// bursts included (as Gemini does), so a client at its limit or its request
    /// gets `share × duty` of GPU busy time.
    pub fn duty(&self) -> f64 {
        let burst = (self.kernel_us * Micros::from(self.kernels)) as f64;
        burst / (burst + self.gap_us as f64)
    }
    /// The GPU benchmark's capped tenant: 50 ms bursts of 0.175 ms kernels, launched
    /// blind, `gap_us` of CPU between them.
    pub fn blind_50ms(gap_us: Micros) -> Self {
        Pattern {
            kernel_us: 175,
            kernels: 286,
            gap_us,
            idle: vec![],
            blind: true,
            launch_us: 0,
        }
    }
    pub fn idle_during(mut self, from: Micros, to: Micros) -> Self {
        self.idle.push((from, to));
        self
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ev {
    /// The client's CPU wants to launch its next burst.
    Ready(usize),
    /// The client's CPU launches the next kernel of its burst (`Pattern::launch_us` > 0).
    Launch(usize),
    /// The client's burst finished on the GPU (its sync returns).
    SyncDone(usize),
    /// Release the token if nothing was launched since epoch `1`.
    IdleCheck(usize, u64),
    /// The hook's idle thread finds the hold granted at `1` past its deadline
    /// (`Sim::release_at_deadline`).
    DeadlineCheck(usize, Micros),
    /// A message reaches the scheduler.
    ToSched(usize, Msg),
    /// A grant reaches the client.
    Grant(usize, Micros),
    /// A Yield (its Renew refused) reaches the client.
    Yield(usize),
    /// The client's process, woken by a grant `Sim::wake` ago, launches (`Sim::wake`).
    Woken(usize, Micros),
    /// The scheduler's timer.
    Wake,
    /// Replace the config.
    Reconfig(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Msg {
    Request {
        overuse: Micros,
        burst: Micros,
    },
    Release {
        used: Micros,
    },
    Renew {
        burst: Micros,
    },
    /// The hook's notice that it stops launching and drains (`Sim::drain_notice`).
    Drain,
    /// The hook's Busy report (`Sim::busy_reports`).
    Busy {
        busy: Micros,
        held: Micros,
    },
}

pub struct Client {
    pub spec: ClientSpec,
    pub pattern: Pattern,
    pub holding: bool,
    pub grant_at: Micros,
    pub deadline: Micros,
    /// The quota of the current grant.
    pub quota: Micros,
    /// When the client wanted to launch its current burst (a request's arrival).
    pub want_at: Micros,
    /// Time from wanting to launch a burst to its end, per burst (a request's latency).
    pub latencies: Vec<Micros>,
    /// With a coarse clock, the burst the hook reports with its next request: the quota
    /// when its hold ended at the deadline, the time held when it released on idle.
    pub hook_burst: Micros,
    pub waiting: bool,
    pub overuse: Micros,
    pub launched_at: Micros,
    /// Kernels of the current burst launched so far, and the GPU end of the last one
    /// (`Pattern::launch_us` > 0).
    pub next_kernel: u32,
    pub last_end: Micros,
    pub epoch: u64,
    /// Renewals granted (`Sim::renew`).
    pub renewed: u32,
    /// (time, measured burst) over the last 3 s: the prediction is their maximum.
    /// Kept as a monotonic queue (decreasing bursts), so the maximum is the front.
    pub samples: VecDeque<(Micros, Micros)>,
    /// GPU busy intervals of this client's bursts.
    pub segments: Vec<(Micros, Micros)>,
    pub errors: u32,
    /// When the client last sent a Busy report, and since when it holds (its last grant)
    /// without having reported it (`Sim::busy_reports`).
    pub reported_at: Micros,
    pub held_from: Option<Micros>,
}

impl Client {
    pub fn predicted(&self) -> Micros {
        self.samples.front().map_or(0, |s| s.1)
    }
    pub fn idle_until(&self, t: Micros) -> Option<Micros> {
        self.pattern
            .idle
            .iter()
            .find(|(a, b)| *a <= t && t < *b)
            .map(|(_, b)| *b)
    }
}

pub struct Sim {
    /// Resolution of the clock the client's deadline check reads, like the hook's
    /// CLOCK_MONOTONIC_COARSE (one kernel tick, 1–4 ms); 0 = exact. With a tick, a client
    /// notices the end of its quota at its first launch after the tick past the deadline and
    /// reports the time held past the quota (the hook's `used − quota`) as overuse.
    pub tick: Micros,
    /// The hook reads the precise clock in the last tick before its deadline: the deadline
    /// is noticed at the first launch past it, exactly (the overuse is still reported the
    /// hook's way, as with a tick).
    pub precise: bool,
    pub core: Core,
    pub clients: Vec<Client>,
    pub queue: BinaryHeap<Reverse<(Micros, u64, Ev)>>,
    pub seq: u64,
    pub gpu_busy: Micros,
    pub latency: Micros,
    pub release_idle: Micros,
    pub last_wake: Option<Micros>,
    pub reconfigs: Vec<Vec<ClientSpec>>,
    /// Clients launching kernel by kernel (`Pattern::launch_us` > 0) ask to renew their hold
    /// at its deadline before draining, as the hook does (`Request::Renew`); off, they drain
    /// and ask with a request at every deadline (the hook before renewals).
    pub renew: bool,
    /// Clients send a Busy report (their GPU time and hold time since the last one) before
    /// each request, release and renewal, as the hook does when gem-schd co-runs clients
    /// (exactly: the simulation knows each client's GPU time, the hook samples it).
    pub busy_reports: bool,
    /// The part of a client's GPU time its Busy reports say (1: exactly; the hook samples one
    /// launch in ~256, and beside another context its event pairs may read either way).
    pub busy_scale: f64,
    /// The hook's idle thread ends a hold whose quota ran out while the process was not in a
    /// launch (busy on the CPU between launches, as a launch-bound framework mostly is), with
    /// a Release, this long after the deadline (its tick); the next launch then asks again with
    /// a TokenRequest. `None`: holds end at a launch past the deadline only.
    pub release_at_deadline: Option<Micros>,
    /// From a grant's arrival at the client to its first launch on the GPU: the process,
    /// blocked reading the grant, wakes up and its launch reaches the GPU (a renewal is not
    /// delayed: the process was running). 0: at once.
    pub wake: Micros,
    /// The hook's queue-ahead bound at a hold's end, for clients launching kernel by kernel
    /// (`Pattern::launch_us` > 0): before a launch the CPU waits while more than this much of
    /// its GPU work is queued (its early allowance is not modelled). 0: no bound.
    pub max_ahead: Micros,
    /// Clients that do not renew (`Sim::renew` off) tell gem-schd with a Drain notice that they
    /// stop launching and drain, as the hook does with `KUBESHARE_HOOK_RENEW=0` (a Renew
    /// answered Yield is that notice otherwise).
    pub drain_notice: bool,
    /// The GPU's cost of switching from one client's context to another's: a kernel of a
    /// client other than the last one to run starts this much later (on an H200 the gap
    /// between two tenants' kernels was 0.2–0.27 ms at the median whatever was queued). 0: none.
    pub switch: Micros,
    /// The client whose kernel ran last.
    pub on_gpu: Option<usize>,
}

pub fn spec(id: &str, req: u16, lim: u16) -> ClientSpec {
    ClientSpec {
        id: id.into(),
        request_milli: req,
        limit_milli: lim,
        mem_limit: 1 << 30,
        class: ClientClass::Guaranteed,
    }
}

/// An opportunistic client (`sharedgpu/priority` 0): it gets what guaranteed clients leave.
pub fn opportunistic(id: &str, req: u16, lim: u16) -> ClientSpec {
    ClientSpec {
        class: ClientClass::Opportunistic,
        ..spec(id, req, lim)
    }
}

impl Sim {
    pub fn new(params: Params, clients: Vec<(ClientSpec, Pattern)>) -> Sim {
        let specs: Vec<ClientSpec> = clients.iter().map(|c| c.0.clone()).collect();
        let mut core = Core::new(params, &specs, 0);
        let clients: Vec<Client> = clients
            .into_iter()
            .enumerate()
            .map(|(i, (spec, pattern))| {
                core.hello(i as u64, &spec.id).unwrap();
                // As a hook with a gate page: its Grants say whether a hand-over is due.
                core.set_told_handover_due(i as u64);
                Client {
                    spec,
                    pattern,
                    holding: false,
                    grant_at: 0,
                    deadline: 0,
                    quota: 0,
                    want_at: 0,
                    latencies: vec![],
                    hook_burst: 0,
                    waiting: false,
                    overuse: 0,
                    launched_at: 0,
                    next_kernel: 0,
                    last_end: 0,
                    epoch: 0,
                    renewed: 0,
                    samples: VecDeque::new(),
                    segments: vec![],
                    errors: 0,
                    reported_at: 0,
                    held_from: None,
                }
            })
            .collect();
        let mut sim = Sim {
            core,
            clients,
            queue: BinaryHeap::new(),
            seq: 0,
            gpu_busy: 0,
            tick: 0,
            precise: false,
            latency: 20,
            release_idle: MS,
            last_wake: None,
            reconfigs: vec![],
            renew: false,
            busy_reports: false,
            busy_scale: 1.0,
            release_at_deadline: None,
            wake: 0,
            max_ahead: 0,
            drain_notice: false,
            switch: 0,
            on_gpu: None,
        };
        for i in 0..sim.clients.len() {
            sim.push(0, Ev::Ready(i));
        }
        sim
    }

    pub fn push(&mut self, t: Micros, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, ev)));
    }

    pub fn apply(&mut self, now: Micros, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Grant {
                    conns, quota_us, ..
                } => {
                    for c in conns {
                        self.push(now + self.latency, Ev::Grant(c as usize, quota_us));
                    }
                }
                Action::Error { conn, .. } => self.clients[conn as usize].errors += 1,
                Action::Yield { conn } => self.push(now + self.latency, Ev::Yield(conn as usize)),
                // The simulated process wakes at a Grant whatever it was told before.
                Action::Soon { .. } => {}
            }
        }
        // Keep one timer: the earliest wake-up asked for (a later one is re-asked
        // when that fires).
        if let Some(w) = self.core.next_wakeup(now)
            && self.last_wake.is_none_or(|l| w < l)
        {
            self.last_wake = Some(w);
            self.push(w.max(now), Ev::Wake);
        }
    }

    pub fn run(&mut self, horizon: Micros) {
        while let Some(Reverse((t, seq, ev))) = self.queue.pop() {
            if t > horizon {
                // Kept for a later `run` (a test may run the clock in steps).
                self.queue.push(Reverse((t, seq, ev)));
                break;
            }
            self.step(t, ev);
        }
    }

    /// The time the client's deadline check reads at `t`.
    fn seen(&self, t: Micros) -> Micros {
        if self.tick > 0 && !self.precise {
            t - t % self.tick
        } else {
            t
        }
    }

    /// Whether clients measure and report overuse the hook's way (`used − quota`, noticed
    /// at a launch), rather than at the end of the burst that overran.
    fn hooklike(&self) -> bool {
        self.tick > 0 || self.precise
    }

    /// One kernel through the gate at `t` (`Pattern::launch_us` > 0): launched while the
    /// token is valid; past the deadline the hook drains the queue (the CPU blocks until the
    /// client's last kernel ends), then asks again reporting `used − quota`.
    fn launch_one(&mut self, t: Micros, i: usize) {
        let seen = self.seen(t);
        let c = &mut self.clients[i];
        if c.holding && seen < c.deadline {
            if self.max_ahead > 0 && c.last_end > t + self.max_ahead {
                // The queue-ahead bound: the CPU waits until the GPU has caught up.
                let at = c.last_end - self.max_ahead;
                self.push(at, Ev::Launch(i));
                return;
            }
            c.epoch += 1;
            c.launched_at = t;
            let start = self.gpu_busy.max(t) + self.switch_to(i);
            let c = &mut self.clients[i];
            let end = start + c.pattern.kernel_us;
            self.gpu_busy = end;
            match c.segments.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => c.segments.push((start, end)),
            }
            c.last_end = end;
            c.next_kernel += 1;
            if c.next_kernel >= c.pattern.kernels {
                self.push(end, Ev::SyncDone(i));
            } else {
                let next = t + c.pattern.launch_us;
                self.push(next, Ev::Launch(i));
            }
            return;
        }
        if c.holding && self.renew {
            // Renew first, the queue left as it is; the launch waits for the answer.
            let burst = (t - c.grant_at).min(c.quota);
            c.waiting = true;
            c.epoch += 1;
            self.send(t, i, Msg::Renew { burst });
            return;
        }
        self.hand_over(t, i);
    }

    /// The hold ended at `t` with no renewal: the CPU waits for the client's last kernel, then
    /// asks again reporting `used − quota` (or, not holding, what an expiry left to report).
    fn hand_over(&mut self, t: Micros, i: usize) {
        if self.clients[i].holding && self.drain_notice && !self.renew {
            self.send(t, i, Msg::Drain);
        }
        let c = &mut self.clients[i];
        let (at, overuse, burst) = if c.holding {
            let drained = t.max(c.last_end);
            let used = drained - c.grant_at;
            (drained, used.saturating_sub(c.quota), used.min(c.quota))
        } else {
            (t, std::mem::take(&mut c.overuse), c.hook_burst)
        };
        c.holding = false;
        c.waiting = true;
        c.epoch += 1;
        self.send(at, i, Msg::Request { overuse, burst });
    }

    pub fn send(&mut self, t: Micros, i: usize, m: Msg) {
        if self.busy_reports && !matches!(m, Msg::Busy { .. } | Msg::Drain) {
            let c = &mut self.clients[i];
            let from = c.reported_at;
            let busy: Micros = c
                .segments
                .iter()
                .rev()
                .take_while(|(_, e)| *e > from)
                .map(|&(s, e)| e.min(t).saturating_sub(s.max(from)))
                .sum();
            let held = c
                .held_from
                .take()
                .map_or(0, |h| t.saturating_sub(h.max(from)));
            if matches!(m, Msg::Renew { .. }) {
                c.held_from = Some(t); // the hold goes on (or ends with the next report)
            }
            c.reported_at = t;
            let busy = (busy as f64 * self.busy_scale) as Micros;
            self.push(t + self.latency, Ev::ToSched(i, Msg::Busy { busy, held }));
        }
        self.push(t + self.latency, Ev::ToSched(i, m));
    }

    /// The context switch client `i`'s next kernel waits for ([`Sim::switch`]), and it is
    /// now the one on the GPU.
    fn switch_to(&mut self, i: usize) -> Micros {
        let other = self.on_gpu.is_some_and(|o| o != i);
        self.on_gpu = Some(i);
        if other { self.switch } else { 0 }
    }

    pub fn launch(&mut self, t: Micros, i: usize) {
        let c = &mut self.clients[i];
        c.epoch += 1;
        c.launched_at = t;
        let start = self.gpu_busy.max(t) + self.switch_to(i);
        let c = &mut self.clients[i];
        let end = start + c.pattern.kernel_us * Micros::from(c.pattern.kernels);
        self.gpu_busy = end;
        c.segments.push((start, end));
        c.last_end = end;
        self.push(end, Ev::SyncDone(i));
    }

    pub fn step(&mut self, t: Micros, ev: Ev) {
        match ev {
            Ev::Ready(i) => {
                let c = &mut self.clients[i];
                if let Some(until) = c.idle_until(t) {
                    if until != Micros::MAX {
                        self.push(until, Ev::Ready(i));
                    }
                    return;
                }
                c.want_at = t;
                if c.pattern.launch_us > 0 {
                    c.next_kernel = 0;
                    self.launch_one(t, i);
                    return;
                }
                let now = self.seen(t);
                let hooklike = self.hooklike();
                let c = &mut self.clients[i];
                if c.holding && now >= c.deadline {
                    c.holding = false; // the quota ran out during the CPU gap
                    if hooklike {
                        // Noticed at this launch: held past the quota until now (the last
                        // burst has been synchronised already).
                        c.overuse = (t - c.grant_at).saturating_sub(c.quota);
                        c.hook_burst = (t - c.grant_at).min(c.quota);
                    }
                }
                let fits = if c.pattern.blind {
                    now < c.deadline
                } else {
                    t - c.grant_at + c.predicted() < c.deadline.saturating_sub(c.grant_at)
                };
                if c.holding && fits {
                    self.launch(t, i);
                } else {
                    // No token, or the next burst does not fit what is left of it.
                    let m = Msg::Request {
                        overuse: c.overuse,
                        burst: if hooklike {
                            c.hook_burst
                        } else {
                            c.predicted()
                        },
                    };
                    c.overuse = 0;
                    c.holding = false;
                    c.waiting = true;
                    c.epoch += 1;
                    self.send(t, i, m);
                }
            }
            Ev::Launch(i) => self.launch_one(t, i),
            Ev::SyncDone(i) => {
                let hooklike = self.hooklike();
                let c = &mut self.clients[i];
                let burst = t - c.launched_at;
                while c.samples.back().is_some_and(|s| s.1 <= burst) {
                    c.samples.pop_back();
                }
                c.samples.push_back((t, burst));
                while c.samples.front().is_some_and(|s| s.0 + 3 * S < t) {
                    c.samples.pop_front();
                }
                c.latencies.push(t - c.want_at);
                if !hooklike && c.holding && t > c.deadline {
                    // The hook synchronised at the deadline and measured this overrun.
                    c.overuse = t - c.deadline;
                    c.holding = false;
                }
                let gap = c.pattern.gap_us;
                let epoch = c.epoch;
                self.push(t + gap, Ev::Ready(i));
                self.push(t + self.release_idle, Ev::IdleCheck(i, epoch));
            }
            Ev::IdleCheck(i, epoch) => {
                let c = &mut self.clients[i];
                if c.epoch != epoch || c.waiting {
                    return;
                }
                if c.holding {
                    c.holding = false;
                    let used = t - c.grant_at;
                    c.hook_burst = used;
                    self.send(t, i, Msg::Release { used });
                } else if c.overuse > 0 {
                    let used = c.quota + c.overuse;
                    c.overuse = 0;
                    self.send(t, i, Msg::Release { used });
                }
            }
            Ev::DeadlineCheck(i, granted) => {
                let c = &mut self.clients[i];
                if c.holding && c.grant_at == granted && !c.waiting && c.last_end > t {
                    // Its queued work still runs: the hook drains it before releasing (and
                    // the process, launching meanwhile, may end the hold itself).
                    let at = c.last_end;
                    self.push(at, Ev::DeadlineCheck(i, granted));
                } else if c.holding && c.grant_at == granted && !c.waiting {
                    c.holding = false;
                    c.epoch += 1;
                    let used = t - c.grant_at;
                    // It held to the deadline: the hook reports its quota as its burst.
                    c.hook_burst = c.quota;
                    self.send(t, i, Msg::Release { used });
                }
            }
            Ev::ToSched(i, m) => {
                let acts = match m {
                    Msg::Request { overuse, burst } => {
                        self.core.token_request(t, i as u64, overuse, burst)
                    }
                    Msg::Release { used } => self.core.release(t, i as u64, used),
                    Msg::Renew { burst } => self.core.renew(t, i as u64, burst),
                    Msg::Drain => self.core.drain(t, i as u64),
                    Msg::Busy { busy, held } => {
                        let _ = self.core.busy(t, i as u64, busy, held, 0, None);
                        vec![]
                    }
                };
                self.apply(t, acts);
            }
            Ev::Grant(i, quota) => {
                if self.wake > 0 && !self.clients[i].holding {
                    self.push(t + self.wake, Ev::Woken(i, quota));
                } else {
                    self.granted(t, i, quota);
                }
            }
            Ev::Woken(i, quota) => self.granted(t, i, quota),
            Ev::Yield(i) => {
                self.clients[i].waiting = false;
                self.hand_over(t, i);
            }
            Ev::Wake => {
                if self.last_wake.is_some_and(|l| l <= t) {
                    self.last_wake = None;
                }
                let acts = self.core.tick(t);
                self.apply(t, acts);
            }
            Ev::Reconfig(k) => {
                let specs = self.reconfigs[k].clone();
                let acts = self.core.set_config(t, &specs);
                self.apply(t, acts);
            }
        }
    }

    /// The grant of `quota` reaches client `i`'s launching thread at `t` (a renewal, or a new
    /// hold once the process is awake).
    fn granted(&mut self, t: Micros, i: usize, quota: Micros) {
        let c = &mut self.clients[i];
        if c.holding {
            c.renewed += 1;
        }
        c.waiting = false;
        c.holding = true;
        c.grant_at = t;
        c.quota = quota;
        c.held_from = Some(t);
        let per_kernel = c.pattern.launch_us > 0;
        let seen = self.seen(t);
        let c = &mut self.clients[i];
        c.deadline = seen + quota;
        if let Some(after) = self.release_at_deadline {
            let at = (seen + quota + after).max(t);
            self.push(at, Ev::DeadlineCheck(i, t));
        }
        // The launch that asked for the token goes now.
        if per_kernel {
            self.launch_one(t, i);
        } else {
            self.launch(t, i);
        }
    }

    /// Share of the GPU used by client `i` during [a, b).
    pub fn share(&self, i: usize, a: Micros, b: Micros) -> f64 {
        let used: Micros = self.clients[i]
            .segments
            .iter()
            .map(|&(s, e)| e.min(b).saturating_sub(s.max(a)))
            .sum();
        used as f64 / (b - a) as f64
    }

    /// gem-schd's charge of client `id` over its window ending at `at`, as a share of it.
    pub fn charged(&self, at: Micros, id: &str) -> f64 {
        self.core.usage_us(at, id).unwrap() as f64 / self.core.params().window_us as f64
    }

    /// The largest usage of client `i` over any window of `w` ending on a 100 ms tick.
    pub fn max_window_share(&self, i: usize, w: Micros, horizon: Micros) -> f64 {
        // GPU time per 100 ms bucket, then a running sum over `w`.
        let b = 100 * MS;
        let mut buckets = vec![0u64; (horizon / b) as usize + 1];
        for &(s, e) in &self.clients[i].segments {
            let (mut s, e) = (s, e.min(horizon));
            while s < e {
                let k = s / b;
                let end = ((k + 1) * b).min(e);
                buckets[k as usize] += end - s;
                s = end;
            }
        }
        let n = (w / b) as usize;
        buckets
            .windows(n)
            .map(|win| win.iter().sum::<u64>() as f64 / w as f64)
            .fold(0.0, f64::max)
    }
}

/// A launch-bound training step: its CPU launches slower than the GPU runs the kernels (the
/// GPU is busy ~0.4 of the time alone), one synchronisation per step.
pub fn training_launch_bound() -> Pattern {
    Pattern {
        kernel_us: 40,
        kernels: 200,
        gap_us: 1_000,
        idle: vec![],
        blind: true,
        launch_us: 60,
    }
}

pub fn run(clients: Vec<(ClientSpec, Pattern)>) -> Sim {
    run_with(Params::default(), clients)
}

pub fn run_with(params: Params, clients: Vec<(ClientSpec, Pattern)>) -> Sim {
    let mut sim = Sim::new(params, clients);
    sim.run(60 * S);
    sim
}

#[track_caller]
pub fn assert_share(sim: &Sim, i: usize, expected: f64) {
    let got = sim.share(i, 0, 60 * S);
    eprintln!(
        "share {}: got {got:.4} expected {expected:.4}",
        sim.clients[i].spec.id
    );
    assert!(
        (got - expected).abs() <= 0.02,
        "client {} got {got:.4}, expected {expected:.2} ± 0.02",
        sim.clients[i].spec.id
    );
}

/// Expected GPU-busy share of client `i` held at `share` of the token's time.
pub fn held(sim: &Sim, i: usize, share: f64) -> f64 {
    share * sim.clients[i].pattern.duty()
}

#[track_caller]
pub fn assert_within_limits(sim: &Sim) {
    for (i, c) in sim.clients.iter().enumerate() {
        let lim = f64::from(c.spec.limit_milli) / 1000.0;
        let over_60 = sim.share(i, 0, 60 * S);
        assert!(
            over_60 <= lim + 0.005,
            "{} used {over_60:.4} > limit {lim}",
            c.spec.id
        );
        // Over any 10 s window: at most the limit plus one burst's overrun.
        let worst = sim.max_window_share(i, 10 * S, 60 * S);
        assert!(
            worst <= lim + 0.01,
            "{} used {worst:.4} of a window, limit {lim}",
            c.spec.id
        );
    }
}

pub fn total(sim: &Sim) -> f64 {
    (0..sim.clients.len())
        .map(|i| sim.share(i, 0, 60 * S))
        .sum()
}

/// GPU time of client `i` per millisecond, as prefix sums over [0, horizon).
pub fn busy_prefix(sim: &Sim, i: usize, horizon: Micros) -> Vec<u64> {
    let mut ms = vec![0u64; (horizon / MS) as usize];
    for &(s, e) in &sim.clients[i].segments {
        let (mut s, e) = (s, e.min(horizon));
        while s < e {
            let k = s / MS;
            let end = ((k + 1) * MS).min(e);
            ms[k as usize] += end - s;
            s = end;
        }
    }
    let mut prefix = vec![0u64; ms.len() + 1];
    for (k, b) in ms.iter().enumerate() {
        prefix[k + 1] = prefix[k] + b;
    }
    prefix
}

/// (lowest, highest) share of client `i` over every `len`-long slice of [a, b) that
/// starts on a 10 ms grid.
pub fn slice_shares(sim: &Sim, i: usize, len: Micros, a: Micros, b: Micros) -> (f64, f64) {
    let prefix = busy_prefix(sim, i, b);
    let (len_ms, mut lo, mut hi) = ((len / MS) as usize, f64::MAX, f64::MIN);
    let mut k = (a / MS) as usize;
    while k + len_ms <= (b / MS) as usize {
        let x = (prefix[k + len_ms] - prefix[k]) as f64 / len as f64;
        (lo, hi) = (lo.min(x), hi.max(x));
        k += 10;
    }
    (lo, hi)
}

/// The longest time in [a, b) between two GPU segments of client `i` (a client that
/// always has work, alone on the GPU, is waiting for the token all that time).
pub fn longest_gap(sim: &Sim, i: usize, a: Micros, b: Micros) -> Micros {
    let segs = &sim.clients[i].segments;
    segs.windows(2)
        .filter(|w| w[0].1 >= a && w[1].0 <= b)
        .map(|w| w[1].0.saturating_sub(w[0].1))
        .max()
        .unwrap_or(b - a)
}

/// The `q` quantile of `v` (0 when empty).
pub fn pct(v: &[Micros], q: f64) -> Micros {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.get(((q * v.len() as f64) as usize).min(v.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0)
}

/// Lengths of client `i`'s turns on the GPU after `a`: its runs of GPU time between two
/// segments of other clients (the wait of a request that arrives as the turn begins).
pub fn turns(sim: &Sim, i: usize, a: Micros) -> Vec<Micros> {
    let mut all: Vec<(Micros, Micros, usize)> = vec![];
    for (k, c) in sim.clients.iter().enumerate() {
        all.extend(
            c.segments
                .iter()
                .filter(|s| s.0 >= a)
                .map(|s| (s.0, s.1, k)),
        );
    }
    all.sort_unstable();
    let mut out = vec![];
    let mut run: Option<(Micros, Micros)> = None;
    for (s, e, k) in all {
        if k == i {
            run = Some(run.map_or((s, e), |r| (r.0, e)));
        } else if let Some(r) = run.take() {
            out.push(r.1 - r.0);
        }
    }
    out
}
