//! Preemption: which opportunistic pods a guaranteed pod evicts, the books while they
//! leave, and the property that the choice is minimal, allowed and keeps the books true.

use kubeshare_api::{GpuShare, Granted};

use super::*;

fn opp(uid: &str, req: &str, prio: i32) -> PodInfo {
    let mut p = frac(uid, req);
    p.pod_priority = prio;
    p
}

fn guar(uid: &str, req: &str, prio: i32) -> PodInfo {
    let mut p = pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1.0"),
            ("priority", "50"),
        ],
    );
    p.pod_priority = prio;
    p
}

fn member(uid: &str, req: &str, group: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1.0"),
            ("group_name", group),
            ("group_headcount", "2"),
            ("group_threshold", "1.0"),
        ],
    )
}

/// Books `p` as the watch shows a bound pod: on GPU `gpu` of `node` (number `n`).
fn observed(c: &mut Cluster, mut p: PodInfo, node: &str, n: u32, gpu: u32) {
    let d = p.demand.clone().unwrap().unwrap();
    let GpuShare::Fraction { request, limit, .. } = d.share else {
        panic!("fractions only")
    };
    p.node_name = Some(node.into());
    p.allocation = Ok(Some(Allocation {
        node: node.into(),
        gpu_uuids: vec![uuid(n, gpu)],
        gpu_mem: d.mem_on(40 * GIB),
        gpu_model: "A".into(),
        granted: Granted::Fraction { request, limit },
        gpu_mem_resident: None,
    }));
    c.apply_pod(&p);
    c.check_invariants().unwrap();
}

fn uids(o: &PreemptOrder) -> Vec<&str> {
    o.victims.iter().map(|v| v.uid.as_str()).collect()
}

#[test]
fn a_guaranteed_pod_evicts_the_fewest_opportunistic_pods_and_gets_their_room() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    for (u, r) in [("a", "0.5"), ("b", "0.25"), ("c", "0.25")] {
        schedule(&mut c, &mut opp(u, r, 0), 0).unwrap();
    }
    let mut g = guar("g", "0.5", 0);
    let names = c.node_names();
    let mut out = c.filter(&g, &names, 0);
    assert_eq!(out.kind, FilterKind::NoFit);
    let order = c.preempt(&g, &names, 0, &mut out).expect("preempts");
    assert_eq!(uids(&order), ["a"], "one pod rather than two");
    assert_eq!(
        (order.pods[0].node.as_str(), order.pods[0].gpus.as_slice()),
        ("n1", &[0][..])
    );
    assert_eq!(out.kind, FilterKind::Preempting);
    assert!(
        out.failed["n1"].contains("evicting 1 opportunistic pod(s) (ns/pod-a)"),
        "{out:?}"
    );
    assert!(c.take_nominations().iter().any(|n| n.name == "pod-g"));
    c.check_invariants().unwrap();

    // While the victim runs, the preemptor waits and its room stays booked.
    let f = c.filter(&g, &names, 1);
    assert_eq!(f.kind, FilterKind::Preempting);
    assert!(f.failed["n1"].contains("waiting for 1 of the 1"), "{f:?}");
    assert!(c.preempt(&g, &names, 1, &mut f.clone()).is_none());
    assert!(schedule(&mut c, &mut opp("d", "0.25", 0), 1).is_err());

    // Gone: the room is the preemptor's at once; nobody else gets it.
    c.delete_pod("a");
    c.check_invariants().unwrap();
    assert_eq!(c.booking_counts(), (2, 0, 1));
    let noms = c.take_nominations();
    assert!(
        noms.iter().any(|n| n.name == "pod-g" && n.node == "n1"),
        "{noms:?}"
    );
    assert!(schedule(&mut c, &mut opp("e", "0.25", 0), 2).is_err());
    let a = schedule(&mut c, &mut g, 2).expect("the preemptor binds");
    assert_eq!(a.gpu_uuids, [uuid(1, 0)]);
    assert_eq!(c.usage()[0].used_milli, 1000);
    assert!(c.preemptions().is_empty());
}

#[test]
fn never_a_guaranteed_pod_nor_a_higher_priority_class() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    schedule(&mut c, &mut guar("x", "0.5", 0), 0).unwrap();
    schedule(&mut c, &mut opp("y", "0.5", 5), 0).unwrap();
    let names = c.node_names();
    let g = guar("g", "0.5", 0);
    let mut out = c.filter(&g, &names, 0);
    assert!(c.plan_preemption(&g, &names).is_none());
    assert!(c.preempt(&g, &names, 0, &mut out).is_none());
    assert_eq!(out.kind, FilterKind::NoFit);
    // An opportunistic pod never preempts, whatever its PriorityClass.
    assert!(c.plan_preemption(&opp("o", "0.5", 100), &names).is_none());
    // With a PriorityClass as high as the victim's, it may.
    let g5 = guar("g5", "0.5", 5);
    let plan = c.plan_preemption(&g5, &names).expect("plan");
    assert_eq!(plan.victims, ["y"]);
    assert_eq!(plan.cost.top_priority, 5);
}

#[test]
fn a_group_is_evicted_whole_and_only_when_nothing_smaller_does() {
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    observed(&mut c, member("m1", "0.5", "grp"), "n1", 1, 0);
    observed(&mut c, member("m2", "0.5", "grp"), "n1", 1, 1);
    observed(&mut c, opp("s", "0.5", 0), "n1", 1, 0);
    observed(&mut c, opp("t", "0.5", 0), "n1", 1, 1);
    let names = c.node_names();
    let plan = c.plan_preemption(&guar("g", "0.5", 0), &names).unwrap();
    assert_eq!(plan.victims, ["s"], "one single pod, first by uid");
    // A pod that needs a whole GPU: the group alone (two pods) leaves s and t;
    // the group and one single pod (three) empty a GPU; s before t by uid.
    let plan = c.plan_preemption(&guar("w", "1.0", 0), &names).unwrap();
    assert_eq!(plan.victims, ["m1", "m2", "s"]);
    assert_eq!(plan.gpus, [0]);
    // Only the group left to evict: both members go, though one would free the room.
    c.delete_pod("s");
    c.delete_pod("t");
    schedule(&mut c, &mut guar("k0", "0.5", 0), 0).unwrap();
    schedule(&mut c, &mut guar("k1", "0.5", 0), 0).unwrap();
    let plan = c.plan_preemption(&guar("g", "0.5", 0), &names).unwrap();
    assert_eq!(plan.victims, ["m1", "m2"]);
    // A group with a member that may not be evicted is left alone.
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    let mut m = member("q1", "0.5", "hi");
    m.pod_priority = 9;
    observed(&mut c, m, "n1", 1, 0);
    observed(&mut c, member("q2", "0.5", "hi"), "n1", 1, 0);
    assert!(c.plan_preemption(&guar("g", "0.5", 0), &names).is_none());
}

#[test]
fn a_refused_eviction_sends_the_pod_elsewhere_and_a_deleted_preemptor_frees_the_room() {
    let mut c = cluster(&[
        ("n1", inv(1, 1, "A", 40, &[])),
        ("n2", inv(2, 1, "A", 40, &[])),
    ]);
    for (u, n) in [("a", 1), ("b", 1), ("c", 2), ("d", 2)] {
        observed(&mut c, opp(u, "0.5", 0), &format!("n{n}"), n, 0);
    }
    let names = c.node_names();
    let g = guar("g", "1.0", 0);
    let mut out = c.filter(&g, &names, 0);
    let o = c.preempt(&g, &names, 0, &mut out).unwrap();
    assert_eq!((o.pods[0].node.as_str(), uids(&o)), ("n1", vec!["a", "b"]));
    // One victim left; the other's eviction was refused (a PodDisruptionBudget).
    c.delete_pod("a");
    assert_eq!(
        c.usage()[0].used_milli,
        1000,
        "a's room is held while b stays"
    );
    c.preemption_refused(&o, 10);
    c.check_invariants().unwrap();
    assert_eq!(c.usage()[0].used_milli, 500, "a's room is free again");
    assert!(c.take_wake().contains(&("ns".into(), "pod-g".into())));
    let mut out = c.filter(&g, &names, 20);
    let o = c.preempt(&g, &names, 20, &mut out).unwrap();
    assert_eq!(o.pods[0].node, "n2", "the refused node is left out");
    // The preemptor is deleted before its victims leave: nothing stays held.
    c.delete_pod("c");
    c.delete_pod("g");
    c.check_invariants().unwrap();
    assert!(c.preemptions().is_empty());
    assert_eq!(c.usage()[1].used_milli, 500);
    // A preemption whose victims never leave is given up in time.
    let h = guar("h", "1.0", 0);
    let mut out = c.filter(&h, &names, 30_000);
    let o = c.preempt(&h, &names, 30_000, &mut out).unwrap();
    assert_eq!(
        o.pods[0].node, "n1",
        "g's refusal does not block another pod"
    );
    c.expire(30_000 + 120_000);
    assert!(c.preemptions().is_empty());
    assert!(c.take_wake().contains(&("ns".into(), "pod-h".into())));
    c.check_invariants().unwrap();
}

fn gmember(uid: &str, req: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1.0"),
            ("priority", "30"),
            ("group_name", "train"),
            ("group_headcount", "3"),
            ("group_threshold", "0.6"),
        ],
    )
}

/// A guaranteed group that cannot start preempts for ⌈0.6 × 3⌉ = 2 members at once:
/// one member fits as the books are and is held; one needs room; the third is not
/// placed (the quorum is enough). Both bind together once the victim has left.
#[test]
fn a_guaranteed_group_preempts_for_its_quorum_at_once() {
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    for (u, g) in [("a", 0), ("b", 0), ("c", 1)] {
        observed(&mut c, opp(u, "0.5", 0), "n1", 1, g);
    }
    let names = c.node_names();
    let ms: Vec<PodInfo> = ["m1", "m2", "m3"].map(|u| gmember(u, "0.5")).to_vec();
    for m in &ms {
        c.apply_pod(m);
    }
    let mut out = FilterOutcome::default();
    for m in &ms {
        out = c.filter(m, &names, 0);
    }
    assert_eq!(out.kind, FilterKind::GroupWaiting, "{out:?}");
    let o = c
        .preempt(&ms[2], &names, 0, &mut out)
        .expect("the group preempts");
    assert_eq!(o.group.as_ref().map(|g| g.name.as_str()), Some("train"));
    let who: Vec<&str> = o.pods.iter().map(|p| p.pod.uid.as_str()).collect();
    assert_eq!(who, ["m2"], "m1 fits on gpu 1 as the books are");
    assert_eq!(uids(&o), ["a"]);
    assert_eq!(c.booked("m1").map(|b| b.1), Some(vec![uuid(1, 1)]));
    assert_eq!(out.kind, FilterKind::Preempting);
    c.check_invariants().unwrap();
    // m1 waits at the gate (its group's quorum is not there); m2 waits for its victim.
    assert_eq!(c.bind("m1", "n1", 1), Ok(BindStep::Wait));
    assert_eq!(c.filter(&ms[1], &names, 1).kind, FilterKind::Preempting);
    c.delete_pod("a");
    c.check_invariants().unwrap();
    let f = c.filter(&ms[1], &names, 2);
    assert_eq!(f.passed, ["n1"]);
    let d = go(c.bind("m2", "n1", 2).unwrap());
    assert_eq!(d.allocation.unwrap().gpu_uuids, [uuid(1, 0)]);
    assert!(
        c.poll_gate("m1", "n1").unwrap().is_some(),
        "released together"
    );
    c.check_invariants().unwrap();
    assert!(c.usage().iter().all(|g| g.used_milli == 1000));
}

/// A refused eviction gives the whole group's preemption up, its held places too.
#[test]
fn a_refused_group_preemption_holds_nothing() {
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    for (u, g) in [("a", 0), ("b", 0), ("c", 1)] {
        observed(&mut c, opp(u, "0.5", 0), "n1", 1, g);
    }
    let names = c.node_names();
    let ms: Vec<PodInfo> = ["m1", "m2", "m3"].map(|u| gmember(u, "0.5")).to_vec();
    for m in &ms {
        c.apply_pod(m);
    }
    let mut out = FilterOutcome::default();
    for m in &ms {
        out = c.filter(m, &names, 0);
    }
    let o = c.preempt(&ms[2], &names, 0, &mut out).unwrap();
    c.preemption_refused(&o, 5);
    c.check_invariants().unwrap();
    assert_eq!(c.booking_counts(), (3, 0, 0));
    assert!(c.preemptions().is_empty());
    let wake = c.take_wake();
    assert!(wake.contains(&("ns".into(), "pod-m1".into())), "{wake:?}");
}

// ---------------------------------------------------------------- properties

/// Background pods: (request, opportunistic, spec.priority, anti-affinity tag).
fn background() -> impl Strategy<Value = Vec<(u8, bool, i32, bool)>> {
    proptest::collection::vec((0u8..4, any::<bool>(), 0i32..3, any::<bool>()), 2..14)
}

const REQ: [&str; 4] = ["0.25", "0.5", "0.75", "1.0"];

/// Two nodes of two GPUs (models A and B) with the background pods placed where they fit:
/// (request, opportunistic, spec.priority, anti-affinity tag) each.
fn with_background(bg: &[(u8, bool, i32, bool)]) -> Cluster {
    with_background_pods(bg).0
}

const BG_NODES: [(&str, u32, &str); 2] = [("n1", 1, "A"), ("n2", 2, "B")];

fn bg_cluster() -> Cluster {
    let nodes: Vec<(&str, NodeInventory)> = BG_NODES
        .iter()
        .map(|&(n, i, m)| (n, inv(i, 2, m, 40, &[])))
        .collect();
    cluster(&nodes)
}

/// [`with_background`], and the background pods as the API shows them (the placed
/// ones bound, with their records).
fn with_background_pods(bg: &[(u8, bool, i32, bool)]) -> (Cluster, Vec<PodInfo>) {
    let mut c = bg_cluster();
    let mut pods = Vec::new();
    for (i, &(r, o, sp, a)) in bg.iter().enumerate() {
        let mut kv = vec![("gpu_request", REQ[r as usize]), ("gpu_limit", "1")];
        if !o {
            kv.push(("priority", "10"));
        }
        if a {
            kv.push(("sched_anti-affinity", "s"));
        }
        let mut p = pod(&format!("b{i:02}"), &kv);
        p.pod_priority = sp;
        let _ = schedule(&mut c, &mut p, 0);
        pods.push(p);
    }
    (c, pods)
}

/// The preemptor: (kind, spec.priority, model B, anti-affinity tag).
fn preemptor() -> impl Strategy<Value = (u8, i32, bool, bool)> {
    (0u8..5, 0i32..3, any::<bool>(), any::<bool>())
}

fn preemptor_pod(kind: u8, prio: i32, model: bool, anti: bool) -> PodInfo {
    let mut kv: Vec<(&str, &str)> = match kind {
        0 => vec![("gpu_request", "0.5"), ("gpu_limit", "1")],
        1 => vec![("gpu_request", "0.75"), ("gpu_limit", "1")],
        2 => vec![("gpu_request", "1.0"), ("gpu_limit", "1")],
        3 => vec![
            ("gpu_request", "0.5"),
            ("gpu_limit", "1"),
            ("gpu_count", "2"),
        ],
        _ => vec![("gpu_request", "2"), ("gpu_limit", "2")],
    };
    kv.push(("priority", "20"));
    if model {
        kv.push(("gpu_model", "B"));
    }
    if anti {
        kv.push(("sched_anti-affinity", "s"));
    }
    let mut p = pod("pre", &kv);
    p.pod_priority = prio;
    p
}

/// Whether the pod fits some node once the pods `gone` are deleted (the books'
/// own filter on a copy: independent of the search).
fn fits_after(c: &Cluster, p: &PodInfo, gone: &[String]) -> bool {
    let mut c = c.clone();
    for u in gone {
        c.delete_pod(u);
    }
    let names = c.node_names();
    !c.filter(p, &names, 0).passed.is_empty()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, max_global_rejects: 1_000_000, ..ProptestConfig::default() })]

    /// The victims are allowed (opportunistic, spec.priority not above the
    /// preemptor's, groups whole), minimal (no proper subset of whole units
    /// makes room) and the cheapest of all sets that make room anywhere (an
    /// exhaustive search over the books' own filter); none means no set makes
    /// room. Once they leave, the pod is reserved and bound there, and no GPU is
    /// above 1.0 at any step.
    #[test]
    fn victims_are_allowed_minimal_and_cheapest(
        bg in background(),
        grp in proptest::option::of((0u8..2, 0usize..3, 0usize..3)),
        (kind, prio, model, anti) in preemptor(),
    ) {
        let mut c = with_background(&bg);
        // An opportunistic group of two on given GPUs, when they have room.
        if let Some((r, g1, g2)) = grp {
            let req = ["0.25", "0.5"][r as usize];
            let places = [("n1", 1, 0), ("n1", 1, 1), ("n2", 2, 0)];
            let free = |c: &Cluster, (n, _, g): (&str, u32, u32)| {
                c.usage().iter().find(|u| u.node == n && u.index == g).unwrap().used_milli
            };
            let need = if r == 0 { 250 } else { 500 };
            let (a, b) = (places[g1], places[g2]);
            let extra = if a == b { need } else { 0 };
            if free(&c, a) + need + extra <= 1000 && free(&c, b) + need <= 1000 {
                observed(&mut c, member("gm1", req, "grp"), a.0, a.1, a.2);
                observed(&mut c, member("gm2", req, "grp"), b.0, b.1, b.2);
            }
        }
        c.check_invariants().unwrap();
        let p = preemptor_pod(kind, prio, model, anti);
        let names = c.node_names();
        let mut out = c.filter(&p, &names, 0);
        prop_assume!(out.passed.is_empty());

        let units = c.victim_units(prio);
        prop_assume!(units.len() <= 12);
        // The oracle: every union of units, cheapest first.
        let mut best: Option<VictimCost> = None;
        for mask in 1u32..(1 << units.len()) {
            let pick: Vec<&_> = (0..units.len()).filter(|i| mask & (1 << i) != 0).map(|i| &units[i]).collect();
            let cost = pick.iter().fold(VictimCost::default(), |c, u| VictimCost {
                pods: c.pods + u.cost.pods,
                top_priority: if c.pods == 0 { u.cost.top_priority } else { c.top_priority.max(u.cost.top_priority) },
                priority_sum: c.priority_sum + u.cost.priority_sum,
                share: c.share + u.cost.share,
            });
            if best.is_some_and(|b| b <= cost) {
                continue;
            }
            let gone: Vec<String> = pick.iter().flat_map(|u| u.uids.clone()).collect();
            if fits_after(&c, &p, &gone) {
                best = Some(cost);
            }
        }
        let plan = c.plan_preemption(&p, &names);
        prop_assert_eq!(plan.as_ref().map(|p| p.cost), best, "{:?}", plan);
        let Some(plan) = plan else { return Ok(()) };

        // Allowed, and groups whole.
        for v in &plan.victims {
            let e = &c.pods[v];
            let d = e.demand.clone().unwrap().unwrap();
            prop_assert_eq!(d.priority, 0, "{} is guaranteed", v);
            prop_assert!(e.priority <= prio, "{} has a higher PriorityClass", v);
            if let Some(g) = &e.group {
                for m in c.groups[g].values().filter(|m| c.bookings.contains_key(*m)) {
                    prop_assert!(plan.victims.contains(m), "group {} split", g);
                }
            }
        }
        prop_assert!(fits_after(&c, &p, &plan.victims));
        // Minimal: no proper subset of its units makes room.
        let mine: Vec<&_> = units.iter().filter(|u| plan.victims.contains(&u.uids[0])).collect();
        for mask in 0u32..(1 << mine.len()) - 1 {
            let gone: Vec<String> = (0..mine.len()).filter(|i| mask & (1 << i) != 0).flat_map(|i| mine[i].uids.clone()).collect();
            prop_assert!(!fits_after(&c, &p, &gone), "a subset {:?} of {:?} would do", gone, plan.victims);
        }

        // Carried out: the books stay true at each step, the pod gets the room.
        let order = c.preempt(&p, &names, 0, &mut out).unwrap();
        prop_assert_eq!(&order.pods[0].node, &plan.node);
        c.check_invariants().unwrap();
        for v in &plan.victims {
            c.delete_pod(v);
            c.check_invariants().unwrap();
        }
        let mut p = p;
        let a = schedule(&mut c, &mut p, 1).expect("the preemptor binds where it preempted");
        prop_assert_eq!(&a.node, &plan.node);
        c.check_invariants().unwrap();
        prop_assert!(c.usage().iter().all(|g| g.used_milli <= 1000));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, max_global_rejects: 1_000_000, ..ProptestConfig::default() })]

    /// A guaranteed group that cannot start and preempts: its victims are allowed and
    /// groups whole, its quorum is placed, the books are true at every step while the
    /// victims leave, and once its members bind (through the gate) no GPU is above 1.0.
    #[test]
    fn a_group_preemption_keeps_the_books_true(
        bg in background(),
        (head, thr, req) in (2u32..4, 0usize..2, 0usize..2),
        prio in 0i32..3,
    ) {
        let mut c = with_background(&bg);
        let head_s = head.to_string();
        let ms: Vec<PodInfo> = (0..head)
            .map(|i| {
                let mut p = pod(
                    &format!("m{i}"),
                    &[
                        ("gpu_request", ["0.5", "0.25"][req]),
                        ("gpu_limit", "1"),
                        ("priority", "30"),
                        ("group_name", "tg"),
                        ("group_headcount", &head_s),
                        ("group_threshold", ["1.0", "0.6"][thr]),
                    ],
                );
                p.pod_priority = prio;
                p
            })
            .collect();
        for m in &ms {
            c.apply_pod(m);
        }
        let names = c.node_names();
        let mut out = FilterOutcome::default();
        for m in &ms {
            out = c.filter(m, &names, 0);
        }
        prop_assume!(out.kind == FilterKind::GroupWaiting);
        let last = ms.last().unwrap();
        let Some(o) = c.preempt(last, &names, 0, &mut out) else { return Ok(()) };
        c.check_invariants().unwrap();
        for v in &o.victims {
            let e = &c.pods[&v.uid];
            prop_assert_eq!(e.demand.clone().unwrap().unwrap().priority, 0);
            prop_assert!(e.priority <= prio);
            if let Some(g) = &e.group {
                for m in c.groups[g].values().filter(|m| c.bookings.contains_key(*m)) {
                    prop_assert!(o.victims.iter().any(|v| &v.uid == m), "group {} split", g);
                }
            }
        }
        let held = ms.iter().filter(|m| c.bookings.contains_key(&m.uid)).count();
        let min = ms[0].demand.clone().unwrap().unwrap().group.unwrap().min_members() as usize;
        prop_assert!(held + o.pods.len() >= min, "{} held + {} preempting < {}", held, o.pods.len(), min);
        for v in &o.victims {
            c.delete_pod(&v.uid);
            c.check_invariants().unwrap();
        }
        let reserved: Vec<(String, String)> = ms
            .iter()
            .filter_map(|m| c.booked(&m.uid).map(|(n, _)| (m.uid.clone(), n)))
            .collect();
        for p in &o.pods {
            prop_assert!(reserved.iter().any(|(u, _)| *u == p.pod.uid), "{} has no place", p.pod.uid);
        }
        for (u, n) in &reserved {
            c.bind(u, n, 1).unwrap();
            c.check_invariants().unwrap();
        }
        prop_assert_eq!(c.booking_counts().2, 0, "every member released at the gate");
        prop_assert!(c.usage().iter().all(|g| g.used_milli <= 1000));
    }
}

// ---------------------------------------------------------------- restarts

/// A fresh extender's books after a restart: the nodes, then `pods` as the watch
/// lists them.
fn restarted(pods: &[PodInfo]) -> Cluster {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    for p in pods {
        c.apply_pod(p);
    }
    c.check_invariants().unwrap();
    c
}

/// Two opportunistic halves fill n1's one GPU; a guaranteed half preempts `a`.
/// Returns the pods as the API shows them (`g` carrying its record, decided at
/// wall time 1,000) and the order.
fn preempted_half() -> (Vec<PodInfo>, PodInfo, PreemptOrder) {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    let (mut a, mut b) = (opp("a", "0.5", 0), opp("b", "0.5", 0));
    schedule(&mut c, &mut a, 0).unwrap();
    schedule(&mut c, &mut b, 0).unwrap();
    let mut g = guar("g", "0.5", 0);
    let names = c.node_names();
    let mut out = c.filter(&g, &names, 0);
    let order = c.preempt(&g, &names, 0, &mut out).expect("preempts");
    assert_eq!(uids(&order), ["a"]);
    let recs = PreemptRecord::of_order(&order, 1_000);
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].0.uid, "g");
    // Through the annotation, as the API keeps it.
    g.preemption = PreemptRecord::from_annotation(&recs[0].1.to_annotation());
    assert_eq!(g.preemption.as_ref(), Some(&recs[0].1));
    (vec![a, b], g, order)
}

#[test]
fn a_restarted_extender_waits_for_a_leaving_victim_and_keeps_its_room() {
    let (mut pods, g, _) = preempted_half();
    // Evicted before the restart: `a` is terminating (it still holds its half).
    pods[0].terminating = true;
    pods.push(g.clone());
    let mut c = restarted(&pods);
    let names = c.node_names();
    // Nothing is decided before the records are taken up.
    let r = c.resume_preemptions(5, 1_500);
    assert_eq!(r.count, 1);
    assert!(r.orders.is_empty(), "a leaving victim is not evicted again");
    assert_eq!(c.resume_preemptions(6, 1_600), Resumed::default(), "once");
    assert_eq!(
        c.preemptions()["g"],
        ("n1".to_string(), vec!["a".to_string()])
    );
    // The preemptor waits; it evicts nobody else; nobody takes the room.
    let mut f = c.filter(&g, &names, 10);
    assert!(f.failed["n1"].contains("waiting for 1 of the 1"), "{f:?}");
    assert!(c.preempt(&g, &names, 10, &mut f).is_none());
    let mut rival = opp("rival", "0.5", 0);
    assert!(schedule(&mut c, &mut rival, 10).is_err());
    c.delete_pod("a");
    c.check_invariants().unwrap();
    assert!(schedule(&mut c, &mut rival, 11).is_err(), "the room is g's");
    let noms = c.take_nominations();
    assert!(
        noms.iter().any(|n| n.name == "pod-g" && n.node == "n1"),
        "{noms:?}"
    );
    let mut g = g;
    let a = schedule(&mut c, &mut g, 12).expect("the preemptor binds");
    assert_eq!(a.node, "n1");
    assert_eq!(c.usage()[0].used_milli, 1000);
    assert!(c.preemptions().is_empty());
}

#[test]
fn a_restart_before_the_evictions_posts_them_again_and_only_them() {
    let (mut pods, g, order) = preempted_half();
    pods.push(g.clone());
    let mut c = restarted(&pods);
    let r = c.resume_preemptions(0, 2_000);
    assert_eq!(r.count, 1);
    assert_eq!(r.orders.len(), 1);
    let o = &r.orders[0];
    assert!(o.resumed);
    assert_eq!(o.victims, order.victims, "the same victim, no other");
    assert_eq!(o.pods, order.pods);
    c.check_invariants().unwrap();
}

#[test]
fn a_restart_after_the_victims_left_reserves_their_room_at_once() {
    let (pods, g, _) = preempted_half();
    // `a` is gone; the restarted extender has not seen it leave.
    let mut c = restarted(&[pods[1].clone(), g.clone()]);
    assert_eq!(c.usage()[0].used_milli, 500);
    let r = c.resume_preemptions(0, 2_000);
    assert_eq!((r.count, r.orders.len()), (1, 0));
    assert_eq!(c.booking_counts(), (1, 0, 1), "g's room is reserved");
    let mut rival = opp("rival", "0.5", 0);
    assert!(schedule(&mut c, &mut rival, 1).is_err());
    let mut g = g;
    assert_eq!(schedule(&mut c, &mut g, 1).unwrap().node, "n1");
    c.check_invariants().unwrap();
}

#[test]
fn records_that_are_old_forged_or_done_are_ignored() {
    let (pods, g, _) = preempted_half();
    // Older than the preemption timeout: the pod searches as any pod.
    let mut c = restarted(&[pods[0].clone(), pods[1].clone(), g.clone()]);
    let r = c.resume_preemptions(0, 1_000 + crate::placement::preempt::PREEMPTION_TIMEOUT_MS);
    assert_eq!(r, Resumed::default());
    assert!(c.preemptions().is_empty());
    // A record naming a guaranteed pod or one of a higher PriorityClass: neither
    // is waited for nor evicted.
    let mut c = cluster(&[("n1", inv(1, 1, "A", 40, &[]))]);
    let mut x = guar("x", "0.5", 0);
    schedule(&mut c, &mut x, 0).unwrap();
    let mut y = opp("y", "0.5", 9);
    schedule(&mut c, &mut y, 0).unwrap();
    let mut forged = guar("f", "0.5", 0);
    forged.preemption = Some(PreemptRecord {
        node: "n1".into(),
        gpus: vec![0],
        victims: vec!["x".into(), "y".into()],
        at: 1_000,
    });
    c.apply_pod(&forged);
    let r = c.resume_preemptions(0, 1_000);
    assert!(r.orders.is_empty(), "{r:?}");
    assert!(c.preemptions().is_empty());
    assert_eq!(
        c.booking_counts(),
        (2, 0, 0),
        "no room to reserve, nothing held"
    );
    // A bound preemptor, or an opportunistic pod with a record: nothing.
    let (mut pods, mut g, _) = preempted_half();
    g.node_name = Some("n1".into());
    pods.push(g);
    let mut o = opp("o", "0.5", 0);
    o.preemption = pods[2].preemption.clone();
    pods.push(o);
    let mut c = restarted(&pods);
    assert_eq!(c.resume_preemptions(0, 1_000), Resumed::default());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, max_global_rejects: 1_000_000, ..ProptestConfig::default() })]

    /// The extender restarts at any point of a preemption: some victims gone, some
    /// leaving, the rest not evicted yet. The new one, from the pods alone (their
    /// records and the preemptor's), evicts again only the victims the plan named
    /// that are neither gone nor leaving, starts no other preemption for the pod,
    /// gives its room to no other pod, and the pod binds where it was planned; no
    /// GPU is above 1.0 at any step.
    #[test]
    fn a_restart_mid_preemption_keeps_the_plan(
        bg in background(),
        (kind, prio, model, anti) in preemptor(),
        gone in 0usize..8,
        leaving in any::<u8>(),
        rival_req in 0usize..4,
    ) {
        let (mut c, bg_pods) = with_background_pods(&bg);
        let mut p = preemptor_pod(kind, prio, model, anti);
        let names = c.node_names();
        let mut out = c.filter(&p, &names, 0);
        prop_assume!(out.passed.is_empty());
        let Some(order) = c.preempt(&p, &names, 0, &mut out) else { return Ok(()) };
        let node = order.pods[0].node.clone();
        let victims: Vec<String> = uids(&order).into_iter().map(String::from).collect();
        p.preemption = Some(PreemptRecord::of_order(&order, 1_000).remove(0).1);
        // What the API shows at the restart.
        let gone = gone.min(victims.len());
        let mut listed: Vec<PodInfo> = Vec::new();
        for b in &bg_pods {
            let Some(i) = victims.iter().position(|v| *v == b.uid) else {
                listed.push(b.clone());
                continue;
            };
            if i < gone {
                continue;
            }
            let mut b = b.clone();
            b.terminating = leaving & (1 << (i % 8)) != 0;
            listed.push(b);
        }
        listed.push(p.clone());
        let mut c = bg_cluster();
        for l in &listed {
            c.apply_pod(l);
        }
        c.check_invariants().unwrap();
        let r = c.resume_preemptions(0, 1_500);
        prop_assert_eq!(r.count, 1);
        let mut again: Vec<&str> = r.orders.iter().flat_map(|o| o.victims.iter().map(|v| v.uid.as_str())).collect();
        again.sort();
        let want: Vec<&str> = listed
            .iter()
            .filter(|l| victims.contains(&l.uid) && !l.terminating)
            .map(|l| l.uid.as_str())
            .collect();
        prop_assert_eq!(again, want);
        // The victims leave; a rival asks for room at every step.
        let mut rivals = 0;
        let mut rival = |c: &mut Cluster, step: u64| {
            rivals += 1;
            let mut r = pod(&format!("r{rivals}"), &[("gpu_request", REQ[rival_req]), ("gpu_limit", "1")]);
            let _ = schedule(c, &mut r, step);
            c.check_invariants().unwrap();
        };
        rival(&mut c, 1);
        let still: Vec<String> = listed.iter().filter(|l| victims.contains(&l.uid)).map(|l| l.uid.clone()).collect();
        for v in &still {
            let names = c.node_names();
            let mut f = c.filter(&p, &names, 2);
            prop_assert_eq!(f.kind, FilterKind::Preempting);
            prop_assert!(c.preempt(&p, &names, 2, &mut f).is_none(), "a second preemption");
            c.delete_pod(v);
            c.check_invariants().unwrap();
            rival(&mut c, 3);
        }
        let a = schedule(&mut c, &mut p, 4).expect("the preemptor binds where it preempted");
        prop_assert_eq!(&a.node, &node);
        c.check_invariants().unwrap();
        prop_assert!(c.usage().iter().all(|g| g.used_milli <= 1000));
    }
}

#[test]
fn the_room_a_waiting_preemptor_needs_beyond_its_victims_is_promised_to_it() {
    // n1: gpu 0 holds two opportunistic quarters, gpu 1 is free. A guaranteed pod of
    // two whole GPUs evicts both quarters and needs gpu 1 too.
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    for u in ["a", "b"] {
        let mut p = opp(u, "0.25", 0);
        schedule(&mut c, &mut p, 0).unwrap();
        assert_eq!(p.allocation.unwrap().unwrap().gpu_uuids, [uuid(1, 0)]);
    }
    let g = pod(
        "g",
        &[("gpu_request", "2"), ("gpu_limit", "2"), ("priority", "50")],
    );
    let names = c.node_names();
    let mut out = c.filter(&g, &names, 0);
    let order = c.preempt(&g, &names, 0, &mut out).expect("preempts");
    assert_eq!(uids(&order), ["a", "b"]);
    // While they leave, gpu 1 (free) and the half left on gpu 0 are the preemptor's.
    let f = schedule(&mut c, &mut opp("r1", "0.25", 0), 1).unwrap_err();
    assert_eq!(
        f.failed["n1"],
        "n1/gpu 0: 0.0 free < 0.25 requested, counting 0.5 promised to preempting pod(s) ns/pod-g"
    );
    c.delete_pod("a");
    assert!(schedule(&mut c, &mut opp("r2", "0.25", 0), 2).is_err());
    c.delete_pod("b");
    c.check_invariants().unwrap();
    // The last victim gone: the room is reserved for it, then bound.
    assert!(schedule(&mut c, &mut opp("r3", "0.25", 0), 3).is_err());
    let mut g = g;
    let a = schedule(&mut c, &mut g, 3).expect("the preemptor binds");
    assert_eq!(a.gpu_uuids.len(), 2);
    // An abandoned preemption gives its promise back.
    let mut c = cluster(&[("n1", inv(1, 2, "A", 40, &[]))]);
    schedule(&mut c, &mut opp("a", "0.25", 0), 0).unwrap();
    let g = pod(
        "g",
        &[("gpu_request", "2"), ("gpu_limit", "2"), ("priority", "50")],
    );
    let mut out = c.filter(&g, &names, 0);
    c.preempt(&g, &names, 0, &mut out).expect("preempts");
    assert!(schedule(&mut c, &mut opp("r", "0.5", 0), 1).is_err());
    c.delete_pod("g");
    assert!(schedule(&mut c, &mut opp("r", "0.5", 0), 2).is_ok());
}
