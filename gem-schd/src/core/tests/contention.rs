//! Full contention: turns of the min quota, the drain counted in a turn, and a short turn
//! evened out without a double turn.

use super::pacing::run_until_paced;
use super::*;

/// a and b (0.5, 0.5) paced over 100 ms; a runs alone until its allowance is spent, then b
/// asks and takes turns, asking again at the end of each. Returns when a gets the token back.
fn a_back_after_full_contention(unpaced_when_full: bool) -> Micros {
    let p = Params {
        pace_us: 100 * MS,
        ..params()
    };
    let mut c = Core::new(p, &[spec("a", 500, 500, 0), spec("b", 500, 500, 0)], 0);
    c.set_unpaced_when_full(unpaced_when_full);
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    // Alone, a is paced: five 10 ms holds, then it waits.
    let mut now = run_until_paced(&mut c, t(0));
    assert_eq!(now, t(50));
    let mut g = c.token_request(now, 3, 0, 0);
    while let Some(("b", _, q)) = grant(&g) {
        now += q;
        g = c.token_request(now, 3, 0, q);
        assert!(now < t(200), "a never came back");
    }
    assert_eq!(grant(&g).map(|g| g.0), Some("a"));
    now
}

#[test]
fn pacing_is_not_applied_while_the_waiting_clients_request_the_whole_gpu() {
    // The turns by virtual time hold each to its request: once b has caught up (it came
    // back at most the lag behind a), a takes its turn, its allowance over the last 100 ms
    // spent or not; the turns are min-quota long (2 ms).
    let back = a_back_after_full_contention(true);
    assert!(back <= t(62), "a back at {} ms", (back - T0) / MS);
    // Paced regardless (without the rule): a waits until its usage slides out.
    let back = a_back_after_full_contention(false);
    assert!(back >= t(90), "a back at {} ms", (back - T0) / MS);
}

#[test]
fn a_full_contention_grant_is_the_min_quota_less_the_drain_down_to_a_fifth() {
    assert_eq!(dispatch::full_turn_grant(5 * MS, 3 * MS, true), 2 * MS);
    assert_eq!(dispatch::full_turn_grant(5 * MS, 9 * MS, true), MS);
    assert_eq!(dispatch::full_turn_grant(5 * MS, 3 * MS, false), 5 * MS);
    assert_eq!(dispatch::full_turn_grant(0, 3 * MS, true), 1);
}

/// a (connection 1) and b (connection 3) at (0.5, 0.5), min quota 5 ms: together they ask for
/// the whole GPU.
fn full_pair(turn_includes_drain: bool) -> Core {
    let p = Params {
        min_quota_us: 5 * MS,
        ..params()
    };
    let mut c = Core::new(p, &[spec("a", 500, 500, 0), spec("b", 500, 500, 0)], 0);
    c.set_turn_includes_drain(turn_includes_drain);
    c.hello(1, "a").unwrap();
    c.hello(3, "b").unwrap();
    c
}

/// a and b (0.5, 0.5), min quota 5 ms, both always asking again at the end of each grant;
/// a's holds run `a_drain` past its grant (reported as overuse). Returns a's last grant.
fn a_grant_with_drain(turn_includes_drain: bool, a_drain: Micros) -> Micros {
    let mut c = full_pair(turn_includes_drain);
    let mut now = t(0);
    let mut g = c.token_request(now, 1, 0, 0);
    assert!(c.token_request(now, 3, 0, 0).is_empty());
    let mut last_a = 0;
    for _ in 0..60 {
        let (who, _, q) = grant(&g).expect("someone is granted");
        let who = who.to_string();
        if who == "a" {
            last_a = q;
            now += q + a_drain;
            g = c.token_request(now, 1, a_drain, q);
        } else {
            now += q;
            g = c.token_request(now, 3, 0, q);
        }
    }
    last_a
}

#[test]
fn under_full_contention_a_capped_clients_turn_with_its_drain_is_about_the_min_quota() {
    // a drains 3 ms past each grant: its grant settles at about 5 − 3 = 2 ms (the estimate is an
    // average of its reports), so its turn with the drain is the min quota.
    let q = a_grant_with_drain(true, 3 * MS);
    assert!((1_800..=2_200).contains(&q), "a's grant {q} µs");
    // Not below a fifth of the min quota, however long the drain.
    assert_eq!(a_grant_with_drain(true, 20 * MS), MS);
    // Off: the min quota, whatever the drain.
    assert_eq!(a_grant_with_drain(false, 3 * MS), 5 * MS);
}

/// a and b (0.5, 0.5) under full contention, min quota 5 ms; a's turn ends early (after
/// `short` of its 5 ms grant, asking again at once). Returns who gets the next turn and for
/// how long, then who gets the one after.
fn after_a_short_turn(turn_includes_drain: bool, short: Micros) -> (String, Micros, String) {
    let mut c = full_pair(turn_includes_drain);
    let mut now = t(0);
    let g = c.token_request(now, 3, 0, 0);
    assert_eq!(grant(&g).map(|g| g.0), Some("b"));
    assert!(c.token_request(now, 1, 0, 0).is_empty());
    now += 5 * MS;
    let g = c.token_request(now, 3, 0, 5 * MS);
    assert_eq!(grant(&g).map(|g| (g.0, g.2)), Some(("a", 5 * MS)));
    now += short;
    let g = c.token_request(now, 1, 0, short);
    let (who, _, q) = grant(&g).expect("a grant");
    let who = who.to_string();
    now += q;
    let conn = if who == "a" { 1 } else { 3 };
    let g = c.token_request(now, conn, 0, q);
    let next = grant(&g).map(|g| g.0.to_string()).unwrap_or_default();
    (who, q, next)
}

#[test]
fn under_full_contention_a_short_turn_is_evened_out_without_a_double_turn() {
    // a's turn lasted 2 of its 5 ms: a is 3 ms behind b. b goes next, for 5 − 3 = 2 ms, and
    // then a: no two turns in a row, and the charged times are even again.
    assert_eq!(
        after_a_short_turn(true, 2 * MS),
        ("b".to_string(), 2 * MS, "a".to_string())
    );
    // Without the rule: a, behind, takes the next turn too (a double turn for b to wait for).
    assert_eq!(after_a_short_turn(false, 2 * MS).0, "a");
}
