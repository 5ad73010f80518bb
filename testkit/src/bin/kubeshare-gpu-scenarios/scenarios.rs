//! The GPU node's scenarios, one JSON line each ({"scenario", "ok", "secs", "details"} or
//! "error"), then a summary line. Each runs in a fresh namespace's pods and deletes them
//! before the next, so that every scenario starts with the GPU free.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail, ensure};
use clap::ValueEnum;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use kubeshare_testkit::{
    delete_pods_and_wait, pod_annotation, pod_is_running, pod_logs, pod_phase,
};
use serde_json::{Value, json};

use crate::pods::{self, DeviceAccess, PodEnv, Work, Workload};
use crate::report::{self, Split, field, json_lines};

const KUBESHARE_NS: &str = "kubeshare-system";
const NODE_DAEMON_SELECTOR: &str = "app.kubernetes.io/name=kubeshare-node-daemon";
/// KubeShare's DRA driver, and the DeviceClass the chart's `dra.enabled` installs.
const DRA_DRIVER: &str = "gpu.kubeshare.io";
/// The memory each claim of the `claims` scenario books (a claim must book some: left
/// out, it books all the GPU's memory and no second claim fits).
const CLAIM_MEMORY: &str = "8Gi";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Scenario {
    Shares,
    Claims,
    Memory,
    NoGpu,
    Group,
    Free,
    DaemonRestart,
}

#[derive(clap::Args)]
pub struct ScenarioArgs {
    #[arg(long, value_enum, default_value = "torch")]
    workload: Workload,
    #[arg(long, value_enum, default_value = "privileged")]
    device_access: DeviceAccess,
    /// Scenarios to run (comma-separated); all by default.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// Length of the share runs (the daemon-restart run takes at least 24 s).
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// The host's python with PyTorch (workload torch).
    #[arg(long, default_value = "/opt/torch/.venv/bin/python")]
    python: String,
    /// gpu_share.py, put in a ConfigMap for the torch pods.
    #[arg(long, default_value = "hack/gpu-node/gpu_share.py")]
    script: PathBuf,
    /// The host's path of the node's /var/lib/kubeshare-test (hack/gpu-node.sh:
    /// STATE/node/test), where the runner drops the barrier files.
    #[arg(long)]
    test_dir: PathBuf,
    /// More host directories the torch pods mount read-only (repeatable).
    #[arg(long)]
    host_dir: Vec<String>,
    /// LD_LIBRARY_PATH of the torch pods (the driver's libraries).
    #[arg(long, default_value = "/usr/local/nvidia/lib64")]
    lib_path: String,
    /// The memory scenario's cap, in GiB.
    #[arg(long, default_value_t = 4)]
    mem_cap_gib: u64,
    /// How far a pod's share of the GPU time used may be from its request.
    #[arg(long, default_value_t = 0.05)]
    tolerance: f64,
    /// Seconds any one wait may take.
    #[arg(long, default_value_t = 240)]
    timeout_secs: u64,
    /// Keep the namespace (and the last scenario's pods) for a look afterwards.
    #[arg(long)]
    keep: bool,
}

struct Ctx<'a> {
    client: Client,
    pods: Api<Pod>,
    ns: String,
    env: PodEnv,
    args: &'a ScenarioArgs,
    timeout: Duration,
}

/// Runs the scenarios; returns how many failed.
pub async fn run(client: &Client, args: &ScenarioArgs) -> Result<usize> {
    let env = pod_env(args)?;
    let ns = format!("ksgpu-{}", unix_secs());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    if args.workload == Workload::Torch {
        let script = std::fs::read_to_string(&args.script)
            .with_context(|| format!("reading {}", args.script.display()))?;
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        cms.create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": pods::SCRIPT_CONFIGMAP},
                "data": {"gpu_share.py": script},
            }))?,
        )
        .await?;
    }
    std::fs::create_dir_all(&args.test_dir)
        .with_context(|| format!("creating {}", args.test_dir.display()))?;
    let ctx = Ctx {
        client: client.clone(),
        pods: Api::namespaced(client.clone(), &ns),
        ns: ns.clone(),
        env,
        args,
        timeout: Duration::from_secs(args.timeout_secs),
    };
    let mut selected = args.only.clone();
    if selected.is_empty() {
        selected = Scenario::value_variants().to_vec();
        // `claims` needs the chart's DRA (hack/gpu-node.sh up with CDI); asked for by name,
        // it fails without it.
        if !dra_installed(client).await {
            eprintln!(
                "gpu-scenarios: no DeviceClass {DRA_DRIVER} (the chart without dra.enabled): `claims` left out"
            );
            selected.retain(|s| *s != Scenario::Claims);
        }
    }
    let mut results = BTreeMap::new();
    let last = selected.len().saturating_sub(1);
    for (i, s) in selected.into_iter().enumerate() {
        let name = s
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default();
        let t0 = Instant::now();
        let outcome = match s {
            Scenario::Shares => shares(&ctx).await,
            Scenario::Claims => claims(&ctx).await,
            Scenario::Memory => memory(&ctx).await,
            Scenario::NoGpu => no_gpu(&ctx).await,
            Scenario::Group => group(&ctx).await,
            Scenario::Free => free(&ctx).await,
            Scenario::DaemonRestart => daemon_restart(&ctx).await,
        };
        let secs = (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0;
        let mut line = match outcome {
            Ok((ok, details)) => {
                json!({"scenario": name, "ok": ok, "secs": secs, "details": details})
            }
            Err(e) => {
                json!({"scenario": name, "ok": false, "secs": secs, "error": format!("{e:#}")})
            }
        };
        let ok = line["ok"] == true;
        if !ok {
            line["pods"] = pod_dump(&ctx).await;
        }
        println!("{line}");
        results.insert(name, ok);
        if !(args.keep && i == last) {
            clean(&ctx).await?;
        }
    }
    let failed = results.values().filter(|ok| !**ok).count();
    println!(
        "{}",
        json!({"summary": results, "failed": failed, "namespace": ns,
        "workload": format!("{:?}", args.workload), "device_access": format!("{:?}", args.device_access)})
    );
    if !args.keep {
        namespaces
            .delete(&ns, &DeleteParams::background())
            .await
            .ok();
    }
    Ok(failed)
}

fn pod_env(args: &ScenarioArgs) -> Result<PodEnv> {
    let mut host_dirs = vec![];
    if args.workload == Workload::Torch {
        // The venv's parent (e.g. /opt/torch), and the base interpreter's prefix when it is
        // not under /usr (which every torch pod mounts).
        let venv_root = Path::new(&args.python)
            .ancestors()
            .nth(3)
            .context("--python: expected <root>/<venv>/bin/python")?;
        host_dirs.push(venv_root.to_string_lossy().into_owned());
        let real = std::fs::canonicalize(&args.python)
            .with_context(|| format!("--python {}", args.python))?;
        if let Some(prefix) = real.ancestors().nth(2)
            && !real.starts_with("/usr")
            && !real.starts_with(venv_root)
        {
            host_dirs.push(prefix.to_string_lossy().into_owned());
        }
    }
    host_dirs.extend(args.host_dir.iter().cloned());
    Ok(PodEnv {
        workload: args.workload,
        access: args.device_access,
        python: args.python.clone(),
        host_dirs,
        lib_path: args.lib_path.clone(),
        ld_cache: Path::new("/etc/ld.so.cache").exists(),
    })
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn share_labels(share: &str, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
    let mut l = pods::labels(&[
        ("sharedgpu/gpu_request", share),
        ("sharedgpu/gpu_limit", share),
    ]);
    l.extend(pods::labels(extra));
    l
}

async fn create(ctx: &Ctx<'_>, pod: &Pod) -> Result<()> {
    ctx.pods.create(&PostParams::default(), pod).await?;
    Ok(())
}

/// Waits until the pod runs (or has run to completion); fails at once if it failed.
async fn started(ctx: &Ctx<'_>, name: &str) -> Result<Pod> {
    started_within(ctx, name, ctx.timeout).await
}

async fn started_within(ctx: &Ctx<'_>, name: &str, timeout: Duration) -> Result<Pod> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(p) = ctx.pods.get_opt(name).await? {
            match pod_phase(&p) {
                "Failed" => bail!(
                    "pod {name} failed: {}",
                    tail(&pod_logs(&ctx.pods, name, "main").await.unwrap_or_default())
                ),
                "Succeeded" => return Ok(p),
                _ if pod_is_running(&p) => return Ok(p),
                _ => {}
            }
        }
        ensure!(
            Instant::now() < deadline,
            "pod {name} did not start in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the pod's log satisfies `done`; fails at once when the pod ended without.
async fn log_until(
    ctx: &Ctx<'_>,
    name: &str,
    timeout: Duration,
    done: impl Fn(&str) -> bool,
) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let log = pod_logs(&ctx.pods, name, "main").await.unwrap_or_default();
        if done(&log) {
            return Ok(log);
        }
        if let Some(p) = ctx.pods.get_opt(name).await?
            && matches!(pod_phase(&p), "Failed" | "Succeeded")
        {
            let log = pod_logs(&ctx.pods, name, "main").await.unwrap_or_default();
            if done(&log) {
                return Ok(log);
            }
            bail!(
                "pod {name} ended ({}) without the expected output: {}",
                pod_phase(&p),
                tail(&log)
            );
        }
        ensure!(
            Instant::now() < deadline,
            "pod {name}: no expected output in {timeout:?}: {}",
            tail(&log)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn has_phase(log: &str, phase: &str) -> bool {
    json_lines(log).iter().any(|v| v["phase"] == phase)
}

fn has_result(log: &str) -> bool {
    json_lines(log).iter().any(|v| v.get("kernels").is_some())
}

fn gpu_of(p: &Pod) -> Option<String> {
    pod_annotation(p, "sharedgpu/gpu_uuid").map(str::to_string)
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// The hook's log line that shows it reached the GPU's gem-schd (docs/node.md).
fn hook_connected(log: &str, gpu: &str) -> bool {
    log.contains(&format!("connection to gem-schd for {gpu}"))
}

async fn clean(ctx: &Ctx<'_>) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ctx.ns);
    for j in jobs.list(&ListParams::default()).await? {
        jobs.delete(&j.name_any(), &DeleteParams::background())
            .await
            .ok();
    }
    delete_pods_and_wait(&ctx.pods, "", ctx.timeout).await?;
    // The pods' ResourceClaims go with them (the resourceclaim controller): until then the
    // extender counts them in its books, and the next scenario would not find the GPU free.
    let claims: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &ctx.ns);
    let deadline = Instant::now() + ctx.timeout;
    while claims
        .list(&ListParams::default())
        .await
        .is_ok_and(|l| !l.items.is_empty())
    {
        ensure!(
            Instant::now() < deadline,
            "the namespace's ResourceClaims are still there after {:?}",
            ctx.timeout
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The pods of the namespace with their state and last log lines, for a failed scenario.
async fn pod_dump(ctx: &Ctx<'_>) -> Value {
    let Ok(list) = ctx.pods.list(&ListParams::default()).await else {
        return Value::Null;
    };
    let mut out = vec![];
    for p in list {
        let name = p.name_any();
        let log = pod_logs(&ctx.pods, &name, "main")
            .await
            .unwrap_or_else(|e| format!("(no log: {e})"));
        out.push(json!({
            "name": name,
            "phase": pod_phase(&p),
            "node": p.spec.as_ref().and_then(|s| s.node_name.clone()),
            "conditions": p.status.as_ref().and_then(|s| s.conditions.clone()),
            "containers": p.status.as_ref().and_then(|s| s.container_statuses.clone()),
            "log_tail": tail(&log),
        }));
    }
    Value::Array(out)
}

/// How the pods of a share run get their shares of one GPU.
enum Placement<'a> {
    /// sharedgpu labels (request = limit) with one affinity tag: the extender places them
    /// together, and each pod's allocation record names the GPU.
    Labels,
    /// One ResourceClaim each (from a template of the pod's name) booking its share of
    /// `compute` on the GPU of this UUID, which the claims' CEL selector names.
    Claims { gpu: &'a str },
}

/// Runs pods of the given shares on one GPU at once, from a barrier, for `seconds`;
/// `during` runs (once) after the barrier. Returns the split and what the node daemon
/// reported as delivered.
async fn share_run<F, Fut>(
    ctx: &Ctx<'_>,
    want: &[(&str, f64)],
    seconds: f64,
    placement: &Placement<'_>,
    during: Option<F>,
) -> Result<(Split, Value, Value)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<Value>>,
{
    let go = format!("go-{}-{}", want[0].0, unix_secs());
    let tag = format!("share-{}", want[0].0);
    for (name, share) in want {
        let work = Work::Share {
            seconds,
            barrier: Some(go.clone()),
        };
        let pod = match placement {
            Placement::Labels => {
                let labels =
                    share_labels(&share.to_string(), &[("sharedgpu/sched_affinity", &tag)]);
                pods::pod(&ctx.env, name, labels, &work)?
            }
            Placement::Claims { gpu } => {
                let compute = format!("{}", (share * 1000.0).round() as u64);
                let templates: Api<ResourceClaimTemplate> =
                    Api::namespaced(ctx.client.clone(), &ctx.ns);
                templates
                    .create(
                        &PostParams::default(),
                        &kubeshare_testkit::dra::share_claim_template(
                            name,
                            gpu,
                            &compute,
                            CLAIM_MEMORY,
                        )?,
                    )
                    .await?;
                serde_json::from_value(pods::claim_pod_json(&ctx.env, name, name, gpu, &work))?
            }
        };
        create(ctx, &pod).await?;
    }
    let mut gpus = BTreeMap::new();
    for (name, _) in want {
        let p = started(ctx, name).await?;
        let gpu = match placement {
            Placement::Labels => gpu_of(&p).context("no sharedgpu/gpu_uuid")?,
            Placement::Claims { gpu } => gpu.to_string(),
        };
        gpus.insert(name.to_string(), gpu);
    }
    let first = gpus.values().next().cloned().unwrap_or_default();
    ensure!(
        gpus.values().all(|g| *g == first),
        "the pods are on different GPUs: {gpus:?}"
    );
    // The GPU's device nodes each pod sees (PyTorch prints them when ready).
    let mut devs = BTreeMap::new();
    for (name, _) in want {
        let log = log_until(ctx, name, ctx.timeout, |l| has_phase(l, "ready")).await?;
        let ready = json_lines(&log).into_iter().find(|v| v["phase"] == "ready");
        devs.insert(
            name.to_string(),
            ready.map(|v| v["dev_nvidia"].clone()).unwrap_or_default(),
        );
    }
    std::fs::write(ctx.args.test_dir.join(&go), b"")?;
    let t_go = Instant::now();
    let during_result = match during {
        Some(f) => f().await?,
        None => Value::Null,
    };
    // gem-schd's delivered shares (a 10 s window), read while the runs are still going.
    let read_at = Duration::from_secs_f64((seconds - 2.0).max(0.0));
    let delivered = if seconds >= 12.0 {
        if let Some(wait) = read_at.checked_sub(t_go.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let d: BTreeMap<String, f64> = kubectl_sharedgpu::delivered::read(&ctx.client)
            .await
            .into_iter()
            .filter(|((ns, _, _), _)| *ns == ctx.ns)
            .map(|((_, pod, _), v)| (pod, v))
            .collect();
        json!(d)
    } else {
        Value::Null
    };
    let mut runs = vec![];
    let mut hooks = BTreeMap::new();
    for (name, share) in want {
        let log = log_until(
            ctx,
            name,
            ctx.timeout + Duration::from_secs_f64(seconds),
            has_result,
        )
        .await?;
        hooks.insert(name.to_string(), hook_connected(&log, &gpus[*name]));
        runs.push((name.to_string(), *share, report::share_run(&log)?));
    }
    let split = report::split(&runs);
    let extra = json!({"gpu": first, "hook_connected": hooks, "delivered": delivered,
        "during": during_result, "dev_nvidia": devs});
    ensure!(
        hooks.values().all(|h| *h),
        "the hook did not reach gem-schd in every pod: {hooks:?}"
    );
    Ok((
        split,
        extra,
        json!(
            runs.iter()
                .map(|(n, _, r)| (n.clone(), *r))
                .collect::<BTreeMap<_, _>>()
        ),
    ))
}

type NoHook = fn() -> std::future::Ready<Result<Value>>;

async fn shares(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    let (split, extra, runs) = share_run::<NoHook, _>(
        ctx,
        &[("p30", 0.3), ("p70", 0.7)],
        ctx.args.seconds,
        &Placement::Labels,
        None,
    )
    .await?;
    let ok = split.within(ctx.args.tolerance);
    Ok((
        ok,
        json!({"split": split, "runs": runs, "tolerance": ctx.args.tolerance, "more": extra}),
    ))
}

/// Whether the chart's DRA is installed: its DeviceClass exists.
async fn dra_installed(client: &Client) -> bool {
    Api::<DeviceClass>::all(client.clone())
        .get_opt(DRA_DRIVER)
        .await
        .is_ok_and(|d| d.is_some())
}

/// The node's first GPU (lowest index) once the node daemon published it in its
/// ResourceSlice: its UUID and its device name in the slice.
async fn published_gpu(ctx: &Ctx<'_>) -> Result<(String, String)> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let mut first = None;
    for n in nodes.list(&ListParams::default()).await? {
        if let Some(inv) = n.annotations().get("sharedgpu/inventory") {
            let inv = kubeshare_api::NodeInventory::parse(inv)?;
            first = inv.gpus.into_iter().min_by_key(|g| g.index);
            break;
        }
    }
    let gpu = first.context("no node has a GPU in its sharedgpu/inventory")?;
    let device = kubeshare_api::dra::device_name(gpu.index);
    let slices: Api<ResourceSlice> = Api::all(ctx.client.clone());
    let deadline = Instant::now() + ctx.timeout;
    loop {
        let published = slices
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .any(|s| {
                s.spec.driver == DRA_DRIVER
                    && s.spec
                        .devices
                        .as_ref()
                        .is_some_and(|ds| ds.iter().any(|d| d.name == device))
            });
        if published {
            return Ok((gpu.uuid, device));
        }
        ensure!(
            Instant::now() < deadline,
            "no ResourceSlice of {DRA_DRIVER} publishes {device} after {:?}",
            ctx.timeout
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the pod's claim was allocated: device and booked capacity per result.
async fn claim_allocation(ctx: &Ctx<'_>, pod: &str) -> Result<Value> {
    let p = ctx.pods.get(pod).await?;
    let claim = p
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.resource_claim_name.clone())
        .with_context(|| format!("pod {pod} has no ResourceClaim in its status"))?;
    let claims: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &ctx.ns);
    let c = claims.get(&claim).await?;
    let results = kubeshare_testkit::dra::allocated_devices(c);
    Ok(json!(
        results
            .iter()
            .map(
                |r| json!({"claim": claim, "device": r.device, "pool": r.pool,
                "consumed": r.consumed_capacity})
            )
            .collect::<Vec<_>>()
    ))
}

/// `shares` through DRA: each pod's share is its own ResourceClaim (compute 300 and 700,
/// [`CLAIM_MEMORY`] each) on the node's first GPU, placed by the stock scheduler and
/// prepared by the node daemon's kubelet plugin; measured as `shares` is.
async fn claims(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    ensure!(
        dra_installed(&ctx.client).await,
        "no DeviceClass {DRA_DRIVER}: KubeShare is deployed without dra.enabled \
         (hack/gpu-node.sh up renders it only with CDI)"
    );
    ensure!(
        ctx.env.access == DeviceAccess::Cdi,
        "claims reach the GPU through their CDI specs: run with --device-access cdi"
    );
    let (gpu, device) = published_gpu(ctx).await?;
    let want = [("c30", 0.3), ("c70", 0.7)];
    let (split, extra, runs) = share_run::<NoHook, _>(
        ctx,
        &want,
        ctx.args.seconds,
        &Placement::Claims { gpu: &gpu },
        None,
    )
    .await?;
    let mut allocations = BTreeMap::new();
    for (name, _) in want {
        allocations.insert(name, claim_allocation(ctx, name).await?);
    }
    let on_device = allocations.values().all(|a| {
        a.as_array()
            .is_some_and(|rs| rs.len() == 1 && rs[0]["device"] == device)
    });
    let ok = split.within(ctx.args.tolerance) && on_device;
    Ok((
        ok,
        json!({"split": split, "runs": runs, "tolerance": ctx.args.tolerance,
            "claims": allocations, "device": device, "more": extra}),
    ))
}

async fn memory(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    let cap = ctx.args.mem_cap_gib << 30;
    let labels = share_labels(
        "0.2",
        &[("sharedgpu/gpu_mem", &format!("{}Gi", ctx.args.mem_cap_gib))],
    );
    create(
        ctx,
        &pods::pod(&ctx.env, "mem", labels, &Work::Mem { cap_bytes: cap })?,
    )
    .await?;
    started(ctx, "mem").await?;
    let mut checks = BTreeMap::new();
    let details = match ctx.env.workload {
        Workload::Torch => {
            let log = log_until(ctx, "mem", ctx.timeout, |l| {
                has_phase(l, "oom") || has_phase(l, "no-oom")
            })
            .await?;
            let lines = json_lines(&log);
            let info = lines
                .iter()
                .find(|v| v["phase"] == "meminfo")
                .cloned()
                .unwrap_or_default();
            let end = lines
                .iter()
                .find(|v| v["phase"] == "oom" || v["phase"] == "no-oom")
                .cloned()
                .unwrap_or_default();
            checks.insert("cuda_total_is_the_cap", info["total"].as_u64() == Some(cap));
            // nvidia-smi's memory.total (MiB), through the hook's NVML answers.
            let smi_total = info["nvidia_smi"]["out"]
                .as_str()
                .and_then(|o| o.split(',').next())
                .and_then(|t| t.trim().parse::<u64>().ok());
            checks.insert("nvidia_smi_total_is_the_cap", smi_total == Some(cap >> 20));
            let allocated = end["allocated"].as_u64().unwrap_or(0);
            checks.insert("clean_oom", end["phase"] == "oom");
            checks.insert(
                "allocated_within_the_cap",
                allocated <= cap && allocated >= cap / 2,
            );
            json!({"meminfo": info, "end": end, "nvidia_smi_total_mib": smi_total})
        }
        Workload::Fake => {
            let log = log_until(ctx, "mem", ctx.timeout, |l| has_phase(l, "allocated")).await?;
            let lines = json_lines(&log);
            let info = lines
                .iter()
                .find(|v| v.get("total").is_some())
                .cloned()
                .unwrap_or_default();
            let alloc = lines
                .iter()
                .find(|v| v["phase"] == "allocated")
                .cloned()
                .unwrap_or_default();
            checks.insert("cuda_total_is_the_cap", info["total"].as_u64() == Some(cap));
            checks.insert("third_block_refused", alloc["codes"] == json!([0, 0, 2]));
            json!({"meminfo": info, "allocated": alloc})
        }
    };
    let ok = checks.values().all(|c| *c);
    Ok((ok, json!({"cap": cap, "checks": checks, "out": details})))
}

async fn no_gpu(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    create(
        ctx,
        &pods::pod(&ctx.env, "plain", pods::labels(&[]), &Work::Probe)?,
    )
    .await?;
    started(ctx, "plain").await?;
    let torch = ctx.env.workload == Workload::Torch;
    let log = log_until(ctx, "plain", ctx.timeout, |l| {
        l.contains("DEV=") && (!torch || has_phase(l, "probe"))
    })
    .await?;
    let nvd = field(&log, "NVD").unwrap_or_default().to_string();
    let devs = field(&log, "DEV").unwrap_or_default().trim().to_string();
    let mut checks = BTreeMap::new();
    checks.insert("nvidia_visible_devices_void", nvd == "void");
    checks.insert("no_dev_nvidia", devs.is_empty());
    let mut probe = Value::Null;
    if torch {
        probe = json_lines(&log)
            .into_iter()
            .find(|v| v["phase"] == "probe")
            .unwrap_or_default();
        checks.insert("cuda_unavailable", probe["cuda_available"] != true);
    }
    let ok = checks.values().all(|c| *c);
    Ok((
        ok,
        json!({"nvidia_visible_devices": nvd, "dev_nvidia": devs, "probe": probe, "checks": checks}),
    ))
}

async fn group(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    let seconds = ctx.args.seconds.min(10.0);
    let labels = share_labels(
        "0.3",
        &[
            ("sharedgpu/group_name", "trio"),
            ("sharedgpu/group_headcount", "3"),
            ("sharedgpu/group_threshold", "1.0"),
        ],
    );
    let mut tpl = pods::pod_json(
        &ctx.env,
        "unused",
        labels,
        &Work::Share {
            seconds,
            barrier: None,
        },
    );
    if let Some(m) = tpl["metadata"].as_object_mut() {
        m.remove("name");
    }
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "trio"},
        "spec": {"parallelism": 3, "completions": 3, "backoffLimit": 0, "template": tpl},
    }))?;
    let jobs: Api<Job> = Api::namespaced(ctx.client.clone(), &ctx.ns);
    jobs.create(&PostParams::default(), &job).await?;
    let done = kubeshare_testkit::wait_for(
        &jobs,
        "trio",
        ctx.timeout + Duration::from_secs_f64(seconds),
        |j: &Job| {
            j.status
                .as_ref()
                .is_some_and(|s| s.succeeded == Some(3) || s.failed.unwrap_or(0) > 0)
        },
    )
    .await?;
    let succeeded = done.status.and_then(|s| s.succeeded).unwrap_or(0);
    let workers = ctx
        .pods
        .list(&ListParams::default().labels("job-name=trio"))
        .await?;
    let mut starts = vec![];
    let mut per_pod = BTreeMap::new();
    for p in &workers.items {
        let name = p.name_any();
        let started_at = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.terminated.as_ref().and_then(|t| t.started_at.clone()))
            .map(|t| t.0.as_millisecond());
        if let Some(t) = started_at {
            starts.push(t);
        }
        let log = pod_logs(&ctx.pods, &name, "main").await.unwrap_or_default();
        let run = report::share_run(&log).ok();
        let hook = gpu_of(p).is_some_and(|g| hook_connected(&log, &g));
        per_pod.insert(
            name,
            json!({"run": run, "hook_connected": hook, "gpu": gpu_of(p)}),
        );
    }
    let spread_s = match (starts.iter().min(), starts.iter().max()) {
        (Some(a), Some(b)) if starts.len() == 3 => Some((b - a) as f64 / 1000.0),
        _ => None,
    };
    let all_computed = per_pod
        .values()
        .all(|v| v["run"]["kernels"].as_u64().unwrap_or(0) > 0 && v["hook_connected"] == true);
    let ok = succeeded == 3 && all_computed && spread_s.is_some_and(|s| s <= 10.0);
    Ok((
        ok,
        json!({"succeeded": succeeded, "start_spread_s": spread_s, "pods": per_pod}),
    ))
}

/// GPUs in the node's inventory (the first node with one).
async fn gpu_count(ctx: &Ctx<'_>) -> Result<usize> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    for n in nodes.list(&ListParams::default()).await? {
        if let Some(inv) = n.annotations().get("sharedgpu/inventory") {
            let v: Value = serde_json::from_str(inv)?;
            return Ok(v["gpus"].as_array().map_or(0, Vec::len));
        }
    }
    Err(anyhow!("no node has a sharedgpu/inventory"))
}

/// How long the `free` scenario waits for the next pod once the holder is deleted.
const FREED_SHARE_WAIT: Duration = Duration::from_secs(60);

async fn free(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    let gpus = gpu_count(ctx).await?;
    let hold = Work::Share {
        seconds: 3600.0,
        barrier: None,
    };
    create(
        ctx,
        &pods::pod(&ctx.env, "holder", share_labels("0.6", &[]), &hold)?,
    )
    .await?;
    started(ctx, "holder").await?;
    log_until(ctx, "holder", ctx.timeout, |l| has_phase(l, "ready")).await?;
    let next = Work::Share {
        seconds: 3.0,
        barrier: None,
    };
    create(
        ctx,
        &pods::pod(&ctx.env, "next", share_labels("0.6", &[]), &next)?,
    )
    .await?;
    // With one GPU, 0.6 + 0.6 does not fit: `next` waits for the holder's share.
    let mut waited = Value::Null;
    if gpus == 1 {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let p = ctx.pods.get("next").await?;
        let placed =
            p.spec.as_ref().and_then(|s| s.node_name.clone()).is_some() || gpu_of(&p).is_some();
        ensure!(
            !placed,
            "next (0.6) was placed beside the holder (0.6) on the one GPU"
        );
        waited = json!(true);
    }
    let t0 = Instant::now();
    ctx.pods
        .delete(
            "holder",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await?;
    // "Within seconds": a minute is far past that (and well short of kube-scheduler's own
    // fallback for a pod that no event moves: 5 min in its unschedulable queue).
    started_within(ctx, "next", FREED_SHARE_WAIT).await?;
    let to_running = t0.elapsed().as_secs_f64();
    log_until(ctx, "next", ctx.timeout, |l| {
        has_phase(l, "ready") || has_result(l)
    })
    .await?;
    let to_ready = t0.elapsed().as_secs_f64();
    let log = log_until(ctx, "next", ctx.timeout, has_result).await?;
    let run = report::share_run(&log)?;
    let ok = to_running <= 30.0 && run.kernels > 0;
    Ok((
        ok,
        json!({"gpus": gpus, "next_waited_for_the_share": waited,
        "delete_to_running_s": to_running, "delete_to_ready_s": to_ready, "next_run": run}),
    ))
}

async fn daemon_restart(ctx: &Ctx<'_>) -> Result<(bool, Value)> {
    let seconds = ctx.args.seconds.max(24.0);
    let daemons: Api<Pod> = Api::namespaced(ctx.client.clone(), KUBESHARE_NS);
    let timeout = ctx.timeout;
    let restart = || async move {
        tokio::time::sleep(Duration::from_secs(6)).await;
        let lp = ListParams::default().labels(NODE_DAEMON_SELECTOR);
        let old: Vec<String> = daemons
            .list(&lp)
            .await?
            .iter()
            .map(|p| p.name_any())
            .collect();
        ensure!(!old.is_empty(), "no node daemon pod");
        let t0 = Instant::now();
        for n in &old {
            daemons.delete(n, &DeleteParams::default()).await?;
        }
        let deadline = Instant::now() + timeout;
        loop {
            let list = daemons.list(&lp).await?;
            let ready = list.iter().any(|p| {
                !old.contains(&p.name_any())
                    && p.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
            });
            if ready {
                return Ok(
                    json!({"replaced": old, "new_daemon_ready_s": t0.elapsed().as_secs_f64()}),
                );
            }
            ensure!(
                Instant::now() < deadline,
                "no new node daemon Ready in {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let (split, extra, runs) = share_run(
        ctx,
        &[("d30", 0.3), ("d70", 0.7)],
        seconds,
        &Placement::Labels,
        Some(restart),
    )
    .await?;
    let ok = split.within(ctx.args.tolerance);
    Ok((
        ok,
        json!({"split": split, "runs": runs, "tolerance": ctx.args.tolerance, "more": extra}),
    ))
}
