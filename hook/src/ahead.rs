//! A bound on how far ahead of the GPU a holder's CPU queues work (`KUBESHARE_HOOK_MAX_AHEAD_US`,
//! default 200 µs, 0 = off).
//!
//! The gate acts at launch time, so everything queued before the deadline runs after it: the hook
//! drains it at the hand-over, and the next holder waits for it. A framework's CPU can queue far
//! more GPU work per ms than the GPU runs: on an H100, ResNet-50 training's drain past a ~3.4 ms
//! grant was 0.75 ms at the median but 4.8 ms at p90 and up to 14.7 ms, and a batch-1 inference
//! request beside it waited that whole turn. Here, in the precise stretch of a hold (the whole hold
//! while the bound is on; docs/hook.md, "The launch gate"), the hook records an event on the
//! launching stream every [`probe_every`] of launching (100 µs, or half a shorter bound), and keeps
//! at most `bound / probe_every` pending: before recording another it waits for the oldest. So the
//! GPU never runs further behind than the work the CPU queued in the bound's worth of its own
//! launching time (the time it spent waiting does not count), whatever the phase of the program. A
//! bound on the CPU's clock, not the GPU's: the GPU time queued is the bound times how much faster
//! the CPU queues work than the GPU runs it (a first attempt bounded the probes' age in wall-clock
//! time, which let the queue settle at 3.5 ms for a 1 ms bound in the test below). The GPU keeps
//! the pending probes' work queued while the CPU waits, so it does not idle for it.
//!
//! That ratio can be large: ResNet-50 training queues milliseconds of GPU work per 100 µs of
//! launching, and its drain past a hold stayed at p90 3.4 ms with a 200 µs bound on the
//! launches alone.
//! So the ring also measures it: the probe events are timed, and where a probe was recorded
//! while the one before it was still pending (its interval's work all queued ahead of the GPU),
//! the GPU's clock between the two is the GPU time of the launching between them. It is read
//! whichever way the probe is found passed (a query, a wait, a drain of the whole queue): from
//! the waits alone (the CPU's clock at each wake-up), a training step's last phase, drained
//! by the step's own synchronisation, was never measured. With that ratio the probe interval
//! shrinks (down to [`MIN_PROBE_EVERY_NS`]) until about half the bound of GPU work lies between
//! two probes, and the probes kept pending hold about the bound's worth of GPU time.
//!
//! The ratio is a moving average, and a step's phases differ in pace: on an H200 a
//! `TransformerEncoder` training step's average read 1.2–2 while its heaviest 0.5 ms windows of
//! launching ran 15–20, so a queue estimated at 0.4 ms drained in up to 8 ms. With
//! `KUBESHARE_HOOK_PACE_HOLD_MS` the ring also keeps the largest ratio over 0.5 ms of launching
//! (`pace.rs`), fading by half every that long, and counts the queue at the larger of the two: the
//! drain stays near the estimate (≤ 5.2 ms for a 5 ms queue there), but the lighter phases' queue
//! is that much shallower (docs/hook.md).
//!
//! The bound is what may drain past the deadline: what is queued before the deadline runs before
//! it. So with the pace measured, the queue may also hold the time left in the hold, up to
//! `KUBESHARE_HOOK_EARLY_AHEAD_US` ([`Limits`]): a bound for the whole hold kept each process
//! of a two-process client about one kernel deep on an H100, and the GPU switched between their
//! contexts at every kernel.
//!
//! Both keep the queue shallow for a hand-over that may never come: a process that keeps the
//! GPU renews its holds (gem-schd renews a holder while no waiting client would go next, and
//! says with each Grant whether one is expected to go at its end: such a renewal does not
//! count), and its queue, narrowed to the
//! bound at every renewed deadline and ~0.8 ms deep at most, ran dry at each pause of its CPU:
//! ResNet-50 training alone at 0.965 of its native rate on an H100, 0.994 with the bound off.
//! So once a hold has been renewed twice in a row the queue may hold
//! `KUBESHARE_HOOK_SOLE_AHEAD_US` (default 5 ms of GPU time, once the pace is measured, as the
//! early allowance) whatever the time left ([`Limits::sole_ns`]).
//! The price is paid once, by the next client to ask: it waits for that queue after the hold's
//! quota (charged to the holder as its overrun), where it waited for the bound's.
//!
//! At a hold's end the queue may also hold `KUBESHARE_HOOK_HANDOVER_AHEAD_US` (off by default;
//! GPU time, once the pace is measured) when that is more than the bound
//! ([`Limits::handover_ns`]): gem-schd hands the token on when the holder stops launching, and
//! the next process wakes up and launches while this queue drains, instead of the GPU idling
//! for its wake-up once a bound's worth has run. The next holder's first kernel waits for the
//! longer of the two; but where it wakes sooner, the GPU may run its kernels beside the drain,
//! which is then charged to this process.

use crate::pace::Pace;

/// How often (at launches, precise time) a probe event is recorded, for bounds of 200 µs and
/// more; shorter bounds probe twice per bound ([`probe_every`]).
pub const PROBE_EVERY_NS: u64 = 100_000;
/// The shortest probe interval: an event record costs ~1 µs.
pub const MIN_PROBE_EVERY_NS: u64 = 10_000;

/// The probe interval for a bound: [`PROBE_EVERY_NS`], or half the bound when that is shorter,
/// so that at least two probes are pending and a short bound is not rounded up to 100 µs.
pub fn probe_every(bound_ns: u64) -> u64 {
    PROBE_EVERY_NS.min(bound_ns / 2).max(MIN_PROBE_EVERY_NS)
}
/// The probes for which a ring whose pace is unmeasured reads the clock at every launch
/// ([`Ring::unpaced_start`]).
pub const UNPACED_PROBES: u64 = 64;
/// Probe events in flight at most (when all are pending the CPU waits for the oldest): enough
/// for the default early allowance ([`Limits::early_ns`]) at any measured pace.
pub const RING: usize = 64;

/// How much GPU work a probe lets stay queued: `bound_ns`, plus the time left in the hold
/// (`until_deadline_ns`) up to `early_ns` (what is queued before the deadline runs before it),
/// or plus `sole_ns` when that is more (the process keeps the GPU: 0 otherwise); and at
/// least `handover_ns` (the next holder's wake-up runs under it).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub bound_ns: u64,
    pub until_deadline_ns: u64,
    pub early_ns: u64,
    pub sole_ns: u64,
    pub handover_ns: u64,
}

impl Limits {
    /// The bound alone, whatever is left of the hold.
    pub const fn bound(bound_ns: u64) -> Self {
        Limits {
            bound_ns,
            until_deadline_ns: 0,
            early_ns: 0,
            sole_ns: 0,
            handover_ns: 0,
        }
    }
}

/// What the driver said about an event (a query), or how a wait for one ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Done {
    Yes,
    /// Not done; for a wait: given up (the hold ended meanwhile, `park.rs`).
    NotYet,
    /// An error (the context went away, ...): forget every probe.
    Broken,
}

/// The probes of one device: slots of events (created in `ctx`), and the pending ones in
/// recording order. Pure bookkeeping: the driver is reached through the closures of
/// [`Ring::probe`], so that the logic is tested without a GPU.
#[derive(Debug)]
pub struct Ring {
    pub ctx: usize,
    /// Event handles by slot (0: not created yet).
    pub events: [usize; RING],
    /// Under parking (`park.rs`): each slot's second event, recorded behind a stream-ordered
    /// wait on the gate word that follows the probe (0: not created yet), and whether this
    /// slot's probe was followed by such a wait.
    pub after: [usize; RING],
    pub gated: [bool; RING],
    /// Each slot's interval of launching: its start (the previous probe's recording) and how
    /// long the CPU spent launching in it (its waits excluded).
    start_at: [u64; RING],
    launching: [u64; RING],
    head: usize,
    len: usize,
    /// When the last probe was recorded (the start of the next slot's interval).
    last_recorded: u64,
    /// When the GPU passed the last probe the CPU waited for (None: not known, e.g. the
    /// probe was found done by a query, at some time before).
    passed_at: Option<u64>,
    /// The GPU time per ns of launching, as measured (`pace.rs`).
    pub pace: Pace,
    /// Whether each slot's probe was recorded behind another still pending: its interval's
    /// work was all queued before the GPU reached it, so the GPU time between the previous
    /// probe and it is that work's alone, with no wait for the CPU in it.
    behind: [bool; RING],
    /// The slot last dropped as passed (its event done): under parking the wait behind it
    /// may not have been read yet (`park.rs`).
    last_passed: Option<usize>,
    /// Probes recorded so far, and each slot's number among them (from 1): a wait for the
    /// queue forgets only the probes recorded before it began ([`Ring::passed_up_to`]).
    recorded: u64,
    seq: [u64; RING],
}

/// The pace's fixed-point scale.
const RATIO_ONE: u64 = crate::pace::ONE;

/// The driver's side of the probes: what the ring asks of the event in a slot. Implemented over
/// the CUDA driver in `device.rs`, over a simulated GPU in the tests.
pub trait Events {
    /// Whether the GPU has passed the slot's event.
    fn query(&mut self, slot: usize) -> Done;
    /// Waits until the GPU has passed the slot's event (`Done::NotYet`: given up).
    fn sync(&mut self, slot: usize) -> Done;
    /// Records the slot's event on the launching stream; false: not recorded.
    fn record(&mut self, slot: usize) -> bool;
    /// The GPU time between two passed events, if the driver can tell.
    fn elapsed_ns(&mut self, from: usize, to: usize) -> Option<u64>;
    /// The precise clock, read again after a wait.
    fn now(&mut self) -> u64;
}

impl Ring {
    pub const fn new() -> Self {
        Ring {
            ctx: 0,
            events: [0; RING],
            after: [0; RING],
            gated: [false; RING],
            start_at: [0; RING],
            launching: [0; RING],
            head: 0,
            len: 0,
            last_recorded: 0,
            passed_at: None,
            pace: Pace::new(),
            behind: [false; RING],
            last_passed: None,
            recorded: 0,
            seq: [0; RING],
        }
    }

    /// The probe interval for `bound_ns`: [`probe_every`], shortened once the GPU has been
    /// measured to run more than half the bound of work per interval, down to
    /// [`MIN_PROBE_EVERY_NS`].
    pub fn every_ns(&self, bound_ns: u64) -> u64 {
        let base = probe_every(bound_ns);
        if self.pace.x1024() <= RATIO_ONE {
            return base;
        }
        let want = (u128::from(bound_ns / 2) * u128::from(RATIO_ONE)
            / u128::from(self.pace.x1024())) as u64;
        want.clamp(MIN_PROBE_EVERY_NS.min(base), base)
    }

    /// Whether the GPU was measured running behind the CPU (more than twice the launching
    /// time in GPU work): the CPU then has time to spare for reading the clock at every launch.
    pub fn gpu_behind(&self) -> bool {
        self.pace.x1024() > 2 * RATIO_ONE
    }

    /// Whether the GPU's pace is still unmeasured in the ring's first [`UNPACED_PROBES`]
    /// probes: every launch should read the clock then too, since nothing yet says the GPU
    /// keeps up. At one read in eight, a tenant of 20 ms kernels launched at 60 µs each
    /// recorded its second probe eight launches after its first, and its first hold queued
    /// 14–18 kernels (drains of 290–366 ms through the fake driver, 171–183 ms with this; on
    /// an H200 such a tenant's longest drain, 373–404 ms, came in its first 2 s). A GPU that
    /// keeps up is never measured (its probes are found passed), so this ends with those
    /// probes: a few ms of launching.
    pub fn unpaced_start(&self) -> bool {
        self.pace.x1024() == 0 && self.recorded < UNPACED_PROBES
    }

    /// The GPU time of `launching` ns of launching, by the measured ratio once there is one
    /// (before: the launching time itself).
    fn gpu_ns(&self, launching: u64) -> u64 {
        if self.pace.x1024() > RATIO_ONE {
            (u128::from(launching) * u128::from(self.pace.x1024()) / u128::from(RATIO_ONE))
                .min(u128::from(u64::MAX)) as u64
        } else {
            launching
        }
    }

    /// The launching time whose GPU work is `gpu_ns` by the measured ratio (before it is
    /// measured, or while the GPU keeps up with the CPU: `gpu_ns` itself).
    pub fn launching_for(&self, gpu_ns: u64) -> u64 {
        if self.pace.x1024() > RATIO_ONE {
            (u128::from(gpu_ns) * u128::from(RATIO_ONE) / u128::from(self.pace.x1024())) as u64
        } else {
            gpu_ns
        }
    }

    /// The GPU work still queued behind the pending probes, by the measured ratio.
    pub fn pending_gpu_ns(&self) -> u64 {
        (0..self.len)
            .map(|i| self.gpu_ns(self.launching[(self.head + i) % RING]))
            .fold(0, u64::saturating_add)
    }

    /// The CPU waited for the probe in `slot` until `t`: the GPU ran that probe's interval of
    /// launching from when it passed the previous probe (or from the interval's start, if the
    /// work came later) to `t`; read on the GPU's clock instead where the events say
    /// ([`Ring::pass_head`] learned it then).
    fn learn(&mut self, slot: usize, t: u64, timed: bool) {
        if let (Some(prev), false) = (self.passed_at, timed) {
            let gpu = t.saturating_sub(prev.max(self.start_at[slot]));
            self.pace.sample(gpu, self.launching[slot], t);
        }
        self.passed_at = Some(t);
    }

    /// The GPU has passed the oldest pending probe: forget it, and learn the pace from the GPU
    /// time since the probe before it (`Events::elapsed_ns`) where its interval was all queued
    /// ahead of the GPU. True when that was learned. So the pace is measured whichever way the
    /// probe is found passed: by a query, a wait, or a drain of the whole queue, where a
    /// training step's heavy last phase, drained by its own synchronisation, was never
    /// measured by the waits alone.
    fn pass_head(&mut self, t: u64, elapsed: &mut impl FnMut(usize, usize) -> Option<u64>) -> bool {
        let slot = self.head;
        let prev = self
            .last_passed
            .filter(|p| self.behind[slot] && self.seq[*p] + 1 == self.seq[slot]);
        let gpu = prev.and_then(|p| elapsed(p, slot));
        if let Some(gpu) = gpu {
            self.pace.sample(gpu, self.launching[slot], t);
        }
        self.pop();
        gpu.is_some()
    }

    pub fn pending(&self) -> usize {
        self.len
    }

    /// The pending probes' slots, oldest first.
    pub fn pending_slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len).map(|i| (self.head + i) % RING)
    }

    /// The slots whose waits the GPU may still have ahead of it (`park.rs`): the one last
    /// dropped as passed (its event is done, but not necessarily the wait behind it; any
    /// earlier one's wait is passed, since the GPU has reached a later probe) unless it was
    /// recorded again, then the pending ones, oldest first.
    pub fn unpassed_slots(&self) -> impl Iterator<Item = usize> + '_ {
        let last = self
            .last_passed
            .filter(|l| !self.pending_slots().any(|s| s == *l));
        last.into_iter().chain(self.pending_slots())
    }

    /// The GPU stopped at a pending probe's wait until the process's next hold (`park.rs`):
    /// the probes stay pending (their work is still queued, and the next hold passes them),
    /// but the GPU's passing of the next one must not be timed from before the stop.
    pub fn stopped(&mut self) {
        self.passed_at = None;
    }

    /// How many probes have been recorded so far: taken before a wait for the whole queue,
    /// then given to [`Ring::passed_up_to`].
    pub fn recorded(&self) -> u64 {
        self.recorded
    }

    /// The GPU has passed every probe up to the `recorded`th (a wait for the whole queue that began
    /// then has returned, at `t`): those are forgotten, later ones stay pending, and the pace is
    /// learned from them ([`Ring::pass_head`]). Forgetting them all let a probe recorded by another
    /// thread during the wait go unknown, and under parking its wait on the gate word with it: a
    /// hold's end then closed the word with the GPU bound to stop at a wait the ring did not know
    /// of (`park.rs`).
    pub fn passed_up_to(
        &mut self,
        recorded: u64,
        t: u64,
        mut elapsed: impl FnMut(usize, usize) -> Option<u64>,
    ) {
        while self.len > 0 && self.seq[self.head] <= recorded {
            self.pass_head(t, &mut elapsed);
        }
        self.passed_at = None;
    }

    /// Forgets every pending probe (the events stay, for reuse).
    pub fn clear(&mut self) {
        self.len = 0;
        self.passed_at = None;
        self.last_passed = None;
    }

    /// One probe at precise time `now`: drops the probes the GPU has passed, waits
    /// ([`Events::sync`]) for the oldest pending ones until the GPU work behind them and the
    /// interval this probe closes fit the `limits` (or none is left), learning the GPU's pace as
    /// probes are passed, then records a new one ([`Events::record`]). A wait given up
    /// (`Done::NotYet`: the hold ended meanwhile) ends the probe, none recorded. What is queued
    /// before the deadline runs before it, so only the bound drains past it: the queue may be a
    /// hold's worth deep early in the hold and narrows to the bound at its end (a bound for the
    /// whole hold kept a two-process client's queues one 0.2 ms kernel deep on an H100, and the GPU
    /// switched between its two contexts at every kernel: 0.31–0.35 of the GPU for 0.4 of the token
    /// time). Returns how long it waited.
    pub fn probe(&mut self, now: u64, limits: Limits, ev: &mut impl Events) -> u64 {
        while self.len > 0 {
            match ev.query(self.head) {
                Done::Yes => {
                    self.passed_at = None;
                    self.pass_head(now, &mut |a, b| ev.elapsed_ns(a, b));
                }
                Done::NotYet => break,
                Done::Broken => {
                    self.clear();
                    return 0;
                }
            }
        }
        // The time left in the hold counts once the GPU's pace is measured: before that a
        // launching-time estimate of the queue can be many times short of the GPU's.
        let Limits {
            bound_ns,
            until_deadline_ns,
            early_ns,
            sole_ns,
            handover_ns,
        } = limits;
        // Both allowances count once the pace is measured: by launching time the queue of a
        // CPU far ahead is many times deeper than it says (the sole allowance counted so let
        // a process whose GPU turned busy while it was alone queue 5 ms of launching, 20 times
        // that at ResNet-50 training's pace, before its first wait).
        let paced = self.pace.x1024() != 0;
        let slack = |t: u64| {
            if !paced {
                0
            } else {
                until_deadline_ns
                    .saturating_sub(t.saturating_sub(now))
                    .min(early_ns)
                    .max(sole_ns)
                    .max(handover_ns.saturating_sub(bound_ns))
            }
        };
        let closing = now
            .saturating_sub(self.last_recorded)
            .clamp(1, self.every_ns(bound_ns));
        let mut t = now;
        // Waiting does not shorten what drains past the deadline (the queue and the time left
        // shrink alike): once the hold's work is queued, this waits for the queue's end, which
        // the GPU reaches at most the bound past the deadline. Until the pace is measured, a
        // wait goes on to the next pending probe: the pace is learned from two passings in a
        // row, and a probe found passed by a query between them teaches nothing (a process
        // whose first wait drained the queue past its deadline could go unmeasured for good).
        while self.len > 0
            && (self.len >= RING
                || (self.pace.x1024() == 0 && self.passed_at.is_some())
                || self.pending_gpu_ns().saturating_add(self.gpu_ns(closing))
                    > bound_ns.saturating_add(slack(t)))
        {
            let slot = self.head;
            match ev.sync(slot) {
                Done::Yes => {}
                // The hold is over: its work stays queued behind the pending probes.
                Done::NotYet => return ev.now().max(t).saturating_sub(now),
                Done::Broken => {
                    self.clear();
                    return t.saturating_sub(now);
                }
            }
            t = ev.now().max(t);
            let timed = self.pass_head(t, &mut |a, b| ev.elapsed_ns(a, b));
            self.learn(slot, t, timed);
        }
        if self.len < RING {
            let slot = (self.head + self.len) % RING;
            if ev.record(slot) {
                self.behind[slot] = self.len > 0;
                // The launching this probe closes: since the last probe, the wait excluded,
                // at most an interval (a pause between launches is not launching).
                self.start_at[slot] = self.last_recorded;
                self.launching[slot] = closing;
                self.last_recorded = t;
                self.recorded += 1;
                self.seq[slot] = self.recorded;
                self.len += 1;
            }
        }
        t.saturating_sub(now)
    }

    fn pop(&mut self) {
        self.last_passed = Some(self.head);
        self.head = (self.head + 1) % RING;
        self.len -= 1;
    }
}

impl Default for Ring {
    fn default() -> Self {
        Ring::new()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_launching_for_some_gpu_work_follows_the_measured_ratio() {
        let mut r = super::Ring::new();
        assert_eq!(r.launching_for(200_000), 200_000, "not measured yet");
        r.pace.set(10 * super::RATIO_ONE);
        assert_eq!(r.launching_for(200_000), 20_000, "a CPU ten times ahead");
        assert_eq!(r.gpu_ns(r.launching_for(200_000)), 200_000);
        r.pace.set(super::RATIO_ONE / 2);
        assert_eq!(r.launching_for(200_000), 200_000, "a GPU that keeps up");
    }

    #[test]
    fn every_launch_reads_the_clock_until_the_pace_is_measured_or_the_first_probes_are_spent() {
        let mut r = super::Ring::new();
        assert!(r.unpaced_start(), "a new ring knows no pace");
        r.recorded = super::UNPACED_PROBES - 1;
        assert!(r.unpaced_start());
        r.pace.set(super::RATIO_ONE / 2);
        assert!(!r.unpaced_start(), "a GPU measured keeping up");
        assert!(!r.gpu_behind());
        let mut r = super::Ring::new();
        r.recorded = super::UNPACED_PROBES;
        assert!(
            !r.unpaced_start(),
            "a GPU never measured: its probes were found passed"
        );
    }

    use super::*;
    use std::cell::{Cell, RefCell};

    /// The driver's side from closures, with no timing (`elapsed_ns` is never known).
    struct Fns<Q, S, R, C>(Q, S, R, C);

    impl<Q, S, R, C> Events for Fns<Q, S, R, C>
    where
        Q: FnMut(usize) -> Done,
        S: FnMut(usize) -> Done,
        R: FnMut(usize) -> bool,
        C: FnMut() -> u64,
    {
        fn query(&mut self, slot: usize) -> Done {
            (self.0)(slot)
        }
        fn sync(&mut self, slot: usize) -> Done {
            (self.1)(slot)
        }
        fn record(&mut self, slot: usize) -> bool {
            (self.2)(slot)
        }
        fn elapsed_ns(&mut self, _: usize, _: usize) -> Option<u64> {
            None
        }
        fn now(&mut self) -> u64 {
            (self.3)()
        }
    }

    impl Ring {
        fn probe_with(
            &mut self,
            now: u64,
            limits: Limits,
            query: impl FnMut(usize) -> Done,
            sync: impl FnMut(usize) -> Done,
            record: impl FnMut(usize) -> bool,
            clock: impl FnMut() -> u64,
        ) -> u64 {
            self.probe(now, limits, &mut Fns(query, sync, record, clock))
        }
    }

    /// A simulated GPU that runs, in order, what a CPU queues at `ratio` ns of GPU work per ns
    /// of launching, and the ring's probes on it.
    struct Sim {
        clock: Cell<u64>,
        /// When the GPU has run everything queued so far.
        gpu_free: Cell<u64>,
        done_at: RefCell<[u64; RING]>,
        ratio: Cell<u64>,
    }

    impl Sim {
        fn new(ratio: u64) -> Self {
            Sim {
                clock: Cell::new(0),
                gpu_free: Cell::new(0),
                done_at: RefCell::new([u64::MAX; RING]),
                ratio: Cell::new(ratio),
            }
        }

        /// The CPU launches for `every` ns, then probes with `limits`; returns the wait.
        fn launch_and_probe(&self, r: &mut Ring, every: u64, limits: Limits) -> u64 {
            let (clock, gpu_free) = (&self.clock, &self.gpu_free);
            clock.set(clock.get() + every);
            gpu_free.set(gpu_free.get().max(clock.get() - every) + self.ratio.get() * every);
            r.probe(clock.get(), limits, &mut &*self)
        }

        /// The CPU waits for the whole queue (its own synchronisation) and the ring is told.
        fn drain(&self, r: &mut Ring) {
            self.clock.set(self.clock.get().max(self.gpu_free.get()));
            let mut ev = self;
            r.passed_up_to(r.recorded(), self.clock.get(), |a, b| ev.elapsed_ns(a, b));
        }

        /// The GPU work queued and not run yet.
        fn depth(&self) -> u64 {
            self.gpu_free.get().saturating_sub(self.clock.get())
        }
    }

    /// The simulated GPU's events, timed on its clock.
    impl Events for &Sim {
        fn query(&mut self, slot: usize) -> Done {
            if self.done_at.borrow()[slot] <= self.clock.get() {
                Done::Yes
            } else {
                Done::NotYet
            }
        }
        fn sync(&mut self, slot: usize) -> Done {
            self.clock
                .set(self.clock.get().max(self.done_at.borrow()[slot]));
            Done::Yes
        }
        fn record(&mut self, slot: usize) -> bool {
            // Done when the GPU has run what was queued before it.
            self.done_at.borrow_mut()[slot] = self.gpu_free.get().max(self.clock.get());
            true
        }
        fn elapsed_ns(&mut self, from: usize, to: usize) -> Option<u64> {
            let done = self.done_at.borrow();
            (done[to] <= self.clock.get()).then(|| done[to].saturating_sub(done[from]))
        }
        fn now(&mut self) -> u64 {
            self.clock.get()
        }
    }

    /// A CPU that queues `ratio` ns of GPU work per ns of launching, probing as the ring says,
    /// for `steps` intervals: (how long it waited, the deepest GPU queue, the deepest and the
    /// shallowest queue after the first 40 intervals, the last probe interval).
    fn simulate(bound: u64, ratio: u64, steps: u32) -> (u64, u64, u64, u64, u64) {
        let sim = Sim::new(ratio);
        let mut r = Ring::new();
        let (mut waited, mut deepest, mut settled, mut shallowest) = (0, 0, 0, u64::MAX);
        for step in 0..steps {
            let every = r.every_ns(bound);
            waited += sim.launch_and_probe(&mut r, every, Limits::bound(bound));
            let depth = sim.depth();
            deepest = deepest.max(depth);
            if step >= 40 {
                settled = settled.max(depth);
                shallowest = shallowest.min(depth);
            }
        }
        (waited, deepest, settled, shallowest, r.every_ns(bound))
    }

    /// Holds of `hold` ns, one after another (each drained before the next): the CPU queues
    /// `ratio` ns of GPU work per ns of launching until the deadline, the hand-over allowance
    /// `handover`. Returns, over the holds
    /// after the first (whose pace is not known yet), the longest drain past a deadline and the
    /// deepest queue in the first half of a hold.
    fn simulate_holds(
        bound: u64,
        early: u64,
        handover: u64,
        ratio: u64,
        hold: u64,
        holds: u32,
    ) -> (u64, u64) {
        let sim = Sim::new(ratio);
        let mut r = Ring::new();
        let (mut drain, mut deepest) = (0, 0);
        for h in 0..holds {
            let deadline = sim.clock.get() + hold;
            let half = sim.clock.get() + hold / 2;
            while sim.clock.get() < deadline {
                let every = r.every_ns(bound);
                let limits = Limits {
                    bound_ns: bound,
                    until_deadline_ns: deadline.saturating_sub(sim.clock.get() + every),
                    early_ns: early,
                    sole_ns: 0,
                    handover_ns: handover,
                };
                sim.launch_and_probe(&mut r, every, limits);
                if h > 0 && sim.clock.get() < half {
                    deepest = deepest.max(sim.depth());
                }
            }
            if h > 0 {
                drain = drain.max(sim.gpu_free.get().saturating_sub(deadline));
            }
            // The hand-over drains the queue; the next hold starts after it.
            sim.clock
                .set(sim.clock.get().max(sim.gpu_free.get()) + 1_000_000);
            r.clear();
        }
        (drain, deepest)
    }

    /// What is queued before the deadline runs before it: early in a 5 ms hold the queue may
    /// be milliseconds deep (a two-process client's GPU switched contexts at every kernel when
    /// both were held to the bound all hold long), and it narrows to the bound at the end, at
    /// a 600 µs allowance as at the default 4 ms (most of a 5 ms hold), whatever the GPU's pace.
    #[test]
    fn the_queue_may_fill_the_hold_and_narrows_to_the_bound_at_its_deadline() {
        for (early, shallowest, deepest_allowed) in [
            (600_000, 700_000, 1_400_000),
            (4_000_000, 2_500_000, 4_800_000),
        ] {
            for ratio in [3, 20] {
                let (drain, deepest) = simulate_holds(200_000, early, 0, ratio, 5_000_000, 6);
                let at = format!("allowance {early} ns, ratio {ratio}");
                assert!(
                    drain <= 600_000,
                    "{at}: drained {drain} ns past the deadline"
                );
                assert!(
                    deepest >= shallowest,
                    "{at}: queue only {deepest} ns deep early on"
                );
                assert!(
                    deepest <= deepest_allowed,
                    "{at}: queue {deepest} ns deep early on"
                );
            }
        }
    }

    /// With the hand-over allowance the queue at the deadline holds about it, not the bound: the
    /// next holder's wake-up runs while it drains (and no more than that drains past the hold).
    #[test]
    fn at_a_holds_end_the_queue_holds_the_hand_over_allowance() {
        for ratio in [3, 20] {
            let (bound_only, _) = simulate_holds(200_000, 600_000, 0, ratio, 5_000_000, 6);
            let (drain, _) = simulate_holds(200_000, 600_000, 1_000_000, ratio, 5_000_000, 6);
            assert!(
                (800_000..=1_500_000).contains(&drain),
                "ratio {ratio}: drained {drain} ns past the deadline with a 1 ms allowance"
            );
            assert!(
                bound_only < 600_000,
                "ratio {ratio}: drained {bound_only} ns past the deadline with the bound alone"
            );
        }
    }

    /// A process alone on `sim`, its holds of `hold` ns renewed one after another (nothing
    /// drained), probing with the default bound and early allowance and the sole allowance
    /// `sole`, its CPU pausing `pause` ns (launching nothing) every `every_pause` ns.
    struct Alone {
        ring: Ring,
        hold: u64,
        sole: u64,
        pause: u64,
        every_pause: u64,
        deadline: u64,
        next_pause: u64,
    }

    impl Alone {
        const BOUND: u64 = 200_000;
        const EARLY: u64 = 600_000;

        fn new(hold: u64, sole: u64, pause: u64, every_pause: u64) -> Self {
            Alone {
                ring: Ring::new(),
                hold,
                sole,
                pause,
                every_pause,
                deadline: hold,
                next_pause: every_pause,
            }
        }

        /// One probe interval of launching and its probe; returns the interval.
        fn launch(&mut self, sim: &Sim) -> u64 {
            if sim.clock.get() >= self.deadline {
                self.deadline = sim.clock.get() + self.hold; // renewed: nothing drained
            }
            let every = self.ring.every_ns(Self::BOUND);
            let limits = Limits {
                bound_ns: Self::BOUND,
                until_deadline_ns: self.deadline.saturating_sub(sim.clock.get() + every),
                early_ns: Self::EARLY,
                sole_ns: self.sole,
                handover_ns: 0,
            };
            sim.launch_and_probe(&mut self.ring, every, limits);
            every
        }

        /// The CPU's pause, if one is due: the GPU runs on, nothing is launched.
        fn pause_if_due(&mut self, sim: &Sim) {
            if sim.clock.get() >= self.next_pause {
                sim.clock.set(sim.clock.get() + self.pause);
                self.next_pause = sim.clock.get() + self.every_pause;
            }
        }
    }

    /// A process alone, its holds of 45 ms renewed, the CPU queuing `ratio` ns of GPU work per
    /// ns of launching and pausing `pause` ns every `every_pause` ns, for `total` ns. Returns
    /// the GPU's idle time.
    fn simulate_sole(sole: u64, ratio: u64, pause: u64, every_pause: u64, total: u64) -> u64 {
        let sim = Sim::new(ratio);
        let mut alone = Alone::new(45_000_000, sole, pause, every_pause);
        let mut queued = 0;
        while sim.clock.get() < total {
            queued += ratio * alone.launch(&sim);
            alone.pause_if_due(&sim);
        }
        sim.gpu_free.get().saturating_sub(queued)
    }

    /// A training step's phases differ in pace: here 6 ms of launching at 2 ns of GPU work per
    /// ns, then 1.5 ms at 10, then the CPU waits for the whole queue (its own synchronisation),
    /// a sole holder's hold renewed throughout. Returns, over the steps after the first two,
    /// the deepest queue at the step's end (what drains if its hold ends while it waits) and
    /// the GPU's idle time while the CPU launched.
    fn simulate_phases(pace_hold_ns: u64, steps: u32) -> (u64, u64) {
        let sim = Sim::new(2);
        let mut alone = Alone::new(5_000_000, 5_000_000, 0, u64::MAX);
        alone.ring.pace.hold_ns = pace_hold_ns;
        let (mut deepest, mut idle) = (0, 0);
        for step in 0..steps {
            for (ratio, launching) in [(2, 6_000_000), (10, 1_500_000)] {
                sim.ratio.set(ratio);
                let end = sim.clock.get() + launching;
                while sim.clock.get() < end {
                    let ran_out = sim.gpu_free.get();
                    let at = sim.clock.get();
                    alone.launch(&sim);
                    if step >= 2 {
                        idle += at.saturating_sub(ran_out);
                    }
                }
            }
            if step >= 2 {
                deepest = deepest.max(sim.depth());
            }
            sim.drain(&mut alone.ring);
        }
        (deepest, idle)
    }

    /// The moving average of the pace, learned mostly in the longer light phase, lets the heavy
    /// phase queue several times the sole allowance; holding the peak pace for longer than a
    /// step keeps the queue near the allowance (the heavy phase measured as the drain passes
    /// its probes), and the light phase's shallower queue does not run dry.
    #[test]
    fn a_held_peak_pace_keeps_a_heavy_phase_near_the_allowance() {
        let (deepest_mean, idle_mean) = simulate_phases(0, 12);
        let (deepest_held, idle_held) = simulate_phases(500_000_000, 12);
        assert!(
            deepest_mean > 10_000_000,
            "the average alone queued {deepest_mean} ns at a step's end"
        );
        assert!(
            deepest_held <= 6_000_000,
            "the held peak queued {deepest_held} ns at a step's end"
        );
        assert_eq!((idle_mean, idle_held), (0, 0), "the GPU ran dry");
    }

    /// A hold's coarse part queued 30 ms unprobed; in its precise stretch the first wait drains
    /// all of it. That wait measures nothing (no passing before it), and the probe after it
    /// is found passed by a query, so the pace was never learned while every hold went so (a
    /// lone tenant through the fake driver: probes in the precise stretch only, for good). The
    /// wait now goes on to the next probe, and the pace is known after one.
    #[test]
    fn the_first_wait_learns_the_pace_even_when_it_drains_the_queue() {
        let sim = Sim::new(5);
        let mut r = Ring::new();
        sim.gpu_free.set(sim.clock.get() + 30_000_000);
        let bound = Limits::bound(200_000);
        let mut waited = 0;
        for _ in 0..3 {
            waited += sim.launch_and_probe(&mut r, 100_000, bound);
        }
        assert!(waited >= 29_000_000, "waited {waited} ns for the queue");
        assert!(
            r.pace.x1024() > 4 * RATIO_ONE,
            "pace after the first wait: {} / {RATIO_ONE}",
            r.pace.x1024()
        );
        assert!(r.gpu_behind());
    }

    /// A framework pauses on the CPU now and then (Python, the allocator, a data loader): a
    /// queue held to the bound and the early allowance (~0.8 ms) runs dry in every pause
    /// longer than that, held to the sole allowance (5 ms) it does not. ResNet-50 training
    /// alone on an H100: 0.956–0.968 of native with the former, 1.002–1.009 with the latter.
    #[test]
    fn a_sole_holders_queue_outlasts_the_pauses_of_its_cpu() {
        for ratio in [3, 20] {
            let total = 2_000_000_000;
            // A 2 ms pause every 10 ms of launching.
            let shallow = simulate_sole(0, ratio, 2_000_000, 10_000_000, total);
            let sole = simulate_sole(5_000_000, ratio, 2_000_000, 10_000_000, total);
            assert!(
                shallow > total / 15,
                "ratio {ratio}: the GPU idled only {shallow} ns of {total} with a shallow queue"
            );
            assert!(
                sole < total / 200,
                "ratio {ratio}: the GPU idled {sole} ns of {total} with the sole allowance"
            );
        }
    }

    proptest::proptest! {
        /// What a hand-over waits for is the queue at the deadline. Whatever the pace (2–40×
        /// the CPU's), the CPU's pauses, the hold's length and the sole allowance, once the
        /// pace is measured the queue never holds more than the bound plus the larger of the
        /// early allowance and the sole one, and an interval's work: so a newcomer waits at
        /// most that past the holder's quota.
        #[test]
        fn the_queue_never_holds_more_than_the_bound_and_the_larger_allowance(
            ratio in 2u64..=40,
            sole_us in proptest::prop_oneof![proptest::strategy::Just(0u64), 500u64..=20_000],
            hold_ms in 3u64..=50,
            pause_us in 0u64..=4_000,
            every_pause_us in 500u64..=20_000,
        ) {
            let sole = sole_us * 1000;
            let sim = Sim::new(ratio);
            let mut alone =
                Alone::new(hold_ms * 1_000_000, sole, pause_us * 1000, every_pause_us * 1000);
            for step in 0..3_000 {
                let every = alone.launch(&sim);
                if step >= 100 {
                    let allowed = Alone::BOUND + Alone::EARLY.max(sole) + 2 * ratio * every;
                    proptest::prop_assert!(
                        sim.depth() <= allowed + allowed / 4,
                        "step {step}: queue {} ns deep, allowed {allowed}", sim.depth()
                    );
                }
                alone.pause_if_due(&sim);
            }
        }
    }

    /// One step of [`every_wait_the_gpu_may_not_have_passed_stays_known`].
    #[derive(Debug, Clone)]
    enum Step {
        /// A launch and its probe (with its wait on the gate word behind it) under a queue-ahead
        /// bound of `bound` × 10 µs: the CPU may wait for older probes first.
        Probe { bound: u64 },
        /// The GPU passes this many more probes (their events, and all but the last one's
        /// wait: it may stop at that one).
        Gpu(usize),
        /// A wait for the whole queue on another thread: it notes the probes recorded, the
        /// launching thread records `meanwhile` more, then the GPU has passed the noted ones.
        Drain { meanwhile: usize },
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (1u64..=80).prop_map(|bound| Step::Probe { bound }),
            (0usize..=8).prop_map(Step::Gpu),
            (0usize..=4).prop_map(|meanwhile| Step::Drain { meanwhile }),
        ]
    }

    proptest::proptest! {
        /// Parking stops the GPU at the first wait it has not passed and must know where that
        /// is (`park.rs`): under any interleaving of probes, the GPU's progress and waits for
        /// the whole queue on another thread, every probe whose wait the GPU may not have
        /// passed is among the ring's unpassed slots, in recording order. (Cleared at each
        /// wait for the queue, the ring forgot the probes recorded during it.)
        #[test]
        fn every_wait_the_gpu_may_not_have_passed_stays_known(
            steps in proptest::collection::vec(step(), 1..120),
        ) {
            use std::cell::Cell;
            // Probes by recording order (1, 2, ...): their slots, and how far the GPU got.
            let slot_of = std::cell::RefCell::new(Vec::<usize>::new());
            let events_passed = Cell::new(0usize);
            let mut r = Ring::new();
            let done = |s: usize| {
                let seq = slot_of.borrow().iter().rposition(|x| *x == s).map(|i| i + 1);
                if seq.is_some_and(|q| q <= events_passed.get()) { Done::Yes } else { Done::NotYet }
            };
            let probe = |r: &mut Ring, bound: u64| {
                let mut recorded = None;
                r.probe_with(
                    0,
                    Limits::bound(bound),
                    done,
                    |s| {
                        // The CPU waits for this probe: the GPU gets there.
                        let seq = slot_of.borrow().iter().rposition(|x| *x == s).unwrap() + 1;
                        events_passed.set(events_passed.get().max(seq));
                        Done::Yes
                    },
                    |s| {
                        recorded = Some(s);
                        true
                    },
                    || 0,
                );
                if let Some(s) = recorded {
                    slot_of.borrow_mut().push(s);
                }
            };
            for st in steps {
                match st {
                    Step::Probe { bound } => probe(&mut r, bound * 10_000),
                    Step::Gpu(k) => {
                        let n = slot_of.borrow().len();
                        events_passed.set((events_passed.get() + k).min(n));
                    }
                    Step::Drain { meanwhile } => {
                        let noted = r.recorded();
                        for _ in 0..meanwhile {
                            probe(&mut r, 800_000);
                        }
                        events_passed.set(events_passed.get().max(noted as usize));
                        r.passed_up_to(noted, 0, |_, _| None);
                    }
                }
                // The GPU may stop at the wait of the last probe whose event it passed, and
                // at any later one: all of them must be known, oldest first (probes in front
                // of them, passed, cost a query each).
                let all = slot_of.borrow();
                let want = &all[events_passed.get().max(1) - 1..];
                let known: Vec<usize> = r.unpassed_slots().collect();
                proptest::prop_assert!(
                    known.ends_with(want),
                    "known {:?}, the waits the GPU may not have passed {:?}", known, want
                );
            }
        }
    }

    /// The CPU queues 300 µs of GPU work per 100 µs (a probe interval): unbounded, the queue
    /// grows by 200 µs per interval. With a 300 µs bound the CPU waits, and once the ring has
    /// measured the GPU's pace the queue stays within about the bound of GPU time plus an
    /// interval's work, and never empties.
    #[test]
    fn the_cpu_waits_for_probes_older_than_the_bound_and_the_queue_stays_bounded() {
        let (waited, deepest, settled, shallowest, _) = simulate(300_000, 3, 200);
        assert!(waited > 0, "a GPU falling behind makes the CPU wait");
        assert!(deepest <= 1_200_000, "queue reached {deepest} ns");
        assert!(settled <= 600_000, "the settled queue reached {settled} ns");
        assert!(shallowest > 0, "the GPU ran dry");
    }

    /// ResNet-50 training's case: 2 ms of GPU work per 100 µs of launching. By the CPU's clock
    /// alone (two probes pending) the queue held ~4 ms, all of it drained past the hold; with the
    /// measured pace the probe interval shrinks and the queue settles near the bound.
    #[test]
    fn a_cpu_far_ahead_of_the_gpu_is_held_to_the_bounds_worth_of_gpu_time() {
        let (waited, _, settled, shallowest, every) = simulate(200_000, 20, 400);
        assert!(waited > 0);
        assert!(every < PROBE_EVERY_NS, "the interval stayed at {every} ns");
        assert!(settled <= 600_000, "the settled queue reached {settled} ns");
        assert!(shallowest > 0, "the GPU ran dry");
    }

    /// A CPU slower than the GPU never waits, and the interval stays as it was.
    #[test]
    fn a_gpu_that_keeps_up_keeps_the_interval() {
        let (waited, _, _, _, every) = simulate(200_000, 1, 100);
        assert_eq!(waited, 0);
        assert_eq!(every, PROBE_EVERY_NS);
    }

    #[test]
    fn short_bounds_probe_twice_per_bound() {
        assert_eq!(probe_every(200_000), PROBE_EVERY_NS);
        assert_eq!(probe_every(1_600_000), PROBE_EVERY_NS);
        assert_eq!(probe_every(60_000), 30_000);
        assert_eq!(probe_every(1_000), MIN_PROBE_EVERY_NS);
    }

    #[test]
    fn a_gpu_that_keeps_up_costs_no_wait_and_a_broken_event_clears_the_ring() {
        let mut r = Ring::new();
        for step in 0..40u64 {
            let w = r.probe_with(
                step * PROBE_EVERY_NS,
                Limits::bound(1_000_000),
                |_| Done::Yes,
                |_| panic!("no wait expected"),
                |_| true,
                || step * PROBE_EVERY_NS,
            );
            assert_eq!(w, 0);
            assert_eq!(r.pending(), 1);
        }
        r.probe_with(
            u64::MAX / 2,
            Limits::bound(1),
            |_| Done::Broken,
            |_| Done::Yes,
            |_| false,
            || 0,
        );
        assert_eq!(r.pending(), 0);
    }

    /// Records a probe at `at` under a 1 ms bound, with none of the pending ones passed: the
    /// ring keeps it pending.
    fn record_probe(r: &mut Ring, at: u64) {
        r.probe_with(
            at,
            Limits::bound(1_000_000),
            |_| Done::NotYet,
            |_| Done::Yes,
            |_| true,
            || at,
        );
    }

    #[test]
    fn a_wait_given_up_at_the_holds_end_keeps_the_probes_and_records_none() {
        // Three probes pending over a 1 µs bound: the next probe must wait for the oldest.
        let mut r = Ring::new();
        for i in 0..3 {
            record_probe(&mut r, i * 10);
        }
        assert_eq!(r.pending(), 3);
        let mut recorded = false;
        r.probe_with(
            40,
            Limits::bound(1),
            |_| Done::NotYet,
            |_| Done::NotYet,
            |_| {
                recorded = true;
                true
            },
            || 50,
        );
        assert_eq!(r.pending(), 3, "the probes' work is still queued");
        assert!(!recorded, "no probe recorded once the hold is over");
        assert_eq!(r.unpassed_slots().collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn a_wait_for_the_queue_forgets_only_the_probes_recorded_before_it() {
        // Three probes, then a drain begins; another thread records two more during it. When
        // it returns only the first three are known passed: the two later ones (and, under
        // parking, their waits on the gate word) stay pending for the hold's end to find.
        let mut r = Ring::new();
        for i in 0..3 {
            record_probe(&mut r, i * 10);
        }
        let before = r.recorded();
        record_probe(&mut r, 30);
        record_probe(&mut r, 40);
        r.passed_up_to(before, 0, |_, _| None);
        assert_eq!(r.pending(), 2);
        assert_eq!(r.unpassed_slots().collect::<Vec<_>>(), vec![2, 3, 4]);
        r.passed_up_to(r.recorded(), 0, |_, _| None);
        assert_eq!(r.pending(), 0);
    }

    #[test]
    fn the_last_probe_passed_may_still_have_its_wait_ahead() {
        let mut r = Ring::new();
        for i in 0..3 {
            record_probe(&mut r, i * 10);
        }
        // The GPU passed the first two probes' events: only the second's wait may be ahead.
        let mut passed = [true, true, false];
        r.probe_with(
            40,
            Limits::bound(1_000_000),
            |s| {
                if std::mem::take(&mut passed[s]) {
                    Done::Yes
                } else {
                    Done::NotYet
                }
            },
            |_| Done::Yes,
            |_| true,
            || 40,
        );
        assert_eq!(r.unpassed_slots().collect::<Vec<_>>(), vec![1, 2, 3]);
        r.clear();
        assert_eq!(r.unpassed_slots().count(), 0, "all drained");
    }
}
