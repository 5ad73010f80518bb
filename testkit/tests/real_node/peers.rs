//! A pod that reaches another pod's gem-schd socket, on the real node: a process of an
//! admin's pod in `kube-system` (outside the webhook and the host-directory policy, as a
//! node agent would be) mounts the node's KubeShare directory and preloads the hook
//! against a tenant pod's socket. gem-schd's peer check (on where the node daemon starts it)
//! refuses it by its cgroup, and the node daemon reports it on both pods; the tenant pod's
//! own process is served.

use super::*;
use k8s_openapi::api::core::v1::Event;

/// Reasons of the Events on the object with `uid` in `ns`.
async fn reasons(client: &kube::Client, ns: &str, uid: &str) -> Result<Vec<(String, String)>> {
    let api: Api<Event> = Api::namespaced(client.clone(), ns);
    let l = api
        .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
        .await?;
    Ok(l.items
        .into_iter()
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect())
}

/// An admin's pod on `node` that preloads the hook from the node's KubeShare directory
/// and points it at `victim`'s socket directory, for GPU `gpu`.
fn intruder(name: &str, node: &str, victim: &str, gpu: &str) -> Result<Pod> {
    let root = kubeshare_api::layout::DEFAULT_ROOT;
    let layout = kubeshare_api::layout::Layout::new("/host-kubeshare");
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{
                "name": "main",
                "image": WORKLOAD_IMAGE,
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c",
                    "cuda-workload launch --kernel-us 1000 --count 5; echo EXIT=$?; sleep 3600"],
                "env": [
                    {"name": "LD_PRELOAD", "value": layout.hook_lib().display().to_string()},
                    {"name": "KUBESHARE_SOCKET_DIR",
                     "value": layout.pod_dir(victim).display().to_string()},
                    {"name": "KUBESHARE_ON_UNREACHABLE", "value": "run"},
                    {"name": "FAKE_CUDA_DEVICES", "value": gpu},
                    {"name": "FAKE_CUDA_SHARED_DIR", "value": "/fake-gpu"},
                    {"name": "FAKE_CUDA_MEM_BYTES", "value": (80u64 << 30).to_string()},
                ],
                "volumeMounts": [
                    {"name": "kubeshare", "mountPath": "/host-kubeshare"},
                    {"name": "fake-gpu", "mountPath": "/fake-gpu"},
                ],
            }],
            "volumes": [
                {"name": "kubeshare", "hostPath": {"path": root, "type": "Directory"}},
                {"name": "fake-gpu", "hostPath":
                    {"path": FAKE_GPU_HOST_DIR, "type": "DirectoryOrCreate"}},
            ],
        }
    }))?)
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn a_pod_cannot_use_another_pods_socket() -> Result<()> {
    let r = rig("rn-peers").await?;
    let labels = [
        ("sharedgpu/gpu_request", "0.2"),
        ("sharedgpu/gpu_limit", "0.2"),
    ];
    let script = "cuda-workload launch --kernel-us 1000 --seconds 600; echo DONE; sleep 3600";
    create(&r.pods, &workload_pod("victim", &labels, script)?).await?;
    let victim = running(&r.pods, "victim").await?;
    let (victim_uid, gpu) = (uid(&victim)?, gpu_of(&victim)?);
    // Its own process is served (the hook logs its share).
    wait_for_log(
        &r.pods,
        "victim",
        "main",
        &format!("connection to gem-schd for {gpu}"),
        WAIT,
    )
    .await?;

    let system: Api<Pod> = Api::namespaced(r.client.clone(), "kube-system");
    let name = format!("rn-intruder-{}", unique());
    system
        .create(
            &PostParams::default(),
            &intruder(&name, &r.node.name, &victim_uid, &gpu)?,
        )
        .await?;
    let intruder_pod = wait_for(&system, &name, WAIT, |p: &Pod| pod_is_running(p)).await?;
    let intruder_uid = uid(&intruder_pod)?;

    let ns = r.ns.name().to_string();
    let (reason, note) = wait_until("a GpuSocketPeerRefused event on the victim", WAIT, || {
        let (client, ns, uid) = (r.client.clone(), ns.clone(), victim_uid.clone());
        async move {
            let ev = reasons(&client, &ns, &uid)
                .await
                .map_err(|e| e.to_string())?;
            Ok(ev.into_iter().find(|(r, _)| r == "GpuSocketPeerRefused"))
        }
    })
    .await?;
    eprintln!("real node: {reason}: {note}");
    ensure!(
        note.contains(&intruder_uid) || note.contains(&name),
        "{note}"
    );
    let on_intruder = wait_until(
        "a GpuSocketOfAnotherPod event on the intruder",
        WAIT,
        || {
            let (client, uid) = (r.client.clone(), intruder_uid.clone());
            async move {
                let ev = reasons(&client, "kube-system", &uid)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(ev.into_iter().find(|(r, _)| r == "GpuSocketOfAnotherPod"))
            }
        },
    )
    .await?;
    eprintln!("real node: {}: {}", on_intruder.0, on_intruder.1);
    // The victim keeps its share: still running, its own connection never refused.
    let log = pod_logs(&r.pods, "victim", "main").await?;
    ensure!(!log.contains("refused"), "{log}");
    ensure!(
        pod_is_running(&r.pods.get("victim").await?),
        "the victim stopped"
    );

    system.delete(&name, &DeleteParams::default()).await?;
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}
