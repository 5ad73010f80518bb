//! The books against the API's view: binds rechecked, assumed binds, records (tampered,
//! unbound, unaddable), restarts, stale events, held GPUs and compaction.

use super::*;

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
        c.bind("q", "a", 0).unwrap_err().to_string(),
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
    assert!(
        c.bind("p", "a", 1)
            .unwrap_err()
            .to_string()
            .contains("being checked")
    );
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
    assert!(
        probs[0].error.to_string().contains("not bound"),
        "{probs:?}"
    );
    // On a bound pod that is not a KubeShare pod (default scheduler, no labels):
    // not booked either, as `kubectl sharedgpu` does not show it.
    let mut q = pod("q", &[]);
    q.kubeshare = false;
    q.node_name = Some("a".into());
    q.allocation = Ok(Some(record("a", &[uuid(1, 0)], 40 * GIB, 1000)));
    c.apply_pod(&q);
    assert_eq!(c.usage()[0].used_milli, 0);
    assert!(
        c.take_problems()[0]
            .error
            .to_string()
            .contains("not a KubeShare pod")
    );
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
    assert!(
        c.take_problems()[0]
            .error
            .to_string()
            .contains("changed after")
    );
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
    assert!(
        probs[0].error.to_string().contains("cannot be added"),
        "{probs:?}"
    );
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
