//! `backlog-bench`: the backlog reproduction of the allocation-record issue.
//!
//! On a running local cluster (hack/cluster.sh; `KUBESHARE_TEST_CLUSTER` names
//! its run dir) it creates N kwok nodes with G simulated GPUs each, stops the
//! kubeshare-scheduler process (SIGSTOP), creates P pods of one share while it
//! is stopped (a backlog, as after a scheduler restart or a big Job), resumes
//! it, optionally SIGKILLs the extender once mid-way and starts a new one, and
//! waits until every pod is bound. It then checks the API's records: no GPU
//! above 1.0, every bound pod with a record naming its node. Exit status 0 only
//! when that holds. hack/bench-backlog.sh runs it on fresh clusters.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use kubeshare_bench::check_books;
use kubeshare_bench::rig::{
    BENCH_LABEL, Extender, component_pid, create_gpu_nodes, create_namespace, list_all, signal,
};
use kubeshare_testkit::{Cluster, Identity};
use serde_json::json;

/// Reproduce the scheduling backlog and check that no GPU is booked above 1.0.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// kwok nodes to create.
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// Simulated GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Pods to create while the scheduler is stopped.
    #[arg(long, default_value_t = 2000)]
    pods: u32,
    /// gpu_request = gpu_limit of every pod.
    #[arg(long, default_value = "0.25")]
    share: String,
    /// SIGKILL the extender once this many pods are bound, then start a new one.
    #[arg(long)]
    kill_extender_at: Option<u32>,
    /// The extender binary to run.
    #[arg(long, default_value = "target/release/kubeshare-extender")]
    extender: PathBuf,
    /// Concurrent API calls while creating nodes and pods.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Give up waiting for the pods to be bound after this many seconds.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// Append the result as one JSON line to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Directory for the extender's logs (default: the cluster's logs dir).
    #[arg(long)]
    log_dir: Option<PathBuf>,
}

/// Bound and total, from one list of the bench's pods.
async fn count_bound(pods: &Api<Pod>) -> anyhow::Result<(usize, usize)> {
    let items = list_all(pods).await?;
    let bound = items
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        .count();
    Ok((bound, items.len()))
}

/// Lines of the kubeshare-scheduler's log that report an extender call cut off by its httpTimeout.
fn scheduler_timeouts(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("logs/kubeshare-scheduler.log"))
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("Client.Timeout") || l.contains("deadline exceeded"))
                .count()
        })
        .unwrap_or(0)
}

/// Waits until every pod of the backlog is bound (or the timeout), printing progress, and
/// kills and restarts the extender once `--kill-extender-at` pods are bound; returns how many
/// were bound when it was killed.
async fn drain(
    pods: &Api<Pod>,
    args: &Args,
    ext: &mut Extender,
    t: Instant,
) -> anyhow::Result<Option<usize>> {
    let mut killed_at = None;
    let mut last = (0, 0);
    let mut list_errors = 0;
    loop {
        // The apiserver is under load by design: a failed list is retried, not fatal.
        let (bound, total) = match count_bound(pods).await {
            Ok(c) => {
                list_errors = 0;
                c
            }
            Err(e) if list_errors < 20 => {
                list_errors += 1;
                eprintln!("backlog-bench: listing pods failed ({e}); retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Err(e) => return Err(e.context("listing pods failed 20 times in a row")),
        };
        if (bound, total) != last {
            eprintln!(
                "backlog-bench: {:6.1} s  {bound}/{total} bound",
                t.elapsed().as_secs_f64()
            );
            last = (bound, total);
        }
        if let Some(k) = args.kill_extender_at
            && killed_at.is_none()
            && bound as u32 >= k
        {
            ext.kill_and_restart()?;
            killed_at = Some(bound);
            eprintln!("backlog-bench: extender SIGKILLed at {bound} bound and restarted");
        }
        if bound == total {
            break;
        }
        if t.elapsed() > Duration::from_secs(args.timeout) {
            eprintln!("backlog-bench: timed out with {bound}/{total} bound");
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(killed_at)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cluster = Cluster::shared().context("no cluster: run under hack/with-cluster.sh")?;
    let admin = cluster.client(Identity::Admin).await?;
    let run_dir = cluster.run_dir().to_owned();
    let log_dir = args.log_dir.clone().unwrap_or(run_dir.join("logs"));
    std::fs::create_dir_all(&log_dir)?;

    let mut ext = Extender::start(
        &args.extender,
        cluster.kubeconfig(Identity::Extender)?,
        cluster.extender_port(),
        &log_dir.join("extender.log"),
    )?;

    // Nodes.
    let t = Instant::now();
    create_gpu_nodes(&admin, "backlog", args.nodes, args.gpus, args.concurrency).await?;
    eprintln!(
        "backlog-bench: {} nodes x {} GPUs ready in {:.1} s",
        args.nodes,
        args.gpus,
        t.elapsed().as_secs_f64()
    );

    // The backlog: pods created while the kubeshare scheduler is stopped.
    let ns_name = "backlog";
    create_namespace(&admin, ns_name).await?;
    let sched_pid = component_pid(&run_dir, "kubeshare-scheduler")?;
    signal(sched_pid, "STOP")?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns_name);
    let t = Instant::now();
    let created = stream::iter(0..args.pods)
        .map(|i| {
            let pods = pods.clone();
            let share = args.share.clone();
            async move {
                let p: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p-{i:05}"), "labels": {
                        "sharedgpu/gpu_request": share, "sharedgpu/gpu_limit": share}},
                    "spec": {
                        "schedulerName": "kubeshare-scheduler",
                        "nodeSelector": {BENCH_LABEL: "backlog"},
                        "containers": [{"name": "main", "image": "registry.invalid/cuda:1"}]
                    }
                }))?;
                pods.create(&PostParams::default(), &p).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.concurrency)
        .try_collect::<Vec<_>>()
        .await;
    // Resume the scheduler whatever happened, so the cluster can go down cleanly.
    signal(sched_pid, "CONT")?;
    created.context("creating pods")?;
    eprintln!(
        "backlog-bench: {} pods created in {:.1} s while the scheduler was stopped; resumed",
        args.pods,
        t.elapsed().as_secs_f64()
    );

    // Drain the backlog.
    let t = Instant::now();
    let killed_at = drain(&pods, &args, &mut ext, t).await?;
    let drain_s = t.elapsed().as_secs_f64();

    let all = match list_all(&pods).await {
        Ok(l) => l,
        Err(_) => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            list_all(&pods).await?
        }
    };
    let check = check_books(&all);
    let over = check.overcommitted();
    let mut per_share: BTreeMap<u32, usize> = BTreeMap::new();
    for m in check.booked_milli.values() {
        *per_share.entry(*m).or_default() += 1;
    }
    let result = json!({
        "nodes": args.nodes, "gpus_per_node": args.gpus, "pods": args.pods, "share": args.share,
        "kill_extender_at": args.kill_extender_at, "killed_at_bound": killed_at,
        "bound": check.bound, "pending": check.pending,
        "drain_seconds": (drain_s * 10.0).round() / 10.0,
        "pods_per_second": if drain_s > 0.0 { ((check.bound as f64 / drain_s) * 10.0).round() / 10.0 } else { 0.0 },
        "gpus_used": check.booked_milli.len(),
        "gpus_by_booked_milli": per_share,
        "max_gpu_booking": f64::from(check.max_milli()) / 1000.0,
        "gpus_over_one": over.len(),
        "bad_records": check.bad_records.len(),
        "scheduler_timeouts": scheduler_timeouts(&run_dir),
        "ok": check.ok(),
    });
    println!("{result}");
    for (uuid, m) in over.iter().take(20) {
        eprintln!(
            "backlog-bench: OVERCOMMIT {uuid} booked {:.3}",
            f64::from(*m) / 1000.0
        );
    }
    for why in check.bad_records.iter().take(20) {
        eprintln!("backlog-bench: BAD RECORD {why}");
    }
    if let Some(path) = &args.out {
        let mut f = OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(f, "{result}")?;
    }
    drop(ext);
    if !check.ok() {
        bail!(
            "backlog run failed: {} GPUs above 1.0 (max {:.3}), {} bad records, {} pending",
            over.len(),
            f64::from(check.max_milli()) / 1000.0,
            check.bad_records.len(),
            check.pending
        );
    }
    Ok(())
}
