//! The extender's edges: the axum routes, bind's API calls (annotations, then
//! the Binding, rolled back if it fails), pod events, and the watches that keep
//! the books.
//!
//! The placement decision runs under one mutex, with no `.await` while it is
//! held; API calls happen after the books are updated (bind books the GPUs as
//! assumed first, so two concurrent binds can never take the same share).

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Binding, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::events::{Event as KEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use kubeshare_api::Allocation;
use kubeshare_api::annotations;
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::convert::{node_inventory, pod_info_of};
use crate::metrics::Metrics;
use crate::placement::{Cluster, Config, FilterKind};
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
    /// Reported as the events' reporting instance (e.g. the pod name).
    pub instance: Option<String>,
}

/// Everything the handlers share.
pub struct Shared {
    cluster: Mutex<Cluster>,
    nodes_synced: AtomicBool,
    pods_synced: AtomicBool,
    pub metrics: Metrics,
    client: Option<Client>,
    recorder: Option<Recorder>,
    start: Instant,
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

const NOT_SYNCED: &str = "kubeshare extender is starting: node and pod state not yet synced";

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Cluster> {
        // A panic while holding the lock is a bug; the books are still usable.
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Whether both watches have listed once; no answer is given before.
    pub fn synced(&self) -> bool {
        self.nodes_synced.load(Ordering::Acquire) && self.pods_synced.load(Ordering::Acquire)
    }

    /// Marks the state synced without watches (the benchmark and tests of the pure path).
    pub fn mark_synced(&self) {
        self.nodes_synced.store(true, Ordering::Release);
        self.pods_synced.store(true, Ordering::Release);
    }

    /// Runs `f` on the books.
    pub fn with_cluster<R>(&self, f: impl FnOnce(&mut Cluster) -> R) -> R {
        f(&mut self.lock())
    }

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
        let out = self.lock().filter(&pod, &names, now);
        let mut r = ExtenderFilterResult::passing(args, &out.passed);
        r.failed_nodes = out.failed;
        r.failed_and_unresolvable_nodes = out.unresolvable;
        debug!(pod = %pod.name, ns = %pod.namespace, passed = out.passed.len(), kind = out.kind.as_str(), "filter");
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

    /// The bind verb: decide, write the annotations, create the Binding.
    pub async fn bind(&self, a: &ExtenderBindingArgs) -> Result<String, String> {
        if !self.synced() {
            return Err(NOT_SYNCED.into());
        }
        let client = self
            .client
            .clone()
            .ok_or_else(|| "extender has no Kubernetes client".to_string())?;
        let pods: Api<Pod> = Api::namespaced(client, &a.pod_namespace);
        if !self.lock().knows_pod(&a.pod_uid) {
            // The watch has not delivered it yet: read it.
            let p = pods
                .get(&a.pod_name)
                .await
                .map_err(|e| format!("reading pod {}/{}: {e}", a.pod_namespace, a.pod_name))?;
            let info = pod_info_of(&p);
            if info.uid != a.pod_uid {
                return Err(format!(
                    "pod {}/{} has uid {}, not {}",
                    a.pod_namespace, a.pod_name, info.uid, a.pod_uid
                ));
            }
            self.lock().note_pod(&info);
        }
        let now = self.now_ms();
        let decision = self.lock().bind(&a.pod_uid, &a.node, now)?;
        if let Some(alloc) = &decision.allocation
            && let Err(e) = write_annotations(&pods, a, Some(alloc)).await
        {
            self.lock().rollback(&a.pod_uid);
            return Err(format!("writing the allocation annotations: {e}"));
        }
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(a.pod_name.clone()),
                namespace: Some(a.pod_namespace.clone()),
                uid: Some(a.pod_uid.clone()),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(a.node.clone()),
                ..ObjectReference::default()
            },
        };
        let bound: Result<serde_json::Value, _> = pods
            .create_subresource("binding", &a.pod_name, &PostParams::default(), &binding)
            .await;
        if let Err(e) = bound {
            self.lock().rollback(&a.pod_uid);
            if decision.allocation.is_some()
                && let Err(e2) = write_annotations(&pods, a, None).await
            {
                warn!(pod = %a.pod_name, error = %e2, "could not remove the allocation annotations after a failed Binding");
            }
            return Err(format!("creating the Binding to {}: {e}", a.node));
        }
        Ok(decision.summary)
    }

    fn event(&self, a: &ExtenderBindingArgs, warning: bool, reason: &str, note: String) {
        let Some(rec) = self.recorder.clone() else {
            return;
        };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(a.pod_name.clone()),
            namespace: Some(a.pod_namespace.clone()),
            uid: Some(a.pod_uid.clone()),
            ..ObjectReference::default()
        };
        let ev = KEvent {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            // Events cap the note at 1 kB.
            note: Some(note.chars().take(1000).collect()),
            action: "Bind".into(),
            secondary: None,
        };
        tokio::spawn(async move {
            if let Err(e) = rec.publish(&ev, &reference).await {
                debug!(error = %e, "could not publish an event");
            }
        });
    }
}

/// Writes (or with `None`, removes) the allocation annotations, guarded by the pod's uid.
async fn write_annotations(
    pods: &Api<Pod>,
    a: &ExtenderBindingArgs,
    alloc: Option<&Allocation>,
) -> Result<(), kube::Error> {
    let anns: serde_json::Map<String, serde_json::Value> = match alloc {
        Some(al) => al
            .to_annotations()
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect(),
        None => [
            annotations::GPU_UUID,
            annotations::GPU_MEM,
            annotations::GPU_MODEL,
            annotations::NODE,
        ]
        .into_iter()
        .map(|k| (k.to_string(), serde_json::Value::Null))
        .collect(),
    };
    let patch = serde_json::json!({"metadata": {"uid": a.pod_uid, "annotations": anns}});
    pods.patch(&a.pod_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

async fn filter_h(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let t = Instant::now();
    let r = decode::<ExtenderArgs>("filter", &body).and_then(|a| s.filter(&a));
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
    let res = s.bind(&args).await;
    let out = match res {
        Ok(summary) => {
            info!(pod = %args.pod_name, ns = %args.pod_namespace, node = %args.node, %summary, "bound");
            s.event(&args, false, "GpuAllocated", format!("Allocated {summary}"));
            s.metrics.observe("bind", "bound", t.elapsed());
            ExtenderBindingResult::default()
        }
        Err(error) => {
            warn!(pod = %args.pod_name, ns = %args.pod_namespace, node = %args.node, %error, "bind failed");
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
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

impl Extender {
    /// State without watches or API client: for the benchmark and HTTP tests.
    pub fn offline(placement: Config) -> Extender {
        Extender::build(None, placement, None)
    }

    fn build(client: Option<Client>, placement: Config, instance: Option<String>) -> Extender {
        let recorder = client.clone().map(|c| {
            Recorder::new(
                c,
                Reporter {
                    controller: "kubeshare-scheduler-extender".into(),
                    instance,
                },
            )
        });
        Extender {
            shared: Arc::new(Shared {
                cluster: Mutex::new(Cluster::new(placement)),
                nodes_synced: AtomicBool::new(false),
                pods_synced: AtomicBool::new(false),
                metrics: Metrics::default(),
                client,
                recorder,
                start: Instant::now(),
            }),
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

    /// Watches nodes and pods, serves the extender until `shutdown` resolves.
    pub async fn run(
        client: Client,
        opts: ExtenderOptions,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let ext = Extender::build(Some(client.clone()), opts.placement, opts.instance);
        let nodes = tokio::spawn(watch_nodes(client.clone(), ext.shared.clone()));
        let pods = tokio::spawn(watch_pods(client, ext.shared.clone()));
        let served = serve(ext.router(), opts.listen, opts.tls, shutdown).await;
        nodes.abort();
        pods.abort();
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

async fn watch_nodes(client: Client, s: Arc<Shared>) {
    let api: Api<Node> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(n)) | Ok(Event::Apply(n)) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                let inv = node_inventory(&n);
                if let Err(e) = &inv {
                    warn!(node = %name, error = %e, "bad GPU inventory");
                }
                s.lock().apply_node(&name, inv);
                listed.insert(name);
            }
            Ok(Event::Delete(n)) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                s.lock().delete_node(&name);
            }
            Ok(Event::InitDone) => {
                s.lock().retain_nodes(&listed);
                if !s.nodes_synced.swap(true, Ordering::AcqRel) {
                    info!(nodes = listed.len(), "nodes synced");
                }
            }
            Err(e) => warn!(error = %e, "node watch error"),
        }
    }
}

async fn watch_pods(client: Client, s: Arc<Shared>) {
    let api: Api<Pod> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(p)) | Ok(Event::Apply(p)) => {
                let info = pod_info_of(&p);
                if let Err(e) = &info.allocation {
                    warn!(pod = %info.name, ns = %info.namespace, error = %e, "bad allocation annotations");
                }
                listed.insert(info.uid.clone());
                s.lock().apply_pod(&info);
            }
            Ok(Event::Delete(p)) => {
                let uid = p.metadata.uid.clone().unwrap_or_default();
                s.lock().delete_pod(&uid);
            }
            Ok(Event::InitDone) => {
                s.lock().retain_pods(&listed);
                if !s.pods_synced.swap(true, Ordering::AcqRel) {
                    let (o, a, r) = s.lock().booking_counts();
                    info!(
                        pods = listed.len(),
                        observed = o,
                        assumed = a,
                        reserved = r,
                        "pods synced; allocations rebuilt from annotations"
                    );
                }
            }
            Err(e) => warn!(error = %e, "pod watch error"),
        }
    }
}
