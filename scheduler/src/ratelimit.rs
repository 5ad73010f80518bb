//! A token bucket (pure: the caller passes the time), for events that only inform: a
//! "GpuAllocated" event per successful bind is useful at a human's pace and is write
//! load on the apiserver (and fan-out to every event watcher) at a backlog's pace.

/// `rate` tokens per second, up to `burst` saved.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate_per_s: f64,
    burst: f64,
    tokens: f64,
    last_ms: u64,
}

impl TokenBucket {
    /// Starts full.
    pub fn new(rate_per_s: f64, burst: u32, now_ms: u64) -> TokenBucket {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            rate_per_s: rate_per_s.max(0.0),
            burst,
            tokens: burst,
            last_ms: now_ms,
        }
    }

    /// Takes a token if one is there at `now_ms` (a clock that went back counts as no time).
    pub fn take(&mut self, now_ms: u64) -> bool {
        let dt = now_ms.saturating_sub(self.last_ms);
        self.last_ms = self.last_ms.max(now_ms);
        self.tokens = (self.tokens + dt as f64 * self.rate_per_s / 1000.0).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn burst_then_rate() {
        let mut b = TokenBucket::new(10.0, 3, 1_000);
        assert!((0..3).all(|_| b.take(1_000)));
        assert!(!b.take(1_000));
        assert!(!b.take(1_099));
        assert!(b.take(1_100), "one token per 100 ms at 10/s");
        assert!(!b.take(1_100));
        // Saved up to the burst only.
        assert_eq!((0..10).filter(|_| b.take(100_000)).count(), 3);
        // A clock going back gives nothing.
        assert!(!b.take(50_000));
    }

    proptest! {
        /// Over any run, at most burst + rate × elapsed tokens are handed out.
        #[test]
        fn never_more_than_burst_plus_rate(rate in 0.0f64..1000.0, burst in 1u32..100,
                                           steps in proptest::collection::vec(0u64..500, 1..300)) {
            let mut b = TokenBucket::new(rate, burst, 0);
            let (mut now, mut taken) = (0u64, 0u64);
            for s in steps {
                now += s;
                taken += u64::from(b.take(now));
            }
            let bound = f64::from(burst) + rate * now as f64 / 1000.0;
            prop_assert!(taken as f64 <= bound + 1e-9, "{taken} > {bound}");
        }
    }
}
