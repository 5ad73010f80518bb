//! The daemon's HTTP endpoints: `/healthz` (the process serves), `/readyz` (the first
//! list of the node's pods is in and applied) and `/metrics` (OpenMetrics text, with
//! gem-schd's usage reports read from disk at each scrape).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use kubeshare_api::UsageReport;

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
    let mut usage = BTreeMap::new();
    if let Some(layout) = &s.layout {
        for g in &snap.inventory.gpus {
            if procs.get(&g.uuid).is_some_and(|p| p.running)
                && let Some(r) = read_usage(&layout.usage(&g.uuid))
            {
                usage.insert(g.uuid.clone(), r);
            }
        }
    }
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        crate::metrics::render(&snap, &procs, s.supervised, &usage),
    )
}

/// gem-schd rewrites its report every second; one older than this is left out
/// (a stuck or stopped gem-schd must not show a share it no longer delivers).
const USAGE_MAX_AGE: Duration = Duration::from_secs(5);

pub(crate) fn read_usage(path: &Path) -> Option<UsageReport> {
    let age = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())?;
    if age > USAGE_MAX_AGE {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    match UsageReport::parse(&text) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "unreadable usage report");
            None
        }
    }
}
