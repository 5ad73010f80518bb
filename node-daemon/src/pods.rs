//! The pods bound to this node, from kube-runtime's reflector store (a list-then-watch
//! on `spec.nodeName`), as the daemon sees them.
//!
//! The store buffers a relist (after a watch error or at start) and swaps it in whole
//! at its end, so a pod is never dropped (and its directory never removed) because a
//! relist was only half done; the test below holds the store to that. Until the first
//! list completes the daemon changes nothing on disk.

use futures::{FutureExt as _, Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::Store;
use kube::runtime::reflector::store::Writer;
use kube::runtime::watcher::{self, Event};

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

/// What a burst of pod watch events did to the store ([`apply_burst`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Burst {
    /// A list completed: the store is in sync from now on.
    pub listed: bool,
    /// The visible set of pods may have changed.
    pub changed: bool,
    /// The watch ended.
    pub ended: bool,
}

/// Applies `first` and every event already waiting on `stream` to the store's `writer`, so
/// that a burst of events is acted on once. Watch errors are logged (the watcher retries
/// with backoff); `watch` names the watch in the log.
pub fn apply_burst<S>(
    first: Option<watcher::Result<Event<Pod>>>,
    stream: &mut S,
    writer: &mut Writer<Pod>,
    watch: &str,
) -> Burst
where
    S: Stream<Item = watcher::Result<Event<Pod>>> + Unpin,
{
    let mut burst = Burst::default();
    let mut next = first;
    loop {
        match next {
            Some(Ok(e)) => {
                writer.apply_watcher_event(&e);
                burst.listed |= completes_list(&e);
                burst.changed |= changes_visible(&e);
            }
            Some(Err(e)) => tracing::warn!(watch, error = %e, "pod watch error; retrying"),
            None => {
                burst.ended = true;
                return burst;
            }
        }
        match stream.next().now_or_never() {
            Some(n) => next = n,
            None => return burst,
        }
    }
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

    #[test]
    fn a_burst_is_applied_until_the_watch_waits_or_ends() {
        let ok = Ok::<_, watcher::Error>;
        let mut writer = Writer::default();
        let reader = writer.as_reader();
        // The events already waiting are taken; then the watch waits.
        let mut waiting =
            futures::stream::iter([ok(Event::InitApply(pod("b"))), ok(Event::InitDone)])
                .chain(futures::stream::pending());
        let burst = apply_burst(Some(ok(Event::Init)), &mut waiting, &mut writer, "test");
        let expected = Burst {
            listed: true,
            changed: true,
            ended: false,
        };
        assert_eq!(burst, expected);
        let uids: Vec<String> = visible(&reader).into_iter().map(|p| p.uid).collect();
        assert_eq!(uids, ["b"]);
        // A relist's pieces change nothing visible; a watch that ends says so.
        let mut ending = futures::stream::iter([ok(Event::InitApply(pod("c")))]);
        let burst = apply_burst(Some(ok(Event::Init)), &mut ending, &mut writer, "test");
        let expected = Burst {
            listed: false,
            changed: false,
            ended: true,
        };
        assert_eq!(burst, expected);
    }
}
