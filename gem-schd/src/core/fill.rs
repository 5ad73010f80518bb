//! A client's fill: how much of its holds' wall time its own kernels kept the GPU busy, from
//! the hook's Busy reports (timing events around a sample of its launches, scaled to all).
//!
//! A tenant that launches continuously but waits on its CPU between small kernels (batch-1
//! inference) holds whole turns and fills a third of them; a training step fills ~95 %. The
//! two are told apart by the fill, not by how long they hold the token. Reports lag their
//! holds (an event pair completes after the hold it was recorded in may have ended), so each
//! figure is kept over decaying sums, not per hold.

use super::Micros;

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
        (self.held >= Self::MIN_HELD_US).then(|| (self.busy / self.held).clamp(0.0, 1.0))
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
