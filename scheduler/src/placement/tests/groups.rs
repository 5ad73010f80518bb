//! Coscheduling: all-or-nothing groups, reservations, the bind gate.

use super::*;

/// Schedules a group's members in order the way kube-scheduler does (filter,
/// prioritize, bind each); a member's bind may wait at the gate, and is answered
/// when a later member's bind releases the group. Returns what each got.
pub(super) fn schedule_group(
    c: &mut Cluster,
    m: &mut [PodInfo],
    now: u64,
) -> Vec<Option<Allocation>> {
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

pub(super) fn member(uid: &str, req: &str, head: &str) -> PodInfo {
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
    assert!(
        c.bind("m0", "a", 0)
            .unwrap_err()
            .to_string()
            .contains("not started")
    );
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
    assert!(c.leave_gate("g0").to_string().contains("group g"));
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
    assert!(
        c.bind("g0", "a", 0)
            .unwrap_err()
            .to_string()
            .contains("not started")
    );
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
