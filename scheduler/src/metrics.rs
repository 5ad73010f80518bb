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
    preemptions: Family<Outcome, Counter>,
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
        let preemptions = Family::<Outcome, Counter>::default();
        registry.register(
            "preemptions",
            "Preemptions for guaranteed pods, by outcome (evicted, blocked, failed, resumed after a restart)",
            preemptions.clone(),
        );
        Metrics {
            events_skipped,
            preemptions,
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
            "kubeshare_extender_preemptions_total" => {
                self.preemptions
                    .get_or_create(&Outcome { outcome: v })
                    .inc();
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
        let mut out = String::with_capacity(4096 + gpus.len() * GPU_SERIES_BYTES);
        // Writing into a String cannot fail; one `# EOF` for the whole text.
        let _ = encode(&mut out, &self.registry);
        strip_eof(&mut out);
        encode_gpu_gauges(&mut out, gpus);
        let mut books = Registry::default();
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
        let _ = encode(&mut out, &books);
        out
    }
}

fn strip_eof(out: &mut String) {
    if let Some(body) = out.strip_suffix("# EOF\n") {
        out.truncate(body.len());
    }
}

/// A per-GPU gauge: its name, help, unit (a suffix of the name) and value.
type GpuGauge = (
    &'static str,
    &'static str,
    Option<&'static str>,
    fn(&GpuUsage) -> u64,
);

/// About how many bytes the series of one GPU take (for the buffer's size).
const GPU_SERIES_BYTES: usize = GPU_GAUGES.len() * 160;

/// The per-GPU gauges (name, help, unit, value), written as prometheus-client writes
/// them. By hand because they are most of the text: through `Family` (a label set
/// cloned and hashed per series) a scrape took ~120 ms of the extender's CPU at
/// 8,000 GPUs (docs/extender.md, "One thread"). Label pods' bookings and what DRA
/// ResourceClaims hold are separate gauges: a GPU's whole load is their sum.
const GPU_GAUGES: [GpuGauge; 8] = [
    (
        "kubeshare_gpu_allocated_share",
        "Guaranteed share of the GPU booked by label pods, in thousandths",
        None,
        |g| u64::from(g.used_milli),
    ),
    (
        "kubeshare_gpu_memory_allocated",
        "GPU memory booked as device-mode pods' caps",
        Some("bytes"),
        |g| g.mem_used,
    ),
    (
        "kubeshare_gpu_memory_unified_resident",
        "GPU memory booked as unified-memory pods' resident shares (may overcommit: docs/um.md)",
        Some("bytes"),
        |g| g.um_resident,
    ),
    (
        "kubeshare_gpu_memory",
        "GPU memory capacity",
        Some("bytes"),
        |g| g.mem_total,
    ),
    (
        "kubeshare_gpu_pods",
        "Pods holding a share of the GPU",
        None,
        |g| u64::from(g.holders),
    ),
    (
        "kubeshare_gpu_claimed_share",
        "Share of the GPU held by DRA ResourceClaims of driver gpu.kubeshare.io, in thousandths",
        None,
        |g| u64::from(g.claimed_milli),
    ),
    (
        "kubeshare_gpu_memory_claimed",
        "GPU memory held by DRA ResourceClaims of driver gpu.kubeshare.io",
        Some("bytes"),
        |g| g.claimed_mem,
    ),
    (
        "kubeshare_gpu_claims",
        "DRA ResourceClaims holding a share of the GPU",
        None,
        |g| u64::from(g.claims),
    ),
];

fn encode_gpu_gauges(out: &mut String, gpus: &[GpuUsage]) {
    use std::fmt::Write;
    // The label sets, escaped once for all the families.
    let labels: Vec<String> = gpus
        .iter()
        .map(|g| {
            let mut l = String::with_capacity(128);
            let index = g.index.to_string();
            for (i, (k, v)) in [
                ("node", g.node.as_str()),
                ("gpu", index.as_str()),
                ("uuid", g.uuid.as_str()),
                ("model", g.model.as_str()),
            ]
            .into_iter()
            .enumerate()
            {
                if i > 0 {
                    l.push(',');
                }
                l.push_str(k);
                l.push_str("=\"");
                escape_label_value(&mut l, v);
                l.push('"');
            }
            l
        })
        .collect();
    for (name, help, unit, value) in GPU_GAUGES {
        let full = match unit {
            Some(u) => format!("{name}_{u}"),
            None => name.to_string(),
        };
        let _ = writeln!(out, "# HELP {full} {help}.");
        let _ = writeln!(out, "# TYPE {full} gauge");
        if let Some(u) = unit {
            let _ = writeln!(out, "# UNIT {full} {u}");
        }
        for (g, l) in gpus.iter().zip(&labels) {
            // The gauges are i64: a value past it reads as i64::MAX, as before.
            let v = i64::try_from(value(g)).unwrap_or(i64::MAX);
            let _ = writeln!(out, "{full}{{{l}}} {v}");
        }
    }
}

/// OpenMetrics label value escaping: backslash, double quote and newline.
fn escape_label_value(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct GpuLabels {
        node: String,
        gpu: String,
        uuid: String,
        model: String,
    }

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
            claimed_milli: 300,
            claimed_mem: 4 << 30,
            claims: 2,
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
        assert!(t.contains(
            "kubeshare_gpu_claimed_share{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 300"
        ));
        assert!(t.contains("kubeshare_gpu_memory_claimed_bytes{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 4294967296"));
        assert!(t.contains(
            "kubeshare_gpu_claims{node=\"n\\\"1\",gpu=\"2\",uuid=\"GPU-x\",model=\"M\"} 2"
        ));
        assert!(t.contains("kubeshare_extender_synced 1"));
        assert_eq!(t.matches("# EOF").count(), 1, "{t}");
    }

    /// The per-GPU gauges as prometheus-client's `Family` writes them (how `render`
    /// wrote them before they were written by hand).
    fn through_families(gpus: &[GpuUsage]) -> String {
        let mut r = Registry::default();
        for (name, help, unit, value) in GPU_GAUGES {
            let f = Family::<GpuLabels, Gauge<i64, std::sync::atomic::AtomicI64>>::default();
            for g in gpus {
                let l = GpuLabels {
                    node: g.node.clone(),
                    gpu: g.index.to_string(),
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                };
                f.get_or_create(&l)
                    .set(i64::try_from(value(g)).unwrap_or(i64::MAX));
            }
            match unit {
                Some("bytes") => r.register_with_unit(name, help, Unit::Bytes, f),
                Some(u) => panic!("unit {u} not mapped in the test"),
                None => r.register(name, help, f),
            }
        }
        let mut out = String::new();
        let _ = encode(&mut out, &r);
        strip_eof(&mut out);
        out
    }

    #[test]
    fn gpu_gauges_written_by_hand_are_what_prometheus_client_writes() {
        let gpu = |node: &str, index, model: &str, used_milli, mem_total| GpuUsage {
            node: node.into(),
            index,
            uuid: format!("GPU-{node}-{index}"),
            model: model.into(),
            used_milli,
            mem_used: 3 << 30,
            um_resident: 0,
            mem_total,
            holders: 2,
            claimed_milli: 1000 - used_milli,
            claimed_mem: 1 << 30,
            claims: 1,
        };
        let gpus = [
            gpu("n-1", 0, "NVIDIA-H100-80GB-HBM3", 1000, 85_899_345_920),
            gpu("n\"2\\x\ny", 7, "odd \"model\"", 0, u64::MAX),
            gpu("n-3", u32::MAX, "", 250, 0),
        ];
        let mut ours = String::new();
        encode_gpu_gauges(&mut ours, &gpus);
        let theirs = through_families(&gpus);
        // Families keep their series in a hash map: compare each family's lines as sets,
        // and the families in order.
        let blocks = |t: &str| -> Vec<Vec<String>> {
            let mut out: Vec<Vec<String>> = Vec::new();
            for line in t.lines() {
                if line.starts_with("# HELP") {
                    out.push(Vec::new());
                }
                if let Some(b) = out.last_mut() {
                    b.push(line.to_string());
                }
            }
            for b in &mut out {
                // Comments first, in order; then the series, sorted.
                b.sort_by_key(|l| {
                    (
                        !l.starts_with('#'),
                        if l.starts_with('#') {
                            String::new()
                        } else {
                            l.clone()
                        },
                    )
                });
            }
            out
        };
        assert_eq!(
            blocks(&ours),
            blocks(&theirs),
            "ours:\n{ours}\ntheirs:\n{theirs}"
        );
        assert_eq!(blocks(&ours).len(), GPU_GAUGES.len());
        assert!(ours.contains(r#"node="n\"2\\x\ny""#), "{ours}");
    }
}
