//! `kubectl-sharedgpu`: lists Nodes and Pods from the current kubeconfig's cluster
//! and prints who holds which GPU. Installed on PATH, `kubectl sharedgpu` runs it.

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use kubectl_sharedgpu::{RenderOptions, render_table};

/// Show KubeShare's fractional GPU allocations: nodes x GPUs, each GPU's pods with
/// their guaranteed share (gpu_request), ceiling (gpu_limit) and memory, as bars.
///
/// Reads Nodes (annotation sharedgpu/inventory) and Pods (labels sharedgpu/* and the
/// allocation annotations the scheduler extender writes at bind). Read-only.
#[derive(Parser, Debug)]
#[command(name = "kubectl-sharedgpu", version, about, long_about)]
struct Args {
    /// Name of the scheduler that places KubeShare pods (the chart's `schedulerName`).
    #[arg(long, env = kubeshare_api::SCHEDULER_NAME_ENV, default_value = kubeshare_api::SCHEDULER_NAME)]
    scheduler_name: String,
    /// Only show pods of this namespace (GPU totals then count only them).
    /// Default: all namespaces.
    #[arg(short = 'n', long, conflicts_with = "all_namespaces")]
    namespace: Option<String>,

    /// Show pods of all namespaces (the default; kept for kubectl habits).
    #[arg(short = 'A', long)]
    all_namespaces: bool,

    /// Path to a kubeconfig file (default: $KUBECONFIG, then ~/.kube/config,
    /// then the in-cluster service account).
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,

    /// The kubeconfig context to use.
    #[arg(long)]
    context: Option<String>,

    /// Show full GPU UUIDs and the scheduler's whole message for pending pods.
    #[arg(short = 'w', long)]
    wide: bool,

    /// Do not read the node daemons' /metrics (through the apiserver's pod proxy) for
    /// the share each pod was delivered ("got").
    #[arg(long)]
    no_metrics: bool,
}

async fn client(args: &Args) -> anyhow::Result<Client> {
    let opts = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &opts).await?
        }
        None if args.context.is_some() => Config::from_kubeconfig(&opts).await?,
        None => Config::infer().await.context("finding a kubeconfig")?,
    };
    Client::try_from(config).context("building the Kubernetes client")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kubeshare_api::set_scheduler_name(&args.scheduler_name).context("--scheduler-name")?;
    tracing_subscriber::fmt()
        // Colour only on a terminal: logs piped to a file or a container log stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();

    // kube's TLS uses rustls's process-wide provider; name ring, so a dependency
    // that also compiles aws-lc-rs cannot leave the choice ambiguous.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = client(&args).await?;
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .context("listing nodes")?;
    let pods_api: Api<Pod> = match &args.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let pods = pods_api
        .list(&ListParams::default())
        .await
        .context("listing pods")?;
    tracing::debug!(nodes = nodes.items.len(), pods = pods.items.len(), "listed");
    let delivered = if args.no_metrics {
        Default::default()
    } else {
        kubectl_sharedgpu::delivered::read(&client).await
    };
    let opts = RenderOptions {
        wide: args.wide,
        delivered,
    };
    print!("{}", render_table(&nodes.items, &pods.items, opts));
    Ok(())
}
