//! Pods the filter turned away for lack of room, and which of them to wake when
//! the books free room. kube-scheduler retries a pending pod on the holder's
//! update and deletion events, which can reach it before the extender's own pod
//! watch has freed the holder's share: both retries are refused and no later
//! event comes, so the pod would wait for kube-scheduler's 5-minute flush.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Most node names kept per refusal; a pod refused on more is woken by room
/// freed on any node (kept small: a large cluster sends hundreds of names).
pub(super) const NODES_KEPT: usize = 8;

/// Most refused pods woken per call (per timer tick): a freed GPU wakes a
/// batch, not a whole backlog at once; the rest follow on the next ticks.
pub(super) const WAKE_PER_CALL: usize = 32;

/// One refusal for lack of room.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Refusal {
    /// The books' version the verdict was made on.
    pub version: u64,
    /// The nodes refused for room; `None`: more than [`NODES_KEPT`].
    pub nodes: Option<BTreeSet<String>>,
}

/// Refusals by pod uid, and where room was freed since the last wake.
#[derive(Debug, Clone, Default)]
pub(super) struct Refused {
    pods: HashMap<String, Refusal>,
    /// Node → the books' version at its newest freeing.
    freed: BTreeMap<String, u64>,
}

impl Refused {
    /// The filter refused pod `uid` for room on `nodes`, on the books at `version`.
    pub fn refuse<'a>(&mut self, uid: &str, version: u64, nodes: impl Iterator<Item = &'a String>) {
        let nodes: BTreeSet<String> = nodes.take(NODES_KEPT + 1).cloned().collect();
        let nodes = (nodes.len() <= NODES_KEPT).then_some(nodes);
        self.pods
            .insert(uid.to_string(), Refusal { version, nodes });
    }

    /// The pod passed, was bound or is gone: nothing to wake it for.
    pub fn clear(&mut self, uid: &str) {
        self.pods.remove(uid);
    }

    /// Room was freed on `node`; the books are now at `version`.
    pub fn freed(&mut self, node: &str, version: u64) {
        if self.pods.is_empty() {
            return;
        }
        self.freed.insert(node.to_string(), version);
    }

    /// The pods to wake now (forgetting their refusals: each refusal wakes
    /// once). The freeings are kept while a batch was cut short.
    pub fn take(&mut self) -> Vec<String> {
        if self.freed.is_empty() {
            return Vec::new();
        }
        let wake = to_wake(&self.pods, &self.freed, WAKE_PER_CALL);
        if wake.len() < WAKE_PER_CALL {
            self.freed.clear();
        }
        for u in &wake {
            self.pods.remove(u);
        }
        wake
    }

    pub fn shrink(&mut self) {
        if self.pods.capacity() > 4 * self.pods.len().max(256) {
            self.pods.shrink_to(2 * self.pods.len());
        }
    }
}

/// Which refused pods to wake, given where room was freed (node → the books'
/// version then): those refused before a freeing on a node they were refused
/// on (any node, when too many were kept). Oldest refusals first, then by uid;
/// at most `max`.
pub(super) fn to_wake(
    refused: &HashMap<String, Refusal>,
    freed: &BTreeMap<String, u64>,
    max: usize,
) -> Vec<String> {
    let newest = freed.values().copied().max().unwrap_or(0);
    let mut out: Vec<(u64, &String)> = refused
        .iter()
        .filter(|(_, r)| match &r.nodes {
            None => r.version < newest,
            Some(ns) => ns
                .iter()
                .any(|n| freed.get(n).is_some_and(|v| r.version < *v)),
        })
        .map(|(u, r)| (r.version, u))
        .collect();
    out.sort_unstable();
    out.into_iter().take(max).map(|(_, u)| u.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(version: u64, nodes: &[&str]) -> Refusal {
        Refusal {
            version,
            nodes: Some(nodes.iter().map(|n| n.to_string()).collect()),
        }
    }

    fn freed(f: &[(&str, u64)]) -> BTreeMap<String, u64> {
        f.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn a_pod_refused_on_a_node_is_woken_when_room_frees_there_after() {
        let r = HashMap::from([
            ("a".to_string(), refusal(5, &["n1"])),
            ("b".to_string(), refusal(5, &["n2"])),
        ]);
        assert_eq!(to_wake(&r, &freed(&[("n1", 6)]), 10), ["a"]);
    }

    #[test]
    fn a_refusal_on_books_that_already_had_the_room_freed_is_not_woken() {
        // Refused after the freeing: the verdict already saw the freed room.
        let r = HashMap::from([("a".to_string(), refusal(7, &["n1"]))]);
        assert!(to_wake(&r, &freed(&[("n1", 6)]), 10).is_empty());
        assert!(to_wake(&r, &freed(&[("n1", 7)]), 10).is_empty());
    }

    #[test]
    fn a_pod_refused_on_many_nodes_is_woken_by_room_freed_anywhere() {
        let r = HashMap::from([(
            "a".to_string(),
            Refusal {
                version: 3,
                nodes: None,
            },
        )]);
        assert_eq!(to_wake(&r, &freed(&[("elsewhere", 4)]), 10), ["a"]);
        assert!(to_wake(&r, &freed(&[("elsewhere", 3)]), 10).is_empty());
    }

    #[test]
    fn the_oldest_refusals_are_woken_first_up_to_the_bound() {
        let r: HashMap<String, Refusal> = (0..5)
            .map(|i| (format!("p{i}"), refusal(10 - i, &["n"])))
            .collect();
        assert_eq!(to_wake(&r, &freed(&[("n", 20)]), 2), ["p4", "p3"]);
    }

    #[test]
    fn each_refusal_wakes_once_and_a_cut_short_batch_continues_next_call() {
        let mut s = Refused::default();
        let names: Vec<String> = (0..WAKE_PER_CALL + 3).map(|i| format!("p{i:03}")).collect();
        for (i, u) in names.iter().enumerate() {
            s.refuse(u, i as u64, [String::from("n")].iter());
        }
        assert!(s.take().is_empty(), "nothing freed yet");
        s.freed("n", 1000);
        assert_eq!(s.take().len(), WAKE_PER_CALL);
        assert_eq!(s.take().len(), 3, "the rest, on the next call");
        assert!(s.take().is_empty(), "each refusal wakes once");
        // No refusal held: a freeing is not kept.
        s.freed("n", 1001);
        s.refuse("late", 1002, [String::from("n")].iter());
        assert!(s.take().is_empty());
    }

    #[test]
    fn a_pod_refused_on_more_nodes_than_kept_is_held_for_any_node() {
        let mut s = Refused::default();
        let many: Vec<String> = (0..=NODES_KEPT).map(|i| format!("n{i}")).collect();
        s.refuse("a", 1, many.iter());
        s.refuse("b", 1, many[..2].iter());
        s.freed("other", 2);
        assert_eq!(s.take(), ["a"]);
    }

    #[test]
    fn a_cleared_refusal_is_not_woken() {
        let mut s = Refused::default();
        s.refuse("a", 1, [String::from("n")].iter());
        s.clear("a");
        s.freed("n", 2);
        assert!(s.take().is_empty());
    }
}
