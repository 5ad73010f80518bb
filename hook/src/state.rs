//! The hook's per-process state, in one place so that a fork can replace it.
//!
//! A forked child (a DataLoader worker, a `subprocess` started by fork) inherits the parent's
//! memory: its token state, its sockets to gem-schd, its allocation records, and any mutex
//! another thread of the parent held at the fork, locked forever in the child. So the child
//! must not touch any of it. All of it hangs off one pointer; the `pthread_atfork` child
//! handler closes the child's copies of the inherited sockets (the parent's connections stay
//! open: closing a descriptor in one process does not close the other's) and points the
//! child at a fresh state. The child then connects on its first CUDA call as another process
//! of the same client (same socket directory, so same token and memory budget). The old state
//! is leaked in the child, never dropped (dropping would touch locks and sockets).
//!
//! The launch fast path pays one extra pointer load for this.

use cuda_abi::CUcontext;
use gem_proto::Client;
use std::collections::BTreeMap;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub const MAX_DEVICES: usize = 64;
/// In the precise stretch of a hold, one launch in this many reads the precise clock.
pub const PRECISE_EVERY: u32 = 8;
/// Contexts the hook drains at a hand-over (a process rarely has more than one per device).
pub const MAX_CONTEXTS: usize = 32;

pub struct Token {
    pub client: Option<Client>,
    /// Precise time of the grant, and the quota granted (µs).
    pub grant_ns: u64,
    pub quota_us: u64,
    /// Length of the last burst that ended by going idle, reported with the next request.
    pub idle_burst_us: u64,
    /// How far the last hold ran past its quota when the idle thread ended it (it expired with
    /// no launch), reported with the next request as a launch-ended hold's overuse is: gem-schd
    /// learns the holder's drain from it, and a zero there shortened nothing and lengthened
    /// the next grants.
    pub expired_overuse_us: u64,
    /// Hold time (ns) not yet reported to gem-schd in a Busy frame (`timing::report`).
    pub held_ns: u64,
    /// Set while launches queue behind the gate ahead of the Grant (`gate.rs`).
    pub ahead: Option<crate::gate::Ahead>,
    /// The gate page registered with the driver: its host address and device address
    /// (0, 0: none yet).
    pub gate_addr: (usize, u64),
    /// The last hold's end left work parked behind the gate (`park.rs`) on this stream (its
    /// handle + 1; 0: none): the next hold starts when gem-schd opened the gate, as for work
    /// queued ahead of a Grant, and launches queued ahead on that stream need no wait of their
    /// own (they are behind the parked one).
    pub parked: usize,
}

pub struct MemConn {
    pub client: Option<Client>,
    /// Until then (precise ns) the device runs without memory accounting (`run` policy).
    pub bypass_until_ns: u64,
}

/// One GPU as seen from this process.
pub struct Gpu {
    /// Coarse-clock time until which launches pass without any check (0: no token).
    pub deadline: AtomicU64,
    /// Precise-clock time until which launches past `deadline` still pass (0: none): the
    /// last coarse tick of a hold is checked on the precise clock (see `clock::deadlines`).
    pub deadline_precise: AtomicU64,
    /// Precise-clock time at which the current hold's quota ends (meaningful while `holding`):
    /// the idle thread ends a hold that nobody ends by launching (`device::release_if_expired`).
    pub hold_end: AtomicU64,
    /// Launches left that pass in the precise stretch without reading the precise clock.
    pub precise_skip: AtomicU32,
    /// Launches per precise read: [`PRECISE_EVERY`], or 1 while the queue-ahead bound has
    /// measured the GPU running behind the CPU (its CPU has time to spare then, and a probe
    /// every 8 launches let 8 long kernels queue at once) or has not measured it yet
    /// (`Ring::unpaced_start`).
    pub precise_every: AtomicU32,
    /// The queue-ahead bound's probes (`ahead.rs`), and the precise time of the last probe.
    pub ahead: Mutex<crate::ahead::Ring>,
    pub last_probe: AtomicU64,
    /// The probe interval in ns (`Ring::every_ns`; 0 until the first probe sets it).
    pub probe_every: AtomicU64,
    pub last_launch: AtomicU64,
    /// Coarse time at which the idle thread saw this process's queued work finished (with no
    /// launch since it looked): the GPU has been idle for this process since then.
    pub drained_at: AtomicU64,
    /// Set while a thread of its own waits for this process's queued work before an idle
    /// release (`idle::watch_queue`): one such wait at a time.
    pub queue_watch: AtomicBool,
    pub holding: AtomicBool,
    /// Under parking (`park.rs`): the first stream launched on in the current hold (its
    /// handle + 1; 0: none yet), whether another one was too, and the device address of the
    /// gate word the probes' waits read (0: none).
    pub hold_stream: AtomicUsize,
    pub streams_mixed: AtomicBool,
    pub park_word: AtomicU64,
    /// How many times in a row the hold was renewed (0 after a grant); written under the
    /// token lock, read by the queue-ahead probes, which let the sole allowance stay queued
    /// once it reaches `device::SOLE_AFTER_RENEWALS` (`ahead.rs`).
    pub renewals_in_row: AtomicU32,
    /// Bytes this process has counted against the pod on this device.
    pub outstanding: AtomicU64,
    /// The pod's memory cap as gem-schd last said (0: not known yet).
    pub cap: AtomicU64,
    /// Descriptors of the token and memory connections (-1: none): the idle thread polls
    /// the token one for a hang-up; a forked child closes its copies.
    pub token_fd: AtomicI32,
    pub mem_fd: AtomicI32,
    pub token: Mutex<Token>,
    pub mem: Mutex<MemConn>,
    pub uuid: OnceLock<Option<String>>,
    /// Launches left before the next one is timed (`busy.rs`): plain loads and stores, racy
    /// on purpose (a lost update moves a sample by a launch). Starts at 1: the first launch
    /// sets the gap (or, sampling off, `u32::MAX`).
    pub sample_in: AtomicU32,
    /// The gap the current countdown started from: the launches the next sample stands for.
    pub sample_gap: AtomicU32,
    /// Launches of samples that could not take the pairs' lock (another thread held it).
    pub sample_carry: AtomicU64,
    pub busy: Mutex<crate::busy::Pairs>,
}

impl Gpu {
    /// Launches pass until these deadlines (see `clock::deadlines`); the precise one is stored
    /// first, so that a launcher that sees the new coarse deadline sees it too.
    pub fn set_deadlines(&self, coarse: u64, precise: u64) {
        self.precise_skip.store(0, Ordering::Relaxed);
        self.deadline_precise.store(precise, Ordering::Release);
        self.deadline.store(coarse, Ordering::Release);
    }

    /// No launch passes without going through the token lock.
    pub fn stop_launches(&self) {
        self.deadline.store(0, Ordering::Release);
        self.deadline_precise.store(0, Ordering::Release);
    }

    /// Whether a launch at coarse time `now` may pass: before the coarse deadline (no other
    /// clock read), or in the last tick before the precise one.
    #[inline]
    pub fn may_launch(&self, now: u64) -> bool {
        now < self.deadline.load(Ordering::Acquire) || self.last_tick() != LastTick::Past
    }

    /// The precise clock is read at every `PRECISE_EVERY`th launch only: on the H100 machine
    /// it cost ~45 ns a read (the coarse one a few ns), and with min-quota turns, shorter
    /// than two ticks, every launch is in the precise stretch. A hold then ends at most that
    /// many launches (tens of µs of a framework's CPU time) past its deadline.
    #[inline]
    pub fn last_tick(&self) -> LastTick {
        let p = self.deadline_precise.load(Ordering::Acquire);
        if p == 0 {
            return LastTick::Past;
        }
        // Racy between threads on purpose (a plain load and store, no read-modify-write): a
        // lost update only moves the next precise read by a launch or two.
        let n = self.precise_skip.load(Ordering::Relaxed);
        if n > 0 {
            self.precise_skip.store(n - 1, Ordering::Relaxed);
            return LastTick::Pass;
        }
        let now = crate::clock::precise_ns();
        if now < p {
            self.precise_skip.store(
                self.precise_every.load(Ordering::Relaxed).saturating_sub(1),
                Ordering::Relaxed,
            );
            LastTick::PassAt(now)
        } else {
            LastTick::Past
        }
    }

    const fn new() -> Self {
        Gpu {
            deadline: AtomicU64::new(0),
            deadline_precise: AtomicU64::new(0),
            hold_end: AtomicU64::new(0),
            precise_skip: AtomicU32::new(0),
            precise_every: AtomicU32::new(PRECISE_EVERY),
            ahead: Mutex::new(crate::ahead::Ring::new()),
            last_probe: AtomicU64::new(0),
            probe_every: AtomicU64::new(0),
            last_launch: AtomicU64::new(0),
            drained_at: AtomicU64::new(0),
            queue_watch: AtomicBool::new(false),
            holding: AtomicBool::new(false),
            hold_stream: AtomicUsize::new(0),
            streams_mixed: AtomicBool::new(false),
            park_word: AtomicU64::new(0),
            renewals_in_row: AtomicU32::new(0),
            outstanding: AtomicU64::new(0),
            cap: AtomicU64::new(0),
            token_fd: AtomicI32::new(-1),
            mem_fd: AtomicI32::new(-1),
            token: Mutex::new(Token {
                client: None,
                grant_ns: 0,
                quota_us: 0,
                idle_burst_us: 0,
                expired_overuse_us: 0,
                held_ns: 0,
                ahead: None,
                gate_addr: (0, 0),
                parked: 0,
            }),
            mem: Mutex::new(MemConn {
                client: None,
                bypass_until_ns: 0,
            }),
            uuid: OnceLock::new(),
            sample_in: AtomicU32::new(1),
            sample_gap: AtomicU32::new(1),
            sample_carry: AtomicU64::new(0),
            busy: Mutex::new(crate::busy::Pairs::new()),
        }
    }
}

/// A launch past the coarse deadline: in the precise stretch without a clock read, in it at
/// the precise time read, or past the deadline (or no token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LastTick {
    Pass,
    PassAt(u64),
    Past,
}

/// What kind of object an allocation record is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Ptr,
    Handle,
    Array,
}

/// What one live allocation counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub dev: usize,
    pub bytes: u64,
    /// The context that owns it (freed with it), 0 for memory no context owns (stream-ordered
    /// pools, `cuMemCreate` handles).
    pub ctx: usize,
    /// Handles only: live `cuMemMap` mappings, and whether `cuMemRelease` was called (the
    /// driver frees a released handle's memory when its last mapping goes).
    pub maps: u32,
    pub released: bool,
}

pub struct State {
    pub gpus: [Gpu; MAX_DEVICES],
    /// One past the highest device index that has held a token (the idle thread scans that far).
    pub devices_seen: AtomicUsize,
    pub idle_thread: AtomicBool,
    /// Live allocations: (kind, pointer or handle) → record.
    pub records: Mutex<BTreeMap<(Kind, u64), Record>>,
    /// Mapped virtual address → (handle, size).
    pub maps: Mutex<BTreeMap<u64, (u64, u64)>>,
    /// Contexts seen made current or retained (0: free slot).
    pub contexts: [AtomicUsize; MAX_CONTEXTS],
    /// Each device's primary context, as `cuDevicePrimaryCtxRetain` returned it.
    pub primary: [AtomicUsize; MAX_DEVICES],
}

impl State {
    const fn new() -> Self {
        State {
            gpus: [const { Gpu::new() }; MAX_DEVICES],
            devices_seen: AtomicUsize::new(0),
            idle_thread: AtomicBool::new(false),
            records: Mutex::new(BTreeMap::new()),
            maps: Mutex::new(BTreeMap::new()),
            contexts: [const { AtomicUsize::new(0) }; MAX_CONTEXTS],
            primary: [const { AtomicUsize::new(0) }; MAX_DEVICES],
        }
    }
}

static INITIAL: State = State::new();
static STATE: AtomicPtr<State> = AtomicPtr::new(&INITIAL as *const State as *mut State);

/// The state of this process.
#[inline]
pub fn state() -> &'static State {
    // SAFETY: STATE always points to INITIAL or to a leaked, never freed State.
    unsafe { &*STATE.load(Ordering::Acquire) }
}

#[inline]
pub fn gpu(dev: usize) -> &'static Gpu {
    &state().gpus[dev]
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] without waiting: `None` while another thread holds `m`.
pub fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Registers the fork handler (once; called before the first connection to gem-schd, which
/// is the first state a child must not inherit).
pub fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: a handler without arguments, valid for the life of the process.
    ONCE.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(child_after_fork));
    });
}

/// In the child, right after fork, single-threaded: close the inherited connections and start
/// from a fresh state. Touches no lock of the old state.
extern "C" fn child_after_fork() {
    let old = state();
    for g in &old.gpus {
        for fd in [&g.token_fd, &g.mem_fd] {
            let f = fd.swap(-1, Ordering::AcqRel);
            if f >= 0 {
                // SAFETY: the child's own copy of a descriptor the old state's (leaked, never
                // dropped) Client owns; nothing in the child uses it again.
                unsafe { libc::close(f) };
            }
        }
    }
    crate::cupti::forked();
    let fresh: &'static State = Box::leak(Box::new(State::new()));
    STATE.store(fresh as *const State as *mut State, Ordering::Release);
    // No logging here: it reads the environment, whose lock another thread of the parent
    // may have held at the fork.
}

// ------------------------------------------------------------------------------ contexts

/// Remembers a context this process uses (made current, retained), for the drains.
pub fn note_context(ctx: CUcontext) {
    let c = ctx as usize;
    if c == 0 {
        return;
    }
    let s = state();
    if s.contexts.iter().any(|x| x.load(Ordering::Relaxed) == c) {
        return;
    }
    for slot in &s.contexts {
        if slot
            .compare_exchange(0, c, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        if slot.load(Ordering::Relaxed) == c {
            return;
        }
    }
    crate::debug!("more than {MAX_CONTEXTS} contexts: context {c:#x} is not drained at hand-overs");
}

/// Forgets a destroyed context.
pub fn forget_context(ctx: usize) {
    for slot in &state().contexts {
        let _ = slot.compare_exchange(ctx, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// The contexts known now.
pub fn contexts() -> Vec<usize> {
    state()
        .contexts
        .iter()
        .map(|x| x.load(Ordering::Acquire))
        .filter(|c| *c != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_precise_stretch_reads_the_clock_every_few_launches_and_ends_at_the_deadline() {
        let g = Gpu::new();
        assert!(!g.may_launch(0), "no token: no launch");
        // Coarse deadline past, precise deadline 1 s ahead: launches pass, and the clock is
        // read at the first and then every PRECISE_EVERY-th.
        let now = crate::clock::precise_ns();
        g.set_deadlines(1, now + 1_000_000_000);
        assert!(g.may_launch(5));
        assert_eq!(g.precise_skip.load(Ordering::Relaxed), PRECISE_EVERY - 1);
        for _ in 0..PRECISE_EVERY - 1 {
            assert!(g.may_launch(5));
        }
        assert_eq!(g.precise_skip.load(Ordering::Relaxed), 0);
        // Precise deadline past: the next launch that reads the clock stops.
        g.set_deadlines(1, now.saturating_sub(1).max(1));
        assert!(!g.may_launch(5));
        // Stopped: nothing passes, whatever was left to skip.
        g.set_deadlines(1, now + 1_000_000_000);
        assert!(g.may_launch(5));
        g.stop_launches();
        assert!(!g.may_launch(0));
    }
}
