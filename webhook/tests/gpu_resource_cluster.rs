//! `--gpu-resource kubeshare.io/gpu` against the real control plane: the apiserver calls
//! the webhook (manifests/webhook.yaml's configuration, pointed at this test's server,
//! limited to this test's namespace), stores a GPU pod whose every container asks for
//! one `kubeshare.io/gpu` in its limits and requests (the apiserver's own validation of
//! extended resources accepts what the webhook writes), and refuses a plain pod that
//! asks for it.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use kubeshare_testkit::{Cluster, Identity};
use kubeshare_webhook::admit::AdmitOptions;
use kubeshare_webhook::server;
use serde_json::{Value, json};

mod cluster_rig;
use cluster_rig::{
    Cleanup, LocalWebhook, labelled_namespace, local_webhook, webhook_by_url, webhook_called,
};

const TEST_LABEL: &str = "kubeshare-webhook-gpu-resource-test";
const R: &str = "kubeshare.io/gpu";

/// A pod that no node matches: it stays Pending and reaches no scheduler's extender.
fn pod(name: &str, labels: Value, spec: Value) -> Result<Pod> {
    let mut spec = spec;
    spec["nodeSelector"] = json!({TEST_LABEL: "no-such-node"});
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiserver_stores_the_gpu_resource_the_webhook_asks_for() -> Result<()> {
    server::install_crypto_provider();
    let cluster = Cluster::shared()?;
    let client = cluster.client(Identity::Admin).await?;
    let LocalWebhook {
        dir: _tls,
        files,
        running,
    } = local_webhook(AdmitOptions {
        gpu_resource: Some(R.into()),
    })
    .await?;

    let (ns, token) = labelled_namespace(cluster, &client, "webhook-gpu-res", TEST_LABEL).await?;
    let name = format!("kubeshare-webhook-gpu-resource-{token}");
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
    Api::<MutatingWebhookConfiguration>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(mutating)?)
        .await
        .context("the apiserver refused the MutatingWebhookConfiguration")?;

    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let frac = json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"});
    let gpu_pod = pod(
        "gpu",
        frac,
        json!({"initContainers": [{"name": "init", "image": "x"}],
               "containers": [{"name": "main", "image": "x", "resources": {"limits": {"cpu": "1"}}},
                              {"name": "side", "image": "x"}]}),
    )?;
    // Created once the apiserver calls the webhook for it.
    webhook_called(&pods, &gpu_pod).await?;

    let stored = serde_json::to_value(pods.create(&PostParams::default(), &gpu_pod).await?)?;
    for (list, i) in [("initContainers", 0), ("containers", 0), ("containers", 1)] {
        let r = &stored["spec"][list][i]["resources"];
        assert_eq!(r["limits"][R], "1", "{list}[{i}]: {r}");
        assert_eq!(r["requests"][R], "1", "{list}[{i}]: {r}");
    }
    assert_eq!(
        stored["spec"]["containers"][0]["resources"]["limits"]["cpu"],
        "1"
    );

    let plain = pod(
        "plain",
        json!({"app": "web"}),
        json!({"containers": [{"name": "a", "image": "x", "resources": {"limits": {R: "1"}}}]}),
    )?;
    match pods.create(&PostParams::default(), &plain).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            assert!(
                s.message
                    .contains("resource kubeshare.io/gpu is given by KubeShare"),
                "{}",
                s.message
            );
        }
        Ok(_) => bail!("a plain pod asking for {R} was admitted"),
        Err(e) => bail!("expected an API error, got {e}"),
    }
    running.shutdown(Duration::from_secs(1)).await?;
    ns.delete().await?;
    Ok(())
}
