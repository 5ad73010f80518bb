//! Full contention: turns of the min quota, the drain counted in a turn, and a short turn
//! evened out without a double turn.

use super::corun::fill;
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

/// `full_pair(turn_includes_drain)` with long turns of `long_turn` and the clients' fills
/// judged at `fills` (a, b).
fn long_turn_full_pair(turn_includes_drain: bool, long_turn: Micros, fills: [f64; 2]) -> Core {
    let mut c = full_pair(turn_includes_drain);
    c.set_long_turn(long_turn);
    fill(&mut c, 1, fills[0]);
    fill(&mut c, 3, fills[1]);
    c
}

/// `long_turn_full_pair()`, both asking again at the end of each grant, a's holds draining
/// `a_drain` past it; the quotas of the turns after the first two (the first is a's alone).
fn long_turn_pair(fills: [f64; 2], long_turn: Micros, a_drain: Micros) -> Vec<Micros> {
    let mut c = long_turn_full_pair(false, long_turn, fills);
    let mut now = t(0);
    let mut g = c.token_request(now, 1, 0, 0);
    assert!(c.token_request(now, 3, 0, 0).is_empty());
    let mut quotas = Vec::new();
    for _ in 0..12 {
        let (who, _, q) = grant(&g).expect("someone is granted");
        quotas.push(q);
        g = if who == "a" {
            now += q + a_drain;
            c.token_request(now, 1, a_drain, q)
        } else {
            now += q;
            c.token_request(now, 3, 0, q)
        };
    }
    quotas.split_off(2)
}

#[test]
fn long_turns_go_only_to_gpu_bound_clients() {
    // Both fill their turns: 10 ms turns.
    assert!(
        long_turn_pair([0.95, 0.9], 10 * MS, 0)
            .iter()
            .all(|q| *q == 10 * MS)
    );
    // One reads its tokens back between short kernels: the min quota for both.
    assert!(
        long_turn_pair([0.95, 0.4], 10 * MS, 0)
            .iter()
            .all(|q| *q == 5 * MS)
    );
    // Off.
    assert!(
        long_turn_pair([0.95, 0.9], 0, 0)
            .iter()
            .all(|q| *q == 5 * MS)
    );
}

/// a (connection 1) holds a turn of both clients' full contention, with b waiting and a's usual
/// drain `drain_us`; a's drain notice at its quota's end: who holds the token after it.
fn holder_after_a_notice(fills: [f64; 2], drain_us: Micros) -> Option<String> {
    let mut c = long_turn_full_pair(true, 10 * MS, fills);
    let mut now = t(0);
    let mut g = c.token_request(now, 3, 0, 0);
    assert!(c.token_request(now, 1, drain_us, 0).is_empty());
    // b's turn, then a's.
    loop {
        let (who, _, q) = grant(&g).expect("someone is granted");
        now += q;
        if who == "a" {
            break;
        }
        g = c.token_request(now, 3, 0, q);
    }
    let _ = c.drain(now, 1);
    c.holder().map(str::to_owned)
}

#[test]
fn a_notice_in_a_long_turn_hands_over_from_the_drains_a_short_turn_does() {
    // Both fill their turns: 10 ms turns, and the bound is still a fifth of the 5 ms min
    // quota. A fifth of the long turn handed over from 1.5 ms drains on an H200: the next
    // tenant's work ran beside them, and the gap per hand-over stayed the same.
    assert_eq!(
        holder_after_a_notice([0.95, 0.9], 1_000).as_deref(),
        Some("b")
    );
    assert_eq!(
        holder_after_a_notice([0.95, 0.9], 1_500).as_deref(),
        Some("a")
    );
}
