//! A client's fill: how much of its holds' wall time its own kernels kept the GPU busy, from
//! the hook's Busy reports (timing events around a sample of its launches, scaled to all).
//!
//! A tenant that launches continuously but waits on its CPU between small kernels (batch-1
//! inference) holds whole turns and fills a third of them; a training step fills ~95 %. The
//! two are told apart by the fill, not by how long they hold the token. Reports lag their
//! holds (an event pair completes after the hold it was recorded in may have ended), so each
//! figure is kept over decaying sums, not per hold.
//!
//! A client's kernels fill less of a co-hold than of its own turn: beside the holder they wait
//! for the GPU's time slices, so the same work spans more wall time (batch-8 ResNet-18
//! inference filled 0.63 of its turns and 0.41 of its co-holds on an H100, batch-1 0.43 and
//! 0.31; issue 14 round 16). One sum over both moved a client near the threshold in and out of
//! co-running with the mix of its holds, so [`Fills`] keeps one per kind of hold: starting to
//! co-run is judged on the turns' fill, going on with it on the co-holds'. (Batch-8 inference
//! still went in and out in one H100 run of two with these fills alone, likely after turns its
//! limit or pacing window forced; a co-runner at its limit now waits for a co-hold instead,
//! `corun.rs`.)

use super::Micros;

/// A client's fill in its turns and in its co-holds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fills {
    turns: Fill,
    co: Fill,
}

impl Fills {
    /// No judging a client on a kind of hold before this much of it was reported: fills come
    /// from a sample of launches, and a start of co-running on a few noisy turns (a warm-up)
    /// would stick, as would an end on one co-hold whose one sample read as a fill of 1
    /// (through the fake driver, a tenant launching 2,000 times a second).
    pub const JUDGE_MIN_HELD_US: f64 = 200_000.0;
    /// A start of co-running is judged on more turns than that: a process's first holds are
    /// its start-up (contexts, allocations; its kernels busy 0.02–0.18 of 30–44 ms holds for
    /// matmul tenants on an H200) and its samples reach gem-schd in lumps a report late, so
    /// 200 ms of turns read GPU-bound tenants at 0.2–0.4 and all three of a run co-ran for a
    /// second (issue 14 round 19). Half a second of turns (decayed) outweighs the start-up.
    pub const START_MIN_HELD_US: f64 = 500_000.0;

    /// Adds one report of a turn (`in_co` false) or a co-hold.
    pub fn report(&mut self, in_co: bool, busy_us: Micros, held_us: Micros) {
        if in_co {
            self.co.report(busy_us, held_us)
        } else {
            self.turns.report(busy_us, held_us)
        }
    }

    /// The turns' fill, once enough of them was reported to judge a start of co-running.
    pub fn start_fill(&self) -> Option<f64> {
        self.turns.ratio_after(Self::START_MIN_HELD_US)
    }

    /// The co-holds' fill (the turns' until enough co-holds have reported): what a co-hold is
    /// charged of its time and judged on to go on.
    pub fn co(&self) -> Option<f64> {
        self.co
            .ratio_after(Self::JUDGE_MIN_HELD_US)
            .or_else(|| self.turns.ratio())
    }

    /// The turns' fill.
    pub fn turns(&self) -> Option<f64> {
        self.turns.ratio()
    }
}

/// Decaying sums of reported busy and held time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fill {
    busy: f64,
    held: f64,
}

impl Fill {
    /// The sums halve every this much reported held time: a second of holds.
    pub const HALF_LIFE_US: f64 = 1_000_000.0;
    /// No ratio before this much held time has been reported (a few 5 ms holds).
    pub const MIN_HELD_US: f64 = 20_000.0;

    /// Adds one report. A report may carry more busy than held time (work of an earlier
    /// hold measured late, or several streams busy at once); the sums absorb the former
    /// and [`Fill::ratio`] caps the latter.
    pub fn report(&mut self, busy_us: Micros, held_us: Micros) {
        let held = held_us as f64;
        let keep = 0.5f64.powf(held / Self::HALF_LIFE_US);
        self.busy = self.busy * keep + busy_us as f64;
        self.held = self.held * keep + held;
    }

    /// Busy over held time, in [0, 1]; `None` until enough has been reported.
    pub fn ratio(&self) -> Option<f64> {
        self.ratio_after(Self::MIN_HELD_US)
    }

    /// [`Fill::ratio`] once at least `min_held_us` (decayed) has been reported.
    pub fn ratio_after(&self, min_held_us: f64) -> Option<f64> {
        (self.held >= min_held_us.max(Self::MIN_HELD_US))
            .then(|| (self.busy / self.held).clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_follows_the_reports_and_forgets_old_ones() {
        let mut f = Fill::default();
        f.report(1_000, 5_000);
        assert_eq!(f.ratio(), None, "one 5 ms hold is not enough to judge");
        for _ in 0..200 {
            f.report(1_500, 5_000);
        }
        let r = f.ratio().unwrap();
        assert!((r - 0.3).abs() < 0.01, "{r}");
        // The tenant becomes compute-bound: after 4 s of holds (four half-lives) the old
        // reports weigh ~3 % (a sixteenth of their decayed sum against the new one's), after
        // 10 s nothing to speak of.
        for _ in 0..800 {
            f.report(4_900, 5_000);
        }
        let r = f.ratio().unwrap();
        assert!(r > 0.95 && r < 0.97, "{r}");
        for _ in 0..1200 {
            f.report(4_900, 5_000);
        }
        let r = f.ratio().unwrap();
        assert!((r - 0.98).abs() < 0.002, "{r}");
    }

    #[test]
    fn turns_and_co_holds_keep_their_own_fill() {
        let mut f = Fills::default();
        assert_eq!((f.start_fill(), f.co(), f.turns()), (None, None, None));
        // 100 ms of turns: a fill, not yet enough to start co-running on.
        for _ in 0..20 {
            f.report(false, 3_150, 5_000);
        }
        assert!(f.turns().is_some_and(|r| (r - 0.63).abs() < 1e-9));
        assert_eq!(f.start_fill(), None);
        // Until the co-holds report, a co-hold is judged on the turns.
        assert_eq!(f.co(), f.turns());
        for _ in 0..40 {
            f.report(false, 3_150, 5_000);
        }
        // 300 ms: enough to judge a co-hold on, not a start (a process's start-up weighs).
        assert_eq!(f.start_fill(), None);
        assert!(f.co().is_some());
        for _ in 0..70 {
            f.report(false, 3_150, 5_000);
        }
        assert!(f.start_fill().is_some_and(|r| (r - 0.63).abs() < 1e-9));
        // Co-holds report a lower fill; until 200 ms of them the turns' stands for it (one
        // lump of a sample in one co-hold is no fill), then theirs; the turns' stays.
        let mut lump = f;
        lump.report(true, 90_000, 20_000);
        assert_eq!(lump.co(), f.turns());
        for _ in 0..30 {
            f.report(true, 4_100, 10_000);
        }
        assert!(f.co().is_some_and(|r| (r - 0.41).abs() < 1e-9));
        assert!(f.start_fill().is_some_and(|r| (r - 0.63).abs() < 1e-9));
    }

    #[test]
    fn late_and_overlapping_reports_are_capped_not_wrapped() {
        let mut f = Fill::default();
        f.report(0, 30_000);
        assert_eq!(f.ratio(), Some(0.0));
        f.report(u64::MAX, 0);
        assert_eq!(f.ratio(), Some(1.0));
        let mut g = Fill::default();
        g.report(u64::MAX, u64::MAX);
        assert!(g.ratio().is_some_and(|r| (0.0..=1.0).contains(&r)));
    }
}
