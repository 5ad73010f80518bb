//! Unit and property tests of the placement.

use std::collections::{BTreeMap, HashMap, HashSet};

use kubeshare_api::{Allocation, GpuDemand, GpuInfo, NodeInventory};
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
    let d = c
        .bind(&p.uid, &best, now)
        .expect("bind after a passing filter");
    let a = d.allocation.expect("a GPU pod gets an allocation");
    p.node_name = Some(best);
    p.allocation = Ok(Some(a.clone()));
    c.apply_pod(p);
    c.check_invariants().unwrap();
    Ok(a)
}

fn gpu_of(a: &Allocation) -> (String, Vec<String>) {
    (a.node.clone(), a.gpu_uuids.clone())
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
    assert_eq!(f.failed["b"], "b: affinity tag t lives on a/gpu 0");

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

#[test]
fn bind_rechecks_against_the_books() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let p = frac("p", "0.6");
    let q = frac("q", "0.6");
    let names = c.node_names();
    assert_eq!(c.filter(&p, &names, 0).passed, names);
    assert_eq!(c.filter(&q, &names, 0).passed, names);
    c.bind("p", "a", 0).unwrap();
    assert_eq!(
        c.bind("q", "a", 0).unwrap_err(),
        "a/gpu 0: 0.4 free < 0.6 requested"
    );
    // Rollback frees the share.
    c.rollback("p");
    c.bind("q", "a", 0).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn assumed_binds_survive_stale_watch_events_until_the_pod_is_gone() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let p = frac("p", "0.6");
    c.filter(&p, &c.node_names(), 0);
    c.bind("p", "a", 0).unwrap();
    // The watch delivers the pod as it was before our patch.
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 600);
    c.expire(u64::MAX);
    assert_eq!(c.usage()[0].used_milli, 600);
    // A relist without the pod: it is gone.
    c.retain_pods(&HashSet::new());
    assert_eq!(c.usage()[0].used_milli, 0);
}

#[test]
fn restart_rebuilds_the_books_from_annotations() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    let mut pods = vec![];
    for (i, r) in ["0.5", "0.25", "0.7", "0.5"].iter().enumerate() {
        let mut p = frac(&i.to_string(), r);
        schedule(&mut c, &mut p, 0).unwrap();
        pods.push(p);
    }
    let before = c.usage();
    // Pods first, nodes later: the order of the two watches must not matter.
    let mut fresh = Cluster::new(Config::default());
    for p in &pods {
        fresh.apply_pod(p);
    }
    fresh.apply_node("b", Ok(Some(inv(2, 2, "A", 40, &[]))));
    fresh.apply_node("a", Ok(Some(inv(1, 2, "A", 40, &[]))));
    assert_eq!(fresh.usage(), before);
    fresh.check_invariants().unwrap();
    // A finished pod gives its share back.
    let mut done = pods[0].clone();
    done.terminal = true;
    fresh.apply_pod(&done);
    assert_eq!(
        fresh.usage().iter().map(|g| g.used_milli).sum::<u32>(),
        before.iter().map(|g| g.used_milli).sum::<u32>() - 500
    );
}

#[test]
fn an_interrupted_bind_does_not_block_the_pod_itself() {
    // The pod carries annotations (patched before a crash) but no node.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let mut p = frac("p", "0.8");
    p.allocation = Ok(Some(Allocation {
        node: "a".into(),
        gpu_uuids: vec![uuid(1, 0)],
        gpu_mem: 32 * GIB,
        gpu_model: "A".into(),
    }));
    c.apply_pod(&p);
    assert_eq!(c.filter(&p, &["a".into()], 0).passed, vec!["a".to_string()]);
    c.bind("p", "a", 0).unwrap();
    assert_eq!(c.usage()[0].used_milli, 800);
    c.check_invariants().unwrap();
}

fn member(uid: &str, req: &str, head: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1"),
            ("group_name", "train-a"),
            ("group_headcount", head),
            ("group_threshold", "0.6"),
        ],
    )
}

#[test]
fn a_group_waits_until_enough_members_exist_and_fit_at_once() {
    // Room for 2 members of 0.5 on one GPU; the group of 5 needs ⌈0.6 × 5⌉ = 3.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let mut m: Vec<PodInfo> = (0..5)
        .map(|i| member(&format!("m{i}"), "0.5", "5"))
        .collect();
    let names = c.node_names();
    let f = c.filter(&m[0], &names, 0);
    assert_eq!(f.kind, FilterKind::GroupWaiting);
    assert_eq!(
        f.failed["a"],
        "group train-a: 1 of 3 required members exist"
    );
    for p in &m {
        c.note_pod(p);
    }
    let f = c.filter(&m[0], &names, 0);
    assert_eq!(
        f.failed["a"],
        "group train-a: 2 of 3 required members can be placed at once"
    );
    assert!(c.bind("m0", "a", 0).unwrap_err().contains("not admitted"));
    c.check_invariants().unwrap();
    assert_eq!(c.booking_counts(), (0, 0, 0));

    // Room for a third appears.
    c.apply_node("b", Ok(Some(inv(2, 1, "A", 40, &[]))));
    let names = c.node_names();
    let f = c.filter(&m[0], &names, 0);
    assert_eq!(f.kind, FilterKind::GroupReserved);
    assert_eq!(f.passed.len(), 1);
    // Every member that fits is reserved at once (4 of 5 here).
    assert_eq!(c.booking_counts(), (0, 0, 4));
    c.check_invariants().unwrap();
    let mut bound = 0;
    for p in m.iter_mut() {
        if let Ok(a) = schedule(&mut c, p, 1) {
            assert!(a.gpu_uuids.len() == 1);
            bound += 1;
        }
    }
    assert_eq!(bound, 4);
    let f = c.filter(&m[4], &names, 1);
    assert_eq!(f.kind, FilterKind::NoFit);
}

#[test]
fn a_reservation_is_released_when_its_members_do_not_come() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let m: Vec<PodInfo> = (0..2)
        .map(|i| member(&format!("m{i}"), "0.5", "2"))
        .collect();
    for p in &m {
        c.note_pod(p);
    }
    let f = c.filter(&m[0], &c.node_names(), 0);
    assert_eq!(f.kind, FilterKind::GroupReserved);
    assert_eq!(c.usage()[0].used_milli, 1000);
    // Another pod cannot take the reserved room.
    assert_eq!(
        c.filter(&frac("x", "0.5"), &["a".into()], 10).kind,
        FilterKind::NoFit
    );
    c.expire(Config::default().reservation_timeout_ms + 1);
    assert_eq!(c.usage()[0].used_milli, 0);
}

#[test]
fn spread_groups_stay_on_one_node_first() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    let g = |u: &str| {
        pod(
            u,
            &[
                ("gpu_request", "0.3"),
                ("gpu_limit", "1"),
                ("priority", "10"),
                ("group_name", "g"),
                ("group_headcount", "3"),
                ("group_threshold", "0.3"),
            ],
        )
    };
    let a = schedule(&mut c, &mut g("1"), 0).unwrap();
    let b = schedule(&mut c, &mut g("2"), 0).unwrap();
    assert_eq!(a.node, b.node, "same node first");
    assert_ne!(gpu_of(&a), gpu_of(&b), "least loaded GPU within it");
}

// ---------------------------------------------------------------- properties

const KINDS: &[&[(&str, &str)]] = &[
    &[("gpu_request", "0.25"), ("gpu_limit", "0.5")],
    &[("gpu_request", "0.5"), ("gpu_limit", "1.0")],
    &[("gpu_request", "0.7"), ("gpu_limit", "1.0")],
    &[("gpu_request", "1.0"), ("gpu_limit", "1.0")],
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "0.3"),
        ("gpu_mem", "30Gi"),
    ],
    &[
        ("gpu_request", "0.3"),
        ("gpu_limit", "0.3"),
        ("gpu_count", "2"),
    ],
    &[("gpu_request", "2"), ("gpu_limit", "2")],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("priority", "50"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_affinity", "a"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_anti-affinity", "b"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "x"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("sched_exclusion", "y"),
    ],
    &[
        ("gpu_request", "0.4"),
        ("gpu_limit", "1"),
        ("gpu_model", "B"),
    ],
    &[
        ("gpu_request", "0.4"),
        ("gpu_limit", "1"),
        ("group_name", "g"),
        ("group_headcount", "3"),
        ("group_threshold", "0.67"),
    ],
    &[],
];

#[derive(Debug, Clone)]
enum Op {
    Create(usize),
    Schedule(usize),
    Deliver(usize),
    Delete(usize),
    Finish(usize),
    Restart,
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KINDS.len()).prop_map(Op::Create),
        6 => any::<usize>().prop_map(Op::Schedule),
        3 => (1usize..4).prop_map(Op::Deliver),
        1 => any::<usize>().prop_map(Op::Delete),
        1 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Restart),
        1 => (1u64..40_000).prop_map(Op::Tick),
    ]
}

fn nodes() -> Vec<(String, NodeInventory)> {
    vec![
        ("n1".into(), inv(1, 2, "A", 40, &[])),
        ("n2".into(), inv(2, 2, "A", 40, &[(0, 1)])),
        ("n3".into(), inv(3, 4, "B", 80, &[(0, 1), (2, 3)])),
    ]
}

enum Ev {
    Apply(Box<PodInfo>),
    Delete(String),
}

/// The API server's truth, the watch's lag, and the extender's books.
struct World {
    api: BTreeMap<String, PodInfo>,
    queue: std::collections::VecDeque<Ev>,
    c: Cluster,
    now: u64,
    next: u32,
    log: Vec<(String, String, Vec<String>)>,
}

impl World {
    fn new() -> World {
        let mut w = World {
            api: BTreeMap::new(),
            queue: Default::default(),
            c: Cluster::new(Config::default()),
            now: 0,
            next: 0,
            log: vec![],
        };
        w.restart();
        w
    }

    fn restart(&mut self) {
        self.c = Cluster::new(Config::default());
        self.queue.clear();
        for p in self.api.values() {
            self.c.apply_pod(p);
        }
        for (n, i) in nodes() {
            self.c.apply_node(&n, Ok(Some(i)));
        }
    }

    fn pick(&self, k: usize, pending: bool) -> Option<String> {
        let v: Vec<&String> = self
            .api
            .iter()
            .filter(|(_, p)| !pending || p.node_name.is_none())
            .map(|(u, _)| u)
            .collect();
        (!v.is_empty()).then(|| v[k % v.len()].clone())
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Create(kind) => {
                self.next += 1;
                let uid = format!("u{:04}", self.next);
                let p = pod(&uid, KINDS[kind]);
                self.api.insert(uid, p.clone());
                self.queue.push_back(Ev::Apply(Box::new(p)));
            }
            Op::Schedule(k) => {
                let Some(uid) = self.pick(k, true) else {
                    return;
                };
                let p = self.api[&uid].clone();
                let names = self.c.node_names();
                let f = self.c.filter(&p, &names, self.now);
                if f.passed.is_empty() {
                    return;
                }
                let scores = self.c.prioritize(&p, &f.passed);
                let mut fresh = self.c.clone();
                fresh.scores = None;
                assert_eq!(
                    fresh.prioritize(&p, &f.passed),
                    scores,
                    "cached scores = fresh scores"
                );
                let best = scores
                    .iter()
                    .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
                    .map(|s| s.0.clone())
                    .unwrap();
                if let Ok(d) = self.c.bind(&uid, &best, self.now) {
                    let mut q = p.clone();
                    q.node_name = Some(best.clone());
                    q.allocation = Ok(d.allocation.clone());
                    if let Some(a) = &d.allocation {
                        self.log.push((uid.clone(), best, a.gpu_uuids.clone()));
                    }
                    self.api.insert(uid, q.clone());
                    self.queue.push_back(Ev::Apply(Box::new(q)));
                }
            }
            Op::Deliver(n) => {
                for _ in 0..n {
                    match self.queue.pop_front() {
                        Some(Ev::Apply(p)) => self.c.apply_pod(&p),
                        Some(Ev::Delete(u)) => self.c.delete_pod(&u),
                        None => break,
                    }
                }
            }
            Op::Delete(k) => {
                if let Some(uid) = self.pick(k, false) {
                    self.api.remove(&uid);
                    self.queue.push_back(Ev::Delete(uid));
                }
            }
            Op::Finish(k) => {
                if let Some(uid) = self.pick(k, false) {
                    let p = self.api.get_mut(&uid).unwrap();
                    p.terminal = true;
                    let p = p.clone();
                    self.api.remove(&uid);
                    self.queue.push_back(Ev::Apply(Box::new(p)));
                }
            }
            Op::Restart => self.restart(),
            Op::Tick(ms) => {
                self.now += ms;
                self.c.expire(self.now);
            }
        }
    }

    /// The truth: what bound pods' annotations say, summed per GPU.
    fn check(&self) -> Result<(), String> {
        self.c.check_invariants()?;
        let caps: HashMap<String, u64> = nodes()
            .into_iter()
            .flat_map(|(_, i)| i.gpus.into_iter().map(|g| (g.uuid, g.memory)))
            .collect();
        let mut used: HashMap<String, (u32, u64)> = HashMap::new();
        for p in self.api.values() {
            if let (Ok(Some(a)), Ok(Some(d))) = (&p.allocation, &p.demand) {
                let mut seen = HashSet::new();
                for u in &a.gpu_uuids {
                    if !seen.insert(u) {
                        return Err(format!("{} holds {u} twice", p.uid));
                    }
                    let e = used.entry(u.clone()).or_default();
                    e.0 += u32::from(d.request_per_gpu().get());
                    e.1 += a.gpu_mem;
                }
            }
        }
        for (u, (m, b)) in used {
            if m > 1000 || b > caps[&u] {
                return Err(format!("{u}: {m} milli, {b} bytes given out"));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_gpu_is_ever_overcommitted(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for o in &ops {
            w.step(o);
            if let Err(e) = w.check() {
                return Err(TestCaseError::fail(format!("after {o:?}: {e}")));
            }
        }
        // Catch up with the watch, restart, and the books agree with the truth.
        w.step(&Op::Deliver(usize::MAX / 2));
        let before: Vec<(String, u32, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used)).collect();
        let reserved = w.c.booking_counts().2;
        w.restart();
        let after: Vec<(String, u32, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used)).collect();
        if reserved == 0 {
            prop_assert_eq!(before, after);
        }
    }

    #[test]
    fn placement_is_deterministic(ops in proptest::collection::vec(op(), 1..80)) {
        let mut a = World::new();
        let mut b = World::new();
        for o in &ops {
            a.step(o);
            b.step(o);
        }
        prop_assert_eq!(&a.log, &b.log);
        prop_assert_eq!(a.c.usage(), b.c.usage());
    }
}
