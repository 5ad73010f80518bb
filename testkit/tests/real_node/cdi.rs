//! GPUs through CDI on the real node, as a production node with a CDI runtime gets them:
//! the node daemon writes its spec into the spec dir of the node's containerd (naming the
//! stand-in device nodes hack/deploy.sh made, RUN_DIR/node/cdi-dev), and registers its
//! device plugin for `kubeshare.io/gpu` with the kubelet; the webhook asks for one in
//! every container of a KubeShare pod, and the plugin answers each with the CDI devices
//! of the pod's allocation record. A pod that reaches the kubelet asking for it without
//! a record is refused there and gets nothing.
//!
//! The rig runs on CDI unless `KUBESHARE_NODE_CDI=0` (hack/node.sh); without it these
//! tests say so and check nothing. The node has no NVIDIA driver: the device nodes are
//! made with mknod (NVIDIA's major number) and nothing opens them.

use kubeshare_node_daemon::cdi::spec::Spec;
use kubeshare_node_daemon::cdi::{generate, host, plugin, select};

use super::*;

/// The node came up with CDI (hack/node.sh wrote its containerd to node.env).
fn on_cdi(node: &RealNode) -> bool {
    if node.env("CTRD_BIN").is_some() {
        return true;
    }
    eprintln!("the node runs without CDI (KUBESHARE_NODE_CDI=0): nothing checked");
    false
}

/// A KubeShare pod (labels), an init container and two app containers that list their
/// device nodes.
fn gpu_pod(name: &str, labels: Value) -> Result<Pod> {
    let main = format!("{LIST_DEVS}; echo DONE; sleep 3600");
    let containers: Vec<Value> = ["a", "b"]
        .iter()
        .map(|c| {
            json!({"name": c, "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", main]})
        })
        .collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "initContainers": [{"name": "init", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", LIST_DEVS]}],
            "containers": containers,
        }
    }))?)
}

/// What each container of `gpu_pod` saw.
async fn seen(pods: &Api<Pod>, name: &str) -> Result<Vec<(String, Vec<String>)>> {
    let mut out = vec![(
        "init".to_string(),
        devs(&pod_logs(pods, name, "init").await?),
    )];
    for c in ["a", "b"] {
        let log = wait_for_log(pods, name, c, "DONE", WAIT).await?;
        out.push((c.to_string(), devs(&log)));
    }
    Ok(out)
}

/// Runs `args` inside the node's namespaces (its own /var/lib/kubelet); whether it succeeded.
async fn in_node(node: &RealNode, args: &[&str]) -> Result<bool> {
    let run_dir = node.dir.parent().context("node dir has no parent")?;
    let st = tokio::process::Command::new(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/node.sh"),
    )
    .arg("exec")
    .arg(run_dir)
    .args(args)
    .status()
    .await?;
    Ok(st.success())
}

fn checkpoint(node: &RealNode) -> Result<select::Answered> {
    let path = node.kubeshare_path(plugin::CHECKPOINT);
    Ok(serde_json::from_slice(
        &std::fs::read(&path).with_context(|| path.display().to_string())?,
    )?)
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn each_container_gets_exactly_its_records_gpus_through_cdi() -> Result<()> {
    let r = rig("rn-cdi").await?;
    if !on_cdi(&r.node) {
        return Ok(());
    }
    let inv = daemon::node_inventory(&r.client, &r.node.name).await?;
    ensure!(inv.gpus.len() >= 2, "the rig has {} GPUs", inv.gpus.len());

    // The spec in the runtime's dir: every GPU by index and by UUID, the stand-in
    // nodes as host paths, and no env (the webhook's LD_PRELOAD must not be replaced).
    let path = r.node.dir.join("cdi").join(host::SPEC_FILE);
    let spec: Spec =
        serde_json::from_slice(&std::fs::read(&path).with_context(|| path.display().to_string())?)?;
    spec.validate()?;
    assert_eq!(spec.kind, generate::KIND);
    for g in &inv.gpus {
        for name in [g.index.to_string(), g.uuid.clone()] {
            let d = spec
                .devices
                .iter()
                .find(|d| d.name == name)
                .with_context(|| format!("no device {name}"))?;
            let n = &d.container_edits.device_nodes[0];
            assert_eq!(n.path, format!("/dev/nvidia{}", g.index));
            let host = r
                .node
                .dir
                .join("cdi-dev")
                .join(format!("nvidia{}", g.index));
            assert_eq!(n.host_path.as_deref(), Some(host.to_str().context("path")?));
        }
    }
    assert!(
        spec.container_edits.env.is_empty(),
        "{:?}",
        spec.container_edits.env
    );
    // The device plugin's slots, as the kubelet publishes them.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(r.client.clone());
    let slots = (inv.gpus.len() as u32 * select::DEFAULT_SLOTS_PER_GPU).to_string();
    wait_for(&nodes, &r.node.name, WAIT, |n| {
        n.status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(select::RESOURCE))
            .is_some_and(|q| q.0 == slots)
    })
    .await?;

    // Whole GPUs: every container, init included, gets both GPUs' nodes and the control node.
    let whole = json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"});
    create(&r.pods, &gpu_pod("whole", whole)?).await?;
    let p = running(&r.pods, "whole").await?;
    let whole_uid = uid(&p)?;
    let mut want: Vec<String> = inv
        .gpus
        .iter()
        .map(|g| format!("/dev/nvidia{}", g.index))
        .collect();
    want.push("/dev/nvidiactl".into());
    want.sort();
    for (c, d) in seen(&r.pods, "whole").await? {
        assert_eq!(d, want, "whole: container {c}");
    }
    // Three containers answered, kept on the node for a daemon restart.
    assert_eq!(checkpoint(&r.node)?.count(&whole_uid), 3);
    delete_pods_and_wait(&r.pods, "", WAIT).await?;

    // The kubelet removes the plugins' sockets when it restarts: the plugin serves and
    // registers again (the kubelet accepts it, as the daemon logs), and the next pod is
    // answered through the new registration.
    let daemon_pods: Api<Pod> = Api::namespaced(r.client.clone(), KUBESHARE_NS);
    let daemon_pod = daemon_pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=kubeshare-node-daemon"))
        .await?
        .items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .and_then(|p| p.metadata.name)
        .context("no node daemon pod")?;
    let registrations = || async {
        let log = pod_logs(&daemon_pods, &daemon_pod, "node-daemon").await?;
        Ok::<_, anyhow::Error>(
            log.matches("device plugin: registered with the kubelet")
                .count(),
        )
    };
    let before = registrations().await?;
    ensure!(
        before >= 1,
        "the node daemon's device plugin never registered"
    );
    let socket = format!(
        "{}/{}",
        kubeshare_api::layout::KUBELET_DEVICE_PLUGIN_DIR,
        plugin::ENDPOINT
    );
    ensure!(
        in_node(&r.node, &["rm", &socket]).await?,
        "cannot remove {socket}"
    );
    wait_until("the device plugin to register again", WAIT, || async {
        match registrations().await {
            Ok(n) => Ok((n > before).then_some(())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    ensure!(
        in_node(&r.node, &["test", "-S", &socket]).await?,
        "no {socket} on the node"
    );

    // A share: only its GPU's node, in each container.
    let frac = json!({"sharedgpu/gpu_request": "0.3", "sharedgpu/gpu_limit": "0.5"});
    create(&r.pods, &gpu_pod("frac", frac)?).await?;
    let p = running(&r.pods, "frac").await?;
    let gpu = gpu_of(&p)?;
    let index = inv
        .gpu(&gpu)
        .context("the pod's GPU is not the node's")?
        .index;
    let mut want = vec![format!("/dev/nvidia{index}"), "/dev/nvidiactl".to_string()];
    want.sort();
    for (c, d) in seen(&r.pods, "frac").await? {
        assert_eq!(d, want, "frac: container {c}");
    }
    // The deleted pod was forgotten when the kubelet asked for the next one.
    let answered = checkpoint(&r.node)?;
    assert_eq!(answered.count(&uid(&p)?), 3, "{answered:?}");
    assert_eq!(answered.count(&whole_uid), 0, "{answered:?}");
    delete_pods_and_wait(&r.pods, "", WAIT).await?;

    // Two pods created and bound within a second, on different GPUs (0.6 + 0.6 do not
    // fit on one): the kubelet admits them in the order they were bound, and each of
    // their six containers gets its own pod's GPU.
    let big = json!({"sharedgpu/gpu_request": "0.6", "sharedgpu/gpu_limit": "0.6"});
    create(&r.pods, &gpu_pod("p1", big.clone())?).await?;
    create(&r.pods, &gpu_pod("p2", big)?).await?;
    let mut gpus = BTreeMap::new();
    for name in ["p1", "p2"] {
        let gpu = gpu_of(&running(&r.pods, name).await?)?;
        let index = inv.gpu(&gpu).context("not the node's GPU")?.index;
        let mut want = vec![format!("/dev/nvidia{index}"), "/dev/nvidiactl".to_string()];
        want.sort();
        for (c, d) in seen(&r.pods, name).await? {
            assert_eq!(d, want, "{name}: container {c}");
        }
        gpus.insert(name, gpu);
    }
    ensure!(gpus["p1"] != gpus["p2"], "both on one GPU: {gpus:?}");
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn a_pod_without_a_record_asking_for_the_gpu_resource_is_refused_at_the_kubelet() -> Result<()>
{
    let r = rig("rn-cdi-norec").await?;
    if !on_cdi(&r.node) {
        return Ok(());
    }
    // Past the webhook (it refuses such a pod): a namespace that opts out of it.
    Api::<k8s_openapi::api::core::v1::Namespace>::all(r.client.clone())
        .patch(
            r.ns.name(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"metadata": {"labels": {"sharedgpu/webhook": "disabled"}}}),
            ),
        )
        .await?;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "norecord"},
        "spec": {
            "restartPolicy": "Never",
            "tolerations": [{"operator": "Exists"}],
            "nodeSelector": {"kubernetes.io/hostname": r.node.name},
            "containers": [{"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", LIST_DEVS],
                "resources": {"limits": {select::RESOURCE: "1"}}}],
        }
    }))?;
    create(&r.pods, &pod).await?;
    let p = wait_for(&r.pods, "norecord", WAIT, |p: &Pod| {
        kubeshare_testkit::pod_phase(p) == "Failed"
    })
    .await?;
    let status = p.status.clone().unwrap_or_default();
    let message = status.message.unwrap_or_default();
    assert_eq!(
        status.reason.as_deref(),
        Some("UnexpectedAdmissionError"),
        "{message}"
    );
    assert!(
        message.contains("asks for kubeshare.io/gpu but has no allocation record"),
        "{message}"
    );
    // It never ran: no container was created.
    assert!(
        status
            .container_statuses
            .unwrap_or_default()
            .iter()
            .all(|c| c
                .state
                .as_ref()
                .is_none_or(|s| s.running.is_none() && s.terminated.is_none())),
    );
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}
