//! Hand-overs at the drain (`handover.rs`): the next client is granted when the holder says it
//! drains, the holder is charged up to its drain's end, the next one from there.

use super::*;

fn is_yield_to(a: &Action, conn: ConnId) -> bool {
    matches!(a, Action::Yield { conn: c } if *c == conn)
}

/// [`two`] with a (conn 1) holding from t(0) for its 10 ms quota and b (conn 3) waiting.
fn a_holds_b_waits() -> Core {
    let mut c = two();
    assert_eq!(
        grant(&c.token_request(t(0), 1, 0, 0)).map(|g| g.2),
        Some(10 * MS)
    );
    assert!(grant(&c.token_request(t(1), 3, 0, 0)).is_none());
    c
}

#[test]
fn a_renew_while_another_waits_hands_the_token_on_and_the_drain_is_charged_to_the_holder() {
    let mut c = a_holds_b_waits();
    // a's quota ends with 400 µs of its work still queued; its Renew is not granted (b waits),
    // and b is granted now, not after a's drain and report.
    let acts = c.renew(t(10), 1, 10 * MS);
    assert_eq!(grant(&acts).map(|g| (g.0, g.1)), Some(("b", vec![3])));
    assert!(acts.iter().any(|a| is_yield_to(a, 1)), "{acts:?}");
    assert_eq!(c.holder(), Some("b"));
    let b_quota = grant(&acts).unwrap().2;
    // a drained and asks again, reporting 400 µs past its quota: charged to it, and b's hold
    // counts from there (b's work queued behind the drain).
    assert!(grant(&c.token_request(t(10) + 400, 1, 400, 10 * MS)).is_none());
    assert_eq!(c.usage_us(t(11), "a"), Some(10 * MS + 400));
    assert_eq!(c.usage_us(t(11), "b"), Some(MS - 400));
    // b's hold ends at its quota (its deadline counts from its grant): charged its quota less
    // the drain it waited for, and a gets the token.
    let end = t(10) + b_quota;
    let acts = c.token_request(end, 3, 0, b_quota);
    assert_eq!(grant(&acts).map(|g| g.0), Some("a"));
    assert_eq!(c.usage_us(end, "b"), Some(b_quota - 400));
    assert_eq!(c.usage_us(end, "a"), Some(10 * MS + 400));
}

#[test]
fn a_hold_that_expired_while_its_process_waited_is_handed_on_and_charged_by_its_release() {
    // The hook's idle thread ends a hold nobody ends by launching: Renew, then (Yield) the
    // drain and a Release with the time used.
    let mut c = a_holds_b_waits();
    let acts = c.renew(t(10) + 100, 1, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    c.release(t(12), 1, 12 * MS);
    assert_eq!(c.usage_us(t(13), "a"), Some(12 * MS));
    assert_eq!(c.usage_us(t(13), "b"), Some(MS));
    // Its next request reports the overrun again (the hook learns nothing new): charged once.
    c.token_request(t(14), 1, 2 * MS, 10 * MS);
    assert_eq!(c.usage_us(t(14), "a"), Some(12 * MS));
}

#[test]
fn a_drain_that_ends_before_the_notice_arrives_leaves_the_next_hold_from_its_grant() {
    let mut c = a_holds_b_waits();
    assert_eq!(grant(&c.renew(t(10), 1, 10 * MS)).map(|g| g.0), Some("b"));
    // Nothing was queued: no overuse.
    c.token_request(t(10) + 20, 1, 0, 10 * MS);
    assert_eq!(c.usage_us(t(11), "a"), Some(10 * MS));
    assert_eq!(c.usage_us(t(11), "b"), Some(MS));
}

/// [`two`] with a (conn 1) having reported a 30 ms drain (its usual overrun: too long to be
/// handed over from at its notice), holding again from t(40) to its quota's end at t(50), and
/// b (conn 3) waiting.
fn a_drains_long_b_waits() -> Core {
    let mut c = two();
    let q = grant(&c.token_request(t(0), 1, 0, 0)).unwrap().2;
    assert_eq!(q, 10 * MS);
    let (_, _, q) = grant(&c.token_request(t(40), 1, 30 * MS, q)).unwrap();
    assert_eq!(q, 10 * MS);
    assert!(grant(&c.token_request(t(41), 3, 0, 0)).is_none());
    c
}

#[test]
fn a_holder_that_said_it_drains_keeps_the_token_past_the_grace_until_its_report() {
    // Granted at the grace's end, b would run beside a's drain (the GPU time-slices the two
    // contexts) and a's report would charge a for the time they shared.
    let mut c = a_drains_long_b_waits();
    assert!(
        grant(&c.drain(t(50), 1)).is_none(),
        "its drains are too long to hand over from"
    );
    assert_eq!(c.next_wakeup(t(50)), Some(t(50) + 4 * 30 * MS));
    assert!(
        grant(&c.tick(t(56))).is_none(),
        "past the grace, a still drains"
    );
    assert_eq!(c.holder(), Some("a"));
    // Its report, 70 ms past its quota: b goes now, and a is charged its whole drain.
    let acts = c.token_request(t(120), 1, 70 * MS, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(120), "a"), Some(40 * MS + 80 * MS));
    assert_eq!(c.usage_us(t(120), "b"), Some(0));

    // The same notice as a Renew answered Yield.
    let mut c = a_drains_long_b_waits();
    let acts = c.renew(t(50), 1, 10 * MS);
    assert!(acts.iter().any(|a| is_yield_to(a, 1)), "{acts:?}");
    assert!(grant(&c.tick(t(56))).is_none());
    assert_eq!(c.holder(), Some("a"));
}

#[test]
fn a_draining_holder_that_never_reports_loses_the_token_after_four_usual_drains() {
    let mut c = a_drains_long_b_waits();
    c.drain(t(50), 1);
    assert!(grant(&c.tick(t(169))).is_none());
    assert_eq!(grant(&c.tick(t(170))).map(|g| g.0), Some("b"));
    // Without the notice (a hook that hangs in its hold), the grace alone, as before.
    let mut c = a_drains_long_b_waits();
    assert_eq!(c.next_wakeup(t(50)), Some(t(55)));
    assert_eq!(grant(&c.tick(t(55))).map(|g| g.0), Some("b"));
}

#[test]
fn a_drain_notice_hands_the_token_on_without_a_reply() {
    // A hook that does not renew says Drain: the same hand-over, nothing answers the Drain.
    let mut c = a_holds_b_waits();
    let acts = c.drain(t(10), 1);
    assert_eq!(acts.len(), 1, "{acts:?}");
    assert_eq!(grant(&acts).map(|g| (g.0, g.1)), Some(("b", vec![3])));
    c.token_request(t(10) + 300, 1, 300, 10 * MS);
    assert_eq!(c.usage_us(t(11), "a"), Some(10 * MS + 300));
    assert_eq!(c.usage_us(t(11), "b"), Some(MS - 300));
    // A Drain from one who does not hold, from before Hello, or with no one waiting: nothing.
    assert!(c.drain(t(11), 1).is_empty());
    assert!(c.drain(t(11), 42).is_empty());
    let mut alone = two();
    alone.token_request(t(0), 1, 0, 0);
    assert!(alone.drain(t(10), 1).is_empty());
    assert_eq!(alone.holder(), Some("a"));
}

/// a (conn 1, request 0.5) and b (conn 3, request 0.02) after four turns of b's, each
/// asked for with `burst` and released at its quota: b is far past its request, a has had
/// nothing. The time after b's last turn. The starvation bound is off: b waits until a is
/// back at its request, not just a few of a's turns (`above_due_in`).
fn b_past_its_request(burst: Micros) -> (Core, Micros) {
    let mut c = Core::new(
        params(),
        &[spec("a", 500, 1000, 100), spec("b", 20, 1000, 100)],
        0,
    );
    c.set_max_wait(0);
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    let mut now = t(0);
    for _ in 0..4 {
        let (_, _, q) = grant(&c.token_request(now, 3, 0, burst)).unwrap();
        now += q;
        c.release(now, 3, q);
    }
    (c, now)
}

#[test]
fn a_holder_that_would_go_next_anyway_keeps_its_hold_until_its_report() {
    // b (request 0.02) has used more than its request; a (0.5) is below its own: a goes first
    // at every hand-over, so its notice hands nothing on, and its Renew is granted straight
    // back (its queue stays: no drain, no gap on the GPU, though b waits) where its Grants say
    // whether b goes at their end.
    let (mut c, now) = b_past_its_request(10 * MS);
    assert!(grant(&c.token_request(now, 1, 0, 0)).is_some());
    assert!(!c.handover_due("a"), "nobody waited at a's grant");
    assert!(grant(&c.token_request(now + MS, 3, 0, 0)).is_none());
    // A hook with renewals off says Drain: the hold stands, a drains, asks and has the token
    // again.
    let mut off = c.clone();
    assert!(off.drain(now + 10 * MS, 1).is_empty());
    assert_eq!(off.holder(), Some("a"));
    let acts = off.token_request(now + 10 * MS + 300, 1, 300, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("a"));
    // A hook whose Grants do not say whether b goes at their end (no gate page) would take
    // renewals in a row for keeping the GPU and queue deep into b's turn: Yield, and the hold
    // stands until its report.
    let mut untold = c.clone();
    let acts = untold.renew(now + 10 * MS, 1, 10 * MS);
    assert!(matches!(&acts[..], [a] if is_yield_to(a, 1)), "{acts:?}");
    assert_eq!(untold.holder(), Some("a"));
    c.set_told_handover_due(1);
    let acts = c.renew(now + 10 * MS, 1, 10 * MS);
    assert_eq!(
        grant(&acts).map(|g| (g.0, g.1)),
        Some(("a", vec![1])),
        "{acts:?}"
    );
    assert!(!acts.iter().any(|a| is_yield_to(a, 1)), "{acts:?}");
    assert_eq!(c.holder(), Some("a"));
    assert!(!c.handover_due("nobody"));
}

#[test]
fn a_renewal_says_whether_the_waiting_client_goes_at_its_end() {
    // b (request 0.02) has had four turns, past its request; a (0.5) is below its own, so it
    // goes first and is renewed while b waits (246 times here, until a has had its request
    // over the window), each Grant saying whether b goes at that hold's end, for the hook to
    // narrow its queue toward it. It says so exactly once, at the last renewal, and b goes at
    // that end.
    let (mut c, mut now) = b_past_its_request(0);
    c.set_told_handover_due(1);
    let (_, _, mut q) = grant(&c.token_request(now, 1, 0, 0)).unwrap();
    assert!(grant(&c.token_request(now + 100, 3, 0, 0)).is_none());
    let mut renewed = 0;
    loop {
        let due = c.handover_due("a");
        now += q;
        let acts = c.renew(now, 1, q);
        match grant(&acts) {
            Some(("a", _, next)) => {
                assert!(!due, "renewed at the end of a hold said to hand over");
                renewed += 1;
                q = next;
            }
            _ => {
                assert!(
                    due,
                    "b went at the end of a hold not said to hand over: {acts:?}"
                );
                assert_eq!(c.holder(), Some("b"));
                break;
            }
        }
        assert!(renewed < 1000, "b never goes");
    }
    assert!(renewed >= 100, "renewed {renewed} times");
}

#[test]
fn a_hold_of_two_processes_is_not_handed_on_at_one_of_them() {
    // The other process still launches in the hold: its client's hold ends with the last
    // report, as before.
    let mut c = two_processes_hold_b_waits();
    let acts = c.renew(t(10), 1, 10 * MS);
    assert!(matches!(&acts[..], [a] if is_yield_to(a, 1)), "{acts:?}");
    assert!(c.drain(t(10), 2).is_empty());
    assert_eq!(c.holder(), Some("a"));
}

#[test]
fn with_hand_overs_at_the_drain_off_the_hold_stands_until_the_report() {
    let mut c = a_holds_b_waits();
    c.set_hand_over_at_drain(false);
    let acts = c.renew(t(10), 1, 10 * MS);
    assert!(matches!(&acts[..], [a] if is_yield_to(a, 1)), "{acts:?}");
    assert!(c.drain(t(10), 1).is_empty());
    assert_eq!(c.holder(), Some("a"));
    // The holder drains and asks: now the waiting client gets the token.
    let acts = c.token_request(t(10) + 400, 1, 400, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(11), "a"), Some(10 * MS + 400));
}

#[test]
fn a_holder_that_parks_is_not_handed_over_from_but_the_next_is_told_soon() {
    // a's drains are short, but its connection parks: its hook stops the GPU at a wait after
    // the notice and can tell where only while no other context runs. b is told Soon; the
    // token goes on at a's report, as for a holder whose drains run long.
    let mut c = a_holds_b_waits();
    c.set_soon(true);
    c.set_parks(1);
    let acts = c.renew(t(10), 1, 10 * MS);
    assert_eq!(acts.len(), 2, "{acts:?}");
    assert_eq!(acts[0], Action::Soon { conns: vec![3] });
    assert!(is_yield_to(&acts[1], 1), "{acts:?}");
    assert_eq!(c.holder(), Some("a"));
    let acts = c.token_request(t(10) + 200, 1, 200, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"), "{acts:?}");
    // A connection gem-schd does not know changes nothing.
    c.set_parks(99);
}

/// `a` holds after a turn whose drain ran 2 ms past its quota, `b` waits; `drain_max` as set
/// by `Core::set_handover_drain_max`.
fn a_drained_long_b_waits(drain_max: Option<Micros>) -> Core {
    let mut c = two();
    c.set_handover_drain_max(drain_max);
    assert!(grant(&c.token_request(t(0), 1, 0, 0)).is_some());
    assert!(grant(&c.token_request(t(10) + 2 * MS, 1, 2 * MS, 10 * MS)).is_some());
    assert!(grant(&c.token_request(t(13), 3, 0, 0)).is_none());
    c
}

#[test]
fn a_holder_whose_drains_run_long_is_not_handed_over_from() {
    // What the next client would run beside a long drain is charged to the holder: a holder
    // whose last drain (2 ms) ran past a fifth of the min quota (2 ms: 0.4 ms) keeps its hold
    // until its report, as before.
    let mut c = a_drained_long_b_waits(None);
    let acts = c.renew(t(22), 1, 10 * MS);
    assert!(matches!(&acts[..], [a] if is_yield_to(a, 1)), "{acts:?}");
    assert!(c.drain(t(22), 1).is_empty());
    assert_eq!(c.holder(), Some("a"));
}

#[test]
fn a_raised_drain_bound_hands_over_from_a_holder_whose_drains_run_long() {
    // Just below the drain it reported, the hold still stands; at it, the Yield hands on.
    let mut c = a_drained_long_b_waits(Some(2 * MS - 1));
    let acts = c.renew(t(22), 1, 10 * MS);
    assert!(matches!(&acts[..], [a] if is_yield_to(a, 1)), "{acts:?}");
    assert_eq!(c.holder(), Some("a"));
    let mut c = a_drained_long_b_waits(Some(2 * MS));
    let acts = c.renew(t(22), 1, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"), "{acts:?}");
    assert!(acts.iter().any(|a| is_yield_to(a, 1)), "{acts:?}");
    assert_eq!(c.holder(), Some("b"));
}

#[test]
fn a_notice_that_cannot_hand_over_tells_the_next_client_soon_and_changes_nothing_else() {
    // a's drains run long, so its notice does not hand the token on; with Soon on, b (conn 3),
    // who goes next, is told so, and the hold, the queue and the decision after a's report are
    // those without Soon.
    let mut off = a_drained_long_b_waits(None);
    let mut on = a_drained_long_b_waits(None);
    on.set_soon(true);
    let acts = on.renew(t(22), 1, 10 * MS);
    assert_eq!(acts.len(), 2, "{acts:?}");
    assert_eq!(acts[0], Action::Soon { conns: vec![3] });
    assert!(is_yield_to(&acts[1], 1), "{acts:?}");
    assert!(!acts[0].answers(3), "Soon is no answer: b's Grant follows");
    assert_eq!(
        off.renew(t(22), 1, 10 * MS),
        vec![Action::Yield { conn: 1 }]
    );
    assert_eq!(on.holder(), Some("a"));
    // A Drain notice tells the same.
    assert_eq!(on.drain(t(22), 1), vec![Action::Soon { conns: vec![3] }]);
    // a's report after its drain: b is granted, with the same quota either way.
    let report = t(22) + 2 * MS;
    let granted_on = on.token_request(report, 1, 2 * MS, 10 * MS);
    let granted_off = off.token_request(report, 1, 2 * MS, 10 * MS);
    assert_eq!(grant(&granted_on).map(|g| g.0), Some("b"), "{granted_on:?}");
    assert_eq!(granted_on, granted_off);
    assert_eq!(on.usage_us(report, "a"), off.usage_us(report, "a"));
}

#[test]
fn no_soon_when_the_holder_goes_next_or_its_drains_are_short() {
    // Nobody else waits: the holder itself would go next, so no one is told.
    let mut c = two();
    c.set_soon(true);
    c.set_handover_drain_max(Some(1));
    assert!(grant(&c.token_request(t(0), 1, 0, 0)).is_some());
    assert!(grant(&c.token_request(t(10) + 2 * MS, 1, 2 * MS, 10 * MS)).is_some());
    assert!(c.drain(t(22), 1).is_empty());
    // Short drains: the notice hands over (a Grant), and nobody is told Soon.
    let mut c = a_holds_b_waits();
    c.set_soon(true);
    let acts = c.renew(t(10), 1, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"), "{acts:?}");
    assert!(
        !acts.iter().any(|a| matches!(a, Action::Soon { .. })),
        "{acts:?}"
    );
}

#[test]
fn a_release_waits_only_for_a_request_that_would_win() {
    // Two clients at 0.3 / 0.7 with 20 ms bursts take turns, each hold ended at its quota by a
    // Release (the hook's idle thread) and the client asking again 0.3 ms later. The token
    // waits for that request only where it would win had it come instead of the Release; one
    // that would lose (the last holder goes again only when more than a turn behind) is not
    // waited for, and the other client goes at once. Waiting for those too, the token idled and
    // then gave the releasing client a double turn at 67 of these 200 hand-overs.
    let mut c = Core::new(
        params(),
        &[spec("a", 300, 1000, 100), spec("b", 700, 1000, 100)],
        0,
    );
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    let burst = 20 * MS;
    let mut now = t(0);
    let (_, _, mut q) = grant(&c.token_request(now, 1, 0, burst)).unwrap();
    assert!(c.token_request(now + 100, 3, 0, burst).is_empty());
    let mut handed_on = 0;
    for _ in 0..200 {
        now += q;
        let holder = c.holder().expect("a turn").to_string();
        let conn = if holder == "a" { 1 } else { 3 };
        let mut asked_instead = c.clone();
        asked_instead.token_request(now, conn, 0, burst);
        let would_win = asked_instead.holder() == Some(holder.as_str());
        let released = c.release(now, conn, q);
        if released.is_empty() {
            assert!(
                would_win,
                "{holder}'s release kept the token for a request that loses"
            );
        } else {
            handed_on += 1;
        }
        let asked = c.token_request(now + 300, conn, 0, burst);
        let (_, _, next) = grant(&released)
            .or(grant(&asked))
            .expect("the token goes on at the release or the request");
        q = next;
    }
    assert!(
        handed_on > 100,
        "{handed_on} of 200 releases handed the token on"
    );
    let (ua, ub) = (c.usage_us(now, "a").unwrap(), c.usage_us(now, "b").unwrap());
    let part = ua as f64 / (ua + ub) as f64;
    assert!((part - 0.3).abs() < 0.02, "a's part {part:.3}");
}
