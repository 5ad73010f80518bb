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
//! 0.31 on an H100). One sum over both moved a client near the threshold in and out of
//! co-running with the mix of its holds, so [`Fills`] keeps one per kind of hold: starting to
//! co-run is judged on the turns' fill, going on with it on the co-holds'. (Batch-8 inference
//! still went in and out in one H100 run of two with these fills alone, likely after turns its
//! limit or pacing window forced; a co-runner at its limit now waits for a co-hold instead,
//! `corun.rs`.)
//!
//! A co-hold's samples are not all of the client's own time: a pair of events around a kernel
//! that waited for the holder's time slice reads that slice too, and a sample stands for ~256
//! launches, so one such sample read 869 ms in a 20 ms co-hold of batch-1 inference on an H200
//! (an H200). Its co-holds' fill rose to 0.91 and took ~1.5 s of co-holds to decay;
//! meanwhile each turn it was sent to read light (turns are exclusive: no slice to take in), so
//! it went back to a co-hold, found the co-holds' fill heavy again, and so on, its requests
//! waiting for turns (max 66 ms, p99 3.3× native). So a client sent from co-holds to turns is
//! judged on the turns it takes from then on, and when they read light its co-holds' fill
//! starts over ([`Fills::left_co`], [`Fills::back_to_co`]).

use super::Micros;

/// A client's fill in its turns and in its co-holds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fills {
    turns: Fill,
    co: Fill,
    /// Its turns since it was last sent from co-holds to turns (`None`: it has not been, or
    /// went back since).
    since_co: Option<Fill>,
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
    /// second (three matmul tenants started together on an H200). Half a second of turns (decayed) outweighs the start-up.
    pub const START_MIN_HELD_US: f64 = 500_000.0;
    /// A client sent from co-holds to turns goes back after this much of its turns since then
    /// read light: enough samples not to go back on one or two (a light client's turns fill
    /// ~0.3), few enough turns that its requests wait for them only briefly (at 5 ms turns
    /// beside one other client, ~100 ms).
    pub const BACK_MIN_HELD_US: f64 = 50_000.0;

    /// Adds one report of a turn (`in_co` false) or a co-hold.
    pub fn report(&mut self, in_co: bool, busy_us: Micros, held_us: Micros) {
        if in_co {
            self.co.report(busy_us, held_us)
        } else {
            self.turns.report(busy_us, held_us);
            if let Some(f) = &mut self.since_co {
                f.report(busy_us, held_us);
            }
        }
    }

    /// The client was sent from co-holds to a turn: its turns are judged afresh from now.
    pub fn left_co(&mut self) {
        self.since_co = Some(Fill::default());
    }

    /// The client co-runs again. If it had been sent to turns (its co-holds' fill judged it
    /// heavy) and its turns since then read light, that fill was not its own (a sample that
    /// took in the holder's time slice): its co-holds' fill starts over, the turns' standing
    /// for it until enough co-holds have reported.
    pub fn back_to_co(&mut self) {
        if self.since_co.take().is_some() {
            self.co = Fill::default();
        }
    }

    /// The turns' fill a start of co-running is judged on, once enough turns were reported: of
    /// its turns since it was sent from co-holds to turns, or of all its turns if it never was.
    pub fn start_fill(&self) -> Option<f64> {
        match &self.since_co {
            Some(f) => f.ratio_after(Self::BACK_MIN_HELD_US),
            None => self.turns.ratio_after(Self::START_MIN_HELD_US),
        }
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

    /// The turns' fill once enough turns were reported to charge them by it
    /// (`Core::set_charge_by_fill`): a few noisy holds must not set a client's charge.
    pub fn turns_judged(&self) -> Option<f64> {
        self.turns.ratio_after(Self::JUDGE_MIN_HELD_US)
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
    fn a_client_sent_to_turns_is_judged_on_its_turns_since_and_then_starts_its_co_fill_over() {
        let mut f = Fills::default();
        for _ in 0..120 {
            f.report(false, 1_500, 5_000);
        }
        for _ in 0..30 {
            f.report(true, 3_500, 10_000);
        }
        assert!(f.co().is_some_and(|r| (r - 0.35).abs() < 1e-9));
        // Going back to co-holds without having left them keeps their fill.
        let mut kept = f;
        kept.back_to_co();
        assert_eq!(kept, f);
        // One sample that took in the holder's time slice (869 ms in a 20 ms co-hold, H200).
        f.report(true, 869_000, 20_000);
        assert!(f.co().is_some_and(|r| r > 0.8), "{:?}", f.co());
        // Sent to turns: judged on its turns from now, not on those of the last seconds (which
        // read light whatever it does now).
        f.left_co();
        assert_eq!(f.start_fill(), None);
        for _ in 0..10 {
            f.report(false, 1_500, 5_000);
        }
        assert_eq!(f.start_fill(), None, "50 ms of turns, decayed");
        f.report(false, 1_500, 5_000);
        assert!(f.start_fill().is_some_and(|r| (r - 0.3).abs() < 1e-9));
        // Back to co-holds: their fill starts over (the turns' stands for it meanwhile).
        f.back_to_co();
        assert_eq!(f.co(), f.turns());
        for _ in 0..25 {
            f.report(true, 3_500, 10_000);
        }
        assert!(f.co().is_some_and(|r| (r - 0.35).abs() < 1e-9));
        // A client whose turns since read heavy stays there: it was heavy.
        let mut g = f;
        g.left_co();
        for _ in 0..11 {
            g.report(false, 4_800, 5_000);
        }
        assert!(g.start_fill().is_some_and(|r| r > 0.9));
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
