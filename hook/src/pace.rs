//! The GPU's pace as the queue-ahead bound (`ahead.rs`) measures it: GPU time per ns of the
//! CPU's launching, from samples of the two taken as probes are passed. Pure arithmetic, no
//! driver.
//!
//! A moving average over the samples, and, with a hold time (`KUBESHARE_HOOK_PACE_HOLD_MS`),
//! the largest pace over [`PEAK_WINDOW_NS`] of launching, fading by half every hold time: the
//! pace counted is the larger of the two. A training step's phases differ in pace (on an H200 a
//! `TransformerEncoder` step's average read 1.2–2 while its heaviest windows ran 15–20), and the
//! average lets a heavy phase queue several times what it estimates.

/// The fixed-point scale of a pace: [`ONE`] is 1 ns of GPU work per ns of launching.
pub const ONE: u64 = 1024;

/// The launching over which the held peak is measured: one long kernel in a 10 µs interval
/// would otherwise hold the queue to a probe's worth for a whole hold time.
pub const PEAK_WINDOW_NS: u64 = 500_000;

#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// The pace counted (×[`ONE`]; 0: not measured yet), as of the last sample.
    counted: u64,
    mean: u64,
    /// The largest windowed pace held, and when it was measured.
    peak: u64,
    peak_at: u64,
    /// How long the peak takes to fade by half (0: the average alone).
    pub hold_ns: u64,
    /// The window being summed: GPU time and launching.
    window_gpu: u64,
    window_cpu: u64,
}

impl Pace {
    pub const fn new() -> Self {
        Pace {
            counted: 0,
            mean: 0,
            peak: 0,
            peak_at: 0,
            hold_ns: 0,
            window_gpu: 0,
            window_cpu: 0,
        }
    }

    /// The pace counted, ×[`ONE`] (0: not measured yet).
    pub fn x1024(&self) -> u64 {
        self.counted
    }

    /// The pace counted as a ratio: GPU time per unit of launching time (0: not measured yet).
    pub fn ratio(&self) -> f64 {
        self.counted as f64 / ONE as f64
    }

    /// One measurement: `gpu` ns of GPU time for `cpu` ns of launching, at `t`.
    pub fn sample(&mut self, gpu: u64, cpu: u64, t: u64) {
        let sample = ratio(gpu, cpu);
        self.mean = if self.mean == 0 {
            sample
        } else {
            (3 * self.mean + sample) / 4
        };
        self.counted = self.mean;
        if self.hold_ns == 0 {
            return;
        }
        self.window_gpu = self.window_gpu.saturating_add(gpu);
        self.window_cpu = self.window_cpu.saturating_add(cpu);
        if self.window_cpu >= PEAK_WINDOW_NS {
            let window = ratio(self.window_gpu, self.window_cpu);
            (self.window_gpu, self.window_cpu) = (0, 0);
            if window >= self.held(t) {
                (self.peak, self.peak_at) = (window, t);
            }
        }
        self.counted = self.counted.max(self.held(t));
    }

    /// The peak as it stands at `t`.
    fn held(&self, t: u64) -> u64 {
        faded(self.peak, t.saturating_sub(self.peak_at), self.hold_ns)
    }

    #[cfg(test)]
    pub fn set(&mut self, x1024: u64) {
        (self.counted, self.mean) = (x1024, x1024);
    }
}

impl Default for Pace {
    fn default() -> Self {
        Pace::new()
    }
}

fn ratio(gpu: u64, cpu: u64) -> u64 {
    (u128::from(gpu) * u128::from(ONE) / u128::from(cpu.max(1))).min(u128::from(u32::MAX)) as u64
}

/// `peak` faded by half for every `half_life` of `age` (linearly between halvings).
fn faded(peak: u64, age: u64, half_life: u64) -> u64 {
    let half_life = half_life.max(1);
    let halvings = age / half_life;
    if halvings >= 64 {
        return 0;
    }
    let at = peak >> halvings;
    at - (u128::from(at / 2) * u128::from(age % half_life) / u128::from(half_life)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peak_fades_by_half_every_half_life() {
        assert_eq!(faded(1000, 0, 100), 1000);
        assert_eq!(faded(1000, 50, 100), 750);
        assert_eq!(faded(1000, 100, 100), 500);
        assert_eq!(faded(1000, 250, 100), 188);
        assert_eq!(faded(u64::MAX, u64::MAX, 1), 0);
        assert_eq!(faded(7, 5, 0), 0, "no half-life: gone at once");
    }

    #[test]
    fn the_average_follows_the_samples_and_the_held_peak_outlasts_them() {
        let mut p = Pace::new();
        p.sample(2_000, 1_000, 0);
        assert_eq!(p.x1024(), 2 * ONE, "the first sample is the pace");
        for i in 1..=20 {
            p.sample(1_000, 1_000, i);
        }
        assert!(
            p.x1024() < ONE + ONE / 50,
            "the average forgets: {}",
            p.x1024()
        );

        let mut held = Pace {
            hold_ns: 100_000_000,
            ..Pace::new()
        };
        // A heavy window of launching at 10, then light samples at 1 for 50 ms.
        held.sample(10 * PEAK_WINDOW_NS, PEAK_WINDOW_NS, 0);
        for i in 1..=50 {
            held.sample(100_000, 100_000, i * 1_000_000);
        }
        let x = held.x1024();
        assert!(
            (6 * ONE..=8 * ONE).contains(&x),
            "50 ms into a 100 ms half-life the peak of 10 counts ~7: {x}"
        );
        held.sample(100_000, 100_000, 2_000_000_000);
        assert!(
            held.x1024() < 2 * ONE,
            "faded after 20 half-lives: {}",
            held.x1024()
        );
    }

    #[test]
    fn one_long_kernel_in_a_short_interval_does_not_set_the_peak_alone() {
        let mut p = Pace {
            hold_ns: 100_000_000,
            ..Pace::new()
        };
        // 20 ms of GPU work in 10 µs of launching, then 4.5 ms of launching at 1: the
        // average forgets the interval, the peak holds its 0.5 ms window's pace, ~41.
        p.sample(20_000_000, 10_000, 0);
        for i in 1..=45 {
            p.sample(100_000, 100_000, i);
        }
        let x = p.x1024();
        assert!(
            (30 * ONE..50 * ONE).contains(&x),
            "the window's pace, not the interval's 2000: {x}"
        );
    }

    #[test]
    fn samples_at_the_types_limits_do_not_overflow() {
        let mut p = Pace {
            hold_ns: u64::MAX,
            ..Pace::new()
        };
        p.sample(u64::MAX, 0, u64::MAX);
        p.sample(u64::MAX, u64::MAX, 0);
        assert!(p.x1024() <= u64::from(u32::MAX));
    }
}
