//! Co-running (`corun.rs`): light clients granted beside the holder, charged by their fill,
//! held to their limit; holders' limits raised by the pace they lose.

use super::*;

/// Training-like `t` (0.5, 0.5) and inference-like `i` (0.5, 0.5); conn 1 = t, 2 = i. Co-running
/// below a fill of 0.6, probes off unless asked.
fn pair(probe_every_us: Micros) -> Core {
    let mut c = Core::new(
        params(),
        &[spec("t", 500, 500, 100), spec("i", 500, 500, 100)],
        0,
    );
    c.set_co_run(CoRunSettings {
        below: 0.6,
        quota_us: 10 * MS,
        probe_every_us,
        probe_us: 100 * MS,
    });
    c.hello(1, "t").unwrap();
    c.hello(2, "i").unwrap();
    c
}

/// `conn` reports its fill as `fill` over 40 ms of holds.
fn fill(c: &mut Core, now: Micros, conn: ConnId, fill: f64) {
    let held = 40 * MS;
    c.busy(now, conn, (held as f64 * fill) as Micros, held, 100)
        .unwrap();
}

#[test]
fn a_light_client_runs_beside_the_holder_and_a_heavy_one_waits() {
    let mut c = pair(0);
    fill(&mut c, t(0), 1, 0.95);
    fill(&mut c, t(0), 2, 0.3);
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().0, "t");
    // i is light: granted at once, while t holds the token.
    let acts = c.token_request(t(1), 2, 0, 0);
    let g = grant(&acts).unwrap();
    assert_eq!((g.0, g.1.as_slice(), g.2), ("i", &[2u64][..], 10 * MS));
    assert_eq!(c.holder(), Some("t"));
    assert!(c.co_running("i"));
    // Its renewal goes on beside t too.
    assert_eq!(grant(&c.renew(t(11), 2, 0)).unwrap().0, "i");
    // Heavy, t is not co-run: with the same fill i would wait for t's turn to end.
    let mut d = pair(0);
    fill(&mut d, t(0), 1, 0.95);
    fill(&mut d, t(0), 2, 0.95);
    grant(&d.token_request(t(0), 1, 0, 0)).unwrap();
    assert_eq!(grant(&d.token_request(t(1), 2, 0, 0)), None);
    assert!(!d.co_running("i"));
}

#[test]
fn off_by_default_and_unknown_fill_means_turns() {
    let mut c = Core::new(
        params(),
        &[spec("t", 500, 500, 100), spec("i", 500, 500, 100)],
        0,
    );
    c.hello(1, "t").unwrap();
    c.hello(2, "i").unwrap();
    fill(&mut c, t(0), 2, 0.3);
    grant(&c.token_request(t(0), 1, 0, 0)).unwrap();
    assert_eq!(
        grant(&c.token_request(t(1), 2, 0, 0)),
        None,
        "co-running is off"
    );
    // On, but i has reported nothing yet: it takes turns until its fill is known.
    let mut d = pair(0);
    grant(&d.token_request(t(0), 1, 0, 0)).unwrap();
    assert_eq!(grant(&d.token_request(t(1), 2, 0, 0)), None);
}

#[test]
fn a_co_hold_is_charged_its_fill_and_a_co_runner_at_its_limit_takes_turns() {
    let mut c = pair(0);
    fill(&mut c, t(0), 2, 0.55);
    // i co-runs alone for 100 ms in 10 ms co-holds: charged 0.55 of that.
    let mut now = t(0);
    grant(&c.token_request(now, 2, 0, 0)).unwrap();
    for _ in 0..10 {
        now += 10 * MS;
        assert_eq!(grant(&c.token_request(now, 2, 0, 0)).unwrap().0, "i");
    }
    let used = c.usage_us(now, "i").unwrap();
    assert!(
        used.abs_diff(55 * MS) <= MS,
        "charged {used} µs for 100 ms at a fill of 0.55"
    );
    // Its limit is 0.5 of the 1 s window, which at a fill of 0.55 it passes in ~0.9 s: then
    // the next co-hold would pass the limit, and it waits like any client.
    let mut last = None;
    while c.co_running("i") && now < t(5000) {
        now += 10 * MS;
        last = grant(&c.token_request(now, 2, 0, 0)).map(|g| g.2);
    }
    assert!(now < t(1000), "still co-running at {} ms", (now - T0) / MS);
    let used = c.usage_us(now, "i").unwrap();
    assert!(
        (490 * MS..=500 * MS).contains(&used),
        "stopped co-running at {used} µs"
    );
    // It takes turns from then on, which its limit holds too: its co-holds count in its usage,
    // so what is left of its 500 ms is all a turn may take.
    assert_eq!(c.holder(), Some("i"));
    assert!(
        last.is_some_and(|q| q <= 500 * MS - used + 2 * MS),
        "turn of {last:?} µs after {used} µs used"
    );
}

#[test]
fn the_holder_is_raised_by_the_pace_it_loses_while_co_runners_run() {
    let mut c = pair(0);
    fill(&mut c, t(0), 2, 0.3);
    // t alone: 100 launches per ms held.
    for k in 0..10 {
        c.busy(t(k * 5), 1, 90 * MS, 100 * MS, 10_000).unwrap();
    }
    assert_eq!(c.limit_in_force("t"), Some(500));
    // i co-runs; t's pace drops to 71 launches per ms.
    grant(&c.token_request(t(100), 2, 0, 0)).unwrap();
    for k in 0..10 {
        c.busy(t(101 + k), 1, 90 * MS, 100 * MS, 7_100).unwrap();
    }
    let lim = c.limit_in_force("t").unwrap();
    assert!((700..=710).contains(&lim), "t's limit in force {lim}");
    // i leaves: a second after its last co-hold t's limit is its own again.
    c.release(t(120), 2, 0);
    c.busy(t(1200), 1, 90 * MS, 100 * MS, 10_000).unwrap();
    assert_eq!(c.limit_in_force("t"), Some(500));
}

#[test]
fn co_running_pauses_for_probes_and_ends_with_the_connection() {
    let mut c = pair(1000 * MS);
    fill(&mut c, t(0), 1, 0.95);
    fill(&mut c, t(0), 2, 0.3);
    grant(&c.token_request(t(0), 1, 0, 0)).unwrap();
    // T0 is 1 s after the core's start: inside a probe (the first 100 ms of each second).
    assert_eq!(
        grant(&c.token_request(t(1), 2, 0, 0)),
        None,
        "probing: i waits for turns"
    );
    let mut d = pair(1000 * MS);
    fill(&mut d, t(0), 2, 0.3);
    grant(&d.token_request(t(150), 1, 0, 0)).unwrap();
    assert!(grant(&d.token_request(t(151), 2, 0, 0)).is_some());
    assert!(d.co_running("i"));
    d.disconnect(t(155), 2);
    assert!(!d.co_running("i"));
    assert!(
        d.usage_us(t(155), "i").unwrap() > 0,
        "the co-hold was charged at the hang-up"
    );
}
