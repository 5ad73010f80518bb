//! The HTTPS server: axum on rustls (ring), `POST /mutate`, `POST /validate`,
//! `GET /healthz`, `GET /metrics`. The certificate and key are read from PEM files (a mounted Secret)
//! and reloaded when they change; admission is never served over plain HTTP.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::Handle;
use axum_server::tls_rustls::RustlsConfig;
use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;

use crate::admit::{AdmitOptions, Verdict};
pub use crate::metrics::{Outcome, Stats};
use crate::review::{Mode, answer_with};

/// An AdmissionReview carries the pod twice (object and oldObject); pods are at most
/// ~1.5 MB in etcd.
const BODY_LIMIT: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("loading TLS certificate {cert} / key {key}: {source}")]
    Tls {
        cert: PathBuf,
        key: PathBuf,
        source: std::io::Error,
    },
    #[error("watching {path} for certificate changes: {source}")]
    Watch {
        path: PathBuf,
        source: notify::Error,
    },
    #[error("serving on {addr}: {source}")]
    Serve {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the server stopped before it was listening")]
    NotListening,
}

/// Installs ring as rustls's process-wide provider (several crates could otherwise
/// leave two providers compiled in, and rustls then refuses to pick one).
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// What the handlers share.
#[derive(Clone)]
struct AppState {
    stats: Arc<Stats>,
    admit: Arc<AdmitOptions>,
}

/// The routes, without TLS.
pub fn router(stats: Arc<Stats>, admit: AdmitOptions) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/validate", post(validate))
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(AppState {
            stats,
            admit: Arc::new(admit),
        })
}

async fn mutate(State(st): State<AppState>, body: Bytes) -> Response {
    handle(&st, &body, Mode::Mutate)
}

async fn validate(State(st): State<AppState>, body: Bytes) -> Response {
    handle(&st, &body, Mode::Validate)
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        st.stats.render(),
    )
        .into_response()
}

fn handle(st: &AppState, body: &[u8], mode: Mode) -> Response {
    let stats = &st.stats;
    let start = Instant::now();
    match answer_with(body, mode, &st.admit) {
        Ok(a) => {
            let outcome = match &a.verdict {
                Verdict::Deny(_) => Outcome::Denied,
                Verdict::Allow { patch, .. } if patch.is_empty() => Outcome::Allowed,
                Verdict::Allow { .. } => Outcome::Patched,
            };
            stats.record(mode, outcome, start.elapsed());
            match &a.verdict {
                Verdict::Deny(d) => tracing::info!(
                    uid = %a.uid, op = %a.operation, kind = %a.kind, namespace = %a.namespace,
                    name = %a.name, code = d.code, message = %d.message, "denied"
                ),
                Verdict::Allow { patch, .. } => tracing::debug!(
                    uid = %a.uid, op = %a.operation, kind = %a.kind, namespace = %a.namespace,
                    name = %a.name, ops = patch.len(), ?mode, "allowed"
                ),
            }
            ([(header::CONTENT_TYPE, "application/json")], a.body).into_response()
        }
        Err(e) => {
            stats.record(mode, Outcome::Malformed, start.elapsed());
            tracing::warn!(error = %e, bytes = body.len(), ?mode, "malformed admission request");
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
    }
}

/// Where to listen and which PEM files to serve.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Fallback re-check of the files when no file event came (events can be lost on
    /// some volume types).
    pub poll: Duration,
    /// How admission is configured.
    pub admit: AdmitOptions,
}

/// A started server.
pub struct Running {
    pub addr: SocketAddr,
    pub stats: Arc<Stats>,
    pub handle: Handle<SocketAddr>,
    pub task: tokio::task::JoinHandle<Result<(), ServerError>>,
    _watcher: notify::RecommendedWatcher,
    reloader: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops accepting, lets requests in flight finish (up to `grace`), and waits.
    pub async fn shutdown(self, grace: Duration) -> Result<(), ServerError> {
        self.handle.graceful_shutdown(Some(grace));
        self.reloader.abort();
        match self.task.await {
            Ok(r) => r,
            Err(_) => Ok(()),
        }
    }
}

/// Binds, starts serving and watching the certificate files; returns once listening.
pub async fn start(cfg: ServeConfig) -> Result<Running, ServerError> {
    install_crypto_provider();
    let tls = RustlsConfig::from_pem_file(&cfg.cert, &cfg.key)
        .await
        .map_err(|source| ServerError::Tls {
            cert: cfg.cert.clone(),
            key: cfg.key.clone(),
            source,
        })?;

    let (tx, rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok_and(|e| !e.kind.is_access()) {
            let _ = tx.send(());
        }
    })
    .map_err(|source| ServerError::Watch {
        path: cfg.cert.clone(),
        source,
    })?;
    // Watch the directories: a Secret volume swaps a `..data` symlink, and editors or
    // `certs` replace files by rename, both invisible to a watch on the file itself.
    let mut dirs: Vec<&Path> = [cfg.cert.as_path(), cfg.key.as_path()]
        .iter()
        .map(|p| {
            p.parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
        })
        .collect();
    dirs.dedup();
    for d in dirs {
        watcher
            .watch(d, RecursiveMode::NonRecursive)
            .map_err(|source| ServerError::Watch {
                path: d.to_path_buf(),
                source,
            })?;
    }
    let stats = Arc::new(Stats::default());
    let reloader = tokio::spawn(reload_loop(tls.clone(), cfg.clone(), rx, stats.clone()));

    let handle: Handle<SocketAddr> = Handle::new();
    let server = axum_server::bind_rustls(cfg.listen, tls).handle(handle.clone());
    let app = router(stats.clone(), cfg.admit.clone());
    let listen = cfg.listen;
    let task = tokio::spawn(async move {
        server
            .serve(app.into_make_service())
            .await
            .map_err(|source| ServerError::Serve {
                addr: listen,
                source,
            })
    });
    let Some(addr) = handle.listening().await else {
        return match task.await {
            Ok(Err(e)) => Err(e),
            _ => Err(ServerError::NotListening),
        };
    };
    tracing::info!(%addr, cert = %cfg.cert.display(), key = %cfg.key.display(), "serving admission over TLS");
    Ok(Running {
        addr,
        stats,
        handle,
        task,
        _watcher: watcher,
        reloader,
    })
}

/// What identifies the current content of the files, cheaply.
fn stamp(cfg: &ServeConfig) -> Option<[(SystemTime, u64); 2]> {
    let one = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())))
    };
    Some([one(&cfg.cert)?, one(&cfg.key)?])
}

async fn reload_loop(
    tls: RustlsConfig,
    cfg: ServeConfig,
    mut rx: mpsc::UnboundedReceiver<()>,
    stats: Arc<Stats>,
) {
    const MAX_RETRIES: u32 = 10;
    let mut loaded = stamp(&cfg);
    let mut retries = 0u32;
    loop {
        let wait = if retries > 0 {
            Duration::from_millis(500)
        } else {
            cfg.poll
        };
        match tokio::time::timeout(wait, rx.recv()).await {
            Ok(Some(())) => {
                // Let a burst of events (key, then cert, then symlink) settle.
                tokio::time::sleep(Duration::from_millis(200)).await;
                while rx.try_recv().is_ok() {}
            }
            Ok(None) => return,
            Err(_) if retries == 0 && stamp(&cfg) == loaded => continue,
            Err(_) => {}
        }
        let now = stamp(&cfg);
        match tls.reload_from_pem_file(&cfg.cert, &cfg.key).await {
            Ok(()) => {
                if now != loaded {
                    tracing::info!(cert = %cfg.cert.display(), "reloaded TLS certificate");
                    stats.record_tls_reload(true);
                }
                loaded = now;
                retries = 0;
            }
            Err(e) if retries + 1 < MAX_RETRIES => {
                // A half-rotated pair (new key, old certificate): keep serving the old
                // one and try again shortly.
                retries += 1;
                stats.record_tls_reload(false);
                tracing::warn!(error = %e, cert = %cfg.cert.display(), "TLS reload failed; keeping the current certificate, retrying");
            }
            Err(e) => {
                retries = 0;
                loaded = now;
                stats.record_tls_reload(false);
                tracing::error!(error = %e, cert = %cfg.cert.display(), "TLS reload failed; keeping the current certificate until the files change again");
            }
        }
    }
}

/// Shared with the binary: a future that completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
