//! Parking a hold's queued work at its end (`KUBESHARE_HOOK_PARK=1`, off by default).
//!
//! Without it a hold ends with a drain: everything the process queued before its deadline
//! runs after it while the next holder waits. On H200s the drains past the quota were
//! 1.4 ms at the median for training steps whose CPU queues far ahead of the GPU, and most of
//! it was work queued while the hold still had time, at a pace the queue-ahead bound
//! (`ahead.rs`) had misjudged or before the process blocked in its own synchronisation.
//!
//! Parked, that work stays queued on the GPU. Every probe of the queue-ahead bound is
//! followed on its stream by a stream-ordered wait on the connection's gate word (`gate.rs`,
//! open while the process holds the token) and a second event. At the hold's end the hook
//! closes the word: the GPU runs at most to the next such wait and stops there, with
//! everything behind it kept queued until gem-schd opens the word at this process's next
//! Grant; a context blocked on a wait costs the one that runs nothing measurable
//! (`hack/gpu/handover_wait.cu`). The hold ends once the GPU has reached the wait (the probe's
//! event before it is done and the one after it is not), a probe interval's work at most.
//!
//! That test is only sound while no other context runs: beside one, the event behind a wait
//! the GPU passed just before the close can complete later than any short grace, and a hold
//! taken for parked let its work run into the neighbour's turn (an H200 tenant capped at 0.5
//! reached 0.53 in its busiest second). So a parking connection tells gem-schd so (gem-proto
//! `Parks`), and gem-schd never hands the token on at its notice (the Renew answered Yield),
//! only tells the next client Soon: the next holder is granted at this process's report, once
//! the GPU has stopped.
//!
//! For the same reason a hold that gem-schd said may be shared (a co-hold, or a turn that
//! co-holds may run beside: gem-proto `GatePage::shared`) drains. Parking co-holds beside
//! decode on an H200, the misjudged stops let a capped encoder's busiest second reach 0.512 of
//! the GPU at its 0.5 limit.
//!
//! Only where it pays and is safe: the queue is deep (at least [`MIN_PROBES`] probes not yet
//! passed: a shallow queue drains in less time than a stopped GPU costs the process, whose
//! thread may be blocked on that very work until its next turn), one context, every launch of
//! the hold on one stream (a wait on another stream could hold work this one depends on, and
//! the drain's `cuCtxSynchronize` would wait for parked work forever), a gate page, and
//! gem-schd took the `Parks` notice. Otherwise the hold drains as before. A process whose
//! work is parked always has a TokenRequest out, so a thread blocked in its own
//! synchronisation on that work is woken by the Grant; a lost connection opens its word for
//! good (gem-proto `GatePage::release`).

use crate::ahead::Ring;
use crate::state::{Gpu, Token, contexts};
use crate::{info, real};
use cuda_abi::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(cuEventCreate, cuEventRecord, cuEventQuery,);
}

/// Set once the driver refused a wait or an event: from then on holds drain.
static BROKEN: AtomicBool = AtomicBool::new(false);

/// How long after the GPU reached a probe the event behind its wait may take to complete
/// when the wait passed (the word was still open when the GPU read it): the GPU runs a wait
/// and an event record in microseconds.
const PASS_GRACE: Duration = Duration::from_micros(20);

/// Whether holds park their work at the end (the setting, and the driver has not refused).
#[inline]
pub fn enabled() -> bool {
    crate::config::settings().park && !BROKEN.load(Ordering::Relaxed)
}

/// Notes the stream of a launch in the current hold (the launch path; only under parking).
#[inline]
pub fn note_stream(g: &Gpu, stream: CUstream) {
    let key = (stream as usize).wrapping_add(1);
    let first = g.hold_stream.load(Ordering::Relaxed);
    if first != key {
        if first == 0 {
            g.hold_stream.store(key, Ordering::Relaxed);
        } else {
            g.streams_mixed.store(true, Ordering::Relaxed);
        }
    }
}

/// A hold starts: no stream launched on yet.
pub fn new_hold(g: &Gpu) {
    g.hold_stream.store(0, Ordering::Relaxed);
    g.streams_mixed.store(false, Ordering::Relaxed);
}

/// After a probe's event on `stream`: the wait on the gate word at device address `word`
/// and the event after it (`after`, created here when 0). False when not queued (the wait
/// then did not go either, or the probe's slot is not marked gated and parking stops).
pub(crate) fn wait_after_probe(word: u64, stream: CUstream, after: &mut usize) -> bool {
    if *after == 0 {
        let mut e: CUevent = std::ptr::null_mut();
        if real!(cuEventCreate, &mut e, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS {
            return false;
        }
        *after = e as usize;
    }
    let rc = crate::gate::wait_until_open(stream, word);
    if rc != CUDA_SUCCESS {
        BROKEN.store(true, Ordering::Relaxed);
        info!("waiting on the gate behind a probe failed (CUresult {rc}); holds drain from now on");
        return false;
    }
    // Recorded after the wait: if this fails the wait stays queued but is not counted on,
    // and the hold drains as usual (the word is open then).
    if real!(cuEventRecord, *after as CUevent, stream) != CUDA_SUCCESS {
        BROKEN.store(true, Ordering::Relaxed);
        return false;
    }
    true
}

/// The queue-ahead bound's wait for the probe event `event` under parking: polled, and given
/// up (`Done::NotYet`) once the hold's deadline has passed or launches were stopped. Waited
/// for past the deadline, a launching thread noticed the hold's end only after the queue had
/// run down to the bound, which is what the wait is for; once the hold is over, what is still
/// queued is parked at its end instead, and the launch goes on behind it.
pub fn wait_in_hold(event: usize, g: &Gpu) -> crate::ahead::Done {
    use crate::ahead::Done;
    loop {
        match real!(cuEventQuery, event as CUevent) {
            CUDA_SUCCESS => return Done::Yes,
            CUDA_ERROR_NOT_READY => {}
            _ => return Done::Broken,
        }
        let deadline = g.deadline_precise.load(Ordering::Acquire);
        if deadline == 0 || crate::clock::precise_ns() >= deadline {
            return Done::NotYet;
        }
        std::thread::yield_now();
    }
}

/// The fewest probes the GPU has not passed for a hold's end to park rather than drain: about
/// three probe intervals of GPU work (each about half the queue-ahead bound, `ahead.rs`).
/// Parked, the work of a process blocked in its own synchronisation waits for its next turn,
/// and so does its CPU: on an H200 a launch-bound GPT training step beside a decode loop ran
/// 8 % slower parking every hold's end (its drains 0.35 ms at the median), while training
/// steps with milliseconds queued gained.
pub const MIN_PROBES: usize = 3;

/// Ends the hold by parking its queued work behind the gate, if it can be and pays (see the
/// module comment); the caller has stopped launches and the token lock is held. True when
/// parked: the GPU runs none of this process's work until the word opens, and the hold's
/// remaining work waits for the next Grant. False: the caller drains as usual (the word open).
pub fn park(g: &Gpu, t: &mut Token) -> bool {
    if !enabled()
        || g.park_word.load(Ordering::Relaxed) == 0
        || g.streams_mixed.load(Ordering::Relaxed)
        || contexts().len() != 1
    {
        return false;
    }
    let Some(page) = t
        .client
        .as_ref()
        .filter(|c| c.sent_parks())
        .and_then(|c| c.gate())
    else {
        return false;
    };
    if page.shared() {
        // Another context may run beside this hold (co-running): where the GPU stopped could
        // not be told from its time slices.
        return false;
    }
    let Ok(mut ring) = g.ahead.lock() else {
        return false;
    };
    if ring.unpassed_slots().filter(|s| ring.gated[*s]).count() < MIN_PROBES {
        return false;
    }
    page.close();
    std::sync::atomic::fence(Ordering::SeqCst);
    let parked = stop_at_a_wait(&ring);
    if parked {
        // The probes stay pending: the next hold runs their work first, and where it ends
        // before that work does, the GPU stops at one of their waits again.
        ring.stopped();
        t.parked = g.hold_stream.load(Ordering::Relaxed);
    } else {
        // Not stopped at a wait (or the driver failed): the drain must not meet a closed
        // word, and the hold still has the token.
        page.open();
    }
    parked
}

/// With the word closed: waits, oldest probe first, for the GPU to reach a probe whose wait
/// it has not passed, and tells whether it stopped there (true) or passed every wait (false:
/// the work after the last probe has no wait and must drain). Never waits on the driver
/// without a bound: a GPU that does not reach the probe within [`REACH_LIMIT`] is stopped at
/// a wait this ring does not know of, and the caller reopens the word and drains.
fn stop_at_a_wait(ring: &Ring) -> bool {
    let query = |e: usize| real!(cuEventQuery, e as CUevent);
    let start = Instant::now();
    for (i, slot) in ring.unpassed_slots().enumerate() {
        if !ring.gated[slot] {
            continue;
        }
        let after = ring.after[slot];
        match query(after) {
            CUDA_SUCCESS => continue, // passed before the word closed
            CUDA_ERROR_NOT_READY => {}
            _ => return false,
        }
        // The GPU reaches the wait once the probe's own event is done; whatever it reads then
        // decides: the closed word holds it, a read from before the close lets it pass.
        if !reached(ring.events[slot], start) {
            info!(
                "parking: the GPU did not reach probe {i} of {} within {} ms; draining instead",
                ring.unpassed_slots().count(),
                REACH_LIMIT.as_millis()
            );
            return false;
        }
        let since = Instant::now();
        loop {
            match query(after) {
                CUDA_SUCCESS => break,
                CUDA_ERROR_NOT_READY if since.elapsed() < PASS_GRACE => std::hint::spin_loop(),
                CUDA_ERROR_NOT_READY => {
                    crate::debug!(
                        "parking: stopped at probe {i} of {} after {} µs",
                        ring.unpassed_slots().count(),
                        start.elapsed().as_micros()
                    );
                    return true;
                }
                _ => return false,
            }
        }
    }
    false
}

/// The longest a hold's end waits for the GPU to reach a probe: past it the GPU is taken to be
/// stopped at another wait (a training step's whole queue is tens of ms).
const REACH_LIMIT: Duration = Duration::from_millis(50);

/// Polls `event` until it is done (true) or [`REACH_LIMIT`] has passed since `start`, or the
/// driver fails (false).
fn reached(event: usize, start: Instant) -> bool {
    loop {
        match real!(cuEventQuery, event as CUevent) {
            CUDA_SUCCESS => return true,
            CUDA_ERROR_NOT_READY if start.elapsed() < REACH_LIMIT => std::thread::yield_now(),
            _ => return false,
        }
    }
}
