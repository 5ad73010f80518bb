//! Unit tests of the core, one behaviour each, on a virtual clock.

use super::reload::carried_pacing;
use super::*;
use gem_proto::code;

mod classes;
mod contention;
mod corun;
mod engine;
mod handover;
mod pacing;

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
        class: ClientClass::Guaranteed,
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
fn a_holder_that_hangs_up_without_its_report_is_charged_to_the_hang_up() {
    // a holds 10 ms (grace 5 ms) and hangs up without a report: a hook that lives reports its
    // drain, so one that hangs up was draining (or killed in its drain) until then. Within the
    // grace it is charged to the hang-up.
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.disconnect(t(13), 1);
    assert_eq!(c.usage_us(t(13), "a"), Some(13 * MS));
    // Past the grace the hold has expired (the token was free at 15 ms): charged to the
    // hang-up too, no further than the grace past its quota (it was charged only to its
    // quota's end, its drain and the token's wait for it counted nowhere).
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.disconnect(t(40), 1);
    assert_eq!(c.usage_us(t(40), "a"), Some(15 * MS));
    // A client whose drains run longer (it reported 8 ms of overuse before) is charged as far
    // as its usual overrun, the hold granted meanwhile pushed back, as a late report would.
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    // Its hold expired at 15 ms; its report at 18 ms charges it to then, and it goes again.
    let acts = c.token_request(t(18), 1, 8 * MS, 0);
    assert_eq!(grant(&acts).map(|g| (g.0, g.2)), Some(("a", 10 * MS)));
    c.token_request(t(20), 3, 0, 0);
    let acts = c.tick(t(33));
    assert_eq!(grant(&acts).map(|g| g.0), Some("b"), "{acts:?}");
    c.disconnect(t(200), 1);
    // 18 ms, then 28 ms + 8: b's hold, granted at 33 ms, is charged from 36 ms.
    assert_eq!(c.usage_us(t(200), "a"), Some(18 * MS + 18 * MS));
    assert_eq!(c.usage_us(t(200), "b"), Some(7 * MS));
    // A process that reported its turn's end hangs up at no charge.
    let mut c = two();
    c.token_request(t(0), 1, 0, 0);
    c.release(t(4), 1, 4 * MS);
    c.disconnect(t(40), 1);
    assert_eq!(c.usage_us(t(40), "a"), Some(4 * MS));
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
