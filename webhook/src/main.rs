//! `kubeshare-webhook`: serve the admission webhook over TLS, or generate its
//! certificates.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use kubeshare_webhook::{certs, server};

#[derive(Parser)]
#[command(
    name = "kubeshare-webhook",
    version,
    about = "KubeShare admission webhook: validates sharedgpu/* labels and injects the GPU env, hook and volumes"
)]
struct Cli {
    /// Log format.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "text",
        env = "KUBESHARE_LOG_FORMAT"
    )]
    log_format: LogFormat,
    /// Name of the scheduler that places KubeShare pods (the chart's `schedulerName`).
    #[arg(long, global = true, env = kubeshare_api::SCHEDULER_NAME_ENV, default_value = kubeshare_api::SCHEDULER_NAME)]
    scheduler_name: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve POST /mutate, POST /validate, GET /healthz and GET /metrics over HTTPS.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:8443", env = "KUBESHARE_WEBHOOK_LISTEN")]
        listen: SocketAddr,
        /// Serving certificate (PEM, may hold a chain); reloaded when it changes.
        #[arg(long, default_value = "/tls/tls.crt", env = "KUBESHARE_WEBHOOK_CERT")]
        cert: PathBuf,
        /// Private key of the serving certificate (PEM).
        #[arg(long, default_value = "/tls/tls.key", env = "KUBESHARE_WEBHOOK_KEY")]
        key: PathBuf,
        /// Seconds between fallback checks of the certificate files.
        #[arg(long, default_value_t = 30)]
        poll_seconds: u64,
        /// Seconds to let requests in flight finish on SIGTERM.
        #[arg(long, default_value_t = 10)]
        grace_seconds: u64,
        /// Ask for this device-plugin resource (one per container) in each container that
        /// gets the allocation's GPUs, and refuse it in every other container: the node
        /// daemon's device plugin then hands the container its GPUs as CDI devices
        /// (kubeshare.io/gpu; docs/node.md, "CDI"). Unset: not asked for.
        #[arg(long, value_name = "NAME", env = "KUBESHARE_WEBHOOK_GPU_RESOURCE")]
        gpu_resource: Option<String>,
    },
    /// Generate a CA and a serving certificate; print the caBundle (base64 CA PEM).
    Certs {
        /// DNS name for the certificate (repeatable), e.g.
        /// kubeshare-webhook.kubeshare-system.svc
        #[arg(long = "dns")]
        dns: Vec<String>,
        /// IP address for the certificate (repeatable), e.g. 127.0.0.1
        #[arg(long = "ip")]
        ips: Vec<IpAddr>,
        /// Output directory: ca.crt, ca.key, tls.crt, tls.key.
        #[arg(long)]
        out: PathBuf,
        /// Validity of the serving certificate, days.
        #[arg(long, default_value_t = 365)]
        days: u64,
        /// Sign with OUT/ca.crt + OUT/ca.key (made by this command) instead of a new
        /// CA, so the caBundle stays the same.
        #[arg(long)]
        reuse_ca: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kubeshare_api::set_scheduler_name(&cli.scheduler_name).context("--scheduler-name")?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        // Colour only on a terminal: logs piped to a file or a container log stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    server::install_crypto_provider();
    match cli.command {
        Command::Serve {
            listen,
            cert,
            key,
            poll_seconds,
            grace_seconds,
            gpu_resource,
        } => {
            let rt = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
            rt.block_on(async move {
                let running = server::start(server::ServeConfig {
                    listen,
                    cert,
                    key,
                    poll: Duration::from_secs(poll_seconds.max(1)),
                    admit: kubeshare_webhook::admit::AdmitOptions { gpu_resource },
                })
                .await?;
                server::shutdown_signal().await;
                tracing::info!("shutting down");
                running.shutdown(Duration::from_secs(grace_seconds)).await?;
                anyhow::Ok(())
            })
        }
        Command::Certs {
            dns,
            ips,
            out,
            days,
            reuse_ca,
        } => {
            let files = certs::generate(
                &certs::CertRequest {
                    dns,
                    ips,
                    days,
                    reuse_ca,
                },
                &out,
            )
            .with_context(|| format!("generating certificates in {}", out.display()))?;
            tracing::info!(dir = %files.dir.display(), "wrote ca.crt, ca.key, tls.crt, tls.key");
            println!("{}", files.ca_bundle());
            Ok(())
        }
    }
}
