//! The pods bound to this node, from kube-runtime's reflector store (a list-then-watch
//! on `spec.nodeName`), as the daemon sees them.
//!
//! The store buffers a relist (after a watch error or at start) and swaps it in whole
//! at its end, so a pod is never dropped (and its directory never removed) because a
//! relist was only half done; the test below holds the store to that. Until the first
//! list completes the daemon changes nothing on disk.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::Event;

use crate::reconcile::PodView;

impl PodView {
    /// The fields the daemon uses; `None` for an object without a UID (not a stored pod).
    pub fn from_pod(pod: &Pod) -> Option<PodView> {
        let meta = &pod.metadata;
        Some(PodView {
            uid: meta.uid.clone()?,
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            phase: pod.status.as_ref().and_then(|s| s.phase.clone()),
            scheduler_name: pod.spec.as_ref().and_then(|s| s.scheduler_name.clone()),
            labels: meta.labels.clone().unwrap_or_default(),
            annotations: meta.annotations.clone().unwrap_or_default(),
            claims: claim_names(pod),
        })
    }
}

/// The names of the ResourceClaims `pod` uses: those it names, and those made for it
/// from templates (as its status records them).
fn claim_names(pod: &Pod) -> std::collections::BTreeSet<String> {
    let named = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    let made = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .filter_map(|c| c.resource_claim_name.clone());
    named.chain(made).collect()
}

/// Whether a watcher event may change the visible set of pods: the pieces of a relist
/// do not (kube's store shows the old set until the list is complete).
pub fn changes_visible(event: &Event<Pod>) -> bool {
    !matches!(event, Event::Init | Event::InitApply(_))
}

/// Whether the event completes a list: from the first one on the store is in sync.
pub fn completes_list(event: &Event<Pod>) -> bool {
    matches!(event, Event::InitDone)
}

/// The pods in the store, by UID.
pub fn visible(store: &Store<Pod>) -> Vec<PodView> {
    let mut v: Vec<PodView> = store
        .state()
        .iter()
        .filter_map(|p| PodView::from_pod(p))
        .collect();
    v.sort_by(|a, b| a.uid.cmp(&b.uid));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn pod(uid: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                name: Some(format!("p-{uid}")),
                namespace: Some("nd".into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    /// Feeds events to the store the way the daemon does, and reads what it would see.
    struct Fed {
        reader: Store<Pod>,
        writer: kube::runtime::reflector::store::Writer<Pod>,
        synced: bool,
    }

    impl Fed {
        fn new() -> Fed {
            let writer = kube::runtime::reflector::store::Writer::default();
            Fed {
                reader: writer.as_reader(),
                writer,
                synced: false,
            }
        }
        fn apply(&mut self, e: Event<Pod>) -> bool {
            self.writer.apply_watcher_event(&e);
            self.synced |= completes_list(&e);
            changes_visible(&e)
        }
        fn uids(&self) -> Vec<String> {
            visible(&self.reader).into_iter().map(|p| p.uid).collect()
        }
    }

    #[test]
    fn relist_swaps_in_whole() {
        let mut c = Fed::new();
        assert!(!c.synced);
        assert!(!c.apply(Event::Init));
        assert!(!c.apply(Event::InitApply(pod("a"))));
        c.apply(Event::InitApply(pod("b")));
        assert!(c.uids().is_empty(), "nothing visible before the list ends");
        assert!(c.apply(Event::InitDone));
        assert!(c.synced);
        assert_eq!(c.uids(), ["a", "b"]);

        // A relist in progress keeps the old set visible, then replaces it.
        c.apply(Event::Init);
        c.apply(Event::InitApply(pod("b")));
        assert_eq!(c.uids(), ["a", "b"]);
        c.apply(Event::InitDone);
        assert_eq!(c.uids(), ["b"]);

        assert!(c.apply(Event::Apply(pod("c"))));
        assert_eq!(c.uids(), ["b", "c"]);
        assert!(c.apply(Event::Delete(pod("b"))));
        assert_eq!(c.uids(), ["c"]);
        // An object without a UID is not a stored pod: not shown.
        let mut no_uid = pod("x");
        no_uid.metadata.uid = None;
        c.apply(Event::Apply(no_uid));
        assert_eq!(c.uids(), ["c"]);
    }
}
