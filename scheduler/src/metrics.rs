//! Prometheus text exposition (format 0.0.4), hand-rolled: a few counters, one
//! histogram per verb, and the GPU books as gauges at scrape time.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::placement::GpuUsage;

/// Upper bounds of the latency buckets, seconds.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
];

/// Name, help, value of one GPU.
type Gauge = (&'static str, &'static str, fn(&GpuUsage) -> u64);

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
struct Inner {
    decisions: BTreeMap<(String, String), u64>,
    latency: BTreeMap<String, Histogram>,
    /// Other counters: (metric name, label name, label value).
    counters: BTreeMap<(&'static str, &'static str, String), u64>,
}

/// Counters besides the decisions: name, help, label.
const COUNTERS: [(&str, &str, &str); 3] = [
    (
        "kubeshare_extender_record_problems_total",
        "Allocation records refused or kept (unparseable, tampered, not addable), by kind.",
        "kind",
    ),
    (
        "kubeshare_extender_task_restarts_total",
        "Background tasks (watches, timer) restarted after they ended or panicked.",
        "task",
    ),
    (
        "kubeshare_extender_api_calls_total",
        "API calls of bind and the background checks, by outcome.",
        "outcome",
    ),
];

/// The extender's counters; cheap to update from every handler.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Counts one answer of `verb` with `outcome` that took `took`.
    pub fn observe(&self, verb: &str, outcome: &str, took: Duration) {
        let Ok(mut m) = self.inner.lock() else {
            return;
        };
        *m.decisions
            .entry((verb.to_string(), outcome.to_string()))
            .or_default() += 1;
        let h = m.latency.entry(verb.to_string()).or_default();
        let s = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += s;
        h.count += 1;
    }

    /// Adds one to counter `name` (one of [`COUNTERS`]) with label value `value`.
    pub fn count(&self, name: &'static str, value: &str) {
        let Some((n, _, label)) = COUNTERS.iter().find(|c| c.0 == name) else {
            return;
        };
        if let Ok(mut m) = self.inner.lock() {
            *m.counters.entry((n, label, value.to_string())).or_default() += 1;
        }
    }

    /// The whole exposition.
    pub fn render(
        &self,
        gpus: &[GpuUsage],
        bookings: (usize, usize, usize),
        synced: bool,
    ) -> String {
        let mut o = String::new();
        let (decisions, latency, counters) = match self.inner.lock() {
            Ok(m) => (m.decisions.clone(), m.latency.clone(), m.counters.clone()),
            Err(_) => Default::default(),
        };
        for (name, help, _) in COUNTERS {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for ((n, label, v), c) in &counters {
                if *n == name {
                    let _ = writeln!(o, "{name}{{{label}=\"{}\"}} {c}", escape(v));
                }
            }
        }
        o.push_str(
            "# HELP kubeshare_extender_decisions_total Extender answers by verb and outcome.\n",
        );
        o.push_str("# TYPE kubeshare_extender_decisions_total counter\n");
        for ((verb, outcome), n) in &decisions {
            let _ = writeln!(
                o,
                "kubeshare_extender_decisions_total{{verb=\"{}\",outcome=\"{}\"}} {n}",
                escape(verb),
                escape(outcome)
            );
        }
        o.push_str("# HELP kubeshare_extender_request_duration_seconds Time to answer one extender call.\n");
        o.push_str("# TYPE kubeshare_extender_request_duration_seconds histogram\n");
        for (verb, h) in &latency {
            let v = escape(verb);
            for (i, b) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    o,
                    "kubeshare_extender_request_duration_seconds_bucket{{verb=\"{v}\",le=\"{b}\"}} {}",
                    h.counts[i]
                );
            }
            let _ = writeln!(
                o,
                "kubeshare_extender_request_duration_seconds_bucket{{verb=\"{v}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                o,
                "kubeshare_extender_request_duration_seconds_sum{{verb=\"{v}\"}} {}",
                h.sum
            );
            let _ = writeln!(
                o,
                "kubeshare_extender_request_duration_seconds_count{{verb=\"{v}\"}} {}",
                h.count
            );
        }
        let gauges: [Gauge; 4] = [
            (
                "kubeshare_gpu_allocated_share",
                "Guaranteed share of the GPU booked, in thousandths.",
                |g| u64::from(g.used_milli),
            ),
            (
                "kubeshare_gpu_memory_allocated_bytes",
                "GPU memory booked, bytes.",
                |g| g.mem_used,
            ),
            (
                "kubeshare_gpu_memory_bytes",
                "GPU memory capacity, bytes.",
                |g| g.mem_total,
            ),
            (
                "kubeshare_gpu_pods",
                "Pods holding a share of the GPU.",
                |g| u64::from(g.holders),
            ),
        ];
        for (name, help, f) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge");
            for g in gpus {
                let _ = writeln!(
                    o,
                    "{name}{{node=\"{}\",gpu=\"{}\",uuid=\"{}\",model=\"{}\"}} {}",
                    escape(&g.node),
                    g.index,
                    escape(&g.uuid),
                    escape(&g.model),
                    f(g)
                );
            }
        }
        o.push_str("# HELP kubeshare_extender_bookings Allocations held, by kind.\n# TYPE kubeshare_extender_bookings gauge\n");
        for (k, n) in [
            ("observed", bookings.0),
            ("assumed", bookings.1),
            ("reserved", bookings.2),
        ] {
            let _ = writeln!(o, "kubeshare_extender_bookings{{kind=\"{k}\"}} {n}");
        }
        let _ = writeln!(
            o,
            "# HELP kubeshare_extender_synced Whether the node and pod watches have listed once.\n# TYPE kubeshare_extender_synced gauge\nkubeshare_extender_synced {}",
            u8::from(synced)
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let m = Metrics::default();
        m.observe("filter", "fits", Duration::from_micros(300));
        m.observe("filter", "fits", Duration::from_millis(3));
        let g = GpuUsage {
            node: "n\"1".into(),
            index: 2,
            uuid: "GPU-x".into(),
            model: "M".into(),
            used_milli: 500,
            mem_used: 7,
            mem_total: 9,
            holders: 1,
        };
        m.count("kubeshare_extender_record_problems_total", "tampered");
        let t = m.render(&[g], (1, 2, 3), true);
        assert!(t.contains("kubeshare_extender_record_problems_total{kind=\"tampered\"} 1"));
        assert!(
            t.contains("kubeshare_extender_decisions_total{verb=\"filter\",outcome=\"fits\"} 2")
        );
        assert!(t.contains(
            "kubeshare_extender_request_duration_seconds_bucket{verb=\"filter\",le=\"0.0005\"} 1"
        ));
        assert!(t.contains(
            "kubeshare_extender_request_duration_seconds_bucket{verb=\"filter\",le=\"0.005\"} 2"
        ));
        assert!(t.contains("kubeshare_gpu_allocated_share{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 500"));
        assert!(t.contains("kubeshare_extender_bookings{kind=\"reserved\"} 3"));
    }
}
