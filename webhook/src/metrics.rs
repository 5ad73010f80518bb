//! The webhook's Prometheus metrics (`GET /metrics`, OpenMetrics text through the
//! `prometheus-client` crate): admission requests by endpoint and outcome, how long
//! answering them took, and the serving certificate's reloads by result.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use crate::review::Mode;

/// What became of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Allowed without a patch.
    Allowed,
    /// Allowed with a patch.
    Patched,
    Denied,
    /// HTTP 400.
    Malformed,
}

impl Outcome {
    const ALL: [Outcome; 4] = [
        Outcome::Allowed,
        Outcome::Patched,
        Outcome::Denied,
        Outcome::Malformed,
    ];
    fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Patched => "patched",
            Outcome::Denied => "denied",
            Outcome::Malformed => "malformed",
        }
    }
}

fn endpoint(mode: Mode) -> &'static str {
    match mode {
        Mode::Mutate => "mutate",
        Mode::Validate => "validate",
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: &'static str,
}

fn reload_result(ok: bool) -> ReloadLabels {
    ReloadLabels {
        result: if ok { "ok" } else { "failed" },
    }
}

/// The webhook's metrics; cheap to update from every request.
#[derive(Debug)]
pub struct Stats {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    duration: Family<EndpointLabels, Histogram>,
    tls_reloads: Family<ReloadLabels, Counter>,
}

impl Default for Stats {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kubeshare_webhook");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Admission requests by endpoint and outcome",
            requests.clone(),
        );
        // 50 µs .. ~0.8 s: an answer is pure CPU work, the apiserver waits up to 5 s.
        let duration = Family::<EndpointLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(50e-6, 2.0, 15))
        });
        registry.register_with_unit(
            "request_duration",
            "Time to read, decide and encode one admission request",
            Unit::Seconds,
            duration.clone(),
        );
        let tls_reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "tls_reloads",
            "Reloads of the serving certificate after its files changed, by result (a failed one keeps the current certificate)",
            tls_reloads.clone(),
        );
        // Every series exists from the start, at 0, so rates work from the first scrape.
        for ok in [true, false] {
            let _ = tls_reloads.get_or_create(&reload_result(ok));
        }
        for mode in [Mode::Mutate, Mode::Validate] {
            for o in Outcome::ALL {
                let _ = requests.get_or_create(&RequestLabels {
                    endpoint: endpoint(mode),
                    outcome: o.label(),
                });
            }
            let _ = duration.get_or_create(&EndpointLabels {
                endpoint: endpoint(mode),
            });
        }
        Stats {
            registry,
            requests,
            duration,
            tls_reloads,
        }
    }
}

impl Stats {
    /// Counts one answered request and how long it took.
    pub fn record(&self, mode: Mode, outcome: Outcome, took: Duration) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint(mode),
                outcome: outcome.label(),
            })
            .inc();
        self.duration
            .get_or_create(&EndpointLabels {
                endpoint: endpoint(mode),
            })
            .observe(took.as_secs_f64());
    }

    /// Requests seen so far on `mode`'s endpoint with this outcome.
    pub fn get(&self, mode: Mode, outcome: Outcome) -> u64 {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint(mode),
                outcome: outcome.label(),
            })
            .get()
    }

    /// All requests seen on `mode`'s endpoint.
    pub fn total(&self, mode: Mode) -> u64 {
        Outcome::ALL.iter().map(|o| self.get(mode, *o)).sum()
    }

    /// Counts one reload of the serving certificate (`ok`: it now serves the new files).
    pub fn record_tls_reload(&self, ok: bool) {
        self.tls_reloads.get_or_create(&reload_result(ok)).inc();
    }

    /// Certificate reloads so far that succeeded (`ok`) or failed.
    pub fn tls_reloads(&self, ok: bool) -> u64 {
        self.tls_reloads.get_or_create(&reload_result(ok)).get()
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Stats::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_renders_by_endpoint_and_outcome() {
        let s = Stats::default();
        s.record(Mode::Mutate, Outcome::Patched, Duration::from_micros(120));
        s.record(Mode::Mutate, Outcome::Patched, Duration::from_micros(80));
        s.record(Mode::Validate, Outcome::Denied, Duration::from_millis(2));
        s.record_tls_reload(false);
        assert_eq!(s.get(Mode::Mutate, Outcome::Patched), 2);
        assert_eq!((s.tls_reloads(true), s.tls_reloads(false)), (0, 1));
        assert_eq!(s.total(Mode::Mutate), 2);
        assert_eq!(s.total(Mode::Validate), 1);
        let text = s.render();
        for want in [
            "kubeshare_webhook_requests_total{endpoint=\"mutate\",outcome=\"patched\"} 2",
            "kubeshare_webhook_requests_total{endpoint=\"validate\",outcome=\"denied\"} 1",
            "kubeshare_webhook_requests_total{endpoint=\"validate\",outcome=\"malformed\"} 0",
            "kubeshare_webhook_request_duration_seconds_count{endpoint=\"mutate\"} 2",
            "# UNIT kubeshare_webhook_request_duration_seconds seconds",
            "kubeshare_webhook_tls_reloads_total{result=\"ok\"} 0",
            "kubeshare_webhook_tls_reloads_total{result=\"failed\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "missing {want:?} in\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
