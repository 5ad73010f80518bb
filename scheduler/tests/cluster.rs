//! The extender on the real control plane: the real kube-scheduler (profile
//! `kubeshare-scheduler`) calls the built `kubeshare-extender` binary on the
//! cluster's extender port; kwok nodes carry GPU inventories these tests write.
//!
//! Tests run one at a time (one extender on the port); each uses its own
//! namespace and `ext-` nodes, and pins its pods to its nodes with a nodeSelector.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kubeshare_api::inventory::INVENTORY_ANNOTATION;
use kubeshare_api::{Allocation, GpuDemand, GpuInfo, NodeInventory};
use kubeshare_testkit::{
    Cluster, Identity, KwokNode, RUN_DURATION_ANNOTATION, TestNamespace, create_kwok_node,
    delete_node, node_is_ready, wait_for, wait_until,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(60);
const GIB: u64 = 1 << 30;
const SELECTOR: &str = "kubeshare.io/ext-test";

/// One extender at a time on the cluster's port.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The extender binary, killed (SIGKILL) when dropped.
struct ExtenderProc {
    child: Child,
    port: u16,
}

impl ExtenderProc {
    async fn start(cluster: &Cluster, log_name: &str) -> Result<ExtenderProc> {
        let port = cluster.extender_port();
        let kubeconfig = cluster.kubeconfig(Identity::Extender)?;
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("extender-logs");
        std::fs::create_dir_all(&dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{log_name}.log")))?;
        let child = Command::new(env!("CARGO_BIN_EXE_kubeshare-extender"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--group-reservation-timeout", "20"])
            .env("RUST_LOG", "info,kubeshare_scheduler=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting kubeshare-extender")?;
        let p = ExtenderProc { child, port };
        wait_until("extender /readyz", WAIT, || async move {
            match get(port, "/readyz").await {
                Ok((200, _)) => Ok(Some(())),
                Ok((s, b)) => Err(format!("{s} {b}")),
                Err(e) => Err(e.to_string()),
            }
        })
        .await?;
        Ok(p)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ExtenderProc {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let status = out.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok((
        status,
        out.split_once("\r\n\r\n")
            .map(|x| x.1.to_string())
            .unwrap_or_default(),
    ))
}

fn uuid(node: &str, i: u32) -> String {
    // A stable UUID per (node, index): 8 hex digits of a hash of the name.
    let h = node.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    });
    format!("GPU-{:08x}-0000-0000-0000-{i:012x}", h as u32)
}

fn inventory(node: &str, gpus: u32, model: &str, mem_gib: u64) -> NodeInventory {
    NodeInventory {
        gpus: (0..gpus)
            .map(|i| GpuInfo {
                uuid: uuid(node, i),
                index: i,
                model: model.into(),
                memory: mem_gib * GIB,
                numa_node: Some(0),
                nvlink_peers: vec![],
                held_by: None,
            })
            .collect(),
    }
}

/// A test's namespace, nodes and extender.
struct Rig {
    cluster: &'static Cluster,
    admin: kube::Client,
    ns: TestNamespace,
    nodes: Vec<String>,
    ext: Option<ExtenderProc>,
}

impl Rig {
    async fn new(test: &str) -> Result<Rig> {
        let cluster = Cluster::shared()?;
        let admin = cluster.client(Identity::Admin).await?;
        let ns = TestNamespace::create(cluster, &format!("ext-{test}")).await?;
        let ext = ExtenderProc::start(cluster, test).await?;
        Ok(Rig {
            cluster,
            admin,
            ns,
            nodes: vec![],
            ext: Some(ext),
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), self.ns.name())
    }

    /// A kwok node with `gpus` GPUs of `model`, ready.
    async fn node(&mut self, what: &str, gpus: u32, model: &str, mem_gib: u64) -> Result<String> {
        let name = self.ns.unique_name(what);
        let inv = inventory(&name, gpus, model, mem_gib);
        create_kwok_node(
            &self.admin,
            &KwokNode::new(&name)
                .label(SELECTOR, self.ns.name())
                .annotation(INVENTORY_ANNOTATION, inv.to_json()),
        )
        .await?;
        self.nodes.push(name.clone());
        let nodes: Api<Node> = Api::all(self.admin.clone());
        wait_for(&nodes, &name, WAIT, node_is_ready).await?;
        Ok(name)
    }

    async fn set_inventory(&self, node: &str, inv: &NodeInventory) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let p = json!({"metadata": {"annotations": {INVENTORY_ANNOTATION: inv.to_json()}}});
        nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        Ok(())
    }

    fn pod_json(&self, name: &str, labels: &[(&str, &str)]) -> serde_json::Value {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
            .collect();
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "schedulerName": "kubeshare-scheduler",
                "nodeSelector": {SELECTOR: self.ns.name()},
                "containers": [{"name": "main", "image": "registry.invalid/cuda:1"}]
            }
        })
    }

    async fn create(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
        let p: Pod = serde_json::from_value(self.pod_json(name, labels))?;
        self.pods().create(&PostParams::default(), &p).await?;
        Ok(())
    }

    /// Waits until the pod is bound; returns its allocation.
    async fn bound(&self, name: &str) -> Result<Allocation> {
        let p = wait_for(&self.pods(), name, WAIT, |p: &Pod| {
            p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
        })
        .await?;
        let a = Allocation::from_annotations(&p.metadata.annotations.clone().unwrap_or_default())?
            .context("bound pod has no allocation annotations")?;
        let node = p.spec.and_then(|s| s.node_name).unwrap_or_default();
        assert_eq!(a.node, node, "annotation node = bound node");
        Ok(a)
    }

    /// Waits for a FailedScheduling event on the pod whose message contains `needle`.
    async fn failed_with(&self, pod: &str, needle: &str) -> Result<String> {
        let events: Api<Event> = Api::namespaced(self.admin.clone(), self.ns.name());
        let lp = ListParams::default().fields(&format!("involvedObject.name={pod}"));
        wait_until(
            &format!("FailedScheduling of {pod} with {needle:?}"),
            WAIT,
            || {
                let events = events.clone();
                let lp = lp.clone();
                async move {
                    let l = events.list(&lp).await.map_err(|e| e.to_string())?;
                    let msgs: Vec<String> = l
                        .items
                        .iter()
                        .filter(|e| e.reason.as_deref() == Some("FailedScheduling"))
                        .filter_map(|e| e.message.clone())
                        .collect();
                    match msgs.iter().find(|m| m.contains(needle)) {
                        Some(m) => Ok(Some(m.clone())),
                        None => Err(format!("messages so far: {msgs:?}")),
                    }
                }
            },
        )
        .await
        .map_err(Into::into)
    }

    async fn unbound_names(&self) -> Result<Vec<String>> {
        Ok(self
            .pods()
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
            .filter_map(|p| p.metadata.name)
            .collect())
    }

    /// The truth, from the API: per GPU, the requests and memory of bound pods.
    async fn check_no_overcommit(&self, mem_per_gpu: u64) -> Result<usize> {
        // Per GPU: milli, device-mode caps, unified-memory resident shares.
        let mut per_gpu: HashMap<String, (u32, u64, u64)> = HashMap::new();
        let mut bound = 0;
        for p in self.pods().list(&ListParams::default()).await?.items {
            if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none() {
                continue;
            }
            bound += 1;
            let a = Allocation::from_annotations(&p.metadata.annotations.unwrap_or_default())?
                .context("bound without allocation")?;
            // The record holds the granted share; it matches the labels' request.
            let d = GpuDemand::from_labels(&p.metadata.labels.unwrap_or_default())?
                .context("no demand")?;
            assert_eq!(a.granted.request_per_gpu(), d.request_per_gpu());
            assert_eq!(a.granted.limit_per_gpu(), d.limit_per_gpu());
            for u in &a.gpu_uuids {
                let e = per_gpu.entry(u.clone()).or_default();
                e.0 += u32::from(a.granted.request_per_gpu().get());
                match a.gpu_mem_resident {
                    None => e.1 += a.gpu_mem,
                    Some(r) => e.2 += r,
                }
            }
        }
        for (u, (m, d, um)) in per_gpu {
            // Unified-memory shares may reach the default factor (1.5) of what device
            // caps leave; nothing else overcommits.
            if m > 1000 || d > mem_per_gpu || um > (mem_per_gpu - d) / 2 * 3 {
                bail!("{u} over-committed: {m} milli, {d} bytes of caps, {um} of unified shares");
            }
        }
        Ok(bound)
    }

    async fn cleanup(mut self) -> Result<()> {
        self.ext.take();
        for n in &self.nodes {
            delete_node(&self.admin, n).await?;
        }
        self.ns.delete().await?;
        Ok(())
    }
}

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

#[tokio::test]
async fn two_halves_share_a_gpu_and_a_third_goes_elsewhere() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("share").await?;
    let node = rig.node("n", 2, "NVIDIA-H100-80GB-HBM3", 80).await?;
    let half = [("gpu_request", "0.5"), ("gpu_limit", "1.0")];
    rig.create("a", &half).await?;
    let a = rig.bound("a").await?;
    rig.create("b", &half).await?;
    let b = rig.bound("b").await?;
    rig.create("c", &half).await?;
    let c = rig.bound("c").await?;
    assert_eq!(a.gpu_uuids, b.gpu_uuids, "two halves share one GPU");
    assert_ne!(a.gpu_uuids, c.gpu_uuids, "the third goes to the other GPU");
    assert_eq!(a.node, node);
    assert_eq!(a.gpu_mem, 40 * GIB, "default memory: request × GPU memory");
    assert_eq!(a.gpu_model, "NVIDIA-H100-80GB-HBM3");
    // A fourth that does not fit waits, and the event says why, per GPU.
    rig.create("d", &[("gpu_request", "0.6"), ("gpu_limit", "1.0")])
        .await?;
    let msg = rig.failed_with("d", "0.5 free < 0.6 requested").await?;
    assert!(msg.contains(&format!("{node}/gpu 1")), "{msg}");
    // The extender's own event on a bound pod.
    let events: Api<Event> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    let ev = wait_until("GpuAllocated event on a", WAIT, || {
        let events = events.clone();
        async move {
            let l = events
                .list(&ListParams::default().fields("involvedObject.name=a"))
                .await
                .map_err(|e| e.to_string())?;
            Ok(l.items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some("GpuAllocated")))
        }
    })
    .await?;
    let note = ev.message.unwrap_or_default();
    assert!(note.contains(&format!("{node}/gpu ")), "{note}");
    // The metrics show the books.
    let (_, metrics) = get(rig.cluster.extender_port(), "/metrics").await?;
    assert!(metrics.contains(&format!(
        "kubeshare_gpu_allocated_share{{node=\"{node}\",gpu=\"0\""
    )));
    rig.cleanup().await
}

#[tokio::test]
async fn memory_decides_where_requests_alone_would_fit() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("mem").await?;
    rig.node("n", 2, "A", 40).await?;
    rig.create(
        "big",
        &[
            ("gpu_request", "0.2"),
            ("gpu_limit", "0.2"),
            ("gpu_mem", "36Gi"),
        ],
    )
    .await?;
    let big = rig.bound("big").await?;
    rig.create(
        "small",
        &[
            ("gpu_request", "0.2"),
            ("gpu_limit", "0.5"),
            ("gpu_mem", "8Gi"),
        ],
    )
    .await?;
    let small = rig.bound("small").await?;
    assert_ne!(
        big.gpu_uuids, small.gpu_uuids,
        "packing would pick the busy GPU if memory were ignored"
    );
    assert_eq!(small.gpu_mem, 8 * GIB);
    rig.cleanup().await
}

/// Unified-memory pods overcommit a GPU's memory up to the extender's factor (default 1.5)
/// through the real kube-scheduler; their records carry the managed ceiling as `gpu_mem`
/// and the resident share beside it; past the factor a unified pod and a device-mode pod
/// are refused, each with its reason.
#[tokio::test]
async fn unified_memory_pods_overcommit_up_to_the_factor() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("um").await?;
    rig.node("n", 1, "A", 40).await?;
    let um = |mem: &'static str| {
        [
            ("gpu_request", "0.1"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", mem),
            ("gpu_mem_mode", "unified"),
        ]
    };
    for name in ["u1", "u2", "u3"] {
        rig.create(name, &um("20Gi")).await?;
        let a = rig.bound(name).await?;
        assert_eq!((a.gpu_mem, a.gpu_mem_resident), (40 * GIB, Some(20 * GIB)));
    }
    rig.create("u4", &um("1Gi")).await?;
    rig.failed_with("u4", "of unified-memory room (1.5 ×")
        .await?;
    rig.create(
        "dev",
        &[
            ("gpu_request", "0.1"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", "1Gi"),
        ],
    )
    .await?;
    rig.failed_with("dev", "memory free < 1.0 GiB requested")
        .await?;
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 3);
    rig.cleanup().await
}

#[tokio::test]
async fn gpu_model_restricts_the_gpus() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("model").await?;
    rig.node("a", 1, "NVIDIA-A100-SXM4-40GB", 40).await?;
    let h = rig.node("h", 1, "NVIDIA-H200", 141).await?;
    rig.create(
        "p",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("gpu_model", "NVIDIA-H200"),
        ],
    )
    .await?;
    let p = rig.bound("p").await?;
    assert_eq!(p.node, h);
    assert_eq!(p.gpu_model, "NVIDIA-H200");
    rig.create(
        "q",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("gpu_model", "NVIDIA-B200"),
        ],
    )
    .await?;
    rig.failed_with("q", "no NVIDIA-B200 GPU").await?;
    // A pod of our scheduler that asks for no GPU is bound as is, without annotations.
    rig.create("plain", &[]).await?;
    let p = wait_for(&rig.pods(), "plain", WAIT, |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
    })
    .await?;
    assert!(Allocation::from_annotations(&p.metadata.annotations.unwrap_or_default())?.is_none());
    rig.cleanup().await
}

#[tokio::test]
async fn priority_zero_packs_and_priority_above_zero_spreads() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("pack").await?;
    rig.node("x", 1, "A", 40).await?;
    rig.node("y", 1, "A", 40).await?;
    let pack = [("gpu_request", "0.3"), ("gpu_limit", "1")];
    rig.create("p1", &pack).await?;
    let p1 = rig.bound("p1").await?;
    rig.create("p2", &pack).await?;
    let p2 = rig.bound("p2").await?;
    assert_eq!(
        p1.gpu_uuids, p2.gpu_uuids,
        "priority 0 packs onto the busy GPU"
    );
    let spread = [
        ("gpu_request", "0.3"),
        ("gpu_limit", "1"),
        ("priority", "50"),
    ];
    rig.create("s1", &spread).await?;
    let s1 = rig.bound("s1").await?;
    assert_ne!(s1.node, p1.node, "priority > 0 goes to the idle node");
    rig.cleanup().await
}

#[tokio::test]
async fn locality_tags() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("tags").await?;
    rig.node("x", 2, "A", 40).await?;
    rig.node("y", 2, "A", 40).await?;
    // Affinity: same GPU, even for spreading pods.
    let aff = [
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("priority", "10"),
        ("sched_affinity", "t"),
    ];
    rig.create("aff1", &aff).await?;
    let a1 = rig.bound("aff1").await?;
    rig.create("aff2", &aff).await?;
    let a2 = rig.bound("aff2").await?;
    assert_eq!((&a1.node, &a1.gpu_uuids), (&a2.node, &a2.gpu_uuids));
    // Anti-affinity: different GPUs, even for packing pods.
    let anti = [
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("sched_anti-affinity", "s"),
    ];
    rig.create("anti1", &anti).await?;
    let n1 = rig.bound("anti1").await?;
    rig.create("anti2", &anti).await?;
    let n2 = rig.bound("anti2").await?;
    assert_ne!(n1.gpu_uuids, n2.gpu_uuids);
    // Exclusion: a GPU holding tag e1 takes no e2 pod.
    let e1 = [
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "e1"),
    ];
    let e2 = [
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "e2"),
    ];
    rig.create("ex1", &e1).await?;
    let x1 = rig.bound("ex1").await?;
    rig.create("ex2", &e2).await?;
    let x2 = rig.bound("ex2").await?;
    assert_ne!(x1.gpu_uuids, x2.gpu_uuids);
    rig.check_no_overcommit(40 * GIB).await?;
    rig.cleanup().await
}

/// kube-scheduler stops searching after a fraction of a large cluster's nodes, so
/// a pod tied to one node (here by its affinity tag) may be sent names without
/// that node. The extender then sets the pod's `status.nominatedNodeName` (which
/// kube-scheduler tries before any other node) and wakes it. Made deterministic
/// here by cordoning the node: kube-scheduler's own filter leaves it out.
#[tokio::test]
async fn a_pod_tied_to_a_node_the_scheduler_did_not_send_is_nominated_there() -> Result<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let _g = serial().await;
    let mut rig = Rig::new("nominate").await?;
    rig.node("x", 1, "A", 40).await?;
    rig.node("y", 1, "A", 40).await?;
    let aff = [
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_affinity", "t"),
    ];
    rig.create("aff1", &aff).await?;
    let a1 = rig.bound("aff1").await?;
    let nodes: Api<Node> = Api::all(rig.admin.clone());
    let cordon = |on: bool| json!({"spec": {"unschedulable": on}});
    let pp = PatchParams::default();
    nodes
        .patch(&a1.node, &pp, &Patch::Merge(&cordon(true)))
        .await?;
    // Every version of aff2 the API serves, watched from before it exists (a
    // failed retry clears the nomination again, so a poll could miss it).
    let cfg = watcher::Config::default().fields("metadata.name=aff2");
    let first_nominated = tokio::spawn(
        watcher(rig.pods(), cfg)
            .applied_objects()
            .filter_map(|p| async move {
                p.ok()?
                    .status?
                    .nominated_node_name
                    .filter(|n| !n.is_empty())
            })
            .boxed()
            .into_future(),
    );
    rig.create("aff2", &aff).await?;
    rig.failed_with("aff2", "affinity tag t lives on").await?;
    let (nominated, _) = tokio::time::timeout(WAIT, first_nominated)
        .await
        .context("aff2 was never nominated")??;
    assert_eq!(nominated.as_deref(), Some(a1.node.as_str()));
    // Uncordoned, it goes there, onto its tag's GPU.
    nodes
        .patch(&a1.node, &pp, &Patch::Merge(&cordon(false)))
        .await?;
    let a2 = rig.bound("aff2").await?;
    assert_eq!((&a2.node, &a2.gpu_uuids), (&a1.node, &a1.gpu_uuids));
    rig.check_no_overcommit(40 * GIB).await?;
    rig.cleanup().await
}

fn member_labels(head: &str, threshold: &'static str) -> Vec<(&'static str, String)> {
    vec![
        ("gpu_request", "0.5".into()),
        ("gpu_limit", "1.0".into()),
        ("group_name", "train-a".into()),
        ("group_headcount", head.into()),
        ("group_threshold", threshold.into()),
    ]
}

#[tokio::test]
async fn a_group_of_five_waits_for_room_for_three() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("gang").await?;
    // Room for 2 members of 0.5 on one GPU; ⌈0.6 × 5⌉ = 3 must start together.
    let node = rig.node("n", 1, "A", 40).await?;
    let labels = member_labels("5", "0.6");
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    rig.create("m0", &labels).await?;
    rig.failed_with("m0", "group train-a: 1 of 3 required members exist")
        .await?;
    for i in 1..5 {
        rig.create(&format!("m{i}"), &labels).await?;
    }
    rig.failed_with(
        "m3",
        "group train-a: 2 of 3 required members can be placed at once",
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        rig.unbound_names().await?.len(),
        5,
        "no member is bound before the group is admitted"
    );

    // Room for 2 more appears: the group starts (4 fit now).
    rig.set_inventory(&node, &inventory(&node, 2, "A", 40))
        .await?;
    wait_until("4 members bound", WAIT, || {
        let rig = &rig;
        async move {
            let n = rig.unbound_names().await.map_err(|e| e.to_string())?.len();
            if n == 1 {
                Ok(Some(()))
            } else {
                Err(format!("{n} unbound"))
            }
        }
    })
    .await?;
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 4);
    rig.cleanup().await
}

#[tokio::test]
async fn a_job_whose_pods_carry_group_labels() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("job").await?;
    rig.node("n", 2, "A", 40).await?;
    let mut tmpl = rig.pod_json("unused", &[]);
    let labels: BTreeMap<String, String> = member_labels("3", "1.0")
        .into_iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v))
        .collect();
    tmpl["metadata"] = json!({"labels": labels, "annotations": {RUN_DURATION_ANNOTATION: "3s"}});
    tmpl["spec"]["restartPolicy"] = json!("Never");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train-a"},
        "spec": {"parallelism": 3, "completions": 3, "backoffLimit": 0,
                 "template": {"metadata": tmpl["metadata"], "spec": tmpl["spec"]}}
    }))?;
    let jobs: Api<Job> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    jobs.create(&PostParams::default(), &job).await?;
    // All three are bound, by the extender, keeping their Job as owner.
    let bound = wait_until("3 job pods bound", WAIT, || {
        let pods = rig.pods();
        async move {
            let l = pods
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let b: Vec<Pod> = l
                .items
                .into_iter()
                .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
                .collect();
            Ok((b.len() >= 3).then_some(b))
        }
    })
    .await?;
    for p in &bound {
        let owner = p.metadata.owner_references.clone().unwrap_or_default();
        assert_eq!(owner.first().map(|o| o.kind.as_str()), Some("Job"));
        assert!(
            Allocation::from_annotations(&p.metadata.annotations.clone().unwrap_or_default())?
                .is_some()
        );
    }
    rig.check_no_overcommit(40 * GIB).await?;
    // kwok runs them to completion, and the Job succeeds.
    wait_for(&jobs, "train-a", WAIT, |j: &Job| {
        j.status.as_ref().and_then(|s| s.succeeded) == Some(3)
    })
    .await?;
    rig.cleanup().await
}

#[tokio::test]
async fn killing_and_restarting_the_extender_never_double_allocates() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("restart").await?;
    // 2 nodes × 2 GPUs × 4 quarters = 16 places for 24 pods.
    rig.node("x", 2, "A", 40).await?;
    rig.node("y", 2, "A", 40).await?;
    let quarter = [("gpu_request", "0.25"), ("gpu_limit", "0.5")];
    for i in 0..24 {
        rig.create(&format!("q{i:02}"), &quarter).await?;
        if i % 8 == 7 {
            // Kill it hard while pods are scheduling, and start a new one.
            if let Some(e) = rig.ext.as_mut() {
                e.kill();
            }
            rig.ext = Some(ExtenderProc::start(rig.cluster, "restart").await?);
        }
    }
    wait_until("16 pods bound", WAIT, || {
        let rig = &rig;
        async move {
            let n = rig.unbound_names().await.map_err(|e| e.to_string())?.len();
            if n <= 8 {
                Ok(Some(()))
            } else {
                Err(format!("{n} unbound"))
            }
        }
    })
    .await?;
    // Let the scheduler retry the rest a few times: none of them may fit.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 16);
    let port = rig.ext.as_ref().map(|e| e.port).unwrap_or_default();
    let (_, metrics) = get(port, "/metrics").await?;
    assert!(metrics.contains("kubeshare_extender_synced 1"));
    rig.cleanup().await
}

/// The extender's `/metrics` value of `kubeshare_extender_bookings{kind}`.
async fn bookings(port: u16, kind: &str) -> Result<u64> {
    let (_, m) = get(port, "/metrics").await?;
    let needle = format!("kubeshare_extender_bookings{{kind=\"{kind}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|v| v.trim().parse().ok())
        .context("no bookings metric")
}

/// The share booked on `node`'s GPUs (thousandths, summed), from `/metrics`.
async fn node_share(port: u16, node: &str) -> Result<u64> {
    let (_, m) = get(port, "/metrics").await?;
    let needle = format!("kubeshare_gpu_allocated_share{{node=\"{node}\",");
    Ok(m.lines()
        .filter(|l| l.starts_with(&needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

#[tokio::test]
async fn a_group_that_cannot_start_never_starts_a_member_and_frees_its_places() -> Result<()> {
    // Review finding: a group of 3 at threshold 1.0 whose third member can never be
    // placed started 2 of its 3 members, and the third's place stayed booked for
    // 109 s and more.
    let _g = serial().await;
    let mut rig = Rig::new("gang-never").await?;
    let node = rig.node("n", 2, "A", 40).await?;
    let labels = member_labels("3", "1.0");
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    rig.create("g0", &labels).await?;
    rig.create("g1", &labels).await?;
    // The third member's nodeSelector matches no node: it never reaches bind.
    let mut p = rig.pod_json("g2", &labels);
    p["spec"]["nodeSelector"]["kubeshare.io/no-such-node"] = json!("x");
    let p: Pod = serde_json::from_value(p)?;
    rig.pods().create(&PostParams::default(), &p).await?;
    let port = rig.cluster.extender_port();
    // The two members that reach the extender wait; nothing is held for the group.
    rig.failed_with(
        "g1",
        "group train-a: 2 of 3 required members have reached the scheduler",
    )
    .await?;
    rig.failed_with(
        "g0",
        "group train-a: 2 of 3 required members have reached the scheduler",
    )
    .await?;
    assert_eq!(rig.unbound_names().await?.len(), 3, "no member was bound");
    assert_eq!(bookings(port, "reserved").await?, 0);
    assert_eq!(
        node_share(port, &node).await?,
        0,
        "nothing booked on the node"
    );
    // The whole room is usable at once.
    rig.create("solo", &[("gpu_request", "1.0"), ("gpu_limit", "1.0")])
        .await?;
    rig.bound("solo").await?;
    assert_eq!(rig.unbound_names().await?.len(), 3, "still no member bound");
    rig.cleanup().await
}

#[tokio::test]
async fn a_group_that_fits_starts_all_members_within_seconds() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("gang-fits").await?;
    rig.node("n", 2, "A", 40).await?;
    let labels = member_labels("3", "1.0");
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for i in 0..3 {
        rig.create(&format!("g{i}"), &labels).await?;
    }
    let last = std::time::Instant::now();
    wait_until("3 members bound", WAIT, || {
        let rig = &rig;
        async move {
            let n = rig.unbound_names().await.map_err(|e| e.to_string())?.len();
            if n == 0 {
                Ok(Some(()))
            } else {
                Err(format!("{n} unbound"))
            }
        }
    })
    .await?;
    let took = last.elapsed();
    assert!(
        took < Duration::from_secs(15),
        "the group started {took:?} after its last member was created"
    );
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 3);
    rig.cleanup().await
}

/// A SIGKILL while a group binds: the members' Bindings are posted together once the
/// quorum is at bind (about 100 ms here), so a kill can land between them. The next
/// extender completes the group: a member of a group with bound members passes the
/// gate as soon as bound + waiting reach the quorum. Either way the group ends whole.
#[tokio::test]
async fn killing_the_extender_while_a_group_binds_ends_with_the_whole_group() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("gang-kill").await?;
    rig.node("n", 2, "A", 40).await?;
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("extender-logs/gang-kill.log");
    let before = std::fs::read_to_string(&log).unwrap_or_default().len();
    let labels = member_labels("3", "1.0");
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for i in 0..3 {
        rig.create(&format!("g{i}"), &labels).await?;
    }
    // Kill it (SIGKILL) as soon as a member waits at bind for the others.
    wait_until("a member waiting at bind", WAIT, || {
        let log = log.clone();
        async move {
            let text = std::fs::read_to_string(&log).map_err(|e| e.to_string())?;
            Ok::<_, String>(
                text[before.min(text.len())..]
                    .contains("waits at bind")
                    .then_some(()),
            )
        }
    })
    .await?;
    if let Some(e) = rig.ext.as_mut() {
        e.kill();
    }
    let bound = 3 - rig.unbound_names().await?.len();
    eprintln!("{bound} of 3 members bound when the extender was killed");
    // A new extender: the group ends whole.
    rig.ext = Some(ExtenderProc::start(rig.cluster, "gang-kill").await?);
    wait_until("3 members bound", WAIT, || {
        let rig = &rig;
        async move {
            let n = rig.unbound_names().await.map_err(|e| e.to_string())?.len();
            if n == 0 {
                Ok(Some(()))
            } else {
                Err(format!("{n} unbound"))
            }
        }
    })
    .await?;
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 3);
    rig.cleanup().await
}

/// The other side of the kill above, made deterministic: two of three members were
/// bound (with their records) when the extender died; the next one binds the third.
#[tokio::test]
async fn a_restarted_extender_completes_a_partly_bound_group() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("gang-partial").await?;
    let node = rig.node("n", 2, "A", 40).await?;
    // No extender while the group is created and half bound.
    if let Some(e) = rig.ext.as_mut() {
        e.kill();
    }
    let labels = member_labels("3", "1.0");
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    for i in 0..3 {
        rig.create(&format!("g{i}"), &labels).await?;
    }
    // g0 and g1 bound as the dead extender's Bindings left them: record and node.
    let ext_client = rig.cluster.client(Identity::Extender).await?;
    let pods: Api<Pod> = Api::namespaced(ext_client, rig.ns.name());
    for (i, name) in ["g0", "g1"].iter().enumerate() {
        let record = Allocation {
            node: node.clone(),
            gpu_uuids: vec![uuid(&node, 0)],
            gpu_mem: 20 * GIB,
            gpu_model: "A".into(),
            granted: kubeshare_api::Granted::Fraction {
                request: kubeshare_api::Milli::new(500).context("milli")?,
                limit: kubeshare_api::Milli::ONE,
            },
            gpu_mem_resident: None,
        };
        let uid = rig.pods().get(name).await?.metadata.uid.context("uid")?;
        let b = json!({"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": name, "uid": uid, "annotations": record.to_annotations()},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}});
        pods.create_subresource::<serde_json::Value, serde_json::Value>(
            "binding",
            name,
            &PostParams::default(),
            &b,
        )
        .await
        .with_context(|| format!("binding {name} ({i})"))?;
    }
    rig.ext = Some(ExtenderProc::start(rig.cluster, "gang-partial").await?);
    let g2 = rig.bound("g2").await?;
    assert_ne!(g2.gpu_uuids, vec![uuid(&node, 0)], "GPU 0 is full");
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 3);
    rig.cleanup().await
}

/// A small version of issue 13's backlog: pods created while the extender is down,
/// then released at once (the scheduler's retries, bind calls racing, watch lag).
#[tokio::test]
async fn a_backlog_released_at_once_never_overcommits() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("backlog").await?;
    // 3 nodes × 2 GPUs × 4 quarters = 24 places for 40 pods.
    for n in ["x", "y", "z"] {
        rig.node(n, 2, "A", 40).await?;
    }
    if let Some(e) = rig.ext.as_mut() {
        e.kill();
    }
    let quarter = [("gpu_request", "0.25"), ("gpu_limit", "0.25")];
    for i in 0..40 {
        rig.create(&format!("b{i:02}"), &quarter).await?;
    }
    rig.ext = Some(ExtenderProc::start(rig.cluster, "backlog").await?);
    wait_until("24 pods bound", WAIT, || {
        let rig = &rig;
        async move {
            let n = rig.unbound_names().await.map_err(|e| e.to_string())?.len();
            if n <= 16 {
                Ok(Some(()))
            } else {
                Err(format!("{n} unbound"))
            }
        }
    })
    .await?;
    // The scheduler keeps retrying the rest: none of them may fit.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 24);
    rig.cleanup().await
}
