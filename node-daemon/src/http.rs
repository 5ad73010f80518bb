//! The daemon's HTTP endpoints: `/healthz` (the process serves), `/readyz` (the first
//! list of the node's pods is in and applied) and `/metrics` (Prometheus text).

use std::future::Future;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::daemon::Shared;

pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Shared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(shared);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %e, "HTTP server failed");
    }
}

async fn readyz(State(s): State<Shared>) -> impl IntoResponse {
    let synced = s.snapshot.lock().map(|g| g.synced).unwrap_or(false);
    if synced {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the first list of pods\n",
        )
    }
}

async fn metrics(State(s): State<Shared>) -> impl IntoResponse {
    let snap = s
        .snapshot
        .lock()
        .map(|g| g.clone())
        .unwrap_or_else(|e| e.into_inner().clone());
    let procs = s
        .procs
        .lock()
        .map(|g| g.clone())
        .unwrap_or_else(|e| e.into_inner().clone());
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::render(&snap, &procs, s.supervised),
    )
}
