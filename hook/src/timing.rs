//! Timing a sample of the launches (`busy.rs` keeps the books): an event pair recorded around
//! the launch on its stream, read once the GPU has passed it, and the GPU time measured sent
//! to gem-schd in a Busy frame before each frame that ends or renews a hold.
//!
//! The launch fast path pays one plain load and store of a countdown per launch; the launch
//! that takes it to zero comes here.

use crate::busy::{Elapsed, PAIRS, Pairs, cut_short};
use crate::config::settings;
use crate::device::{capturing, current_ctx};
use crate::real;
use crate::state::{Gpu, Token, lock};
use cuda_abi::*;
use std::sync::MutexGuard;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(
        cuEventCreate,
        cuEventDestroy_v2,
        cuEventRecord,
        cuEventElapsedTime,
    );
}

/// What gem-schd asked for in OptionsOk (0 until it did, or if it wants no reports).
static ASKED: AtomicU32 = AtomicU32::new(0);
/// While nothing is timed, the countdown looks again after this many launches (gem-schd's
/// answer comes with the first connection, after the first launch's countdown).
const OFF_RECHECK: u32 = 1 << 16;

/// gem-schd's OptionsOk: time one launch in about `busy_every` (0 = none). Reports from then
/// on carry the engine time held too, where CUPTI gives it (`cupti.rs`).
pub fn asked(busy_every: u32) {
    ASKED.store(busy_every, Ordering::Relaxed);
    if every() > 0 {
        crate::cupti::start();
    }
}

/// One launch in about this many is timed (0 = none): `KUBESHARE_HOOK_BUSY_EVERY`, or what
/// gem-schd asked for.
pub fn every() -> u32 {
    settings()
        .busy_every
        .unwrap_or_else(|| ASKED.load(Ordering::Relaxed))
}

/// A launch being timed: its start event is recorded; [`end`] records the other.
pub struct Sampling {
    pairs: MutexGuard<'static, Pairs>,
    slot: usize,
    stream: CUstream,
}

/// Called before a launch on `stream` of device `g`: counts it, and times one in about
/// `KUBESHARE_HOOK_BUSY_EVERY`.
#[inline]
pub fn begin(g: &'static Gpu, stream: CUstream) -> Option<Sampling> {
    let n = g.sample_in.load(Ordering::Relaxed);
    if n > 1 {
        g.sample_in.store(n - 1, Ordering::Relaxed);
        return None;
    }
    crate::device::guard(None, || begin_cold(g, stream))
}

#[cold]
fn begin_cold(g: &'static Gpu, stream: CUstream) -> Option<Sampling> {
    // A gem-schd that refused Busy gets no reports: nothing to time them for.
    let every = if REFUSED.load(Ordering::Relaxed) {
        0
    } else {
        every()
    };
    if every == 0 {
        g.sample_in.store(OFF_RECHECK, Ordering::Relaxed);
        return None;
    }
    let launches = u64::from(g.sample_gap.load(Ordering::Relaxed));
    let Ok(mut pairs) = g.busy.try_lock() else {
        // Another thread is timing a launch: these launches go to the next sample.
        g.sample_carry.fetch_add(launches, Ordering::Relaxed);
        g.sample_in.store(every, Ordering::Relaxed);
        g.sample_gap.store(every, Ordering::Relaxed);
        return None;
    };
    let launches = launches + g.sample_carry.swap(0, Ordering::Relaxed);
    let mean = pairs.mean_gap(every, crate::clock::precise_ns());
    let gap = pairs.next_gap(mean);
    g.sample_gap.store(gap, Ordering::Relaxed);
    g.sample_in.store(gap, Ordering::Relaxed);
    let ctx = current_ctx();
    if ctx == 0 || capturing(stream) {
        pairs.skip(launches);
        return None;
    }
    if pairs.ctx != ctx {
        // Events belong to the context they were made in: start over in this one.
        forget(&mut pairs);
        pairs.ctx = ctx;
    }
    // Reading pairs costs a driver call each and one more for the first not passed yet:
    // leave it to the reports (one per hold) unless the ring fills.
    if pairs.pending() >= PAIRS / 2 {
        harvest(&mut pairs);
    }
    let slot = pairs.begin(launches)?;
    let (mut start, mut end) = pairs.events[slot];
    for e in [&mut start, &mut end] {
        if *e == 0 {
            let mut made: CUevent = std::ptr::null_mut();
            if real!(cuEventCreate, &mut made, CU_EVENT_DEFAULT) != CUDA_SUCCESS {
                pairs.abandon(slot);
                return None;
            }
            *e = made as usize;
        }
    }
    pairs.events[slot] = (start, end);
    if real!(cuEventRecord, start as CUevent, stream) != CUDA_SUCCESS {
        pairs.abandon(slot);
        return None;
    }
    Some(Sampling {
        pairs,
        slot,
        stream,
    })
}

/// Called after the launch `s` timed returned `launched`: records the end event.
#[inline]
pub fn end(s: Option<Sampling>, launched: CUresult) {
    if let Some(mut s) = s {
        let (_, end) = s.pairs.events[s.slot];
        if launched != CUDA_SUCCESS
            || real!(cuEventRecord, end as CUevent, s.stream) != CUDA_SUCCESS
        {
            s.pairs.abandon(s.slot);
        }
    }
}

/// Cuts the countdown to the next sample short ([`cut_short`]). The launching threads count it
/// down with plain loads and stores: one racing this may undo the cut (the next report cuts it
/// again) or count a launch twice, which only moves one sample's weight by a launch.
fn sample_next_launch(g: &Gpu) {
    let remaining = g.sample_in.load(Ordering::Relaxed);
    if let Some((gap, countdown)) = cut_short(g.sample_gap.load(Ordering::Relaxed), remaining) {
        g.sample_gap.store(gap, Ordering::Relaxed);
        g.sample_in.store(countdown, Ordering::Relaxed);
    }
}

/// Reads the pairs the GPU has passed: one `cuEventElapsedTime` each, which answers
/// `CUDA_ERROR_NOT_READY` while either event is still ahead of the GPU.
fn harvest(pairs: &mut Pairs) {
    let events = pairs.events;
    pairs.harvest(|slot| {
        let (start, end) = events[slot];
        let mut ms = 0f32;
        match real!(
            cuEventElapsedTime,
            &mut ms,
            start as CUevent,
            end as CUevent
        ) {
            CUDA_SUCCESS => Elapsed::Ms(ms),
            CUDA_ERROR_NOT_READY => Elapsed::NotYet,
            _ => Elapsed::Broken,
        }
    });
}

/// Destroys every pair's events (made in `pairs.ctx`) and forgets the pending ones.
fn forget(pairs: &mut Pairs) {
    for (a, b) in pairs.events.iter_mut() {
        for e in [a, b] {
            if *e != 0 {
                let _ = real!(cuEventDestroy_v2, *e as CUevent);
                *e = 0;
            }
        }
    }
    pairs.clear();
}

/// Set once a gem-schd refused a Busy frame (one older than it): no more reports.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// gem-schd does not know Busy (see `connect::note_refusal`).
pub fn refused() {
    if !REFUSED.swap(true, Ordering::Relaxed) {
        crate::info!("gem-schd does not take Busy reports (an older version); not sending them");
    }
}

/// A grant (a hold or a renewal) starts on device `g`: pairs pending from before measure
/// earlier grants (`Pairs::next_grant`).
pub fn granted(g: &Gpu) {
    if every() == 0 || REFUSED.load(Ordering::Relaxed) {
        return;
    }
    lock(&g.busy).next_grant();
}

/// Before a frame that ends or renews a hold on device `dev`'s token connection: sends
/// gem-schd the GPU time measured since the last report (of launches in this grant, and late,
/// of earlier ones), the hold time it fell in (`Token::held_ns`) and the engine time its
/// contexts there held (`cupti.rs`).
/// A failed send is left to the frame that follows, which fails the same way.
pub fn report(dev: usize, t: &mut Token) {
    if every() == 0 || REFUSED.load(Ordering::Relaxed) {
        return;
    }
    let g = crate::state::gpu(dev);
    let (busy_ns, earlier_ns) = {
        let mut pairs = lock(&g.busy);
        harvest(&mut pairs);
        if pairs.overdue(crate::clock::precise_ns()) {
            sample_next_launch(g);
        }
        pairs.take_busy_ns()
    };
    let held_ns = std::mem::take(&mut t.held_ns);
    let engine_us = crate::cupti::take_us(dev);
    if busy_ns == 0 && held_ns == 0 && earlier_ns == 0 && engine_us.unwrap_or(0) == 0 {
        return;
    }
    if let Some(c) = t.client.as_mut() {
        let _ = c.busy(busy_ns / 1000, held_ns / 1000, earlier_ns / 1000, engine_us);
    }
}
