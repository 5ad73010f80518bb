//! The node daemon against the real control plane of the test rig (kube-apiserver,
//! controllers, kwok playing the kubelets), with daemons in fake-inventory mode, one
//! per kwok node, side by side on this machine, and the real gem-schd binary.
//!
//! Pods are created bound to their node (`spec.nodeName`) carrying the allocation
//! annotations exactly as the extender writes them at bind (`Allocation::to_annotations`).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kubeshare_api::inventory::{COUNT_LABEL, ENABLED_LABEL, INVENTORY_ANNOTATION, MODEL_LABEL};
use kubeshare_api::{Allocation, GpuInfo, NodeInventory};
use kubeshare_testkit::cgroups::{TestCgroups, exit_within, sim_client_in};
use kubeshare_testkit::{
    Cluster, Identity, KwokNode, TestNamespace, create_kwok_node, delete_node, wait_until,
};

const WAIT: Duration = Duration::from_secs(30);

/// A daemon process; stopped (SIGTERM, then SIGKILL) when dropped.
struct DaemonProc {
    child: Option<Child>,
    log: PathBuf,
}

impl DaemonProc {
    fn start(args: &[String], port: u16, log: PathBuf) -> anyhow::Result<DaemonProc> {
        let daemon = Path::new(env!("CARGO_BIN_EXE_kubeshare-node-daemon"));
        Self::spawn(daemon, args, port, log)
    }

    fn spawn(
        program: &Path,
        args: &[String],
        port: u16,
        log: PathBuf,
    ) -> anyhow::Result<DaemonProc> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let child = Command::new(program)
            .args(args)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        Ok(DaemonProc {
            child: Some(child),
            log,
        })
    }

    /// SIGTERM and wait; returns whether it exited successfully.
    fn stop(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = c.try_wait() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    /// SIGKILL: the harshest restart.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Deletes the test's Nodes however the test ends.
struct Nodes {
    kubeconfig: PathBuf,
    names: Vec<String>,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        let kc = self.kubeconfig.clone();
        let names = self.names.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let c = kubeshare_testkit::client_from_kubeconfig(&kc)
                    .await
                    .map_err(std::io::Error::other)?;
                for n in names {
                    let _ = delete_node(&c, &n).await;
                }
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

async fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).await?;
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status line")?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// The value of `name{...gpu="<gpu>"...}` (or of the only row when `gpu` is None).
fn metric(text: &str, name: &str, gpu: Option<&str>) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        if !rest.starts_with('{') {
            return None;
        }
        if let Some(g) = gpu
            && !rest.contains(&format!("gpu=\"{g}\""))
        {
            return None;
        }
        rest.rsplit_once(' ')?.1.parse().ok()
    })
}

async fn metric_now(port: u16, name: &str, gpu: Option<&str>) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics").await.ok()?;
    metric(&body, name, gpu)
}

fn gpu(uuid: String, index: u32, model: &str, memory: u64) -> GpuInfo {
    GpuInfo {
        uuid,
        index,
        model: model.into(),
        memory,
        numa_node: Some(0),
        nvlink_peers: vec![],
        held_by: None,
    }
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p).ok()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| !r.trim_start().starts_with(['Z', 'X']))
        })
        .unwrap_or(false)
}

fn read_pid(p: &Path) -> Option<u32> {
    read(p)?.trim().parse().ok()
}

/// A binary of another workspace crate, built next to this test binary
/// (mk/node-daemon.mk builds them for `make test`).
fn sibling_binary(name: &str, package: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let p = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .context("no target dir")?;
    if !p.is_file() {
        bail!(
            "{} is missing: run `cargo build -p {package} --bins` (make test does)",
            p.display()
        );
    }
    Ok(p)
}

/// Everything on disk that a restart must leave alone: file contents and inodes
/// (an inode change would mean the file was rewritten), and the pod directories.
fn disk_state(root: &Path, gpus: &[String]) -> BTreeMap<String, (String, u64)> {
    let mut m = BTreeMap::new();
    for g in gpus {
        let p = root.join("gpus").join(g).join("resource-config.txt");
        let meta = std::fs::metadata(&p).map(|m| m.ino()).unwrap_or(0);
        m.insert(format!("config {g}"), (read(&p).unwrap_or_default(), meta));
    }
    let hook = root.join("lib/libgemhook.so.1");
    m.insert(
        "hook".into(),
        (
            format!("{:?}", std::fs::read(&hook).map(|b| b.len())),
            std::fs::metadata(&hook).map(|m| m.ino()).unwrap_or(0),
        ),
    );
    if let Ok(rd) = std::fs::read_dir(root.join("pods")) {
        for e in rd.flatten() {
            let ino = e.metadata().map(|m| m.ino()).unwrap_or(0);
            m.insert(
                format!("pod dir {}", e.file_name().to_string_lossy()),
                (String::new(), ino),
            );
        }
    }
    m
}

fn pod_json(
    name: &str,
    node: &str,
    labels: &[(&str, &str)],
    annotations: BTreeMap<String, String>,
) -> anyhow::Result<Pod> {
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
        .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "schedulerName": "kubeshare-scheduler",
            // What the webhook gives every KubeShare pod: the daemon taints its Node.
            "tolerations": [{"key": "kubeshare.io/gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.invalid/app:1"}],
        },
    }))?)
}

/// A pod for kube-scheduler's `kubeshare-scheduler` profile, kept to `node` by a nodeSelector.
fn scheduled_pod(name: &str, node: &str, labels: &[(&str, &str)]) -> anyhow::Result<Pod> {
    let mut pod = pod_json(name, node, labels, BTreeMap::new())?;
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = None;
        spec.node_selector = Some(BTreeMap::from([(
            "kubernetes.io/hostname".to_string(),
            node.to_string(),
        )]));
    }
    Ok(pod)
}

async fn wait_file(p: &Path, want: &str) -> anyhow::Result<()> {
    let what = format!("{} to read {want:?}", p.display());
    wait_until(&what, WAIT, || async {
        let cur = read(p);
        Ok(if cur.as_deref() == Some(want) {
            Some(())
        } else {
            None
        })
    })
    .await?;
    Ok(())
}

async fn wait_gone(p: &Path) -> anyhow::Result<()> {
    wait_until(&format!("{} to disappear", p.display()), WAIT, || async {
        Ok(if p.exists() { None } else { Some(()) })
    })
    .await?;
    Ok(())
}

async fn event_reasons(client: &kube::Client, ns: &str, uid: &str) -> Vec<(String, String)> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    api.list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
        .await
        .map(|l| {
            l.items
                .into_iter()
                .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_daemons_on_kwok_nodes() -> anyhow::Result<()> {
    let gem_schd = sibling_binary("gem-schd", "gem-schd")?;
    let extender = sibling_binary("kubeshare-extender", "kubeshare-scheduler")?;
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let ns = TestNamespace::create(cluster, "nd-daemon").await?;
    let nsname = ns.name().to_string();
    let node_a = ns.unique_name("a");
    let node_b = ns.unique_name("b");
    assert!(node_a.starts_with("nd-"));
    let _nodes = Nodes {
        kubeconfig: cluster.kubeconfig(Identity::Admin)?.to_path_buf(),
        names: vec![node_a.clone(), node_b.clone()],
    };
    // A label that is not ours must survive the daemon's patches.
    create_kwok_node(&admin, &KwokNode::new(&node_a).label("team", "nd-test")).await?;
    create_kwok_node(&admin, &KwokNode::new(&node_b)).await?;

    let tag = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64 & 0xffff_ffff_ffff;
    let uuid = |i: u32| {
        format!(
            "GPU-{:08x}-0000-4000-8000-{tag:012x}",
            std::process::id() * 16 + i
        )
    };
    let inv_a = NodeInventory {
        gpus: vec![
            gpu(uuid(0), 0, "NVIDIA-H100-80GB-HBM3", 80 << 30),
            gpu(uuid(1), 1, "NVIDIA-H100-80GB-HBM3", 80 << 30),
        ],
    };
    let inv_b = NodeInventory {
        gpus: vec![gpu(uuid(2), 0, "NVIDIA-A100-SXM4-40GB", 40 << 30)],
    };
    let (a0, a1, b0) = (uuid(0), uuid(1), uuid(2));

    // Short: socket paths under the root must fit in 107 bytes.
    let tmp = tempfile::Builder::new().prefix("nd").tempdir_in("/tmp")?;
    let root_a = tmp.path().join("a");
    let root_b = tmp.path().join("b");
    let inv_file_a = tmp.path().join("inv-a.json");
    let inv_file_b = tmp.path().join("inv-b.json");
    std::fs::write(&inv_file_a, inv_a.to_json())?;
    std::fs::write(&inv_file_b, inv_b.to_json())?;
    let hook = tmp.path().join("libgemhook.so");
    std::fs::write(&hook, b"\x7fELF stand-in for the hook library")?;
    let kubeconfig = cluster
        .kubeconfig(Identity::NodeDaemon)?
        .display()
        .to_string();

    let args_a: Vec<String> = [
        "--node-name",
        &node_a,
        "--root",
        &root_a.display().to_string(),
        "--fake-inventory",
        &inv_file_a.display().to_string(),
        "--kubeconfig",
        &kubeconfig,
        "--resync-secs",
        "1",
        "--hook-lib",
        &hook.display().to_string(),
        "--gem-schd",
        &gem_schd.display().to_string(),
        // This test reaches the pods' sockets itself, from outside any pod; the peer check
        // has its own test below.
        "--verify-pod-peers=false",
    ]
    .map(String::from)
    .to_vec();
    // Node B runs in configs-only mode (no gem-schd).
    let args_b: Vec<String> = [
        "--node-name",
        &node_b,
        "--root",
        &root_b.display().to_string(),
        "--fake-inventory",
        &inv_file_b.display().to_string(),
        "--kubeconfig",
        &kubeconfig,
        "--resync-secs",
        "1",
    ]
    .map(String::from)
    .to_vec();
    // The real extender, on the port the cluster's kubeshare-scheduler calls.
    let extender_args: Vec<String> = vec![
        "--kubeconfig".into(),
        cluster
            .kubeconfig(Identity::Extender)?
            .display()
            .to_string(),
    ];
    let extender_proc = DaemonProc::spawn(
        &extender,
        &extender_args,
        cluster.extender_port(),
        tmp.path().join("extender.log"),
    )?;
    let port_a = free_port();
    let mut daemon_a = DaemonProc::start(&args_a, port_a, tmp.path().join("a.log"))?;
    let mut daemon_b = DaemonProc::start(&args_b, free_port(), tmp.path().join("b.log"))?;

    let result = async {
        // 1. The inventory appears on each Node; other labels are kept.
        let nodes: Api<Node> = Api::all(admin.clone());
        for (name, inv) in [(&node_a, &inv_a), (&node_b, &inv_b)] {
            let want = inv.to_json();
            kubeshare_testkit::wait_for(&nodes, name, WAIT, |n: &Node| {
                n.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(INVENTORY_ANNOTATION))
                    == Some(&want)
            })
            .await?;
        }
        // The GPU-node taint is on both Nodes (the pods below tolerate it, as the
        // webhook makes every KubeShare pod do; kube-scheduler checks it).
        for name in [&node_a, &node_b] {
            kubeshare_testkit::wait_for(&nodes, name, WAIT, |n: &Node| {
                n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| {
                        t.iter().any(|t| {
                            t.key == "kubeshare.io/gpu"
                                && t.value.as_deref() == Some("shared")
                                && t.effect == "NoSchedule"
                        })
                    })
            })
            .await?;
        }
        let n = nodes.get(&node_a).await?;
        let labels = n.metadata.labels.unwrap_or_default();
        assert_eq!(labels.get(ENABLED_LABEL).map(String::as_str), Some("true"));
        assert_eq!(labels.get(COUNT_LABEL).map(String::as_str), Some("2"));
        assert_eq!(
            labels.get(MODEL_LABEL).map(String::as_str),
            Some("NVIDIA-H100-80GB-HBM3")
        );
        assert_eq!(labels.get("team").map(String::as_str), Some("nd-test"));
        assert_eq!(
            read(&root_a.join("lib/libgemhook.so.1")).as_deref(),
            Some("\x7fELF stand-in for the hook library")
        );

        wait_until("daemon A ready", WAIT, || async {
            Ok(match http_get(port_a, "/readyz").await {
                Ok((200, _)) => Some(()),
                _ => None,
            })
        })
        .await?;

        // 2. Pods placed on GPUs (annotations as the extender writes them).
        let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
        let alloc = |node: &str, gpus: Vec<String>, mem: u64, model: &str| {
            Allocation {
                node: node.into(),
                gpu_uuids: gpus,
                gpu_mem: mem,
                gpu_model: model.into(),
                granted: kubeshare_api::Granted::Fraction {
                    request: kubeshare_api::Milli::new(200).unwrap_or(kubeshare_api::Milli::ZERO),
                    limit: kubeshare_api::Milli::new(200).unwrap_or(kubeshare_api::Milli::ZERO),
                },
                gpu_mem_resident: None,
            }
            .to_annotations()
        };
        // p1 and p2 go through kube-scheduler and the extender; a nodeSelector keeps them
        // on this test's nodes in a cluster that other tests share.
        let p1 = pods
            .create(
                &PostParams::default(),
                &scheduled_pod(
                    "p1",
                    &node_a,
                    &[("gpu_request", "0.3"), ("gpu_limit", "0.6")],
                )?,
            )
            .await?;
        let p2 = pods
            .create(
                &PostParams::default(),
                &scheduled_pod(
                    "p2",
                    &node_b,
                    &[
                        ("gpu_request", "0.5"),
                        ("gpu_limit", "1.0"),
                        ("gpu_mem", "20Gi"),
                        ("priority", "10"),
                    ],
                )?,
            )
            .await?;
        let placed = |name: &'static str| {
            let pods = pods.clone();
            async move {
                let p = kubeshare_testkit::wait_for(&pods, name, WAIT, |p: &Pod| {
                    p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
                })
                .await?;
                let ann = p.metadata.annotations.clone().unwrap_or_default();
                let a =
                    Allocation::from_annotations(&ann)?.context("bound without an allocation")?;
                anyhow::Ok(a)
            }
        };
        let alloc1 = placed("p1").await?;
        let alloc2 = placed("p2").await?;
        assert_eq!(alloc1.node, node_a);
        assert_eq!(alloc2.node, node_b);
        assert_eq!(alloc2.gpu_uuids, vec![b0.clone()]);
        assert_eq!(alloc2.gpu_mem, 20 << 30);
        // The extender picked one of node A's GPUs: the other must stay empty.
        let (g1, g_other) = if alloc1.gpu_uuids == vec![a0.clone()] {
            (a0.clone(), a1.clone())
        } else {
            (a1.clone(), a0.clone())
        };
        assert_eq!(alloc1.gpu_uuids, vec![g1.clone()]);
        let mem1 = alloc1.gpu_mem;
        // No gpu_mem label: the request's share of the GPU's memory, decided at bind.
        assert_eq!(mem1, (80u64 << 30) * 300 / 1000);
        // p3 is bound by hand with a broken allocation (what no extender writes).
        let mut bad = alloc(&node_a, vec![g_other.clone()], 1, "NVIDIA-H100-80GB-HBM3");
        bad.insert("sharedgpu/gpu_mem".into(), "lots".into());
        let p3 = pods
            .create(
                &PostParams::default(),
                &pod_json(
                    "p3",
                    &node_a,
                    &[("gpu_request", "0.2"), ("gpu_limit", "0.2")],
                    bad,
                )?,
            )
            .await?;
        let uid1 = p1.metadata.uid.clone().context("uid")?;
        let uid2 = p2.metadata.uid.clone().context("uid")?;
        let uid3 = p3.metadata.uid.clone().context("uid")?;

        let cfg = |root: &Path, g: &str| root.join("gpus").join(g).join("resource-config.txt");
        // Gemini's order: ID REQUEST LIMIT GPU_MEM, then the class of a pod of priority 0 (no
        // label); p2's priority 10 is guaranteed, Gemini's four columns.
        wait_file(
            &cfg(&root_a, &g1),
            &format!("1\n{uid1} 0.3 0.6 {mem1} opportunistic\n"),
        )
        .await?;
        wait_file(
            &cfg(&root_b, &b0),
            &format!("1\n{uid2} 0.5 1.0 21474836480\n"),
        )
        .await?;
        assert_eq!(
            read(&cfg(&root_a, &g_other)).as_deref(),
            Some("0\n"),
            "the bad pod is not configured"
        );
        assert!(root_a.join("pods").join(&uid1).is_dir());
        assert!(
            !root_a.join("pods").join(&uid2).exists(),
            "node B's pod stays off node A"
        );
        assert!(!root_a.join("pods").join(&uid3).exists());
        assert!(root_b.join("pods").join(&uid2).is_dir());

        // 3. gem-schd serves the pod's socket with the config's figures.
        let sock = root_a.join("pods").join(&uid1).join(format!("{g1}.sock"));
        let hello = connect(&sock, &g1).await?;
        assert_eq!(
            (hello.request_milli, hello.limit_milli, hello.mem_limit),
            (300, 600, mem1)
        );

        // 4. Events: the placement, and the bad pod's problem.
        wait_until("events on p1 and p3", WAIT, || {
            let admin = admin.clone();
            let (ns, u1, u3) = (nsname.clone(), uid1.clone(), uid3.clone());
            async move {
                let e1 = event_reasons(&admin, &ns, &u1).await;
                let e3 = event_reasons(&admin, &ns, &u3).await;
                let ok1 = e1.iter().any(|(r, _)| r == "GpuConfigured");
                let ok3 = e3.iter().any(|(r, m)| {
                    r == "GpuNotConfigured" && m.contains("sharedgpu/gpu_mem=\"lots\"")
                });
                if ok1 && ok3 {
                    Ok(Some(()))
                } else {
                    Err(format!("events so far: {e1:?} {e3:?}"))
                }
            }
        })
        .await?;

        // 5. Metrics per GPU.
        let (_, m) = http_get(port_a, "/metrics").await?;
        assert_eq!(
            metric(&m, "kubeshare_node_gpu_pods", Some(&g1)),
            Some(1.0),
            "{m}"
        );
        assert_eq!(
            metric(&m, "kubeshare_node_gpu_pods", Some(&g_other)),
            Some(0.0)
        );
        assert_eq!(
            metric(&m, "kubeshare_node_gpu_requested_share", Some(&g1)),
            Some(0.3)
        );
        assert_eq!(
            metric(&m, "kubeshare_node_gpu_allocated_memory_bytes", Some(&g1)),
            Some(mem1 as f64)
        );
        assert_eq!(
            metric(&m, "kubeshare_node_gem_schd_up", Some(&g1)),
            Some(1.0)
        );
        assert_eq!(metric(&m, "kubeshare_node_rejected_pods", None), Some(1.0));

        // 6. A killed gem-schd is restarted, and serves again.
        let pid_file = root_a.join("gpus").join(&g1).join("gem-schd.pid");
        let old = read_pid(&pid_file).context("pid file")?;
        unsafe { libc::kill(old as i32, libc::SIGKILL) };
        let new = wait_until("gem-schd restarted", WAIT, || async {
            Ok(read_pid(&pid_file).filter(|p| *p != old && alive(*p)))
        })
        .await?;
        assert_ne!(new, old);
        let hello = connect(&sock, &g1).await?;
        assert_eq!(hello.request_milli, 300);
        wait_until("restart counted", WAIT, || async {
            Ok(
                (metric_now(port_a, "kubeshare_node_gem_schd_restarts_total", Some(&g1)).await
                    == Some(1.0))
                .then_some(()),
            )
        })
        .await?;

        // 7. Restart the daemon (SIGKILL: no chance to clean up). Its children die with
        // it, and the new one rebuilds from the API and the files, changing nothing.
        let gpus_a = vec![a0.clone(), a1.clone()];
        let before = disk_state(&root_a, &gpus_a);
        let children: Vec<u32> = gpus_a
            .iter()
            .filter_map(|g| read_pid(&root_a.join("gpus").join(g).join("gem-schd.pid")))
            .collect();
        assert_eq!(children.len(), 2);
        daemon_a.kill();
        wait_until("gem-schd children gone with their daemon", WAIT, || {
            let children = children.clone();
            async move { Ok(children.iter().all(|p| !alive(*p)).then_some(())) }
        })
        .await?;
        let port_a2 = free_port();
        daemon_a = DaemonProc::start(&args_a, port_a2, tmp.path().join("a2.log"))?;
        // Wait for a pass after the first list, plus a resync pass.
        wait_until("restarted daemon reconciled twice", WAIT, || async {
            Ok(metric_now(port_a2, "kubeshare_node_reconciles_total", None)
                .await
                .filter(|n| *n >= 2.0))
        })
        .await?;
        assert_eq!(
            disk_state(&root_a, &gpus_a),
            before,
            "a restart changed the disk"
        );
        let hello = connect(&sock, &g1).await?;
        assert_eq!(hello.limit_milli, 600);
        assert_eq!(
            metric_now(port_a2, "kubeshare_node_config_writes_total", None).await,
            Some(0.0)
        );
        // Nor does it announce the pod again.
        let configured = event_reasons(&admin, &nsname, &uid1)
            .await
            .into_iter()
            .filter(|(r, _)| r == "GpuConfigured")
            .count();
        assert_eq!(configured, 1, "one GpuConfigured event for p1");

        // 8. A finished pod leaves its GPU (node B), a deleted one too (node A).
        let status = serde_json::json!({"status": {"phase": "Succeeded"}});
        Api::<Pod>::namespaced(admin.clone(), &nsname)
            .patch_status("p2", &PatchParams::default(), &Patch::Merge(&status))
            .await?;
        wait_file(&cfg(&root_b, &b0), "0\n").await?;
        wait_gone(&root_b.join("pods").join(&uid2)).await?;

        pods.delete(
            "p1",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await?;
        wait_file(&cfg(&root_a, &g1), "0\n").await?;
        wait_gone(&root_a.join("pods").join(&uid1)).await?;

        // 9. The inventory changes (a GPU of another model appears): the Node follows,
        // by patch, and the new GPU gets its (empty) config.
        let b1 = uuid(3);
        let inv_b2 = NodeInventory {
            gpus: vec![
                inv_b.gpus[0].clone(),
                gpu(b1.clone(), 1, "NVIDIA-H100-80GB-HBM3", 80 << 30),
            ],
        };
        std::fs::write(&inv_file_b, inv_b2.to_json())?;
        let want = inv_b2.to_json();
        let n = kubeshare_testkit::wait_for(&nodes, &node_b, WAIT, |n: &Node| {
            n.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(INVENTORY_ANNOTATION))
                == Some(&want)
        })
        .await?;
        let labels = n.metadata.labels.unwrap_or_default();
        assert_eq!(labels.get(COUNT_LABEL).map(String::as_str), Some("2"));
        assert_eq!(labels.get(MODEL_LABEL).map(String::as_str), Some("mixed"));
        wait_file(&cfg(&root_b, &b1), "0\n").await?;

        // 10. Graceful shutdown stops every gem-schd.
        let children: Vec<u32> = gpus_a
            .iter()
            .filter_map(|g| read_pid(&root_a.join("gpus").join(g).join("gem-schd.pid")))
            .collect();
        assert_eq!(children.len(), 2);
        assert!(daemon_a.stop(), "daemon A exits 0 on SIGTERM");
        assert!(children.iter().all(|p| !alive(*p)), "gem-schd left running");
        assert!(daemon_b.stop(), "daemon B exits 0 on SIGTERM");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = &result {
        eprintln!("--- extender log ---\n{}", extender_proc.log_text());
        eprintln!(
            "--- daemon A log ---\n{}\n--- daemon B log ---\n{}",
            daemon_a.log_text(),
            daemon_b.log_text()
        );
        eprintln!("test failed: {e:#}");
    }
    drop(daemon_a);
    drop(daemon_b);
    drop(extender_proc);
    ns.delete().await?;
    result
}

async fn connect(sock: &Path, gpu: &str) -> anyhow::Result<gem_proto::client::HelloInfo> {
    let sock = sock.to_path_buf();
    let gpu = gpu.to_string();
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + WAIT;
        loop {
            match gem_proto::client::Client::connect(&sock, std::process::id(), &gpu) {
                Ok(c) => return Ok(*c.hello()),
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => bail!("cannot reach gem-schd at {}: {e}", sock.display()),
            }
        }
    })
    .await?
}

/// A process of one pod at another pod's socket: the node daemon's gem-schd refuses it, and
/// the node daemon reports it with an Event on each pod and a counter; a process of the
/// socket's own pod is served. The processes run in cgroups named for the two pods' UIDs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_at_another_pods_socket_is_refused_and_reported() -> anyhow::Result<()> {
    let Some(cgroups) = TestCgroups::make("ks-nd-peers") else {
        eprintln!("skipped: needs root and a writable cgroup hierarchy under /sys/fs/cgroup");
        return Ok(());
    };
    let gem_schd = sibling_binary("gem-schd", "gem-schd")?;
    let sim = sibling_binary("gem-client-sim", "gem-schd")?;
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let ns = TestNamespace::create(cluster, "nd-peers").await?;
    let nsname = ns.name().to_string();
    let node = ns.unique_name("p");
    let _nodes = Nodes {
        kubeconfig: cluster.kubeconfig(Identity::Admin)?.to_path_buf(),
        names: vec![node.clone()],
    };
    create_kwok_node(&admin, &KwokNode::new(&node)).await?;
    let tag = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64 & 0xffff_ffff_ffff;
    let g = format!("GPU-{:08x}-0000-4000-8000-{tag:012x}", std::process::id());
    let inv = NodeInventory {
        gpus: vec![gpu(g.clone(), 0, "NVIDIA-H100-80GB-HBM3", 80 << 30)],
    };
    let tmp = tempfile::Builder::new().prefix("nd").tempdir_in("/tmp")?;
    let root = tmp.path().join("r");
    let inv_file = tmp.path().join("inv.json");
    std::fs::write(&inv_file, inv.to_json())?;
    let args: Vec<String> = [
        "--node-name",
        &node,
        "--root",
        &root.display().to_string(),
        "--fake-inventory",
        &inv_file.display().to_string(),
        "--kubeconfig",
        &cluster
            .kubeconfig(Identity::NodeDaemon)?
            .display()
            .to_string(),
        "--gem-schd",
        &gem_schd.display().to_string(),
        "--gpu-process-check-secs",
        "1",
        // No NVML on this machine: only gem-schd's refusals are checked.
        "--nvml-library",
        "/nonexistent/libnvidia-ml.so.1",
    ]
    .map(String::from)
    .to_vec();
    let port = free_port();
    let daemon = DaemonProc::start(&args, port, tmp.path().join("d.log"))?;
    let result = async {
        let pods: Api<Pod> = Api::namespaced(admin.clone(), &nsname);
        let ann = Allocation {
            node: node.clone(),
            gpu_uuids: vec![g.clone()],
            gpu_mem: 1 << 30,
            gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
            granted: kubeshare_api::Granted::Fraction {
                request: kubeshare_api::Milli::new(200).context("milli")?,
                limit: kubeshare_api::Milli::new(200).context("milli")?,
            },
            gpu_mem_resident: None,
        }
        .to_annotations();
        let labels = [("gpu_request", "0.2"), ("gpu_limit", "0.2")];
        let mut uids = vec![];
        for name in ["owner", "intruder"] {
            let p = pods
                .create(
                    &PostParams::default(),
                    &pod_json(name, &node, &labels, ann.clone())?,
                )
                .await?;
            uids.push(p.metadata.uid.context("uid")?);
        }
        let (owner, intruder) = (uids[0].clone(), uids[1].clone());
        let sock = root.join("pods").join(&owner).join(format!("{g}.sock"));
        wait_until("the owner's socket", WAIT, || async {
            Ok(sock.exists().then_some(()))
        })
        .await?;

        // The intruder's process at the owner's socket: Error 7, naming both pods.
        let intruding = sim_client_in(&sim, &cgroups.pod("besteffort", &intruder)?, &sock, &g)?;
        let out = exit_within(intruding, WAIT).context("the intruder was served")?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "the intruder was served: {err}");
        ensure!(
            err.contains("code 7") && err.contains(&format!("runs in pod {intruder}")),
            "{err}"
        );
        // The owner's process is served.
        let mut ok = sim_client_in(&sim, &cgroups.pod("burstable", &owner)?, &sock, &g)?;
        let mut line = String::new();
        if let Some(o) = ok.stdout.take() {
            std::io::BufRead::read_line(&mut std::io::BufReader::new(o), &mut line)?;
        }
        let _ = ok.kill();
        let _ = ok.wait();
        ensure!(
            line.starts_with("allocated used=1"),
            "owner not served: {line:?}"
        );

        // Events on both pods, and the counter.
        wait_until("refusal events on both pods", WAIT, || {
            let admin = admin.clone();
            let (ns, o, i) = (nsname.clone(), owner.clone(), intruder.clone());
            async move {
                let eo = event_reasons(&admin, &ns, &o).await;
                let ei = event_reasons(&admin, &ns, &i).await;
                let on_owner = eo.iter().any(|(r, m)| {
                    r == "GpuSocketPeerRefused" && m.contains(&format!("/intruder ({i})"))
                });
                let on_intruder = ei
                    .iter()
                    .any(|(r, m)| r == "GpuSocketOfAnotherPod" && m.contains("/owner"));
                if on_owner && on_intruder {
                    Ok(Some(()))
                } else {
                    Err(format!("events so far: {eo:?} {ei:?}"))
                }
            }
        })
        .await?;
        ensure!(
            metric_now(port, "kubeshare_node_refused_socket_peers_total", None).await == Some(1.0),
            "refusal not counted"
        );
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = &result {
        eprintln!("--- daemon log ---\n{}", daemon.log_text());
        eprintln!("test failed: {e:#}");
    }
    drop(daemon);
    ns.delete().await?;
    result
}
