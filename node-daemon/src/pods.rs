//! The set of pods bound to this node, kept from a list-then-watch stream.
//!
//! A relist (after a watch error or at start) is buffered and swapped in whole at its
//! end, so a pod is never dropped (and its directory never removed) because a relist
//! was only half done. Until the first list completes the cache is not `synced` and
//! the daemon changes nothing on disk.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
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
        })
    }
}

/// Pods by UID.
#[derive(Debug, Default)]
pub struct PodCache {
    pods: BTreeMap<String, PodView>,
    relist: Option<BTreeMap<String, PodView>>,
    synced: bool,
}

impl PodCache {
    /// Applies one watcher event; returns whether the visible set may have changed.
    pub fn apply(&mut self, event: Event<Pod>) -> bool {
        match event {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            Event::InitApply(p) => {
                if let (Some(buf), Some(v)) = (self.relist.as_mut(), PodView::from_pod(&p)) {
                    buf.insert(v.uid.clone(), v);
                }
                false
            }
            Event::InitDone => {
                if let Some(buf) = self.relist.take() {
                    self.pods = buf;
                }
                self.synced = true;
                true
            }
            Event::Apply(p) => match PodView::from_pod(&p) {
                Some(v) => self.pods.insert(v.uid.clone(), v.clone()).as_ref() != Some(&v),
                None => false,
            },
            Event::Delete(p) => match p.metadata.uid.as_deref() {
                Some(uid) => self.pods.remove(uid).is_some(),
                None => false,
            },
        }
    }

    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn pods(&self) -> Vec<PodView> {
        self.pods.values().cloned().collect()
    }
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

    #[test]
    fn relist_swaps_in_whole() {
        let mut c = PodCache::default();
        assert!(!c.synced());
        c.apply(Event::Init);
        c.apply(Event::InitApply(pod("a")));
        c.apply(Event::InitApply(pod("b")));
        assert!(c.pods().is_empty(), "nothing visible before the list ends");
        assert!(c.apply(Event::InitDone));
        assert!(c.synced());
        assert_eq!(c.pods().len(), 2);

        // A relist in progress keeps the old set visible, then replaces it.
        c.apply(Event::Init);
        c.apply(Event::InitApply(pod("b")));
        assert_eq!(c.pods().len(), 2);
        c.apply(Event::InitDone);
        let uids: Vec<String> = c.pods().into_iter().map(|p| p.uid).collect();
        assert_eq!(uids, ["b"]);

        assert!(c.apply(Event::Apply(pod("c"))));
        assert!(
            !c.apply(Event::Apply(pod("c"))),
            "an identical update changes nothing"
        );
        assert!(c.apply(Event::Delete(pod("b"))));
        assert!(!c.apply(Event::Delete(pod("zz"))));
        let mut no_uid = pod("x");
        no_uid.metadata.uid = None;
        assert!(!c.apply(Event::Apply(no_uid)));
        assert_eq!(c.pods().len(), 1);
    }
}
