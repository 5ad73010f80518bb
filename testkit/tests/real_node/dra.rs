//! DRA on the real node: a pod claims 0.3 of a GPU with a limit of 0.6 and 2 GiB through a
//! ResourceClaim of `gpu.kubeshare.io`; the stock kube-scheduler places it, the kubelet
//! has the node daemon's kubelet plugin prepare the claim, containerd applies the claim's
//! CDI spec, and inside the container the hook (on the fake libcuda) reaches that GPU's
//! gem-schd and gets the claim's share and memory cap. Deleting the pod unprepares it.
//! Two pods with a claim each split one GPU as labelled pods do (the same measure of GPU
//! time); a third claim waits, Pending, until one of them goes.
//!
//! The rig runs on CDI unless `KUBESHARE_NODE_CDI=0` (containerd with CDI, its spec dir
//! RUN_DIR/node/cdi, the chart's `cdi.enabled` with stand-in device nodes made by
//! hack/deploy.sh); without it the tests say so and check nothing. The chart runs the
//! node daemon without `--dra`: each test turns it on in the DaemonSet (the flags and
//! mounts `dra.enabled` adds) and puts the DaemonSet back afterwards. The claims' specs
//! go to the daemon's `--cdi-spec-dir`, beside its node spec.

use std::path::{Path, PathBuf};

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use kube::api::{Patch, PatchParams};
use kubeshare_api::dra::{ATTR_UUID, COMPUTE, COMPUTE_UNITS, DRIVER_NAME};
use kubeshare_node_daemon::dra::slice::slice_name;

use super::*;

const DAEMONSET: &str = "kubeshare-node-daemon";
const RBAC_NAME: &str = "kubeshare:node-daemon-dra-test";

/// Puts the node daemon's DaemonSet template and the test's DRA objects back however
/// the test ends (with a client of its own: the test's runtime is blocked meanwhile),
/// and waits until the node is as the next tests expect it.
struct Restore {
    kubeconfig: PathBuf,
    node: String,
    template: Value,
}

/// The node daemon's DaemonSet has rolled out: every pod of its latest template ready.
fn rolled_out(ds: &DaemonSet) -> bool {
    let generation = ds.metadata.generation.unwrap_or(0);
    ds.status.as_ref().is_some_and(|s| {
        s.observed_generation.unwrap_or(0) >= generation
            && s.updated_number_scheduled == Some(s.desired_number_scheduled)
            && s.number_ready == s.desired_number_scheduled
            && s.number_unavailable.unwrap_or(0) == 0
    })
}

/// How many `kubeshare.io/gpu` the Node offers, and when the kubelet last reported.
fn offered(
    n: &k8s_openapi::api::core::v1::Node,
) -> (Option<String>, Option<k8s_openapi::jiff::Timestamp>) {
    let s = n.status.as_ref();
    let gpus = s
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get("kubeshare.io/gpu"))
        .map(|q| q.0.clone());
    let beat = s
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .and_then(|c| c.last_heartbeat_time.as_ref())
        .map(|t| t.0);
    (gpus, beat)
}

impl Restore {
    async fn run(kubeconfig: &Path, node: &str, template: Value) {
        let client = match kubeshare_testkit::client_from_kubeconfig(kubeconfig).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("could not put the node daemon's DaemonSet back: {e}");
                return;
            }
        };
        let ds: Api<DaemonSet> = Api::namespaced(client.clone(), KUBESHARE_NS);
        if let Err(e) = set_template(&ds, template).await {
            eprintln!("could not put the node daemon's DaemonSet back: {e}");
        }
        // The restored daemon's device plugin registers anew, and until the kubelet
        // reports its devices healthy it refuses pods asking for them: wait for a
        // report made after the rollout.
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
        let cdi = nodes.get(node).await.map(|n| offered(&n).0.is_some());
        if let Err(e) = wait_for(&ds, DAEMONSET, WAIT, rolled_out).await {
            eprintln!("the node daemon did not roll back: {e}");
        }
        let rolled = k8s_openapi::jiff::Timestamp::now();
        if matches!(cdi, Ok(true))
            && let Err(e) = wait_for(&nodes, node, WAIT, |n| match offered(n) {
                (Some(g), Some(beat)) => g != "0" && beat > rolled,
                _ => false,
            })
            .await
        {
            eprintln!("the node offers no kubeshare.io/gpu after the rollback: {e}");
        }
        let dp = DeleteParams::default();
        let _ = Api::<DeviceClass>::all(client.clone())
            .delete(DRIVER_NAME, &dp)
            .await;
        let _ = Api::<ClusterRoleBinding>::all(client.clone())
            .delete(RBAC_NAME, &dp)
            .await;
        let _ = Api::<ClusterRole>::all(client.clone())
            .delete(RBAC_NAME, &dp)
            .await;
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        let (kubeconfig, node, template) = (
            self.kubeconfig.clone(),
            self.node.clone(),
            self.template.clone(),
        );
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(Restore::run(&kubeconfig, &node, template));
            Ok::<_, std::io::Error>(())
        })
        .join();
    }
}

/// The DeviceClass and the node daemon ServiceAccount's rights that `dra.enabled`
/// installs (charts/kubeshare/templates/dra.yaml).
async fn install_dra(client: &kube::Client) -> Result<()> {
    let pp = PatchParams::apply("kubeshare-real-node-dra").force();
    let dc: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DRIVER_NAME},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER_NAME}\"")}}]},
    }))?;
    Api::<DeviceClass>::all(client.clone())
        .patch(DRIVER_NAME, &pp, &Patch::Apply(&dc))
        .await?;
    let role: ClusterRole = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": RBAC_NAME},
        "rules": [{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
                   "verbs": ["get", "list", "watch", "create", "update", "delete"]},
                  {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
                   "verbs": ["get"]}],
    }))?;
    Api::<ClusterRole>::all(client.clone())
        .patch(RBAC_NAME, &pp, &Patch::Apply(&role))
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": RBAC_NAME},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RBAC_NAME},
        "subjects": [{"kind": "ServiceAccount", "name": DAEMONSET, "namespace": KUBESHARE_NS}],
    }))?;
    Api::<ClusterRoleBinding>::all(client.clone())
        .patch(RBAC_NAME, &pp, &Patch::Apply(&binding))
        .await?;
    Ok(())
}

/// Replaces the DaemonSet's pod template (a merge patch replaces lists whole).
async fn set_template(ds: &Api<DaemonSet>, template: Value) -> Result<()> {
    let patch = json!({"spec": {"template": template}});
    ds.patch(DAEMONSET, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// `template` with `--dra`, its flag and its mounts added to the node daemon's
/// container: the kubelet's plugin directories, at the host's paths.
fn with_dra(mut template: Value) -> Result<Value> {
    let dirs: Vec<(&str, PathBuf)> = vec![
        (
            "dra-registry",
            PathBuf::from("/var/lib/kubelet/plugins_registry"),
        ),
        ("dra-plugins", PathBuf::from("/var/lib/kubelet/plugins")),
    ];
    let spec = &mut template["spec"];
    let c = &mut spec["containers"][0];
    let args = c["args"]
        .as_array_mut()
        .context("the container has no args")?;
    ensure!(
        args.iter()
            .any(|a| a.as_str().is_some_and(|a| a.starts_with("--cdi-spec-dir="))),
        "the node daemon runs without --cdi-spec-dir (the chart's cdi.enabled)"
    );
    args.extend(["--dra", "--kubelet-root-dir=/var/lib/kubelet"].map(Value::from));
    let mounts = c["volumeMounts"]
        .as_array_mut()
        .context("the container has no volumeMounts")?;
    mounts.extend(
        dirs.iter()
            .map(|(name, path)| json!({"name": name, "mountPath": path})),
    );
    let volumes = spec["volumes"]
        .as_array_mut()
        .context("the pod has no volumes")?;
    volumes.extend(dirs.iter().map(|(name, path)| {
        json!({"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}})
    }));
    Ok(template)
}

/// The node's first GPU (lowest index), which the tests' claims pin by their CEL selector.
async fn first_gpu(r: &Rig) -> Result<kubeshare_api::GpuInfo> {
    let inv = daemon::node_inventory(&r.client, &r.node.name).await?;
    inv.gpus
        .into_iter()
        .min_by_key(|g| g.index)
        .context("no GPUs")
}

/// Waits until nothing holds GPU `uuid` in kube-scheduler's books: the node's slice
/// offers all of its compute (an earlier test's label pod may still be terminating on it)
/// and no claim is allocated in the node's pool (an earlier test's claim goes through the
/// garbage collector a moment after its pod). What holds it, while something does, is the
/// last state a timeout reports.
async fn wait_gpu_free(r: &Rig, uuid: &str) -> Result<()> {
    let slices: Api<ResourceSlice> = Api::all(r.client.clone());
    let claims: Api<ResourceClaim> = Api::all(r.client.clone());
    let name = slice_name(&r.node.name);
    let pool = r.node.name.as_str();
    wait_until(
        "the GPU to be free of label pods and claims",
        WAIT,
        || async {
            let slice = slices.get(&name).await.map_err(|e| e.to_string())?;
            let compute = slice
                .spec
                .devices
                .iter()
                .flatten()
                .find(|d| {
                    d.attributes
                        .as_ref()
                        .and_then(|a| a.get(ATTR_UUID))
                        .and_then(|v| v.string.as_deref())
                        == Some(uuid)
                })
                .and_then(|d| d.capacity.as_ref()?.get(COMPUTE))
                .map(|c| c.value.0.clone());
            let held: Vec<String> = claims
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?
                .items
                .into_iter()
                .filter(|c| {
                    kubeshare_testkit::dra::allocated_devices(c.clone())
                        .iter()
                        .any(|d| d.pool == pool)
                })
                .filter_map(|c| c.metadata.name)
                .collect();
            let whole = compute
                .as_deref()
                .and_then(|c| kubeshare_api::parse_bytes(c).ok())
                == Some(u64::from(COMPUTE_UNITS));
            if whole && held.is_empty() {
                Ok(Some(()))
            } else {
                Err(format!(
                    "compute offered {compute:?}, claims allocated {held:?}"
                ))
            }
        },
    )
    .await?;
    Ok(())
}

/// Turns DRA on as `dra.enabled` would: the DeviceClass and RBAC, `--dra` in the node
/// daemon's DaemonSet, until the daemon published the node's slice. The guard puts the
/// DaemonSet back and removes the objects.
async fn enable_dra(r: &Rig) -> Result<Restore> {
    install_dra(&r.client)
        .await
        .context("installing the DRA objects")?;
    let ds: Api<DaemonSet> = Api::namespaced(r.client.clone(), KUBESHARE_NS);
    let before = serde_json::to_value(&ds.get(DAEMONSET).await?)?;
    let restore = Restore {
        kubeconfig: Cluster::shared()?
            .kubeconfig(Identity::Admin)?
            .to_path_buf(),
        node: r.node.name.clone(),
        template: before["spec"]["template"].clone(),
    };
    set_template(&ds, with_dra(before["spec"]["template"].clone())?)
        .await
        .context("turning --dra on in the node daemon's DaemonSet")?;
    // The new daemon runs (its kubelet plugin registered) before any pod asks for a claim: a
    // slice left by an earlier test's daemon may exist already, so the slice alone does not
    // say so.
    wait_for(&ds, DAEMONSET, WAIT, rolled_out)
        .await
        .context("the node daemon with --dra rolling out")?;
    // The new daemon publishes the node's slice.
    let slices: Api<ResourceSlice> = Api::all(r.client.clone());
    let slice = slice_name(&r.node.name);
    wait_for(&slices, &slice, WAIT, |_| true)
        .await
        .context("the node daemon with --dra publishing its slice")?;
    Ok(restore)
}

/// The pod's `PodScheduled=False` reason and message, once the scheduler gave one.
fn unschedulable(p: &Pod) -> Option<(String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| {
            (
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

fn node_of(p: &Pod) -> Option<&str> {
    p.spec.as_ref()?.node_name.as_deref()
}

/// A pod of the default scheduler whose container uses the claim from `template`, on
/// the fake GPU `gpu` (the claim's CEL selector picks the same one).
fn claiming_pod(name: &str, template: &str, gpu: &str, script: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": "kubeshare.io/gpu", "operator": "Exists"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [{
                "name": "main", "image": WORKLOAD_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
                "resources": {"claims": [{"name": "gpu"}]},
                "env": [
                    {"name": "FAKE_CUDA_DEVICES", "value": gpu},
                    {"name": "FAKE_CUDA_SHARED_DIR", "value": "/fake-gpu"},
                    {"name": "FAKE_CUDA_MEM_BYTES", "value": (80u64 << 30).to_string()},
                ],
                "volumeMounts": [{"name": "fake-gpu", "mountPath": "/fake-gpu"}],
            }],
            "volumes": [{"name": "fake-gpu", "hostPath":
                {"path": FAKE_GPU_HOST_DIR, "type": "DirectoryOrCreate"}}],
        },
    }))?)
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn a_claimed_share_reaches_gem_schd_and_the_hook() -> Result<()> {
    let r = rig("rn-dra").await?;
    // hack/node.sh wrote its containerd to node.env: the node runs on CDI.
    if r.node.env("CTRD_BIN").is_none() {
        eprintln!("the node runs without CDI (KUBESHARE_NODE_CDI=0): nothing checked");
        return Ok(());
    }
    let gpu = first_gpu(&r).await?;
    // The spec dir hack/with-cluster.sh deploys the chart with.
    let cdi = r.node.dir.join("cdi");
    let restore = enable_dra(&r).await?;

    // 0.3 of the GPU, bursting to 0.6, with 2 GiB.
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(r.client.clone(), r.ns.name());
    let t: ResourceClaimTemplate = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "burst"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER_NAME,
                "selectors": [{"cel": {"expression":
                    format!("device.attributes[\"{DRIVER_NAME}\"].uuid == \"{}\"", gpu.uuid)}}],
                "capacity": {"requests": {"compute": "300", "memory": "2Gi"}},
            }}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER_NAME, "parameters":
                {"apiVersion": "gpu.kubeshare.io/v1alpha1", "kind": "GpuShareConfig", "limit": "0.6", "priority": "50"}}}],
        }}},
    }))?;
    templates.create(&PostParams::default(), &t).await?;
    let script = "echo LDP=$LD_PRELOAD; echo SOCK=$(ls -A /kubeshare/run | tr '\\n' ' '); \
        cuda-workload meminfo; cuda-workload launch --kernel-us 1000 --count 20; \
        echo DONE; sleep 3600";
    create(
        &r.pods,
        &claiming_pod("claimer", "burst", &gpu.uuid, script)?,
    )
    .await?;
    let pod = running(&r.pods, "claimer").await?;
    let pod_uid = uid(&pod)?;
    let log = wait_for_log(&r.pods, "claimer", "main", "DONE", WAIT).await?;

    // The claim's CDI spec gave the hook and the pod's socket directory; the hook
    // reached the GPU's gem-schd and got the claim's share and memory cap.
    assert_eq!(
        field(&log, "LDP"),
        Some(kubeshare_api::layout::POD_HOOK_LIB),
        "{log}"
    );
    assert_eq!(
        field(&log, "SOCK").map(str::trim),
        Some(format!("{}.sock", gpu.uuid).as_str()),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "connection to gem-schd for {}: request 300 limit 600 (milli), memory cap 2147483648 bytes",
            gpu.uuid
        )),
        "{log}"
    );
    let out = json_lines(&log);
    assert_eq!(
        out.first().map(|v| v["total"].clone()),
        Some(json!(2u64 << 30)),
        "{log}"
    );
    assert!(out.iter().any(|v| v["kernels"] == json!(20)), "{log}");
    // Priority 50: guaranteed, the class column left out as for a label pod.
    let line = format!("{pod_uid} 0.3 0.6 2147483648");
    let config = r.node.resource_config(&gpu.uuid).unwrap_or_default();
    assert!(config.lines().any(|l| l == line), "{config}");

    // The pod goes: the kubelet unprepares the claim, and its line and spec go.
    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    wait_until("the claim's line to leave the config", WAIT, || async {
        let c = r.node.resource_config(&gpu.uuid).unwrap_or_default();
        Ok::<_, String>((!c.contains(&pod_uid)).then_some(()))
    })
    .await?;
    let specs: Vec<String> = std::fs::read_dir(&cdi)?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("kubeshare.io-claim_"))
        .collect();
    assert!(specs.is_empty(), "{specs:?}");
    drop(restore);
    r.ns.delete().await?;
    Ok(())
}

#[tokio::test]
#[ignore = "needs the real node: make node-test"]
async fn two_claims_split_one_gpu_and_a_third_waits_for_room() -> Result<()> {
    let r = rig("rn-dra-share").await?;
    if r.node.env("CTRD_BIN").is_none() {
        eprintln!("the node runs without CDI (KUBESHARE_NODE_CDI=0): nothing checked");
        return Ok(());
    }
    let gpu = first_gpu(&r).await?;
    let restore = enable_dra(&r).await?;
    // 0.3 and 0.7 fill the GPU: nothing may hold any of it.
    wait_gpu_free(&r, &gpu.uuid).await?;

    // Two pods, each with its own claim on the one GPU: 0.3 and 0.7 of it, fixed shares.
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(r.client.clone(), r.ns.name());
    for (name, compute) in [("c30", "300"), ("c70", "700"), ("c30b", "300")] {
        templates
            .create(
                &PostParams::default(),
                &kubeshare_testkit::dra::share_claim_template(name, &gpu.uuid, compute, "2Gi")?,
            )
            .await?;
    }
    let go = format!("go-{}", unique());
    let script = share_script(&go);
    // One after the other: this test is about the split, not about kube-scheduler's
    // moment of counting a claim twice (docs/dra.md, "Two claims that fill a GPU at
    // once"), which node-daemon/tests/dra.rs covers.
    create(&r.pods, &claiming_pod("p30", "c30", &gpu.uuid, &script)?).await?;
    let p30 = running(&r.pods, "p30").await?;
    create(&r.pods, &claiming_pod("p70", "c70", &gpu.uuid, &script)?).await?;
    let p70 = running(&r.pods, "p70").await?;
    // Both claims are prepared: the GPU's config holds a fixed-share line for each pod
    // (opportunistic: their configs give no priority, as a pod without the label).
    let config = r.node.resource_config(&gpu.uuid).unwrap_or_default();
    for (pod, share) in [(&p30, "0.3"), (&p70, "0.7")] {
        let line = format!("{} {share} {share} 2147483648 opportunistic", uid(pod)?);
        assert!(config.lines().any(|l| l == line), "{line} not in {config}");
    }
    release_barrier(&r.node, &go)?;
    gpu_time_split(&r.pods, &[("p30", 0.3), ("p70", 0.7)]).await?;

    // A third claim of 0.3 does not fit beside them (1000 of 1000 booked): its pod stays
    // Pending with the scheduler's reason.
    create(
        &r.pods,
        &claiming_pod("late", "c30b", &gpu.uuid, "echo UP; sleep 3600")?,
    )
    .await?;
    let late = wait_for(&r.pods, "late", WAIT, |p| unschedulable(p).is_some()).await?;
    let (reason, message) = unschedulable(&late).unwrap_or_default();
    eprintln!("real node: the third claim's pod pending: {reason}: {message}");
    assert_eq!(reason, "Unschedulable", "{message}");
    assert!(
        message.contains("cannot allocate all claims"),
        "the reason names the claims: {message}"
    );
    assert_eq!(node_of(&late), None);

    // Deleting the 0.3 pod frees its share: the pending pod is placed, its claim prepared.
    let p30_uid = uid(&p30)?;
    r.pods
        .delete(
            "p30",
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..Default::default()
            },
        )
        .await?;
    let late = running(&r.pods, "late").await?;
    assert_eq!(node_of(&late), Some(r.node.name.as_str()));
    let line = format!("{} 0.3 0.3 2147483648 opportunistic", uid(&late)?);
    wait_until("the late pod's line in the GPU's config", WAIT, || async {
        let c = r.node.resource_config(&gpu.uuid).unwrap_or_default();
        Ok::<_, String>((c.lines().any(|l| l == line) && !c.contains(&p30_uid)).then_some(()))
    })
    .await?;

    delete_pods_and_wait(&r.pods, "", WAIT).await?;
    drop(restore);
    r.ns.delete().await?;
    Ok(())
}
