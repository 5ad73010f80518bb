//! The I/O edge of the ResourceSlice: reads the Node and its slices, sends what
//! [`super::slice::plan`] decides, and removes any other slice of this driver on the
//! node (a renamed or duplicated one), so that the scheduler sees exactly one pool.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kubeshare_api::NodeInventory;
use kubeshare_api::dra::DRIVER_NAME;

use super::slice::{Step, plan, slice_name};
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

/// Makes the API hold `node`'s slice for `inv`.
pub async fn publish(
    client: &kube::Client,
    node: &str,
    inv: &NodeInventory,
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
    match plan(node, &uid, inv, existing.as_ref()) {
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

/// Publishes the node's slice from `source` now and every `every`, forever; failures
/// are logged and retried at the next turn (a conflict there means someone changed
/// the slice since it was read: the next read sees it).
pub async fn run(client: kube::Client, node: String, source: InventorySource, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let inv = match source.load() {
            Ok(inv) => inv,
            Err(e) => {
                tracing::warn!(error = %e, "DRA: GPU discovery failed; ResourceSlice left as it is");
                continue;
            }
        };
        match publish(&client, &node, &inv).await {
            Ok(Published::Unchanged) => {}
            Ok(p) => tracing::info!(?p, gpus = inv.gpus.len(), "DRA: ResourceSlice published"),
            Err(e) => tracing::warn!(error = %e, "DRA: publishing the ResourceSlice failed"),
        }
    }
}
