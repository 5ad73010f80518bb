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
    let mut c = cluster(&[
        ("n1", inv(1, 2, "A", 40, &[])),
        ("n2", inv(2, 2, "B", 40, &[])),
    ]);
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
    }
    c
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
