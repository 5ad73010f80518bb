//! The extender's HTTP edge: the axum routes, the verbs' decisions on the
//! shared state (`state.rs`), `/readyz`, and serving (HTTP or HTTPS). Bind's
//! API calls live in `binding.rs`, the watches and the timer in `tasks.rs`.
//!
//! The placement decision runs under one mutex, with no `.await` while it is
//! held; API calls happen after the books are updated (bind books the GPUs as
//! assumed first, so two concurrent binds can never take the same share).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use kube::Client;
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::error::NOT_SYNCED;
use crate::placement::{Config, FilterKind};
use crate::state::{Shared, Timing};
use crate::wire::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
};

/// PEM files of the serving certificate (chain) and its key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How the extender runs.
#[derive(Debug, Clone)]
pub struct ExtenderOptions {
    pub listen: SocketAddr,
    /// Serve HTTPS (scheduler config `enableHTTPS: true`) instead of HTTP.
    pub tls: Option<TlsFiles>,
    pub placement: Config,
    pub timing: Timing,
    /// Reported as the events' reporting instance (e.g. the pod name).
    pub instance: Option<String>,
}

/// Handle to the shared state, for the binary, the tests and the benchmark.
#[derive(Clone)]
pub struct Extender {
    pub shared: Arc<Shared>,
}

/// A malformed request: HTTP 400 with this message.
#[derive(Debug)]
pub struct BadRequest(pub String);

impl IntoResponse for BadRequest {
    fn into_response(self) -> Response {
        (StatusCode::BAD_REQUEST, self.0).into_response()
    }
}

fn json<T: Serialize>(v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(b) => ([(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn decode<T: serde::de::DeserializeOwned>(verb: &str, body: &[u8]) -> Result<T, BadRequest> {
    serde_json::from_slice(body)
        .map_err(|e| BadRequest(format!("{verb}: malformed request body: {e}")))
}

/// The verbs' decisions, on the shared state.
impl Shared {
    /// The filter verb's decision.
    pub fn filter(
        &self,
        args: &ExtenderArgs,
    ) -> Result<(ExtenderFilterResult, FilterKind), BadRequest> {
        let pod = args
            .pod
            .as_ref()
            .ok_or_else(|| BadRequest("filter: request has no Pod".into()))?
            .info();
        let names = args.candidate_names();
        if !self.synced() {
            let r = ExtenderFilterResult {
                error: NOT_SYNCED.into(),
                ..ExtenderFilterResult::default()
            };
            return Ok((r, FilterKind::NoFit));
        }
        let now = self.now_ms();
        let out = {
            let mut c = self.lock();
            self.resume(&mut c);
            let mut out = c.filter(&pod, &names, now);
            // Preemption needs the API (evictions): not for an offline extender.
            if matches!(out.kind, FilterKind::NoFit | FilterKind::GroupWaiting)
                && self.client.is_some()
                && let Some(order) = c.preempt(&pod, &names, now, &mut out)
            {
                self.preempt_orders
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(order);
            }
            out
        };
        let passed = out.passed.len();
        let mut r = ExtenderFilterResult::passing(args, out.passed);
        r.failed_nodes = out.failed;
        r.failed_and_unresolvable_nodes = out.unresolvable;
        debug!(pod = %pod.name, ns = %pod.namespace, passed, kind = out.kind.as_str(), "filter");
        Ok((r, out.kind))
    }

    /// The prioritize verb's decision.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Result<Vec<HostPriority>, BadRequest> {
        let pod = args
            .pod
            .as_ref()
            .ok_or_else(|| BadRequest("prioritize: request has no Pod".into()))?
            .info();
        let names = args.candidate_names();
        let scores = self.lock().prioritize(&pod, &names);
        Ok(scores
            .into_iter()
            .map(|(host, score)| HostPriority { host, score })
            .collect())
    }

    fn event(&self, a: &ExtenderBindingArgs, warning: bool, reason: &str, note: String) {
        self.pod_event(
            (&a.pod_namespace, &a.pod_name, &a.pod_uid),
            warning,
            reason,
            "Bind",
            note,
        );
    }
}

async fn filter_h(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let t = Instant::now();
    let args = decode::<ExtenderArgs>("filter", &body);
    if args.is_ok() {
        // Before the decision, so that it is made from the books as they are then.
        let (after, max) = (s.timing.filter_hold_after, s.timing.filter_hold_max);
        let held = s.api_queue.wait_for_room(after, max).await;
        if !held.is_zero() {
            let outcome = if held >= max { "gave_up" } else { "held" };
            s.metrics.observe("filter_hold", outcome, held);
        }
    }
    let r = args.and_then(|a| s.filter(&a));
    crate::preemption::carry_out_orders(&s);
    match r {
        Ok((res, kind)) => {
            let outcome = if res.error.is_empty() {
                kind.as_str()
            } else {
                "not_synced"
            };
            s.metrics.observe("filter", outcome, t.elapsed());
            json(&res)
        }
        Err(e) => {
            s.metrics.observe("filter", "bad_request", t.elapsed());
            e.into_response()
        }
    }
}

async fn prioritize_h(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let t = Instant::now();
    match decode::<ExtenderArgs>("prioritize", &body).and_then(|a| s.prioritize(&a)) {
        Ok(res) => {
            s.metrics.observe("prioritize", "ok", t.elapsed());
            json(&res)
        }
        Err(e) => {
            s.metrics.observe("prioritize", "bad_request", t.elapsed());
            e.into_response()
        }
    }
}

async fn bind_h(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let t = Instant::now();
    let args: ExtenderBindingArgs = match decode("bind", &body) {
        Ok(a) => a,
        Err(e) => {
            s.metrics.observe("bind", "bad_request", t.elapsed());
            return e.into_response();
        }
    };
    let res = crate::binding::bind(&s, &args).await;
    let out = match res {
        Ok(summary) => {
            info!(pod = %args.pod_name, ns = %args.pod_namespace, node = %args.node, %summary, "bound");
            if s.allocated_event_allowed() {
                s.event(&args, false, "GpuAllocated", format!("Allocated {summary}"));
            } else {
                s.metrics
                    .count("kubeshare_extender_events_skipped_total", "GpuAllocated");
            }
            s.metrics.observe("bind", "bound", t.elapsed());
            ExtenderBindingResult::default()
        }
        Err(error) => {
            warn!(pod = %args.pod_name, ns = %args.pod_namespace, node = %args.node, %error, "bind failed");
            let error = error.to_string();
            s.event(&args, true, "GpuBindFailed", error.clone());
            s.metrics.observe("bind", "failed", t.elapsed());
            ExtenderBindingResult { error }
        }
    };
    json(&out)
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    if s.synced() {
        "ok".into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, NOT_SYNCED).into_response()
    }
}

async fn metrics_h(State(s): State<Arc<Shared>>) -> Response {
    let (usage, counts) = s.with_cluster(|c| (c.usage(), c.booking_counts()));
    let body = s.metrics.render(&usage, counts, s.synced());
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body).into_response()
}

impl Extender {
    /// State without watches or API client: for the benchmark and HTTP tests.
    pub fn offline(placement: Config) -> Extender {
        Extender::build(None, placement, Timing::default(), None)
    }

    fn build(
        client: Option<Client>,
        placement: Config,
        timing: Timing,
        instance: Option<String>,
    ) -> Extender {
        Extender {
            shared: Arc::new(Shared::new(client, placement, timing, instance)),
        }
    }

    /// The HTTP routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/filter", post(filter_h))
            .route("/prioritize", post(prioritize_h))
            .route("/bind", post(bind_h))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .route("/metrics", get(metrics_h))
            .with_state(self.shared.clone())
    }

    /// Watches nodes and pods, runs the timer, serves the extender until
    /// `shutdown` resolves. `config`'s built-in retries are turned off for the
    /// API calls (bind's own retries end before its deadline).
    pub async fn run(
        config: kube::Config,
        opts: ExtenderOptions,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let watch_client =
            Client::try_from(config.clone()).context("building the Kubernetes client")?;
        let mut api_config = config;
        api_config.default_retry = false;
        let api_client = Client::try_from(api_config).context("building the Kubernetes client")?;
        let ext = Extender::build(Some(api_client), opts.placement, opts.timing, opts.instance);
        let tasks = crate::tasks::start(watch_client, ext.shared.clone());
        let served = serve(ext.router(), opts.listen, opts.tls, shutdown).await;
        for t in tasks {
            t.abort();
        }
        served
    }
}

/// Serves `router` on `listen` (HTTPS with `tls`) until `shutdown` resolves,
/// then lets in-flight requests finish.
pub async fn serve(
    router: Router,
    listen: SocketAddr,
    tls: Option<TlsFiles>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    match tls {
        None => {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"))?
                .tap_io(|tcp| {
                    // Small JSON replies should not wait for Nagle.
                    let _ = tcp.set_nodelay(true);
                });
            info!(addr = %listen, "kubeshare extender listening (HTTP)");
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
                .context("serving HTTP")
        }
        Some(t) => {
            // kube uses ring; make it the process default (a no-op if already set).
            let _ = rustls::crypto::ring::default_provider().install_default();
            let cfg = axum_server::tls_rustls::RustlsConfig::from_pem_file(&t.cert, &t.key)
                .await
                .with_context(|| {
                    format!(
                        "loading TLS files {} and {}",
                        t.cert.display(),
                        t.key.display()
                    )
                })?;
            let handle = axum_server::Handle::new();
            let h = handle.clone();
            tokio::spawn(async move {
                shutdown.await;
                h.graceful_shutdown(Some(std::time::Duration::from_secs(10)));
            });
            info!(addr = %listen, "kubeshare extender listening (HTTPS)");
            axum_server::bind_rustls(listen, cfg)
                .handle(handle)
                .serve(router.into_make_service())
                .await
                .context("serving HTTPS")
        }
    }
}
