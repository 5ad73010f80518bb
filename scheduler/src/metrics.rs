//! The extender's metrics (OpenMetrics text through `prometheus-client`): answers and
//! their latency per verb, a few counters, and the GPU books as gauges built from the
//! cluster state at each scrape.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::placement::GpuUsage;

/// Upper bounds of the latency buckets, seconds.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
];

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Decision {
    verb: String,
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Verb {
    verb: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Task {
    task: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    node: String,
    gpu: String,
    uuid: String,
    model: String,
}

/// The extender's counters; cheap to update from every handler.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: Family<Decision, Counter>,
    latency: Family<Verb, Histogram>,
    record_problems: Family<Kind, Counter>,
    task_restarts: Family<Task, Counter>,
    api_calls: Family<Outcome, Counter>,
    events_skipped: Family<Reason, Counter>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kubeshare_extender");
        let decisions = Family::<Decision, Counter>::default();
        registry.register(
            "decisions",
            "Extender answers by verb and outcome",
            decisions.clone(),
        );
        let latency = Family::<Verb, Histogram>::new_with_constructor(|| {
            Histogram::new(BUCKETS.iter().copied())
        });
        registry.register_with_unit(
            "request_duration",
            "Time to answer one extender call",
            Unit::Seconds,
            latency.clone(),
        );
        let record_problems = Family::<Kind, Counter>::default();
        registry.register(
            "record_problems",
            "Allocation records refused or kept (unparseable, tampered, not addable), by kind",
            record_problems.clone(),
        );
        let task_restarts = Family::<Task, Counter>::default();
        registry.register(
            "task_restarts",
            "Background tasks (watches, timer) restarted after they ended or panicked",
            task_restarts.clone(),
        );
        let api_calls = Family::<Outcome, Counter>::default();
        registry.register(
            "api_calls",
            "API calls of bind and the background checks, by outcome",
            api_calls.clone(),
        );
        let events_skipped = Family::<Reason, Counter>::default();
        registry.register(
            "events_skipped",
            "Informational pod events not sent (over their rate limit), by reason",
            events_skipped.clone(),
        );
        Metrics {
            events_skipped,
            registry,
            decisions,
            latency,
            record_problems,
            task_restarts,
            api_calls,
        }
    }
}

impl Metrics {
    /// Counts one answer of `verb` with `outcome` that took `took`.
    pub fn observe(&self, verb: &str, outcome: &str, took: Duration) {
        self.decisions
            .get_or_create(&Decision {
                verb: verb.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
        self.latency
            .get_or_create(&Verb {
                verb: verb.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Adds one to counter `name` (`kubeshare_extender_record_problems_total`,
    /// `..._task_restarts_total` or `..._api_calls_total`) with label value `value`;
    /// another name is ignored.
    pub fn count(&self, name: &str, value: &str) {
        let v = value.to_string();
        match name {
            "kubeshare_extender_record_problems_total" => {
                self.record_problems.get_or_create(&Kind { kind: v }).inc();
            }
            "kubeshare_extender_task_restarts_total" => {
                self.task_restarts.get_or_create(&Task { task: v }).inc();
            }
            "kubeshare_extender_api_calls_total" => {
                self.api_calls.get_or_create(&Outcome { outcome: v }).inc();
            }
            "kubeshare_extender_events_skipped_total" => {
                self.events_skipped
                    .get_or_create(&Reason { reason: v })
                    .inc();
            }
            _ => {}
        }
    }

    /// The whole exposition: the counters, then the books at this moment.
    pub fn render(
        &self,
        gpus: &[GpuUsage],
        bookings: (usize, usize, usize),
        synced: bool,
    ) -> String {
        let mut books = Registry::default();
        let gauge = || Family::<GpuLabels, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
        let (share, mem, um, total, pods) = (gauge(), gauge(), gauge(), gauge(), gauge());
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for g in gpus {
            let l = GpuLabels {
                node: g.node.clone(),
                gpu: g.index.to_string(),
                uuid: g.uuid.clone(),
                model: g.model.clone(),
            };
            share.get_or_create(&l).set(i64::from(g.used_milli));
            mem.get_or_create(&l).set(to_i64(g.mem_used));
            um.get_or_create(&l).set(to_i64(g.um_resident));
            total.get_or_create(&l).set(to_i64(g.mem_total));
            pods.get_or_create(&l).set(i64::from(g.holders));
        }
        books.register(
            "kubeshare_gpu_allocated_share",
            "Guaranteed share of the GPU booked, in thousandths",
            share,
        );
        books.register_with_unit(
            "kubeshare_gpu_memory_allocated",
            "GPU memory booked as device-mode pods' caps",
            Unit::Bytes,
            mem,
        );
        books.register_with_unit(
            "kubeshare_gpu_memory_unified_resident",
            "GPU memory booked as unified-memory pods' resident shares (may overcommit: docs/um.md)",
            Unit::Bytes,
            um,
        );
        books.register_with_unit(
            "kubeshare_gpu_memory",
            "GPU memory capacity",
            Unit::Bytes,
            total,
        );
        books.register(
            "kubeshare_gpu_pods",
            "Pods holding a share of the GPU",
            pods,
        );
        let kinds = Family::<Kind, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
        for (k, n) in [
            ("observed", bookings.0),
            ("assumed", bookings.1),
            ("reserved", bookings.2),
        ] {
            kinds
                .get_or_create(&Kind { kind: k.into() })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        books.register(
            "kubeshare_extender_bookings",
            "Allocations held, by kind",
            kinds,
        );
        let up = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
        up.set(i64::from(synced));
        books.register(
            "kubeshare_extender_synced",
            "Whether the node and pod watches have listed once",
            up,
        );
        let mut out = String::new();
        // Writing into a String cannot fail; one `# EOF` for the two registries.
        let _ = encode(&mut out, &self.registry);
        if let Some(body) = out.strip_suffix("# EOF\n") {
            out.truncate(body.len());
        }
        let _ = encode(&mut out, &books);
        out
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
            um_resident: 11,
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
            "kubeshare_extender_request_duration_seconds_bucket{le=\"0.0005\",verb=\"filter\"} 1"
        ));
        assert!(t.contains(
            "kubeshare_extender_request_duration_seconds_bucket{le=\"0.005\",verb=\"filter\"} 2"
        ));
        assert!(t.contains("kubeshare_gpu_allocated_share{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 500"));
        assert!(t.contains("kubeshare_extender_bookings{kind=\"reserved\"} 3"));
        assert!(t.contains("kubeshare_gpu_memory_allocated_bytes{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 7"));
        assert!(t.contains("kubeshare_gpu_memory_unified_resident_bytes{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 11"));
        assert!(t.contains("kubeshare_extender_synced 1"));
        assert_eq!(t.matches("# EOF").count(), 1, "{t}");
    }
}
