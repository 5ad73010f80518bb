//! A bound on how far ahead of the GPU a holder's CPU queues work (`KUBESHARE_HOOK_MAX_AHEAD_US`,
//! default 200 µs, 0 = off; issue 14's fifth round).
//!
//! The gate acts at launch time, so everything queued before the deadline runs after it: the
//! hook drains it at the hand-over, and the next holder waits for it. A framework's CPU can
//! queue far more GPU work per ms than the GPU runs: on an H100, ResNet-50 training's drain
//! past a ~3.4 ms grant was 0.75 ms at the median but 4.8 ms at p90 and up to 14.7 ms, and a
//! batch-1 inference request beside it waited that whole turn. Here, in the precise stretch of
//! a hold (docs/hook.md, "The launch gate"), the hook records an event on the launching stream
//! every [`probe_every`] of launching (100 µs, or half a shorter bound), and keeps at most
//! `bound / probe_every` pending: before recording another it waits for the oldest. So the GPU never runs
//! further behind than the work the CPU queued in the bound's worth of its own launching time
//! (the time it spent waiting does not count), whatever the phase of the program. A bound on
//! the CPU's clock, not the GPU's: the GPU time queued is the bound times how much faster the
//! CPU queues work than the GPU runs it (a first attempt bounded the probes' age in wall-clock
//! time, which let the queue settle at 3.5 ms for a 1 ms bound in the test below). The GPU keeps
//! the pending probes' work queued while the CPU waits, so it does not idle for it.

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
/// Probe events in flight at most.
pub const RING: usize = 16;

/// What the driver said about an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Done {
    Yes,
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
    recorded: [u64; RING],
    head: usize,
    len: usize,
}

impl Ring {
    pub const fn new() -> Self {
        Ring {
            ctx: 0,
            events: [0; RING],
            recorded: [0; RING],
            head: 0,
            len: 0,
        }
    }

    pub fn pending(&self) -> usize {
        self.len
    }

    /// Forgets every pending probe (the events stay, for reuse).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// One probe at precise time `now`: drops the probes the GPU has passed, waits (`sync`)
    /// for the oldest pending ones until fewer than `bound_ns / PROBE_EVERY_NS` (at least one)
    /// are pending, then records a new one (`record(slot)`, false: not recorded). `clock`
    /// reads the time again after a wait. Returns how long it waited.
    pub fn probe(
        &mut self,
        now: u64,
        bound_ns: u64,
        mut query: impl FnMut(usize) -> Done,
        mut sync: impl FnMut(usize) -> bool,
        mut record: impl FnMut(usize) -> bool,
        mut clock: impl FnMut() -> u64,
    ) -> u64 {
        while self.len > 0 {
            match query(self.head) {
                Done::Yes => self.pop(),
                Done::NotYet => break,
                Done::Broken => {
                    self.clear();
                    return 0;
                }
            }
        }
        let keep = usize::try_from(bound_ns / probe_every(bound_ns))
            .unwrap_or(RING)
            .clamp(1, RING);
        let mut t = now;
        while self.len >= keep {
            if !sync(self.head) {
                self.clear();
                return t.saturating_sub(now);
            }
            self.pop();
            t = clock().max(t);
        }
        if self.len < RING {
            let slot = (self.head + self.len) % RING;
            if record(slot) {
                self.recorded[slot] = t;
                self.len += 1;
            }
        }
        t.saturating_sub(now)
    }

    fn pop(&mut self) {
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
    use super::*;
    use std::cell::{Cell, RefCell};

    /// The CPU queues 300 µs of GPU work per 100 µs (a probe interval): unbounded, the queue
    /// grows by 200 µs per interval. With a 300 µs bound (three probes pending) the CPU waits,
    /// and the queue stays within what the CPU queues in the bound's worth of launching (900
    /// µs of GPU work) plus an interval's.
    #[test]
    fn the_cpu_waits_for_probes_older_than_the_bound_and_the_queue_stays_bounded() {
        let clock = Cell::new(0u64);
        let gpu_free = Cell::new(0u64); // when the GPU has run everything queued so far
        let done_at = RefCell::new([u64::MAX; RING]);
        let mut r = Ring::new();
        let (mut waited, mut deepest, mut settled) = (0, 0, 0);
        for step in 0..200 {
            waited += r.probe(
                clock.get(),
                300_000,
                |s| {
                    if done_at.borrow()[s] <= clock.get() {
                        Done::Yes
                    } else {
                        Done::NotYet
                    }
                },
                |s| {
                    clock.set(clock.get().max(done_at.borrow()[s]));
                    true
                },
                |s| {
                    // Done when the GPU has run what was queued before it.
                    done_at.borrow_mut()[s] = gpu_free.get().max(clock.get());
                    true
                },
                || clock.get(),
            );
            gpu_free.set(gpu_free.get().max(clock.get()) + 300_000);
            let depth = gpu_free.get() - clock.get();
            deepest = deepest.max(depth);
            if step >= 20 {
                settled = settled.max(depth);
            }
            clock.set(clock.get() + PROBE_EVERY_NS);
        }
        assert!(waited > 0, "a GPU falling behind makes the CPU wait");
        assert!(deepest <= 1_200_000, "queue reached {deepest} ns");
        assert!(settled >= 900_000, "the GPU kept {settled} ns queued");
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
            let w = r.probe(
                step * PROBE_EVERY_NS,
                1_000_000,
                |_| Done::Yes,
                |_| panic!("no wait expected"),
                |_| true,
                || step * PROBE_EVERY_NS,
            );
            assert_eq!(w, 0);
            assert_eq!(r.pending(), 1);
        }
        r.probe(u64::MAX / 2, 1, |_| Done::Broken, |_| true, |_| false, || 0);
        assert_eq!(r.pending(), 0);
    }
}
