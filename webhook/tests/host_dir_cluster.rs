//! KubeShare's host directory against the real kube-apiserver, as a namespace editor
//! (the rig's `webhook` identity, given the built-in ClusterRole `edit` in this test's
//! namespace): a hostPath that reaches /var/lib/kubeshare is refused by the webhook
//! while it runs and by the ValidatingAdmissionPolicy `kubeshare-host-dir` of
//! manifests/admission-policy.yaml while it is down; a fractional pod as the webhook
//! makes it is admitted; kube-system is not covered.
//!
//! The webhook configuration is manifests/webhook.yaml's, served by URL and limited to
//! this test's namespace (as in cluster.rs). The policy and its binding are the
//! manifest's, renamed, the binding's namespace selector kept as written and an object
//! selector added that matches only this test's pods.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::rbac::v1::RoleBinding;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kubeshare_testkit::{Cluster, Identity, wait_until};
use kubeshare_webhook::server;
use serde_json::{Value, json};

mod cluster_rig;
use cluster_rig::{
    Cleanup, LocalWebhook, labelled_namespace, local_webhook, manifest, webhook_by_url,
};

const WAIT: Duration = Duration::from_secs(60);
const TEST_LABEL: &str = "kubeshare-hostdir-test";
const TENANT: Identity = Identity::Webhook;
const WEBHOOK_SAYS: &str = "reaches /var/lib/kubeshare, KubeShare's host directory, which holds every pod's GPU scheduler socket and config";
const POLICY_SAYS: &str = "reaches /var/lib/kubeshare, KubeShare's host directory, which holds every pod's GPU scheduler socket and config: a pod may not mount it";

/// The host-dir policy and binding, renamed with `token`; the binding also selects
/// only pods labelled `TEST_LABEL=token`.
fn policy(token: &str) -> Result<(Value, Value)> {
    let mut policy = None;
    let mut binding = None;
    for mut doc in manifest("admission-policy.yaml")? {
        if doc["metadata"]["name"] != "kubeshare-host-dir" {
            continue;
        }
        doc["metadata"]["name"] = json!(format!("kubeshare-host-dir-{token}"));
        match doc["kind"].as_str() {
            Some("ValidatingAdmissionPolicy") => policy = Some(doc),
            Some("ValidatingAdmissionPolicyBinding") => {
                doc["spec"]["policyName"] = json!(format!("kubeshare-host-dir-{token}"));
                doc["spec"]["matchResources"]["objectSelector"] =
                    json!({"matchLabels": {TEST_LABEL: token}});
                binding = Some(doc);
            }
            other => bail!("unexpected kind {other:?}"),
        }
    }
    Ok((
        policy.context("no policy kubeshare-host-dir in admission-policy.yaml")?,
        binding.context("no binding kubeshare-host-dir in admission-policy.yaml")?,
    ))
}

/// A pod that no node matches (it stays Pending), labelled for this test's binding.
fn pod(name: &str, token: &str, labels: Value, spec: Value) -> Result<Pod> {
    let mut labels = labels;
    labels[TEST_LABEL] = json!(token);
    let mut spec = spec;
    spec["nodeSelector"] = json!({TEST_LABEL: "no-such-node"});
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }))?)
}

fn host_pod(name: &str, token: &str, path: &str) -> Result<Pod> {
    pod(
        name,
        token,
        json!({"app": "peek"}),
        json!({"containers": [{"name": "c", "image": "x", "volumeMounts": [{"name": "host", "mountPath": "/host"}]}],
               "volumes": [{"name": "host", "hostPath": {"path": path}}]}),
    )
}

fn refusal(r: std::result::Result<Pod, kube::Error>) -> Result<(u16, String)> {
    match r {
        Err(kube::Error::Api(s)) => Ok((s.code, s.message)),
        Err(other) => bail!("expected an API error, got {other}"),
        Ok(p) => bail!("expected a refusal, got pod {:?}", p.metadata.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_editor_cannot_mount_kubeshares_host_directory() -> Result<()> {
    server::install_crypto_provider();
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let (ns, token) = labelled_namespace(cluster, &admin, "hostdir", TEST_LABEL).await?;
    let pp = PostParams::default();
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    // The tenant: the built-in `edit` role in this namespace.
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT.user()}]
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), ns.name())
        .create(&pp, &rb)
        .await?;
    let tenant = cluster.client(TENANT).await?;
    let as_tenant: Api<Pod> = Api::namespaced(tenant.clone(), ns.name());

    // The webhook, by URL with our own CA.
    let LocalWebhook {
        dir: _tls,
        files,
        running,
    } = local_webhook(Default::default()).await?;
    let config = webhook_by_url(
        &format!("kubeshare-hostdir-test-{token}"),
        running.addr.port(),
        &files.ca_bundle(),
        TEST_LABEL,
        &token,
    )?;
    let (vap, vapb) = policy(&token)?;
    let mut cleanup = Cleanup {
        cluster,
        objects: vec![],
    };
    for (kind, doc) in [
        ("mutatingwebhookconfiguration", &config),
        ("validatingadmissionpolicy", &vap),
        ("validatingadmissionpolicybinding", &vapb),
    ] {
        cleanup.objects.push((
            kind,
            doc["metadata"]["name"].as_str().unwrap_or_default().into(),
        ));
    }
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&pp, &serde_json::from_value(config)?)
        .await?;
    Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .create(&pp, &serde_json::from_value(vap)?)
        .await
        .context("the apiserver refused the policy")?;
    Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
        .create(&pp, &serde_json::from_value(vapb)?)
        .await?;

    // 1. With the webhook up, it refuses first (mutating admission runs before the
    //    policies), saying why. Wait until the apiserver calls it.
    let root = host_pod("root", &token, "/")?;
    let message = wait_until("the webhook to refuse a hostPath of /", WAIT, || {
        let (api, p, dry) = (as_tenant.clone(), root.clone(), dry.clone());
        async move {
            match api.create(&dry, &p).await {
                Err(kube::Error::Api(s)) if s.message.contains("denied the request") => {
                    Ok(Some(s.message))
                }
                Ok(_) => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    assert!(
        message.contains(&format!("volume host: hostPath / {WEBHOOK_SAYS}")),
        "{message}"
    );
    for path in [
        "/var/lib//kubeshare/pods/",
        "/var/lib/kubeshare/gpus/GPU-1",
        "/var",
    ] {
        let (code, message) = refusal(as_tenant.create(&pp, &host_pod("p", &token, path)?).await)?;
        assert_eq!(code, 422, "{path}: {message}");
        assert!(message.contains(WEBHOOK_SAYS), "{path}: {message}");
    }
    // A fractional pod, as the webhook makes it (its two volumes), passes the policy too.
    let frac = as_tenant
        .create(
            &pp,
            &pod(
                "frac",
                &token,
                json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"}),
                json!({"initContainers": [{"name": "i", "image": "x"}], "containers": [{"name": "c", "image": "x"}]}),
            )?,
        )
        .await
        .context("a fractional pod must be admitted with the webhook's volumes")?;
    let volumes = serde_json::to_value(&frac.spec)?["volumes"].clone();
    let names: Vec<&str> = volumes
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v.get("hostPath").is_some())
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["kubeshare-lib", "kubeshare-run"], "{volumes}");
    // A debug container may not mount the socket volume (it cannot narrow it).
    let (code, message) = match Api::<Pod>::namespaced(admin.clone(), ns.name())
        .patch_subresource(
            "ephemeralcontainers",
            "frac",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"ephemeralContainers": [
                {"name": "debug", "image": "x", "volumeMounts": [{"name": "kubeshare-run", "mountPath": "/s"}]}
            ]}})),
        )
        .await
    {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        other => bail!("a debug container mounting kubeshare-run must be refused: {other:?}"),
    };
    assert!(code >= 400, "{message}");
    assert!(
        message.contains("volume kubeshare-run holds every pod's GPU scheduler sockets"),
        "{message}"
    );

    // 2. With the webhook down, a plain pod is admitted unmutated (failurePolicy
    //    Ignore for pods that cannot reach a GPU node), but the policy still refuses a
    //    hostPath into the directory, in every spelling.
    running.shutdown(Duration::from_secs(1)).await?;
    let message = wait_until("the policy to refuse a hostPath of /", WAIT, || {
        let (api, p, dry) = (as_tenant.clone(), root.clone(), dry.clone());
        async move {
            match api.create(&dry, &p).await {
                Err(kube::Error::Api(s)) if s.message.contains("ValidatingAdmissionPolicy") => {
                    Ok(Some(s.message))
                }
                Ok(_) => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    assert!(
        message.contains(&format!("hostPath volume host (/) {POLICY_SAYS}")),
        "{message}"
    );
    for path in [
        "/var/lib/kubeshare",
        "/var/lib/kubeshare/",
        "//var/lib/./kubeshare/pods",
        "/var/lib/kubeshare/gpus/GPU-1/resource-config.txt",
        "/var/lib",
    ] {
        let (code, message) = refusal(as_tenant.create(&pp, &host_pod("p", &token, path)?).await)?;
        assert_eq!(code, 403, "{path}: {message}");
        assert!(
            message.contains(&format!("hostPath volume host ({path}) {POLICY_SAYS}")),
            "{path}: {message}"
        );
    }
    // The socket volume copied, mounted whole.
    let copy = |mount: Value, env: Value| {
        pod(
            "copy",
            &token,
            json!({"app": "copy"}),
            json!({"containers": [{"name": "c", "image": "x", "env": env, "volumeMounts": [mount]}],
                   "volumes": [{"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods", "type": "Directory"}}]}),
        )
    };
    let uid_env = json!([{"name": "KUBESHARE_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]);
    let (_, message) = refusal(
        as_tenant
            .create(
                &pp,
                &copy(
                    json!({"name": "kubeshare-run", "mountPath": "/s"}),
                    uid_env.clone(),
                )?,
            )
            .await,
    )?;
    assert!(
        message.contains("containers c mount KubeShare's volumes otherwise than its webhook does"),
        "{message}"
    );
    // ... or narrowed by a UID the pod chose.
    let (_, message) = refusal(
        as_tenant
            .create(
                &pp,
                &copy(
                    json!({"name": "kubeshare-run", "mountPath": "/s", "subPathExpr": "$(KUBESHARE_POD_UID)"}),
                    json!([{"name": "KUBESHARE_POD_UID", "value": "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e01"}]),
                )?,
            )
            .await,
    )?;
    assert!(
        message.contains("containers c mount KubeShare's volumes"),
        "{message}"
    );
    // As the webhook mounts it, the policy admits it; and other host paths are not its business.
    let as_webhook_mounts = copy(
        json!({"name": "kubeshare-run", "mountPath": "/kubeshare/run", "subPathExpr": "$(KUBESHARE_POD_UID)"}),
        uid_env,
    )?;
    as_tenant
        .create(&dry, &as_webhook_mounts)
        .await
        .context("the webhook's own mount must pass the policy")?;
    as_tenant
        .create(&dry, &host_pod("logs", &token, "/var/log")?)
        .await
        .context("a hostPath elsewhere is not this policy's business")?;

    // 3. kube-system is not covered (the binding's namespace selector, as written).
    Api::<Pod>::namespaced(admin.clone(), "kube-system")
        .create(&dry, &host_pod("system", &token, "/var/lib/kubeshare")?)
        .await
        .context("kube-system is exempt")?;

    // 4. Pod Security "baseline" forbids every hostPath, the webhook's own volumes
    //    included: a fractional pod is refused in a namespace that enforces it
    //    (docs/security.md says what to do instead).
    Api::<Namespace>::all(admin.clone())
        .patch(
            ns.name(),
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}),
            ),
        )
        .await?;
    let (code, message) = refusal(as_tenant.create(&dry, &as_webhook_mounts).await)?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(
            "violates PodSecurity \"baseline:latest\": hostPath volumes (volume \"kubeshare-run\")"
        ),
        "{message}"
    );

    drop(cleanup);
    ns.delete().await?;
    Ok(())
}
