//! Classes (`class.rs`): guaranteed clients go first whenever they may take a turn; an
//! opportunistic client gets what they leave and gives the token back at its next hand-over.

use super::*;

fn opportunistic(id: &str, req: u16, lim: u16) -> ClientSpec {
    ClientSpec {
        class: ClientClass::Opportunistic,
        ..spec(id, req, lim, 100)
    }
}

/// `g` guaranteed at `g_at` (conn 1), `o` and `p` opportunistic at (0.3, 1.0) and (0.2, 1.0)
/// (conns 2 and 3).
fn trio(p: Params, g_at: (u16, u16)) -> Core {
    let specs = [
        spec("g", g_at.0, g_at.1, 100),
        opportunistic("o", 300, 1000),
        opportunistic("p", 200, 1000),
    ];
    let mut c = Core::new(p, &specs, 0);
    for (conn, id) in [(1, "g"), (2, "o"), (3, "p")] {
        c.hello(conn, id).unwrap();
    }
    c
}

/// The trio with `g` at (0.5, 0.5), paced over 100 ms (`p` otherwise), `g` having taken turns
/// alone from `t(0)` until it spent its pacing allowance (its last request waits): the core,
/// and when `g` was held back.
fn g_held_back(p: Params) -> (Core, Micros) {
    let mut c = trio(
        Params {
            pace_us: 100 * MS,
            ..p
        },
        (500, 500),
    );
    let mut now = t(0);
    let mut g = c.token_request(now, 1, 0, 0);
    while let Some(("g", _, q)) = grant(&g) {
        now += q;
        g = c.token_request(now, 1, 0, q);
    }
    (c, now)
}

#[test]
fn a_waiting_guaranteed_client_goes_before_opportunistic_ones_however_far_behind() {
    let mut c = trio(params(), (500, 1000));
    // o holds; g and p ask meanwhile. g has had far more of the GPU than p (it is ahead by
    // usage and by any virtual time), yet at o's hand-over it is g's turn.
    assert_eq!(grant(&c.token_request(t(0), 2, 0, 0)).unwrap().0, "o");
    assert!(c.token_request(t(1), 3, 0, 0).is_empty());
    assert!(c.token_request(t(2), 1, 0, 0).is_empty());
    assert_eq!(c.class("g"), Some(ClientClass::Guaranteed));
    assert!(c.may_take_turn(t(2), "g"));
    let mut g = c.token_request(t(10), 2, 0, 10 * MS);
    // While g keeps asking, neither o nor p gets a turn.
    let mut now = t(10);
    while now < t(200) {
        let (who, _, q) = grant(&g).unwrap();
        assert_eq!(who, "g");
        now += q;
        g = c.token_request(now, 1, 0, q);
    }
    // When g stops asking, the opportunistic clients take their turns (after a moment for g's
    // next request, `the_token_waits_for_a_released_guaranteed_clients_next_request`).
    assert!(c.release(now + MS, 1, MS).is_empty());
    let r = c.tick(c.next_wakeup(now + MS).unwrap());
    assert!(matches!(grant(&r), Some(("o" | "p", _, _))), "{r:?}");
}

#[test]
fn opportunistic_clients_share_among_themselves_as_guaranteed_ones_do() {
    // With g idle, o and p rank by virtual time among themselves: p, whose turn is shorter in
    // virtual time at a smaller request, waits while o catches up, as two guaranteed clients
    // would.
    let run = |class: ClientClass| {
        let specs = [
            spec("g", 500, 1000, 100),
            ClientSpec {
                class,
                ..spec("o", 300, 1000, 100)
            },
            ClientSpec {
                class,
                ..spec("p", 200, 1000, 100)
            },
        ];
        let mut c = Core::new(params(), &specs, 0);
        c.hello(2, "o").unwrap();
        c.hello(3, "p").unwrap();
        let mut now = t(0);
        let mut order = Vec::new();
        let mut g = c.token_request(now, 2, 0, 0);
        assert!(c.token_request(now, 3, 0, 0).is_empty());
        for _ in 0..30 {
            let (who, conns, q) = grant(&g).unwrap();
            let (who, conn) = (who.to_string(), conns[0]);
            now += q;
            order.push((who, q));
            g = c.token_request(now, conn, 0, q);
        }
        order
    };
    assert_eq!(
        run(ClientClass::Opportunistic),
        run(ClientClass::Guaranteed)
    );
}

#[test]
fn an_opportunistic_holder_is_not_renewed_while_a_guaranteed_client_waits() {
    let mut c = trio(params(), (500, 1000));
    assert_eq!(grant(&c.token_request(t(0), 2, 0, 0)).unwrap().0, "o");
    // Alone, o's hold goes on.
    assert_eq!(grant(&c.renew(t(10), 2, 10 * MS)).unwrap().0, "o");
    // With g waiting it does not: o drains, and g is granted at o's notice (handover.rs).
    assert!(c.token_request(t(12), 1, 0, 0).is_empty());
    let r = c.renew(t(20), 2, 10 * MS);
    assert_eq!(grant(&r).unwrap().0, "g");
    assert!(r.contains(&Action::Yield { conn: 2 }), "{r:?}");
}

#[test]
fn a_guaranteed_holder_is_renewed_beside_waiting_opportunistic_clients() {
    let mut c = trio(params(), (500, 1000));
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().0, "g");
    assert!(c.token_request(t(1), 2, 0, 0).is_empty());
    // o waits, but a request of g now would be granted straight back to it.
    let r = c.renew(t(10), 1, 10 * MS);
    assert_eq!(grant(&r).unwrap().0, "g", "{r:?}");
}

#[test]
fn a_guaranteed_client_held_back_by_its_limit_leaves_its_time_to_opportunistic_ones() {
    // g at (0.5, 0.5) is paced over 100 ms: once it has spent its allowance, o gets the turns,
    // each ending when g may go again.
    let p = Params {
        base_quota_us: 80 * MS,
        ..params()
    };
    let (mut c, mut now) = g_held_back(p);
    // g waits for its allowance: o, asking now, is granted, for no longer than g's wait
    // (not its 80 ms quota estimate).
    assert!(!c.may_take_turn(now, "g"));
    let back = c.next_wakeup(now).expect("g waits for a time");
    assert!(back > now + p.min_quota_us && back < now + 80 * MS);
    let o = c.token_request(now, 2, 0, 0);
    let (who, _, q) = grant(&o).unwrap();
    assert_eq!((who, now + q), ("o", back));
    // At o's hand-over g goes again, o asking too.
    now += q;
    assert!(c.may_take_turn(now, "g"));
    assert_eq!(grant(&c.token_request(now, 2, 0, q)).unwrap().0, "g");
}

#[test]
fn an_opportunistic_holder_is_renewed_up_to_a_held_back_guaranteed_clients_return() {
    // g (0.5, 0.5) has spent its pacing allowance and waits; o's turn ends well before g may
    // go again. A request of o's would be granted straight back, up to g's return, so its
    // Renew is (o's queue stays, the GPU does not idle for a drain), to the same end.
    let (mut c, mut now) = g_held_back(params());
    c.set_told_handover_due(2);
    let back = c.next_wakeup(now).unwrap();
    let o = c.token_request(now, 2, 0, 0);
    let (_, _, q) = grant(&o).unwrap();
    now += q;
    assert!(now + 10 * MS < back);
    let mut asked = c.clone();
    let by_request =
        grant(&asked.token_request(now, 2, 0, q)).map(|(w, cs, q)| (w.to_string(), cs, q));
    let r = c.renew(now, 2, q);
    let renewed = grant(&r).map(|(w, cs, q)| (w.to_string(), cs, q));
    assert_eq!(renewed, by_request, "{r:?}");
    let (who, _, mut rq) = renewed.unwrap();
    assert_eq!(who, "o");
    // Renewed turn after turn, never past g's return; then g goes, o asking too.
    for _ in 0..100 {
        now += rq;
        assert!(now <= back);
        if now == back {
            break;
        }
        rq = grant(&c.renew(now, 2, rq))
            .and_then(|(w, _, q)| (w == "o").then_some(q))
            .unwrap();
    }
    assert_eq!(now, back);
    assert_eq!(grant(&c.token_request(now, 2, 0, rq)).unwrap().0, "g");
}

#[test]
fn full_contention_is_judged_among_the_guaranteed_clients_alone() {
    // g (0.5, 0.5) beside o and p: all three request the whole GPU together, the guaranteed one
    // alone only half of it, so g's limit holds (otherwise, going first and unchecked, it
    // would take every turn).
    let p = Params {
        pace_us: 100 * MS,
        ..params()
    };
    let mut c = trio(p, (500, 500));
    let mut g = c.token_request(t(0), 2, 0, 0);
    assert!(c.token_request(t(0), 3, 0, 0).is_empty());
    assert!(c.token_request(t(0), 1, 0, 0).is_empty());
    let mut now = t(0);
    let mut held = HashMap::new();
    for _ in 0..2000 {
        if now > t(900) {
            break;
        }
        match grant(&g) {
            Some((who, conns, q)) => {
                *held.entry(who.to_string()).or_insert(0) += q;
                now += q;
                g = c.token_request(now, conns[0], 0, q);
            }
            None => {
                now = c.next_wakeup(now).unwrap().max(now + 1);
                g = c.tick(now);
            }
        }
    }
    let span = (now - t(0)) as f64;
    let g_share = held["g"] as f64 / span;
    assert!((0.45..=0.52).contains(&g_share), "g held {g_share:.3}");
    assert!(held["o"] > held["p"], "{held:?}");
}

#[test]
fn the_token_waits_for_a_released_guaranteed_clients_next_request() {
    // g's hold ended with a Release (the hook's idle thread between two launches, at its quota's
    // end or, by a coarse clock, a little before it): the next request of g is on its way, and
    // o, waiting, is not granted meanwhile.
    for released in [100i64, -200] {
        let mut c = trio(params(), (500, 1000));
        let (_, _, quota) = grant(&c.token_request(t(0), 1, 0, 0)).unwrap();
        assert!(c.token_request(t(1), 2, 0, 0).is_empty());
        let at = (t(0) + quota).saturating_add_signed(released);
        assert!(
            c.release(at, 1, quota).is_empty(),
            "released at {released} µs"
        );
        assert_eq!(
            grant(&c.token_request(at + 300, 1, 0, quota)).unwrap().0,
            "g"
        );
        // Had g not asked again, o would have been granted at the wait's end.
        let mut d = trio(params(), (500, 1000));
        grant(&d.token_request(t(0), 1, 0, 0)).unwrap();
        assert!(d.token_request(t(1), 2, 0, 0).is_empty());
        assert!(d.release(at, 1, quota).is_empty());
        let wake = d.next_wakeup(at).unwrap();
        assert!(wake <= at + MS);
        assert_eq!(grant(&d.tick(wake)).unwrap().0, "o");
    }
}

#[test]
fn an_opportunistic_turn_beside_a_guaranteed_client_between_requests_is_short() {
    // g held the token a moment ago and is on the CPU: o's turn is the min quota, not its
    // quota estimate (g's next request waits for it), less o's usual drain (the work its CPU
    // queued ahead, drained at the hand-over).
    let p = Params {
        base_quota_us: 40 * MS,
        ..params()
    };
    let mut c = trio(p, (500, 1000));
    let (_, _, q) = grant(&c.token_request(t(0), 1, 0, 0)).unwrap();
    c.release(t(0) + q / 2, 1, q / 2);
    let (who, _, q) = grant(&c.token_request(t(30), 2, 0, 0))
        .map(|(w, c, q)| (w.to_string(), c, q))
        .unwrap();
    assert_eq!((who.as_str(), q), ("o", p.min_quota_us));
    // o drains 1 ms past each turn: its next turn leaves room for that.
    let now = t(30) + q;
    c.token_request(now + MS, 2, MS, q);
    c.release(now + MS + q, 2, q);
    assert!(c.token_request(now + 2 * MS + q, 1, 0, 0).len() == 1);
    c.release(now + 3 * MS + q, 1, MS);
    let (_, _, q2) = grant(&c.token_request(now + 4 * MS + q, 2, 0, 0)).unwrap();
    assert!(q2 < p.min_quota_us, "o's turn {q2} µs");
    // Long after g's last hold, o takes turns of its own estimate again.
    let later = now + 200 * MS;
    c.release(later, 2, q2);
    let (_, _, q3) = grant(&c.token_request(later + MS, 2, 0, 0)).unwrap();
    assert!(q3 > 10 * MS, "o's turn {q3} µs");
}

#[test]
fn an_opportunistic_client_does_not_co_run_beside_a_guaranteed_one() {
    // (An idle uncapped client connected: the capped `o` may co-run, `capped.rs`.)
    let specs = [
        spec("g", 500, 500, 100),
        opportunistic("o", 300, 500),
        spec("u", 0, 1000, 100),
    ];
    let mut c = Core::new(params(), &specs, 0);
    c.set_co_run(CoRunSettings {
        below: 0.6,
        quota_us: 10 * MS,
    });
    c.hello(1, "g").unwrap();
    c.hello(2, "o").unwrap();
    c.hello(99, "u").unwrap();
    c.busy(T0, 2, 100 * MS, 600 * MS, 0, None).unwrap();
    c.busy(T0, 1, 570 * MS, 600 * MS, 0, None).unwrap();
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().0, "g");
    // o is light, but g holds the token: o waits, with no wake-up of its own.
    assert!(c.token_request(t(1), 2, 0, 0).is_empty());
    assert!(!c.co_running("o"));
    assert_eq!(
        c.next_wakeup(t(1)),
        Some(t(0) + 10 * MS + params().grace_us)
    );
    // When g's hold ends and g does not ask again, o co-runs.
    let r = c.release(t(5), 1, 5 * MS);
    assert_eq!(grant(&r).unwrap().0, "o");
    assert!(c.co_running("o"));
}

#[test]
fn a_class_change_starts_a_new_account() {
    let mut c = trio(params(), (500, 1000));
    assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().0, "g");
    c.release(t(10), 1, 10 * MS);
    assert!(c.virtual_time_us("g").unwrap() > 0);
    let specs = [
        opportunistic("g", 500, 1000),
        opportunistic("o", 300, 1000),
        opportunistic("p", 200, 1000),
    ];
    c.set_config(t(20), &specs);
    assert_eq!(c.class("g"), Some(ClientClass::Opportunistic));
    // Its virtual time is now that of its new class, where no one has had a turn yet.
    assert_eq!(c.virtual_time_us("g"), Some(0));
    assert_eq!(c.usage_us(t(20), "g"), Some(0));
}
