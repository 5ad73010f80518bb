//! What the webhook's cluster tests share: removing the cluster-scoped objects a test made,
//! the rendered manifests, the chart's webhook configuration pointed at a test's own server,
//! a test's labelled namespace, and the wait for the apiserver to call the webhook.
// Each test crate uses a part of it.
#![allow(dead_code)]

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kubeshare_testkit::{Cluster, TestNamespace, wait_until};
use serde_json::{Value, json};

/// Deletes the cluster-scoped objects a test made (kind, name), also on panic.
pub struct Cleanup {
    pub cluster: &'static Cluster,
    pub objects: Vec<(&'static str, String)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (kind, name) in &self.objects {
            if let Ok(mut cmd) = self.cluster.kubectl() {
                let _ = cmd
                    .args(["delete", kind, name, "--ignore-not-found", "--wait=false"])
                    .output();
            }
        }
    }
}

/// The documents of `manifests/<file>` (rendered from the chart).
pub fn manifest(file: &str) -> Result<Vec<Value>> {
    let path = format!("{}/../manifests/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).with_context(|| path.clone())?;
    Ok(serde_saphyr::from_multiple(&text)?)
}

/// manifests/webhook.yaml's MutatingWebhookConfiguration, named `name`, pointed at
/// `https://127.0.0.1:port` and limited to namespaces labelled `label=token`.
pub fn webhook_by_url(
    name: &str,
    port: u16,
    ca_bundle: &str,
    label: &str,
    token: &str,
) -> Result<Value> {
    for mut doc in manifest("webhook.yaml")? {
        if doc["kind"] != "MutatingWebhookConfiguration" {
            continue;
        }
        doc["metadata"]["name"] = json!(name);
        for wh in doc["webhooks"].as_array_mut().context("webhooks")? {
            let path = wh["clientConfig"]["service"]["path"]
                .as_str()
                .context("service path")?
                .to_string();
            wh["clientConfig"] = json!({
                "url": format!("https://127.0.0.1:{port}{path}"),
                "caBundle": ca_bundle,
            });
            wh["namespaceSelector"]["matchLabels"] = json!({ label: token });
        }
        return Ok(doc);
    }
    bail!("manifests/webhook.yaml lacks the MutatingWebhookConfiguration")
}

/// A webhook server of this test's own on 127.0.0.1 (a random port), serving a
/// certificate for `localhost` / 127.0.0.1 from a fresh CA, as `kubeshare-webhook certs`
/// makes them. Keep the directory: it holds the certificate the server reloads.
pub struct LocalWebhook {
    pub dir: tempfile::TempDir,
    pub files: kubeshare_webhook::certs::CertFiles,
    pub running: kubeshare_webhook::server::Running,
}

pub async fn local_webhook(admit: kubeshare_webhook::admit::AdmitOptions) -> Result<LocalWebhook> {
    use kubeshare_webhook::certs::{self, CertRequest};
    use kubeshare_webhook::server::{self, ServeConfig};
    server::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let files = certs::generate(
        &CertRequest {
            dns: vec!["localhost".into()],
            ips: vec!["127.0.0.1".parse()?],
            days: 1,
            reuse_ca: false,
        },
        dir.path(),
    )?;
    let running = server::start(ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        cert: files.cert(),
        key: files.key(),
        poll: std::time::Duration::from_secs(5),
        admit,
    })
    .await?;
    Ok(LocalWebhook {
        dir,
        files,
        running,
    })
}

/// A namespace of the test's own, labelled `label: <its name>`, and that name: the token the
/// test's webhook configuration or policy binding selects, so that no other test's pods reach
/// them.
pub async fn labelled_namespace(
    cluster: &Cluster,
    admin: &kube::Client,
    prefix: &str,
    label: &str,
) -> Result<(TestNamespace, String)> {
    let ns = TestNamespace::create(cluster, prefix).await?;
    let token = ns.name().to_string();
    Api::<Namespace>::all(admin.clone())
        .patch(
            &token,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {label: token}}})),
        )
        .await?;
    Ok((ns, token))
}

/// Waits until the apiserver calls the webhook for a pod created in `pods` (it picks up a new
/// configuration within a moment): a dry run of `probe` comes back with KubeShare's scheduler.
pub async fn webhook_called(pods: &Api<Pod>, probe: &Pod) -> Result<()> {
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    wait_until(
        "the apiserver to call the webhook",
        std::time::Duration::from_secs(60),
        || {
            let (pods, probe, dry) = (pods.clone(), probe.clone(), dry.clone());
            async move {
                match pods.create(&dry, &probe).await {
                    Ok(p)
                        if p.spec.as_ref().and_then(|s| s.scheduler_name.as_deref())
                            == Some("kubeshare-scheduler") =>
                    {
                        Ok(Some(()))
                    }
                    Ok(_) => Ok(None),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await?;
    Ok(())
}
