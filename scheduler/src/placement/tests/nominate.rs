//! Nominations: pods tied to nodes outside kube-scheduler's names, and admitted groups.

use super::groups::member;
use super::*;

/// A pod tied to one node that kube-scheduler's search did not reach (large
/// clusters: it stops after a fraction of the nodes) is nominated to that node,
/// once per node: kube-scheduler then tries it first.
#[test]
fn a_pod_tied_to_a_node_outside_the_names_is_nominated_once() {
    let mut c = cluster(&[
        ("a", inv(1, 1, "A", 40, &[])),
        ("b", inv(2, 1, "A", 40, &[])),
        ("c", inv(3, 1, "A", 40, &[])),
    ]);
    let tagged = |u: &str| {
        pod(
            u,
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("sched_affinity", "t"),
            ],
        )
    };
    let x = schedule(&mut c, &mut tagged("x"), 0).unwrap();
    let home = x.node.clone();
    let others: Vec<String> = c.node_names().into_iter().filter(|n| *n != home).collect();
    // Sent the other nodes only: it fits none, and is nominated to its tag's node.
    let y = tagged("y");
    let f = c.filter(&y, &others, 0);
    assert!(f.passed.is_empty());
    assert_eq!(
        c.take_nominations(),
        vec![Nomination {
            namespace: "ns".into(),
            name: "pod-y".into(),
            node: home.clone()
        }]
    );
    // Again: kube-scheduler's own filters may have rejected that node; no loop.
    c.filter(&y, &others, 0);
    assert!(c.take_nominations().is_empty());
    // Sent its node: it passes there, nothing to nominate.
    let z = tagged("z");
    let f = c.filter(&z, &c.node_names(), 0);
    assert_eq!(f.passed, vec![home.clone()]);
    assert!(c.take_nominations().is_empty());
    // A pod with no tie is never nominated, whatever it was sent.
    let f = c.filter(&frac("w", "0.5"), &others[..1], 0);
    assert_eq!(f.passed.len(), 1);
    assert!(c.take_nominations().is_empty());
}

/// When a group is admitted, every other member is nominated to its reserved
/// node and woken; a member later sent names without its node is not nominated
/// again to the same node.
#[test]
fn an_admitted_groups_members_are_nominated_to_their_places() {
    let mut c = cluster(&[
        ("a", inv(1, 1, "A", 40, &[])),
        ("b", inv(2, 1, "A", 40, &[])),
    ]);
    let m: Vec<PodInfo> = (0..3)
        .map(|i| member(&format!("m{i}"), "0.6", "3"))
        .collect();
    for p in &m {
        c.note_pod(p);
    }
    let names = c.node_names();
    // ⌈0.6 × 3⌉ = 2 members needed: the first waits for a second to reach the
    // scheduler, whose filter admits the group (one member per GPU).
    assert_eq!(c.filter(&m[0], &names, 0).kind, FilterKind::GroupWaiting);
    assert!(c.take_nominations().is_empty());
    let f = c.filter(&m[1], &names, 0);
    assert_eq!(f.kind, FilterKind::GroupReserved);
    let placed: BTreeMap<String, String> = m
        .iter()
        .filter_map(|p| c.booked(&p.uid).map(|(n, _)| (p.name.clone(), n)))
        .collect();
    assert_eq!(placed.len(), 2, "{placed:?}");
    let nominated = c.take_nominations();
    let want: Vec<Nomination> = placed
        .iter()
        .filter(|(name, _)| **name != m[1].name)
        .map(|(name, node)| Nomination {
            namespace: "ns".into(),
            name: name.clone(),
            node: node.clone(),
        })
        .collect();
    assert_eq!(nominated, want);
    assert_eq!(c.take_wake().len(), 1);
    // That member, sent only the other node, is held to its own; not nominated twice.
    let (who, node) = placed.iter().find(|(n, _)| **n != m[1].name).unwrap();
    let p = m.iter().find(|p| p.name == *who).unwrap();
    let other: Vec<String> = names.iter().filter(|n| *n != node).cloned().collect();
    let f = c.filter(p, &other, 0);
    assert_eq!(f.kind, FilterKind::GroupReserved);
    assert!(f.passed.is_empty());
    assert!(c.take_nominations().is_empty());
    c.check_invariants().unwrap();
}

/// kube-scheduler stops its search once it has found 100 feasible nodes (or its
/// percentage of a large cluster): a pod that fits only elsewhere (here the one
/// node with its model) is nominated to the best node outside the names sent.
/// With fewer than 100 names, kube-scheduler searched every node, and the nodes
/// it did not send failed its own filters: no suggestion.
#[test]
fn a_pod_that_fits_only_outside_a_cut_short_search_is_nominated_there() {
    let mut nodes: Vec<(String, NodeInventory)> = (0..120)
        .map(|i| (format!("a{i:03}"), inv(i, 1, "A", 40, &[])))
        .collect();
    nodes.push(("b0".into(), inv(500, 1, "B", 40, &[])));
    nodes.push(("b1".into(), inv(501, 1, "B", 40, &[])));
    let refs: Vec<(&str, NodeInventory)> =
        nodes.iter().map(|(n, i)| (n.as_str(), i.clone())).collect();
    let mut c = cluster(&refs);
    // b1 is fuller: packing prefers it.
    let mut half = pod(
        "h",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("gpu_model", "B"),
        ],
    );
    let f = c.filter(&half, &["b1".into()], 0);
    assert_eq!(f.passed, vec!["b1".to_string()]);
    c.bind("h", "b1", 0).unwrap();
    half.node_name = Some("b1".into());
    let want_b = |u: &str| {
        pod(
            u,
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("gpu_model", "B"),
            ],
        )
    };
    let sent: Vec<String> = (0..100).map(|i| format!("a{i:03}")).collect();
    let f = c.filter(&want_b("x"), &sent, 0);
    assert_eq!(f.kind, FilterKind::NoFit);
    let n = c.take_nominations();
    assert_eq!(n.len(), 1, "{n:?}");
    assert_eq!(n[0].node, "b1");
    // Once per node.
    c.filter(&want_b("x"), &sent, 0);
    assert!(c.take_nominations().is_empty());
    // 99 names: the whole cluster was searched.
    let f = c.filter(&want_b("y"), &sent[..99], 0);
    assert_eq!(f.kind, FilterKind::NoFit);
    assert!(c.take_nominations().is_empty());
    // Nothing fits anywhere: nothing to suggest.
    let f = c.filter(
        &pod(
            "z",
            &[("gpu_request", "1"), ("gpu_limit", "1"), ("gpu_model", "C")],
        ),
        &sent,
        0,
    );
    assert_eq!(f.kind, FilterKind::NoFit);
    assert!(c.take_nominations().is_empty());
    c.check_invariants().unwrap();
}
