//! How much of the GPU co-runners took, over time: the integral of the open co-holds' fills
//! (capped as the holder's boost is), kept as a piecewise-linear curve over the window. A
//! holder's turns are credited what co-runners took of them, both in the window's check and
//! in the usage report, so that its usage is GPU time and the check holds what the report
//! delivers (`corun.rs`).

use std::collections::VecDeque;

use super::Micros;

/// The curve: at each change of the co-runners' fill, (when, area so far in µs, fill from then).
#[derive(Debug, Clone, Default)]
pub struct CoArea {
    points: VecDeque<(Micros, f64, f64)>,
}

impl CoArea {
    /// From `now` on, co-runners keep the GPU `rate` busy (0 when none runs).
    pub fn set_rate(&mut self, now: Micros, rate: f64) {
        let rate = if rate.is_finite() { rate.max(0.0) } else { 0.0 };
        let now = self.points.back().map_or(now, |p| now.max(p.0));
        let area = self.at(now);
        match self.points.back_mut() {
            Some(p) if p.0 == now => p.2 = rate,
            _ => self.points.push_back((now, area, rate)),
        }
    }

    /// The area up to `t` (µs of GPU time the co-runners took since the curve began).
    pub fn at(&self, t: Micros) -> f64 {
        let i = self.points.partition_point(|p| p.0 <= t);
        match i.checked_sub(1).and_then(|i| self.points.get(i)) {
            Some(&(from, area, rate)) => area + rate * (t - from) as f64,
            // Before the first point nothing ran beside anyone.
            None => self.points.front().map_or(0.0, |p| p.1),
        }
    }

    /// What co-runners took between `a` and `b`.
    pub fn between(&self, a: Micros, b: Micros) -> f64 {
        if b <= a {
            return 0.0;
        }
        (self.at(b) - self.at(a)).max(0.0)
    }

    /// Forgets the curve before `t`, keeping what [`CoArea::at`] needs for `t` and later.
    pub fn prune(&mut self, t: Micros) {
        while self.points.len() > 1 && self.points[1].0 <= t {
            self.points.pop_front();
        }
    }

    /// Points kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.points.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_area_integrates_the_rates_between_changes() {
        let mut a = CoArea::default();
        assert_eq!(a.at(5), 0.0);
        a.set_rate(100, 0.5);
        a.set_rate(300, 0.0);
        a.set_rate(400, 0.25);
        assert_eq!(a.at(100), 0.0);
        assert_eq!(a.at(200), 50.0);
        assert_eq!(a.at(350), 100.0);
        assert_eq!(a.at(800), 200.0);
        assert_eq!(a.between(200, 800), 150.0);
        assert_eq!(a.between(800, 200), 0.0);
        // A change at the same instant replaces the rate; one from the past counts from the last.
        a.set_rate(800, 1.0);
        a.set_rate(800, 0.5);
        a.set_rate(700, 0.0);
        assert_eq!(a.at(900), 200.0);
        assert_eq!(a.len(), 4);
    }

    #[test]
    fn pruning_keeps_the_area_from_then_on_and_odd_rates_count_as_none() {
        let mut a = CoArea::default();
        a.set_rate(0, 0.5);
        a.set_rate(100, f64::NAN);
        a.set_rate(200, -3.0);
        a.set_rate(300, 0.5);
        let (x, y) = (a.at(250), a.at(1000));
        a.prune(250);
        assert_eq!(a.len(), 2);
        assert_eq!((a.at(250), a.at(1000)), (x, y));
        assert_eq!(y, 50.0 + 350.0);
    }

    proptest! {
        /// The area never decreases with time and pruning never changes it from then on.
        #[test]
        fn monotone_and_pruning_is_invisible(
            changes in proptest::collection::vec((0u64..1_000, 0.0f64..2.0), 0..40),
            cut in 0u64..20_000,
            probes in proptest::collection::vec(0u64..30_000, 1..20),
        ) {
            let mut a = CoArea::default();
            let mut t = 0;
            for (dt, r) in changes {
                t += dt;
                a.set_rate(t, r);
            }
            let mut sorted = probes.clone();
            sorted.sort_unstable();
            for w in sorted.windows(2) {
                prop_assert!(a.at(w[1]) >= a.at(w[0]));
            }
            let before: Vec<f64> = probes.iter().filter(|p| **p >= cut).map(|p| a.at(*p)).collect();
            a.prune(cut);
            let after: Vec<f64> = probes.iter().filter(|p| **p >= cut).map(|p| a.at(*p)).collect();
            prop_assert_eq!(before, after);
        }
    }
}
