//! Clocks. The launch fast path compares against a deadline on CLOCK_MONOTONIC_COARSE, which
//! the vDSO serves from memory (no system call, a few ns); in the last coarse tick before the
//! deadline it reads CLOCK_MONOTONIC (also the vDSO, a TSC read), so that a hold ends at its
//! quota and not up to a tick early or late; accounting uses the precise clock.

use std::sync::atomic::{AtomicU64, Ordering};

/// CLOCK_MONOTONIC_COARSE in nanoseconds (resolution: one kernel tick, 1–4 ms).
#[inline]
pub fn coarse_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC_COARSE)
}

/// CLOCK_MONOTONIC in nanoseconds.
#[inline]
pub fn precise_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// Resolution of CLOCK_MONOTONIC_COARSE in ns (one kernel tick: 4 ms at 250 Hz), asked once.
pub fn coarse_resolution_ns() -> u64 {
    static RES: AtomicU64 = AtomicU64::new(0);
    let r = RES.load(Ordering::Relaxed);
    if r != 0 {
        return r;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    let rc = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    // Unknown: assume the coarsest common tick (100 Hz); it only widens the precise stretch.
    let r = if rc == 0 {
        (ts.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec as u64)
            .max(1)
    } else {
        10_000_000
    };
    RES.store(r, Ordering::Relaxed);
    r
}

/// The two deadlines of a hold granted `quota_us` at precise time `grant_ns` (coarse time
/// `coarse_now`): (coarse, precise). Launches pass while the coarse clock reads less than the
/// first; after it, while the precise clock reads less than the second (0: no second check).
/// Precise: the coarse deadline is two resolutions before the precise one, or more if the
/// coarse clock trailed further at the grant: the coarse clock is only updated at a tick, and a
/// tick can come late (on a 2-core VM with a 4 ms tick it trailed by 6.2 ms after the thread
/// had slept in its token wait), so one resolution let launches pass up to 2 ms after the
/// precise deadline. Not precise: the coarse clock alone, `quota` after the coarse
/// time of the grant, which on a 4 ms tick ends a 5 ms hold after 1–9 ms.
pub fn deadlines(
    grant_ns: u64,
    coarse_now: u64,
    quota_us: u64,
    res_ns: u64,
    precise: bool,
) -> (u64, u64) {
    let q = quota_us.saturating_mul(1000);
    if precise {
        let p = grant_ns.saturating_add(q).max(1);
        let trail = grant_ns.saturating_sub(coarse_now);
        let margin = res_ns.saturating_mul(2).max(trail.saturating_add(res_ns));
        (p.saturating_sub(margin), p)
    } else {
        (coarse_now.saturating_add(q), 0)
    }
}

#[inline]
fn read(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; these clocks always exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precise_deadlines_end_a_hold_at_its_quota() {
        // Granted 20 ms at precise 100 ms, coarse clock 97 ms, 4 ms tick: the last two ticks
        // are checked on the precise clock.
        let (c, p) = deadlines(100_000_000, 97_000_000, 20_000, 4_000_000, true);
        assert_eq!((c, p), (112_000_000, 120_000_000));
        // The coarse clock trailing by more than a tick at the grant widens that stretch.
        let (c, p) = deadlines(100_000_000, 93_000_000, 20_000, 4_000_000, true);
        assert_eq!((c, p), (109_000_000, 120_000_000));
        // Not precise: on the coarse clock only, from the coarse time of the grant.
        assert_eq!(
            deadlines(100_000_000, 97_000_000, 5_000, 4_000_000, false),
            (102_000_000, 0)
        );
        // A 5 ms grant: every launch reads the precise clock.
        assert_eq!(
            deadlines(100_000_000, 97_000_000, 5_000, 4_000_000, true),
            (97_000_000, 105_000_000)
        );
        // A quota shorter than a tick: the coarse deadline is already past.
        assert_eq!(
            deadlines(100_000_000, 97_000_000, 1_000, 4_000_000, true),
            (93_000_000, 101_000_000)
        );
    }

    #[test]
    fn coarse_resolution_is_known_and_below_a_second() {
        let r = coarse_resolution_ns();
        assert!((1..1_000_000_000).contains(&r), "{r}");
    }

    #[test]
    fn coarse_trails_precise_by_at_most_a_tick() {
        let c = coarse_ns();
        let p = precise_ns();
        assert!(c <= p + 1_000_000);
        assert!(p - c < 20_000_000, "coarse clock {c} vs precise {p}");
    }
}
