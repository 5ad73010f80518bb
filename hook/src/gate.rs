//! Launches queued ahead of a Grant, behind the token connection's gate word (gem-proto
//! `gate.rs`).
//!
//! gem-schd tells a waiting connection Soon when the holder drains and the token comes to it
//! next. With a gate page, the launching thread then does not block for the Grant: the launch
//! goes on, its stream first told to wait (`cuStreamWaitValue32`) until the gate word is set,
//! which gem-schd does just before it sends the Grant. So the GPU starts this process's work
//! as the token comes, without waiting for this thread to wake up, read the Grant and launch
//! (on an H200, 0.23 ms from one process's last kernel to the next one's first when the next
//! is woken on the host, 0.147 ms behind such a word, `hack/gpu/handover_wait.cu`). Launches
//! queue so, each stream told to wait once, while they bring up to
//! `KUBESHARE_HOOK_GATE_AHEAD_US` of GPU work at the pace the queue-ahead bound measured (and
//! at most [`MAX_LAUNCHES`]); then the thread blocks for the Grant as before. The Grant, read by a later launch or
//! by the idle thread, starts the hold. The word is cleared before every TokenRequest (the
//! process's earlier work has drained by then) and set by the hook too when it reads a Grant,
//! so a gem-schd that never sets it delays the queued work, never holds it.
//!
//! Not with unified-memory mode (its grant prefetches before the hold's kernels) nor inside a
//! graph capture (a capture runs nothing now).

use crate::config::settings;
use crate::device::current_ctx;
use crate::state::Token;
use crate::{info, real};
use cuda_abi::*;
use gem_proto::Client;
use std::sync::atomic::{AtomicBool, Ordering};

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(
        cuStreamWaitValue32_v2,
        cuMemHostRegister_v2,
        cuMemHostGetDevicePointer_v2,
    );
}

/// Streams told to wait in one queueing ahead, at most: past it the thread waits for the Grant.
const MAX_STREAMS: usize = 16;
/// Launches queued in one queueing ahead, at most, whatever the pace: until the queue-ahead
/// bound has measured how much GPU work a launch brings, a program far ahead of the GPU could
/// otherwise queue its whole allowance of launching in long kernels (through the fake driver,
/// 1 ms kernels launched at a few µs each queued tens of ms behind the gate).
const MAX_LAUNCHES: u32 = 16;

/// One queueing ahead of a Grant.
pub struct Ahead {
    /// When it began (precise ns).
    pub since_ns: u64,
    /// How long launches may queue, in ns of launching: the allowance's GPU time at the pace
    /// the queue-ahead bound measured (`Ring::launching_for`).
    allowance_ns: u64,
    launches: u32,
    /// (context, stream) pairs told to wait on the gate so far.
    streams: Vec<(usize, usize)>,
    /// The overuse the TokenRequest reported (for the log line of its Grant).
    pub reported_overuse_us: u64,
}

impl Ahead {
    /// Queueing ahead from `since_ns`, for launches that bring `allowance_ns` of launching,
    /// after a TokenRequest that reported `reported_overuse_us`.
    pub fn new(since_ns: u64, allowance_ns: u64, reported_overuse_us: u64) -> Ahead {
        Ahead {
            since_ns,
            allowance_ns,
            launches: 0,
            streams: Vec::with_capacity(4),
            reported_overuse_us,
        }
    }
}

/// Set once the driver refused the page or a wait on it: from then on this process blocks
/// for every Grant, as without a gate.
static BROKEN: AtomicBool = AtomicBool::new(false);

/// Whether a wait on `c` may queue launches ahead when Soon comes.
pub(crate) fn usable(c: &Client) -> bool {
    settings().gate_ahead_ns > 0 && c.gate().is_some() && !BROKEN.load(Ordering::Relaxed)
}

/// The launching time that brings `KUBESHARE_HOOK_GATE_AHEAD_US` of GPU work at the pace the
/// queue-ahead bound measured: a program far ahead of the GPU queues that much GPU time behind
/// the gate, not that much of its own launching.
pub(crate) fn allowance_ns(ring: Option<&crate::ahead::Ring>) -> u64 {
    let gpu_ns = settings().gate_ahead_ns;
    ring.map_or(gpu_ns, |r| r.launching_for(gpu_ns))
}

/// Holds back the launch about to go on `stream` at `now_ns` until the gate opens: its stream
/// is told to wait for the word, once per queueing ahead. False when it cannot be (the
/// allowance is spent, no gate, the driver refused, too many streams): the caller waits for
/// the Grant instead.
pub(crate) fn hold_back(t: &mut Token, stream: CUstream, now_ns: u64) -> bool {
    let key = (current_ctx(), stream as usize);
    match t.ahead.as_mut() {
        Some(a)
            if a.launches >= MAX_LAUNCHES
                || (a.launches > 0 && now_ns.saturating_sub(a.since_ns) >= a.allowance_ns) =>
        {
            return false;
        }
        Some(a) if a.streams.contains(&key) => {
            a.launches += 1;
            return true;
        }
        Some(a) if a.streams.len() < MAX_STREAMS => {}
        _ => return false,
    }
    // Behind work parked at the last hold's end (`park.rs`) a launch waits already; a wait of
    // its own there would be one the parking at this hold's end does not know of.
    if t.parked != (stream as usize).wrapping_add(1) {
        let Some(word) = device_addr(t) else {
            return false;
        };
        let rc = wait_until_open(stream, word);
        if rc != CUDA_SUCCESS {
            BROKEN.store(true, Ordering::Relaxed);
            info!(
                "waiting on the gate failed (CUresult {rc}); blocking for each Grant from now on"
            );
            return false;
        }
    }
    if let Some(a) = t.ahead.as_mut() {
        a.streams.push(key);
        a.launches += 1;
    }
    true
}

/// Tells `stream` to wait on the GPU until the gate word at device address `word` is open
/// (1: set by gem-schd at each Grant, by the hook when it reads one or drops the connection).
pub(crate) fn wait_until_open(stream: CUstream, word: CUdeviceptr) -> CUresult {
    real!(
        cuStreamWaitValue32_v2,
        stream,
        word,
        1,
        CU_STREAM_WAIT_VALUE_GEQ
    )
}

/// When a hold whose Grant was read at `now_ns` began: when gem-schd opened the gate for it
/// (`stamp`, given if launches were queued behind it: they ran from then, however late this
/// process read the Grant; counted from the read, the hold and the overuse it reports would
/// miss that time), else `now_ns`. A stamp ahead of now (another clock: a time namespace) or
/// more than a second old (an earlier Grant's) is not trusted.
pub fn hold_start(now_ns: u64, stamp: Option<u64>) -> u64 {
    match stamp {
        Some(at) if at <= now_ns && now_ns - at < 1_000_000_000 => at,
        _ => now_ns,
    }
}

/// The device address of the connection's gate word, registering its page with the driver
/// the first time (portable: valid in every context of the process).
pub(crate) fn device_addr(t: &mut Token) -> Option<CUdeviceptr> {
    let page = t.client.as_ref()?.gate()?;
    let addr = page.addr() as usize;
    if t.gate_addr.0 == addr {
        return Some(t.gate_addr.1);
    }
    if BROKEN.load(Ordering::Relaxed) {
        return None;
    }
    let host = addr as *mut std::ffi::c_void;
    let flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
    let rc = real!(cuMemHostRegister_v2, host, page.len(), flags);
    let mut device: CUdeviceptr = 0;
    let rc = if rc == CUDA_SUCCESS {
        real!(cuMemHostGetDevicePointer_v2, &mut device, host, 0)
    } else {
        rc
    };
    if rc != CUDA_SUCCESS {
        BROKEN.store(true, Ordering::Relaxed);
        info!(
            "registering the gate page failed (CUresult {rc}); blocking for each Grant from now on"
        );
        return None;
    }
    // The page stays registered for the process's life: a dropped connection's page may
    // still have work queued behind it (gem-proto `GatePage::release`).
    t.gate_addr = (addr, device);
    Some(device)
}

#[cfg(test)]
mod tests {
    use super::hold_start;

    #[test]
    fn a_hold_queued_ahead_starts_when_the_gate_opened() {
        let now = 5_000_000_000;
        assert_eq!(hold_start(now, Some(now - 3_000_000)), now - 3_000_000);
        assert_eq!(hold_start(now, None), now, "nothing queued ahead");
        assert_eq!(hold_start(now, Some(now + 1)), now, "a stamp ahead of now");
        assert_eq!(
            hold_start(now, Some(now - 2_000_000_000)),
            now,
            "an old stamp"
        );
        assert_eq!(hold_start(now, Some(0)), now, "never stamped");
        assert_eq!(hold_start(5, Some(0)), 0, "a clock near its start");
    }
}
