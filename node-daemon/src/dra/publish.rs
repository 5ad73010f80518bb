//! The I/O edge of the ResourceSlice: reads the Node and its slices, sends what
//! [`super::slice::plan`] decides, and removes any other slice of this driver on the
//! node (a renamed or duplicated one), so that the scheduler sees exactly one pool.
//! [`run`] watches the node's pods and publishes again whenever what the label pods
//! hold changes, so that the slice's capacities follow them (one set of books with the
//! extender: docs/dra.md).

use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use kubeshare_api::NodeInventory;
use kubeshare_api::dra::DRIVER_NAME;

use super::slice::{LabelUse, Step, label_use, plan, slice_name};
use crate::source::InventorySource;

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("cannot read Node {node}: {source}")]
    Node { node: String, source: kube::Error },
    #[error("Node {0} has no uid")]
    NoUid(String),
    #[error("cannot {what} ResourceSlice {name}: {source}")]
    Api {
        what: &'static str,
        name: String,
        source: kube::Error,
    },
}

/// What [`publish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    Created,
    /// Replaced, at this pool generation.
    Replaced(i64),
    Unchanged,
}

/// Makes the API hold `node`'s slice for `inv`, less what label pods hold (`used`).
pub async fn publish(
    client: &kube::Client,
    node: &str,
    inv: &NodeInventory,
    used: &LabelUse,
) -> Result<Published, PublishError> {
    let n = Api::<Node>::all(client.clone())
        .get(node)
        .await
        .map_err(|source| PublishError::Node {
            node: node.into(),
            source,
        })?;
    let uid = n
        .metadata
        .uid
        .ok_or_else(|| PublishError::NoUid(node.into()))?;
    let api = Api::<ResourceSlice>::all(client.clone());
    let ours = slice_name(node);
    let lp =
        ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRIVER_NAME}"));
    let list = api.list(&lp).await.map_err(|source| PublishError::Api {
        what: "list",
        name: format!("of node {node}"),
        source,
    })?;
    let mut existing = None;
    for s in list.items {
        let name = s.metadata.name.clone().unwrap_or_default();
        if name == ours {
            existing = Some(s);
        } else {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => tracing::info!(slice = %name, "removed a stray ResourceSlice"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(source) => {
                    return Err(PublishError::Api {
                        what: "delete",
                        name,
                        source,
                    });
                }
            }
        }
    }
    let pp = PostParams::default();
    match plan(node, &uid, inv, used, existing.as_ref()) {
        Step::Unchanged => Ok(Published::Unchanged),
        Step::Create(s) => {
            api.create(&pp, &s)
                .await
                .map_err(|source| PublishError::Api {
                    what: "create",
                    name: ours,
                    source,
                })?;
            Ok(Published::Created)
        }
        Step::Replace(s) => {
            let generation = s.spec.pool.generation;
            api.replace(&ours, &pp, &s)
                .await
                .map_err(|source| PublishError::Api {
                    what: "replace",
                    name: ours,
                    source,
                })?;
            Ok(Published::Replaced(generation))
        }
    }
}

/// What the label pods among `pods` (this node's) hold of each GPU of `inv`, read as the
/// daemon's loop reads them (`reconcile::desired_with_claims` without claims), so the
/// slice and gem-schd's configs count the same pods.
pub fn label_use_of(node: &str, inv: &NodeInventory, pods: &[Pod]) -> LabelUse {
    let views: Vec<crate::reconcile::PodView> = pods
        .iter()
        .filter_map(crate::reconcile::PodView::from_pod)
        .collect();
    label_use(&crate::reconcile::desired_with_claims(
        node,
        inv,
        &views,
        &[],
    ))
}

/// Publishes the node's slice from `source` now, every `every`, and whenever the node's
/// pods change (label pods coming and going change the capacities), forever; failures
/// are logged and retried at the next turn (a conflict there means someone changed the
/// slice since it was read: the next read sees it). Until the pod watch has listed, the
/// slice is not published: capacities without the label pods would let claims into
/// their shares.
pub async fn run(client: kube::Client, node: String, source: InventorySource, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let pods: Api<Pod> = Api::all(client.clone());
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher(pods, wc).default_backoff().boxed();
    let (store, mut writer) = reflector::store::<Pod>();
    let mut synced = false;
    let mut last: Option<LabelUse> = None;
    loop {
        let mut due = false;
        tokio::select! {
            _ = tick.tick() => due = true,
            ev = stream.next() => {
                // Every event already waiting, then one publish.
                let burst = crate::pods::apply_burst(ev, &mut stream, &mut writer, "DRA");
                if burst.ended {
                    tracing::error!("DRA: the pod watch ended; the slice no longer follows label pods");
                    return;
                }
                synced |= burst.listed;
            }
        }
        if !synced {
            continue;
        }
        let inv = match source.load() {
            Ok(inv) => inv,
            Err(e) => {
                tracing::warn!(error = %e, "DRA: GPU discovery failed; ResourceSlice left as it is");
                continue;
            }
        };
        let pods: Vec<Pod> = store.state().iter().map(|p| (**p).clone()).collect();
        let used = label_use_of(&node, &inv, &pods);
        // A pod event that changes no label share sends nothing; the tick still checks.
        if !due && last.as_ref() == Some(&used) {
            continue;
        }
        match publish(&client, &node, &inv, &used).await {
            Ok(Published::Unchanged) => last = Some(used),
            Ok(p) => {
                tracing::info!(?p, gpus = inv.gpus.len(), "DRA: ResourceSlice published");
                last = Some(used);
            }
            Err(e) => tracing::warn!(error = %e, "DRA: publishing the ResourceSlice failed"),
        }
    }
}
