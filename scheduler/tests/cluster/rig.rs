//! The rig every test here runs on: the cluster, the extender process, kwok nodes with GPU
//! inventories, and the helpers that read its answers. Imports are re-exported for the tests.

pub(crate) use std::collections::{BTreeMap, HashMap};
pub(crate) use std::path::PathBuf;
pub(crate) use std::process::{Child, Command, Stdio};
pub(crate) use std::time::Duration;

pub(crate) use anyhow::{Context, Result, bail};
pub(crate) use k8s_openapi::api::batch::v1::Job;
pub(crate) use k8s_openapi::api::core::v1::{Event, Node, Pod};
pub(crate) use kube::Api;
pub(crate) use kube::api::{ListParams, Patch, PatchParams, PostParams};
pub(crate) use kubeshare_api::inventory::INVENTORY_ANNOTATION;
pub(crate) use kubeshare_api::{Allocation, GpuDemand, GpuInfo, NodeInventory};
pub(crate) use kubeshare_testkit::{
    Cluster, Identity, KwokNode, RUN_DURATION_ANNOTATION, TestNamespace, create_kwok_node,
    delete_node, node_is_ready, wait_for, wait_until,
};
pub(crate) use serde_json::json;
pub(crate) use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) const WAIT: Duration = Duration::from_secs(60);
pub(crate) const GIB: u64 = 1 << 30;
const SELECTOR: &str = "kubeshare.io/ext-test";

/// One extender at a time on the cluster's port.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The extender binary, killed (SIGKILL) when dropped.
pub(crate) struct ExtenderProc {
    child: Child,
    pub(crate) port: u16,
}

impl ExtenderProc {
    pub(crate) async fn start(cluster: &Cluster, log_name: &str) -> Result<ExtenderProc> {
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

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ExtenderProc {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) async fn get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
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

pub(crate) fn uuid(node: &str, i: u32) -> String {
    // A stable UUID per (node, index): 8 hex digits of a hash of the name.
    let h = node.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    });
    format!("GPU-{:08x}-0000-0000-0000-{i:012x}", h as u32)
}

pub(crate) fn inventory(node: &str, gpus: u32, model: &str, mem_gib: u64) -> NodeInventory {
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
pub(crate) struct Rig {
    pub(crate) cluster: &'static Cluster,
    pub(crate) admin: kube::Client,
    pub(crate) ns: TestNamespace,
    nodes: Vec<String>,
    pub(crate) ext: Option<ExtenderProc>,
}

impl Rig {
    /// Kills the extender hard (SIGKILL), as a node failure or an OOM kill would.
    pub(crate) fn kill_extender(&mut self) {
        if let Some(e) = self.ext.as_mut() {
            e.kill();
        }
    }

    /// Starts a new extender (after [`Rig::kill_extender`]): it rebuilds its books from the
    /// API and serves once ready.
    pub(crate) async fn start_extender(&mut self, test: &str) -> Result<()> {
        self.ext = Some(ExtenderProc::start(self.cluster, test).await?);
        Ok(())
    }

    pub(crate) async fn new(test: &str) -> Result<Rig> {
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

    pub(crate) fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.admin.clone(), self.ns.name())
    }

    /// A kwok node with `gpus` GPUs of `model`, ready.
    pub(crate) async fn node(
        &mut self,
        what: &str,
        gpus: u32,
        model: &str,
        mem_gib: u64,
    ) -> Result<String> {
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

    pub(crate) async fn set_inventory(&self, node: &str, inv: &NodeInventory) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let p = json!({"metadata": {"annotations": {INVENTORY_ANNOTATION: inv.to_json()}}});
        nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        Ok(())
    }

    pub(crate) fn pod_json(&self, name: &str, labels: &[(&str, &str)]) -> serde_json::Value {
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

    pub(crate) async fn create(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
        let p: Pod = serde_json::from_value(self.pod_json(name, labels))?;
        self.pods().create(&PostParams::default(), &p).await?;
        Ok(())
    }

    /// Waits until the pod is bound; returns its allocation.
    pub(crate) async fn bound(&self, name: &str) -> Result<Allocation> {
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
    pub(crate) async fn failed_with(&self, pod: &str, needle: &str) -> Result<String> {
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

    /// Waits until at most `most` of the namespace's pods are unbound; their names.
    pub(crate) async fn wait_unbound_at_most(
        &self,
        what: &str,
        most: usize,
    ) -> Result<Vec<String>> {
        wait_until(what, WAIT, || async move {
            let left = self.unbound_names().await.map_err(|e| e.to_string())?;
            if left.len() <= most {
                Ok(Some(left))
            } else {
                Err(format!("{} unbound", left.len()))
            }
        })
        .await
        .map_err(Into::into)
    }

    /// Waits until kube-scheduler has tried each of `pods` against full books since they
    /// filled: a FailedScheduling event that says a GPU had less free than `request`. What a
    /// test then finds bound is what stays bound, with no sleep to guess how long retries take.
    pub(crate) async fn each_found_no_room(&self, pods: &[String], request: &str) -> Result<()> {
        for p in pods {
            self.failed_with(p, &format!("free < {request} requested"))
                .await?;
        }
        Ok(())
    }

    pub(crate) async fn unbound_names(&self) -> Result<Vec<String>> {
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
    pub(crate) async fn check_no_overcommit(&self, mem_per_gpu: u64) -> Result<usize> {
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

    pub(crate) async fn cleanup(mut self) -> Result<()> {
        self.ext.take();
        for n in &self.nodes {
            delete_node(&self.admin, n).await?;
        }
        self.ns.delete().await?;
        Ok(())
    }
}

pub(crate) async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}
