//! High availability on the real control plane: two kube-scheduler + extender pairs,
//! as the chart runs them (two pods of kubeshare-scheduler, each a kube-scheduler
//! with its extender beside it), whose kube-schedulers elect a leader through a Lease.
//! A burst of 500 GPU pods; the leader pair is killed (SIGKILL, as losing its node
//! would) while it schedules. Scheduling moves to the other pair within 20 s, every pod
//! ends bound with its allocation record, and no GPU is booked above 1.0.
//!
//! The kube-scheduler configuration is the chart's (manifests/kube-scheduler.yaml,
//! leader election included), with only the kubeconfig, the extender's port, the
//! profile's name and the Lease's namespace changed for this test; the pods carry
//! the mark the webhook gives GPU pods (the chart's extender sees only those). The
//! profile's name is this test's own, so the rig's kubeshare-scheduler never takes
//! these pods; the rig's extender is not used.

#[allow(dead_code, unused_imports)]
#[path = "cluster/rig.rs"]
mod rig;

use std::time::Instant;

use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kubeshare_api::{GPU_POD_MARK, GPU_POD_RESOURCE};
use rig::*;

const PODS: usize = 500;
const NODES: usize = 16;
const GPUS: u32 = 8;
const MEM_GIB: u64 = 80;
/// Pods bound by the first leader before it is killed.
const KILL_AFTER: usize = 100;
const FAILOVER: Duration = Duration::from_secs(20);

/// One kube-scheduler or extender process, killed (SIGKILL) when dropped.
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(cmd: &mut Command, log: PathBuf) -> Result<Proc> {
        let f = std::fs::File::create(&log)?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .spawn()
            .with_context(|| format!("starting {cmd:?}"))?;
        Ok(Proc { child, log })
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log_has(&self, needle: &str) -> bool {
        std::fs::read_to_string(&self.log).is_ok_and(|l| l.contains(needle))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A kube-scheduler and its extender.
struct Pair {
    scheduler: Proc,
    extender: Proc,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The embedded `scheduler-config.yaml` of manifests/kube-scheduler.yaml's ConfigMap.
fn chart_scheduler_config() -> Result<String> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../manifests/kube-scheduler.yaml"
    ))?;
    let mut lines = text
        .lines()
        .skip_while(|l| l.trim() != "scheduler-config.yaml: |");
    lines
        .next()
        .context("no scheduler-config.yaml in manifests/kube-scheduler.yaml")?;
    let block: Vec<&str> = lines
        .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
        .collect();
    Ok(block
        .iter()
        .map(|l| l.get(4..).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Replaces the one occurrence of `from` in `text`.
fn replace_once(text: &str, from: &str, to: &str) -> Result<String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => bail!("{n} occurrences of {from:?} in the chart's scheduler config"),
    }
}

async fn start_pair(
    cluster: &Cluster,
    dir: &std::path::Path,
    name: &str,
    profile: &str,
    namespace: &str,
) -> Result<Pair> {
    let port = free_port()?;
    let extender = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_kubeshare-extender"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--kubeconfig")
            .arg(cluster.kubeconfig(Identity::Extender)?)
            .args(["--scheduler-name", profile, "--filter-top", "1"])
            .env("RUST_LOG", "info"),
        dir.join(format!("{name}-extender.log")),
    )?;
    let mut config = chart_scheduler_config()?;
    let kubeconfig = cluster
        .kubeconfig(Identity::KubeScheduler)?
        .display()
        .to_string();
    config = replace_once(
        &config,
        "kubeconfig: \"\"",
        &format!("kubeconfig: {kubeconfig}"),
    )?;
    config = replace_once(
        &config,
        "urlPrefix: http://127.0.0.1:8888",
        &format!("urlPrefix: http://127.0.0.1:{port}"),
    )?;
    config = replace_once(
        &config,
        "- schedulerName: kubeshare-scheduler",
        &format!("- schedulerName: {profile}"),
    )?;
    config = replace_once(
        &config,
        "resourceNamespace: kubeshare-system",
        &format!("resourceNamespace: {namespace}"),
    )?;
    let path = dir.join(format!("{name}-config.yaml"));
    std::fs::write(&path, &config)?;
    let kc = cluster.kubeconfig(Identity::KubeScheduler)?;
    let scheduler = Proc::spawn(
        Command::new(cluster.bin_dir().join("kube-scheduler"))
            .arg(format!("--config={}", path.display()))
            .arg(format!("--authentication-kubeconfig={}", kc.display()))
            .arg(format!("--authorization-kubeconfig={}", kc.display()))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port()?))
            .arg(format!(
                "--cert-dir={}",
                dir.join(format!("{name}-certs")).display()
            ))
            .arg("--v=2"),
        dir.join(format!("{name}-scheduler.log")),
    )?;
    // The extender serves once both watches have listed; a standby's as well.
    wait_until(&format!("extender {name} /readyz"), WAIT, || async move {
        match get(port, "/readyz").await {
            Ok((200, _)) => Ok(Some(())),
            Ok((s, b)) => Err(format!("{s} {b}")),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    Ok(Pair {
        scheduler,
        extender,
    })
}

/// How many of the namespace's pods are bound.
async fn bound_count(pods: &Api<Pod>) -> Result<usize> {
    Ok(pods
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
        .count())
}

const ACQUIRED: &str = "Successfully acquired lease";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_standby_pair_takes_over_when_the_leader_pair_is_lost_mid_burst() -> Result<()> {
    let mut rig = Rig::new("ha").await?;
    // This test's pairs bring their own extenders.
    rig.kill_extender();
    let ns = rig.ns.name().to_string();
    let profile = format!("kubeshare-ha-{}", &ns[ns.len().saturating_sub(8)..]);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("ha-{ns}"));
    std::fs::create_dir_all(&dir)?;

    // The leader-election Lease: the rules of the chart's Role (the built-in
    // kube-scheduler role covers only the Lease named kube-scheduler), bound to the
    // rig's scheduler user.
    let pp = PostParams::default();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "kubeshare-scheduler-leader-election"},
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "resourceNames": ["kubeshare-scheduler"], "verbs": ["get", "update"]}
        ]
    }))?;
    Api::<Role>::namespaced(rig.admin.clone(), &ns)
        .create(&pp, &role)
        .await?;
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "kubeshare-scheduler-leader-election"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kubeshare-scheduler-leader-election"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": Identity::KubeScheduler.user()}]
    }))?;
    Api::<RoleBinding>::namespaced(rig.admin.clone(), &ns)
        .create(&pp, &rb)
        .await?;

    for i in 0..NODES {
        rig.node(&format!("ha{i}"), GPUS, "NVIDIA-H100-80GB-HBM3", MEM_GIB)
            .await?;
    }
    let mut pairs = vec![
        Some(start_pair(rig.cluster, &dir, "a", &profile, &ns).await?),
        Some(start_pair(rig.cluster, &dir, "b", &profile, &ns).await?),
    ];
    let leader = wait_until("a kube-scheduler to lead", WAIT, || {
        let has: Vec<bool> = pairs
            .iter()
            .map(|p| p.as_ref().is_some_and(|p| p.scheduler.log_has(ACQUIRED)))
            .collect();
        async move {
            match has.iter().position(|h| *h) {
                Some(i) => Ok(Some(i)),
                None => Err("no lease acquired yet".to_string()),
            }
        }
    })
    .await?;
    let standby = 1 - leader;
    assert!(
        !pairs[standby]
            .as_ref()
            .is_some_and(|p| p.scheduler.log_has(ACQUIRED)),
        "both kube-schedulers lead"
    );

    // The burst: 500 pods of 0.1, 0.2 and 0.25 (92 GPUs' worth on 128), created as
    // fast as the API takes them.
    let pods = rig.pods();
    let shares = ["0.1", "0.2", "0.25"];
    let mut set = tokio::task::JoinSet::new();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(16));
    for i in 0..PODS {
        let share = shares[i % shares.len()];
        let mut p = rig.pod_json(
            &format!("burst-{i}"),
            &[("gpu_request", share), ("gpu_limit", share)],
        );
        p["spec"]["schedulerName"] = json!(profile);
        p["spec"]["containers"][0]["resources"] = json!({
            "limits": {GPU_POD_RESOURCE: GPU_POD_MARK}, "requests": {GPU_POD_RESOURCE: GPU_POD_MARK}});
        let p: Pod = serde_json::from_value(p)?;
        let (pods, sem) = (pods.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await?;
            pods.create(&PostParams::default(), &p).await?;
            anyhow::Ok(())
        });
    }

    // Kill the leader pair once it has bound some of them, while the rest are coming.
    let before = wait_until(
        "the leader to bind the first pods",
        Duration::from_secs(180),
        || {
            let pods = pods.clone();
            async move {
                let n = bound_count(&pods).await.map_err(|e| e.to_string())?;
                if n >= KILL_AFTER {
                    Ok(Some(n))
                } else {
                    Err(format!("{n} bound"))
                }
            }
        },
    )
    .await?;
    if let Some(mut p) = pairs[leader].take() {
        p.scheduler.kill();
        p.extender.kill();
    }
    let killed = Instant::now();
    // Binds in flight when it died may still land: count from what is bound a moment on.
    let at_kill = bound_count(&pods).await?;
    eprintln!("killed leader pair {leader} with {before}..{at_kill} of {PODS} pods bound");
    assert!(
        at_kill < PODS,
        "the leader placed every pod before it was killed: no failover to see"
    );
    let standby_log = pairs[standby]
        .as_ref()
        .map(|p| p.scheduler.log.clone())
        .context("standby")?;
    let (took, bound_then) = wait_until(
        "the standby pair to schedule",
        Duration::from_secs(60),
        || {
            let (pods, log) = (pods.clone(), standby_log.clone());
            async move {
                let leads = std::fs::read_to_string(&log).is_ok_and(|l| l.contains(ACQUIRED));
                let n = bound_count(&pods).await.map_err(|e| e.to_string())?;
                if leads && n > at_kill {
                    Ok(Some((killed.elapsed(), n)))
                } else {
                    Err(format!("leads: {leads}, {n} bound"))
                }
            }
        },
    )
    .await?;
    eprintln!(
        "the standby pair bound its first pod {took:.1?} after the kill ({bound_then} bound)"
    );
    assert!(took <= FAILOVER, "failover took {took:?}");

    while let Some(r) = set.join_next().await {
        r??;
    }
    let left = wait_until("every pod bound", Duration::from_secs(300), || {
        let pods = pods.clone();
        async move {
            let n = bound_count(&pods).await.map_err(|e| e.to_string())?;
            if n == PODS {
                Ok(Some(n))
            } else {
                Err(format!("{n} of {PODS} bound"))
            }
        }
    })
    .await?;
    assert_eq!(left, PODS);
    // Every bound pod has its record, matching its node and labels; no GPU above 1.0.
    let bound = rig.check_no_overcommit(MEM_GIB * GIB).await?;
    assert_eq!(bound, PODS);

    drop(pairs);
    rig.cleanup().await?;
    Ok(())
}
