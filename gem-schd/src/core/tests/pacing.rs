//! Pacing: a capped client held to its limit over the pacing windows, renewals, and the
//! starvation bound.

use super::*;

/// Pacing over 100 ms (window 1 s), one client with the given limit.
fn paced(limit_milli: u16) -> Core {
    let p = Params {
        pace_us: 100 * MS,
        ..params()
    };
    let mut c = Core::new(p, &[spec("a", 0, limit_milli, 0)], 0);
    c.hello(1, "a").unwrap();
    c
}

/// Back-to-back holds from `now` while granted at once; returns the time of the
/// first request that waits.
pub(super) fn run_until_paced(c: &mut Core, mut now: Micros) -> Micros {
    while let Some((_, _, q)) = grant(&c.token_request(now, 1, 0, 0)) {
        now += q;
        c.release(now, 1, q);
        assert!(now < t(10_000), "never paced");
    }
    now
}

fn is_yield(acts: &[Action], conn: ConnId) -> bool {
    matches!(acts, [Action::Yield { conn: c }] if *c == conn)
}

#[test]
fn a_lone_paced_holder_renews_as_a_request_would_be_granted_and_is_charged_without_a_gap() {
    // The same client, the same pacing: back-to-back requests get five 10 ms holds before
    // waiting at t(50) (the test below); renewals go exactly as far.
    let mut c = paced(500);
    let (_, _, q) = grant(&c.token_request(t(0), 1, 0, 0)).unwrap();
    let mut now = t(0) + q;
    let mut renewed = 0;
    loop {
        let acts = c.renew(now, 1, q);
        let Some((id, conns, q)) = grant(&acts) else {
            assert!(is_yield(&acts, 1), "{acts:?}");
            break;
        };
        assert_eq!((id, conns, q), ("a", vec![1], 10 * MS));
        renewed += 1;
        now += q;
    }
    assert_eq!((renewed, now), (4, t(50)));
    // Charged continuously: 50 ms in five holds, none of it lost between them.
    assert_eq!(c.usage_us(now, "a"), Some(50 * MS));
    // The Yield changed nothing: the hold stands until the drained holder reports.
    assert_eq!(c.holder(), Some("a"));
    assert!(grant(&c.token_request(now + 300, 1, 300, 10 * MS)).is_none());
    assert_eq!(c.holder(), None);
    assert_eq!(c.usage_us(now + 300, "a"), Some(50 * MS + 300));
}

#[test]
fn renew_yields_without_trying_when_the_window_holds_too_many_grants() {
    // Short holds fill the window's history; a renewal then is not tried (the try copies it).
    let mut c = paced(1000);
    let mut now = t(0);
    for _ in 0..=super::dispatch::RENEW_MAX_ENTRIES {
        assert!(grant(&c.token_request(now, 1, 0, 0)).is_some());
        c.release(now + 10, 1, 10);
        now += 20;
    }
    assert!(grant(&c.token_request(now, 1, 0, 0)).is_some());
    assert!(is_yield(&c.renew(now + 10 * MS, 1, 10 * MS), 1));
    assert_eq!(c.holder(), Some("a"));
}

#[test]
fn renew_yields_to_a_non_holder_a_shared_hold_and_a_hold_past_its_grace() {
    let mut c = two();
    assert!(grant(&c.token_request(t(0), 1, 0, 0)).is_some());
    // Not the holder.
    assert!(is_yield(&c.renew(t(10), 3, 0), 3));
    // Two processes of the holder's client in the hold: the usual request decides.
    assert!(grant(&c.token_request(t(1), 2, 0, 0)).is_some());
    assert!(is_yield(&c.renew(t(10), 1, 10 * MS), 1));
    assert_eq!(c.holder(), Some("a"));
    // Past the quota and the grace (5 ms) the hold is over: nothing to renew.
    let mut c = two();
    assert!(grant(&c.token_request(t(0), 1, 0, 0)).is_some());
    assert!(is_yield(&c.renew(t(16), 1, 10 * MS), 1));
    assert_eq!(c.holder(), None);
    // Before Hello: refused like any other frame.
    assert!(matches!(
        &c.renew(t(16), 42, 0)[..],
        [Action::Error {
            conn: 42,
            code: code::PROTOCOL_MISUSE,
            ..
        }]
    ));
}

#[test]
fn pacing_holds_a_capped_client_to_its_limit_over_the_pace_window() {
    let mut c = paced(500);
    // 0.5 of 100 ms: five 10 ms holds, then it waits, far below its window limit.
    let now = run_until_paced(&mut c, t(0));
    assert_eq!(now, t(50));
    // Exact wake-up: when a whole 10 ms quota fits, i.e. when the first hold
    // starts to slide out of the pace window (the new hold replaces it).
    let wake = c.next_wakeup(now).unwrap();
    assert_eq!(wake, t(100));
    assert!(grant(&c.tick(wake - 1)).is_none());
    assert_eq!(grant(&c.tick(wake)).map(|g| g.2), Some(10 * MS));
}

#[test]
fn a_paced_grant_leaves_room_for_the_clients_usual_overrun() {
    // 0.5 of 100 ms = 50 ms per pace window, min quota 2 ms.
    let mut c = paced(500);
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().2, 10 * MS);
    // The whole queued burst ran 20 ms past the 10 ms quota: [0, 30) is charged, 20 ms of
    // the allowance are left. Without the overrun allowance a 10 ms grant went out now
    // and, overrunning again, the window [−60, 40) held 60 ms > 50.
    assert!(grant(&c.token_request(t(30), 1, 20 * MS, 10 * MS)).is_none());
    // It waits until room − overrun fits a min quota: the window ending at the grant's
    // end plus the overrun holds at most 50 ms.
    let wake = c.next_wakeup(t(30)).unwrap();
    assert_eq!(wake, t(80));
    assert!(grant(&c.tick(wake - 1)).is_none());
    let q = grant(&c.tick(wake)).unwrap().2;
    assert_eq!(q, 10 * MS);
    // The allowance decays once the client stops overrunning (halved per report).
    c.token_request(wake + q, 1, 0, 10 * MS);
    assert_eq!(c.clients[&0].overrun_us, 10 * MS);
}

/// b (2 ms bursts) held the token alone for 38.5 ms before a (40 ms bursts) asked: a comes
/// back the lag (10 ms) behind b in virtual time, so its turn may be that long; returns a's
/// first grant, made while b waits again, and b's quota estimate then.
fn long_turn_beside_short(max_hold: Micros) -> (Micros, Micros) {
    let mut c = two();
    c.set_max_hold(max_hold);
    // b alone: its own estimates (10 → 25 ms, then 25 → 13.5 ms).
    assert_eq!(
        grant(&c.token_request(t(0), 3, 0, 40 * MS)).unwrap().2,
        25 * MS
    );
    assert_eq!(
        grant(&c.token_request(t(25), 3, 0, 2 * MS)).unwrap().2,
        13_500
    );
    assert!(grant(&c.token_request(t(30), 1, 0, 40 * MS)).is_none());
    // b's turn ends and it asks again (13.5 → 7.75 ms); a goes.
    let g = c.token_request(t(38) + 500, 3, 0, 2 * MS);
    let (who, _, q) = grant(&g).unwrap();
    assert_eq!(who, "a");
    (q, c.quota_estimate_us("b").unwrap())
}

#[test]
fn under_contention_a_turn_follows_the_contenders_quanta() {
    // b waits: a's turn is cut to max(max_hold − a's overrun, b's quota) = b's 7.75 ms.
    let (q, b_quota) = long_turn_beside_short(5 * MS);
    assert_eq!(b_quota, 7_750);
    assert_eq!(q, b_quota);
    // Off: a's turn is what it is behind b (the 10 ms lag it was floored to when it came
    // back), not its own 25 ms estimate.
    assert_eq!(long_turn_beside_short(0).0, 10 * MS);
}

#[test]
fn pacing_is_off_at_zero_and_for_uncapped_clients() {
    // Limit 1.0: one second of back-to-back holds, each granted at once.
    let mut c = paced(1000);
    let mut now = t(0);
    while now < t(1000) {
        let q = grant(&c.token_request(now, 1, 0, 0))
            .expect("never paced")
            .2;
        now += q;
        c.release(now, 1, q);
    }
    let mut c = Core::new(params(), &[spec("a", 0, 500, 0)], 0);
    c.hello(1, "a").unwrap();
    // pace_us = 0: the 0.5 limit holds over the 1 s window only (500 ms at once).
    assert_eq!(run_until_paced(&mut c, t(0)), t(500));
}

#[test]
fn a_grant_never_exceeds_the_pace_allowance_nor_drops_below_min_quota() {
    let mut c = paced(500);
    // A 150 ms burst moves the estimate to 80 ms; the allowance is 50 ms.
    assert_eq!(
        grant(&c.token_request(t(0), 1, 0, 150 * MS)).unwrap().2,
        50 * MS
    );
    // A limit whose allowance (1 ms) is below the min quota gets the min quota.
    let mut c = paced(10);
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().2, 2 * MS);
}

/// b used 300 ms just before; a and b then both always want the token, a re-asking every
/// 10 ms. Ranked by usage over the window alone, a (below b) would keep the token until
/// their usages cross, 300 ms; with the starvation bound b waits at most the bound plus one
/// hold; ranked by virtual time, a comes back at most the lag behind b and they alternate.
fn longest_wait_of_b(max_wait: Micros, max_lag: Micros, window: Micros) -> Micros {
    let mut c = Core::new(
        Params {
            window_us: window,
            ..params()
        },
        &[spec("a", 500, 1000, 100), spec("b", 500, 1000, 100)],
        0,
    );
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    // Start once the window is full, so that it holds 10 s of history.
    let t0 = window;
    c.set_max_wait(max_wait);
    c.set_max_lag(max_lag);
    let acts = c.token_request(t0 + t(0), 3, 0, 0);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    let _ = c.release(t0 + t(300), 3, 300 * MS);
    let _ = c.token_request(t0 + t(300), 1, 0, 0);
    let _ = c.token_request(t0 + t(300), 3, 0, 0);
    let (mut b_since, mut longest, mut now) = (t0 + t(300), 0, t0 + t(300));
    let mut holder = c.holder().map(str::to_owned);
    while now < t0 + t(1300) {
        now += 10 * MS;
        let conn = if holder.as_deref() == Some("a") { 1 } else { 3 };
        let _ = c.token_request(now, conn, 0, 10 * MS);
        holder = c.holder().map(str::to_owned);
        match (holder.as_deref(), conn) {
            (Some("b"), 1) => longest = longest.max(now - b_since), // b's turn came
            (Some("a"), 3) => b_since = now,                        // b lost the token
            _ => {}
        }
    }
    longest
}

#[test]
fn a_waiting_client_is_served_within_the_starvation_bound() {
    let off = longest_wait_of_b(0, 0, 1000 * MS);
    let on = longest_wait_of_b(50 * MS, 0, 1000 * MS);
    assert!(
        off >= 250 * MS,
        "without the bound b waited only {} ms",
        off / MS
    );
    assert!(on <= 60 * MS, "b waited {} ms with a 50 ms bound", on / MS);
}

#[test]
fn a_client_back_from_idle_cannot_bank_its_idle_time() {
    // Virtual-time ranking, no starvation bound, gem-schd's 10 s window (b's 300 ms leave
    // both below their request): a comes back 10 ms (the lag) behind b, so b waits for at
    // most the lag plus a hold, then they alternate.
    let wait = longest_wait_of_b(0, 10 * MS, 10_000 * MS);
    assert!(wait <= 30 * MS, "b waited {} ms", wait / MS);
    // Ranked by usage over the window instead: a keeps the token until the usages cross.
    let window = longest_wait_of_b(0, 0, 10_000 * MS);
    assert!(window >= 250 * MS, "b waited only {} ms", window / MS);
}

/// b (0.4/1.0, conn 3) after running alone for 600 ms, so above its request, beside a
/// (0.5/0.5, conn 1, below its own): the time, and the quota of b's hold then.
fn b_alone_600_ms(max_wait: Micros) -> (Core, Micros, Micros) {
    let mut c = Core::new(
        params(),
        &[spec("a", 500, 500, 0), spec("b", 400, 1000, 0)],
        0,
    );
    c.set_max_wait(max_wait);
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    let mut now = t(0);
    let mut acts = c.token_request(now, 3, 0, 0);
    while now < t(600) {
        let (_, _, q) = grant(&acts).expect("b alone is granted back");
        now += q;
        acts = c.token_request(now, 3, 0, q);
    }
    let (_, _, quota) = grant(&acts).expect("b alone is granted back");
    (c, now, quota)
}

/// After `b_alone_600_ms`, a and b both always want the token, each asking again at its
/// quota's end (a reporting `a_burst` as its burst, or its quota). Returns b's longest wait for
/// the token over the next 400 ms, and a's share of the time from its first turn on (in
/// thousandths).
fn beside_a_client_catching_up(max_wait: Micros, a_burst: Option<Micros>) -> (Micros, u64) {
    let (mut c, mut now, mut quota) = b_alone_600_ms(max_wait);
    let _ = c.token_request(now, 1, 0, 0);
    let (end, mut holder) = (now + 400 * MS, 3);
    let (mut b_since, mut longest, mut a_from) = (now, 0, None);
    while now < end {
        now += quota;
        let burst = if holder == 1 { a_burst } else { None };
        let acts = c.token_request(now, holder, 0, burst.unwrap_or(quota));
        let (who, _, q) = grant(&acts).expect("the other client waits");
        match (who, holder) {
            ("a", 3) => {
                b_since = now;
                a_from = a_from.or(Some(now));
            }
            ("b", 1) => longest = longest.max(now - b_since),
            _ => {}
        }
        (holder, quota) = (if who == "a" { 1 } else { 3 }, q);
    }
    if holder == 1 {
        longest = longest.max(now - b_since);
    }
    let a_from = a_from.expect("a had a turn");
    let a_time = c.usage_us(now, "a").unwrap();
    (longest, a_time * 1000 / (now - a_from))
}

#[test]
fn a_client_above_its_request_waits_boundedly_beside_one_catching_up() {
    // Without the bound b waits until a is back at its request: 400 ms here.
    let (off, _) = beside_a_client_catching_up(0, None);
    assert!(off >= 300 * MS, "b waited only {} ms", off / MS);
    // With it, b gets a min-quota turn once a has run R = 4 ms (2 min quotas at s = 0.5)
    // since b's last one: b waits for one of a's turns.
    let (on, a_share) = beside_a_client_catching_up(DEFAULT_MAX_WAIT_US, None);
    let a_quota = params().base_quota_us;
    assert!(on <= a_quota, "b waited {} µs", on);
    // a still catches up faster than its request: 2s / (1 + s) = 2/3 of the time, less the
    // part of a cycle (a, a, b) cut off at the end.
    assert!(a_share >= 660, "a's share {a_share}‰");
    // a's turns, 30 ms by its bursts, end when b is due: b waits R, or twice its own last
    // turn (its overrun included), here 4–4.5 ms.
    let (long, a_share) = beside_a_client_catching_up(DEFAULT_MAX_WAIT_US, Some(30 * MS));
    assert!(long <= 3 * params().min_quota_us, "b waited {} µs", long);
    assert!(a_share >= 660, "a's share {a_share}‰");
}

/// After `b_alone_600_ms`, b's hold ends and a takes a turn; b asks `offset` into it (a re-asks
/// at each quota's end). How long after its due time (`due` after it asked, or the end of that
/// turn if later: a turn is not cut short) b was granted its turn (negative: before it).
fn b_past_its_due_time(offset: Micros, due: Micros) -> i64 {
    let (mut c, mut now, q) = b_alone_600_ms(DEFAULT_MAX_WAIT_US);
    let _ = c.token_request(now, 1, 0, 0);
    now += q;
    let acts = c.release(now, 3, q);
    let (who, _, mut quota) = grant(&acts).expect("a is granted");
    assert_eq!(who, "a");
    let asked = now + offset;
    let due_at = (asked + due).max(now + quota);
    assert!(grant(&c.token_request(asked, 3, 0, 0)).is_none());
    loop {
        now += quota;
        let acts = c.token_request(now, 1, 0, quota);
        match grant(&acts) {
            Some(("a", _, q)) => quota = q,
            Some(("b", _, _)) => return now as i64 - due_at as i64,
            other => panic!("{other:?}"),
        }
        assert!(now < asked + 100 * MS, "b still waits");
    }
}

#[test]
fn a_turn_beside_a_client_above_its_request_ends_by_its_due_time() {
    // b is due after 2 min quotas (4 ms here). A turn of a granted then ends by that time, or,
    // when b is due within a fifth of a min quota, b goes at once. Granted at least a min
    // quota instead, a's turn ran up to a min quota past it: b went up to 1.9 ms late here,
    // and on an H200 batch-1 decode waited 17 ms for one token beside a capped encoder renewed
    // a whole min quota 0.6 ms before decode was due.
    let p = params();
    let due = 2 * p.min_quota_us;
    let late: Vec<i64> = (0..p.base_quota_us)
        .step_by(100)
        .map(|offset| b_past_its_due_time(offset, due))
        .collect();
    let (earliest, latest) = (late.iter().min().unwrap(), late.iter().max().unwrap());
    eprintln!("b granted from {earliest} µs to {latest} µs after its due time");
    assert!(*latest <= 0, "b went {latest} µs late");
    assert!(
        *earliest >= -((p.min_quota_us / 5) as i64),
        "b went {earliest} µs early"
    );
}

/// a and b both capped at 0.5 (request 0.5) and always wanting the token, re-asking when
/// each hold ends (a every 2 ms of its hold, b after 8 ms of work per hold); pacing over
/// 100 ms, from a start where a was alone for 60 ms (so it is held back by pacing first).
/// Returns the longest time b waited for the token after 1 s.
fn longest_wait_after_a_pacing_block() -> Micros {
    let p = Params {
        window_us: 10_000 * MS,
        pace_us: 100 * MS,
        ..params()
    };
    let mut c = Core::new(p, &[spec("a", 500, 500, 0), spec("b", 500, 500, 0)], 0);
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    let mut now = 10_000 * MS;
    // a alone: back-to-back holds until pacing holds it back.
    while let Some((_, _, q)) = grant(&c.token_request(now, 1, 0, 0)) {
        now += q;
        c.release(now, 1, q);
    }
    let _ = c.token_request(now, 3, 0, 0);
    let (mut b_since, mut longest) = (now, 0);
    let end = now + 3_000 * MS;
    while now < end {
        now += MS;
        let holder = c.holder().map(str::to_owned);
        match holder.as_deref() {
            None => {
                let _ = c.tick(now);
            }
            Some("a") => {
                let _ = c.token_request(now, 1, 0, 2 * MS);
            }
            Some(_) => {
                if now.is_multiple_of(8 * MS) {
                    let _ = c.token_request(now, 3, 0, 8 * MS);
                    b_since = now;
                } else {
                    continue;
                }
            }
        }
        if c.holder() == Some("b")
            && holder.as_deref() != Some("b")
            && now > 10_000 * MS + 1_000 * MS
        {
            longest = longest.max(now - b_since);
        }
    }
    longest
}

#[test]
fn a_client_held_back_by_pacing_does_not_catch_up_in_a_run_of_turns() {
    // Without the rule: 42 ms (a, back from its pacing block, catches up in a run of
    // turns); with it: 8 ms, one of b's holds.
    let wait = longest_wait_after_a_pacing_block();
    assert!(wait <= 20 * MS, "b waited {} ms", wait / MS);
}

#[test]
fn an_early_release_is_not_charged_again_by_the_next_request() {
    let mut c = two();
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().0, "a");
    // a goes idle after 3 ms of its 10 ms quota; b takes the token.
    c.release(t(3), 1, 3 * MS);
    assert_eq!(grant(&c.token_request(t(4), 3, 0, 0)).unwrap().0, "b");
    // a asks again while b holds, with no overuse to report: its last hold ended at the
    // release, and b's hold is not pushed back over a's unused quota.
    assert!(grant(&c.token_request(t(5), 1, 0, 3 * MS)).is_none());
    assert_eq!(c.usage_us(t(6), "a"), Some(3 * MS));
    assert_eq!(c.usage_us(t(6), "b"), Some(2 * MS));
}

#[test]
fn overlapping_pieces_of_use_are_layered_by_depth() {
    use super::super::window::layers;
    // A turn with two co-hold charges on it, a gap, one more piece; empty pieces drop out.
    let pieces = [(0, 280), (0, 1), (14, 15), (300, 300), (400, 410)];
    assert_eq!(
        layers(&pieces),
        vec![
            (0, 1, 2),
            (1, 14, 1),
            (14, 15, 2),
            (15, 280, 1),
            (400, 410, 1)
        ]
    );
    // What the spans carry is what the pieces did.
    let total = |v: &[(Micros, Micros, u32)]| -> Micros {
        v.iter().map(|(s, e, d)| (e - s) * Micros::from(*d)).sum()
    };
    assert_eq!(total(&layers(&pieces)), 280 + 1 + 1 + 10);
    assert!(layers(&[]).is_empty());
}
