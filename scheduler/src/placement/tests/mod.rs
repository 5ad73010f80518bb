//! Unit and property tests of the placement: the helpers every test module uses, and the
//! basic placement rules (fit, reasons, memory, model, pack / spread, tags, GPU counts).
//! The books, unified memory, groups, nominations, the property tests and the demo have
//! modules of their own.

use std::collections::{BTreeMap, HashMap, HashSet};

use kubeshare_api::{Allocation, GpuDemand, GpuInfo, Milli, NodeInventory};
use proptest::prelude::*;

use super::*;

const GIB: u64 = 1 << 30;

fn uuid(node: u32, gpu: u32) -> String {
    format!("GPU-{node:08x}-0000-0000-0000-{gpu:012x}")
}

fn inv(node: u32, n: u32, model: &str, mem_gib: u64, links: &[(u32, u32)]) -> NodeInventory {
    NodeInventory {
        gpus: (0..n)
            .map(|i| GpuInfo {
                uuid: uuid(node, i),
                index: i,
                model: model.into(),
                memory: mem_gib * GIB,
                numa_node: None,
                nvlink_peers: links
                    .iter()
                    .filter_map(|&(a, b)| {
                        if a == i {
                            Some(uuid(node, b))
                        } else if b == i {
                            Some(uuid(node, a))
                        } else {
                            None
                        }
                    })
                    .collect(),
                held_by: None,
            })
            .collect(),
    }
}

fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
        .collect()
}

fn pod(uid: &str, kv: &[(&str, &str)]) -> PodInfo {
    PodInfo {
        uid: uid.into(),
        namespace: "ns".into(),
        name: format!("pod-{uid}"),
        node_name: None,
        terminal: false,
        demand: GpuDemand::from_labels(&labels(kv)).map_err(|e| e.to_string()),
        allocation: Ok(None),
        resource_version: None,
        kubeshare: true,
        pod_priority: 0,
        terminating: false,
        preemption: None,
    }
}

fn frac(uid: &str, req: &str) -> PodInfo {
    pod(uid, &[("gpu_request", req), ("gpu_limit", "1.0")])
}

fn cluster(nodes: &[(&str, NodeInventory)]) -> Cluster {
    let mut c = Cluster::new(Config::default());
    for (n, i) in nodes {
        c.apply_node(n, Ok(Some(i.clone())));
    }
    c
}

/// What the scheduler does: filter, prioritize, pick the top score, bind.
/// Then what the watch does: the pod shows up annotated and bound.
fn schedule(c: &mut Cluster, p: &mut PodInfo, now: u64) -> Result<Allocation, FilterOutcome> {
    let names = c.node_names();
    let f = c.filter(p, &names, now);
    if f.passed.is_empty() {
        return Err(f);
    }
    let scores = c.prioritize(p, &f.passed);
    let best = scores
        .iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
        .map(|s| s.0.clone())
        .unwrap();
    let d = go(c
        .bind(&p.uid, &best, now)
        .expect("bind after a passing filter"));
    let a = d.allocation.expect("a GPU pod gets an allocation");
    p.node_name = Some(best);
    p.allocation = Ok(Some(a.clone()));
    c.apply_pod(p);
    c.check_invariants().unwrap();
    Ok(a)
}

fn go(s: BindStep) -> BindDecision {
    match s {
        BindStep::Go(d) => *d,
        BindStep::Wait => panic!("bind waits at the group gate"),
    }
}

fn gpu_of(a: &Allocation) -> (String, Vec<String>) {
    (a.node.clone(), a.gpu_uuids.clone())
}

mod books;
mod claims;
mod demo;
mod groups;
mod nominate;
mod preempt;
mod props;
mod um;

/// A plain pod the watch has not shown yet binds from what filter saw (no GET
/// of the pod), gets no record, and is forgotten once the watch shows it bound.
#[test]
fn a_plain_pod_binds_from_its_filter_and_is_forgotten_once_bound() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    let mut p = pod("plain", &[]);
    p.kubeshare = false;
    assert!(!c.knows_pod("plain"));
    let f = c.filter(&p, &c.node_names(), 0);
    assert_eq!(f.passed, vec!["n1".to_string()]);
    let d = go(c.bind("plain", "n1", 0).expect("bind after filter"));
    assert_eq!(d.allocation, None);
    p.node_name = Some("n1".into());
    c.apply_pod(&p);
    assert!(!c.knows_pod("plain"));
    c.check_invariants().unwrap();
}

#[test]
fn two_halves_share_a_gpu_and_a_third_goes_elsewhere() {
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    let a = schedule(&mut c, &mut frac("a", "0.5"), 0).unwrap();
    let b = schedule(&mut c, &mut frac("b", "0.5"), 0).unwrap();
    let x = schedule(&mut c, &mut frac("c", "0.5"), 0).unwrap();
    assert_eq!(gpu_of(&a), gpu_of(&b));
    assert_ne!(gpu_of(&a), gpu_of(&x));
    // Default memory: request × the GPU's memory.
    assert_eq!(a.gpu_mem, 20 * GIB);
    assert_eq!(a.gpu_model, "A");
}

/// kube-scheduler retries a pending pod on the holder's deletion, which can reach
/// it before our watch has freed the holder's share: the pod refused for room is
/// woken once our books free room on its node, and only then; a pod that passed
/// or was refused on the freed books is not.
#[test]
fn a_pod_refused_for_room_is_woken_once_when_room_frees_on_its_node() {
    let mut c = cluster(&[
        ("n1", inv(1, 1, "A", 40, &[])),
        ("n2", inv(2, 1, "A", 40, &[])),
    ]);
    let mut holder = frac("holder", "0.6");
    let a = schedule(&mut c, &mut holder, 0).unwrap();
    let mut other = frac("other", "0.6");
    schedule(&mut c, &mut other, 0).unwrap();
    let pending = frac("pending", "0.6");
    assert!(c.filter(&pending, &c.node_names(), 0).passed.is_empty());
    assert!(c.take_wake().is_empty(), "nothing freed yet");
    c.delete_pod("holder");
    assert_eq!(
        c.take_wake(),
        [("ns".to_string(), "pod-pending".to_string())]
    );
    assert!(c.take_wake().is_empty(), "woken once per refusal");
    // Retried on the freed books, it passes: later freeings do not wake it.
    assert_eq!(c.filter(&pending, &c.node_names(), 0).passed, [a.node]);
    c.delete_pod("other");
    assert!(c.take_wake().is_empty());
    // Refused on one node only: room freed on another does not wake it.
    let mut c = cluster(&[
        ("n1", inv(1, 1, "A", 40, &[])),
        ("n2", inv(2, 1, "A", 40, &[])),
    ]);
    let mut h1 = frac("h1", "0.6");
    let b = schedule(&mut c, &mut h1, 0).unwrap();
    let mut h2 = frac("h2", "0.6");
    schedule(&mut c, &mut h2, 0).unwrap();
    assert!(
        c.filter(&pending, std::slice::from_ref(&b.node), 0)
            .passed
            .is_empty()
    );
    c.delete_pod("h2");
    assert!(c.take_wake().is_empty(), "room freed elsewhere");
    c.delete_pod("h1");
    assert_eq!(c.take_wake().len(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn reasons_name_the_node_the_gpu_and_the_numbers() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    schedule(&mut c, &mut frac("a", "0.6"), 0).unwrap();
    let f = schedule(&mut c, &mut frac("b", "0.5"), 0).unwrap_err();
    assert_eq!(f.failed["n1"], "n1/gpu 0: 0.4 free < 0.5 requested");
    assert_eq!(f.kind, FilterKind::NoFit);
    let f = schedule(
        &mut c,
        &mut pod(
            "m",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.2"),
                ("gpu_mem", "30Gi"),
            ],
        ),
        0,
    )
    .unwrap_err();
    assert_eq!(
        f.failed["n1"],
        "n1/gpu 0: 16.0 GiB memory free < 30.0 GiB requested"
    );
    // A node without inventory and a model that is not there are unresolvable.
    c.apply_node("plain", Ok(None));
    let f = c.filter(
        &pod(
            "x",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.1"),
                ("gpu_model", "B"),
            ],
        ),
        &["n1".into(), "plain".into()],
        0,
    );
    assert_eq!(f.unresolvable["n1"], "n1: no B GPU (has A)");
    assert!(f.unresolvable["plain"].contains("no sharedgpu/inventory annotation"));
}

#[test]
fn memory_decides_where_requests_alone_would_fit() {
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    // gpu 0: 0.2 of share but 36 GiB of memory taken.
    let a = schedule(
        &mut c,
        &mut pod(
            "a",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.2"),
                ("gpu_mem", "36Gi"),
            ],
        ),
        0,
    )
    .unwrap();
    let b = schedule(
        &mut c,
        &mut pod(
            "b",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.5"),
                ("gpu_mem", "8Gi"),
            ],
        ),
        0,
    )
    .unwrap();
    assert_ne!(
        gpu_of(&a),
        gpu_of(&b),
        "packing would pick the busy GPU if memory were ignored"
    );
    assert_eq!(b.gpu_mem, 8 * GIB);
}

#[test]
fn gpu_model_restricts_the_gpus() {
    let mut c = cluster(&[
        ("a", inv(1, 1, "A", 40, &[])),
        ("b", inv(2, 1, "B", 80, &[])),
    ]);
    let p = schedule(
        &mut c,
        &mut pod(
            "m",
            &[
                ("gpu_request", "0.5"),
                ("gpu_limit", "1"),
                ("gpu_model", "B"),
            ],
        ),
        0,
    )
    .unwrap();
    assert_eq!(p.node, "b");
    assert_eq!(p.gpu_model, "B");
    assert_eq!(p.gpu_mem, 40 * GIB);
}

#[test]
fn priority_zero_packs_and_priority_above_zero_spreads() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    let first = schedule(&mut c, &mut frac("1", "0.3"), 0).unwrap();
    assert_eq!(first.node, "a");
    // Pack: onto the same (fullest) GPU.
    let packed = schedule(&mut c, &mut frac("2", "0.3"), 0).unwrap();
    assert_eq!(gpu_of(&packed), gpu_of(&first));
    // Spread: onto an idle node.
    let spread = schedule(
        &mut c,
        &mut pod(
            "3",
            &[
                ("gpu_request", "0.3"),
                ("gpu_limit", "1"),
                ("priority", "50"),
            ],
        ),
        0,
    )
    .unwrap();
    assert_eq!(spread.node, "b");
    let spread2 = schedule(
        &mut c,
        &mut pod(
            "4",
            &[
                ("gpu_request", "0.3"),
                ("gpu_limit", "1"),
                ("priority", "50"),
            ],
        ),
        0,
    )
    .unwrap();
    // Least loaded GPU: a's second GPU or b's second one, never a busy one.
    assert_ne!(gpu_of(&spread2), gpu_of(&first));
    assert_ne!(gpu_of(&spread2), gpu_of(&spread));
}

#[test]
fn prioritize_gives_one_node_ten_and_non_gpu_pods_zero() {
    let mut c = cluster(&[
        ("a", inv(1, 1, "A", 40, &[])),
        ("b", inv(2, 1, "A", 40, &[])),
    ]);
    schedule(&mut c, &mut frac("1", "0.3"), 0).unwrap();
    let names = c.node_names();
    let s = c.prioritize(&frac("2", "0.3"), &names);
    assert_eq!(s, vec![("a".to_string(), 10), ("b".to_string(), 0)]);
    let plain = pod("p", &[]);
    assert_eq!(
        c.prioritize(&plain, &names),
        vec![("a".to_string(), 0), ("b".to_string(), 0)]
    );
    let f = c.filter(&plain, &names, 0);
    assert_eq!(f.passed, names);
    assert_eq!(f.kind, FilterKind::NotGpu);
}

/// With `filter_top: 1`, filter passes exactly the node prioritize would give 10
/// (kube-scheduler then binds it without scoring), and the placements are those
/// of a filter that passes every fitting node.
#[test]
fn filter_top_passes_the_node_prioritize_would_pick() {
    let nodes = [
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
        ("c", inv(3, 4, "B", 80, &[])),
    ];
    let mut all = cluster(&nodes);
    let mut top = Cluster::new(Config {
        filter_top: 1,
        ..Config::default()
    });
    for (n, i) in &nodes {
        top.apply_node(n, Ok(Some(i.clone())));
    }
    let shapes: [&[(&str, &str)]; 5] = [
        &[("gpu_request", "0.3"), ("gpu_limit", "1")],
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("priority", "50"),
        ],
        &[
            ("gpu_request", "0.2"),
            ("gpu_limit", "0.2"),
            ("gpu_count", "2"),
        ],
        &[
            ("gpu_request", "0.4"),
            ("gpu_limit", "0.8"),
            ("gpu_mem", "30Gi"),
        ],
        &[("gpu_request", "1"), ("gpu_limit", "1")],
    ];
    let mut placed = 0;
    for i in 0..40 {
        let mut p = pod(&format!("p{i}"), shapes[i % shapes.len()]);
        let names = all.node_names();
        let f = all.filter(&p, &names, 0);
        let t = top.filter(&p, &names, 0);
        if f.passed.is_empty() {
            assert_eq!(t, f, "{i}: no node fits either way");
            continue;
        }
        let best: Vec<String> = all
            .prioritize(&p, &f.passed)
            .into_iter()
            .filter(|(_, s)| *s == 10)
            .map(|(n, _)| n)
            .collect();
        assert_eq!(t.passed, best, "{i}");
        assert!(t.failed.len() <= f.failed.len() && t.unresolvable == f.unresolvable);
        let mut q = p.clone();
        let a = schedule(&mut all, &mut p, 0).unwrap();
        assert_eq!(schedule(&mut top, &mut q, 0).unwrap(), a, "{i}");
        placed += 1;
    }
    assert!(
        placed > 10 && placed < 40,
        "{placed} placed: the cluster should fill up"
    );
    assert_eq!(all.usage(), top.usage());
}

/// A node update with the same GPUs (a heartbeat, in any order) changes nothing:
/// same id, stamp and books, so memoised verdicts stay valid; a changed GPU is
/// applied at once and the node's bookings are counted again.
#[test]
fn a_node_update_with_the_same_gpus_keeps_the_node_and_its_books() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    schedule(&mut c, &mut frac("1", "0.5"), 0).unwrap();
    let before = (c.version, c.usage(), c.nodes["a"].id, c.nodes["a"].stamp);
    let mut reversed = inv(1, 2, "A", 40, &[]);
    reversed.gpus.reverse();
    c.apply_node("a", Ok(Some(inv(1, 2, "A", 40, &[]))));
    c.apply_node("a", Ok(Some(reversed)));
    assert_eq!(
        before,
        (c.version, c.usage(), c.nodes["a"].id, c.nodes["a"].stamp)
    );
    let mut changed = inv(1, 2, "A", 40, &[]);
    changed.gpus[1].memory = 80 * GIB;
    c.apply_node("a", Ok(Some(changed)));
    assert!(c.version > before.0 && c.nodes["a"].stamp > before.3);
    let booked: u32 = c.usage().iter().map(|u| u.used_milli).sum();
    assert_eq!(
        booked, 500,
        "the pod's booking is counted on the updated node"
    );
    c.check_invariants().unwrap();
    // Fewer GPUs is a change too.
    c.apply_node("b", Ok(Some(inv(2, 1, "A", 40, &[]))));
    assert_eq!(c.nodes["b"].gpus.len(), 1);
    c.check_invariants().unwrap();
}

/// Node ids are reused after a delete, and the scores filter caches by id
/// never leak from a deleted node to the one that takes its id.
#[test]
fn node_ids_are_reused_and_cached_scores_follow_the_node() {
    let mut c = cluster(&[
        ("a", inv(1, 1, "A", 40, &[])),
        ("b", inv(2, 1, "A", 40, &[])),
        ("c", inv(3, 1, "A", 40, &[])),
    ]);
    schedule(&mut c, &mut frac("1", "0.3"), 0).unwrap();
    schedule(&mut c, &mut frac("2", "0.3"), 0).unwrap();
    for round in 0..5 {
        c.delete_node("b");
        c.apply_node("d", Ok(Some(inv(4, 1, "A", 40, &[]))));
        c.apply_node("d", Ok(Some(inv(4, 1, "A", 40, &[]))));
        c.apply_node("b", Ok(Some(inv(2, 1, "A", 40, &[]))));
        c.delete_node("d");
        assert_eq!(c.next_id, 4, "round {round}: ids stay dense");
        c.check_invariants().unwrap();
    }
    c.apply_node("d", Ok(Some(inv(4, 1, "A", 40, &[]))));
    let names = c.node_names();
    let p = frac("3", "0.3");
    let f = c.filter(&p, &names, 0);
    assert_eq!(f.passed, names);
    let cached = c.prioritize(&p, &names);
    let mut fresh = c.clone();
    fresh.scores = None;
    assert_eq!(cached, fresh.prioritize(&p, &names));
    // Pack: the GPU holding both pods gets the top score.
    let top: Vec<&str> = cached
        .iter()
        .filter(|(_, s)| *s == 10)
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(top.len(), 1);
    assert!(
        c.usage()
            .iter()
            .any(|g| g.node == top[0] && g.used_milli == 600)
    );
}

#[test]
fn affinity_anti_affinity_and_exclusion() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    // Affinity beats spreading: the second pod joins the first's GPU.
    let aff = |u: &str| {
        pod(
            u,
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("priority", "9"),
                ("sched_affinity", "t"),
            ],
        )
    };
    let x = schedule(&mut c, &mut aff("x"), 0).unwrap();
    let y = schedule(&mut c, &mut aff("y"), 0).unwrap();
    assert_eq!(gpu_of(&x), gpu_of(&y));
    let f = c.filter(&aff("z"), &["b".into()], 0);
    assert_eq!(f.unresolvable["b"], "b: affinity tag t lives on a/gpu 0");

    // Anti-affinity beats packing.
    let anti = |u: &str| {
        pod(
            u,
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "1"),
                ("sched_anti-affinity", "s"),
            ],
        )
    };
    let p = schedule(&mut c, &mut anti("p"), 0).unwrap();
    let q = schedule(&mut c, &mut anti("q"), 0).unwrap();
    assert_ne!(gpu_of(&p), gpu_of(&q));

    // Exclusion: a GPU holding tag e1 takes no e2 pod; untagged pods may join.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let e1 = schedule(
        &mut c,
        &mut pod(
            "e1",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("sched_exclusion", "e1"),
            ],
        ),
        0,
    )
    .unwrap();
    let f = schedule(
        &mut c,
        &mut pod(
            "e2",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("sched_exclusion", "e2"),
            ],
        ),
        0,
    )
    .unwrap_err();
    assert_eq!(f.failed["a"], "a/gpu 0: holds exclusion tag e1, pod has e2");
    let same = schedule(
        &mut c,
        &mut pod(
            "e1b",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "1"),
                ("sched_exclusion", "e1"),
            ],
        ),
        0,
    )
    .unwrap();
    assert_eq!(gpu_of(&same), gpu_of(&e1));
    schedule(&mut c, &mut frac("none", "0.2"), 0).unwrap();
}

#[test]
fn affinity_and_anti_affinity_are_per_namespace() {
    let mut c = cluster(&[("a", inv(1, 2, "A", 40, &[]))]);
    let mut p = pod(
        "p",
        &[
            ("gpu_request", "0.1"),
            ("gpu_limit", "1"),
            ("sched_anti-affinity", "s"),
        ],
    );
    let mut q = p.clone();
    q.uid = "q".into();
    q.namespace = "other".into();
    let a = schedule(&mut c, &mut p, 0).unwrap();
    let b = schedule(&mut c, &mut q, 0).unwrap();
    assert_eq!(gpu_of(&a), gpu_of(&b));
}

#[test]
fn gpu_count_takes_distinct_gpus_and_whole_gpus_prefer_nvlink() {
    let mut c = cluster(&[("a", inv(1, 4, "A", 40, &[(0, 2), (1, 3)]))]);
    let two = schedule(
        &mut c,
        &mut pod(
            "c",
            &[
                ("gpu_request", "0.5"),
                ("gpu_limit", "0.5"),
                ("gpu_count", "2"),
            ],
        ),
        0,
    )
    .unwrap();
    assert_eq!(two.gpu_uuids.len(), 2);
    assert_ne!(two.gpu_uuids[0], two.gpu_uuids[1]);
    // Whole pods take free GPUs only, NVLink-connected ones first.
    let mut c = cluster(&[("a", inv(1, 4, "A", 40, &[(0, 2), (1, 3)]))]);
    let w = schedule(
        &mut c,
        &mut pod("w", &[("gpu_request", "2"), ("gpu_limit", "2")]),
        0,
    )
    .unwrap();
    assert_eq!(w.gpu_uuids, vec![uuid(1, 0), uuid(1, 2)]);
    assert_eq!(w.gpu_mem, 40 * GIB);
    // A fraction packs onto... nothing busy with room: whole GPUs are full. It takes gpu 1.
    let f = schedule(&mut c, &mut frac("f", "0.5"), 0).unwrap();
    assert_eq!(f.gpu_uuids, vec![uuid(1, 1)]);
    let f = schedule(
        &mut c,
        &mut pod("w2", &[("gpu_request", "2"), ("gpu_limit", "2")]),
        0,
    )
    .unwrap_err();
    assert_eq!(f.failed["a"], "a: 1 of 2 whole GPUs free");
}

#[test]
fn packing_keeps_whole_nodes_free() {
    // Node a already busy; b idle. A fraction that needs an idle GPU goes to a.
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    schedule(&mut c, &mut frac("1", "0.9"), 0).unwrap();
    let x = schedule(&mut c, &mut frac("2", "0.5"), 0).unwrap();
    assert_eq!(x.node, "a");
    assert_eq!(x.gpu_uuids, vec![uuid(1, 1)]);
}

#[test]
fn invalid_labels_are_unresolvable_with_the_parser_message() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let f = c.filter(&pod("x", &[("gpu_request", "0.5")]), &["a".into()], 0);
    assert_eq!(f.kind, FilterKind::InvalidLabels);
    assert!(f.unresolvable["a"].starts_with("invalid sharedgpu labels: sharedgpu/gpu_request=0.5"));
}
