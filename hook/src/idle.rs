//! The hook's background thread: gives the token back (Release) when the process has launched
//! nothing for `KUBESHARE_HOOK_IDLE_MS`, once its queued work is done (waited for on a
//! short-lived thread, `watch_queue`), so an idle tenant does not hold the GPU; ends a hold
//! whose quota ran out while the process was not launching (blocked in its own
//! synchronisation, or busy on the CPU), so that the next holder does not wait for this
//! process's next launch; and notices within 5 ms when gem-schd hangs up during a hold, and
//! stops launches. The launch gate is `device.rs`.

use crate::clock::{coarse_ns, precise_ns};
use crate::config::settings;
use crate::connect::{drop_client, note_refusal};
use crate::device::{drain, exchange_capture_mode, guard, notice_drain, renew, start_hold};
use crate::state::{gpu, state, try_lock};
use crate::{debug, info};
use cuda_abi::*;
use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(crate) fn start_idle_thread() {
    let st = state();
    if st.idle_thread.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gemhook-idle".into())
        .spawn(|| {
            // Its drains must not invalidate a graph capture in another thread.
            let mut mode: c_int = CU_STREAM_CAPTURE_MODE_RELAXED;
            let _ = exchange_capture_mode(&mut mode);
            // It ends expired holds at their quota: woken with the default 50 µs timer slack,
            // later than that by the slack.
            // SAFETY: PR_SET_TIMERSLACK takes a plain integer and affects this thread only.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
            let idle_ns = settings().idle_release_us * 1000;
            // Also the period at which a hang-up of gem-schd is noticed (≤ 5 ms).
            let tick = Duration::from_nanos((idle_ns / 2).clamp(500_000, 5_000_000));
            let me = state() as *const _;
            loop {
                std::thread::sleep(next_wake(tick));
                // In a forked child this thread does not exist; in the parent the state
                // never changes. Stop if it somehow did.
                if !std::ptr::eq(me, state()) {
                    return;
                }
                for dev in 0..state().devices_seen.load(Ordering::Relaxed) {
                    guard((), || crate::device::take_grant_queued_ahead(dev));
                    guard((), || watch_hangup(dev));
                    guard((), || release_if_expired(dev));
                    guard((), || release_if_idle(dev, idle_ns));
                }
            }
        });
    if spawned.is_err() {
        st.idle_thread.store(false, Ordering::Release);
    }
}

/// A holder whose gem-schd went away (killed, restarting) stops launching at once instead of
/// running out its quota: a restarted gem-schd may grant someone else meanwhile. gem-schd
/// sends nothing unasked to a holder, so anything readable (a hang-up, an error frame) means
/// the hold is over, but only under the token lock: a thread that holds it may be waiting for
/// the answer to its Renew, which is readable before that thread reads it. (Polled without the
/// lock, a lone tenant renewing at every quota end through the fake driver took 13–23 of ~340
/// answers in 4 s for hang-ups, and could stop launches in a hold gem-schd had just renewed.)
/// A thread that holds the lock meets a real hang-up in its own exchange.
fn watch_hangup(dev: usize) {
    let g = gpu(dev);
    if !g.holding.load(Ordering::Acquire) {
        return;
    }
    let Some(_t) = try_lock(&g.token) else {
        return;
    };
    if !g.holding.load(Ordering::Acquire) {
        return;
    }
    let fd = g.token_fd.load(Ordering::Acquire);
    if fd < 0 {
        return;
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n > 0
        && p.revents != 0
        && (g.deadline.load(Ordering::Acquire) != 0
            || g.deadline_precise.load(Ordering::Acquire) != 0)
    {
        g.stop_launches();
        info!("device {dev}: gem-schd hung up during a hold; launches stop until a new grant");
    }
}

/// How long after a hold's quota the idle thread ends it when no launch has: a launch in that
/// time ends it the usual way.
const EXPIRY_GRACE_NS: u64 = 20_000;
/// The idle thread's shortest sleep (a hold it could not end yet is looked at again then).
const MIN_NAP_NS: u64 = 50_000;

/// The idle thread's next wake-up: its tick, or sooner when a hold's quota ends sooner.
fn next_wake(tick: Duration) -> Duration {
    let now = precise_ns();
    let mut wake = tick;
    for dev in 0..state().devices_seen.load(Ordering::Relaxed) {
        let g = gpu(dev);
        if g.holding.load(Ordering::Acquire) {
            let at = g.hold_end.load(Ordering::Acquire) + EXPIRY_GRACE_NS;
            wake = wake.min(Duration::from_nanos(at.saturating_sub(now).max(MIN_NAP_NS)));
        }
    }
    wake
}

/// Ends a hold whose quota is over when the process has not launched since: it is blocked in
/// its own synchronisation or busy on the CPU, and the hold would otherwise last until its next
/// launch (or the idle release, 10 ms after its work is done), with the next holder waiting and
/// the GPU idle meanwhile. The queued work is parked (`park.rs`) or drained first, as at any
/// hand-over; the use, overrun included, is reported in the Release (gem-schd charges it), and
/// with the next request, as for a hold a launch ended, the overrun as the overuse (gem-schd
/// learns the drain from it; the charge it already has) and the quota as the burst.
fn release_if_expired(dev: usize) {
    let g = gpu(dev);
    if !g.holding.load(Ordering::Acquire)
        || precise_ns() < g.hold_end.load(Ordering::Acquire) + EXPIRY_GRACE_NS
    {
        return;
    }
    let Some(mut t) = try_lock(&g.token) else {
        return; // a launching thread ends it
    };
    if !g.holding.load(Ordering::Acquire) {
        return;
    }
    // Its work may still run (the process waits in its own synchronisation): renewed, the
    // hold goes on as if a launch had renewed it. Not once its queue was seen drained with
    // nothing launched since: it is idle, not waiting for its work, and renewed it kept the
    // token for as long as it stayed idle (a co-hold every 20 ms, charged and counted as
    // co-running, through a PyTorch tenant's 13 s of profiler teardown on an H200).
    crate::timing::report(dev, &mut t);
    let idle = g.drained_at.load(Ordering::Relaxed) > g.last_launch.load(Ordering::Relaxed);
    if let Some(quota_us) = (!idle).then(|| renew(dev, g, &mut t)).flatten() {
        start_hold(dev, g, &mut t, quota_us, true);
        debug!(
            "device {dev}: hold renewed for {quota_us} µs while the process waits, nothing drained"
        );
        return;
    }
    g.stop_launches();
    notice_drain(dev, g, &mut t);
    let parked = crate::park::park(g, &mut t);
    if !parked {
        let queue = QueueAtBlock::read(g);
        drain(dev);
        if let Some(q) = queue {
            q.log(dev);
        }
    }
    g.holding.store(false, Ordering::Release);
    let used_ns = precise_ns().saturating_sub(t.grant_ns);
    t.held_ns += used_ns;
    crate::timing::report(dev, &mut t);
    let used_us = used_ns / 1000;
    if parked {
        ask_again_parked(dev, g, &mut t, used_us);
        return;
    }
    // Drained: the process runs nothing on the device until its next hold.
    crate::cupti::idle(dev);
    t.idle_burst_us = used_us.min(t.quota_us);
    t.expired_overuse_us = used_us.saturating_sub(t.quota_us);
    if let Some(c) = t.client.as_mut()
        && let Err(e) = c.release(used_us)
    {
        // A refusal of the frame before (a Drain to an older gem-schd) arrives here.
        note_refusal(&e);
        info!("device {dev}: release failed: {e}");
        drop_client(&mut t.client, &g.token_fd);
    }
    debug!(
        "device {dev}: hold expired without a launch; released after {used_us} µs of a {} µs grant",
        t.quota_us
    );
    crate::um::on_hold_end(dev);
}

/// With the debug log, at a hold that ends while its process waits: what the queue-ahead bound
/// (`ahead.rs`) estimated was queued, beside how long the drain took and how long ago the last
/// launch was, so that the estimate can be checked against the GPU.
struct QueueAtBlock {
    at: u64,
    since_launch_ns: u64,
    since_probe_ns: u64,
    pending: usize,
    estimate_ns: u64,
    pace: f64,
    every_launch_precise: bool,
}

impl QueueAtBlock {
    fn read(g: &crate::state::Gpu) -> Option<Self> {
        if !crate::log::enabled(crate::log::DEBUG) {
            return None;
        }
        let r = g.ahead.try_lock().ok()?;
        let at = precise_ns();
        Some(QueueAtBlock {
            at,
            since_launch_ns: coarse_ns().saturating_sub(g.last_launch.load(Ordering::Relaxed)),
            since_probe_ns: at.saturating_sub(g.last_probe.load(Ordering::Relaxed)),
            pending: r.pending(),
            estimate_ns: r.pending_gpu_ns(),
            pace: r.pace.ratio(),
            every_launch_precise: g.precise_every.load(Ordering::Relaxed) == 1,
        })
    }

    fn log(&self, dev: usize) {
        debug!(
            "device {dev}: drained in {} µs at a hold's end while the process waits; last launch {} µs, last probe {} µs before; queue bound: {} probes pending, ~{} µs of GPU work at a pace of {:.2}, precise clock at every launch {}",
            precise_ns().saturating_sub(self.at) / 1000,
            self.since_launch_ns / 1000,
            self.since_probe_ns / 1000,
            self.pending,
            self.estimate_ns / 1000,
            self.pace,
            self.every_launch_precise
        );
    }
}

/// An expired hold whose work is parked behind the gate (`park.rs`) asks for the token again
/// at once instead of releasing it: a thread of the process may be blocked in its own
/// synchronisation on that work, and nothing else would ask. Launches meanwhile queue behind
/// the gate as after a Soon, and the Grant is read by a launch or by this thread
/// (`take_grant_queued_ahead`). The overrun and the quota go with the request, as when a
/// launch ends a hold.
fn ask_again_parked(dev: usize, g: &crate::state::Gpu, t: &mut crate::state::Token, used_us: u64) {
    let overuse_us = used_us.saturating_sub(t.quota_us);
    let burst_us = used_us.min(t.quota_us);
    let Some(c) = t.client.as_mut() else { return };
    if let Err(e) = c.send_token_request(overuse_us, burst_us) {
        // The connection's page is opened as it goes: the parked work runs.
        note_refusal(&e);
        info!("device {dev}: token request after parking failed: {e}; reconnecting");
        drop_client(&mut t.client, &g.token_fd);
        return;
    }
    let allowance = crate::gate::allowance_ns(g.ahead.try_lock().ok().as_deref());
    t.ahead = Some(crate::gate::Ahead::new(precise_ns(), allowance, overuse_us));
    debug!(
        "device {dev}: hold expired without a launch; parked its queue after {used_us} µs of a {} µs grant and asked again",
        t.quota_us
    );
    crate::um::on_hold_end(dev);
}

/// Idle means: no launch for `idle_ns` *after the queued work finished*. A program blocked in
/// its own synchronisation while the GPU runs its burst is busy, not idle, so the queue is
/// first waited for (the token stays valid meanwhile, launches keep passing; `watch_queue`),
/// and the token released only once the GPU has been idle for this process for `idle_ns` with
/// no launch since.
fn release_if_idle(dev: usize, idle_ns: u64) {
    let g = gpu(dev);
    let last = g.last_launch.load(Ordering::Relaxed);
    if !g.holding.load(Ordering::Acquire) || coarse_ns().saturating_sub(last) < idle_ns {
        return;
    }
    let drained = g.drained_at.load(Ordering::Relaxed);
    if drained <= last {
        // Not yet seen drained since the last launch: wait for the queued work, note when.
        watch_queue(dev, last);
        return;
    }
    let Some(mut t) = try_lock(&g.token) else {
        return; // a launching thread is at the gate
    };
    if !g.holding.load(Ordering::Acquire) {
        return;
    }
    if coarse_ns().saturating_sub(drained) < idle_ns {
        return;
    }
    // Idle for long enough: stop launches, make sure nothing slipped in, give the token back.
    g.stop_launches();
    drain(dev);
    if g.last_launch.load(Ordering::Relaxed) != last {
        // A launch raced with the check: it ran on the token still held; the next launch
        // ends the hold the usual way (overuse report and a new request).
        g.set_deadlines(coarse_ns() + 1, 0);
        return;
    }
    g.holding.store(false, Ordering::Release);
    let used_ns = precise_ns().saturating_sub(t.grant_ns);
    t.held_ns += used_ns;
    crate::timing::report(dev, &mut t);
    crate::cupti::idle(dev);
    let used_us = used_ns / 1000;
    // A burst that ended by itself is the program's natural burst: gem-schd learns its
    // quota estimate from it (sent with the next request; Release carries no burst).
    t.idle_burst_us = used_us;
    if let Some(c) = t.client.as_mut()
        && let Err(e) = c.release(used_us)
    {
        // A refusal of the frame before (a Drain to an older gem-schd) arrives here.
        note_refusal(&e);
        info!("device {dev}: release failed: {e}");
        drop_client(&mut t.client, &g.token_fd);
    }
    debug!("device {dev}: idle, released the token after {used_us} µs");
    crate::um::on_hold_end(dev);
}

/// Waits for the work the process queued on `dev`, on a thread of its own, and notes when it
/// was done (`Gpu::drained_at`) if nothing was launched since `last`. Not on the idle thread,
/// nor under the token lock: that wait lasts as long as the process's queue (a training step's
/// queue past its hold runs for tens of ms), and a hold whose quota ends meanwhile must still
/// be ended at its quota (`release_if_expired`, a launch at the gate), its notice letting
/// gem-schd hand the token on while the queue drains. Waited here, the hold ran on until the
/// queue was done, and the next client was granted only then. One such wait at a time; if no
/// thread can be started, the idle thread waits itself.
fn watch_queue(dev: usize, last: u64) {
    let g = gpu(dev);
    if g.queue_watch.swap(true, Ordering::AcqRel) {
        return;
    }
    let wait = move || {
        guard((), || {
            drain(dev);
            if g.last_launch.load(Ordering::Relaxed) == last {
                g.drained_at
                    .store(coarse_ns().max(last + 1), Ordering::Relaxed);
            }
        });
        g.queue_watch.store(false, Ordering::Release);
    };
    let spawned = std::thread::Builder::new()
        .name("gemhook-queue".into())
        .spawn(wait);
    if spawned.is_err() {
        wait();
    }
}
