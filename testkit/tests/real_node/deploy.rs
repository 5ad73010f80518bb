//! What is deployed and admitted on the real node: a group Job runs to completion and bad
//! labels are refused; a plain pod gets no GPU; KubeShare runs as its manifests deploy it,
//! through the one script the kind demo uses too.

use super::*;

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn group_job_runs_to_completion_and_bad_labels_are_refused() -> Result<()> {
    let r = rig("rn-job").await?;
    let template = workload_pod(
        "unused",
        &[
            ("sharedgpu/gpu_request", "0.2"),
            ("sharedgpu/gpu_limit", "0.2"),
            ("sharedgpu/group_name", "allreduce"),
            ("sharedgpu/group_headcount", "3"),
            ("sharedgpu/group_threshold", "1.0"),
        ],
        "cuda-workload launch --kernel-us 1000 --count 50",
    )?;
    let mut tpl = serde_json::to_value(&template)?;
    if let Some(m) = tpl["metadata"].as_object_mut() {
        m.remove("name");
    }
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "allreduce"},
        "spec": {"parallelism": 3, "completions": 3, "backoffLimit": 0, "template": tpl},
    }))?;
    let jobs: Api<Job> = Api::namespaced(r.client.clone(), r.ns.name());
    jobs.create(&PostParams::default(), &job).await?;
    let done = wait_for(&jobs, "allreduce", WAIT, |j: &Job| {
        j.status
            .as_ref()
            .is_some_and(|s| s.succeeded == Some(3) || s.failed.unwrap_or(0) > 0)
    })
    .await?;
    let st = done.status.context("no job status")?;
    assert_eq!(st.succeeded, Some(3), "{st:?}");
    // Each worker ran on the GPU its record names, through the hook.
    let workers = r
        .pods
        .list(&ListParams::default().labels("job-name=allreduce"))
        .await?;
    assert_eq!(workers.items.len(), 3);
    for p in &workers.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        let gpu = gpu_of(p)?;
        let log = pod_logs(&r.pods, &name, "main").await?;
        assert!(
            log.contains(&format!("connection to gem-schd for {gpu}")),
            "{name}: {log}"
        );
        assert_eq!(
            json_lines(&log).first().map(|v| v["kernels"].clone()),
            Some(json!(50))
        );
    }

    // request above limit: the webhook refuses the pod at creation.
    let bad = workload_pod(
        "greedy",
        &[
            ("sharedgpu/gpu_request", "0.8"),
            ("sharedgpu/gpu_limit", "0.5"),
        ],
        "true",
    )?;
    match r.pods.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => {
            assert!(s.code >= 400 && s.code < 500, "{s:?}");
            assert!(
                s.message.contains("gpu_request") || s.message.contains("gpu_limit"),
                "{s:?}"
            );
        }
        Ok(_) => bail!("a pod with request 0.8 > limit 0.5 was admitted"),
        Err(e) => bail!("unexpected error: {e}"),
    }
    jobs.delete("allreduce", &DeleteParams::background())
        .await?;
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn a_pod_that_is_not_a_kubeshare_pod_gets_no_gpu() -> Result<()> {
    // The image sets NVIDIA_VISIBLE_DEVICES=all (as CUDA images do); the pod asks for
    // no share and tolerates every taint, so it lands on the GPU node. Under the
    // NVIDIA runtime, `all` would give it every GPU: admission must override it.
    let r = rig("rn-nogpu").await?;
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"operator": "Exists"}],
            "nodeSelector": {"kubernetes.io/hostname": r.node.name},
            "initContainers": [{"name": "init", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", format!("echo NVD=$NVIDIA_VISIBLE_DEVICES; {LIST_DEVS}")]}],
            "containers": [{"name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", format!("echo NVD=$NVIDIA_VISIBLE_DEVICES; {LIST_DEVS}; echo DONE; sleep 3600")]}],
        }
    }))?;
    create(&r.pods, &pod).await?;
    running(&r.pods, "plain").await?;
    let log = wait_for_log(&r.pods, "plain", "main", "DONE", WAIT).await?;
    assert_eq!(field(&log, "NVD"), Some("void"), "main: {log}");
    let init = pod_logs(&r.pods, "plain", "init").await?;
    assert_eq!(field(&init, "NVD"), Some("void"), "init: {init}");
    // No GPU device node either: it asks for no kubeshare.io/gpu, so the runtime is
    // handed no CDI device (the stand-in nodes exist on the node).
    assert_eq!(devs(&log), Vec::<String>::new(), "main: {log}");
    assert_eq!(devs(&init), Vec::<String>::new(), "init: {init}");
    let asks = |c: &k8s_openapi::api::core::v1::Container| {
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.contains_key(kubeshare_node_daemon::cdi::select::RESOURCE))
    };
    let admitted = r.pods.get("plain").await?.spec.context("no spec")?;
    assert!(
        !admitted
            .containers
            .iter()
            .chain(admitted.init_containers.iter().flatten())
            .any(asks)
    );
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    r.ns.delete().await?;
    Ok(())
}

/// The images manifests/ names, per workload kind and name (manifests/ is the
/// chart rendered, so the Helm release must run the same ones).
fn manifest_images() -> Result<Vec<String>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let mut out = vec![];
    for f in ["kube-scheduler.yaml", "webhook.yaml", "node-daemon.yaml"] {
        let text = std::fs::read_to_string(dir.join(f))?;
        out.extend(
            text.lines()
                .filter_map(|l| l.trim().strip_prefix("image:"))
                .map(|s| s.trim().to_string()),
        );
    }
    Ok(out)
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn kubeshare_runs_on_the_node_as_the_manifests_deploy_it() -> Result<()> {
    let node = RealNode::from_env()?;
    let client = Cluster::shared()?.client(Identity::Admin).await?;
    let want = manifest_images()?;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), KUBESHARE_NS);
    let dss: Api<DaemonSet> = Api::namespaced(client.clone(), KUBESHARE_NS);
    let mut running_images = vec![];
    for d in ["kubeshare-scheduler", "kubeshare-webhook"] {
        let dep = deps.get(d).await?;
        // Installed by `helm upgrade --install` (hack/deploy.sh), not by kubectl.
        let release = dep
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("meta.helm.sh/release-name"));
        assert_eq!(release.map(String::as_str), Some("kubeshare"), "{d}");
        let spec = dep.spec.context("no spec")?;
        running_images.extend(
            spec.template
                .spec
                .context("no pod spec")?
                .containers
                .into_iter()
                .filter_map(|c| c.image),
        );
        let st = dep.status.context("no status")?;
        assert_eq!(st.ready_replicas, spec.replicas, "{d}");
    }
    let ds = dss.get("kubeshare-node-daemon").await?;
    running_images.extend(
        ds.spec
            .context("no spec")?
            .template
            .spec
            .context("no pod spec")?
            .containers
            .into_iter()
            .filter_map(|c| c.image),
    );
    running_images.sort();
    // The rig may run another Kubernetes version (K8S_VERSION): the scheduler image
    // then follows it, as a user matches it to the cluster.
    let mut want_sorted: Vec<String> = match std::env::var("K8S_VERSION") {
        Ok(v) if !v.is_empty() => want
            .iter()
            .map(|i| {
                if i.starts_with("registry.k8s.io/kube-scheduler:") {
                    format!("registry.k8s.io/kube-scheduler:{v}")
                } else {
                    i.clone()
                }
            })
            .collect(),
        _ => want.clone(),
    };
    want_sorted.sort();
    assert_eq!(
        running_images, want_sorted,
        "the rig runs the images manifests/ names"
    );
    // Every KubeShare pod runs on the real node.
    let pods: Api<Pod> = Api::namespaced(client.clone(), KUBESHARE_NS);
    for p in pods.list(&ListParams::default()).await?.items {
        let on = p.spec.as_ref().and_then(|s| s.node_name.clone());
        assert_eq!(
            on.as_deref(),
            Some(node.name.as_str()),
            "{:?}",
            p.metadata.name
        );
    }
    Ok(())
}

#[test]
fn kind_demo_and_the_node_rig_deploy_through_one_script() -> Result<()> {
    let hack = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack");
    for f in ["kind-demo.sh", "with-cluster.sh"] {
        let text = std::fs::read_to_string(hack.join(f))?;
        assert!(
            text.contains("\"$HACK/deploy.sh\""),
            "{f} does not run hack/deploy.sh"
        );
        // Neither applies a KubeShare manifest of its own (deploy.sh does).
        for m in ["webhook.yaml", "kube-scheduler.yaml", "node-daemon.yaml"] {
            assert!(!text.contains(m), "{f} applies manifests/{m} itself");
        }
    }
    Ok(())
}
