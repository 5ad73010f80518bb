//! Clocks. The launch fast path compares against a deadline on CLOCK_MONOTONIC_COARSE, which
//! the vDSO serves from memory (no system call, a few ns); accounting uses the precise clock.

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
    fn coarse_trails_precise_by_at_most_a_tick() {
        let c = coarse_ns();
        let p = precise_ns();
        assert!(c <= p + 1_000_000);
        assert!(p - c < 20_000_000, "coarse clock {c} vs precise {p}");
    }
}
