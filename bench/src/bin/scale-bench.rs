//! `scale-bench`: scheduling throughput and control-plane CPU per pod of the
//! KubeShare profile against the default scheduler, side by side on one
//! cluster.
//!
//! On a running local cluster (hack/bench-scale.sh starts one with both
//! schedulers' client limits raised alike) it creates N kwok nodes with G
//! simulated GPUs each, then, per round, runs each configuration in each mode:
//!
//! - `a2`: plain pods, `default-scheduler` (the default profile);
//! - `b`: GPU pods (`gpu_request = gpu_limit = --share`), `kubeshare-scheduler`
//!   (filter, prioritize and bind through the extender);
//! - `c`: plain pods, `kubeshare-scheduler` (the extender passes them through);
//! - `a2p` (only when asked for): `a2` with pods the size of `b`'s after its bind
//!   (its labels and a record's annotations, under a prefix the extender ignores);
//! - `b1` (only when asked for): `b` with the scheduler's mark at 1, its quantity
//!   before 4ee04fa, as the control for the zero (`kubeshare_api::GPU_POD_MARK`);
//! - `b2` (only when asked for): `b` served by the extender restarted on two worker
//!   threads (`--threads 2`, its runtime before the one-thread default), the control
//!   for that default; the extender is restarted with its defaults after the run;
//! - `dra`, `drac` (only when asked for; hack/bench-dra.sh): pods that claim a GPU share
//!   through DRA, allocated by `default-scheduler` on the slices the node daemon's code
//!   builds (published here for the kwok nodes); `dra`'s claims come from a template,
//!   `drac`'s are created by the bench. Each run ends with the check of the claims'
//!   allocation results (no device's `compute` above 1000, every pod's claim on its node);
//!
//! `stream`: `--clients` concurrent clients create the pods as fast as the
//! apiserver takes them; `backlog`: the pods are created while that scheduler is
//! stopped (SIGSTOP), then it is resumed. Pods/s = pods / (last bind seen by a
//! watch − first create, or the resume). CPU per pod = the CPU time the
//! control-plane processes (etcd, apiserver, controller-manager, both
//! schedulers, the extender; not kwok, which plays the kubelets) used during the
//! run / pods (kwok's and this bench's own CPU are reported beside it, uncharged:
//! they share the two cores). Every `b` run ends with the check of the API's records (no GPU
//! above 1.0, every bound pod with its record); the bench fails if one fails.
//! Each run's pods are deleted (and gone) before the next run starts, and a run
//! starts once the processes are back near their CPU at rest (measured after the
//! nodes are ready, reported as `idle_cpu_ms_per_s`; at most 30 s of waiting).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use kubeshare_api::{GPU_POD_MARK, GPU_POD_RESOURCE};
use kubeshare_bench::measure::{
    BindWatch, apiserver_profile, cpu_ms_used, cpu_profile, idle_cpu, per_pod_growth, quiesce,
};
use kubeshare_bench::rig::{
    BENCH_LABEL, Extender, MachineCpu, SpeedProbe, api_requests, apiserver_metrics, component_pid,
    cpu_snapshot, create_gpu_nodes, create_namespace, extender_metrics, histogram_sums, list_all,
    metrics_text, rss, scheduler_client, signal, tcp_passive_opens, watch_events,
};
use kubeshare_bench::{check_books, dra};
use kubeshare_testkit::{Cluster, Identity};
use serde_json::json;

/// The control-plane processes whose CPU time a run is charged.
const CONTROL_PLANE: [&str; 5] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubeshare-scheduler",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Config {
    A2,
    /// `a2` with pods the size of `b`'s: its labels and a record's annotations under
    /// another prefix (the extender ignores them), created with the annotations.
    A2p,
    B,
    /// `b` with the mark's quantity before 4ee04fa (1 instead of the webhook's 0):
    /// kube-scheduler's resource fit then checks the resource's name on every node it
    /// searches. The control for that change.
    B1,
    /// `b` with the extender on two work-stealing worker threads (`--threads 2`), the
    /// runtime it had before one thread became the default. The control for that change.
    B2,
    C,
    /// Pods that each claim a GPU share through a ResourceClaimTemplate (DRA, docs/dra.md):
    /// `compute` `--dra-compute` and `memory` `--dra-memory` of one device of the DeviceClass
    /// `gpu.kubeshare.io`, on slices the node daemon's code builds; `default-scheduler`
    /// allocates (consumable capacity), kube-controller-manager makes the claims.
    Dra,
    /// `dra` with each pod's claim created by this bench just before the pod (the pod
    /// names it), not by kube-controller-manager from the template: the scheduler's side
    /// alone, without the controller's client limits.
    Drac,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::A2 => "a2",
            Config::A2p => "a2p",
            Config::B => "b",
            Config::B1 => "b1",
            Config::B2 => "b2",
            Config::C => "c",
            Config::Dra => "dra",
            Config::Drac => "drac",
        }
    }

    /// The kube-scheduler process (hack/cluster.sh component) that schedules its pods.
    fn scheduler(self) -> &'static str {
        match self {
            Config::A2 | Config::A2p | Config::Dra | Config::Drac => "kube-scheduler",
            Config::B | Config::B1 | Config::B2 | Config::C => "kubeshare-scheduler",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Mode {
    Stream,
    Backlog,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Stream => "stream",
            Mode::Backlog => "backlog",
        }
    }
}

/// Scheduling throughput and CPU per pod: default profile vs KubeShare, one cluster.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// kwok nodes to create.
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    /// Simulated GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Pods per run.
    #[arg(long, default_value_t = 2000)]
    pods: u32,
    /// gpu_request = gpu_limit of the GPU pods (configuration b).
    #[arg(long, default_value = "0.25")]
    share: String,
    /// Concurrent clients creating the pods.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Rounds; each runs every configuration in every mode, interleaved.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Configurations to run.
    #[arg(long, value_delimiter = ',', default_value = "a2,b,c")]
    configs: Vec<Config>,
    /// Modes to run.
    #[arg(long, value_delimiter = ',', default_value = "stream,backlog")]
    modes: Vec<Mode>,
    /// The extender binary to run.
    #[arg(long, default_value = "target/release/kubeshare-extender")]
    extender: PathBuf,
    /// Give up on a run whose pods are not all bound after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Append each run as one JSON line to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// GPU pods without KubeShare's mark, for a kubeshare profile without
    /// `managedResources` (there kube-scheduler would look for nodes that have
    /// the resource, and find none).
    #[arg(long)]
    unmarked: bool,
    /// GPU pods in sets of this many sharing an affinity tag (one GPU each set):
    /// every pod after a set's first is tied to its node, which kube-scheduler's
    /// search (a fraction of the nodes) may not reach. 0: no tags.
    #[arg(long, default_value_t = 0)]
    tied: u32,
    /// From a backlog, read the apiserver's CPU profile for `--profile-seconds` into
    /// DIR/<config>-<mode>-<round>-<phase>.pb: while the pods are created (the scheduler
    /// stopped; it resumes when the profile ends) and from when the scheduler resumes, with the
    /// pods bound meanwhile; over the second window also the serving kube-scheduler's
    /// (`-scheduler.pb`). The cluster must serve the apiserver's /debug/pprof
    /// (`KUBESHARE_APISERVER_PROFILING=true`).
    #[arg(long)]
    apiserver_profile_dir: Option<PathBuf>,
    /// How long each apiserver profile runs: longer than creating the pods, shorter than
    /// scheduling them.
    #[arg(long, default_value_t = 6)]
    profile_seconds: u32,
    /// The `compute` (thousandths of one GPU) each DRA pod's claim asks for.
    #[arg(long, default_value_t = 300)]
    dra_compute: u16,
    /// The `memory` each DRA pod's claim asks for (book both: a capacity left out books
    /// all of it, the whole GPU).
    #[arg(long, default_value = "4Gi")]
    dra_memory: String,
}

/// What one run measured.
#[derive(Debug, Clone)]
struct Run {
    config: Config,
    mode: Mode,
    round: u32,
    pods_per_second: f64,
    seconds: f64,
    cpu_ms_per_pod: f64,
    /// The same less the CPU the processes use at rest over the run's window:
    /// what the pods themselves cost (at-rest work grows with a run's length).
    cpu_ms_per_pod_above_rest: f64,
    cpu_ms_by_process: BTreeMap<String, f64>,
    /// The same for what plays the rest of the cluster (kwok's kubelets) and this bench
    /// (its creates and its watch): not charged to the run, but they share its two cores.
    rig_cpu_ms_by_process: BTreeMap<String, f64>,
    /// The control plane's CPU from the first create (stream) or the resume (backlog) to
    /// the last bind, per pod: a backlog's scheduling alone.
    scheduling_cpu_ms_per_pod: f64,
    /// The machine's busy and stolen cores meanwhile (every process, kwok and this bench
    /// included): near 2 on this machine means the run was bound by CPU.
    busy_cores: f64,
    steal_cores: f64,
    /// The machine's speed meanwhile: the median CPU µs of [`SpeedProbe`]'s batch.
    probe_us: Option<f64>,
    /// Loopback TCP connections opened during the run, per pod.
    tcp_opens_per_pod: f64,
    extender_rss_mib: f64,
    api_requests_per_pod: BTreeMap<String, f64>,
    /// Watch events (and KiB) the apiserver sent per pod, by resource.
    watch_per_pod: BTreeMap<String, f64>,
    /// Time per pod inside the scheduler that served the run and inside the extender, by
    /// histogram (`Timings`), with how many observations per pod.
    timing_ms_per_pod: BTreeMap<String, f64>,
    timing_calls_per_pod: BTreeMap<String, f64>,
    /// The apiserver profiles' files (creating, scheduling) and the pods bound while the
    /// second ran.
    apiserver_profile: Option<(PathBuf, PathBuf, usize)>,
    check: String,
}

/// Where a run's time goes, from the histograms of the kube-scheduler that serves it and of
/// the extender: the serial scheduling cycle (kube-scheduler's algorithm: its filter plugins,
/// the extender's filter call, scoring), its plugins by extension point, and the extender's
/// own handling of each verb (the rest of a call is HTTP, JSON and waiting for a CPU).
struct Timings {
    kube_scheduler: Client,
    kubeshare_scheduler: Client,
    /// None while the extender serves TLS (`HTTPS=1`): its histograms are then not read.
    extender_port: Option<u16>,
}

/// (histogram, its short name in the results, the labels kept).
const SCHEDULER_HISTOGRAMS: [(&str, &str, &[&str]); 3] = [
    (
        "scheduler_scheduling_algorithm_duration_seconds",
        "algorithm",
        &[],
    ),
    (
        "scheduler_scheduling_attempt_duration_seconds",
        "attempt",
        &["result"],
    ),
    (
        "scheduler_framework_extension_point_duration_seconds",
        "plugins",
        &["extension_point"],
    ),
];

impl Timings {
    /// The client of the kube-scheduler that serves `config`.
    fn scheduler(&self, config: Config) -> &Client {
        match config.scheduler() {
            "kube-scheduler" => &self.kube_scheduler,
            _ => &self.kubeshare_scheduler,
        }
    }

    /// (sum s, count) by short key, now.
    async fn snapshot(&self, config: Config) -> anyhow::Result<BTreeMap<String, (f64, f64)>> {
        let text = metrics_text(self.scheduler(config), config.scheduler()).await?;
        let mut out = BTreeMap::new();
        for (name, short, keep) in SCHEDULER_HISTOGRAMS {
            for (labels, v) in histogram_sums(&text, name, keep) {
                out.insert(format!("{short}{labels}"), v);
            }
        }
        if let Some(port) = self.extender_port {
            let text = extender_metrics(port).await?;
            let name = "kubeshare_extender_request_duration_seconds";
            for (labels, v) in histogram_sums(&text, name, &["verb"]) {
                out.insert(format!("extender{labels}"), v);
            }
        }
        Ok(out)
    }
}

/// A pod of the configuration; a GPU pod carries what the webhook would have
/// added for the scheduler (the mark `managedResources` selects on).
fn pod(config: Config, i: u32, args: &Args) -> anyhow::Result<Pod> {
    let (share, marked) = (&args.share, !args.unmarked);
    let quantity = if config == Config::B1 {
        "1"
    } else {
        GPU_POD_MARK
    };
    let mark = json!({ GPU_POD_RESOURCE: quantity });
    let mut gpu_labels = json!({"sharedgpu/gpu_request": share, "sharedgpu/gpu_limit": share});
    if let Some(set) = i.checked_div(args.tied) {
        gpu_labels["sharedgpu/sched_affinity"] = json!(format!("t{set}"));
    }
    let mut annotations = json!({});
    let (scheduler, labels, resources) = match config {
        Config::A2 => ("default-scheduler", json!({}), json!({})),
        Config::A2p => {
            let pad = |m: &serde_json::Value| -> serde_json::Map<String, serde_json::Value> {
                m.as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.replace("sharedgpu/", "bench.kubeshare.io/"), v.clone()))
                    .collect()
            };
            annotations = serde_json::Value::Object(pad(&json!(record_like())));
            (
                "default-scheduler",
                serde_json::Value::Object(pad(&gpu_labels)),
                json!({}),
            )
        }
        Config::B | Config::B1 | Config::B2 => (
            "kubeshare-scheduler",
            gpu_labels,
            if marked {
                json!({"limits": mark, "requests": mark})
            } else {
                json!({})
            },
        ),
        Config::C => ("kubeshare-scheduler", json!({}), json!({})),
        Config::Dra | Config::Drac => {
            let source = if config == Config::Dra {
                json!({"name": "gpu", "resourceClaimTemplateName": dra::TEMPLATE})
            } else {
                json!({"name": "gpu", "resourceClaimName": format!("p-{i:05}")})
            };
            return Ok(serde_json::from_value(json!({
                "metadata": {"name": format!("p-{i:05}")},
                "spec": {
                    "nodeSelector": {BENCH_LABEL: "scale"},
                    "containers": [{"name": "main", "image": "registry.invalid/cuda:1",
                                    "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [source]
                }
            }))?);
        }
    };
    Ok(serde_json::from_value(json!({
        "metadata": {"name": format!("p-{i:05}"), "labels": labels, "annotations": annotations},
        "spec": {
            "schedulerName": scheduler,
            "nodeSelector": {BENCH_LABEL: "scale"},
            "containers": [{"name": "main", "image": "registry.invalid/cuda:1",
                            "resources": resources}]
        }
    }))?)
}

/// A record as the extender writes it for a quarter of an H100 (for `a2p`'s size).
fn record_like() -> BTreeMap<String, String> {
    kubeshare_api::Allocation {
        node: "bench-node-0000".into(),
        gpu_uuids: vec!["GPU-0f5f1c1e-7b43-4c4e-9d8a-3b1a2c3d4e5f".into()],
        gpu_mem: 21_474_836_480,
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        granted: kubeshare_api::Granted::Fraction {
            request: kubeshare_api::Milli::new(250).unwrap_or(kubeshare_api::Milli::ONE),
            limit: kubeshare_api::Milli::new(250).unwrap_or(kubeshare_api::Milli::ONE),
        },
        gpu_mem_resident: None,
    }
    .to_annotations()
}

async fn create_pods(pods: &Api<Pod>, config: Config, args: &Args) -> anyhow::Result<()> {
    let claims: Api<ResourceClaim> = Api::namespaced(
        pods.clone().into_client(),
        pods.namespace().context("a namespaced pod API")?,
    );
    let spec = dra::claim_spec(args.dra_compute, &args.dra_memory);
    stream::iter(0..args.pods)
        .map(|i| {
            let (pods, claims) = (pods.clone(), claims.clone());
            let p = pod(config, i, args);
            let claim = (config == Config::Drac).then(|| {
                serde_json::from_value::<ResourceClaim>(
                    json!({"metadata": {"name": format!("p-{i:05}")}, "spec": spec}),
                )
            });
            async move {
                if let Some(c) = claim {
                    claims.create(&PostParams::default(), &c?).await?;
                }
                pods.create(&PostParams::default(), &p?).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(args.clients)
        .try_collect::<Vec<_>>()
        .await
        .context("creating pods")?;
    Ok(())
}

/// Deletes the namespace and waits until it is gone, so that its deletion
/// does not load the next run.
async fn delete_namespace(admin: &Client, ns: &str) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(admin.clone());
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    // Pods first, with no grace period: kwok's nodes have nothing to stop. A busy
    // apiserver may time the collection's deletion out (60 s for 2,000 pods, seen
    // with profiling on); what it deleted stays deleted, so ask again for the rest.
    let mut tries = 0;
    while let Err(e) = pods
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &Default::default(),
        )
        .await
    {
        tries += 1;
        if tries == 5 {
            return Err(e).context("deleting pods");
        }
        eprintln!("scale-bench: deleting the pods of {ns} failed ({e:?}); again");
    }
    nss.delete(ns, &DeleteParams::default()).await.ok();
    let t = Instant::now();
    while nss.get_opt(ns).await?.is_some() {
        if t.elapsed() > Duration::from_secs(600) {
            bail!("namespace {ns} still there after 600 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    args: &Args,
    admin: &Client,
    run_dir: &Path,
    pids: &BTreeMap<String, u32>,
    rig: &BTreeMap<String, u32>,
    extender_pid: u32,
    timings: &Timings,
    config: Config,
    mode: Mode,
    round: u32,
    idle: Duration,
) -> anyhow::Result<Run> {
    let ns = format!("scale-{}-{}-{round}", config.name(), mode.name());
    create_namespace(admin, &ns).await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &ns);
    if config == Config::Dra {
        let templates: Api<ResourceClaimTemplate> = Api::namespaced(admin.clone(), &ns);
        let t = serde_json::from_value(json!({
            "metadata": {"name": dra::TEMPLATE},
            "spec": {"spec": dra::claim_spec(args.dra_compute, &args.dra_memory)}
        }))?;
        templates
            .create(&PostParams::default(), &t)
            .await
            .context("creating the claim template")?;
    }
    let watch = BindWatch::start(pods.clone());
    // Let the watch list the (empty) namespace before the first create.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let m0 = apiserver_metrics(admin).await?;
    let (api0, watch0) = (api_requests(&m0), watch_events(&m0));
    let timing0 = timings.snapshot(config).await?;
    let (cpu0, tcp0) = (cpu_snapshot(pids)?, tcp_passive_opens()?);
    let rig0 = cpu_snapshot(rig)?;
    let w0 = Instant::now();
    let mut creating_profile = None;
    let probe = SpeedProbe::start(Duration::from_millis(250));
    // From t0 on the scheduler works: what the machine does from then to the last bind
    // says whether the run was bound by CPU (both cores busy) or by a wait (the serial
    // cycle, its calls).
    let (t0, machine_t0, cpu_t0) = match mode {
        Mode::Stream => {
            // The run's CPU snapshot, taken just before, is also the scheduler's start.
            let at_t0 = (Instant::now(), MachineCpu::now()?, cpu0.clone());
            create_pods(&pods, config, args).await?;
            at_t0
        }
        Mode::Backlog => {
            let sched = component_pid(run_dir, config.scheduler())?;
            signal(sched, "STOP")?;
            let created = match &args.apiserver_profile_dir {
                Some(_) => {
                    let (data, created) = tokio::join!(
                        apiserver_profile(admin, args.profile_seconds),
                        create_pods(&pods, config, args)
                    );
                    creating_profile = Some(data);
                    created
                }
                None => create_pods(&pods, config, args).await,
            };
            // Resume whatever happened, so the cluster can go down cleanly.
            let (t0, machine, cpu) = (Instant::now(), MachineCpu::now(), cpu_snapshot(pids));
            signal(sched, "CONT")?;
            created?;
            (t0, machine?, cpu?)
        }
    };
    let profile = match (&args.apiserver_profile_dir, mode) {
        (Some(dir), Mode::Backlog) => {
            let file = |phase: &str| {
                dir.join(format!(
                    "{}-{}-{round}-{phase}.pb",
                    config.name(),
                    mode.name()
                ))
            };
            let before = watch.bound();
            // The serving kube-scheduler's profile over the same window (it profiles by
            // default): where its extra time per pod goes.
            let (data, sched) = tokio::join!(
                apiserver_profile(admin, args.profile_seconds),
                cpu_profile(timings.scheduler(config), args.profile_seconds)
            );
            let (data, sched) = (data?, sched.context("reading the scheduler's profile")?);
            let during = watch.bound() - before;
            std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
            let (creating, scheduling) = (file("creating"), file("scheduling"));
            if let Some(c) = creating_profile.take() {
                std::fs::write(&creating, c?).with_context(|| creating.display().to_string())?;
            }
            std::fs::write(&scheduling, data).with_context(|| scheduling.display().to_string())?;
            let scheduler = file("scheduler");
            std::fs::write(&scheduler, sched).with_context(|| scheduler.display().to_string())?;
            Some((creating, scheduling, during))
        }
        _ => None,
    };
    let end = watch
        .wait(args.pods as usize, Duration::from_secs(args.timeout))
        .await
        .with_context(|| ns.clone())?;
    let (machine_end, cpu1) = (MachineCpu::now()?, cpu_snapshot(pids)?);
    let rig1 = cpu_snapshot(rig)?;
    let tcp_opens = tcp_passive_opens()?.saturating_sub(tcp0);
    let probe_us = probe.finish();
    let window = w0.elapsed();
    drop(watch);
    let m1 = apiserver_metrics(admin).await?;
    let (api1, watch1) = (api_requests(&m1), watch_events(&m1));
    let timing1 = timings.snapshot(config).await?;
    let per_pod = |v: f64| v / f64::from(args.pods);
    let (mut timing_ms_per_pod, mut timing_calls_per_pod) = (BTreeMap::new(), BTreeMap::new());
    for (k, (sum, count)) in &timing1 {
        let (sum0, count0) = timing0.get(k).copied().unwrap_or_default();
        if count - count0 > 0.0 {
            timing_ms_per_pod.insert(k.clone(), per_pod((sum - sum0) * 1000.0));
            timing_calls_per_pod.insert(k.clone(), per_pod(count - count0));
        }
    }
    // Requests and watch events per pod that the run made (this bench's own two metrics
    // reads aside).
    let api_per_pod = per_pod_growth(&api0, &api1, args.pods);
    let watch_per_pod = per_pod_growth(&watch0, &watch1, args.pods);
    let seconds = end.saturating_duration_since(t0).as_secs_f64();
    let by = cpu_ms_used(&cpu0, &cpu1);
    let total: f64 = by.values().sum();
    let scheduling_ms: f64 = cpu_ms_used(&cpu_t0, &cpu1).values().sum();
    let (busy_cores, steal_cores) =
        machine_t0.cores_until(&machine_end, end.saturating_duration_since(t0));

    let all_claims = match config {
        Config::Dra | Config::Drac => dra::list_claims(&claims).await?,
        _ => Vec::new(),
    };
    let check = check_run(config, &list_all(&pods).await?, &all_claims, args.pods, &ns)?;
    delete_namespace(admin, &ns).await?;
    Ok(Run {
        config,
        mode,
        round,
        pods_per_second: f64::from(args.pods) / seconds.max(1e-9),
        seconds,
        cpu_ms_per_pod: total / f64::from(args.pods),
        cpu_ms_per_pod_above_rest: (total - idle.as_secs_f64() * window.as_secs_f64() * 1000.0)
            / f64::from(args.pods),
        scheduling_cpu_ms_per_pod: scheduling_ms / f64::from(args.pods),
        busy_cores,
        steal_cores,
        probe_us,
        tcp_opens_per_pod: tcp_opens as f64 / f64::from(args.pods),
        cpu_ms_by_process: by
            .into_iter()
            .map(|(n, v)| (n, v / f64::from(args.pods)))
            .collect(),
        rig_cpu_ms_by_process: cpu_ms_used(&rig0, &rig1)
            .into_iter()
            .map(|(n, v)| (n, v / f64::from(args.pods)))
            .collect(),
        extender_rss_mib: rss(extender_pid)? as f64 / f64::from(1u32 << 20),
        api_requests_per_pod: api_per_pod,
        watch_per_pod,
        timing_ms_per_pod,
        timing_calls_per_pod,
        apiserver_profile: profile,
        check,
    })
}

/// Whether a run ended right: every pod bound, and for GPU pods no GPU above 1.0 and every
/// record right; the verdict as a line for the results.
fn check_run(
    config: Config,
    all: &[Pod],
    claims: &[ResourceClaim],
    pods: u32,
    ns: &str,
) -> anyhow::Result<String> {
    Ok(match config {
        Config::Dra | Config::Drac => {
            let c = dra::check_claims(all, claims);
            if !c.ok() || c.bound != pods as usize {
                bail!(
                    "{ns}: {} devices above 1000 (max {}), {} of {pods} bound, {} pending, {} bad: {:?}",
                    c.overcommitted().len(),
                    c.max(),
                    c.bound,
                    c.pending,
                    c.bad.len(),
                    c.bad.iter().take(5).collect::<Vec<_>>()
                );
            }
            format!(
                "ok: {} bound, {} claims allocated on {} devices, max allocated compute {}",
                c.bound,
                c.allocated,
                c.compute.len(),
                c.max()
            )
        }
        Config::B | Config::B1 | Config::B2 => {
            let c = check_books(all);
            if !c.ok() {
                bail!(
                    "{ns}: {} GPUs above 1.0 (max {:.3}), {} bad records, {} pending: {:?}",
                    c.overcommitted().len(),
                    f64::from(c.max_milli()) / 1000.0,
                    c.bad_records.len(),
                    c.pending,
                    c.bad_records.iter().take(5).collect::<Vec<_>>()
                );
            }
            format!(
                "ok: {} bound, {} GPUs used, max booking {:.2}",
                c.bound,
                c.booked_milli.len(),
                f64::from(c.max_milli()) / 1000.0
            )
        }
        Config::A2 | Config::A2p | Config::C => {
            let bound = all
                .iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                .count();
            if bound != pods as usize {
                bail!("{ns}: {bound} of {pods} pods bound");
            }
            format!("ok: {bound} bound")
        }
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The summary: per mode, each configuration's median pods/s and CPU per pod,
/// and the ratios the issue sets targets for.
fn summary(runs: &[Run], modes: &[Mode]) -> String {
    let mut s = String::from(
        "| mode | config | pods/s (median) | CPU ms/pod (median) | ratio to a2: pods/s | ratio to a2: CPU/pod | ratio to a2: CPU/pod above rest |\n|---|---|---|---|---|---|---|\n",
    );
    for &m in modes {
        let stat = |c: Config| {
            let of = |f: fn(&Run) -> f64| {
                median(
                    runs.iter()
                        .filter(|r| r.mode == m && r.config == c)
                        .map(f)
                        .collect(),
                )
            };
            (
                of(|r| r.pods_per_second),
                of(|r| r.cpu_ms_per_pod),
                of(|r| r.cpu_ms_per_pod_above_rest),
            )
        };
        let (a_rate, a_cpu, a_above) = stat(Config::A2);
        for c in [
            Config::A2,
            Config::A2p,
            Config::B,
            Config::B1,
            Config::B2,
            Config::C,
            Config::Dra,
            Config::Drac,
        ] {
            let (rate, cpu, above) = stat(c);
            if rate.is_nan() {
                continue;
            }
            s.push_str(&format!(
                "| {} | {} | {rate:.1} | {cpu:.2} | {:.2} | {:.2} | {:.2} |\n",
                m.name(),
                c.name(),
                rate / a_rate,
                cpu / a_cpu,
                above / a_above
            ));
        }
    }
    s
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cluster = Cluster::shared().context("no cluster: run under hack/with-cluster.sh")?;
    let admin = cluster.client(Identity::Admin).await?;
    let run_dir = cluster.run_dir().to_owned();
    let mut ext = Extender::start(
        &args.extender,
        cluster.kubeconfig(Identity::Extender)?,
        cluster.extender_port(),
        &run_dir.join("logs/extender.log"),
    )?;
    let mut pids: BTreeMap<String, u32> = CONTROL_PLANE
        .iter()
        .map(|n| Ok((n.to_string(), component_pid(&run_dir, n)?)))
        .collect::<anyhow::Result<_>>()?;
    pids.insert("kubeshare-extender".into(), ext.pid());
    let rig = BTreeMap::from([
        ("kwok".to_string(), component_pid(&run_dir, "kwok")?),
        ("scale-bench".to_string(), std::process::id()),
    ]);
    let admin_kc = cluster.kubeconfig(Identity::Admin)?;
    let timings = Timings {
        kube_scheduler: scheduler_client(admin_kc, cluster.ports().kube_scheduler).await?,
        kubeshare_scheduler: scheduler_client(admin_kc, cluster.ports().kubeshare_scheduler)
            .await?,
        extender_port: std::env::var_os("KUBESHARE_EXTENDER_TLS_CERT")
            .is_none()
            .then(|| cluster.extender_port()),
    };
    // Before the nodes (minutes), not at b2's first run.
    if args.configs.contains(&Config::B2) && timings.extender_port.is_none() {
        bail!("b2 restarts the extender and waits for it on plain HTTP: not with HTTPS=1");
    }

    let t = Instant::now();
    create_gpu_nodes(&admin, "scale", args.nodes, args.gpus, 16).await?;
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let rss_nodes = mib(rss(ext.pid())?);
    eprintln!(
        "scale-bench: {} nodes x {} GPUs ready in {:.1} s; extender RSS {rss_nodes:.1} MiB",
        args.nodes,
        args.gpus,
        t.elapsed().as_secs_f64(),
    );
    if args
        .configs
        .iter()
        .any(|c| matches!(c, Config::Dra | Config::Drac))
    {
        let t = Instant::now();
        dra::create_device_class(&admin).await?;
        let n = dra::publish_slices(&admin, "scale", args.gpus, 16).await?;
        eprintln!(
            "scale-bench: {n} ResourceSlices published in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let probe = SpeedProbe::start(Duration::from_millis(250));
    let idle = idle_cpu(&pids).await?;
    let probe_at_rest = probe.finish();
    eprintln!("scale-bench: the control plane at rest uses {idle:?} of CPU per second");

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        for &mode in &args.modes {
            for &config in &args.configs {
                eprintln!(
                    "scale-bench: round {round}, {} {}",
                    config.name(),
                    mode.name()
                );
                if config == Config::B2 {
                    ext.restart_with(&["--threads", "2"]).await?;
                    pids.insert("kubeshare-extender".into(), ext.pid());
                }
                quiesce(&pids, idle).await?;
                let r = run_one(
                    &args,
                    &admin,
                    &run_dir,
                    &pids,
                    &rig,
                    ext.pid(),
                    &timings,
                    config,
                    mode,
                    round,
                    idle,
                )
                .await?;
                if config == Config::B2 {
                    ext.restart_with(&[]).await?;
                    pids.insert("kubeshare-extender".into(), ext.pid());
                }
                let line = json!({
                    "config": r.config.name(), "mode": r.mode.name(), "round": r.round,
                    "nodes": args.nodes, "gpus_per_node": args.gpus, "pods": args.pods,
                    "clients": args.clients, "tied": args.tied,
                    "dra_claim": matches!(r.config, Config::Dra | Config::Drac).then(|| json!({
                        "compute": args.dra_compute, "memory": args.dra_memory})),
                    "extender": args.extender.display().to_string(),
                    "idle_cpu_ms_per_s": idle.as_millis(),
                    "seconds": (r.seconds * 100.0).round() / 100.0,
                    "pods_per_second": (r.pods_per_second * 10.0).round() / 10.0,
                    "cpu_ms_per_pod": (r.cpu_ms_per_pod * 100.0).round() / 100.0,
                    "cpu_ms_per_pod_above_rest": (r.cpu_ms_per_pod_above_rest * 100.0).round() / 100.0,
                    "scheduling_cpu_ms_per_pod": (r.scheduling_cpu_ms_per_pod * 100.0).round() / 100.0,
                    "busy_cores": (r.busy_cores * 100.0).round() / 100.0,
                    "steal_cores": (r.steal_cores * 100.0).round() / 100.0,
                    "probe_us": r.probe_us.map(|v| v.round()),
                    "tcp_opens_per_pod": (r.tcp_opens_per_pod * 100.0).round() / 100.0,
                    "probe_us_at_rest": probe_at_rest.map(|v| v.round()),
                    "cpu_ms_per_pod_by_process": r.cpu_ms_by_process.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 100.0).round() / 100.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "rig_cpu_ms_per_pod_by_process": r.rig_cpu_ms_by_process.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 100.0).round() / 100.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "extender_rss_mib_after": (r.extender_rss_mib * 10.0).round() / 10.0,
                    "api_requests_per_pod": r.api_requests_per_pod.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 100.0).round() / 100.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "apiserver_profile": r.apiserver_profile.as_ref().map(|(c, f, n)| json!({
                        "creating": c.display().to_string(), "scheduling": f.display().to_string(),
                        "pods_bound_during_scheduling": n})),
                    "watch_per_pod": r.watch_per_pod.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 100.0).round() / 100.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "timing_ms_per_pod": r.timing_ms_per_pod.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 1000.0).round() / 1000.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "timing_calls_per_pod": r.timing_calls_per_pod.iter()
                        .map(|(k, v)| (k.clone(), json!((v * 100.0).round() / 100.0)))
                        .collect::<serde_json::Map<_, _>>(),
                    "check": r.check,
                });
                println!("{line}");
                if let Some(path) = &args.out {
                    let mut f = OpenOptions::new().create(true).append(true).open(path)?;
                    writeln!(f, "{line}")?;
                }
                runs.push(r);
            }
        }
    }
    eprintln!("{}", summary(&runs, &args.modes));
    // Every pod is gone: the extender should be back near where it started.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let line = json!({"extender_rss_mib": {
        "after_nodes": (rss_nodes * 10.0).round() / 10.0,
        "after_runs_max": runs.iter().map(|r| r.extender_rss_mib).fold(0.0, f64::max),
        "idle_40s_after_last_run": (mib(rss(ext.pid())?) * 10.0).round() / 10.0,
    }});
    println!("{line}");
    if let Some(path) = &args.out {
        let mut f = OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(f, "{line}")?;
    }
    Ok(())
}
