//! What a scale run measures while it runs: the pods a watch has seen bound (and when the
//! last was), the control plane's CPU (per process, per second, at rest) and a Go component's
//! CPU profile. I/O at the edges of the bench binaries; the arithmetic on snapshots is pure.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::Mutex;

use crate::rig::cpu_snapshot;

/// Counts the pods of a namespace that a watch has seen bound, with the time of the last.
pub struct BindWatch {
    bound: Arc<AtomicUsize>,
    last: Arc<Mutex<Option<Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl BindWatch {
    pub fn start(pods: Api<Pod>) -> BindWatch {
        let bound = Arc::new(AtomicUsize::new(0));
        let last = Arc::new(Mutex::new(None));
        let (b, l) = (bound.clone(), last.clone());
        let task = tokio::spawn(async move {
            let mut seen = HashSet::new();
            let mut s = watcher(pods, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(ev) = s.next().await {
                let Ok(p) = ev else { continue };
                let is_bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
                if is_bound
                    && let Some(name) = p.metadata.name
                    && seen.insert(name)
                {
                    *l.lock().await = Some(Instant::now());
                    b.store(seen.len(), Ordering::Release);
                }
            }
        });
        BindWatch { bound, last, task }
    }

    /// How many pods the watch has seen bound so far.
    pub fn bound(&self) -> usize {
        self.bound.load(Ordering::Acquire)
    }

    /// Waits until `n` pods are bound; the time of the last bind.
    pub async fn wait(&self, n: usize, timeout: Duration) -> anyhow::Result<Instant> {
        let t = Instant::now();
        let mut shown = 0;
        loop {
            let b = self.bound.load(Ordering::Acquire);
            if b >= n {
                return (*self.last.lock().await).context("no bind time");
            }
            if t.elapsed() > timeout {
                bail!("only {b} of {n} pods bound after {} s", timeout.as_secs());
            }
            if b >= shown + n / 4 {
                eprintln!("scale-bench:   {b}/{n} bound");
                shown = b;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for BindWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How much each counter grew over a run, per pod; counters that grew by less than 0.05 per
/// pod are left out.
pub fn per_pod_growth(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    pods: u32,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| {
            let grew = v - before.get(k).copied().unwrap_or(0.0);
            (k.clone(), grew / f64::from(pods))
        })
        .filter(|(_, v)| *v >= 0.05)
        .collect()
}

/// The CPU ms each process used between two snapshots.
pub fn cpu_ms_used(
    before: &BTreeMap<String, Duration>,
    after: &BTreeMap<String, Duration>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(n, c)| {
            let used = c.saturating_sub(before.get(n).copied().unwrap_or_default());
            (n.clone(), used.as_secs_f64() * 1000.0)
        })
        .collect()
}

/// The apiserver's CPU profile over `seconds` (pprof's gzipped protobuf).
pub async fn apiserver_profile(admin: &Client, seconds: u32) -> anyhow::Result<Vec<u8>> {
    cpu_profile(admin, seconds)
        .await
        .context("reading the apiserver's profile (is KUBESHARE_APISERVER_PROFILING=true?)")
}

/// A Go component's CPU profile over `seconds`, from its /debug/pprof.
pub async fn cpu_profile(client: &Client, seconds: u32) -> anyhow::Result<Vec<u8>> {
    let req = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
        .body(Vec::new())
        .context("building the profile request")?;
    let mut body = client.request_stream(req).await?;
    let mut data = Vec::new();
    futures::AsyncReadExt::read_to_end(&mut body, &mut data).await?;
    Ok(data)
}

/// CPU the processes used together over the last second.
pub async fn cpu_per_second(pids: &BTreeMap<String, u32>) -> anyhow::Result<Duration> {
    let a = cpu_snapshot(pids)?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = cpu_snapshot(pids)?;
    Ok(b.iter()
        .map(|(n, t)| t.saturating_sub(a.get(n).copied().unwrap_or_default()))
        .sum())
}

/// The control plane's CPU per second at rest with the nodes (kwok's heartbeats,
/// leases): the least of three seconds.
pub async fn idle_cpu(pids: &BTreeMap<String, u32>) -> anyhow::Result<Duration> {
    let mut least = Duration::MAX;
    for _ in 0..3 {
        least = least.min(cpu_per_second(pids).await?);
    }
    Ok(least)
}

/// Waits until the processes are back near their rest level (the previous run's
/// deletions, garbage collection and timers settled), at most 30 s: a run must
/// not pay for the one before it.
pub async fn quiesce(pids: &BTreeMap<String, u32>, idle: Duration) -> anyhow::Result<()> {
    let t = Instant::now();
    let enough = idle + idle / 4 + Duration::from_millis(50);
    loop {
        let used = cpu_per_second(pids).await?;
        if used <= enough {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(30) {
            eprintln!(
                "scale-bench: the control plane still uses {used:?} of CPU per second (at rest {idle:?}); starting anyway"
            );
            return Ok(());
        }
    }
}
