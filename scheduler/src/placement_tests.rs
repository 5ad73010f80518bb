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

fn um(uid: &str, req: &str, mem: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1.0"),
            ("gpu_mem", mem),
            ("gpu_mem_mode", "unified"),
        ],
    )
}

/// Unified-memory pods overcommit a GPU's memory up to the factor (default 1.5) with
/// their resident shares; the record carries the ceiling as `gpu_mem` and the resident
/// share beside it; once they overcommit, no device-mode pod gets in.
#[test]
fn unified_pods_overcommit_up_to_the_factor_and_device_pods_never_do() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 80, &[]))]);
    let mut got = Vec::new();
    for uid in ["u1", "u2", "u3"] {
        got.push(schedule(&mut c, &mut um(uid, "0.3", "40Gi"), 0).unwrap());
    }
    for a in &got {
        assert_eq!(a.gpu_mem_resident, Some(40 * GIB));
        // Default ceiling: 2 × the resident share.
        assert_eq!(a.gpu_mem, 80 * GIB);
    }
    let u = c.usage();
    assert_eq!((u[0].mem_used, u[0].um_resident), (0, 120 * GIB));
    // 1.5 × 80 GiB is booked: a fourth resident share does not fit, and says why.
    let f = schedule(&mut c, &mut um("u4", "0.05", "1Gi"), 0).unwrap_err();
    assert!(
        f.failed["n1"].contains("unified-memory room (1.5 × what device-mode pods leave)"),
        "{:?}",
        f.failed
    );
    // The share is free (0.1 left) but no memory is: a device-mode pod is refused.
    let mut dev = pod(
        "d1",
        &[
            ("gpu_request", "0.05"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", "1Mi"),
        ],
    );
    let f = schedule(&mut c, &mut dev, 0).unwrap_err();
    assert!(f.failed["n1"].contains("memory free < "), "{:?}", f.failed);
    c.check_invariants().unwrap();
}

/// Device-mode pods take memory first; unified-memory pods share what they leave,
/// factor-fold; a record read back books each figure where it belongs.
#[test]
fn unified_pods_share_what_device_pods_leave_and_records_rebuild_the_books() {
    let cfg = Config {
        um_overcommit_milli: 2000,
        ..Config::default()
    };
    let mut c = Cluster::new(cfg.clone());
    c.apply_node("n1", Ok(Some(inv(1, 1, "A", 80, &[]))));
    let mut dev = pod(
        "d1",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", "60Gi"),
        ],
    );
    let d = schedule(&mut c, &mut dev, 0).unwrap();
    assert_eq!((d.gpu_mem, d.gpu_mem_resident), (60 * GIB, None));
    // 2 × (80 − 60) = 40 GiB of unified-memory room.
    let mut a = um("u1", "0.2", "25Gi");
    let a_rec = schedule(&mut c, &mut a, 0).unwrap();
    let f = schedule(&mut c, &mut um("u2", "0.2", "16Gi"), 0).unwrap_err();
    assert!(
        f.failed["n1"].contains("15.0 GiB of unified-memory room (2.0 ×"),
        "{:?}",
        f.failed
    );
    let mut b = um("u3", "0.2", "15Gi");
    schedule(&mut c, &mut b, 0).unwrap();
    // A fresh extender (the restart case) rebuilds the same books from the records.
    let mut fresh = Cluster::new(cfg);
    fresh.apply_node("n1", Ok(Some(inv(1, 1, "A", 80, &[]))));
    for p in [&dev, &a, &b] {
        fresh.apply_pod(p);
    }
    fresh.check_invariants().unwrap();
    assert_eq!(fresh.usage(), c.usage());
    assert_eq!(fresh.usage()[0].um_resident, 40 * GIB);
    assert_eq!(fresh.usage()[0].mem_used, 60 * GIB);
    assert_eq!(a_rec.gpu_mem_resident, Some(25 * GIB));
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

#[test]
fn bind_rechecks_against_the_books() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let p = frac("p", "0.6");
    let q = frac("q", "0.6");
    let names = c.node_names();
    assert_eq!(c.filter(&p, &names, 0).passed, names);
    assert_eq!(c.filter(&q, &names, 0).passed, names);
    go(c.bind("p", "a", 0).unwrap());
    assert_eq!(
        c.bind("q", "a", 0).unwrap_err(),
        "a/gpu 0: 0.4 free < 0.6 requested"
    );
    // Rollback frees the share.
    c.rollback("p");
    go(c.bind("q", "a", 0).unwrap());
    c.check_invariants().unwrap();
}

#[test]
fn assumed_binds_survive_stale_watch_events_until_the_pod_is_gone() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let p = frac("p", "0.6");
    c.filter(&p, &c.node_names(), 0);
    go(c.bind("p", "a", 0).unwrap());
    c.settle("p", 0, true);
    // The watch delivers the pod as it was before our Binding.
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 600);
    c.expire(u64::MAX);
    assert_eq!(c.usage()[0].used_milli, 600);
    // A relist whose snapshot predates the Binding does not drop it either.
    c.retain_pods(&HashSet::new());
    assert_eq!(c.usage()[0].used_milli, 600);
    // The check against the API does: the pod is gone.
    assert_eq!(c.due_checks(1, 5).len(), 0, "not due yet");
    let due = c.due_checks(10, 5);
    assert_eq!(due, vec![("p".into(), "ns".into(), "pod-p".into())]);
    assert!(c.due_checks(11, 5).is_empty(), "asked once per period");
    c.confirm("p", None);
    assert_eq!(c.usage()[0].used_milli, 0);
    c.check_invariants().unwrap();
}

/// Seen in a backlog run: a retried bind was told "already bound" for a pod whose
/// first Binding had no answer before the deadline and had not landed; kube-scheduler
/// then believed it bound, and it never was. Only a Binding answered OK (or the
/// observed record) makes a pod count as bound.
#[test]
fn a_binding_with_an_unknown_outcome_does_not_count_as_bound() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    for (uid, ok) in [("p", false), ("q", true)] {
        let p = frac(uid, "0.25");
        c.filter(&p, &c.node_names(), 0);
        go(c.bind(uid, "a", 0).unwrap());
        assert_eq!(c.bound_node(uid), None, "in flight");
        c.settle(uid, 0, ok);
    }
    assert_eq!(c.bound_node("p"), None, "outcome unknown");
    assert_eq!(c.bound_node("q"), Some("a".into()));
    // Neither is booked twice.
    assert!(c.bind("p", "a", 1).unwrap_err().contains("being checked"));
    // The check finds p unbound: its place is freed; it can be bound again.
    c.due_checks(u64::MAX / 2, 1);
    c.confirm("p", Some(&frac("p", "0.25")));
    assert_eq!(c.booked("p"), None);
    go(c.bind("p", "a", 2).unwrap());
    c.check_invariants().unwrap();
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

fn record(node: &str, gpus: &[String], mem: u64, req: u16) -> Allocation {
    Allocation {
        node: node.into(),
        gpu_uuids: gpus.to_vec(),
        gpu_mem: mem,
        gpu_model: "A".into(),
        granted: Granted::Fraction {
            request: Milli::new(req).unwrap(),
            limit: Milli::ONE,
        },
        gpu_mem_resident: None,
    }
}

#[test]
fn a_record_on_an_unbound_pod_is_not_booked_and_is_reported() {
    // Review finding (forged annotation): a record the Binding did not write.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let mut p = frac("p", "0.8");
    p.allocation = Ok(Some(record("a", &[uuid(1, 0)], 32 * GIB, 800)));
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 0);
    let probs = c.take_problems();
    assert_eq!(probs.len(), 1);
    assert!(probs[0].message.contains("not bound"), "{probs:?}");
    // On a bound pod that is not a KubeShare pod (default scheduler, no labels):
    // not booked either, as `kubectl sharedgpu` does not show it.
    let mut q = pod("q", &[]);
    q.kubeshare = false;
    q.node_name = Some("a".into());
    q.allocation = Ok(Some(record("a", &[uuid(1, 0)], 40 * GIB, 1000)));
    c.apply_pod(&q);
    assert_eq!(c.usage()[0].used_milli, 0);
    assert!(c.take_problems()[0].message.contains("not a KubeShare pod"));
    // The pod itself is scheduled normally.
    assert_eq!(c.filter(&p, &["a".into()], 0).passed, vec!["a".to_string()]);
    go(c.bind("p", "a", 0).unwrap());
    assert_eq!(c.usage()[0].used_milli, 800);
    c.check_invariants().unwrap();
}

#[test]
fn the_books_read_the_granted_share_from_the_record_not_the_labels() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    // Labels say 0.2, the record granted 0.7: the record wins.
    let mut p = frac("p", "0.2");
    p.node_name = Some("a".into());
    p.allocation = Ok(Some(record("a", &[uuid(1, 0)], 8 * GIB, 700)));
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 700);
    // A bound pod whose labels no longer parse keeps its booking.
    p.demand = Err("bad".into());
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 700);
    c.check_invariants().unwrap();
}

#[test]
fn tampered_records_never_move_or_free_a_booking() {
    // Review findings: gpu_uuid edited on a bound pod; an unparseable record.
    let mut c = cluster(&[("a", inv(1, 2, "A", 40, &[]))]);
    let mut p = frac("p", "1.0");
    schedule(&mut c, &mut p, 0).unwrap();
    let held = c.booked("p").unwrap();
    // Edit gpu_uuid to the other GPU.
    let mut t = p.clone();
    let mut a = p.allocation.clone().unwrap().unwrap();
    let other = if a.gpu_uuids[0] == uuid(1, 0) {
        uuid(1, 1)
    } else {
        uuid(1, 0)
    };
    a.gpu_uuids = vec![other.clone()];
    t.allocation = Ok(Some(a));
    c.apply_pod(&t);
    assert_eq!(c.booked("p").unwrap(), held, "the booking did not move");
    assert!(c.take_problems()[0].message.contains("changed after"));
    // So a whole-GPU pod cannot land on the GPU p really uses.
    let f = c.filter(&frac("w", "1.0"), &["a".into()], 0);
    assert_eq!(f.passed, vec!["a".to_string()]);
    go(c.bind("w", "a", 0).unwrap());
    assert_eq!(c.booked("w").unwrap().1, vec![other]);
    // Unparseable, or removed: the booking stays, and it is reported.
    t.allocation = Err("annotation sharedgpu/gpu_mem=\"lots\": not a byte count".into());
    c.apply_pod(&t);
    t.allocation = Ok(None);
    c.apply_pod(&t);
    assert_eq!(c.booked("p").unwrap(), held);
    assert_eq!(c.take_problems().len(), 2);
    c.check_invariants().unwrap();
}

#[test]
fn a_record_that_cannot_be_added_is_refused_not_a_panic() {
    // Review finding: two pods with gpu_mem=u64::MAX on one GPU panicked the watch.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    for u in ["x", "y"] {
        let mut p = frac(u, "0.1");
        p.node_name = Some("a".into());
        p.allocation = Ok(Some(record("a", &[uuid(1, 0)], u64::MAX, 100)));
        c.apply_pod(&p);
    }
    assert_eq!(c.usage()[0].mem_used, u64::MAX);
    assert_eq!(c.usage()[0].used_milli, 100);
    let probs = c.take_problems();
    assert_eq!(probs.len(), 1);
    assert!(probs[0].message.contains("cannot be added"), "{probs:?}");
    // The same when the node arrives after the pods (a restart's order).
    let mut d = Cluster::new(Config::default());
    for u in ["x", "y"] {
        let mut p = frac(u, "0.1");
        p.node_name = Some("a".into());
        p.allocation = Ok(Some(record("a", &[uuid(1, 0)], u64::MAX, 100)));
        d.apply_pod(&p);
    }
    d.apply_node("a", Ok(Some(inv(1, 1, "A", 40, &[]))));
    assert_eq!(d.take_problems().len(), 1);
    assert_eq!(d.usage()[0].mem_used, u64::MAX);
}

#[test]
fn stale_events_are_ignored_by_resource_version() {
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let mut p = frac("p", "0.5");
    p.resource_version = Some(10);
    c.apply_pod(&p);
    let mut bound = p.clone();
    bound.resource_version = Some(12);
    bound.node_name = Some("a".into());
    bound.allocation = Ok(Some(record("a", &[uuid(1, 0)], GIB, 500)));
    c.apply_pod(&bound);
    assert_eq!(c.usage()[0].used_milli, 500);
    // A replayed older event (before the Binding) changes nothing.
    c.apply_pod(&p);
    assert_eq!(c.usage()[0].used_milli, 500);
    // A finished pod (newer) frees it.
    let mut done = bound.clone();
    done.resource_version = Some(13);
    done.terminal = true;
    c.apply_pod(&done);
    assert_eq!(c.usage()[0].used_milli, 0);
}

#[test]
fn a_zero_byte_memory_cap_is_refused_with_a_reason() {
    // Review finding: gpu_limit alone (request 0) gave a 0-byte cap silently.
    let mut c = cluster(&[("a", inv(1, 1, "A", 40, &[]))]);
    let p = pod("p", &[("gpu_limit", "0.5")]);
    let f = c.filter(&p, &["a".into()], 0);
    let default_mem = p.demand.clone().unwrap().unwrap().mem_on(40 * GIB);
    if default_mem == 0 {
        assert_eq!(f.kind, FilterKind::NoFit);
        assert!(
            f.failed["a"].contains("memory cap would be 0 bytes"),
            "{f:?}"
        );
    } else {
        // The label parser gives such pods a non-zero default: it simply fits.
        assert_eq!(f.kind, FilterKind::Fits);
    }
    // With gpu_mem it fits.
    let p = pod("q", &[("gpu_limit", "0.5"), ("gpu_mem", "1Gi")]);
    assert_eq!(c.filter(&p, &["a".into()], 0).kind, FilterKind::Fits);
}

/// Schedules a group's members in order the way kube-scheduler does (filter,
/// prioritize, bind each); a member's bind may wait at the gate, and is answered
/// when a later member's bind releases the group. Returns what each got.
fn schedule_group(c: &mut Cluster, m: &mut [PodInfo], now: u64) -> Vec<Option<Allocation>> {
    let mut waiting: Vec<(usize, String)> = vec![];
    let mut got: Vec<Option<Allocation>> = vec![None; m.len()];
    let bound = |c: &mut Cluster, p: &mut PodInfo, node: String, d: BindDecision| {
        let a = d.allocation.unwrap();
        p.node_name = Some(node);
        p.allocation = Ok(Some(a.clone()));
        c.settle(&p.uid, now, true);
        c.apply_pod(p);
        a
    };
    // The scheduler retries what did not bind: a few passes.
    let n = m.len();
    for i in (0..4).flat_map(|_| 0..n) {
        if got[i].is_some() || waiting.iter().any(|w| w.0 == i) {
            continue;
        }
        let names = c.node_names();
        let f = c.filter(&m[i], &names, now);
        if f.passed.is_empty() {
            continue;
        }
        let scores = c.prioritize(&m[i], &f.passed);
        let best = scores
            .iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
            .map(|s| s.0.clone())
            .unwrap();
        match c.bind(&m[i].uid, &best, now) {
            Ok(BindStep::Go(d)) => got[i] = Some(bound(c, &mut m[i], best, *d)),
            Ok(BindStep::Wait) => waiting.push((i, best)),
            Err(_) => {}
        }
        for (j, node) in std::mem::take(&mut waiting) {
            match c.poll_gate(&m[j].uid, &node) {
                Ok(Some(d)) => got[j] = Some(bound(c, &mut m[j], node, d)),
                Ok(None) => waiting.push((j, node)),
                Err(e) => panic!("{e}"),
            }
        }
        c.check_invariants().unwrap();
    }
    // Members still at the gate give up.
    for (j, _) in waiting {
        c.leave_gate(&m[j].uid);
    }
    got
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
    let f = c.filter(&m[1], &names, 0);
    assert_eq!(
        f.failed["a"],
        "group train-a: 2 of 3 required members have reached the scheduler"
    );
    let f = c.filter(&m[2], &names, 0);
    assert_eq!(
        f.failed["a"],
        "group train-a: 2 of 3 required members can be placed at once"
    );
    assert!(c.bind("m0", "a", 0).unwrap_err().contains("not started"));
    c.check_invariants().unwrap();
    assert_eq!(c.booking_counts(), (0, 0, 0));

    // Room for a third appears.
    c.apply_node("b", Ok(Some(inv(2, 1, "A", 40, &[]))));
    let names = c.node_names();
    let f = c.filter(&m[0], &names, 0);
    assert_eq!(f.kind, FilterKind::GroupReserved);
    assert_eq!(f.passed.len(), 1);
    // Every member that reached the scheduler is reserved at once (3 here);
    // the others are woken.
    assert_eq!(c.booking_counts(), (0, 0, 3));
    assert_eq!(c.take_wake().len(), 2);
    c.check_invariants().unwrap();
    let got = schedule_group(&mut c, &mut m, 1);
    assert_eq!(got.iter().filter(|a| a.is_some()).count(), 4);
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
    assert_eq!(
        c.filter(&m[1], &c.node_names(), 0).kind,
        FilterKind::GroupWaiting
    );
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
fn no_member_is_bound_before_the_quorum_reaches_bind() {
    // Review finding (group 2-of-3): a group of 3 at threshold 1.0 whose third
    // member never reaches bind (its nodeSelector matches no node).
    let mut c = cluster(&[("a", inv(1, 2, "A", 40, &[]))]);
    let m: Vec<PodInfo> = ["g0", "g1", "g2"]
        .iter()
        .map(|u| member_all(u, "3"))
        .collect();
    for p in &m {
        c.note_pod(p);
    }
    let names = c.node_names();
    assert_eq!(c.filter(&m[1], &names, 0).kind, FilterKind::GroupWaiting);
    assert_eq!(c.filter(&m[2], &names, 0).kind, FilterKind::GroupWaiting);
    assert_eq!(c.filter(&m[0], &names, 0).kind, FilterKind::GroupReserved);
    assert_eq!(c.booking_counts(), (0, 0, 3));
    // Two members reach bind: both wait, nothing is bound.
    assert_eq!(c.bind("g0", "a", 0), Ok(BindStep::Wait));
    c.filter(&m[1], &names, 0);
    assert_eq!(c.bind("g1", "a", 0), Ok(BindStep::Wait));
    assert_eq!(c.poll_gate("g0", "a"), Ok(None));
    assert_eq!(c.booking_counts(), (0, 0, 3));
    // Their binds give up (kube-scheduler's timeout is near); places stay held.
    assert!(c.leave_gate("g0").contains("group g"));
    c.leave_gate("g1");
    // The group's deadline frees every place at once, on the timer, and names
    // the members to wake.
    let wake = c.expire(Config::default().reservation_timeout_ms);
    assert_eq!(c.booking_counts(), (0, 0, 0));
    assert_eq!(c.usage().iter().map(|g| g.used_milli).sum::<u32>(), 0);
    assert_eq!(wake.len(), 3, "{wake:?}");
    c.check_invariants().unwrap();
}

fn member_all(uid: &str, head: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("group_name", "g"),
            ("group_headcount", head),
            ("group_threshold", "1.0"),
        ],
    )
}

#[test]
fn a_group_whose_member_never_reaches_the_scheduler_holds_nothing() {
    // Review finding (group 2-of-3), first line of defence: the third member is
    // never sent to the extender (no node passes kube-scheduler's own checks).
    let mut c = cluster(&[("a", inv(1, 2, "A", 40, &[]))]);
    let m: Vec<PodInfo> = (0..3).map(|i| member_all(&format!("g{i}"), "3")).collect();
    for p in &m {
        c.note_pod(p);
    }
    let names = c.node_names();
    c.filter(&m[0], &names, 0);
    c.filter(&m[1], &names, 0);
    for _ in 0..3 {
        for p in &m[..2] {
            let f = c.filter(p, &names, 0);
            assert_eq!(f.kind, FilterKind::GroupWaiting);
            assert_eq!(
                f.failed["a"],
                "group g: 2 of 3 required members have reached the scheduler"
            );
        }
    }
    assert_eq!(c.booking_counts(), (0, 0, 0), "nothing is held");
    assert!(c.bind("g0", "a", 0).unwrap_err().contains("not started"));
}

#[test]
fn a_group_that_fits_is_released_together() {
    let mut c = cluster(&[
        ("a", inv(1, 2, "A", 40, &[])),
        ("b", inv(2, 2, "A", 40, &[])),
    ]);
    let mut m: Vec<PodInfo> = (0..4)
        .map(|i| member(&format!("m{i}"), "0.5", "4"))
        .collect();
    for p in &m {
        c.note_pod(p);
    }
    // ⌈0.6 × 4⌉ = 3: the first three reach the scheduler and are admitted; the
    // fourth waits for the group to run; at bind the first two wait, the third
    // releases all three.
    let got = schedule_group(&mut c, &mut m, 0);
    assert!(got.iter().all(Option::is_some), "{got:?}");
    // The fourth was woken when the group was released.
    assert!(
        c.take_wake()
            .contains(&("ns".to_string(), "pod-m3".to_string()))
    );
    assert_eq!(c.booking_counts().2, 0);
    c.check_invariants().unwrap();
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
    // Unified memory: resident shares that overcommit a 40 GiB GPU after two or three.
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("gpu_mem", "18Gi"),
        ("gpu_mem_mode", "unified"),
    ],
    &[
        ("gpu_request", "0.2"),
        ("gpu_limit", "1"),
        ("gpu_mem", "30Gi"),
        ("gpu_mem_mode", "unified"),
        ("gpu_mem_managed", "40Gi"),
    ],
    // Device mode with a large cap, to meet unified pods on the same GPUs.
    &[
        ("gpu_request", "0.1"),
        ("gpu_limit", "1"),
        ("gpu_mem", "25Gi"),
    ],
];

#[derive(Debug, Clone)]
enum Op {
    Create(usize),
    /// Filter, prioritize, and bind's decision (booked as assumed); the Binding
    /// is still to come (`Post`).
    Schedule(usize),
    /// The Binding of one decided bind: 0 done, 1 refused (a bind failing between
    /// decision and Binding), 2 outcome unknown but landed, 3 unknown, not landed.
    Post(usize, u8),
    /// A pending pod's labels change (between a decision and its Binding, say).
    Relabel(usize, usize),
    Deliver(usize),
    /// An old event of some pod delivered again (a stale watch event).
    Replay(usize),
    /// A bogus event: a bound pod's record tampered with (0 unparseable, 1 another
    /// GPU, 2 gpu_mem = u64::MAX); the stored record stays (admission refused it).
    Tamper(usize, u8),
    /// The watch relists: the queue is lost, a snapshot of the API is listed (it
    /// may predate binds in flight).
    Relist,
    /// Members waiting at the gate give up (their HTTP call times out).
    GiveUp,
    Delete(usize),
    Finish(usize),
    Restart,
    Tick(u64),
    /// A node's update that leaves its GPUs as they were (a heartbeat; the GPUs
    /// listed in reverse order when the flag is set).
    Heartbeat(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KINDS.len()).prop_map(Op::Create),
        6 => any::<usize>().prop_map(Op::Schedule),
        5 => (any::<usize>(), prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)])
            .prop_map(|(k, o)| Op::Post(k, o)),
        1 => (any::<usize>(), 0..KINDS.len()).prop_map(|(k, n)| Op::Relabel(k, n)),
        3 => (1usize..4).prop_map(Op::Deliver),
        1 => any::<usize>().prop_map(Op::Replay),
        1 => (any::<usize>(), 0u8..3).prop_map(|(k, v)| Op::Tamper(k, v)),
        1 => Just(Op::Relist),
        1 => Just(Op::GiveUp),
        1 => any::<usize>().prop_map(Op::Delete),
        1 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Restart),
        1 => (1u64..40_000).prop_map(Op::Tick),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(k, r)| Op::Heartbeat(k, r)),
    ]
}

fn nodes() -> Vec<(String, NodeInventory)> {
    vec![
        ("n1".into(), inv(1, 2, "A", 40, &[])),
        ("n2".into(), inv(2, 2, "A", 40, &[(0, 1)])),
        ("n3".into(), inv(3, 4, "B", 80, &[(0, 1), (2, 3)])),
    ]
}

#[derive(Debug)]
enum Ev {
    Apply(Box<PodInfo>),
    Delete(String),
}

/// How long a settled assumed booking waits before it is checked against the API.
const CHECK_MS: u64 = 5_000;

/// The API server's truth, the watch's lag, and the extender's books.
struct World {
    api: BTreeMap<String, PodInfo>,
    /// Last resourceVersion handed out.
    rv: u64,
    queue: std::collections::VecDeque<Ev>,
    /// Every event ever sent, for replays.
    hist: Vec<PodInfo>,
    /// Binds decided, Binding not yet posted: (uid, node, decision).
    inflight: Vec<(String, String, BindDecision)>,
    /// Group members waiting at the gate: (uid, node).
    waiting: Vec<(String, String)>,
    c: Cluster,
    now: u64,
    next: u32,
    log: Vec<(String, String, Vec<String>)>,
}

impl World {
    fn new() -> World {
        let mut w = World {
            api: BTreeMap::new(),
            rv: 0,
            queue: Default::default(),
            hist: vec![],
            inflight: vec![],
            waiting: vec![],
            c: Cluster::new(Config::default()),
            now: 0,
            next: 0,
            log: vec![],
        };
        w.restart();
        w
    }

    /// Stores `p` with a new resourceVersion and sends its event.
    fn write(&mut self, mut p: PodInfo) {
        self.rv += 1;
        p.resource_version = Some(self.rv);
        self.hist.push(p.clone());
        self.api.insert(p.uid.clone(), p.clone());
        self.queue.push_back(Ev::Apply(Box::new(p)));
    }

    fn restart(&mut self) {
        // Binds in flight die with the process (their Binding never lands).
        self.inflight.clear();
        self.waiting.clear();
        self.c = Cluster::new(Config::default());
        // A new process sees only new events: nothing from before is replayed.
        self.queue.clear();
        self.hist.clear();
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

    /// What bind's task does after the decision: the Binding with the
    /// resourceVersion precondition, re-read on a conflict.
    fn post(&mut self, uid: &str, node: &str, d: &BindDecision, outcome: u8) {
        let (demand, rv) = (d.demand.clone(), d.rv);
        let Some(cur) = self.api.get(uid).cloned() else {
            self.c.rollback(uid);
            return;
        };
        if cur.node_name.is_some() {
            self.c.rollback(uid);
            return;
        }
        if rv != cur.resource_version {
            // 409: read the pod; labels changed → give up; else retry, same decision.
            self.c.note_pod(&cur);
            if cur.demand.clone().ok().flatten() != demand {
                self.c.rollback(uid);
                return;
            }
        }
        match outcome {
            1 => self.c.rollback(uid),
            3 => self.c.settle(uid, self.now, false),
            _ => {
                let mut q = cur.clone();
                // The record is granted from the labels the pod has at this write.
                if let (Some(a), Ok(Some(dm))) = (&d.allocation, &q.demand) {
                    assert_eq!(a.granted.request_per_gpu(), dm.request_per_gpu());
                    assert_eq!(a.granted.limit_per_gpu(), dm.limit_per_gpu());
                    self.log
                        .push((uid.to_string(), node.to_string(), a.gpu_uuids.clone()));
                }
                q.node_name = Some(node.to_string());
                q.allocation = Ok(d.allocation.clone());
                self.write(q);
                self.c.settle(uid, self.now, outcome == 0);
            }
        }
    }

    fn poll_waiting(&mut self) {
        for (uid, node) in std::mem::take(&mut self.waiting) {
            match self.c.poll_gate(&uid, &node) {
                Ok(Some(d)) => self.inflight.push((uid, node, d)),
                Ok(None) => self.waiting.push((uid, node)),
                Err(_) => {}
            }
        }
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Create(kind) => {
                self.next += 1;
                let uid = format!("u{:04}", self.next);
                self.write(pod(&uid, KINDS[kind]));
            }
            Op::Schedule(k) => {
                let Some(uid) = self.pick(k, true) else {
                    return;
                };
                if self.inflight.iter().any(|f| f.0 == uid)
                    || self.waiting.iter().any(|f| f.0 == uid)
                {
                    return;
                }
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
                match self.c.bind(&uid, &best, self.now) {
                    Ok(BindStep::Go(d)) => self.inflight.push((uid, best, *d)),
                    Ok(BindStep::Wait) => self.waiting.push((uid, best)),
                    Err(_) => {}
                }
                self.poll_waiting();
            }
            Op::Post(k, outcome) => {
                if self.inflight.is_empty() {
                    return;
                }
                let (uid, node, d) = self.inflight.remove(k % self.inflight.len());
                self.post(&uid, &node, &d, outcome);
            }
            Op::Relabel(k, kind) => {
                if let Some(uid) = self.pick(k, true) {
                    let mut q = pod(&uid, KINDS[kind]);
                    q.allocation = self.api[&uid].allocation.clone();
                    self.write(q);
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
            Op::Replay(k) => {
                if !self.hist.is_empty() {
                    let p = self.hist[k % self.hist.len()].clone();
                    self.c.apply_pod(&p);
                }
            }
            Op::Tamper(k, v) => {
                let bound: Vec<&PodInfo> = self
                    .api
                    .values()
                    .filter(|p| matches!(p.allocation, Ok(Some(_))))
                    .collect();
                if bound.is_empty() {
                    return;
                }
                let mut t = bound[k % bound.len()].clone();
                let Ok(Some(mut a)) = t.allocation.clone() else {
                    return;
                };
                match v {
                    0 => {
                        t.allocation =
                            Err("annotation sharedgpu/gpu_mem=\"x\": not a byte count".into())
                    }
                    1 => {
                        let (_, i) = nodes().into_iter().find(|(n, _)| *n == a.node).unwrap();
                        a.gpu_uuids = i
                            .gpus
                            .iter()
                            .rev()
                            .take(a.gpu_uuids.len())
                            .map(|g| g.uuid.clone())
                            .collect();
                        t.allocation = Ok(Some(a));
                    }
                    _ => {
                        a.gpu_mem = u64::MAX;
                        t.allocation = Ok(Some(a));
                    }
                }
                self.rv += 1;
                t.resource_version = Some(self.rv);
                // Refused by admission: the API keeps the real record, but the
                // extender sees the attempt (defence in depth).
                self.api.get_mut(&t.uid).unwrap().resource_version = Some(self.rv);
                self.queue.push_back(Ev::Apply(Box::new(t)));
            }
            Op::Relist => {
                // The new stream starts at the list: nothing older comes after it.
                self.queue.clear();
                self.hist.clear();
                let snap: Vec<PodInfo> = self.api.values().cloned().collect();
                for p in &snap {
                    self.c.apply_pod(p);
                }
                self.c
                    .retain_pods(&snap.iter().map(|p| p.uid.clone()).collect());
            }
            Op::GiveUp => {
                for (uid, _) in std::mem::take(&mut self.waiting) {
                    self.c.leave_gate(&uid);
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
                    let mut p = self.api[&uid].clone();
                    p.terminal = true;
                    self.write(p);
                    self.api.remove(&uid);
                }
            }
            Op::Restart => self.restart(),
            Op::Heartbeat(k, reversed) => {
                let all = nodes();
                let (n, mut i) = all[k % all.len()].clone();
                if reversed {
                    i.gpus.reverse();
                }
                self.c.apply_node(&n, Ok(Some(i)));
            }
            Op::Tick(ms) => {
                self.now += ms;
                self.c.expire(self.now);
                for (uid, _, _) in self.c.due_checks(self.now, CHECK_MS) {
                    if self.inflight.iter().any(|f| f.0 == uid) {
                        continue;
                    }
                    let fresh = self.api.get(&uid).cloned();
                    self.c.confirm(&uid, fresh.as_ref());
                }
                self.poll_waiting();
            }
        }
    }

    /// The truth: what bound pods' records say, summed per GPU.
    fn check(&self) -> Result<(), String> {
        self.c.check_invariants()?;
        // The filter's memo never changes an answer: every pending pod gets the
        // same verdicts with the memo as from a cluster that never memoised.
        let names = self.c.node_names();
        for p in self.api.values().filter(|p| p.node_name.is_none()) {
            let mut fresh = self.c.clone();
            fresh.memo = Default::default();
            let want = fresh.filter(p, &names, self.now);
            let got = self.c.clone().filter(p, &names, self.now);
            if got != want {
                return Err(format!(
                    "{}: memoised filter {got:?} != fresh {want:?}",
                    p.uid
                ));
            }
        }
        let caps: HashMap<String, u64> = nodes()
            .into_iter()
            .flat_map(|(_, i)| i.gpus.into_iter().map(|g| (g.uuid, g.memory)))
            .collect();
        // Per GPU: milli, device-mode caps, unified-memory resident shares.
        let mut used: HashMap<String, (u32, u64, u64)> = HashMap::new();
        for p in self.api.values() {
            if let Ok(Some(a)) = &p.allocation {
                let mut seen = HashSet::new();
                for u in &a.gpu_uuids {
                    if !seen.insert(u) {
                        return Err(format!("{} holds {u} twice", p.uid));
                    }
                    let e = used.entry(u.clone()).or_default();
                    e.0 += u32::from(a.granted.request_per_gpu().get());
                    match a.gpu_mem_resident {
                        None => e.1 += a.gpu_mem,
                        Some(r) => e.2 += r,
                    }
                }
            }
        }
        let factor = u128::from(Config::default().um_overcommit_milli);
        for (u, (m, d, um)) in used {
            let cap = caps[&u];
            // Device-mode caps never overcommit; unified-memory shares stay within the
            // factor of what they leave.
            if m > 1000 || d > cap || u128::from(um) * 1000 > factor * u128::from(cap - d) {
                return Err(format!(
                    "{u}: {m} milli, {d} bytes of device caps, {um} of unified shares given out of {cap}"
                ));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_gpu_is_ever_overcommitted(ops in proptest::collection::vec(op(), 1..150)) {
        let mut w = World::new();
        for o in &ops {
            w.step(o);
            if let Err(e) = w.check() {
                return Err(TestCaseError::fail(format!("after {o:?}: {e}")));
            }
        }
        // Finish the binds, catch up with the watch and the checks, restart: the
        // books agree with the truth.
        while !w.inflight.is_empty() {
            w.step(&Op::Post(0, 0));
        }
        w.step(&Op::GiveUp);
        w.step(&Op::Deliver(usize::MAX / 2));
        w.step(&Op::Tick(CHECK_MS));
        w.step(&Op::Deliver(usize::MAX / 2));
        let before: Vec<(String, u32, u64, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used, g.um_resident)).collect();
        let reserved = w.c.booking_counts().2;
        w.restart();
        let after: Vec<(String, u32, u64, u64)> = w.c.usage().iter()
            .map(|g| (g.uuid.clone(), g.used_milli, g.mem_used, g.um_resident)).collect();
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

// ---------------------------------------------------------------- the demo

/// The `make demo` cluster (hack/demo.sh): 2 H100 nodes and 2 A100 nodes, 4 GPUs each.
fn demo_cluster() -> Cluster {
    let mut c = Cluster::new(Config::default());
    for n in 0..4u32 {
        let (model, mem) = if n < 2 {
            ("NVIDIA-H100-80GB-HBM3", 80)
        } else {
            ("NVIDIA-A100-SXM4-40GB", 40)
        };
        c.apply_node(
            &format!("kwok-gpu-{n}"),
            Ok(Some(inv(n, 4, model, mem, &[]))),
        );
    }
    c
}

/// The demo's workloads (examples/*.yaml), one pod each.
fn demo_pods() -> Vec<PodInfo> {
    let a100 = ("gpu_model", "NVIDIA-A100-SXM4-40GB");
    let mut v = vec![
        pod(
            "notebook",
            &[
                ("gpu_request", "0.25"),
                ("gpu_limit", "0.5"),
                ("gpu_mem", "10Gi"),
            ],
        ),
        pod(
            "stage-1",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.4"),
                ("sched_affinity", "pipeline"),
            ],
        ),
        pod(
            "stage-2",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.4"),
                ("sched_affinity", "pipeline"),
            ],
        ),
        pod(
            "replica-a",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.3"),
                ("sched_anti-affinity", "replicas"),
            ],
        ),
        pod(
            "replica-b",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.3"),
                ("sched_anti-affinity", "replicas"),
            ],
        ),
        pod(
            "tenant-a",
            &[
                ("gpu_request", "0.4"),
                ("gpu_limit", "0.4"),
                a100,
                ("sched_exclusion", "tenant-a"),
            ],
        ),
        pod(
            "tenant-b",
            &[
                ("gpu_request", "0.4"),
                ("gpu_limit", "0.4"),
                a100,
                ("sched_exclusion", "tenant-b"),
            ],
        ),
        pod(
            "trainer",
            &[
                ("gpu_request", "2"),
                ("gpu_limit", "2"),
                ("gpu_model", "NVIDIA-H100-80GB-HBM3"),
            ],
        ),
    ];
    for i in 0..3 {
        v.push(pod(
            &format!("inference-{i}"),
            &[
                ("gpu_request", "0.3"),
                ("gpu_limit", "0.6"),
                ("priority", "50"),
            ],
        ));
        v.push(pod(
            &format!("allreduce-{i}"),
            &[
                ("gpu_request", "0.5"),
                ("gpu_limit", "0.5"),
                a100,
                ("group_name", "allreduce"),
                ("group_headcount", "3"),
                ("group_threshold", "1.0"),
            ],
        ));
    }
    v
}

/// Review finding (demo order): every pod of the demo is placed whatever order
/// the scheduler takes them in, with the tags honoured. (Without "the first pod
/// of an affinity tag takes the GPU with the most headroom" and "others leave
/// the room a tag's pending pods need", the reverse order strands stage-1.)
#[test]
fn the_demo_places_every_pod_in_any_order() {
    let base = demo_pods();
    let n = base.len();
    let mut orders: Vec<Vec<usize>> = vec![(0..n).collect(), (0..n).rev().collect()];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..40 {
        let mut o: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            o.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        orders.push(o);
    }
    for order in orders {
        let mut c = demo_cluster();
        let mut m: Vec<PodInfo> = order.iter().map(|&i| base[i].clone()).collect();
        // All exist before the scheduler starts (kubectl apply -f examples/).
        for p in &m {
            c.note_pod(p);
        }
        let got = schedule_group(&mut c, &mut m, 0);
        let names: Vec<&str> = m.iter().map(|p| p.uid.as_str()).collect();
        let at = |u: &str| {
            let i = names.iter().position(|n| *n == u).unwrap();
            got[i]
                .clone()
                .unwrap_or_else(|| panic!("{u} not placed in order {names:?}"))
        };
        for u in &names {
            at(u);
        }
        assert_eq!(gpu_of(&at("stage-1")), gpu_of(&at("stage-2")), "{names:?}");
        assert_ne!(gpu_of(&at("replica-a")), gpu_of(&at("replica-b")));
        assert_ne!(gpu_of(&at("tenant-a")), gpu_of(&at("tenant-b")));
        assert_eq!(at("trainer").gpu_uuids.len(), 2);
        c.check_invariants().unwrap();
    }
}

/// The same sequence of arrivals gives the same placement, run after run
/// (what `make demo` relies on when it applies its workloads one file at a time).
#[test]
fn the_demo_gives_the_same_table_for_the_same_order() {
    let run = || {
        let mut c = demo_cluster();
        let mut m = demo_pods();
        for p in &m {
            c.note_pod(p);
        }
        schedule_group(&mut c, &mut m, 0)
    };
    assert_eq!(run(), run());
}

#[test]
fn a_gpu_held_by_the_device_plugin_takes_no_pod_until_it_is_freed() {
    let mut held = inv(1, 2, "A", 40, &[]);
    held.gpus[0].held_by = Some("team/trainer".into());
    let mut c = cluster(&[("n1", held.clone())]);
    let a = schedule(&mut c, &mut frac("a", "0.5"), 0).unwrap();
    let b = schedule(&mut c, &mut frac("b", "0.5"), 0).unwrap();
    assert_eq!(a.gpu_uuids, vec![uuid(1, 1)]);
    assert_eq!(b.gpu_uuids, vec![uuid(1, 1)]);
    // The only GPU with room is the device plugin's: the reason says so.
    let f = schedule(&mut c, &mut frac("c", "0.5"), 0).unwrap_err();
    assert!(f.passed.is_empty());
    assert!(
        f.failed["n1"].contains("n1/gpu 0: given whole to pod team/trainer"),
        "{}",
        f.failed["n1"]
    );
    let mut solo = frac("solo", "0.5");
    let mut only_held = inv(2, 1, "A", 40, &[]);
    only_held.gpus[0].held_by = Some("team/trainer".into());
    c.apply_node("n2", Ok(Some(only_held.clone())));
    let f = c.filter(&solo, &["n2".to_string()], 0);
    let why = &f.failed["n2"];
    assert!(
        why.contains("gpu 0: given whole to pod team/trainer by the NVIDIA device plugin"),
        "{why}"
    );
    let whole = pod("whole", &[("gpu_request", "2"), ("gpu_limit", "2")]);
    let f = c.filter(&whole, &["n1".to_string()], 0);
    assert!(
        f.failed["n1"]
            .contains("0 of 2 whole GPUs free (1 given whole to pods by the NVIDIA device plugin)"),
        "{}",
        f.failed["n1"]
    );
    // Freed: the node daemon republishes the inventory without the holder.
    only_held.gpus[0].held_by = None;
    c.apply_node("n2", Ok(Some(only_held)));
    let a = schedule(&mut c, &mut solo, 0).unwrap();
    assert_eq!(a.gpu_uuids, vec![uuid(2, 0)]);
    held.gpus[0].held_by = None;
    c.apply_node("n1", Ok(Some(held)));
    // Packing fills n2's GPU first; then only the freed GPU has room.
    let x = schedule(&mut c, &mut frac("c", "0.5"), 0).unwrap();
    assert_eq!(x.gpu_uuids, vec![uuid(2, 0)]);
    let y = schedule(&mut c, &mut frac("d", "0.5"), 0).unwrap();
    assert_eq!(y.gpu_uuids, vec![uuid(1, 0)]);
}

/// After a burst of pods came and went, `compact` gives the per-pod tables'
/// space back, and the books still work (the next pod places as before).
#[test]
fn compact_gives_back_what_a_drained_burst_left() {
    let nodes: Vec<(String, NodeInventory)> = (0..64)
        .map(|n| {
            (
                format!("n{n:02}"),
                inv(n, 8, "NVIDIA H100 80GB HBM3", 80, &[]),
            )
        })
        .collect();
    let refs: Vec<(&str, NodeInventory)> =
        nodes.iter().map(|(n, i)| (n.as_str(), i.clone())).collect();
    let mut c = cluster(&refs);
    for i in 0..2000 {
        let mut p = frac(&format!("u{i}"), "0.25");
        schedule(&mut c, &mut p, 0).expect("room for 2,048 quarters");
    }
    let full = (c.pods.capacity(), c.bookings.capacity());
    for i in 0..2000 {
        c.delete_pod(&format!("u{i}"));
    }
    // A HashMap keeps (nearly all of) its table when its entries leave.
    assert!(c.pods.capacity() > 2000 && c.bookings.capacity() > 2000);
    c.compact();
    assert!(
        c.pods.capacity() < full.0 / 4,
        "{} of {}",
        c.pods.capacity(),
        full.0
    );
    assert!(
        c.bookings.capacity() < full.1 / 4,
        "{} of {}",
        c.bookings.capacity(),
        full.1
    );
    c.check_invariants().unwrap();
    let mut p = frac("after", "0.25");
    schedule(&mut c, &mut p, 0).expect("places after compaction");
}

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
