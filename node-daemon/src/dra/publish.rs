//! The I/O edge of the ResourceSlice: reads the Node and its slices, sends what
//! [`super::slice::plan`] decides, and removes any other slice of this driver on the
//! node (a renamed or duplicated one), so that the scheduler sees exactly one pool.
//! [`run`] watches the node's pods and publishes again whenever what the label pods
//! hold changes, so that the slice's capacities follow them (one set of books with the
//! extender: docs/dra.md). It also marks the slice when a pod with claims is bound here
//! ([`mark_bound`]), which wakes pods kube-scheduler refused while that pod's claims were
//! counted twice.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use kubeshare_api::NodeInventory;
use kubeshare_api::dra::{ANNOTATION_CLAIM_POD_BOUND, DRIVER_NAME};

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

/// Names `uid`, a pod with claims just bound to `node`, in the node's slice
/// ([`ANNOTATION_CLAIM_POD_BOUND`]). kube-scheduler counts a claim's consumed capacity
/// twice between writing its allocation and binding its pod, refuses a pod that fits only
/// if it is counted once, and no event of that claim tries the pod again; an update of a
/// ResourceSlice does. Returns whether the slice changed (not when it names `uid` already
/// or there is no slice).
pub async fn mark_bound(
    client: &kube::Client,
    node: &str,
    uid: &str,
) -> Result<bool, PublishError> {
    let api = Api::<ResourceSlice>::all(client.clone());
    let name = slice_name(node);
    let api_error = |what, source| PublishError::Api {
        what,
        name: name.clone(),
        source,
    };
    let Some(mut s) = api.get_opt(&name).await.map_err(|e| api_error("get", e))? else {
        return Ok(false);
    };
    let annotations = s.metadata.annotations.get_or_insert_default();
    if annotations
        .get(ANNOTATION_CLAIM_POD_BOUND)
        .map(String::as_str)
        == Some(uid)
    {
        return Ok(false);
    }
    annotations.insert(ANNOTATION_CLAIM_POD_BOUND.into(), uid.into());
    // The read's resourceVersion goes along: a slice changed meanwhile is a conflict, and
    // the next turn marks it again.
    api.replace(&name, &PostParams::default(), &s)
        .await
        .map_err(|e| api_error("mark", e))?;
    Ok(true)
}

/// The uids of the pods among `pods` (this node's) that use resource claims.
pub fn claim_pods(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.resource_claims.as_ref())
                .is_some_and(|c| !c.is_empty())
        })
        .filter_map(|p| p.metadata.uid.clone())
        .collect()
}

/// A pod of `now` not in `before`, if any: one is enough to wake every refused pod.
pub fn newly_bound<'a>(before: &BTreeSet<String>, now: &'a BTreeSet<String>) -> Option<&'a str> {
    now.iter()
        .find(|u| !before.contains(*u))
        .map(String::as_str)
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
    // Pods with claims bound here, as last marked in the slice.
    let mut marked = BTreeSet::new();
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
        let bound = claim_pods(&pods);
        let fresh = newly_bound(&marked, &bound);
        // A pod event that changes no label share sends nothing; the tick still checks. A
        // pod with claims bound here only marks the slice.
        if due || last.as_ref() != Some(&used) {
            match publish(&client, &node, &inv, &used).await {
                Ok(Published::Unchanged) => last = Some(used),
                Ok(p) => {
                    tracing::info!(?p, gpus = inv.gpus.len(), "DRA: ResourceSlice published");
                    last = Some(used);
                }
                Err(e) => tracing::warn!(error = %e, "DRA: publishing the ResourceSlice failed"),
            }
        }
        if let Some(uid) = fresh {
            match mark_bound(&client, &node, uid).await {
                Ok(changed) => {
                    tracing::debug!(pod = uid, changed, "DRA: a pod with claims bound here");
                    marked = bound;
                }
                Err(e) => tracing::warn!(error = %e, "DRA: marking the ResourceSlice failed"),
            }
        } else {
            // Pods that went are forgotten, so the set stays the node's.
            marked = bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str, claims: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": uid, "uid": uid},
            "spec": {
                "containers": [{"name": "c"}],
                "resourceClaims": if claims {
                    serde_json::json!([{"name": "gpu", "resourceClaimTemplateName": "t"}])
                } else {
                    serde_json::json!([])
                },
            },
        }))
        .expect("a pod")
    }

    #[test]
    fn only_pods_with_claims_count() {
        let pods = [pod("a", true), pod("b", false), pod("c", true)];
        let got: Vec<String> = claim_pods(&pods).into_iter().collect();
        assert_eq!(got, ["a", "c"]);
    }

    #[test]
    fn a_pod_not_marked_before_is_newly_bound() {
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(newly_bound(&set(&[]), &set(&[])), None);
        assert_eq!(newly_bound(&set(&["a"]), &set(&["a"])), None);
        // One that went is no news; one that came is.
        assert_eq!(newly_bound(&set(&["a", "b"]), &set(&["a"])), None);
        assert_eq!(newly_bound(&set(&["a"]), &set(&["a", "b"])), Some("b"));
        assert_eq!(newly_bound(&set(&["b"]), &set(&["a"])), Some("a"));
    }
}
