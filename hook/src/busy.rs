//! How busy this process keeps the GPU: timing events around a sample of its launches (one in
//! 256 when gem-schd asks for it, `KUBESHARE_HOOK_BUSY_EVERY` to override), reported to gem-schd
//! as GPU time with the hold time it fell in (gem-proto `Busy`).
//!
//! A token hold says when a tenant may launch, not how much of the GPU it used: a batch-1
//! inference tenant launches all through its turns and keeps the GPU ~30 % busy in them, a
//! training step ~95 %. Events around a kernel measure its own context's time even while
//! another context runs beside it (0.18 ms matmuls beside a co-running tenant measured as
//! alone on an H100, issue 14 round 14), so they can account a tenant that does not run in
//! exclusive turns. A timed launch costs ~6 µs of CPU, so only a sample is timed: each sample
//! stands for the launches since the one before it (gaps drawn at random around the mean, so
//! that a program's launch pattern cannot line up with them), and a sample that cannot be taken
//! (all pairs pending, a graph capture, a failed record) hands its launches to the next one.
//!
//! This file is the pure bookkeeping (a ring of pairs, oldest first); `timing.rs` records and
//! reads the events.

/// Pairs in flight at most: at one sample in 256 launches, 16,384 launches of queued work.
pub const PAIRS: usize = 64;

/// A tenant whose launches come slowly is sampled more often than `every` asks, so that a gap
/// spans about this much time (gem-schd judges fills over a few hundred ms of holds): at 1 in
/// 256, a tenant launching 2,000 times a second was sampled every 128 ms and one sample in a
/// 20 ms co-hold read as a fill of 1 (through the fake driver). Fast launchers (batch-1
/// inference on an H100, ~44,000 a second: 256 launches in ~6 ms) keep the asked rate.
pub const GAP_TARGET_NS: u64 = 10_000_000;
/// The fewest launches a gap may stand for.
pub const MIN_GAP: u32 = 8;

/// What reading a pair found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Elapsed {
    /// Both events passed: the kernel between them took this many ms of GPU time.
    Ms(f32),
    /// The end event has not passed yet.
    NotYet,
    /// The events could not be read (destroyed context, driver error).
    Broken,
}

/// The pairs of one device, made in one context.
#[derive(Debug)]
pub struct Pairs {
    /// The context the events were made in (0: none yet).
    pub ctx: usize,
    /// Per slot, the (start, end) event handles (0: not made yet).
    pub events: [(usize, usize); PAIRS],
    weight: [u64; PAIRS],
    /// Per slot, when the launches it stands for began (the CPU clock, ns): their GPU time ran
    /// after that, so a reading counts at most the time from then to when it is read.
    since: [u64; PAIRS],
    /// Per slot, the grant its launch was made in (`grant` then).
    grant_of: [u32; PAIRS],
    /// The current grant (a counter, [`Pairs::next_grant`]).
    grant: u32,
    head: usize,
    len: usize,
    /// Launches that no pending or future pair stands for yet, and when the first of them
    /// began (`u64::MAX`: none).
    carry: u64,
    carry_since: u64,
    /// GPU time read of launches in the current grant, and of launches in earlier ones.
    busy_ns: f64,
    earlier_ns: f64,
    rng: u64,
    /// The mean gap in use (0: not yet set) and when the last gap was drawn.
    mean: u32,
    last_ns: u64,
}

impl Default for Pairs {
    fn default() -> Self {
        Self::new()
    }
}

impl Pairs {
    pub const fn new() -> Self {
        Pairs {
            ctx: 0,
            events: [(0, 0); PAIRS],
            weight: [0; PAIRS],
            since: [0; PAIRS],
            grant_of: [0; PAIRS],
            grant: 0,
            head: 0,
            len: 0,
            carry: 0,
            carry_since: u64::MAX,
            busy_ns: 0.0,
            earlier_ns: 0.0,
            rng: 0x9e37_79b9_7f4a_7c15,
            mean: 0,
            last_ns: 0,
        }
    }

    /// When the last sample was drawn (0: none yet): the launches of the next one begin then.
    pub fn last_sample_ns(&self) -> u64 {
        self.last_ns
    }

    /// The mean gap for the next sample at `now_ns`: `every`, or less (down to [`MIN_GAP`])
    /// while a gap takes more than twice [`GAP_TARGET_NS`]; back up (doubling) while it takes
    /// less than half.
    pub fn mean_gap(&mut self, every: u32, now_ns: u64) -> u32 {
        let since = now_ns.saturating_sub(self.last_ns);
        self.last_ns = now_ns;
        let floor = MIN_GAP.min(every).max(1);
        if self.mean == 0 || self.mean > every {
            self.mean = every;
        }
        if since > 2 * GAP_TARGET_NS {
            self.mean = (self.mean / 2).max(floor);
        } else if since < GAP_TARGET_NS / 2 {
            self.mean = self.mean.saturating_mul(2).min(every);
        }
        self.mean
    }

    /// Launches until the next sample: uniform in `[every / 2, every / 2 + every)`, about
    /// `every` on average (each sample stands for its own gap, so the mean need not be exact).
    pub fn next_gap(&mut self, every: u32) -> u32 {
        // xorshift64: cheap, and only has to be unrelated to the program's launches.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        let every = every.max(2);
        every / 2 + (x % u64::from(every)) as u32
    }

    /// A sample standing for `launches`, made since `since_ns`, is about to be taken: the slot
    /// whose events to record around the launch, or `None` when every pair is pending (the
    /// launches carry over).
    pub fn begin(&mut self, launches: u64, since_ns: u64) -> Option<usize> {
        let launches = launches.saturating_add(std::mem::take(&mut self.carry));
        let since_ns = since_ns.min(std::mem::replace(&mut self.carry_since, u64::MAX));
        if self.len == PAIRS {
            self.carry_over(launches, since_ns);
            return None;
        }
        let slot = (self.head + self.len) % PAIRS;
        self.weight[slot] = launches;
        self.since[slot] = since_ns;
        self.grant_of[slot] = self.grant;
        self.len += 1;
        Some(slot)
    }

    /// The pair just begun in `slot` was not recorded (or its launch failed): its launches
    /// carry over to the next sample.
    pub fn abandon(&mut self, slot: usize) {
        if self.len > 0 && (self.head + self.len - 1) % PAIRS == slot {
            self.len -= 1;
            self.carry_over(self.weight[slot], self.since[slot]);
        }
    }

    /// Launches no sample was taken for (a graph capture, no context), made since `since_ns`:
    /// the next one stands for them.
    pub fn skip(&mut self, launches: u64, since_ns: u64) {
        self.carry_over(launches, since_ns);
    }

    fn carry_over(&mut self, launches: u64, since_ns: u64) {
        self.carry = self.carry.saturating_add(launches);
        self.carry_since = self.carry_since.min(since_ns);
    }

    /// Reads the pending pairs oldest first, up to the first whose end has not passed, at
    /// `now_ns`. A reading stands for its gap's launches (its time × their number), and one
    /// long kernel sampled among short ones read as hundreds of ms (827 ms in a 20 ms co-hold
    /// on an H200, which kept batch-1 inference's fill above the co-running threshold for a
    /// few hundred ms): it counts at most the time since its launches began. (Bounding it by
    /// the time since the last report instead cut GPU-bound tenants' fills by half: a gap
    /// begins before the report its reading comes after.)
    pub fn harvest(&mut self, now_ns: u64, mut elapsed: impl FnMut(usize) -> Elapsed) {
        while self.len > 0 {
            let slot = self.head;
            match elapsed(slot) {
                Elapsed::NotYet => return,
                Elapsed::Ms(ms) => {
                    let ms = if ms.is_finite() {
                        f64::from(ms.max(0.0))
                    } else {
                        0.0
                    };
                    let span = now_ns.saturating_sub(self.since[slot]) as f64;
                    let ns = (ms * 1e6 * self.weight[slot] as f64).min(span);
                    if self.grant_of[slot] == self.grant {
                        self.busy_ns += ns;
                    } else {
                        self.earlier_ns += ns;
                    }
                }
                // Its launches' time is unknown: the next sample stands for them.
                Elapsed::Broken => self.carry_over(self.weight[slot], self.since[slot]),
            }
            self.head = (self.head + 1) % PAIRS;
            self.len -= 1;
        }
    }

    /// A new grant (a hold or a renewal) starts: pairs begun before it measure earlier grants.
    /// gem-schd keeps a fill per kind of hold (a turn, a co-hold), and a pair read after the
    /// report that ended its grant is told apart, so that it counts for the kind it was
    /// launched in: sent with the next grant's report, it counted for that one's kind, and a
    /// GPU-bound tenant whose grants alternated kinds read a fill of 0.007 in its turns
    /// (through the fake driver).
    pub fn next_grant(&mut self) {
        self.grant = self.grant.wrapping_add(1);
    }

    /// The GPU time measured since the last call, in ns: of launches in the current grant, and
    /// of launches in earlier ones.
    pub fn take_busy_ns(&mut self) -> (u64, u64) {
        (
            std::mem::take(&mut self.busy_ns) as u64,
            std::mem::take(&mut self.earlier_ns) as u64,
        )
    }

    /// Pairs begun and not read yet.
    pub fn pending(&self) -> usize {
        self.len
    }

    /// Forgets every pending pair (their context is gone or another one is current; the
    /// caller destroys the events and zeroes `events`); what they stood for carries over.
    pub fn clear(&mut self) {
        while self.len > 0 {
            self.carry_over(self.weight[self.head], self.since[self.head]);
            self.head = (self.head + 1) % PAIRS;
            self.len -= 1;
        }
        self.head = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn gaps_average_the_setting_and_vary() {
        let mut p = Pairs::new();
        let gaps: Vec<u32> = (0..10_000).map(|_| p.next_gap(32)).collect();
        assert!(gaps.iter().all(|g| (16..48).contains(g)));
        let mean = gaps.iter().map(|g| f64::from(*g)).sum::<f64>() / gaps.len() as f64;
        assert!((mean - 31.5).abs() < 0.5, "{mean}");
        assert!(gaps.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn slow_launchers_are_sampled_more_often_and_fast_ones_at_the_asked_rate() {
        let mut p = Pairs::new();
        let ms = 1_000_000u64;
        // 256 launches take 128 ms (2,000 a second): the mean halves down to where a gap
        // takes 10–20 ms (16 launches: 8 ms... 32: 16 ms).
        let mut now = 0;
        let mut mean = p.mean_gap(256, now);
        for _ in 0..20 {
            now += u64::from(mean) * ms / 2;
            mean = p.mean_gap(256, now);
        }
        assert!((16..=32).contains(&mean), "{mean}");
        // Then the tenant launches 44,000 a second: back to 256 within a few gaps.
        for _ in 0..10 {
            now += u64::from(mean) * ms / 44;
            mean = p.mean_gap(256, now);
        }
        assert_eq!(mean, 256);
        // Never below the floor nor above what is asked; a smaller ask takes effect at once.
        for _ in 0..20 {
            now += 1_000 * ms;
            mean = p.mean_gap(256, now);
        }
        assert_eq!(mean, MIN_GAP);
        assert_eq!(p.mean_gap(4, now + 1), 4);
    }

    #[test]
    fn each_read_pair_counts_for_the_launches_it_stands_for() {
        let mut p = Pairs::new();
        let a = p.begin(10, 0).unwrap();
        let b = p.begin(30, 0).unwrap();
        p.harvest(u64::MAX, |s| {
            if s == a {
                Elapsed::Ms(0.5)
            } else {
                Elapsed::NotYet
            }
        });
        assert_eq!(p.take_busy_ns(), (5_000_000, 0));
        assert_eq!(p.pending(), 1);
        p.harvest(u64::MAX, |s| {
            assert_eq!(s, b);
            Elapsed::Ms(0.1)
        });
        assert_eq!(p.take_busy_ns(), (3_000_000, 0));
        assert_eq!(p.take_busy_ns(), (0, 0));
    }

    #[test]
    fn pairs_read_after_their_grant_ended_are_told_apart() {
        let mut p = Pairs::new();
        let old = p.begin(10, 0).unwrap();
        p.next_grant();
        let new = p.begin(20, 0).unwrap();
        // The old pair is read in the new grant: earlier; the new one: this grant's.
        p.harvest(u64::MAX, |s| {
            assert!(s == old || s == new);
            Elapsed::Ms(if s == old { 1.0 } else { 0.5 })
        });
        assert_eq!(p.take_busy_ns(), (10_000_000, 10_000_000));
        assert_eq!(p.take_busy_ns(), (0, 0));
        // A pair pending across two grants is earlier too (the counter wraps).
        p.grant = u32::MAX;
        let s = p.begin(4, 0).unwrap();
        p.next_grant();
        p.next_grant();
        assert_eq!(p.grant, 1);
        p.harvest(u64::MAX, |x| {
            assert_eq!(x, s);
            Elapsed::Ms(1.0)
        });
        assert_eq!(p.take_busy_ns(), (0, 4_000_000));
    }

    #[test]
    fn launches_without_a_pair_are_stood_for_by_the_next_one() {
        let mut p = Pairs::new();
        let s = p.begin(8, 0).unwrap();
        p.abandon(s); // its record failed
        p.skip(4, 0); // a capture
        let s = p.begin(20, 0).unwrap();
        let broken = p.begin(5, 0).unwrap();
        p.harvest(u64::MAX, |x| {
            if x == s {
                Elapsed::Ms(1.0)
            } else {
                assert_eq!(x, broken);
                Elapsed::Broken
            }
        });
        // 8 + 4 + 20 launches at 1 ms each; the broken pair's 5 carry on.
        assert_eq!(p.take_busy_ns(), (32_000_000, 0));
        let s = p.begin(1, 0).unwrap();
        p.harvest(u64::MAX, |_| Elapsed::Ms(2.0));
        assert_eq!(p.take_busy_ns(), (12_000_000, 0), "{s}");
    }

    #[test]
    fn a_full_ring_carries_and_a_cleared_one_starts_over() {
        let mut p = Pairs::new();
        for _ in 0..PAIRS {
            assert!(p.begin(1, 0).is_some());
        }
        assert_eq!(p.begin(7, 0), None);
        p.clear();
        assert_eq!(p.pending(), 0);
        let s = p.begin(1, 0).unwrap();
        assert_eq!(s, 0);
        p.harvest(u64::MAX, |_| Elapsed::Ms(1.0));
        assert_eq!(p.take_busy_ns(), ((PAIRS as u64 + 7 + 1) * 1_000_000, 0));
    }

    #[test]
    fn a_reading_counts_at_most_the_time_since_its_launches_began() {
        let ms = 1_000_000u64;
        let mut p = Pairs::new();
        // 256 launches made from 100 ms on, one sampled kernel of 3.2 ms, read at 110 ms:
        // 819 ms scaled, 10 ms at most.
        p.begin(256, 100 * ms).unwrap();
        p.harvest(110 * ms, |_| Elapsed::Ms(3.2));
        assert_eq!(p.take_busy_ns(), (10 * ms, 0));
        // Launches carried over keep when the first of them began: 8 from 0 ms (their pair's
        // record failed) and 20 from 50 ms, read at 60 ms at 1 ms each: 28 ms, within 60.
        let s = p.begin(8, 0).unwrap();
        p.abandon(s);
        p.begin(20, 50 * ms).unwrap();
        p.harvest(60 * ms, |_| Elapsed::Ms(1.0));
        assert_eq!(p.take_busy_ns(), (28 * ms, 0));
        // So do a skip's, a broken pair's and a cleared ring's.
        p.skip(5, 200 * ms);
        let s = p.begin(5, 300 * ms).unwrap();
        p.harvest(400 * ms, |x| {
            assert_eq!(x, s);
            Elapsed::Broken
        });
        p.begin(1, 390 * ms).unwrap();
        p.clear();
        p.begin(1, 395 * ms).unwrap();
        p.harvest(410 * ms, |_| Elapsed::Ms(100.0));
        assert_eq!(p.take_busy_ns(), (210 * ms, 0));
    }

    #[test]
    fn odd_readings_count_as_nothing() {
        let mut p = Pairs::new();
        for ms in [f32::NAN, f32::INFINITY, -1.0] {
            p.begin(100, 0).unwrap();
            p.harvest(u64::MAX, |_| Elapsed::Ms(ms));
        }
        assert_eq!(p.take_busy_ns(), (0, 0));
    }

    proptest! {
        /// Whatever the order of begins, abandons, skips and reads, every launch is counted
        /// once: with every kernel taking 1 µs, the busy time read equals the launches
        /// stood for by pairs read, and the rest is still pending or carried.
        #[test]
        fn every_launch_is_counted_once(ops in proptest::collection::vec((0u8..4, 1u64..100), 1..300)) {
            let mut p = Pairs::new();
            let mut launches = 0u64;
            let mut last: Option<usize> = None;
            let mut busy = 0u64;
            for (op, n) in ops {
                match op {
                    0 => { launches += n; last = p.begin(n, 0); }
                    1 => if let Some(s) = last.take() { p.abandon(s) },
                    2 => { launches += n; p.skip(n, 0); last = None; }
                    _ => { p.harvest(u64::MAX, |_| Elapsed::Ms(0.001)); last = None; }
                }
                busy += p.take_busy_ns().0;
            }
            p.harvest(u64::MAX, |_| Elapsed::Ms(0.001));
            busy += p.take_busy_ns().0;
            let rest = p.carry;
            prop_assert!(busy.abs_diff((launches - rest) * 1000) <= 1 + launches / 1000, "{} {} {}", busy, launches, rest);
            prop_assert!(p.pending() == 0);
        }
    }
}
