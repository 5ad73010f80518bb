//! The DRA path against the real control plane of the test rig (kube-apiserver,
//! kube-controller-manager with the resourceclaim controller, the stock kube-scheduler,
//! kwok playing the kubelet): the node daemon, run with `--dra` and a fake inventory,
//! publishes its kwok node's ResourceSlice, and the stock kube-scheduler allocates
//! ResourceClaims against the GPU's consumable capacity. No KubeShare extender takes
//! part. The test then plays the kubelet (kwok has none): it registers the daemon's
//! kubelet plugin through the registration socket and prepares and unprepares the
//! allocated claims over the plugin's socket, as the kubelet's DRA manager does.
//! Needs Kubernetes 1.36+ (consumable capacity beta and on); skipped on older control
//! planes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kubeshare_api::dra::{ANNOTATION_CLAIM_POD_BOUND, Consumed, DRIVER_NAME, ShareConfig};
use kubeshare_api::{GpuInfo, Milli, NodeInventory, parse_bytes};
use kubeshare_kubelet_rpc::dra as dra_rpc;
use kubeshare_node_daemon::dra::slice::slice_name;
use kubeshare_node_daemon::dra::{Published, publish};
use kubeshare_testkit::metrics::{label, metrics_text, scheduler_client, sum_where};
use kubeshare_testkit::{
    Cluster, Identity, KwokNode, TestNamespace, create_kwok_node, delete_node, wait_for, wait_until,
};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// The node daemon process and the port of its `/metrics`; SIGTERM, then SIGKILL,
/// when dropped.
struct Daemon {
    child: Child,
    port: u16,
}

/// Starts the node daemon for kwok node `node` as the chart runs it with dra.enabled:
/// its own identity, `--dra`, the inventory file `inv_file`, its root in `dir/root`,
/// plus `extra` arguments; logging to `log` (appended, so restarts keep the history).
fn start_daemon(
    cluster: &Cluster,
    node: &str,
    dir: &Path,
    inv_file: &Path,
    log: &Path,
    extra: &[String],
) -> anyhow::Result<Daemon> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kubeshare-node-daemon"))
        .args(["--node-name", node, "--dra", "--taint-node=false"])
        .args(["--resync-secs", "1", "--pod-resources-interval-secs", "0"])
        .arg("--root")
        .arg(dir.join("root"))
        .arg("--fake-inventory")
        .arg(inv_file)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig(Identity::NodeDaemon)?)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()?;
    Ok(Daemon { child, port })
}

/// A kubelet plugin's stand-in host in a temporary directory: the inventory file, `/dev` and
/// the driver library directory, the kubelet's root and the CDI spec directory, and the
/// daemon's arguments for them.
struct PluginRig {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    inv_file: PathBuf,
    log: PathBuf,
    kubelet_root: PathBuf,
    cdi_dir: PathBuf,
    args: Vec<String>,
}

impl PluginRig {
    fn new(prefix: &str, inv: &NodeInventory) -> anyhow::Result<Self> {
        let tmp = tempfile::Builder::new().prefix(prefix).tempdir_in("/tmp")?;
        let dir = tmp.path().to_path_buf();
        let inv_file = dir.join("inv.json");
        std::fs::write(&inv_file, inv.to_json())?;
        // Stand-ins for the host's /dev and driver library directory.
        std::fs::create_dir_all(dir.join("dev"))?;
        std::fs::write(dir.join("dev/nvidiactl"), "")?;
        std::fs::create_dir_all(dir.join("lib"))?;
        std::fs::write(dir.join("lib/libcuda.so.1"), "elf")?;
        let (kubelet_root, cdi_dir) = (dir.join("kubelet"), dir.join("cdi"));
        let args = [
            ("--kubelet-root-dir", &kubelet_root),
            ("--cdi-spec-dir", &cdi_dir),
            ("--cdi-dev-dir", &dir.join("dev")),
            ("--cdi-lib-dir", &dir.join("lib")),
            // --cdi-spec-dir also runs the device plugin for kubeshare.io/gpu: kept here.
            ("--device-plugin-dir", &dir.join("device-plugins")),
        ]
        .iter()
        .flat_map(|(k, v)| [k.to_string(), v.display().to_string()])
        .collect();
        Ok(PluginRig {
            log: dir.join("daemon.log"),
            _tmp: tmp,
            dir,
            inv_file,
            kubelet_root,
            cdi_dir,
            args,
        })
    }

    /// Starts (or starts again) the daemon on this host.
    fn start(&self, cluster: &Cluster, node: &str) -> anyhow::Result<Daemon> {
        start_daemon(
            cluster,
            node,
            &self.dir,
            &self.inv_file,
            &self.log,
            &self.args,
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes the kwok node however the test ends (its ResourceSlice follows it: the
/// Node owns it).
struct NodeGuard(PathBuf, String);

impl Drop for NodeGuard {
    fn drop(&mut self) {
        let (kc, name) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let c = kubeshare_testkit::client_from_kubeconfig(&kc)
                    .await
                    .map_err(std::io::Error::other)?;
                let _ = delete_node(&c, &name).await;
                Ok::<_, std::io::Error>(())
            })
        })
        .join();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// The apiserver's minor version, or None when it does not say.
async fn minor(client: &kube::Client) -> anyhow::Result<Option<u32>> {
    let v = client.apiserver_version().await?;
    let digits: String = v.minor.chars().take_while(char::is_ascii_digit).collect();
    Ok(digits.parse().ok())
}

/// What each test starts from: the admin client, DRA installed, a namespace named after
/// `prefix`, and a kwok node's name in it, the node created and deleted however the test ends
/// (the guard). None (the test is skipped, and says so) before Kubernetes 1.36: consumable
/// capacity.
async fn dra_node(
    cluster: &Cluster,
    prefix: &str,
) -> anyhow::Result<Option<(kube::Client, TestNamespace, String, NodeGuard)>> {
    let admin = cluster.client(Identity::Admin).await?;
    match minor(&admin).await? {
        Some(m) if m >= 36 => {}
        other => {
            eprintln!(
                "skipped: consumable capacity needs Kubernetes 1.36+ (apiserver minor {other:?})"
            );
            return Ok(None);
        }
    }
    install_dra(&admin).await?;
    let ns = TestNamespace::create(cluster, prefix).await?;
    let node = ns.unique_name("gpu");
    let guard = NodeGuard(
        cluster.kubeconfig(Identity::Admin)?.to_path_buf(),
        node.clone(),
    );
    create_kwok_node(&admin, &KwokNode::new(&node)).await?;
    Ok(Some((admin, ns, node, guard)))
}

/// What the chart's templates/dra.yaml installs with dra.enabled (the DeviceClass, and
/// the node daemon's right to write ResourceSlices, bound to the rig's daemon user as
/// rbac.localRigUsers does), applied server-side so that reruns are no-ops.
async fn install_dra(admin: &kube::Client) -> anyhow::Result<()> {
    let pp = PatchParams::apply("kubeshare-dra-test").force();
    let dc: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DRIVER_NAME},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER_NAME}\"")}}]},
    }))?;
    Api::<DeviceClass>::all(admin.clone())
        .patch(DRIVER_NAME, &pp, &Patch::Apply(&dc))
        .await?;
    let role: ClusterRole = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "kubeshare:node-daemon-dra"},
        "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
                   "verbs": ["get", "list", "watch", "create", "update", "delete"]},
                  {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
                   "verbs": ["get"]}],
    }))?;
    Api::<ClusterRole>::all(admin.clone())
        .patch("kubeshare:node-daemon-dra", &pp, &Patch::Apply(&role))
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "kubeshare:node-daemon-dra"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "kubeshare:node-daemon-dra"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": Identity::NodeDaemon.user()}],
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch("kubeshare:node-daemon-dra", &pp, &Patch::Apply(&binding))
        .await?;
    Ok(())
}

/// A claim template for one share of a GPU: `compute` thousandths and `memory`.
fn template(name: &str, compute: u16, memory: &str) -> anyhow::Result<ResourceClaimTemplate> {
    template_with(name, compute, memory, None)
}

/// [`template`] with `config` (the opaque parameters of driver gpu.kubeshare.io,
/// apiVersion and kind added) for its request.
fn template_with(
    name: &str,
    compute: u16,
    memory: &str,
    config: Option<serde_json::Value>,
) -> anyhow::Result<ResourceClaimTemplate> {
    let mut devices = json!({"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": DRIVER_NAME,
        "capacity": {"requests": {"compute": compute.to_string(), "memory": memory}},
    }}]});
    if let Some(mut params) = config {
        params["apiVersion"] = "gpu.kubeshare.io/v1alpha1".into();
        params["kind"] = "GpuShareConfig".into();
        devices["config"] = json!([{"requests": ["gpu"],
            "opaque": {"driver": DRIVER_NAME, "parameters": params}}]);
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": devices}},
    }))?)
}

/// A pod of the default scheduler with one claim from `template`, kept to `node`.
fn pod(name: &str, node: &str, template: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.invalid/app:1",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
        },
    }))?)
}

/// The uid of the pod with claims the daemon last saw bound to the slice's node (its mark).
fn bound_mark(s: &ResourceSlice) -> Option<&String> {
    s.metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_CLAIM_POD_BOUND)
}

fn scheduled_on(p: &Pod) -> Option<&str> {
    p.spec.as_ref()?.node_name.as_deref()
}

/// The scheduler's verdict on a pod it could not place: `(reason, message)`.
fn unschedulable(p: &Pod) -> Option<(String, String)> {
    let c = p
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    Some((c.reason.clone()?, c.message.clone().unwrap_or_default()))
}

/// The claim the resourceclaim controller made for `pod` from its template.
async fn claim_of(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    pod: &str,
) -> anyhow::Result<ResourceClaim> {
    let p = pods.get(pod).await?;
    let name = p
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|v| v.into_iter().find_map(|s| s.resource_claim_name))
        .with_context(|| format!("pod {pod} names no generated claim"))?;
    Ok(claims.get(&name).await?)
}

/// examples/dra/claims.yaml passes the apiserver's validation (server-side dry run in
/// `ns`), and each opaque config in it parses and agrees with its own capacity requests.
fn check_examples(cluster: &Cluster, ns: &str) -> anyhow::Result<usize> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/dra/claims.yaml");
    let text = std::fs::read_to_string(&file)?
        .replace("namespace: kubeshare-demo", &format!("namespace: {ns}"));
    let mut kubectl = cluster.kubectl()?;
    let mut child = kubectl
        .args(["apply", "--dry-run=server", "-o", "json", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "kubectl apply --dry-run=server examples/dra/claims.yaml: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let list: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut configs = 0;
    for item in list["items"].as_array().context("a List")? {
        if item["kind"] != "ResourceClaimTemplate" {
            continue;
        }
        let spec = &item["spec"]["spec"]["devices"];
        let req = &spec["requests"][0]["exactly"]["capacity"]["requests"];
        for c in spec["config"].as_array().into_iter().flatten() {
            let cfg = ShareConfig::from_value(&c["opaque"]["parameters"])
                .with_context(|| format!("{}", item["metadata"]["name"]))?;
            let compute = req["compute"].as_str().and_then(|s| parse_bytes(s).ok());
            let memory = req["memory"].as_str().and_then(|s| parse_bytes(s).ok());
            let (Some(compute), Some(memory)) = (compute, memory) else {
                bail!(
                    "{}: a config without capacity requests",
                    item["metadata"]["name"]
                );
            };
            let consumed = Consumed {
                compute: Milli::new(compute as u16).context("compute above 1000")?,
                memory,
            };
            cfg.resolve(consumed)
                .with_context(|| format!("{}", item["metadata"]["name"]))?;
            configs += 1;
        }
    }
    Ok(configs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_scheduler_shares_a_gpu_by_consumable_capacity() -> anyhow::Result<()> {
    let cluster = Cluster::shared()?;
    let Some((admin, ns, node, _node_guard)) = dra_node(cluster, "dra").await? else {
        return Ok(());
    };
    let nsname = ns.name().to_string();

    // The daemon, as the chart runs it with dra.enabled: its own identity, --dra.
    let inv = NodeInventory {
        gpus: vec![GpuInfo {
            uuid: format!("GPU-{:08x}-0000-4000-8000-000000000000", std::process::id()),
            index: 0,
            model: "NVIDIA-H100-80GB-HBM3".into(),
            memory: 16 << 30,
            numa_node: Some(0),
            nvlink_peers: vec![],
            held_by: None,
        }],
    };
    let tmp = tempfile::Builder::new().prefix("dra").tempdir_in("/tmp")?;
    let inv_file = tmp.path().join("inv.json");
    std::fs::write(&inv_file, inv.to_json())?;
    let log = tmp.path().join("daemon.log");
    let kubelet = format!("{}", tmp.path().join("kubelet").display());
    let _daemon = start_daemon(
        cluster,
        &node,
        tmp.path(),
        &inv_file,
        &log,
        &["--kubelet-root-dir".into(), kubelet],
    )?;

    // 1. The slice: one shared device with both capacities, pool generation 1.
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let slice_name = slice_name(&node);
    let slice = wait_for(&slices, &slice_name, WAIT, |_| true)
        .await
        .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    assert_eq!(slice.spec.node_name.as_deref(), Some(node.as_str()));
    assert_eq!(slice.spec.pool.generation, 1);
    let devices = slice.spec.devices.clone().unwrap_or_default();
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0].name, "gpu-0");
    assert_eq!(devices[0].allow_multiple_allocations, Some(true));
    let cap = devices[0].capacity.clone().unwrap_or_default();
    assert_eq!(parse_bytes(&cap["compute"].value.0).ok(), Some(1000));
    assert_eq!(parse_bytes(&cap["memory"].value.0).ok(), Some(16 << 30));
    // What the apiserver stored reads back as unchanged: no new generation each resync.
    let daemon_client = cluster.client(Identity::NodeDaemon).await?;
    assert_eq!(
        publish(&daemon_client, &node, &inv, &Default::default()).await?,
        Published::Unchanged
    );
    assert_eq!(slices.get(&slice_name).await?.spec.pool.generation, 1);

    // 1b. One set of books: a label pod the extender bound here (its allocation record:
    // 0.4 and 6Gi of the GPU) shrinks the device's capacities to what it leaves; when
    // it goes, the whole GPU is published again.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
    let record = kubeshare_api::Allocation {
        node: node.clone(),
        gpu_uuids: vec![inv.gpus[0].uuid.clone()],
        gpu_mem: 6 << 30,
        gpu_model: inv.gpus[0].model.clone(),
        granted: kubeshare_api::Granted::Fraction {
            request: Milli::new(400).context("0.4")?,
            limit: Milli::new(400).context("0.4")?,
        },
        gpu_mem_resident: None,
    };
    let labelled: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "labelled", "annotations": record.to_annotations(),
                     "labels": {"sharedgpu/gpu_request": "0.4", "sharedgpu/gpu_limit": "0.4",
                                "sharedgpu/gpu_mem": "6Gi"}},
        "spec": {"schedulerName": kubeshare_api::SCHEDULER_NAME, "nodeName": node,
                 "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))?;
    pods.create(&PostParams::default(), &labelled).await?;
    let capacity = |s: &ResourceSlice, c: &str| {
        s.spec
            .devices
            .as_ref()
            .and_then(|d| d.first())
            .and_then(|d| d.capacity.as_ref())
            .and_then(|m| m.get(c))
            .and_then(|q| parse_bytes(&q.value.0).ok())
    };
    let shrunk = wait_for(&slices, &slice_name, WAIT, |s| {
        capacity(s, "compute") == Some(600)
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    assert_eq!(capacity(&shrunk, "memory"), Some(10 << 30));
    assert_eq!(shrunk.spec.pool.generation, 2);
    pods.delete(
        "labelled",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await?;
    let back = wait_for(&slices, &slice_name, WAIT, |s| {
        capacity(s, "compute") == Some(1000)
    })
    .await?;
    assert_eq!(capacity(&back, "memory"), Some(16 << 30));
    assert_eq!(back.spec.pool.generation, 3);

    // 2. Claims of 300 and 600 thousandths share the GPU.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &nsname);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(admin.clone(), &nsname);
    let pp = PostParams::default();
    templates
        .create(&pp, &template("share-300", 300, "4Gi")?)
        .await?;
    templates
        .create(&pp, &template("share-600", 600, "4Gi")?)
        .await?;
    pods.create(&pp, &pod("a", &node, "share-300")?).await?;
    pods.create(&pp, &pod("b", &node, "share-600")?).await?;
    for p in ["a", "b"] {
        wait_for(&pods, p, WAIT, |p| scheduled_on(p) == Some(node.as_str())).await?;
    }
    // Pods with claims bound here mark the slice (an update wakes pods the scheduler
    // refused while a claim counted twice: docs/dra.md).
    let mut uids = Vec::new();
    for p in ["a", "b"] {
        uids.push(pods.get(p).await?.metadata.uid.context("a pod's uid")?);
    }
    wait_for(&slices, &slice_name, WAIT, |s| {
        bound_mark(s).is_some_and(|u| uids.contains(u))
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    let claim_a = claim_of(&pods, &claims, "a").await?;
    let alloc = kubeshare_testkit::dra::allocated_devices(claim_a);
    assert_eq!(alloc.len(), 1, "{alloc:?}");
    assert_eq!(alloc[0].driver, DRIVER_NAME);
    assert_eq!(alloc[0].pool, node);
    assert_eq!(alloc[0].device, "gpu-0");
    assert!(
        alloc[0].share_id.is_some(),
        "a shared device's allocation has a shareID"
    );
    let consumed = alloc[0].consumed_capacity.clone().unwrap_or_default();
    assert_eq!(parse_bytes(&consumed["compute"].0).ok(), Some(300));
    assert_eq!(parse_bytes(&consumed["memory"].0).ok(), Some(4 << 30));

    // 3. A third claim of 300 does not fit (900 of 1000 are booked): it stays Pending
    // with the scheduler's reason.
    pods.create(&pp, &pod("c", &node, "share-300")?).await?;
    let c = wait_for(&pods, "c", WAIT, |p| unschedulable(p).is_some()).await?;
    let (reason, message) = unschedulable(&c).unwrap_or_default();
    assert_eq!(reason, "Unschedulable", "{message}");
    assert!(
        message.contains("claim"),
        "the reason names the claims: {message}"
    );
    assert_eq!(scheduled_on(&c), None);
    eprintln!("pod c pending: {reason}: {message}");

    // 3b. A pod with a claim of 100 fits (1000 booked then). Bound here, it marks the slice,
    // and that update moves pod c, which the scheduler refused, back to be tried again: the
    // wake-up a pod refused while a claim counted twice needs (docs/dra.md). Nothing else
    // would move it: the new claim's allocation wakes no pod that does not use that claim.
    let sched = scheduler_client(
        cluster.kubeconfig(Identity::Admin)?,
        cluster.ports().kube_scheduler,
    )
    .await?;
    let moved_by_slices = || async {
        let text = metrics_text(&sched, "the kube-scheduler")
            .await
            .map_err(|e| e.to_string())?;
        // The event's label is "resource.k8s.io/ResourceSliceUpdate" on 1.37; releases
        // that leave the group out say "ResourceSliceUpdate".
        Ok::<f64, String>(sum_where(
            &text,
            "scheduler_queue_incoming_pods_total",
            |l| label(l, "event").ends_with("ResourceSliceUpdate"),
        ))
    };
    let before = moved_by_slices().await.map_err(anyhow::Error::msg)?;
    templates
        .create(&pp, &template("share-100", 100, "1Gi")?)
        .await?;
    pods.create(&pp, &pod("d", &node, "share-100")?).await?;
    wait_for(&pods, "d", WAIT, |p| scheduled_on(p) == Some(node.as_str())).await?;
    let d_uid = pods.get("d").await?.metadata.uid.context("pod d's uid")?;
    wait_for(&slices, &slice_name, WAIT, |s| {
        bound_mark(s) == Some(&d_uid)
    })
    .await
    .with_context(|| std::fs::read_to_string(&log).unwrap_or_default())?;
    let after = wait_until(
        "a ResourceSlice update to move a pending pod",
        WAIT,
        || async {
            let now = moved_by_slices().await?;
            Ok((now > before).then_some(now))
        },
    )
    .await?;
    eprintln!("pods moved by ResourceSlice updates: {before} before pod d, {after} after");
    assert_eq!(
        scheduled_on(&pods.get("c").await?),
        None,
        "pod c does not fit beside a, b and d"
    );

    // 4. Deleting pod a frees its 300: the pending pod is placed beside b and d.
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete("a", &dp).await?;
    wait_for(&pods, "c", WAIT, |p| scheduled_on(p) == Some(node.as_str())).await?;
    let claim_c = claim_of(&pods, &claims, "c").await?;
    assert!(
        claim_c.status.and_then(|s| s.allocation).is_some(),
        "pod c's claim is allocated"
    );

    // 5. Ten claims of 100 made at once fill the GPU exactly: every pod is placed, also
    // one the scheduler tried while another's claim counted twice.
    for p in ["b", "c", "d"] {
        pods.delete(p, &dp).await?;
    }
    let tenths: Vec<String> = (0..10).map(|i| format!("t{i}")).collect();
    for p in &tenths {
        pods.create(&pp, &pod(p, &node, "share-100")?).await?;
    }
    for p in &tenths {
        wait_for(&pods, p, WAIT, |p| scheduled_on(p) == Some(node.as_str()))
            .await
            .with_context(|| format!("pod {p} of ten claims of 100 being placed"))?;
    }

    // 6. The examples are valid objects whose configs agree with their bookings.
    let n = check_examples(cluster, &nsname)?;
    assert_eq!(n, 2, "examples/dra/claims.yaml has two opaque configs");

    // The node's removal takes its slice along (the Node owns it).
    drop(_daemon);
    delete_node(&admin, &node).await?;
    wait_until("the slice to follow its Node", WAIT, || async {
        match slices.get_opt(&slice_name).await {
            Ok(None) => Ok(Some(())),
            Ok(Some(_)) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    ns.delete().await?;
    Ok(())
}

/// The kubelet's side of a claim: what NodePrepareResources and
/// NodeUnprepareResources carry.
fn kubelet_claim(c: &ResourceClaim) -> dra_rpc::Claim {
    dra_rpc::Claim {
        namespace: c.metadata.namespace.clone().unwrap_or_default(),
        uid: c.metadata.uid.clone().unwrap_or_default(),
        name: c.metadata.name.clone().unwrap_or_default(),
    }
}

/// The claim of `pod` once the scheduler allocated it and reserved it for the pod.
async fn reserved_claim_of(
    pods: &Api<Pod>,
    claims: &Api<ResourceClaim>,
    pod: &str,
) -> anyhow::Result<ResourceClaim> {
    wait_for(pods, pod, WAIT, |p| scheduled_on(p).is_some()).await?;
    let name = claim_of(pods, claims, pod)
        .await?
        .metadata
        .name
        .unwrap_or_default();
    Ok(wait_for(claims, &name, WAIT, |c| {
        c.status.as_ref().is_some_and(|s| {
            s.allocation.is_some() && s.reserved_for.as_ref().is_some_and(|r| !r.is_empty())
        })
    })
    .await?)
}

/// The daemon's `/metrics` text, or `None` while it does not answer.
async fn scrape(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// What `/metrics` says the prepared claims hold of GPU `gpu`: the number of claims,
/// their share, their memory; `None` while any of the three is missing.
fn claimed(text: &str, gpu: &str) -> Option<(f64, f64, f64)> {
    let value = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            rest.contains(&format!("gpu=\"{gpu}\""))
                .then(|| rest.rsplit_once(' ')?.1.parse().ok())?
        })
    };
    Some((
        value("kubeshare_node_gpu_claims")?,
        value("kubeshare_node_gpu_claimed_share")?,
        value("kubeshare_node_gpu_memory_claimed_bytes")?,
    ))
}

/// Waits until the daemon on `port` shows `want` for `gpu` ([`claimed`]).
async fn wait_claimed(port: u16, gpu: &str, want: (f64, f64, f64)) -> anyhow::Result<()> {
    wait_until(
        &format!("{want:?} claimed of {gpu} in /metrics"),
        WAIT,
        || async {
            let now = scrape(port).await.map(|t| claimed(&t, gpu));
            if now == Some(Some(want)) {
                Ok(Some(()))
            } else {
                Err(format!("claims, share, memory: {now:?}"))
            }
        },
    )
    .await?;
    Ok(())
}

/// A path's text, or "" when it cannot be read.
/// A node of 16 GiB H100s with these UUIDs, in order.
fn h100s(uuids: &[String]) -> NodeInventory {
    NodeInventory {
        gpus: (0..)
            .zip(uuids)
            .map(|(index, uuid)| GpuInfo {
                uuid: uuid.clone(),
                index,
                model: "NVIDIA-H100-80GB-HBM3".into(),
                memory: 16 << 30,
                numa_node: None,
                nvlink_peers: vec![],
                held_by: None,
            })
            .collect(),
    }
}

fn text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The DRA kubelet plugin, with the test as the kubelet: registration, a claim at
/// 0.3/0.6 with 2 GiB and priority 50 (guaranteed) prepared into gem-schd's config and a CDI spec, a claim whose
/// config is bad refused with the field named, idempotent calls, the claim kept
/// across a restart of the daemon, and unprepare undoing it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_plugin_prepares_claims_into_gem_schd_configs() -> anyhow::Result<()> {
    let cluster = Cluster::shared()?;
    let Some((admin, ns, node, _node_guard)) = dra_node(cluster, "dra-plugin").await? else {
        return Ok(());
    };
    let nsname = ns.name().to_string();
    let gpu = format!("GPU-{:08x}-1111-4000-8000-000000000000", std::process::id());
    let rig = PluginRig::new("dp", &h100s(std::slice::from_ref(&gpu)))?;
    let PluginRig {
        dir,
        log,
        kubelet_root,
        cdi_dir,
        ..
    } = &rig;
    let logs = || text(log);
    let daemon = rig.start(cluster, &node)?;

    // 1. Registration, as the kubelet's plugin watcher does it.
    let sockets = dra_rpc::PluginSockets::under(kubelet_root, DRIVER_NAME);
    let info = wait_until("the plugin's GetInfo", WAIT, || async {
        Ok(dra_rpc::get_info(&sockets.registration).await.ok())
    })
    .await
    .with_context(logs)?;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER_NAME);
    assert_eq!(info.endpoint, sockets.service.display().to_string());
    assert_eq!(info.supported_versions, vec!["v1.DRAPlugin"]);
    let mut reg = dra_rpc::RegistrationClient::new(
        kubeshare_kubelet_rpc::connect(&sockets.registration).await?,
    );
    reg.notify_registration_status(dra_rpc::RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await?;
    // The plugin is on: /metrics counts its claims, none yet.
    wait_claimed(daemon.port, &gpu, (0.0, 0.0, 0.0))
        .await
        .with_context(logs)?;

    // 2. Two pods, each with a claim: 0.3 with a limit of 0.6 and 2 GiB, and one whose
    // limit is below its booking. The scheduler allocates both (it does not read the
    // opaque config); the plugin refuses the second.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &nsname);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(admin.clone(), &nsname);
    let pp = PostParams::default();
    templates
        .create(
            &pp,
            &template_with(
                "burst",
                300,
                "2Gi",
                Some(json!({"limit": "0.6", "priority": 50})),
            )?,
        )
        .await?;
    templates
        .create(
            &pp,
            &template_with("bad", 300, "2Gi", Some(json!({"limit": "0.2"})))?,
        )
        .await?;
    pods.create(&pp, &pod("a", &node, "burst")?).await?;
    pods.create(&pp, &pod("b", &node, "bad")?).await?;
    let claim_a = reserved_claim_of(&pods, &claims, "a").await?;
    let claim_b = reserved_claim_of(&pods, &claims, "b").await?;
    let pod_a = pods.get("a").await?.metadata.uid.unwrap_or_default();
    let (ka, kb) = (kubelet_claim(&claim_a), kubelet_claim(&claim_b));
    let mut plugin = dra_rpc::DraPluginClient::new(
        kubeshare_kubelet_rpc::connect(Path::new(&info.endpoint)).await?,
    );
    let prepare = dra_rpc::NodePrepareResourcesRequest {
        claims: vec![ka.clone(), kb.clone()],
    };
    let resp = plugin
        .node_prepare_resources(prepare.clone())
        .await?
        .into_inner();
    let a = &resp.claims[&ka.uid];
    assert_eq!(a.error, "", "{}", logs());
    assert_eq!(a.devices.len(), 1);
    let d = &a.devices[0];
    assert_eq!(
        (d.pool_name.as_str(), d.device_name.as_str()),
        (node.as_str(), "gpu-0")
    );
    assert_eq!(d.request_names, vec!["gpu"]);
    assert_eq!(
        d.cdi_device_ids,
        vec![format!("kubeshare.io/claim={}-gpu-0", ka.uid)]
    );
    assert!(
        d.share_id.is_some(),
        "the allocation's shareID is passed on"
    );
    let b = &resp.claims[&kb.uid];
    assert!(b.devices.is_empty());
    assert_eq!(
        b.error,
        "request gpu: opaque config of gpu.kubeshare.io: limit=0.2: must be at least the claim's capacity request compute=300 (the share the scheduler booked)"
    );

    // 3. The answer came after the books: gem-schd's config names pod a's share, its
    // socket directory exists, and the claim's CDI spec gives the GPU, the hook and
    // that directory.
    let root = dir.join("root");
    let config = root.join("gpus").join(&gpu).join("resource-config.txt");
    let line = format!("1\n{pod_a} 0.3 0.6 2147483648\n");
    assert_eq!(text(&config), line, "{}", logs());
    assert!(root.join("pods").join(&pod_a).is_dir());
    let spec_file = cdi_dir.join(format!("kubeshare.io-claim_{}.json", ka.uid));
    let spec: serde_json::Value = serde_json::from_str(&text(&spec_file))
        .with_context(|| format!("{}: {}", spec_file.display(), logs()))?;
    assert_eq!(spec["kind"], "kubeshare.io/claim");
    assert_eq!(spec["devices"][0]["name"], format!("{}-gpu-0", ka.uid));
    assert_eq!(
        spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
        "/dev/nvidia0"
    );
    let common = &spec["containerEdits"];
    let env: Vec<&str> = common["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env.contains(&"LD_PRELOAD=/kubeshare/lib/libgemhook.so.1"),
        "{env:?}"
    );
    assert!(
        env.contains(&"KUBESHARE_SOCKET_DIR=/kubeshare/run"),
        "{env:?}"
    );
    let mounts = common["mounts"].as_array().cloned().unwrap_or_default();
    assert!(
        mounts.iter().any(|m| m["hostPath"]
            == root.join("pods").join(&pod_a).display().to_string()
            && m["containerPath"] == "/kubeshare/run"),
        "{mounts:?}"
    );
    assert!(
        !cdi_dir
            .join(format!("kubeshare.io-claim_{}.json", kb.uid))
            .exists()
    );
    // /metrics counts claim a, not the refused b.
    let claimed_a = (1.0, 0.3, (2u64 << 30) as f64);
    wait_claimed(daemon.port, &gpu, claimed_a)
        .await
        .with_context(logs)?;

    // 4. Asked again (the kubelet retries after its own restart): the same answer.
    let again = plugin.node_prepare_resources(prepare).await?.into_inner();
    assert_eq!(again.claims[&ka.uid], resp.claims[&ka.uid]);
    assert_eq!(text(&config), line);

    // 5. A restart keeps the claim: with the config emptied while the daemon was
    // down, the restarted daemon writes pod a's share back from its checkpoint.
    drop(daemon);
    assert!(
        !sockets.registration.exists(),
        "a stopped daemon leaves no registration behind"
    );
    std::fs::write(&config, "0\n")?;
    let daemon = rig.start(cluster, &node)?;
    wait_until(
        "the restarted daemon to write the claim back",
        WAIT,
        || async { Ok((text(&config) == line).then_some(())) },
    )
    .await
    .with_context(logs)?;
    let mut plugin = dra_rpc::DraPluginClient::new(
        wait_until("the restarted plugin", WAIT, || async {
            Ok(kubeshare_kubelet_rpc::connect(&sockets.service).await.ok())
        })
        .await?,
    );
    let again = plugin
        .node_prepare_resources(dra_rpc::NodePrepareResourcesRequest {
            claims: vec![ka.clone()],
        })
        .await?
        .into_inner();
    assert_eq!(again.claims[&ka.uid], resp.claims[&ka.uid]);
    // The restarted daemon's /metrics has the claim from its checkpoint.
    wait_claimed(daemon.port, &gpu, claimed_a)
        .await
        .with_context(logs)?;

    // 6. Unprepare undoes it, and again, and for a claim never prepared, succeeds.
    let unknown = dra_rpc::Claim {
        uid: "00000000-0000-4000-8000-000000000000".into(),
        ..kb.clone()
    };
    for _ in 0..2 {
        let resp = plugin
            .node_unprepare_resources(dra_rpc::NodeUnprepareResourcesRequest {
                claims: vec![ka.clone(), kb.clone(), unknown.clone()],
            })
            .await?
            .into_inner();
        assert_eq!(resp.claims.len(), 3);
        for (uid, r) in &resp.claims {
            assert_eq!(r.error, "", "{uid}");
        }
        assert_eq!(text(&config), "0\n", "{}", logs());
        assert!(!spec_file.exists());
        assert!(!root.join("pods").join(&pod_a).exists());
    }
    wait_claimed(daemon.port, &gpu, (0.0, 0.0, 0.0))
        .await
        .with_context(logs)?;
    drop(daemon);
    ns.delete().await?;
    Ok(())
}

/// A pod of the default scheduler using the ResourceClaim `claim` by name, kept to `node`.
fn pod_of_claim(name: &str, node: &str, claim: &str) -> anyhow::Result<Pod> {
    let mut p = pod(name, node, "unused")?;
    if let Some(spec) = p.spec.as_mut() {
        spec.resource_claims = Some(serde_json::from_value(
            json!([{"name": "gpu", "resourceClaimName": claim}]),
        )?);
    }
    Ok(p)
}

/// The pods a claim is reserved for, by UID.
fn reserved_for(c: &ResourceClaim) -> Vec<String> {
    let mut v: Vec<String> = c
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .map(|r| r.uid.clone())
        .collect();
    v.sort();
    v
}

/// A CDI spec's container-wide env and mount targets.
fn spec_env_and_mounts(spec: &serde_json::Value) -> (Vec<String>, Vec<String>) {
    let strs = |v: &serde_json::Value, key: Option<&str>| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| match key {
                Some(k) => x[k].as_str().map(String::from),
                None => x.as_str().map(String::from),
            })
            .collect()
    };
    let c = &spec["containerEdits"];
    (
        strs(&c["env"], None),
        strs(&c["mounts"], Some("containerPath")),
    )
}

/// A claim that pods share and a whole-GPU claim, with the test as the kubelet: the
/// shared claim is prepared once, as one gem-schd client of its own (its UID), whose
/// peers file lists the pods it was reserved for and a pod that joins it later; the
/// whole-GPU claim gets its GPU without the hook and no config line, yet holds the GPU.
/// Both survive a restart; unpreparing the shared claim removes its line, its socket
/// directory and its peers file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_plugin_prepares_shared_and_whole_gpu_claims() -> anyhow::Result<()> {
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    match minor(&admin).await? {
        Some(m) if m >= 36 => {}
        other => {
            eprintln!(
                "skipped: consumable capacity needs Kubernetes 1.36+ (apiserver minor {other:?})"
            );
            return Ok(());
        }
    }
    install_dra(&admin).await?;
    let ns = TestNamespace::create(cluster, "dra-shared").await?;
    let nsname = ns.name().to_string();
    let node = ns.unique_name("gpu");
    let _node_guard = NodeGuard(
        cluster.kubeconfig(Identity::Admin)?.to_path_buf(),
        node.clone(),
    );
    create_kwok_node(&admin, &KwokNode::new(&node)).await?;
    let gpu = |i: u32| {
        format!(
            "GPU-{:08x}-222{i}-4000-8000-000000000000",
            std::process::id()
        )
    };
    let rig = PluginRig::new("ds", &h100s(&[gpu(0), gpu(1)]))?;
    let PluginRig {
        dir,
        log,
        kubelet_root,
        cdi_dir,
        ..
    } = &rig;
    let logs = || text(log);
    let daemon = rig.start(cluster, &node)?;
    let sockets = dra_rpc::PluginSockets::under(kubelet_root, DRIVER_NAME);
    let connect = || async {
        wait_until("the plugin's service", WAIT, || async {
            Ok(kubeshare_kubelet_rpc::connect(&sockets.service).await.ok())
        })
        .await
        .map(dra_rpc::DraPluginClient::new)
    };
    let mut plugin = connect().await.with_context(logs)?;

    // A claim by name, 0.4 and 4 GiB, used by pods t1 and t2; then a whole GPU.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &nsname);
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(admin.clone(), &nsname);
    let pp = PostParams::default();
    let team: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "team"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER_NAME,
            "capacity": {"requests": {"compute": "400", "memory": "4Gi"}},
        }}]}},
    }))?;
    claims.create(&pp, &team).await?;
    pods.create(&pp, &pod_of_claim("t1", &node, "team")?)
        .await?;
    pods.create(&pp, &pod_of_claim("t2", &node, "team")?)
        .await?;
    let uid_of = |name: &'static str| {
        let pods = pods.clone();
        async move {
            anyhow::Ok(
                wait_for(&pods, name, WAIT, |p| scheduled_on(p).is_some())
                    .await?
                    .metadata
                    .uid
                    .unwrap_or_default(),
            )
        }
    };
    let (t1, t2) = (uid_of("t1").await?, uid_of("t2").await?);
    let mut both = vec![t1.clone(), t2.clone()];
    both.sort();
    let team = wait_for(&claims, "team", WAIT, |c| reserved_for(c) == both).await?;
    let mut whole_tpl = template("whole", 0, "0")?;
    whole_tpl
        .spec
        .spec
        .devices
        .as_mut()
        .unwrap()
        .requests
        .as_mut()
        .unwrap()[0]
        .exactly
        .as_mut()
        .unwrap()
        .capacity = None;
    templates.create(&pp, &whole_tpl).await?;
    pods.create(&pp, &pod("w", &node, "whole")?).await?;
    let whole = reserved_claim_of(&pods, &claims, "w").await?;
    let w = pods.get("w").await?.metadata.uid.unwrap_or_default();
    let (kt, kw) = (kubelet_claim(&team), kubelet_claim(&whole));
    let device_of = |c: &ResourceClaim| {
        c.status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .and_then(|r| r.first())
            .map(|r| r.device.clone())
            .unwrap_or_default()
    };
    let (team_dev, whole_dev) = (device_of(&team), device_of(&whole));
    assert_ne!(team_dev, whole_dev, "the whole GPU is the other one");
    let index = |d: &str| kubeshare_api::dra::device_index(d).unwrap_or(9);
    let (team_gpu, whole_gpu) = (gpu(index(&team_dev)), gpu(index(&whole_dev)));

    // Prepared once, as the kubelet does for a claim however many pods use it.
    let prepare = dra_rpc::NodePrepareResourcesRequest {
        claims: vec![kt.clone(), kw.clone()],
    };
    let resp = plugin
        .node_prepare_resources(prepare.clone())
        .await?
        .into_inner();
    for k in [&kt, &kw] {
        assert_eq!(resp.claims[&k.uid].error, "", "{}", logs());
    }
    assert_eq!(
        resp.claims[&kt.uid].devices[0].cdi_device_ids,
        vec![format!("kubeshare.io/claim={}-{team_dev}", kt.uid)]
    );
    let root = dir.join("root");
    let config = |g: &str| root.join("gpus").join(g).join("resource-config.txt");
    // One client, the claim's: one token and one memory budget for both pods. No
    // priority in its config: opportunistic, as a labelled pod without one.
    let team_line = format!("1\n{} 0.4 0.4 4294967296 opportunistic\n", kt.uid);
    assert_eq!(text(&config(&team_gpu)), team_line, "{}", logs());
    assert!(root.join("pods").join(&kt.uid).is_dir());
    let peers = root.join("peers").join(&kt.uid);
    let listed = |want: &[&String]| {
        let mut want: Vec<String> = want.iter().map(|s| format!("{s}\n")).collect();
        want.sort();
        want.concat()
    };
    assert_eq!(text(&peers), listed(&[&t1, &t2]), "{}", logs());
    let team_spec: serde_json::Value = serde_json::from_str(&text(
        &cdi_dir.join(format!("kubeshare.io-claim_{}.json", kt.uid)),
    ))?;
    let (env, mounts) = spec_env_and_mounts(&team_spec);
    assert!(env.contains(&"LD_PRELOAD=/kubeshare/lib/libgemhook.so.1".to_string()));
    assert!(mounts.contains(&"/kubeshare/run".to_string()));
    assert!(
        team_spec["containerEdits"]["mounts"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["hostPath"] == root.join("pods").join(&kt.uid).display().to_string()),
        "{team_spec}"
    );
    // The whole GPU: no line, no hook, no socket directory; the GPU's device node.
    assert_eq!(text(&config(&whole_gpu)), "0\n");
    let whole_spec: serde_json::Value = serde_json::from_str(&text(
        &cdi_dir.join(format!("kubeshare.io-claim_{}.json", kw.uid)),
    ))?;
    let (env, mounts) = spec_env_and_mounts(&whole_spec);
    assert!(env.is_empty(), "{env:?}");
    assert!(
        !mounts.contains(&"/kubeshare/run".to_string()),
        "{mounts:?}"
    );
    assert_eq!(
        whole_spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
        format!("/dev/nvidia{}", index(&whole_dev))
    );
    assert!(!root.join("pods").join(&w).exists());
    // /metrics: the claim of two pods counts once; the whole GPU is all of it.
    let team_claimed = (1.0, 0.4, (4u64 << 30) as f64);
    let whole_claimed = (1.0, 1.0, (16u64 << 30) as f64);
    wait_claimed(daemon.port, &team_gpu, team_claimed)
        .await
        .with_context(logs)?;
    wait_claimed(daemon.port, &whole_gpu, whole_claimed)
        .await
        .with_context(logs)?;

    // A pod that joins the prepared claim is not prepared again (the kubelet calls
    // the plugin once per claim); the daemon's pod watch adds it to the peers file.
    pods.create(&pp, &pod_of_claim("t3", &node, "team")?)
        .await?;
    let t3 = uid_of("t3").await?;
    wait_until("pod t3 in the peers file", WAIT, || async {
        Ok((text(&peers) == listed(&[&t1, &t2, &t3])).then_some(()))
    })
    .await
    .with_context(logs)?;

    // A restart keeps both claims and the peers.
    drop(daemon);
    std::fs::write(config(&team_gpu), "0\n")?;
    let daemon = rig.start(cluster, &node)?;
    wait_until("the claim's line back", WAIT, || async {
        Ok((text(&config(&team_gpu)) == team_line).then_some(()))
    })
    .await
    .with_context(logs)?;
    let mut plugin = connect().await?;
    let again = plugin.node_prepare_resources(prepare).await?.into_inner();
    assert_eq!(again.claims, resp.claims);
    assert_eq!(text(&peers), listed(&[&t1, &t2, &t3]));
    assert_eq!(text(&config(&whole_gpu)), "0\n");
    wait_claimed(daemon.port, &team_gpu, team_claimed).await?;
    wait_claimed(daemon.port, &whole_gpu, whole_claimed).await?;

    // The kubelet unprepares a claim once the last of its pods on the node is gone.
    let resp = plugin
        .node_unprepare_resources(dra_rpc::NodeUnprepareResourcesRequest {
            claims: vec![kt.clone(), kw.clone()],
        })
        .await?
        .into_inner();
    for (uid, r) in &resp.claims {
        assert_eq!(r.error, "", "{uid}");
    }
    assert_eq!(text(&config(&team_gpu)), "0\n", "{}", logs());
    assert!(!peers.exists());
    assert!(!root.join("pods").join(&kt.uid).exists());
    for g in [&team_gpu, &whole_gpu] {
        wait_claimed(daemon.port, g, (0.0, 0.0, 0.0)).await?;
    }
    for k in [&kt, &kw] {
        assert!(
            !cdi_dir
                .join(format!("kubeshare.io-claim_{}.json", k.uid))
                .exists()
        );
    }
    drop(daemon);
    ns.delete().await?;
    Ok(())
}
