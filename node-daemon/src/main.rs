//! `kubeshare-node-daemon`: the command line around [`kubeshare_node_daemon::daemon::run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use kubeshare_node_daemon::daemon::{self, Config, DevicePluginWatch, GuardConfig};
use kubeshare_node_daemon::disk::Layout;
use kubeshare_node_daemon::nvml::DEFAULT_LIBRARY;
use kubeshare_node_daemon::source::InventorySource;
use kubeshare_node_daemon::supervisor::GemSchdCommand;

/// KubeShare node daemon: publishes the node's GPUs on its Node, writes one Gemini
/// resource-config per GPU from the pods bound to the node, and runs one gem-schd per GPU.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Name of the Node this daemon serves.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,

    /// Host directory holding lib/, gpus/<uuid>/ and pods/<pod-uid>/.
    #[arg(long, default_value = kubeshare_api::layout::DEFAULT_ROOT)]
    root: PathBuf,

    /// Fake mode: read the inventory from this file (the JSON of the Node annotation
    /// sharedgpu/inventory) instead of NVML. Re-read on every resync.
    #[arg(long, value_name = "FILE")]
    fake_inventory: Option<PathBuf>,

    /// NVML library to load at run time.
    #[arg(long, default_value = DEFAULT_LIBRARY, value_name = "PATH")]
    nvml_library: PathBuf,

    /// Install this file as <root>/lib/libgemhook.so.1 (skipped when identical).
    #[arg(long, value_name = "PATH")]
    hook_lib: Option<PathBuf>,

    /// Run and supervise this gem-schd binary, one process per GPU. Without it the
    /// daemon only writes the configs.
    #[arg(long, value_name = "PATH")]
    gem_schd: Option<PathBuf>,

    /// Extra argument appended to every gem-schd command line (repeatable).
    #[arg(long = "gem-schd-arg", value_name = "ARG", allow_hyphen_values = true)]
    gem_schd_args: Vec<String>,

    /// gem-schd refuses a connection to a pod's socket from a process that does not run in
    /// that pod (by its cgroups): a process that reaches another pod's socket cannot spend
    /// that pod's share. Needs the host's PID namespace (the chart's hostPID) to see the
    /// clients' processes. `false` only where sockets are reached from outside pods.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    verify_pod_peers: bool,

    /// Seconds between checks of GPU use that gem-schd does not gate: its refusals at pods'
    /// sockets, and the processes the driver (NVML) lists on each GPU against those
    /// connected to its gem-schd (a stranger is reported after two checks in a row). 0 = off.
    #[arg(long, default_value_t = 3)]
    gpu_process_check_secs: u64,

    /// Evict a pod found with a process on a GPU that gem-schd does not know (it dropped
    /// the hook, or links its own driver). Off: an Event and a metric only.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    evict_untracked_gpu_pods: bool,

    /// Seconds between SIGTERM and SIGKILL when stopping a gem-schd.
    #[arg(long, default_value_t = 5)]
    stop_grace_secs: u64,

    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = "0.0.0.0:9477")]
    listen: SocketAddr,

    /// Seconds between full resyncs (inventory re-read, Node re-published, files repaired).
    #[arg(long, default_value_t = 30)]
    resync_secs: u64,

    /// Kubeconfig to use (default: $KUBECONFIG, ~/.kube/config, then in-cluster).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Put the taint kubeshare.io/gpu=shared:NoSchedule on the Node while it has GPUs, so
    /// that only KubeShare pods (which the webhook gives the toleration) are scheduled
    /// there. `--taint-node=false` leaves the Node's taints alone (docs/webhook.md).
    #[arg(long, env = "KUBESHARE_TAINT_NODE", default_value_t = true, action = clap::ArgAction::Set)]
    taint_node: bool,

    /// The kubelet's PodResources socket: which GPUs NVIDIA's device plugin gave whole
    /// to pods (published as held; the extender places no KubeShare pod on them). A node
    /// without it has none (docs/device-plugin.md).
    #[arg(long, default_value = kubeshare_api::layout::KUBELET_POD_RESOURCES_SOCKET, value_name = "PATH")]
    pod_resources_socket: PathBuf,

    /// Device-plugin resources whose devices are this node's GPUs (by UUID or index).
    #[arg(long = "device-plugin-resource", value_name = "NAME", default_values_t = kubeshare_node_daemon::held::DEFAULT_RESOURCES.iter().map(|s| s.to_string()).collect::<Vec<_>>())]
    device_plugin_resources: Vec<String>,

    /// Seconds between PodResources lists; 0 never asks.
    #[arg(long, default_value_t = 2)]
    pod_resources_interval_secs: u64,

    /// Print the discovered inventory as JSON and exit (no API access).
    #[arg(long)]
    print_inventory: bool,

    /// Publish the node's GPUs as a DRA ResourceSlice (driver gpu.kubeshare.io, shared
    /// through consumable capacity; Kubernetes 1.36+, docs/dra.md) and serve the kubelet
    /// plugin that prepares claims (CDI specs into --cdi-spec-dir, else /var/run/cdi).
    #[arg(long)]
    dra: bool,

    /// The kubelet's root directory (its --root-dir): with --dra, the kubelet plugin
    /// registers in plugins_registry/ and serves in plugins/gpu.kubeshare.io/ there.
    #[arg(long, default_value = kubeshare_kubelet_rpc::dra::KUBELET_ROOT, value_name = "DIR")]
    kubelet_root_dir: PathBuf,

    /// Write a CDI spec of kind kubeshare.io/gpu into this directory (e.g. /etc/cdi or
    /// /var/run/cdi, the runtime's cdi_spec_dirs), keep it current, and run the device
    /// plugin for kubeshare.io/gpu that hands its devices out; unset = off (docs/node.md,
    /// "CDI").
    #[arg(long, value_name = "DIR")]
    cdi_spec_dir: Option<PathBuf>,

    /// Host directory whose nvidia* device nodes the CDI spec names (a stand-in for /dev
    /// in tests; the container still sees /dev/nvidiaN).
    #[arg(long, default_value = kubeshare_node_daemon::cdi::generate::CONTAINER_DEV_DIR, value_name = "DIR")]
    cdi_dev_dir: PathBuf,

    /// Directories searched for the driver's libraries (libcuda, libnvidia-ml) that the CDI
    /// spec mounts into containers (repeatable; earlier wins).
    #[arg(long = "cdi-lib-dir", value_name = "DIR", default_values_t = kubeshare_node_daemon::cdi::host::DEFAULT_LIB_DIRS.iter().map(|s| s.to_string()).collect::<Vec<_>>())]
    cdi_lib_dirs: Vec<String>,

    /// With --cdi-spec-dir: the kubelet's device-plugin directory, where the device plugin
    /// for kubeshare.io/gpu registers (it answers each container of a KubeShare pod with
    /// the CDI devices of the pod's allocation record).
    #[arg(long, default_value = kubeshare_api::layout::KUBELET_DEVICE_PLUGIN_DIR, value_name = "DIR")]
    device_plugin_dir: PathBuf,

    /// Slots the device plugin advertises per GPU (one per container that asks; see
    /// cdi::select::DEFAULT_SLOTS_PER_GPU for why they must never run out).
    #[arg(long, default_value_t = kubeshare_node_daemon::cdi::select::DEFAULT_SLOTS_PER_GPU)]
    cdi_slots_per_gpu: u32,

    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Name of the scheduler that places KubeShare pods (the chart's `schedulerName`).
    #[arg(long, env = kubeshare_api::SCHEDULER_NAME_ENV, default_value = kubeshare_api::SCHEDULER_NAME)]
    scheduler_name: String,
}

fn init_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        // Colour only on a terminal: logs piped to a file or a container log stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        b.json().init();
    } else {
        b.init();
    }
}

async fn client(kubeconfig: Option<&PathBuf>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("bad kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no Kubernetes configuration found")?,
    };
    kube::Client::try_from(config).context("cannot build the Kubernetes client")
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the daemon");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

// One thread on purpose: gem-schd children get PR_SET_PDEATHSIG, which fires when the
// thread that forked them exits; the main thread lives as long as the daemon.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kubeshare_api::set_scheduler_name(&args.scheduler_name).context("--scheduler-name")?;
    init_tracing(args.log_json);
    // kube's TLS uses the process-wide rustls provider: name ring, so that another
    // provider compiled into the workspace cannot make the choice ambiguous.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let inventory = match &args.fake_inventory {
        Some(file) => InventorySource::Fake { file: file.clone() },
        None => InventorySource::Nvml {
            library: args.nvml_library.clone(),
        },
    };
    if args.print_inventory {
        let inv = inventory.load().context("GPU discovery failed")?;
        println!("{}", serde_json::to_string_pretty(&inv)?);
        return Ok(());
    }
    anyhow::ensure!(
        !args.node_name.is_empty(),
        "--node-name (or NODE_NAME) must not be empty"
    );
    let cfg = Config {
        node: args.node_name.clone(),
        layout: Layout::new(&args.root),
        inventory,
        hook_lib: args.hook_lib.clone(),
        gem_schd: args.gem_schd.clone().map(|binary| GemSchdCommand {
            binary,
            extra_args: args.gem_schd_args.clone(),
            grace: Duration::from_secs(args.stop_grace_secs),
            verify_pod_peers: args.verify_pod_peers,
        }),
        listen: args.listen,
        resync: Duration::from_secs(args.resync_secs.max(1)),
        taint: args.taint_node,
        device_plugins: (args.pod_resources_interval_secs > 0).then(|| DevicePluginWatch {
            socket: args.pod_resources_socket.clone(),
            resources: args.device_plugin_resources.clone(),
            interval: Duration::from_secs(args.pod_resources_interval_secs),
        }),
        guard: GuardConfig {
            every: (args.gpu_process_check_secs > 0)
                .then(|| Duration::from_secs(args.gpu_process_check_secs)),
            nvml_library: args.nvml_library.clone(),
            evict: args.evict_untracked_gpu_pods,
        },
    };
    let client = client(args.kubeconfig.as_ref()).await?;
    // Stops the daemon's loop and the DRA kubelet plugin together.
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let mut plugin = None;
    if args.dra {
        use kubeshare_node_daemon::dra::plugin as kp;
        let pcfg = kp::PluginConfig {
            node: args.node_name.clone(),
            cdi: kubeshare_node_daemon::cdi::host::CdiConfig {
                spec_dir: (args.cdi_spec_dir.clone())
                    .unwrap_or_else(|| PathBuf::from(kp::DEFAULT_SPEC_DIR)),
                dev_dir: args.cdi_dev_dir.clone(),
                lib_dirs: args.cdi_lib_dirs.iter().map(PathBuf::from).collect(),
                layout: cfg.layout.clone(),
            },
            inventory: cfg.inventory.clone(),
            checkpoint: kp::checkpoint_path(&cfg.layout),
            apply_timeout: Duration::from_secs(10),
        };
        let stopped = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        plugin = Some(kp::start(
            pcfg,
            &args.kubelet_root_dir,
            client.clone(),
            stopped,
        )?);
    }
    if args.dra {
        let (c, n, s, every) = (
            client.clone(),
            args.node_name.clone(),
            cfg.inventory.clone(),
            cfg.resync,
        );
        tokio::spawn(kubeshare_node_daemon::dra::run(c, n, s, every));
    }
    if let Some(spec_dir) = args.cdi_spec_dir.clone() {
        let cdi = kubeshare_node_daemon::cdi::host::CdiConfig {
            spec_dir,
            dev_dir: args.cdi_dev_dir.clone(),
            lib_dirs: args.cdi_lib_dirs.iter().map(PathBuf::from).collect(),
            layout: cfg.layout.clone(),
        };
        tokio::spawn(kubeshare_node_daemon::cdi::host::run(
            cdi,
            cfg.inventory.clone(),
            cfg.resync,
        ));
        let plugin = kubeshare_node_daemon::cdi::plugin::PluginConfig {
            node: args.node_name.clone(),
            dir: args.device_plugin_dir.clone(),
            resource: kubeshare_node_daemon::cdi::select::RESOURCE.into(),
            slots_per_gpu: args.cdi_slots_per_gpu,
            checkpoint: args
                .root
                .join(kubeshare_node_daemon::cdi::plugin::CHECKPOINT),
            inventory: cfg.inventory.clone(),
            resync: cfg.resync,
        };
        tokio::spawn(kubeshare_node_daemon::cdi::plugin::run(
            plugin,
            client.clone(),
        ));
    }
    let (task, claims) = plugin.map(|p| (p.task, (p.book, p.changes))).unzip();
    let shutdown = async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    };
    let result = daemon::run_with_claims(cfg, client, shutdown, claims).await;
    if let Some(task) = task {
        kubeshare_node_daemon::dra::plugin::join(task).await;
    }
    result
}
