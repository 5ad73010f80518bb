//! Charging turns by fill (`Core::set_charge_by_fill`) in the virtual-clock simulation: a
//! launch-bound tenant's request and limit hold in GPU time (the GPU model's busy segments),
//! not in token time.

mod harness;
use gem_schd::core::CoRunSettings;
use harness::*;

/// Batch-1 decode as on an H200: one short graph replay per token, then the CPU reads the
/// token back (the GPU busy ~0.3 of the time alone).
fn decode_light() -> Pattern {
    Pattern {
        kernel_us: 120,
        kernels: 1,
        gap_us: 280,
        idle: vec![],
        blind: true,
        launch_us: 0,
    }
}

/// The tenants start when gem-schd has been up for a while, as on a node.
const ARRIVE: Micros = 12 * S;

/// The simulation of `clients`, run to `horizon`, with the hook's habits (4 ms clock,
/// renewals, the idle thread's release) and Busy reports; charged by fill or not, co-running
/// light clients or not.
fn ran(clients: Vec<(ClientSpec, Pattern)>, by_fill: bool, co_run: bool, horizon: Micros) -> Sim {
    let clients = clients
        .into_iter()
        .map(|(s, p)| (s, p.idle_during(0, ARRIVE)))
        .collect();
    let mut sim = Sim::new(Params::default(), clients);
    sim.core.set_max_hold(0);
    sim.tick = 4 * MS;
    sim.renew = true;
    sim.release_idle = 10 * MS;
    sim.release_at_deadline = Some(2 * MS);
    sim.busy_reports = true;
    if co_run {
        sim.core.set_co_run(CoRunSettings {
            below: 0.6,
            ..CoRunSettings::default()
        });
    }
    sim.core.set_charge_by_fill(by_fill, 0);
    sim.run(horizon);
    sim
}

/// GPU time of each client over [ARRIVE + 3 s, horizon).
fn shares(sim: &Sim, horizon: Micros) -> Vec<f64> {
    (0..sim.clients.len())
        .map(|i| sim.share(i, ARRIVE + 3 * S, horizon))
        .collect()
}

#[test]
fn a_launch_bound_tenant_capped_alone_gets_its_limit_in_gpu_time() {
    let horizon = ARRIVE + 30 * S;
    let alone = |by_fill| {
        ran(
            vec![(spec("t", 300, 300), training_launch_bound())],
            by_fill,
            false,
            horizon,
        )
    };
    let (token, fill) = (alone(false), alone(true));
    let (t, f) = (shares(&token, horizon)[0], shares(&fill, horizon)[0]);
    let worst = fill.max_window_share(0, S, horizon);
    eprintln!(
        "capped 0.3, duty {:.2}: by token time {t:.3}, by fill {f:.3} (worst 1 s {worst:.3})",
        training_launch_bound().duty()
    );
    // By token time it gets 0.3 of the wall and uses part of it; by fill, 0.3 of GPU time.
    assert!(t < 0.27, "by token time {t:.3}");
    assert!((0.285..=0.305).contains(&f), "by fill {f:.3}");
    assert!(worst <= 0.31, "by fill, a 1 s window at {worst:.3}");
}

#[test]
fn capped_launch_bound_training_beside_co_running_decode_gets_its_request_in_gpu_time() {
    let horizon = ARRIVE + 30 * S;
    let pair = |by_fill| {
        ran(
            vec![
                (spec("train", 500, 500), training_launch_bound()),
                (spec("decode", 500, 1000), decode_light()),
            ],
            by_fill,
            true,
            horizon,
        )
    };
    let (token, fill) = (pair(false), pair(true));
    let (t, f) = (shares(&token, horizon), shares(&fill, horizon));
    let worst = fill.max_window_share(0, S, horizon);
    eprintln!(
        "training {:.2} / decode {:.2} duty: by token time {:.3} / {:.3}, by fill {:.3} / {:.3} \
         (training's worst 1 s {worst:.3})",
        training_launch_bound().duty(),
        decode_light().duty(),
        t[0],
        t[1],
        f[0],
        f[1]
    );
    assert!(f[0] >= 0.48, "training by fill {:.3}", f[0]);
    assert!(
        f[0] > t[0] + 0.03,
        "by fill {:.3}, by token {:.3}",
        f[0],
        t[0]
    );
    assert!(
        worst <= 0.51,
        "training's worst 1 s {worst:.3} at a 0.5 limit"
    );
    assert!(f[1] >= 0.2, "decode {:.3}", f[1]);
}

#[test]
fn a_launch_bound_guaranteed_tenant_gets_its_request_beside_opportunistic_ones() {
    let horizon = ARRIVE + 30 * S;
    let trio = |by_fill| {
        ran(
            vec![
                (spec("g", 500, 500), training_launch_bound()),
                (opportunistic("o", 300, 1000), Pattern::matmul()),
                (opportunistic("p", 200, 1000), Pattern::medium()),
            ],
            by_fill,
            false,
            horizon,
        )
    };
    let (token, fill) = (trio(false), trio(true));
    let (t, f) = (shares(&token, horizon), shares(&fill, horizon));
    eprintln!(
        "guaranteed launch-bound 0.5/0.5 beside o 0.3, p 0.2: by token time {:.3} / {:.3} / {:.3}, \
         by fill {:.3} / {:.3} / {:.3}",
        t[0], t[1], t[2], f[0], f[1], f[2]
    );
    assert!(f[0] >= 0.48, "g by fill {:.3}", f[0]);
    assert!(
        f[0] > t[0] + 0.1,
        "g by fill {:.3}, by token time {:.3}",
        f[0],
        t[0]
    );
    // The opportunistic clients take turns in what g leaves, in proportion to their requests.
    assert!(f[1] > f[2], "o {:.3}, p {:.3}", f[1], f[2]);
}

#[test]
fn four_tenants_of_different_fills_split_the_gpu_time_by_their_requests() {
    let horizon = ARRIVE + 30 * S;
    let four = |by_fill| {
        ran(
            vec![
                (spec("conv", 100, 100), Pattern::medium()),
                (spec("matmul", 200, 200), Pattern::matmul()),
                (spec("elem", 300, 300), training_launch_bound()),
                (
                    spec("encoder", 400, 400),
                    Pattern {
                        launch_us: 60,
                        ..Pattern::medium()
                    },
                ),
            ],
            by_fill,
            false,
            horizon,
        )
    };
    let (token, fill) = (four(false), four(true));
    let (t, f) = (shares(&token, horizon), shares(&fill, horizon));
    let (bt, bf) = (t.iter().sum::<f64>(), f.iter().sum::<f64>());
    eprintln!("four by token time {t:.3?} (busy {bt:.3}), by fill {f:.3?} (busy {bf:.3})");
    // Together they request the whole GPU; what their CPUs leave idle of their turns is lost
    // either way (no overlap without co-running), but by fill the GPU time they do get is
    // split by their requests, where by token time the launch-bound one got 0.6 of its part.
    for (got, req) in f.iter().zip([0.1, 0.2, 0.3, 0.4]) {
        let part = got / bf;
        assert!(
            (part - req).abs() <= 0.015,
            "by fill {f:.3?}: {part:.3} of the GPU time at {req}"
        );
    }
    assert!(
        t[2] / bt < 0.25,
        "by token time the launch-bound one got {:.3}",
        t[2] / bt
    );
}
