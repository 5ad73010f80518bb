//! The API client of `hack/gpu-node.sh` (a single real GPU node, no kubectl): waits for the
//! control plane and the node, installs the rendered Helm chart (server-side apply), and
//! runs the node's scenarios against KubeShare, printing one JSON line per result.
//!
//!   kubeshare-gpu-scenarios --kubeconfig F wait-api | wait-node NAME | deploy FILE.. | status
//!   kubeshare-gpu-scenarios --kubeconfig F scenarios [--workload torch|fake] [--only a,b]
//!
//! The scenarios (docs/gpu-node.md): `shares` (0.3 / 0.7 on one GPU, each pod's GPU time),
//! `claims` (the same split with a ResourceClaim per pod, through KubeShare's DRA driver),
//! `memory` (a `gpu_mem` cap as seen by CUDA and nvidia-smi, and a clean OOM past it),
//! `no-gpu` (a pod without sharedgpu labels sees no GPU), `group` (a group Job of three
//! starts together and all compute), `free` (deleting a pod frees its share at once),
//! `daemon-restart` (replacing the node daemon's pod leaves running shares alone).

mod deploy;
mod pods;
mod report;
mod scenarios;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Control plane waits, chart install and scenarios of hack/gpu-node.sh")]
struct Cli {
    /// The admin kubeconfig (hack/gpu-node.sh: STATE/kubeconfig/admin.kubeconfig).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Wait until the apiserver is ready and kube-controller-manager has made the default
    /// ServiceAccount (its controllers run).
    WaitApi {
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
        /// Only the apiserver (before kube-controller-manager runs).
        #[arg(long)]
        apiserver_only: bool,
    },
    /// Wait until the Node is Ready.
    WaitNode {
        name: String,
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
    /// Apply the YAML documents of each file (server-side apply, Namespaces first), then
    /// wait until KubeShare is rolled out and the node daemon published the Node's GPUs.
    Deploy(deploy::DeployArgs),
    /// Pods of every namespace, Nodes and the latest warning Events (for a failed run).
    Status,
    /// Run the scenarios; exits non-zero when one fails.
    Scenarios(scenarios::ScenarioArgs),
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let client = kubeshare_testkit::client_from_kubeconfig(&cli.kubeconfig)
        .await
        .with_context(|| format!("kubeconfig {}", cli.kubeconfig.display()))?;
    match cli.cmd {
        Cmd::WaitApi {
            timeout_secs,
            apiserver_only,
        } => deploy::wait_api(&client, Duration::from_secs(timeout_secs), apiserver_only).await,
        Cmd::WaitNode { name, timeout_secs } => {
            deploy::wait_node(&client, &name, Duration::from_secs(timeout_secs)).await
        }
        Cmd::Deploy(args) => deploy::deploy(&client, &args).await,
        Cmd::Status => deploy::status(&client).await,
        Cmd::Scenarios(args) => {
            let failed = scenarios::run(&client, &args).await?;
            if failed > 0 {
                anyhow::bail!("{failed} scenario(s) failed");
            }
            Ok(())
        }
    }
}
