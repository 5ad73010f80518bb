//! The node daemon on the real node: a restart keeps running pods' configs and cleans up
//! deleted ones; GPUs the device plugin gives away are not shared until freed.

use super::*;

async fn node_daemon_pod(client: &kube::Client) -> Result<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), KUBESHARE_NS);
    let l = api
        .list(&ListParams::default().labels("app.kubernetes.io/name=kubeshare-node-daemon"))
        .await?;
    l.items
        .into_iter()
        .find(|p| p.metadata.deletion_timestamp.is_none())
        .context("no node daemon pod")
}

fn config_has(node: &RealNode, gpu: &str, pod_uid: &str) -> bool {
    node.resource_config(gpu).is_some_and(|c| {
        c.lines()
            .any(|l| l.split_whitespace().next() == Some(pod_uid))
    })
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn node_daemon_restart_keeps_running_pods_and_cleans_up_deleted_ones() -> Result<()> {
    let r = rig("rn-restart").await?;
    let labels = [
        ("sharedgpu/gpu_request", "0.2"),
        ("sharedgpu/gpu_limit", "0.2"),
        ("sharedgpu/sched_affinity", "restart"),
    ];
    // Prints one JSON line per 100 kernels, for ever.
    let script = "while true; do cuda-workload launch --kernel-us 1000 --count 100 || exit 1; done";
    create(&r.pods, &workload_pod("keep", &labels, script)?).await?;
    create(&r.pods, &workload_pod("gone", &labels, script)?).await?;
    let keep = running(&r.pods, "keep").await?;
    let gone = running(&r.pods, "gone").await?;
    let gpu = gpu_of(&keep)?;
    let (keep_uid, gone_uid) = (uid(&keep)?, uid(&gone)?);
    wait_for_log(&r.pods, "keep", "main", "\"kernels\":100", WAIT).await?;
    ensure!(
        config_has(&r.node, &gpu, &keep_uid),
        "keep is not in the config"
    );
    let config_before = r.node.resource_config(&gpu).unwrap_or_default();

    // The node daemon's pod goes; the DaemonSet brings a new one.
    let ds_pods: Api<Pod> = Api::namespaced(r.client.clone(), KUBESHARE_NS);
    let old = node_daemon_pod(&r.client).await?;
    let old_name = old.metadata.name.clone().context("no name")?;
    ds_pods.delete(&old_name, &DeleteParams::default()).await?;
    let new = wait_until("a new node daemon pod, ready", WAIT, || async {
        match node_daemon_pod(&r.client).await {
            Ok(p)
                if p.metadata.name.as_deref() != Some(old_name.as_str()) && pod_is_running(&p) =>
            {
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                Ok(ready.then_some(p))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    })
    .await?;
    eprintln!(
        "node daemon pod {old_name} replaced by {:?}",
        new.metadata.name
    );

    // The running pod kept its line and keeps running kernels through the new gem-schd.
    assert_eq!(
        r.node.resource_config(&gpu).unwrap_or_default(),
        config_before
    );
    let lines_now = json_lines(&pod_logs(&r.pods, "keep", "main").await?).len();
    wait_until(
        "keep to finish two more rounds after the restart",
        WAIT,
        || async {
            match pod_logs(&r.pods, "keep", "main").await {
                Ok(l) => Ok((json_lines(&l).len() >= lines_now + 2).then_some(())),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;
    assert!(pod_is_running(&r.pods.get("keep").await?));

    // A deleted pod's line and socket directory go.
    r.pods.delete("gone", &DeleteParams::default()).await?;
    let gone_dir = r.node.pod_socket_dir(&gone_uid);
    wait_until(
        "gone's config line and socket directory to disappear",
        WAIT,
        || async {
            Ok::<_, String>(
                (!config_has(&r.node, &gpu, &gone_uid) && !gone_dir.exists()).then_some(()),
            )
        },
    )
    .await?;
    assert!(config_has(&r.node, &gpu, &keep_uid));
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}

/// The Node's published GPUs (the node daemon's `sharedgpu/inventory`).
pub(super) async fn node_inventory(
    client: &kube::Client,
    node: &str,
) -> Result<kubeshare_api::NodeInventory> {
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let n = nodes.get(node).await?;
    let json = n
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kubeshare_api::inventory::INVENTORY_ANNOTATION))
        .context("the Node has no inventory annotation")?;
    Ok(kubeshare_api::NodeInventory::parse(json)?)
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn gpus_the_device_plugin_gives_away_are_not_shared_until_freed() -> Result<()> {
    let r = rig("rn-devplugin").await?;
    let inv = node_inventory(&r.client, &r.node.name).await?;
    let last = inv.gpus.iter().max_by_key(|g| g.index).context("no GPUs")?;
    let given = last.uuid.clone();
    // NVIDIA's device plugin, as far as the kubelet can tell: nvidia.com/gpu with GPU
    // UUIDs as device IDs; here it offers only the last GPU.
    let run_dir = r.node.dir.parent().context("node dir has no parent")?;
    let node_sh = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/node.sh");
    let mut plugin = tokio::process::Command::new(node_sh)
        .arg("exec")
        .arg(run_dir)
        .arg(env!("CARGO_BIN_EXE_kubeshare-test-device-plugin"))
        .arg(format!("--devices={given}"))
        .kill_on_drop(true)
        .spawn()
        .context("cannot start the test device plugin")?;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(r.client.clone());
    wait_for(&nodes, &r.node.name, WAIT, |n| {
        n.status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("nvidia.com/gpu"))
            .is_some_and(|q| q.0 == "1")
    })
    .await?;

    // A plain pod takes that GPU whole through the device plugin. Admission leaves its
    // env to the plugin and lets it onto the KubeShare node (the toleration).
    let whole: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "whole"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", "echo NVD=$NVIDIA_VISIBLE_DEVICES; echo DONE; sleep 3600"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        }
    }))?;
    create(&r.pods, &whole).await?;
    running(&r.pods, "whole").await?;
    let log = wait_for_log(&r.pods, "whole", "main", "DONE", WAIT).await?;
    assert_eq!(field(&log, "NVD"), Some(given.as_str()), "{log}");
    let holder = format!("{}/whole", r.ns.name());
    wait_until(
        "the node daemon to publish the GPU as held",
        WAIT,
        || async {
            match node_inventory(&r.client, &r.node.name).await {
                Ok(i) => Ok(i
                    .gpu(&given)
                    .is_some_and(|g| g.held_by.as_deref() == Some(holder.as_str()))
                    .then_some(())),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await?;

    // One 0.6 share per GPU: every GPU but the held one takes one; the last waits.
    let labels = [
        ("sharedgpu/gpu_request", "0.6"),
        ("sharedgpu/gpu_limit", "0.6"),
    ];
    let n = inv.gpus.len();
    for i in 0..n {
        create(
            &r.pods,
            &workload_pod(&format!("share-{i}"), &labels, "sleep 3600")?,
        )
        .await?;
    }
    let (placed, waiting) = wait_until("all but one share to run", WAIT, || async {
        let (mut placed, mut pending) = (BTreeMap::new(), Vec::new());
        for i in 0..n {
            let name = format!("share-{i}");
            let p = r.pods.get(&name).await.map_err(|e| e.to_string())?;
            if pod_is_running(&p) {
                placed.insert(name, gpu_of(&p).map_err(|e| e.to_string())?);
            } else {
                pending.push((name, p));
            }
        }
        Ok((placed.len() == n - 1 && pending.len() == 1).then(|| (placed, pending.remove(0))))
    })
    .await?;
    assert!(
        placed.values().all(|g| *g != given),
        "a share was placed on the held GPU {given}: {placed:?}"
    );
    let (waiting_name, waiting_pod) = waiting;
    assert!(
        pod_annotation(&waiting_pod, GPU_UUID).is_none(),
        "{waiting_name} has an allocation but does not run"
    );
    let reason = wait_until("the pending share's reason", WAIT, || async {
        let p = r.pods.get(&waiting_name).await.map_err(|e| e.to_string())?;
        Ok(p.status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .and_then(|c| c.message)
            .filter(|m| m.contains("NVIDIA device plugin")))
    })
    .await?;
    assert!(reason.contains(&holder), "{reason}");

    // The device-plugin pod goes: the GPU returns to the pool and the share runs there.
    r.pods.delete("whole", &DeleteParams::default()).await?;
    let p = running(&r.pods, &waiting_name).await?;
    assert_eq!(gpu_of(&p)?, given);
    let inv = node_inventory(&r.client, &r.node.name).await?;
    assert!(inv.gpus.iter().all(|g| g.held_by.is_none()), "{inv:?}");

    plugin.kill().await?;
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}
