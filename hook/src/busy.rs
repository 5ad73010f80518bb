//! How busy this process keeps the GPU: timing events around a sample of its launches (one in
//! 256 when gem-schd asks for it, `KUBESHARE_HOOK_BUSY_EVERY` to override), reported to gem-schd
//! as GPU time with the hold time it fell in (gem-proto `Busy`).
//!
//! A token hold says when a tenant may launch, not how much of the GPU it used: a batch-1
//! inference tenant launches all through its turns and keeps the GPU ~30 % busy in them, a
//! training step ~95 %. Events around a kernel measure its own context's time even while
//! another context runs beside it (0.18 ms matmuls beside a co-running tenant measured as
//! alone on an H100), so they can account a tenant that does not run in
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

/// The countdown to the next sample cut short (a sample is [`Pairs::overdue`]): `remaining`
/// launches of a gap of `gap` are still to go, so `gap - remaining` were made since the last
/// sample. The next launch is sampled, standing for those and itself: the new (gap, countdown),
/// or `None` when the next launch is sampled anyway.
pub fn cut_short(gap: u32, remaining: u32) -> Option<(u32, u32)> {
    (remaining > 1).then(|| (gap.saturating_sub(remaining).saturating_add(1), 1))
}

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
    /// Per slot, the grant its launch was made in (`grant` then).
    grant_of: [u32; PAIRS],
    /// The current grant (a counter, [`Pairs::next_grant`]).
    grant: u32,
    head: usize,
    len: usize,
    /// Launches that no pending or future pair stands for yet.
    carry: u64,
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
            grant_of: [0; PAIRS],
            grant: 0,
            head: 0,
            len: 0,
            carry: 0,
            busy_ns: 0.0,
            earlier_ns: 0.0,
            rng: 0x9e37_79b9_7f4a_7c15,
            mean: 0,
            last_ns: 0,
        }
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

    /// Whether a sample is overdue at `now_ns`: the last one was taken more than twice
    /// [`GAP_TARGET_NS`] ago. The gap is drawn in launches when a sample is taken and only
    /// adapts at the next one, so a tenant that turned to slow launches could wait seconds for
    /// it: 25 ms kernels at a gap drawn for 256 launches were sampled once in 6 s through the
    /// fake driver, their fill decayed to 0.03 between samples, and charged by fill the
    /// tenant got 0.64 of the GPU at a 0.5 limit.
    pub fn overdue(&self, now_ns: u64) -> bool {
        self.last_ns != 0 && now_ns.saturating_sub(self.last_ns) > 2 * GAP_TARGET_NS
    }

    /// Launches until the next sample: uniform in `[every / 2, every / 2 + every)`, about
    /// `every` on average (each sample stands for its own gap, so the mean need not be exact);
    /// 1 at `every` 1, every launch timed.
    pub fn next_gap(&mut self, every: u32) -> u32 {
        if every <= 1 {
            return 1;
        }
        // xorshift64: cheap, and only has to be unrelated to the program's launches.
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        every / 2 + (x % u64::from(every)) as u32
    }

    /// A sample standing for `launches` is about to be taken: the slot whose events to record
    /// around the launch, or `None` when every pair is pending (the launches carry over).
    pub fn begin(&mut self, launches: u64) -> Option<usize> {
        let launches = launches.saturating_add(std::mem::take(&mut self.carry));
        if self.len == PAIRS {
            self.carry = launches;
            return None;
        }
        let slot = (self.head + self.len) % PAIRS;
        self.weight[slot] = launches;
        self.grant_of[slot] = self.grant;
        self.len += 1;
        Some(slot)
    }

    /// The pair just begun in `slot` was not recorded (or its launch failed): its launches
    /// carry over to the next sample.
    pub fn abandon(&mut self, slot: usize) {
        if self.len > 0 && (self.head + self.len - 1) % PAIRS == slot {
            self.len -= 1;
            self.carry = self.carry.saturating_add(self.weight[slot]);
        }
    }

    /// Launches no sample was taken for (a graph capture, no context): the next one stands
    /// for them.
    pub fn skip(&mut self, launches: u64) {
        self.carry = self.carry.saturating_add(launches);
    }

    /// Reads the pending pairs oldest first, up to the first whose end has not passed.
    pub fn harvest(&mut self, mut elapsed: impl FnMut(usize) -> Elapsed) {
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
                    let ns = ms * 1e6 * self.weight[slot] as f64;
                    if self.grant_of[slot] == self.grant {
                        self.busy_ns += ns;
                    } else {
                        self.earlier_ns += ns;
                    }
                }
                // Its launches' time is unknown: the next sample stands for them.
                Elapsed::Broken => self.carry = self.carry.saturating_add(self.weight[slot]),
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
            self.carry = self.carry.saturating_add(self.weight[self.head]);
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
        assert!(
            (0..100).all(|_| p.next_gap(1) == 1),
            "every 1 times every launch"
        );
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
    fn an_overdue_sample_is_taken_at_the_next_launch_standing_for_those_since() {
        let ms = 1_000_000u64;
        let mut p = Pairs::new();
        assert!(
            !p.overdue(100 * ms),
            "no sample taken yet: nothing is overdue"
        );
        p.mean_gap(256, 1_000 * ms);
        assert!(!p.overdue(1_000 * ms + 2 * GAP_TARGET_NS));
        assert!(p.overdue(1_000 * ms + 2 * GAP_TARGET_NS + 1));
        // A gap of 300 launches with 290 to go: 10 were made; the next stands for 11.
        assert_eq!(cut_short(300, 290), Some((11, 1)));
        // None made since: the next stands for itself.
        assert_eq!(cut_short(300, 300), Some((1, 1)));
        // The next launch is sampled anyway (or the countdown was already cut).
        assert_eq!(cut_short(300, 1), None);
        assert_eq!(cut_short(300, 0), None);
        // A countdown raced above its gap by another thread counts nothing made.
        assert_eq!(cut_short(5, 9), Some((1, 1)));
    }

    #[test]
    fn each_read_pair_counts_for_the_launches_it_stands_for() {
        let mut p = Pairs::new();
        let a = p.begin(10).unwrap();
        let b = p.begin(30).unwrap();
        p.harvest(|s| {
            if s == a {
                Elapsed::Ms(0.5)
            } else {
                Elapsed::NotYet
            }
        });
        assert_eq!(p.take_busy_ns(), (5_000_000, 0));
        assert_eq!(p.pending(), 1);
        p.harvest(|s| {
            assert_eq!(s, b);
            Elapsed::Ms(0.1)
        });
        assert_eq!(p.take_busy_ns(), (3_000_000, 0));
        assert_eq!(p.take_busy_ns(), (0, 0));
    }

    #[test]
    fn pairs_read_after_their_grant_ended_are_told_apart() {
        let mut p = Pairs::new();
        let old = p.begin(10).unwrap();
        p.next_grant();
        let new = p.begin(20).unwrap();
        // The old pair is read in the new grant: earlier; the new one: this grant's.
        p.harvest(|s| {
            assert!(s == old || s == new);
            Elapsed::Ms(if s == old { 1.0 } else { 0.5 })
        });
        assert_eq!(p.take_busy_ns(), (10_000_000, 10_000_000));
        assert_eq!(p.take_busy_ns(), (0, 0));
        // A pair pending across two grants is earlier too (the counter wraps).
        p.grant = u32::MAX;
        let s = p.begin(4).unwrap();
        p.next_grant();
        p.next_grant();
        assert_eq!(p.grant, 1);
        p.harvest(|x| {
            assert_eq!(x, s);
            Elapsed::Ms(1.0)
        });
        assert_eq!(p.take_busy_ns(), (0, 4_000_000));
    }

    #[test]
    fn launches_without_a_pair_are_stood_for_by_the_next_one() {
        let mut p = Pairs::new();
        let s = p.begin(8).unwrap();
        p.abandon(s); // its record failed
        p.skip(4); // a capture
        let s = p.begin(20).unwrap();
        let broken = p.begin(5).unwrap();
        p.harvest(|x| {
            if x == s {
                Elapsed::Ms(1.0)
            } else {
                assert_eq!(x, broken);
                Elapsed::Broken
            }
        });
        // 8 + 4 + 20 launches at 1 ms each; the broken pair's 5 carry on.
        assert_eq!(p.take_busy_ns(), (32_000_000, 0));
        let s = p.begin(1).unwrap();
        p.harvest(|_| Elapsed::Ms(2.0));
        assert_eq!(p.take_busy_ns(), (12_000_000, 0), "{s}");
    }

    #[test]
    fn a_full_ring_carries_and_a_cleared_one_starts_over() {
        let mut p = Pairs::new();
        for _ in 0..PAIRS {
            assert!(p.begin(1).is_some());
        }
        assert_eq!(p.begin(7), None);
        p.clear();
        assert_eq!(p.pending(), 0);
        let s = p.begin(1).unwrap();
        assert_eq!(s, 0);
        p.harvest(|_| Elapsed::Ms(1.0));
        assert_eq!(p.take_busy_ns(), ((PAIRS as u64 + 7 + 1) * 1_000_000, 0));
    }

    /// A GPU-bound tenant whose kernels are mostly short with a few long ones (a training
    /// step's elementwise kernels and convolutions): one reading may stand for many times its
    /// gap's GPU time, and readings add up to the truth only uncapped. Capping each at its
    /// gap's time (or the wall time since its launches began, which for a GPU-bound tenant is
    /// the same) keeps the many low readings and cuts the few high ones: it was tried twice
    /// and both times ResNet-50 training, then matmul tenants, read as light and co-ran
    /// charged a fraction of their GPU time (on H200s).
    #[test]
    fn readings_of_a_long_tailed_kernel_mix_add_up_to_its_gpu_time() {
        let mut p = Pairs::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut kernel_ms = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if rng.is_multiple_of(20) { 2.0 } else { 0.02 }
        };
        let (mut truth, mut read) = (0.0f64, 0.0f64);
        for _ in 0..100_000 {
            let n = p.next_gap(32);
            let gap: Vec<f64> = (0..n).map(|_| kernel_ms()).collect();
            let gap_ms: f64 = gap.iter().sum();
            let sampled = gap[gap.len() - 1];
            let s = p.begin(u64::from(n)).unwrap();
            p.harvest(|x| {
                assert_eq!(x, s);
                Elapsed::Ms(sampled as f32)
            });
            let (busy, _) = p.take_busy_ns();
            let ms = busy as f64 / 1e6;
            truth += gap_ms;
            read += ms;
        }
        // 0.979 (about 5,000 long kernels sampled); each capped at its gap's time, 0.234.
        assert!(
            (read / truth - 1.0).abs() < 0.05,
            "read {read:.0} ms of {truth:.0}"
        );
    }

    #[test]
    fn odd_readings_count_as_nothing() {
        let mut p = Pairs::new();
        for ms in [f32::NAN, f32::INFINITY, -1.0] {
            p.begin(100).unwrap();
            p.harvest(|_| Elapsed::Ms(ms));
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
                    0 => { launches += n; last = p.begin(n); }
                    1 => if let Some(s) = last.take() { p.abandon(s) },
                    2 => { launches += n; p.skip(n); last = None; }
                    _ => { p.harvest(|_| Elapsed::Ms(0.001)); last = None; }
                }
                busy += p.take_busy_ns().0;
            }
            p.harvest(|_| Elapsed::Ms(0.001));
            busy += p.take_busy_ns().0;
            let rest = p.carry;
            prop_assert!(busy.abs_diff((launches - rest) * 1000) <= 1 + launches / 1000, "{} {} {}", busy, launches, rest);
            prop_assert!(p.pending() == 0);
        }
    }
}
