//! The launch gate: gem-schd's token, asked for on each device's token connection
//! (`connect.rs`).
//!
//! While the token is valid, a launch reads the current context's device, the
//! coarse clock (vDSO) and one atomic deadline: no lock, no system call; in the last coarse
//! tick before the deadline it also reads the precise clock (vDSO too), so that a hold ends
//! at its quota (`KUBESHARE_HOOK_PRECISE_DEADLINE=0`: the coarse clock alone; on a 4 ms tick
//! a 5 ms hold then runs 1–9 ms). When the deadline has
//! passed, the launching thread takes the device's token lock and first asks gem-schd to renew
//! the hold (granted only when the token would come straight back to this process: nothing
//! is drained then); otherwise it waits for the work the process queued on the device in every
//! context it uses (a hand-over must not leave work of this process running under the next
//! holder), reports how far it overran the quota, and asks again (gem-schd then hands the
//! token to whoever is due). A background thread (`idle.rs`) gives the token back when the
//! process goes idle, ends holds whose quota ran out without a launch, and notices gem-schd
//! hanging up.
//!
//! Timeouts (`KUBESHARE_HOOK_TIMEOUT_MS`, default 5000): every reply is awaited at most that
//! long. A token wait may be longer by right (others hold the token), so on each timeout
//! gem-schd is probed on the memory connection; if it does not answer either, it is hung: under
//! `KUBESHARE_ON_UNREACHABLE=run` the device runs unmanaged for 5 s and retries, under `wait`
//! (fail closed) launches keep waiting on a fresh connection. Memory calls never wait longer
//! than the timeout: see `memory.rs`.

use crate::ahead;
use crate::clock::{coarse_ns, coarse_resolution_ns, deadlines, precise_ns};
use crate::config::{Unreachable, active, settings};
use crate::connect::{Purpose, connect, drop_client, note_refusal};
use crate::state::{
    Gpu, LastTick, MAX_DEVICES, PRECISE_EVERY, Token, contexts, gpu, lock, note_context, state,
};
use crate::{debug, info, real};
use cuda_abi::*;
use gem_proto::{Client, ClientError};
use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

/// Under `KUBESHARE_ON_UNREACHABLE=run`, how long a device runs unmanaged before retrying.
const BYPASS_NS: u64 = 5_000_000_000;

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(
        cuCtxGetDevice,
        cuDeviceGetCount,
        cuCtxGetCurrent,
        cuCtxSynchronize,
        cuCtxPushCurrent_v2,
        cuCtxPopCurrent_v2,
        cuStreamIsCapturing,
        cuThreadExchangeStreamCaptureMode,
        cuEventCreate,
        cuEventDestroy_v2,
        cuEventRecord,
        cuEventQuery,
        cuEventSynchronize,
        cuEventElapsedTime,
    );
}

/// Runs `f`, turning a panic into `fallback`: no panic may cross the C ABI.
pub fn guard<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// How many devices the process sees (0: not asked yet). A process that sees one device (a
/// pod with one GPU) needs no `cuCtxGetDevice` call per launch to know which device it
/// launches on, which keeps the launch fast path free of driver calls.
static DEVICE_COUNT: AtomicI32 = AtomicI32::new(0);

/// The device of the calling thread's current context.
#[inline]
pub fn current_device() -> Option<usize> {
    match DEVICE_COUNT.load(Ordering::Relaxed) {
        1 => return Some(0),
        0 => {
            let mut n: c_int = 0;
            if real!(cuDeviceGetCount, &mut n) == CUDA_SUCCESS && n > 0 {
                DEVICE_COUNT.store(n, Ordering::Relaxed);
                if n == 1 {
                    return Some(0);
                }
            }
        }
        _ => {}
    }
    let mut d: CUdevice = -1;
    let rc = real!(cuCtxGetDevice, &mut d);
    if rc == CUDA_SUCCESS {
        usize::try_from(d).ok().filter(|d| *d < MAX_DEVICES)
    } else {
        None
    }
}

/// `CUdevice` ordinal as an index into the device table.
pub fn device_index(d: CUdevice) -> Option<usize> {
    usize::try_from(d).ok().filter(|d| *d < MAX_DEVICES)
}

pub fn current_ctx() -> usize {
    let mut c: CUcontext = std::ptr::null_mut();
    let _ = real!(cuCtxGetCurrent, &mut c);
    c as usize
}

fn ctx_device() -> Option<usize> {
    let mut d: CUdevice = -1;
    (real!(cuCtxGetDevice, &mut d) == CUDA_SUCCESS)
        .then(|| usize::try_from(d).ok())
        .flatten()
}

/// The device of context `ctx` (one the program made current or retained), made current on
/// this thread for the question if it is not; `None` if the driver no longer knows it.
pub fn context_device(ctx: usize) -> Option<usize> {
    if DEVICE_COUNT.load(Ordering::Relaxed) == 1 {
        return Some(0);
    }
    if ctx == current_ctx() {
        return ctx_device();
    }
    if real!(cuCtxPushCurrent_v2, ctx as CUcontext) != CUDA_SUCCESS {
        return None;
    }
    let d = ctx_device();
    let mut popped: CUcontext = std::ptr::null_mut();
    let _ = real!(cuCtxPopCurrent_v2, &mut popped);
    d
}

/// Waits for all work this process queued on device `dev`, in every context it uses there
/// (not only the calling thread's: another thread may launch in another context). Done in
/// relaxed capture mode, so that it cannot invalidate a CUDA-graph capture in another thread.
pub fn drain(dev: usize) {
    // The probes recorded from here on may not be waited for (another thread's launches).
    let recorded = gpu(dev).ahead.try_lock().ok().map(|r| r.recorded());
    let mut mode: c_int = CU_STREAM_CAPTURE_MODE_RELAXED;
    let swapped = exchange_capture_mode(&mut mode) == CUDA_SUCCESS;
    let current = current_ctx();
    let mut done_current = false;
    for ctx in contexts() {
        if ctx == current {
            if ctx_device() == Some(dev) {
                sync_here();
            }
            done_current = true;
            continue;
        }
        if real!(cuCtxPushCurrent_v2, ctx as CUcontext) != CUDA_SUCCESS {
            continue; // destroyed behind the hook's back
        }
        if ctx_device() == Some(dev) {
            sync_here();
        }
        let mut popped: CUcontext = std::ptr::null_mut();
        let _ = real!(cuCtxPopCurrent_v2, &mut popped);
    }
    if !done_current && current != 0 && ctx_device() == Some(dev) {
        sync_here();
    }
    // Every probe recorded before the wait is passed now: forget them (the measured pace
    // stays), so the next hold's first probe does not query each.
    if let (Some(recorded), Ok(mut ring)) = (recorded, gpu(dev).ahead.try_lock()) {
        let events = ring.events;
        ring.passed_up_to(recorded, precise_ns(), |a, b| {
            elapsed_ns(events[a], events[b])
        });
    }
    if swapped {
        let _ = exchange_capture_mode(&mut mode);
    }
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's capture mode to `*mode` and leaves
/// the previous one there.
pub(crate) fn exchange_capture_mode(mode: &mut c_int) -> CUresult {
    real!(cuThreadExchangeStreamCaptureMode, mode)
}

fn sync_here() {
    let rc = real!(cuCtxSynchronize);
    if rc != CUDA_SUCCESS {
        debug!("cuCtxSynchronize at a token boundary returned {rc}");
    }
}

// ------------------------------------------------------------------------------ launch gate

/// Called before every kernel/graph launch on `stream`; what it returns goes to
/// [`crate::timing::end`] with the launch's result (a launch being timed, `busy.rs`).
#[inline]
pub fn gate(stream: CUstream) -> Option<crate::timing::Sampling> {
    if !active() {
        return None;
    }
    let dev = current_device()?;
    let g = gpu(dev);
    pass(dev, g, stream);
    crate::timing::begin(g, stream)
}

/// The token gate: returns once a launch on `stream` may go.
#[inline]
fn pass(dev: usize, g: &Gpu, stream: CUstream) {
    if crate::park::enabled() {
        crate::park::note_stream(g, stream);
    }
    let now = coarse_ns();
    if now < g.deadline.load(Ordering::Acquire) {
        g.last_launch.store(now, Ordering::Relaxed);
        return;
    }
    match g.last_tick() {
        LastTick::Pass => {
            g.last_launch.store(now, Ordering::Relaxed);
            return;
        }
        LastTick::PassAt(p) => {
            g.last_launch.store(now, Ordering::Relaxed);
            // A probe may wait for the GPU, as long as a kernel runs: the hold may end
            // meanwhile (the idle thread drains, releases, and gem-schd grants the next
            // client), and a launch that went on then would run with no token, in the next
            // client's turn, charged to no one. So one that waited passes only if the hold
            // still lets it; otherwise it asks for the token as any launch past the quota.
            if p.saturating_sub(g.last_probe.load(Ordering::Relaxed))
                >= g.probe_every.load(Ordering::Relaxed)
                && guard(0, || bound_ahead(g, stream, p)) > 0
                && !g.may_launch(coarse_ns())
            {
                guard((), || acquire(dev, stream));
            }
            return;
        }
        LastTick::Past => {}
    }
    guard((), || acquire(dev, stream));
}

/// The queue-ahead bound (`ahead.rs`): at most one probe per `Gpu::probe_every`, by whichever
/// launching thread gets there (others pass). Never during a graph capture. Returns how long
/// it waited for the GPU (ns).
#[cold]
fn bound_ahead(g: &Gpu, stream: CUstream, now: u64) -> u64 {
    let bound = settings().max_ahead_ns;
    g.last_probe.store(now, Ordering::Relaxed);
    if bound == 0 {
        // Off: no launch comes here again.
        g.probe_every.store(u64::MAX, Ordering::Relaxed);
        return 0;
    }
    if capturing(stream) {
        return 0;
    }
    let Ok(mut ring) = g.ahead.try_lock() else {
        return 0;
    };
    let ctx = current_ctx();
    if ctx == 0 {
        return 0;
    }
    if ring.ctx != ctx {
        // Events belong to the context they were made in: start over in this one.
        for e in ring.events.iter_mut() {
            if *e != 0 {
                let _ = real!(cuEventDestroy_v2, *e as CUevent);
                *e = 0;
            }
        }
        ring.clear();
        ring.ctx = ctx;
        // The setting, read once here, not at every probe.
        ring.pace.hold_ns = settings().pace_hold_ns;
    }
    // Under parking each probe is followed by a wait on the gate word (`park.rs`).
    let word = if crate::park::enabled() {
        g.park_word.load(Ordering::Relaxed)
    } else {
        0
    };
    let until_deadline = g
        .deadline_precise
        .load(Ordering::Acquire)
        .saturating_sub(now);
    let limits = ahead::Limits {
        bound_ns: bound,
        until_deadline_ns: until_deadline,
        early_ns: settings().early_ahead_ns,
        sole_ns: if g.renewals_in_row.load(Ordering::Relaxed) >= SOLE_AFTER_RENEWALS {
            settings().sole_ahead_ns
        } else {
            0
        },
        handover_ns: settings().handover_ahead_ns,
    };
    let mut ev = ProbeEvents {
        g,
        stream,
        word,
        events: ring.events,
        after: ring.after,
        gated: ring.gated,
    };
    let waited = ring.probe(now, limits, &mut ev);
    (ring.events, ring.after, ring.gated) = (ev.events, ev.after, ev.gated);
    g.probe_every.store(ring.every_ns(bound), Ordering::Relaxed);
    g.precise_every.store(
        if ring.gpu_behind() || ring.unpaced_start() {
            1
        } else {
            PRECISE_EVERY
        },
        Ordering::Relaxed,
    );
    if waited > 0 {
        g.last_probe.store(now + waited, Ordering::Relaxed);
    }
    waited
}

/// The queue-ahead ring's events (`ahead::Events`) on the driver: made on first use in the
/// ring's context, timed (the ring reads the GPU time between two passed probes), each followed
/// under parking by a wait on the gate word.
struct ProbeEvents<'a> {
    g: &'a Gpu,
    stream: CUstream,
    word: u64,
    /// The ring's events, with those made here, for the ring to keep.
    events: [usize; ahead::RING],
    after: [usize; ahead::RING],
    gated: [bool; ahead::RING],
}

impl ahead::Events for ProbeEvents<'_> {
    fn query(&mut self, slot: usize) -> ahead::Done {
        match real!(cuEventQuery, self.events[slot] as CUevent) {
            CUDA_SUCCESS => ahead::Done::Yes,
            CUDA_ERROR_NOT_READY => ahead::Done::NotYet,
            _ => ahead::Done::Broken,
        }
    }

    fn sync(&mut self, slot: usize) -> ahead::Done {
        if self.word != 0 {
            // Parked at the hold's end, the work behind this probe needs no waiting for.
            return crate::park::wait_in_hold(self.events[slot], self.g);
        }
        if real!(cuEventSynchronize, self.events[slot] as CUevent) == CUDA_SUCCESS {
            ahead::Done::Yes
        } else {
            ahead::Done::Broken
        }
    }

    fn record(&mut self, slot: usize) -> bool {
        let mut e = self.events[slot] as CUevent;
        if e.is_null() {
            if real!(cuEventCreate, &mut e, CU_EVENT_DEFAULT) != CUDA_SUCCESS {
                return false;
            }
            self.events[slot] = e as usize;
        }
        if real!(cuEventRecord, e, self.stream) != CUDA_SUCCESS {
            return false;
        }
        self.gated[slot] = self.word != 0
            && crate::park::wait_after_probe(self.word, self.stream, &mut self.after[slot]);
        true
    }

    fn elapsed_ns(&mut self, from: usize, to: usize) -> Option<u64> {
        elapsed_ns(self.events[from], self.events[to])
    }

    fn now(&mut self) -> u64 {
        precise_ns()
    }
}

/// The GPU time between two passed timed events (None: not both passed, or not timed).
fn elapsed_ns(from: usize, to: usize) -> Option<u64> {
    let mut ms = 0f32;
    (from != 0
        && to != 0
        && real!(cuEventElapsedTime, &mut ms, from as CUevent, to as CUevent) == CUDA_SUCCESS
        && ms >= 0.0)
        .then(|| (f64::from(ms) * 1e6) as u64)
}

pub(crate) fn capturing(stream: CUstream) -> bool {
    let mut status: c_int = 0;
    real!(cuStreamIsCapturing, stream, &mut status) == CUDA_SUCCESS && status != 0
}

#[cold]
fn acquire(dev: usize, stream: CUstream) {
    // A launch into a stream being captured into a graph runs nothing now: let it through
    // (and never synchronise during a capture). The graph's replay is gated.
    if capturing(stream) {
        return;
    }
    // The context this thread launches in is drained at hand-overs from now on.
    note_context(current_ctx() as CUcontext);
    let g = gpu(dev);
    let mut t = lock(&g.token);
    if t.ahead.is_some() {
        match launch_ahead(dev, g, &mut t, stream) {
            GatedLaunch::Goes => return,
            GatedLaunch::Granted => {
                // Unlocked: the idle thread may tell gem-schd of the quota's end meanwhile.
                drop(t);
                if bound_gated_work(g, stream) {
                    return;
                }
                t = lock(&g.token);
            }
            GatedLaunch::AskAgain => {}
        }
    }
    loop {
        let now = coarse_ns();
        if g.may_launch(now) {
            g.last_launch.store(now, Ordering::Relaxed);
            return; // another thread renewed it, or the device runs unmanaged for now
        }
        let (overuse_us, burst_us) = if g.holding.load(Ordering::Acquire) {
            crate::timing::report(dev, &mut t);
            let noticed = precise_ns();
            if let Some(quota_us) = renew(dev, g, &mut t) {
                start_hold(dev, g, &mut t, quota_us, true);
                debug!("device {dev}: hold renewed for {quota_us} µs, nothing drained");
                return;
            }
            let r = end_hold(dev, g, &mut t, noticed);
            crate::um::on_hold_end(dev);
            r
        } else {
            (
                std::mem::take(&mut t.expired_overuse_us),
                std::mem::take(&mut t.idle_burst_us),
            )
        };
        if t.client.is_none() {
            t.client = connect(dev, Purpose::Token);
            if t.client.is_none() {
                g.set_deadlines(coarse_ns() + BYPASS_NS, 0);
                return;
            }
        }
        crate::timing::report(dev, &mut t);
        let Some(c) = t.client.as_mut() else { continue };
        let asked = precise_ns();
        let gated = crate::gate::usable(c);
        let got = match request_token(dev, c, overuse_us, burst_us, gated) {
            Ok(Got::Grant(quota_us)) => Ok(quota_us),
            Ok(Got::Soon) => {
                // The allowance counts from here: the wait for Soon is no launching.
                let allowance = crate::gate::allowance_ns(g.ahead.try_lock().ok().as_deref());
                let now = precise_ns();
                t.ahead = Some(crate::gate::Ahead::new(now, allowance, overuse_us));
                if crate::gate::hold_back(&mut t, stream, now) {
                    debug!("device {dev}: told Soon; launches queue behind the gate");
                    return;
                }
                t.ahead = None;
                match t.client.as_mut() {
                    Some(c) => await_grant(dev, c),
                    None => continue,
                }
            }
            Err(e) => Err(e),
        };
        match got {
            Ok(quota_us) => {
                granted(dev, g, &mut t, quota_us, stream);
                debug!(
                    "device {dev}: granted {quota_us} µs after waiting {} µs (reported overuse {overuse_us} µs)",
                    (t.grant_ns - asked) / 1000,
                );
                return;
            }
            Err(e) => {
                if no_token(dev, g, &mut t, e) {
                    return;
                }
            }
        }
    }
}

/// What became of a launch while launches queued behind the gate ([`launch_ahead`]).
enum GatedLaunch {
    /// It goes on: behind the gate, or unmanaged for a while (`no_token`).
    Goes,
    /// Its Grant was read, starting the hold: it goes on once [`bound_gated_work`] says so.
    Granted,
    /// The connection failed meanwhile (the queued work was let go, `GatePage::release`).
    AskAgain,
}

/// A launch while launches queue behind the gate (`gate.rs`): starts the hold if the Grant
/// has come, holds the launch back behind the gate while the allowance lasts, or else waits
/// for the Grant.
fn launch_ahead(dev: usize, g: &Gpu, t: &mut Token, stream: CUstream) -> GatedLaunch {
    let (since, overuse_us) = t
        .ahead
        .as_ref()
        .map_or((0, 0), |a| (a.since_ns, a.reported_overuse_us));
    let got = match t.client.as_mut().map(|c| c.poll_grant()) {
        None => {
            t.ahead = None;
            return GatedLaunch::AskAgain;
        }
        Some(Ok(Some(quota_us))) => Ok(quota_us),
        Some(Ok(None)) => {
            if crate::gate::hold_back(t, stream, precise_ns()) {
                return GatedLaunch::Goes;
            }
            match t.client.as_mut() {
                Some(c) => await_grant(dev, c),
                None => return GatedLaunch::AskAgain,
            }
        }
        Some(Err(e)) => Err(Lost(e)),
    };
    match got {
        Ok(quota_us) => {
            granted(dev, g, t, quota_us, stream);
            debug!(
                "device {dev}: granted {quota_us} µs, {} µs after Soon, work queued behind the gate (reported overuse {overuse_us} µs)",
                (t.grant_ns.saturating_sub(since)) / 1000
            );
            GatedLaunch::Granted
        }
        Err(e) => {
            t.ahead = None;
            if no_token(dev, g, t, e) {
                GatedLaunch::Goes
            } else {
                GatedLaunch::AskAgain
            }
        }
    }
}

/// The work queued behind the gate, run from its Grant on, counts against the queue-ahead
/// bound (`ahead.rs`) as work queued in the hold does: a probe is recorded behind it, then the
/// launch that read the Grant probes as any launch, waiting for the GPU where more is queued
/// than the bound lets stay. False when the hold ended meanwhile: that launch asks for the
/// token, as one that waited in the bound past its hold does (`pass`).
///
/// Unprobed, the gated work and the launch that read the Grant counted as one probe
/// interval's work at the next probe: through the fake driver a tenant of 20 ms kernels ran
/// three of them in each 1–5 ms hold (drains of 55–60 ms past its quotas), the next tenant
/// waiting for them all; with the probe, one (16–20 ms).
fn bound_gated_work(g: &Gpu, stream: CUstream) -> bool {
    guard(0, || bound_ahead(g, stream, precise_ns()));
    let waited = guard(0, || bound_ahead(g, stream, precise_ns()));
    waited == 0 || g.may_launch(coarse_ns())
}

/// A Grant read: the gate is opened (gem-schd has done so already; this covers one that did
/// not) and the hold starts, from when gem-schd opened the gate if work was queued behind it.
fn granted(dev: usize, g: &Gpu, t: &mut Token, quota_us: u64, stream: CUstream) {
    start_gated_hold(dev, g, t, quota_us);
    crate::um::on_grant(dev, stream);
}

/// Opens the gate after a Grant was read, ends the queueing ahead and starts the hold, from
/// when it began (`gate::hold_start`).
fn start_gated_hold(dev: usize, g: &Gpu, t: &mut Token, quota_us: u64) {
    let now = precise_ns();
    // Work parked at the last hold's end ran from the gate's opening too.
    let queued = t.ahead.take().is_some() | (std::mem::take(&mut t.parked) != 0);
    if crate::park::enabled() {
        let word = crate::gate::device_addr(t).unwrap_or(0);
        g.park_word.store(word, Ordering::Relaxed);
    }
    let mut since = now;
    if let Some(p) = t.client.as_ref().and_then(|c| c.gate()) {
        let at = p.opened_at();
        p.open();
        since = crate::gate::hold_start(now, queued.then_some(at));
    }
    start_hold_from(dev, g, t, quota_us, since, false);
}

/// The idle thread's part while launches queue behind the gate: a process blocked in its own
/// synchronisation launches nothing that would read the Grant, so it is read here and the hold
/// starts (its expiry and idle release then apply as to any hold).
pub(crate) fn take_grant_queued_ahead(dev: usize) {
    let g = gpu(dev);
    let Ok(mut t) = g.token.try_lock() else {
        return; // a launching thread has it, and reads the Grant itself
    };
    if t.ahead.is_none() {
        return;
    }
    let polled = match t.client.as_mut() {
        Some(c) => c.poll_grant(),
        None => return,
    };
    let overuse_us = t.ahead.as_ref().map_or(0, |a| a.reported_overuse_us);
    match polled {
        Ok(Some(quota_us)) => {
            // The gate is already open and work queued behind it runs: the launching stream
            // of the hold's first launch is not known here (unified-memory mode has no gate).
            start_gated_hold(dev, g, &mut t, quota_us);
            debug!(
                "device {dev}: granted {quota_us} µs while no launch came; read by the idle thread (reported overuse {overuse_us} µs)"
            );
        }
        Ok(None) => {}
        Err(e) => {
            t.ahead = None;
            no_token(dev, g, &mut t, Lost(e));
        }
    }
}

/// With the debug log: how late the quota's end was noticed and what the queue-ahead bound
/// thought was queued then (`ahead.rs`), beside the drain the next request reports, to tell a
/// late notice, a misjudged pace and work the probes never saw apart.
fn log_queue_at_quota_end(dev: usize, g: &Gpu, t: &Token, noticed: u64) {
    if !crate::log::enabled(crate::log::DEBUG) {
        return;
    }
    let late_us = noticed.saturating_sub(t.grant_ns) / 1000;
    let late_us = late_us.saturating_sub(t.quota_us);
    match g.ahead.try_lock() {
        Ok(r) => debug!(
            "device {dev}: quota over {late_us} µs ago; queue bound: {} probes pending, ~{} µs of GPU work at a pace of {:.1}",
            r.pending(),
            r.pending_gpu_ns() / 1000,
            r.pace.ratio()
        ),
        Err(_) => debug!("device {dev}: quota over {late_us} µs ago; queue bound busy"),
    }
}

/// After a token request ended without a grant: reconnect (the next round of the caller's
/// loop) or, under `KUBESHARE_ON_UNREACHABLE=run` with gem-schd hung, run unmanaged for a
/// while. True when the launch may go now.
fn no_token(dev: usize, g: &Gpu, t: &mut Token, e: NoToken) -> bool {
    match e {
        Hung => {
            drop_client(&mut t.client, &g.token_fd);
            if settings().on_unreachable == Unreachable::Run {
                info!("device {dev}: gem-schd does not answer; running unmanaged for a while");
                g.set_deadlines(coarse_ns() + BYPASS_NS, 0);
                return true;
            }
            info!("device {dev}: gem-schd does not answer; reconnecting (launches wait)");
        }
        Lost(e) => {
            note_refusal(&e);
            info!("device {dev}: token request failed: {e}; reconnecting");
            drop_client(&mut t.client, &g.token_fd);
        }
    }
    false
}

/// After this many renewals in a row a process is taken to keep the GPU for a while: one
/// renewal can fall in a neighbour's pause between its requests, two in a row span at least two
/// quotas that nobody else took. A renewal whose Grant says that the token is expected to go to
/// another client at its end (gem-proto `GatePage::handover_due`) starts the count again, so
/// the queue narrows toward that end. One beside a waiting client that will not go then (held
/// back by its limit, or further behind in the ranking) counts: left out, the queue narrowed at
/// each such deadline, and a GPU-bound tenant at 0.7 beside one at 0.3 (in turns) ran 0.659 of
/// its native rate on an H200, 0.676 with them counted (same host).
const SOLE_AFTER_RENEWALS: u32 = 2;

/// Starts (or, `renewed`, renews) the hold gem-schd granted for `quota_us` from now: the
/// deadlines the gate reads; returns the coarse one.
pub(crate) fn start_hold(dev: usize, g: &Gpu, t: &mut Token, quota_us: u64, renewed: bool) -> u64 {
    let now = precise_ns();
    if renewed {
        // The renewed hold's time so far, reported with the next Busy.
        t.held_ns += now.saturating_sub(t.grant_ns);
    }
    start_hold_from(dev, g, t, quota_us, now, renewed)
}

/// [`start_hold`] of a hold that began at `since_ns` (precise clock, not after now).
fn start_hold_from(
    dev: usize,
    g: &Gpu,
    t: &mut Token,
    quota_us: u64,
    since_ns: u64,
    renewed: bool,
) -> u64 {
    crate::timing::granted(g);
    crate::cupti::resumed(dev, precise_ns().saturating_sub(since_ns));
    crate::park::new_hold(g);
    t.grant_ns = since_ns;
    t.quota_us = quota_us;
    let handover_due = t
        .client
        .as_ref()
        .and_then(|c| c.gate())
        .is_some_and(|p| p.handover_due());
    let renewals = if renewed && !handover_due {
        g.renewals_in_row.load(Ordering::Relaxed).saturating_add(1)
    } else {
        0
    };
    g.renewals_in_row.store(renewals, Ordering::Relaxed);
    g.hold_end
        .store(t.grant_ns + quota_us * 1000, Ordering::Release);
    g.holding.store(true, Ordering::Release);
    let now = coarse_ns();
    g.last_launch.store(now, Ordering::Relaxed);
    let (mut coarse, precise) = deadlines(
        t.grant_ns,
        now,
        quota_us,
        coarse_resolution_ns(),
        settings().precise_deadline,
    );
    // The queue-ahead bound (`ahead.rs`) covers the whole hold: on the coarse clock alone a
    // burst launched in the hold's first ticks queued unprobed (18 ms past a 5 ms grant
    // through the fake driver; on an H200, a `TransformerEncoder` training step whose average
    // pace read below 2 queued 20 ms that way while the probes said 0.7 ms). The precise
    // stretch costs a launch ~8 ns more.
    if precise != 0 && settings().max_ahead_ns > 0 {
        coarse = now;
    }
    g.set_deadlines(coarse, precise);
    state().devices_seen.fetch_max(dev + 1, Ordering::Relaxed);
    crate::idle::start_idle_thread();
    coarse
}

/// At a quota's end, before draining: asks gem-schd to renew the hold (`Request::Renew`).
/// `Some(quota)`: the hold goes on, the work queued stays queued and the GPU never idles
/// for the hand-over; `None`: drain and ask as usual (another client waits, the limit or
/// pacing says wait, renewal is off, or the connection failed).
pub(crate) fn renew(dev: usize, g: &Gpu, t: &mut Token) -> Option<u64> {
    if !settings().renew || crate::connect::refused(gem_proto::kind::RENEW) {
        return None;
    }
    let used_us = precise_ns().saturating_sub(t.grant_ns) / 1000;
    let burst_us = used_us.min(t.quota_us);
    let c = t.client.as_mut()?;
    match c.renew(burst_us) {
        Ok(r) => r,
        Err(e) => {
            note_refusal(&e);
            info!("device {dev}: renewing the hold failed: {e}; draining and asking again");
            // gem-schd closes a connection after a frame it cannot read (and ends the hold).
            drop_client(&mut t.client, &g.token_fd);
            None
        }
    }
}

/// The hold ends at its quota and the process stops launching: before draining, tell gem-schd,
/// which may hand the token on at once (the next process wakes up and launches while the drain
/// runs; the report after the drain charges it). A Renew answered Yield has told it already,
/// so only a process that does not renew sends Drain (`KUBESHARE_HOOK_RENEW=0`); a gem-schd
/// that refused Renew is older than Drain too. No reply: a refusal arrives with the next one.
pub(crate) fn notice_drain(dev: usize, g: &Gpu, t: &mut Token) {
    if settings().renew || crate::connect::refused(gem_proto::kind::DRAIN) {
        return;
    }
    let Some(c) = t.client.as_mut() else { return };
    if let Err(e) = c.drain() {
        note_refusal(&e);
        info!("device {dev}: the drain notice failed: {e}; reconnecting");
        drop_client(&mut t.client, &g.token_fd);
    }
}

/// Why a token request ended without a grant.
enum NoToken {
    /// gem-schd answered neither the request nor a liveness probe within the I/O timeout.
    Hung,
    /// The connection failed (gem-schd restarted, refused, closed).
    Lost(ClientError),
}
use NoToken::{Hung, Lost};

/// What a wait for the token ended with.
enum Got {
    Grant(u64),
    /// Soon, on a connection whose launches may queue behind its gate.
    Soon,
}

/// Sends a TokenRequest (the gate closed first: the process's earlier work has drained) and
/// waits for the Grant, or, `gated`, for a Soon.
fn request_token(
    dev: usize,
    c: &mut Client,
    overuse_us: u64,
    burst_us: u64,
    gated: bool,
) -> Result<Got, NoToken> {
    if let Some(p) = c.gate() {
        p.close();
    }
    c.send_token_request(overuse_us, burst_us).map_err(Lost)?;
    if gated {
        await_grant_or_soon(dev, c)
    } else {
        await_grant(dev, c).map(Got::Grant)
    }
}

/// Waits for the Grant of the TokenRequest sent before; a Soon before it makes the thread poll
/// for the Grant a while (`KUBESHARE_HOOK_SOON_SPIN_US`). A wait longer than the I/O timeout is legitimate (other
/// clients hold the token, this one is at its limit), so on each timeout gem-schd is probed on
/// the memory connection: alive, the wait goes on; silent, it is hung.
fn await_grant(dev: usize, c: &mut Client) -> Result<u64, NoToken> {
    let spin = Duration::from_nanos(settings().soon_spin_ns);
    awaiting(dev, c, |c| c.wait_grant_spinning(spin))
}

/// [`await_grant`], but a Soon ends the wait too (a gated connection queues launches then).
fn await_grant_or_soon(dev: usize, c: &mut Client) -> Result<Got, NoToken> {
    awaiting(dev, c, |c| {
        c.wait_grant_or_soon().map(|w| match w {
            gem_proto::Wait::Grant(q) => Got::Grant(q),
            gem_proto::Wait::Soon => Got::Soon,
        })
    })
}

/// Runs `wait` until it answers, probing gem-schd at each timeout (see [`await_grant`]).
fn awaiting<T>(
    dev: usize,
    c: &mut Client,
    mut wait: impl FnMut(&mut Client) -> Result<T, ClientError>,
) -> Result<T, NoToken> {
    loop {
        match wait(c) {
            Ok(got) => return Ok(got),
            Err(e) if e.is_timeout() => {
                if crate::memory::probe(dev) {
                    continue;
                }
                return Err(Hung);
            }
            Err(e) => return Err(Lost(e)),
        }
    }
}

/// Ends a hold whose quota ran out, noticed at `noticed` (precise clock) in the launching
/// thread: stops launches, tells gem-schd (`notice_drain`), and parks the queued work
/// (`park.rs`) or waits for it. Returns (overuse, burst) to report with the next request.
fn end_hold(dev: usize, g: &Gpu, t: &mut Token, noticed: u64) -> (u64, u64) {
    g.stop_launches();
    notice_drain(dev, g, t);
    log_queue_at_quota_end(dev, g, t, noticed);
    if crate::park::park(g, t) {
        debug!(
            "device {dev}: quota over {} µs ago; the queue parked behind the gate",
            (precise_ns().saturating_sub(t.grant_ns) / 1000).saturating_sub(t.quota_us)
        );
    } else {
        drain(dev);
        // Nothing of the process runs on the device until its next hold.
        crate::cupti::idle(dev);
    }
    g.holding.store(false, Ordering::Release);
    let used_ns = precise_ns().saturating_sub(t.grant_ns);
    t.held_ns += used_ns;
    let used_us = used_ns / 1000;
    // The burst was cut by the quota, not ended by the program: report the quota as its
    // length, so that a busy tenant's quota estimate stays put instead of creeping up by each
    // overrun; the overrun itself is reported (and charged) as overuse.
    (used_us.saturating_sub(t.quota_us), used_us.min(t.quota_us))
}
