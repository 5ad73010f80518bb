//! Unit tests of the core, one behaviour each, on a virtual clock.

use super::*;
use gem_proto::code;

const MS: Micros = 1000;
/// Events start one window after the core: the effective window is then full.
const T0: Micros = 1_000_000;
fn t(ms: Micros) -> Micros {
    T0 + ms * MS
}

fn spec(id: &str, req: u16, lim: u16, mem: u64) -> ClientSpec {
    ClientSpec {
        id: id.into(),
        request_milli: req,
        limit_milli: lim,
        mem_limit: mem,
    }
}

fn params() -> Params {
    Params {
        window_us: 1000 * MS,
        base_quota_us: 10 * MS,
        min_quota_us: 2 * MS,
        grace_us: 5 * MS,
        pace_us: 0,
        pace_short_us: 0,
    }
}

/// Core with clients a, b (0.5/1.0 each); conns 1,2 = a; 3 = b.
fn two() -> Core {
    let mut c = Core::new(
        params(),
        &[spec("a", 500, 1000, 100), spec("b", 500, 1000, 100)],
        0,
    );
    c.hello(1, "a").unwrap();
    c.hello(2, "a").unwrap();
    c.hello(3, "b").unwrap();
    c
}

fn grant(acts: &[Action]) -> Option<(&str, Vec<ConnId>, Micros)> {
    acts.iter().find_map(|a| match a {
        Action::Grant {
            client,
            conns,
            quota_us,
        } => Some((client.as_str(), conns.clone(), *quota_us)),
        _ => None,
    })
}

#[test]
fn unknown_client_and_early_frames_are_refused() {
    let mut c = two();
    assert_eq!(c.hello(9, "zz").unwrap_err().code, code::UNKNOWN_CLIENT);
    assert_eq!(c.hello(1, "a").unwrap_err().code, code::PROTOCOL_MISUSE);
    let acts = c.token_request(t(0), 42, 0, 0);
    assert!(matches!(
        &acts[..],
        [Action::Error {
            conn: 42,
            code: 4,
            ..
        }]
    ));
    assert_eq!(c.mem_query(42).unwrap_err().code, code::PROTOCOL_MISUSE);
}

#[test]
fn free_token_is_granted_at_once_with_the_base_quota() {
    let mut c = two();
    let acts = c.token_request(t(0), 1, 0, 0);
    assert_eq!(grant(&acts), Some(("a", vec![1], 10 * MS)));
    assert_eq!(c.holder(), Some("a"));
}

#[test]
fn a_grant_answers_every_waiting_connection_of_the_client() {
    let mut c = two();
    c.token_request(t(0), 3, 0, 0); // b holds
    assert!(grant(&c.token_request(1, 1, 0, 0)).is_none());
    assert!(grant(&c.token_request(2, 2, 0, 0)).is_none());
    let acts = c.release(t(3), 3, 3 * MS);
    assert_eq!(grant(&acts).map(|g| (g.0, g.1)), Some(("a", vec![1, 2])));
}

#[test]
fn release_is_work_conserving() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    assert!(grant(&c.token_request(t(1), 3, 0, 0)).is_none());
    // a goes idle after 2 ms of its 10 ms: b gets the token then, not at 10 ms.
    let acts = c.release(t(2), 1, 2 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(2), "a"), Some(2 * MS));
}

#[test]
fn a_new_process_joins_the_running_hold() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0); // a holds until 10 ms
    let acts = c.token_request(t(4), 2, 0, MS);
    assert_eq!(grant(&acts), Some(("a", vec![2], 6 * MS)));
    // The hold ends when both have released.
    c.token_request(t(4), 3, 0, 0);
    assert!(grant(&c.release(t(5), 1, 0)).is_none());
    assert_eq!(grant(&c.release(t(6), 2, 0)).map(|g| g.0), Some("b"));
}

/// [`two`] with a's processes 1 and 2 in one hold until 10 ms (2 joined it) and b waiting.
fn two_processes_hold_b_waits() -> Core {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.token_request(t(0), 2, 0, 0);
    c.token_request(t(1), 3, 0, 0);
    c
}

/// Two processes of a in one hold; the first asks again after the quota while the second still
/// drains its last burst: the token stays with a until the second reports (before, b was
/// granted beside that drain and a's late report charged a for b's time).
#[test]
fn a_hold_of_two_processes_ends_when_the_last_one_reports() {
    let mut c = two_processes_hold_b_waits();
    // Process 1 drained 1 ms past the quota and asks again: 2 is still in the hold.
    assert!(grant(&c.token_request(t(11), 1, MS, 0)).is_none());
    assert_eq!(c.holder(), Some("a"));
    // Process 2 reports 3 ms of overuse: the hold ends at 13 ms, and b goes.
    let acts = c.token_request(t(13), 2, 3 * MS, 0);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(13), "a"), Some(13 * MS));
}

/// The entry ends at the latest end any of the hold's processes reported, whichever reports
/// last; and a silent process loses the hold at the grace's end as a single one does.
#[test]
fn a_hold_of_two_processes_is_charged_to_the_latest_reported_end() {
    let mut c = two_processes_hold_b_waits();
    // 1 ran 4 ms past the quota (Release with its use), 2 then asks again with 1 ms.
    assert!(grant(&c.release(t(14), 1, 14 * MS)).is_none());
    let acts = c.token_request(t(14), 2, MS, 0);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(14), "a"), Some(14 * MS));

    let mut c = two_processes_hold_b_waits();
    assert!(grant(&c.token_request(t(11), 1, MS, 0)).is_none());
    // 2 never reports: b gets the token at the grace's end (10 + 5 ms).
    assert_eq!(grant(&c.tick(t(15))).map(|g| g.0), Some("b"));

    // A stray Release from 1, after it left the hold, says nothing about the hold's end.
    let mut c = two_processes_hold_b_waits();
    assert!(grant(&c.token_request(t(11), 1, MS, 0)).is_none());
    assert!(grant(&c.release(t(12), 1, 50 * MS)).is_none());
    let acts = c.token_request(t(13), 2, 0, 0);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(13), "a"), Some(11 * MS));
}

#[test]
fn expiry_waits_for_the_holders_report_within_the_grace() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0); // a: 10 ms
    c.token_request(t(1), 3, 0, 0); // b waits
    assert_eq!(c.next_wakeup(t(1)), Some(t(15)));
    assert!(grant(&c.tick(t(12))).is_none(), "a's last burst still runs");
    // a reports 3 ms of overuse and asks again: b goes, a is charged 13 ms.
    let acts = c.token_request(t(13), 1, 3 * MS, 0);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(13), "a"), Some(13 * MS));
}

#[test]
fn a_silent_holder_loses_the_token_after_the_grace_and_overuse_pushes_back() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.token_request(t(1), 3, 0, 0);
    let acts = c.tick(t(15));
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    // a reports late: it ran until 18 ms; b's hold is charged from then on.
    c.token_request(t(18), 1, 8 * MS, 0);
    assert_eq!(c.usage_us(t(18), "a"), Some(18 * MS));
    assert_eq!(c.usage_us(t(18), "b"), Some(0));
    assert_eq!(c.usage_us(t(20), "b"), Some(2 * MS));
}

#[test]
fn quota_follows_reported_bursts_within_bounds() {
    let mut c = two();
    // EMA: 10 -> (10+30)/2 = 20 ms.
    assert_eq!(
        grant(&c.token_request(t(0), 1, 0, 30 * MS)).unwrap().2,
        20 * MS
    );
    // Tiny bursts: clamped up to the 2 ms minimum eventually.
    let mut now = t(20);
    let mut q = 0;
    for _ in 0..10 {
        q = grant(&c.token_request(now, 1, 0, 100)).unwrap().2;
        now += MS;
    }
    assert_eq!(q, 2 * MS);
    assert!(
        c.quota_estimate_us("a").unwrap() < 2 * MS,
        "the estimate itself follows the bursts"
    );
}

#[test]
fn below_request_goes_first_then_least_usage() {
    let mut c = Core::new(
        params(),
        &[
            spec("hi", 800, 1000, 0),
            spec("lo", 100, 1000, 0),
            spec("z", 0, 1000, 0),
        ],
        0,
    );
    c.hello(1, "hi").unwrap();
    c.hello(2, "lo").unwrap();
    c.hello(3, "z").unwrap();
    // Run `conn` alone for `ms` of holds starting at `now`; returns the end.
    let run = |c: &mut Core, conn, mut now: Micros, ms: Micros| {
        let end = now + ms * MS;
        while now < end {
            let q = grant(&c.token_request(now, conn, 0, 0))
                .unwrap()
                .2
                .min(end - now);
            now += q;
            c.release(now, conn, q);
        }
        now
    };
    // hi used 300 ms (37% of its request), lo 50 ms (50% of its), z 20 ms.
    let now = run(&mut c, 1, t(0), 300);
    let now = run(&mut c, 2, now, 50);
    let now = run(&mut c, 3, now, 20);
    c.token_request(now, 3, 0, 0); // z holds; all three then wait
    c.token_request(now, 2, 0, 0);
    c.token_request(now, 1, 0, 0);
    // Both below their requests: the smaller usage/request goes first (hi),
    // although lo has used less.
    let acts = c.release(now + MS, 3, MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("hi"));
    // lo (below its request) beats z (above its request of 0) despite more usage.
    let acts = c.release(now + 5 * MS, 1, 4 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("lo"));
}

#[test]
fn a_client_at_its_limit_waits_even_on_an_idle_gpu() {
    let mut c = Core::new(params(), &[spec("a", 0, 100, 0)], 0);
    c.hello(1, "a").unwrap();
    // 10% of the 1 s window is 100 ms: ten 10 ms holds, then it must wait.
    let mut now = t(0);
    for _ in 0..10 {
        let q = grant(&c.token_request(now, 1, 0, 0))
            .expect("below its limit")
            .2;
        now += q;
        c.release(now, 1, q);
    }
    assert_eq!(now, t(100));
    assert!(grant(&c.token_request(now, 1, 0, 0)).is_none());
    // Eligible again just after the first hold begins to slide out of the window.
    let wake = c.next_wakeup(now).unwrap();
    assert_eq!(wake, t(1000) + 1);
    assert!(grant(&c.tick(wake - 1)).is_none());
    assert!(grant(&c.tick(wake)).is_some());
}

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
fn run_until_paced(c: &mut Core, mut now: Micros) -> Micros {
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
fn renew_yields_while_another_client_waits_and_the_hold_stands() {
    let mut c = two();
    assert!(grant(&c.token_request(t(0), 1, 0, 0)).is_some());
    assert!(grant(&c.token_request(t(1), 3, 0, 0)).is_none());
    assert!(is_yield(&c.renew(t(10), 1, 10 * MS), 1));
    assert_eq!(c.holder(), Some("a"));
    // The holder drains and asks: now the waiting client gets the token.
    let acts = c.token_request(t(10) + 400, 1, 400, 10 * MS);
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
    assert_eq!(c.usage_us(t(11), "a"), Some(10 * MS + 400));
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

/// a (40 ms bursts) and b (2 ms bursts) alternate; returns a's grant after b's turn.
fn long_turn_after_short(max_hold: Micros) -> Micros {
    let mut c = two();
    c.set_max_hold(max_hold);
    // Alone, a gets its own estimate (10 → 25 ms): nobody contends.
    assert_eq!(
        grant(&c.token_request(t(0), 1, 0, 40 * MS)).unwrap().2,
        25 * MS
    );
    assert!(grant(&c.token_request(t(10), 3, 0, 2 * MS)).is_none());
    // a's turn ends; b (less usage) goes, with its own short quota (10 → 6 ms).
    let g = c.token_request(t(25), 1, 0, 40 * MS);
    assert_eq!(grant(&g).map(|g| (g.0, g.2)), Some(("b", 6 * MS)));
    grant(&c.release(t(27), 3, 2 * MS)).unwrap().2
}

#[test]
fn under_contention_a_turn_follows_the_contenders_quanta() {
    // b just held: a's turn is cut to max(max_hold − a's overrun, b's quota) = 6 ms.
    assert_eq!(long_turn_after_short(5 * MS), 6 * MS);
    // Off: a gets its own 32 ms estimate and b waits that long.
    assert_eq!(long_turn_after_short(0), 32_500);
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

#[test]
fn memory_is_per_client_and_reclaimed_per_connection() {
    let mut c = two();
    assert!(c.mem_alloc(1, 60).unwrap().granted);
    let d = c.mem_alloc(2, 50).unwrap();
    assert_eq!((d.granted, d.used, d.limit), (false, 60, 100));
    assert!(c.mem_alloc(2, 40).unwrap().granted);
    // MemFree credits only what that connection counted.
    c.mem_free(2, 1000).unwrap();
    assert_eq!(c.mem_query(1).unwrap(), (60, 100));
    c.mem_alloc(2, 30).unwrap();
    c.disconnect(t(0), 1); // a killed process: its 60 bytes are freed
    assert_eq!(c.mem_query(2).unwrap(), (30, 100));
    c.disconnect(t(0), 2);
    assert_eq!(c.mem_used("a"), Some(0));
}

#[test]
fn reload_keeps_stayers_and_errors_leavers() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 40 * MS); // a holds, quota estimate moves to 25 ms
    c.token_request(t(1), 3, 0, 0); // b waits
    let acts = c.set_config(t(2), &[spec("a", 500, 800, 50)]);
    assert!(matches!(
        &acts[..],
        [Action::Error {
            conn: 3,
            code: 1,
            ..
        }]
    ));
    assert_eq!(c.quota_estimate_us("a"), Some(25 * MS));
    assert_eq!(c.holder(), Some("a"));
    assert_eq!(c.mem_query(1).unwrap(), (0, 50));
    // b's connection now gets Error{1} for everything.
    assert_eq!(c.mem_query(3).unwrap_err().code, code::UNKNOWN_CLIENT);
    let acts = c.token_request(t(3), 3, 0, 0);
    assert!(matches!(
        &acts[..],
        [Action::Error {
            conn: 3,
            code: 1,
            ..
        }]
    ));
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

#[test]
fn nothing_is_granted_during_the_quiet_period() {
    let mut c = two();
    c.hold_grants_until(t(200));
    let acts = c.token_request(t(10), 1, 0, 0);
    assert!(grant(&acts).is_none(), "granted during the quiet period");
    assert_eq!(c.next_wakeup(t(10)), Some(t(200)));
    assert!(grant(&c.tick(t(199))).is_none());
    let acts = c.tick(t(200));
    assert_eq!(grant(&acts).map(|g| g.0), Some("a"));
}

#[test]
fn shutdown_errors_every_waiter() {
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.token_request(t(0), 3, 0, 0);
    let acts = c.shutdown();
    assert!(matches!(
        &acts[..],
        [Action::Error {
            conn: 3,
            code: 5,
            ..
        }]
    ));
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
    assert_eq!(c.usage_us(t(8), "a"), Some(3 * MS));
    assert_eq!(c.usage_us(t(8), "b"), Some(4 * MS));
}

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
    // Paced regardless (before issue 14's round 4): a waits until its usage slides out.
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
    // Off: the min quota (round 4), whatever the drain.
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
    // Round 4's rule: a, behind, takes the next turn too (a double turn for b to wait for).
    assert_eq!(after_a_short_turn(false, 2 * MS).0, "a");
}

/// A hold the hook ended at its expiry (no launch came): Release with the use past the quota,
/// then, with the next request, that overrun as the overuse (gem-schd learns the drain from
/// it). The time is charged once.
#[test]
fn an_expired_holds_release_then_its_overuse_report_charge_it_once() {
    let mut c = two();
    let q = grant(&c.token_request(t(0), 1, 0, 0)).map(|g| g.2);
    assert_eq!(q, Some(10 * MS));
    c.release(t(11), 1, 11 * MS);
    assert_eq!(c.usage_us(t(12), "a"), Some(11 * MS));
    // The next request reports the same overrun: no second charge.
    c.token_request(t(12), 1, MS, 10 * MS);
    assert_eq!(c.usage_us(t(12), "a"), Some(11 * MS));
}

#[test]
fn carried_pacing_spreads_the_new_limit_over_the_window() {
    let v = carried_pacing(0, 1_000_000, 300);
    assert_eq!(v.len(), 20);
    assert_eq!(v[0], (0, 15_000));
    assert_eq!(v[19], (950_000, 965_000));
    assert_eq!(v.iter().map(|(s, e)| e - s).sum::<Micros>(), 300_000);
    // Nothing to carry: no span, no limit, or no cap.
    assert!(carried_pacing(5, 5, 300).is_empty());
    assert!(carried_pacing(0, 1_000_000, 0).is_empty());
    assert!(carried_pacing(0, 1_000_000, 1000).is_empty());
    // A span too short for a µs per piece.
    assert!(carried_pacing(0, 19, 500).is_empty());
}
