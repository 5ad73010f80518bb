//! The control plane's and the node's readiness, the chart's install (its rendered YAML,
//! applied server-side as `helm install` would create it) and a status dump for failures.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, ServiceAccount};
use kube::api::{DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Discovery, Scope};
use kube::{Api, Client, ResourceExt};
use kubeshare_testkit::{node_is_ready, wait_until};
use serde_json::Value;

/// What `helm install` of the chart is, here: one field manager for every object.
const FIELD_MANAGER: &str = "kubeshare-gpu-node";

#[derive(clap::Args)]
pub struct DeployArgs {
    /// Multi-document YAML files (the rendered chart, extra objects), applied in order.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The GPU node whose `sharedgpu/inventory` the node daemon must publish.
    #[arg(long)]
    node: String,
    /// KubeShare's namespace (the chart's release namespace).
    #[arg(long, default_value = "kubeshare-system")]
    namespace: String,
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
}

pub async fn wait_api(client: &Client, timeout: Duration, apiserver_only: bool) -> Result<()> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    wait_until(
        "the apiserver and the default ServiceAccount",
        timeout,
        || {
            let (client, sas) = (client.clone(), sas.clone());
            async move {
                // /readyz: every post-start hook done (RBAC's bootstrap roles among them).
                let req = http::Request::get("/readyz")
                    .body(Vec::new())
                    .map_err(|e| e.to_string())?;
                let ready = client
                    .request_text(req)
                    .await
                    .map_err(|e| format!("apiserver: {e}"))?;
                if ready.trim() != "ok" {
                    return Err(format!("/readyz: {ready}"));
                }
                if apiserver_only {
                    return Ok(Some(()));
                }
                match sas.get_opt("default").await {
                    Ok(Some(_)) => Ok(Some(())),
                    Ok(None) => Err("no default ServiceAccount yet".into()),
                    Err(e) => Err(e.to_string()),
                }
            }
        },
    )
    .await?;
    if !apiserver_only {
        eprintln!("gpu-scenarios: apiserver ready, controllers running");
    }
    Ok(())
}

pub async fn wait_node(client: &Client, name: &str, timeout: Duration) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    wait_until(&format!("Node {name} Ready"), timeout, || {
        let nodes = nodes.clone();
        async move {
            match nodes.get_opt(name).await {
                Ok(Some(n)) if node_is_ready(&n) => Ok(Some(())),
                Ok(Some(n)) => Err(format!(
                    "conditions {:?}",
                    n.status.and_then(|s| s.conditions)
                )),
                Ok(None) => Err("not registered".into()),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    eprintln!("gpu-scenarios: node {name} Ready");
    Ok(())
}

/// The documents of the files, Namespaces first (the rest keep their order).
fn documents(files: &[PathBuf]) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for f in files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let parsed: Vec<Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("parsing {}", f.display()))?;
        docs.extend(parsed.into_iter().filter(|d| d.is_object()));
    }
    Ok(order_for_apply(docs))
}

/// Namespaces before everything else; otherwise the files' order.
fn order_for_apply(docs: Vec<Value>) -> Vec<Value> {
    let (mut first, rest): (Vec<Value>, Vec<Value>) =
        docs.into_iter().partition(|d| d["kind"] == "Namespace");
    first.extend(rest);
    first
}

fn gvk_of(doc: &Value) -> Result<GroupVersionKind> {
    let api_version = doc["apiVersion"].as_str().context("no apiVersion")?;
    let kind = doc["kind"].as_str().context("no kind")?;
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    Ok(GroupVersionKind::gvk(group, version, kind))
}

async fn apply_all(client: &Client, docs: &[Value], default_ns: &str) -> Result<()> {
    let discovery = Discovery::new(client.clone()).run().await?;
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    for doc in docs {
        let gvk = gvk_of(doc)?;
        let name = doc["metadata"]["name"]
            .as_str()
            .with_context(|| format!("a {} without a name", gvk.kind))?;
        let (ar, caps) = discovery
            .resolve_gvk(&gvk)
            .ok_or_else(|| anyhow!("the apiserver does not serve {gvk:?}"))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => {
                let ns = doc["metadata"]["namespace"].as_str().unwrap_or(default_ns);
                Api::namespaced_with(client.clone(), ns, &ar)
            }
            Scope::Cluster => Api::all_with(client.clone(), &ar),
        };
        api.patch(name, &pp, &Patch::Apply(doc))
            .await
            .with_context(|| format!("applying {} {name}", gvk.kind))?;
    }
    eprintln!("gpu-scenarios: applied {} objects", docs.len());
    Ok(())
}

pub async fn deploy(client: &Client, args: &DeployArgs) -> Result<()> {
    let docs = documents(&args.files)?;
    apply_all(client, &docs, &args.namespace).await?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let ns = args.namespace.as_str();
    let result = wait_rolled_out(client, ns, &args.node, timeout).await;
    if result.is_err() {
        status(client).await.ok();
    }
    result
}

async fn wait_rolled_out(client: &Client, ns: &str, node: &str, timeout: Duration) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    for name in ["kubeshare-webhook", "kubeshare-scheduler"] {
        kubeshare_testkit::wait_for(&deployments, name, timeout, |d: &Deployment| {
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            d.status.as_ref().is_some_and(|s| {
                s.ready_replicas == Some(want)
                    && s.updated_replicas == Some(want)
                    && s.replicas == Some(want)
            })
        })
        .await?;
        eprintln!("gpu-scenarios: deployment {name} rolled out");
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
    kubeshare_testkit::wait_for(
        &daemonsets,
        "kubeshare-node-daemon",
        timeout,
        |d: &DaemonSet| {
            d.status.as_ref().is_some_and(|s| {
                s.desired_number_scheduled > 0 && s.number_ready == s.desired_number_scheduled
            })
        },
    )
    .await?;
    eprintln!("gpu-scenarios: daemonset kubeshare-node-daemon ready");
    // The scheduler pods' kube-schedulers elect a leader; until one holds the Lease no
    // GPU pod is placed.
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    kubeshare_testkit::wait_for(&leases, "kubeshare-scheduler", timeout, |l: &Lease| {
        l.spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            .is_some_and(|h| !h.is_empty())
    })
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let n = kubeshare_testkit::wait_for(&nodes, node, timeout, |n: &Node| {
        n.annotations()
            .get("sharedgpu/inventory")
            .is_some_and(|v| !v.is_empty())
    })
    .await?;
    eprintln!(
        "gpu-scenarios: KubeShare is up; {node} sharedgpu/inventory = {}",
        n.annotations()["sharedgpu/inventory"]
    );
    Ok(())
}

/// Pods, Nodes and the latest warning Events, for the log of a failed run.
pub async fn status(client: &Client) -> Result<()> {
    let pods: Api<Pod> = Api::all(client.clone());
    for p in pods.list(&ListParams::default()).await? {
        let st = p.status.clone().unwrap_or_default();
        let containers: Vec<String> = st
            .container_statuses
            .unwrap_or_default()
            .iter()
            .map(|c| {
                let state = c.state.as_ref().map_or(String::from("?"), |s| {
                    if let Some(w) = &s.waiting {
                        format!("waiting:{}", w.reason.clone().unwrap_or_default())
                    } else if let Some(t) = &s.terminated {
                        format!(
                            "terminated:{}:{}",
                            t.reason.clone().unwrap_or_default(),
                            t.exit_code
                        )
                    } else {
                        "running".into()
                    }
                });
                format!(
                    "{}={state},ready={},restarts={}",
                    c.name, c.ready, c.restart_count
                )
            })
            .collect();
        println!(
            "pod {}/{} phase={} node={} {}",
            p.namespace().unwrap_or_default(),
            p.name_any(),
            st.phase.unwrap_or_default(),
            p.spec.and_then(|s| s.node_name).unwrap_or_default(),
            containers.join(" ")
        );
    }
    let nodes: Api<Node> = Api::all(client.clone());
    for n in nodes.list(&ListParams::default()).await? {
        let taints: Vec<String> = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .iter()
            .map(|t| {
                format!(
                    "{}={}:{}",
                    t.key,
                    t.value.clone().unwrap_or_default(),
                    t.effect
                )
            })
            .collect();
        println!(
            "node {} ready={} taints={taints:?} inventory={}",
            n.name_any(),
            node_is_ready(&n),
            n.annotations()
                .get("sharedgpu/inventory")
                .cloned()
                .unwrap_or_default()
        );
    }
    let events: Api<Event> = Api::all(client.clone());
    let mut warnings: Vec<Event> = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .collect();
    warnings.sort_by_key(|e| e.last_timestamp.clone().map(|t| t.0));
    for e in warnings.iter().rev().take(30).rev() {
        println!(
            "event {}/{} {}: {}",
            e.involved_object.namespace.clone().unwrap_or_default(),
            e.involved_object.name.clone().unwrap_or_default(),
            e.reason.clone().unwrap_or_default(),
            e.message.clone().unwrap_or_default()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn namespaces_are_applied_first_and_the_rest_keep_their_order() {
        let docs = vec![
            json!({"kind": "ServiceAccount", "metadata": {"name": "a"}}),
            json!({"kind": "Namespace", "metadata": {"name": "ns"}}),
            json!({"kind": "Deployment", "metadata": {"name": "b"}}),
        ];
        let ordered = order_for_apply(docs);
        let names: Vec<&str> = ordered
            .iter()
            .map(|d| d["metadata"]["name"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(names, ["ns", "a", "b"]);
    }

    #[test]
    fn group_and_version_come_from_api_version() {
        let g = gvk_of(&json!({"apiVersion": "apps/v1", "kind": "Deployment"})).unwrap();
        assert_eq!(
            (g.group.as_str(), g.version.as_str(), g.kind.as_str()),
            ("apps", "v1", "Deployment")
        );
        let core = gvk_of(&json!({"apiVersion": "v1", "kind": "Service"})).unwrap();
        assert_eq!((core.group.as_str(), core.version.as_str()), ("", "v1"));
    }
}
