//! `kubeshare-extender`: the HTTP scheduler extender that kube-scheduler's
//! `kubeshare-scheduler` profile calls (filter, prioritize, bind).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kubeshare_scheduler::{Config, Extender, ExtenderOptions, Timing, TlsFiles};
use tracing::info;
use tracing_subscriber::EnvFilter;

// A quarter of the extender's CPU at a backlog's pace was glibc's malloc and free
// (watch events decoded, requests served); mimalloc's thread-local free lists cost
// less (docs/extender.md, "The Bindings' queue: 64 API slots, back-pressure, and the
// allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// KubeShare's scheduler extender: picks the node and GPU(s) for sharedgpu pods.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Name of the scheduler that places KubeShare pods (the chart's `schedulerName`).
    #[arg(long, env = kubeshare_api::SCHEDULER_NAME_ENV, default_value = kubeshare_api::SCHEDULER_NAME)]
    scheduler_name: String,
    /// Address to serve the extender verbs, /healthz, /readyz and /metrics on.
    #[arg(
        long,
        env = "KUBESHARE_EXTENDER_LISTEN",
        default_value = "127.0.0.1:8888"
    )]
    listen: SocketAddr,
    /// Serve HTTPS with this PEM certificate (chain); needs --tls-key.
    #[arg(long, env = "KUBESHARE_EXTENDER_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KUBESHARE_EXTENDER_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, then in-cluster.
    #[arg(long, env = "KUBESHARE_EXTENDER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Seconds capacity reserved for an admitted group's members is held for them.
    #[arg(long, default_value_t = 30)]
    group_reservation_timeout: u64,
    /// How far unified-memory pods (`sharedgpu/gpu_mem_mode=unified`) may overcommit a
    /// GPU's memory with their resident shares: a factor from 1.0 (none) to 8.0 of what
    /// device-mode pods leave. Device-mode pods never overcommit (docs/um.md).
    #[arg(long, default_value = "1.5", value_parser = kubeshare_scheduler::um_fit::parse_factor)]
    um_overcommit: u32,
    /// Filter passes only the best N fitting nodes (0: every fitting node). With 1,
    /// kube-scheduler takes the extender's choice without scoring the nodes or
    /// calling prioritize; its own soft preferences (preferred affinity, spreading
    /// scores) then do not apply among GPU nodes, its hard constraints still do.
    #[arg(long, env = "KUBESHARE_EXTENDER_FILTER_TOP", default_value_t = 0)]
    filter_top: usize,
    /// Milliseconds a bind call may take, API retries and a group member's wait
    /// included; keep it below kube-scheduler's extender httpTimeout (10 s).
    #[arg(long, default_value_t = 8000)]
    bind_timeout_ms: u64,
    /// Milliseconds a group member's bind waits for the group's quorum to reach bind.
    #[arg(long, default_value_t = 5000)]
    gang_wait_ms: u64,
    /// Informational "GpuAllocated" events on bound pods, at most this many per second
    /// (burst 50; failures are always reported). A backlog binds far faster.
    #[arg(long, default_value_t = kubeshare_scheduler::state::ALLOCATED_EVENTS_PER_S)]
    allocated_events_per_second: f64,
    /// Seconds after which a bind not yet seen in the watch is checked with a GET.
    #[arg(long, default_value_t = 15)]
    assume_check: u64,
    /// Back-pressure: the filter verb holds a pod while the oldest API call (a
    /// Binding) has waited longer than this many milliseconds for one of the
    /// --api-concurrency slots (the backlog then waits in kube-scheduler's queue, not
    /// as bind calls that time out); 0 turns it off.
    #[arg(
        long,
        env = "KUBESHARE_EXTENDER_FILTER_HOLD_AFTER_MS",
        default_value_t = 2000
    )]
    filter_hold_after_ms: u64,
    /// The longest a filter call is held, milliseconds (below kube-scheduler's
    /// extender httpTimeout, like --bind-timeout-ms).
    #[arg(long, default_value_t = 3000)]
    filter_hold_max_ms: u64,
    /// Most concurrent API calls (Bindings, checks).
    #[arg(long, env = "KUBESHARE_EXTENDER_API_CONCURRENCY", default_value_t = 64)]
    api_concurrency: usize,
    /// Threads that run the extender's tasks: 1 (the default) runs everything on one
    /// thread, which measured cheaper than two work-stealing workers on a busy
    /// control-plane node (docs/extender.md, "One thread"); more for a very large
    /// cluster whose decisions should not wait behind the watches.
    #[arg(long, env = "KUBESHARE_EXTENDER_THREADS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: u16,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

async fn config(path: Option<&PathBuf>) -> anyhow::Result<kube::Config> {
    match path {
        None => kube::Config::infer()
            .await
            .context("no kubeconfig ($KUBECONFIG, ~/.kube/config) and not in a cluster"),
        Some(p) => {
            let kc =
                Kubeconfig::read_from(p).with_context(|| format!("reading {}", p.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading {}", p.display()))
        }
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
    info!("shutting down");
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(n))
            .enable_all()
            .build(),
    }
    .context("starting the runtime")?;
    runtime.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    kubeshare_api::set_scheduler_name(&args.scheduler_name).context("--scheduler-name")?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    if args.log_json {
        tracing_subscriber::fmt()
            // Colour only on a terminal: logs piped to a file or a container log stay plain.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt()
            // Colour only on a terminal: logs piped to a file or a container log stay plain.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_env_filter(filter)
            .init();
    }
    let config = config(args.kubeconfig.as_ref()).await?;
    if args.gang_wait_ms + 2000 > args.bind_timeout_ms {
        anyhow::bail!(
            "--gang-wait-ms must leave at least 2000 ms of --bind-timeout-ms for the Binding"
        );
    }
    if args.filter_hold_max_ms > args.bind_timeout_ms {
        anyhow::bail!(
            "--filter-hold-max-ms must not exceed --bind-timeout-ms (both are below httpTimeout)"
        );
    }
    let opts = ExtenderOptions {
        listen: args.listen,
        tls: match (args.tls_cert, args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            _ => None,
        },
        placement: Config {
            reservation_timeout_ms: args.group_reservation_timeout.saturating_mul(1000),
            um_overcommit_milli: args.um_overcommit,
            filter_top: args.filter_top,
        },
        timing: Timing {
            bind_timeout: Duration::from_millis(args.bind_timeout_ms),
            gang_wait: Duration::from_millis(args.gang_wait_ms),
            assume_check: Duration::from_secs(args.assume_check),
            api_concurrency: args.api_concurrency,
            allocated_events_per_s: args.allocated_events_per_second,
            filter_hold_after: Duration::from_millis(args.filter_hold_after_ms),
            filter_hold_max: Duration::from_millis(args.filter_hold_max_ms),
            ..Timing::default()
        },
        instance: std::env::var("POD_NAME").ok(),
    };
    Extender::run(config, opts, shutdown_signal()).await
}
