//! Reading the scenarios' pod logs (pure): the JSON lines the workloads print, each share
//! run's GPU time, and how two or more runs split the GPU.

use anyhow::{Context, Result, ensure};
use serde::Serialize;
use serde_json::Value;

/// The JSON objects among the log's lines.
pub fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The value printed as `KEY=value` on the log's last such line.
pub fn field<'a>(log: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("{key}=");
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
}

/// One pod's share run: GPU time used over its wall time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ShareRun {
    pub busy_ms: f64,
    pub wall_s: f64,
    pub kernels: u64,
}

impl ShareRun {
    /// GPU time per wall time.
    pub fn of_wall(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.busy_ms / (self.wall_s * 1000.0)
        } else {
            0.0
        }
    }
}

/// Skipped at the start of a fake run's samples: the first launches differ in pace.
const FAKE_SKIP_MS: u64 = 2000;

/// The run in a log: gpu_share.py's `done` line (PyTorch), or cuda-workload's launch
/// output with its (ms, busy µs) samples (the fake driver), read after its start-up.
pub fn share_run(log: &str) -> Result<ShareRun> {
    let lines = json_lines(log);
    let out = lines
        .iter()
        .rev()
        .find(|v| v.get("kernels").is_some())
        .context("no result line (with \"kernels\") in the log")?;
    let kernels = out["kernels"].as_u64().unwrap_or(0);
    if let Some(busy_ms) = out["busy_ms"].as_f64() {
        return Ok(ShareRun {
            busy_ms,
            wall_s: out["wall_s"].as_f64().context("no wall_s")?,
            kernels,
        });
    }
    let samples = out["samples"]
        .as_array()
        .context("no busy_ms and no samples")?;
    let pt = |x: &Value| (x[0].as_u64().unwrap_or(0), x[1].as_u64().unwrap_or(0));
    let first = samples
        .iter()
        .map(pt)
        .find(|(t, _)| *t >= FAKE_SKIP_MS)
        .context("no sample after the start-up")?;
    let last = pt(samples.last().context("no samples")?);
    ensure!(last.0 > first.0, "too short a run: {first:?} .. {last:?}");
    Ok(ShareRun {
        busy_ms: (last.1 - first.1) as f64 / 1000.0,
        wall_s: (last.0 - first.0) as f64 / 1000.0,
        kernels,
    })
}

/// How runs that went on at once split the GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Split {
    /// Sum of the runs' GPU time per wall time: how busy the GPU was.
    pub used: f64,
    /// (name, wanted share, share of the GPU time used, off by) per run.
    pub pods: Vec<SplitPod>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitPod {
    pub name: String,
    pub want: f64,
    pub got: f64,
    pub of_wall: f64,
    pub kernels: u64,
}

pub fn split(runs: &[(String, f64, ShareRun)]) -> Split {
    let used: f64 = runs.iter().map(|(_, _, r)| r.of_wall()).sum();
    let pods = runs
        .iter()
        .map(|(name, want, r)| SplitPod {
            name: name.clone(),
            want: *want,
            got: if used > 0.0 { r.of_wall() / used } else { 0.0 },
            of_wall: r.of_wall(),
            kernels: r.kernels,
        })
        .collect();
    Split { used, pods }
}

impl Split {
    /// Every run's share of the time used within `tol` of what it asked for.
    pub fn within(&self, tol: f64) -> bool {
        !self.pods.is_empty() && self.pods.iter().all(|p| (p.got - p.want).abs() <= tol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torch_run_is_read_from_its_done_line() {
        let log = "noise\n{\"phase\":\"ready\"}\n\
            {\"phase\":\"done\",\"kernels\":100,\"wall_s\":20.0,\"busy_ms\":6000.0}\n";
        let r = share_run(log).unwrap();
        assert_eq!(
            r,
            ShareRun {
                busy_ms: 6000.0,
                wall_s: 20.0,
                kernels: 100
            }
        );
        assert!((r.of_wall() - 0.3).abs() < 1e-9);
    }

    #[test]
    fn a_fake_run_is_read_from_its_samples_after_the_start_up() {
        let log = "{\"kernels\":9,\"samples\":[[0,0],[1000,900000],[2000,1000000],[4000,1600000]]}";
        let r = share_run(log).unwrap();
        // 0.6 s busy over the 2 s after the start-up.
        assert_eq!(r.busy_ms, 600.0);
        assert_eq!(r.wall_s, 2.0);
    }

    #[test]
    fn a_log_without_a_result_is_an_error() {
        assert!(share_run("{\"phase\":\"ready\"}").is_err());
    }

    #[test]
    fn the_split_is_each_runs_part_of_the_time_used() {
        let run = |busy_ms| ShareRun {
            busy_ms,
            wall_s: 10.0,
            kernels: 1,
        };
        let s = split(&[
            ("p30".into(), 0.3, run(2800.0)),
            ("p70".into(), 0.7, run(6700.0)),
        ]);
        assert!((s.used - 0.95).abs() < 1e-9);
        assert!((s.pods[0].got - 2800.0 / 9500.0).abs() < 1e-9);
        assert!(s.within(0.02));
        assert!(!s.within(0.001));
    }

    #[test]
    fn fields_are_read_from_the_last_line_that_has_them() {
        assert_eq!(field("NVD=a\nx\nNVD=void\n", "NVD"), Some("void"));
        assert_eq!(field("DEV=\n", "DEV"), Some(""));
        assert_eq!(field("x\n", "DEV"), None);
    }
}
