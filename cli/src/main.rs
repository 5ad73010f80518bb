//! `kubectl-sharedgpu`: lists Nodes and Pods from the current kubeconfig's cluster
//! and prints who holds which GPU. Installed on PATH, `kubectl sharedgpu` runs it.

use std::time::Duration;

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

/// Where the node daemons run, and the port of their /metrics.
const KUBESHARE_NS: &str = "kubeshare-system";
const NODE_DAEMON_SELECTOR: &str = "app.kubernetes.io/name=kubeshare-node-daemon";
const METRICS_PORT: u16 = 9477;

/// Delivered shares from every node daemon that answers within a few seconds. Best
/// effort: without the rights (pods/proxy in kubeshare-system) or with a daemon down,
/// the table is shown without them.
async fn delivered(client: &Client) -> kubectl_sharedgpu::delivered::Delivered {
    let daemons: Api<Pod> = Api::namespaced(client.clone(), KUBESHARE_NS);
    let list = match daemons
        .list(&ListParams::default().labels(NODE_DAEMON_SELECTOR))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            tracing::debug!(error = %e, "cannot list the node daemons; no delivered shares");
            return Default::default();
        }
    };
    let fetches = list
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .map(|name| {
            let client = client.clone();
            async move {
                let req = http::Request::get(format!(
                    "/api/v1/namespaces/{KUBESHARE_NS}/pods/{name}:{METRICS_PORT}/proxy/metrics"
                ))
                .body(Vec::new())
                .ok()?;
                match tokio::time::timeout(Duration::from_secs(3), client.request_text(req)).await {
                    Ok(Ok(text)) => Some(kubectl_sharedgpu::delivered::parse(&text)),
                    Ok(Err(e)) => {
                        tracing::debug!(daemon = %name, error = %e, "metrics unreadable");
                        None
                    }
                    Err(_) => {
                        tracing::debug!(daemon = %name, "metrics timed out");
                        None
                    }
                }
            }
        });
    futures::future::join_all(fetches)
        .await
        .into_iter()
        .flatten()
        .flatten()
        .collect()
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
    tracing_subscriber::fmt()
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
        delivered(&client).await
    };
    let opts = RenderOptions {
        wide: args.wide,
        delivered,
    };
    print!("{}", render_table(&nodes.items, &pods.items, opts));
    Ok(())
}
