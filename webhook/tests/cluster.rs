//! The webhook against the real control plane (kubeshare-testkit): the real
//! kube-apiserver calls it by URL over TLS with our `caBundle`, using the webhook
//! configuration of `manifests/webhook.yaml` as written (rules, matchConditions,
//! failurePolicy), with only the clientConfig, the name and a namespaceSelector for
//! this test's namespaces changed, so other tests' pods never reach it.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kubeshare_testkit::{Cluster, Identity, TestNamespace, wait_until};
use kubeshare_webhook::review::Mode;
use kubeshare_webhook::server;
use serde_json::{Value, json};

mod cluster_rig;
use cluster_rig::{
    Cleanup, LocalWebhook, labelled_namespace, local_webhook, webhook_by_url, webhook_called,
};

const TEST_LABEL: &str = "kubeshare-webhook-test";
const HOOK: &str = "/kubeshare/lib/libgemhook.so.1";
const WAIT: Duration = Duration::from_secs(60);

async fn label_namespace(client: &kube::Client, ns: &str, labels: Value) -> Result<()> {
    Api::<Namespace>::all(client.clone())
        .patch(
            ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": labels}})),
        )
        .await?;
    Ok(())
}

/// A pod that no node matches: it stays Pending and never reaches a scheduler's
/// extender (filters run first), so it cannot disturb other tests.
fn pod(generate_name: &str, labels: Value, spec: Value) -> Result<Pod> {
    let mut spec = spec;
    spec["nodeSelector"] = json!({TEST_LABEL: "no-such-node"});
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": generate_name, "labels": labels},
        "spec": spec,
    }))?)
}

fn api_error(e: kube::Error) -> Result<(u16, String)> {
    match e {
        kube::Error::Api(s) => Ok((s.code, s.message)),
        other => bail!("expected an API error, got {other}"),
    }
}

fn env_of(pod: &Value, list: &str, i: usize) -> Vec<Value> {
    pod["spec"][list][i]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn env_named<'a>(env: &'a [Value], name: &str) -> Option<&'a Value> {
    env.iter().find(|e| e["name"] == name)
}

/// Every container and init container of a fractional pod carries the env and mounts.
fn assert_injected(pod: &Pod) {
    let v = serde_json::to_value(pod).unwrap();
    assert_eq!(v["spec"]["schedulerName"], "kubeshare-scheduler", "{v}");
    for list in ["initContainers", "containers"] {
        for (i, c) in v["spec"][list]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let env = env_of(&v, list, i);
            assert_eq!(
                env_named(&env, "NVIDIA_VISIBLE_DEVICES").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
                "metadata.annotations['sharedgpu/gpu_uuid']",
                "{list}[{i}]"
            );
            assert_eq!(
                env_named(&env, "KUBESHARE_POD_UID").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
                "metadata.uid"
            );
            let preload = env_named(&env, "LD_PRELOAD").unwrap()["value"]
                .as_str()
                .unwrap();
            assert!(preload.ends_with(HOOK), "{preload}");
            let mounts = c["volumeMounts"].as_array().unwrap();
            assert!(mounts.contains(&json!({"name": "kubeshare-lib", "mountPath": "/kubeshare/lib", "readOnly": true})), "{mounts:?}");
            assert!(mounts.contains(&json!({"name": "kubeshare-run", "mountPath": "/kubeshare/run", "subPathExpr": "$(KUBESHARE_POD_UID)"})), "{mounts:?}");
        }
    }
    let vols = v["spec"]["volumes"].as_array().unwrap();
    assert!(vols.contains(&json!({"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib", "type": "Directory"}})), "{vols:?}");
    assert!(vols.contains(&json!({"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods", "type": "Directory"}})), "{vols:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_apiserver_calls_the_webhook() -> Result<()> {
    server::install_crypto_provider();
    let cluster = Cluster::shared()?;
    let client = cluster.client(Identity::Admin).await?;

    let LocalWebhook {
        dir: _tls,
        files,
        running,
    } = local_webhook(Default::default()).await?;

    let (ns, token) = labelled_namespace(cluster, &client, "webhook", TEST_LABEL).await?;
    let opted_out = TestNamespace::create(cluster, "webhook-optout").await?;
    label_namespace(
        &client,
        opted_out.name(),
        json!({TEST_LABEL: token, "sharedgpu/webhook": "disabled"}),
    )
    .await?;

    let name = format!("kubeshare-webhook-test-{token}");
    let mutating = webhook_by_url(
        &name,
        running.addr.port(),
        &files.ca_bundle(),
        TEST_LABEL,
        &token,
    )?;
    let _guard = Cleanup {
        cluster,
        objects: vec![("mutatingwebhookconfiguration", name)],
    };
    let pp = PostParams::default();
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&pp, &serde_json::from_value(mutating)?)
        .await
        .context("the apiserver refused the MutatingWebhookConfiguration")?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let frac = json!({"app": "t", "sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"});

    // The apiserver picks up a new configuration within a moment: probe with dry runs.
    let probe = pod(
        "probe-",
        frac.clone(),
        json!({"containers": [{"name": "c", "image": "x"}]}),
    )?;
    webhook_called(&pods, &probe).await?;
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };

    // 1. A fractional pod (generateName, init container, two containers, an existing
    //    LD_PRELOAD) is created with everything injected.
    let created = pods
        .create(
            &pp,
            &pod(
                "frac-",
                frac.clone(),
                json!({
                    "initContainers": [{"name": "init", "image": "x"}],
                    "containers": [
                        {"name": "main", "image": "x", "env": [{"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so.2"}]},
                        {"name": "side", "image": "x"}
                    ]
                }),
            )?,
        )
        .await?;
    assert_injected(&created);
    let v = serde_json::to_value(&created)?;
    assert_eq!(
        env_named(&env_of(&v, "containers", 0), "LD_PRELOAD").unwrap()["value"],
        format!("/usr/lib/libjemalloc.so.2:{HOOK}")
    );
    // What the apiserver stored is what it returned.
    let stored = pods
        .get(created.metadata.name.as_deref().unwrap_or_default())
        .await?;
    assert_eq!(serde_json::to_value(&stored)?["spec"], v["spec"]);

    // 2. gpu_request=1.5 is refused at create, with the label, value and rule.
    let bad = pod(
        "bad-",
        json!({"sharedgpu/gpu_request": "1.5", "sharedgpu/gpu_limit": "1.0"}),
        json!({"containers": [{"name": "c", "image": "x"}]}),
    )?;
    let (code, message) = api_error(
        pods.create(&pp, &bad)
            .await
            .expect_err("1.5 must be refused"),
    )?;
    assert_eq!(code, 422, "{message}");
    assert!(
        message.contains("sharedgpu/gpu_request=1.5: a fractional request must be at most 1.0; whole GPUs are written as an integer such as 2"),
        "{message}"
    );
    assert!(message.contains("pods.mutate.kubeshare.io"), "{message}");

    // 3. The pods of a Job (created by the job controller) are mutated.
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train"},
        "spec": {
            "parallelism": 2, "completions": 2, "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"sharedgpu/gpu_request": "0.25", "sharedgpu/gpu_limit": "0.5"}},
                "spec": {"restartPolicy": "Never",
                         "nodeSelector": {TEST_LABEL: "no-such-node"},
                         "containers": [{"name": "main", "image": "x"}]}
            }
        }
    }))?;
    Api::<Job>::namespaced(client.clone(), ns.name())
        .create(&pp, &job)
        .await?;
    let job_pods = wait_until("two pods of job train", WAIT, || {
        let pods = pods.clone();
        async move {
            let l = pods
                .list(&ListParams::default().labels("job-name=train"))
                .await
                .map_err(|e| e.to_string())?;
            Ok((l.items.len() == 2).then_some(l.items))
        }
    })
    .await?;
    for p in &job_pods {
        assert_injected(p);
    }

    // 4. Pods that are not KubeShare pods get no GPU: NVIDIA_VISIBLE_DEVICES=void in
    //    every container, whatever the pod says, through either entry (one that
    //    tolerates every taint goes to the strict one).
    let void = json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"});
    let plain = pods
        .create(
            &pp,
            &pod(
                "plain-",
                json!({"app": "web"}),
                json!({"containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await?;
    let pv = serde_json::to_value(&plain)?;
    assert_eq!(pv["spec"]["schedulerName"], "default-scheduler");
    assert_eq!(pv["spec"]["containers"][0]["env"], json!([void]), "{pv}");
    // (The apiserver's DefaultTolerationSeconds adds NoExecute tolerations; ours is not.)
    assert!(
        !pv["spec"]["tolerations"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|t| t["key"] == "kubeshare.io/gpu"),
        "{pv}"
    );
    let monitor = pods
        .create(
            &pp,
            &pod(
                "monitor-",
                json!({"app": "dcgm"}),
                json!({"tolerations": [{"operator": "Exists"}],
                       "initContainers": [{"name": "i", "image": "x"}],
                       "containers": [{"name": "c", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}),
            )?,
        )
        .await?;
    let mv = serde_json::to_value(&monitor)?;
    assert_eq!(
        mv["spec"]["initContainers"][0]["env"],
        json!([void]),
        "{mv}"
    );
    assert_eq!(mv["spec"]["containers"][0]["env"], json!([void]), "{mv}");
    // A KubeShare pod tolerates the GPU-node taint.
    assert!(
        serde_json::to_value(&created)?["spec"]["tolerations"]
            .as_array()
            .unwrap()
            .contains(&json!({"key": "kubeshare.io/gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}))
    );

    // 5. A namespace labelled sharedgpu/webhook=disabled is not sent to the webhook.
    let out_pods: Api<Pod> = Api::namespaced(client.clone(), opted_out.name());
    let admitted = out_pods.create(&pp, &bad).await?;
    assert!(
        admitted
            .spec
            .and_then(|s| s.containers[0].env.clone())
            .is_none()
    );

    // 5b. KubeShare's own namespace is never sent to the webhook (its node daemon sees
    //     every GPU), even when it carries this test's label.
    label_namespace(&client, "kubeshare-system", json!({TEST_LABEL: token})).await?;
    let own: Api<Pod> = Api::namespaced(client.clone(), "kubeshare-system");
    let own_pod = own
        .create(
            &dry,
            &pod(
                "daemon-",
                json!({"app": "node-daemon"}),
                json!({"containers": [{"name": "c", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}),
            )?,
        )
        .await;
    label_namespace(&client, "kubeshare-system", json!({TEST_LABEL: null})).await?;
    let own_pod = serde_json::to_value(own_pod?)?;
    assert_eq!(
        own_pod["spec"]["containers"][0]["env"],
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
        "{own_pod}"
    );

    // 6. A memory cap that would be 0, or a device-plugin GPU beside the labels, is
    //    refused by the real apiserver's call, with the label and the rule.
    let (code, message) = api_error(
        pods.create(
            &pp,
            &pod(
                "nomem-",
                json!({"sharedgpu/gpu_limit": "0.5"}),
                json!({"containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await
        .expect_err("a zero memory cap must be refused"),
    )?;
    assert_eq!(code, 422, "{message}");
    assert!(
        message.contains("sharedgpu/gpu_limit=0.5: with a gpu_request of 0 and no sharedgpu/gpu_mem, the pod's GPU memory cap would be 0 bytes"),
        "{message}"
    );
    let (_, message) = api_error(
        pods.create(
            &pp,
            &pod(
                "plugin-",
                frac.clone(),
                json!({"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
            )?,
        )
        .await
        .expect_err("nvidia.com/gpu beside sharedgpu labels must be refused"),
    )?;
    assert!(
        message.contains("container \"c\": resources.limits[nvidia.com/gpu]=1: a pod with sharedgpu/* labels gets its GPU from KubeShare"),
        "{message}"
    );
    let (_, message) = api_error(
        pods.create(
            &pp,
            &pod(
                "dot-",
                json!({"sharedgpu/gpu_request": ".5", "sharedgpu/gpu_limit": "1.0"}),
                json!({"containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await
        .expect_err(".5 must be refused"),
    )?;
    assert!(
        message.contains("sharedgpu/gpu_request=.5: must be a decimal between 0.0 and 1.0"),
        "{message}"
    );
    let big = pods
        .create(
            &pp,
            &pod(
                "exa-",
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "sharedgpu/gpu_mem": "1Ei"}),
                json!({"containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await?;
    assert_injected(&big);

    // 7. kubectl debug: pods/ephemeralcontainers UPDATE reaches the webhook; a debug
    //    container of a fractional pod or of any other pod gets no GPU.
    let name = created.metadata.name.clone().unwrap_or_default();
    for (pod_name, what) in [
        (name.clone(), "fractional"),
        (plain.metadata.name.clone().unwrap_or_default(), "plain"),
    ] {
        let patched: Pod = pods
            .patch_subresource(
                "ephemeralcontainers",
                &pod_name,
                &PatchParams::default(),
                &Patch::Strategic(json!({"spec": {"ephemeralContainers": [
                    {"name": "debug", "image": "cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}
                ]}})),
            )
            .await
            .with_context(|| format!("adding a debug container to the {what} pod"))?;
        let v = serde_json::to_value(&patched)?;
        assert_eq!(
            v["spec"]["ephemeralContainers"][0]["env"],
            json!([void]),
            "{what}: {v}"
        );
    }

    // 8. UPDATE: sharedgpu/* labels are not the webhook's business any more (the
    //    admission policy guards them); no UPDATE of the pod itself reaches it.
    let seen = running.stats.total(Mode::Mutate);
    pods.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}}})),
    )
    .await?;
    assert_eq!(running.stats.total(Mode::Mutate), seen);

    // 9. failurePolicy, with the webhook down: a plain pod is still created (the taint
    //    keeps it off GPU nodes), while a KubeShare pod and a pod that tolerates every
    //    taint are refused rather than admitted unmutated.
    running.shutdown(Duration::from_secs(1)).await?;
    let plain2 = pods
        .create(
            &pp,
            &pod(
                "down-plain-",
                json!({"app": "web"}),
                json!({"containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await
        .context("failurePolicy Ignore must admit a pod that cannot reach a GPU node")?;
    assert!(
        serde_json::to_value(&plain2)?["spec"]["containers"][0]
            .get("env")
            .is_none()
    );
    for (what, labels, spec) in [
        (
            "KubeShare pod",
            frac.clone(),
            json!({"containers": [{"name": "c", "image": "x"}]}),
        ),
        (
            "pod tolerating every taint",
            json!({"app": "dcgm"}),
            json!({"tolerations": [{"operator": "Exists"}], "containers": [{"name": "c", "image": "x"}]}),
        ),
        (
            "pod tolerating the GPU taint",
            json!({"app": "x"}),
            json!({"tolerations": [{"key": "kubeshare.io/gpu", "operator": "Exists"}], "containers": [{"name": "c", "image": "x"}]}),
        ),
    ] {
        let err = pods
            .create(&pp, &pod("down-", labels, spec)?)
            .await
            .expect_err(what);
        let (code, message) = api_error(err)?;
        assert!(
            code >= 500 && message.contains("failed calling webhook"),
            "{what}: {code} {message}"
        );
    }
    // A node-critical pod (CNI, CSI) is never held up by the webhook.
    pods.create(
        &pp,
        &pod(
            "down-critical-",
            json!({"app": "cni"}),
            json!({"priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}],
                   "containers": [{"name": "c", "image": "x"}]}),
        )?,
    )
    .await
    .context("a node-critical pod must be admitted while the webhook is down")?;

    // Clean up: pods bound to a node without a kubelet go at once with grace 0.
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete(&name, &now).await?;
    ns.delete().await?;
    opted_out.delete().await?;
    Ok(())
}
