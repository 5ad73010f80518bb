//! Virtual-clock simulations of the scheduling core with clients that behave like
//! the hook: ask for the token, launch kernel bursts while the quota lasts (a burst
//! that does not fit the rest of the quota asks again first), report overuse and the
//! predicted burst, and give the token back when idle. The GPU runs kernels one after
//! another in submission order and cannot be preempted. The harness is in `harness/mod.rs`.

mod harness;
use gem_schd::core::CoRunSettings;
use harness::*;

// ---- (0.3, 0.3) + (0.7, 0.7): both capped ----

#[test]
fn capped_pair_long_and_tiny() {
    let sim = run(vec![
        (spec("a", 300, 300), Pattern::long()),
        (spec("b", 700, 700), Pattern::tiny()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.30));
    assert_share(&sim, 1, held(&sim, 1, 0.70));
    assert_within_limits(&sim);
}

#[test]
fn capped_pair_tiny_and_long() {
    let sim = run(vec![
        (spec("a", 300, 300), Pattern::tiny()),
        (spec("b", 700, 700), Pattern::long()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.30));
    assert_share(&sim, 1, held(&sim, 1, 0.70));
    assert_within_limits(&sim);
}

#[test]
fn capped_pair_medium_both() {
    let sim = run(vec![
        (spec("a", 300, 300), Pattern::medium()),
        (spec("b", 700, 700), Pattern::medium()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.30));
    assert_share(&sim, 1, held(&sim, 1, 0.70));
    assert_within_limits(&sim);
}

#[test]
fn capped_client_alone_is_held_to_its_limit() {
    // Idle GPU time is not given beyond a limit: the limit is a hard cap.
    let sim = run(vec![
        (spec("a", 300, 300), Pattern::tiny()),
        (spec("b", 700, 700), Pattern::absent()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.30));
    assert_share(&sim, 1, 0.0);
    assert_within_limits(&sim);
}

// ---- (0.2, 1.0) + (0.2, 1.0): equal, elastic ----

#[test]
fn elastic_pair_splits_evenly_long_long() {
    let sim = run(vec![
        (spec("a", 200, 1000), Pattern::long()),
        (spec("b", 200, 1000), Pattern::long()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.50));
    assert_share(&sim, 1, held(&sim, 1, 0.50));
    assert_within_limits(&sim);
}

#[test]
fn elastic_pair_splits_evenly_long_tiny() {
    let sim = run(vec![
        (spec("a", 200, 1000), Pattern::long()),
        (spec("b", 200, 1000), Pattern::tiny()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.50));
    assert_share(&sim, 1, held(&sim, 1, 0.50));
    assert_within_limits(&sim);
}

#[test]
fn elastic_idle_client_share_goes_to_the_other() {
    // b is idle from 20 s to 40 s: a gets (almost) the whole GPU then.
    let sim = run(vec![
        (spec("a", 200, 1000), Pattern::tiny()),
        (
            spec("b", 200, 1000),
            Pattern::long().idle_during(20 * S, 40 * S),
        ),
    ]);
    let a_idle = sim.share(0, 20 * S + 100 * MS, 40 * S);
    // Tiny's own duty cycle (1 ms of kernels, 20 µs of CPU) bounds it at ~0.98.
    assert!(a_idle >= 0.96, "a got {a_idle:.4} while b was idle");
    assert!(sim.share(1, 20 * S + 100 * MS, 40 * S) == 0.0);
    // Both competing before: an even split.
    assert!((sim.share(0, 0, 20 * S) - 0.5).abs() <= 0.02);
    // Over the minute the GPU never sat idle while someone had work.
    assert!(total(&sim) >= 0.96, "total {:.4}", total(&sim));
    assert_within_limits(&sim);
}

#[test]
fn elastic_client_alone_takes_the_gpu() {
    let sim = run(vec![
        (spec("a", 200, 1000), Pattern::long()),
        (spec("b", 200, 1000), Pattern::absent()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 1.0));
}

// ---- (0.5, 0.5) + (0.1, 1.0) ----

#[test]
fn capped_and_elastic_busy() {
    let sim = run(vec![
        (spec("a", 500, 500), Pattern::long()),
        (spec("b", 100, 1000), Pattern::tiny()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.50));
    assert_share(&sim, 1, held(&sim, 1, 0.50));
    assert_within_limits(&sim);
}

#[test]
fn capped_and_elastic_busy_swapped_patterns() {
    let sim = run(vec![
        (spec("a", 500, 500), Pattern::tiny()),
        (spec("b", 100, 1000), Pattern::long()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.50));
    assert_share(&sim, 1, held(&sim, 1, 0.50));
    assert_within_limits(&sim);
}

#[test]
fn capped_idle_elastic_takes_all() {
    let sim = run(vec![
        (spec("a", 500, 500), Pattern::absent()),
        (spec("b", 100, 1000), Pattern::long()),
    ]);
    assert_share(&sim, 0, 0.0);
    assert_share(&sim, 1, held(&sim, 1, 1.0));
}

#[test]
fn elastic_idle_capped_keeps_its_limit() {
    let sim = run(vec![
        (spec("a", 500, 500), Pattern::medium()),
        (spec("b", 100, 1000), Pattern::absent()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.50));
    assert_within_limits(&sim);
}

#[test]
fn capped_and_elastic_with_idle_gaps() {
    // a stops for 10 s twice; meanwhile b takes the GPU, and a's limit still holds.
    let sim = run(vec![
        (
            spec("a", 500, 500),
            Pattern::medium()
                .idle_during(15 * S, 25 * S)
                .idle_during(40 * S, 50 * S),
        ),
        (spec("b", 100, 1000), Pattern::tiny()),
    ]);
    let b_alone = sim.share(1, 15 * S + 100 * MS, 25 * S);
    assert!(b_alone >= 0.96, "b got {b_alone:.4} while a was idle");
    assert!(total(&sim) >= 0.96, "total {:.4}", total(&sim));
    assert_within_limits(&sim);
}

// ---- requests are guaranteed ----

#[test]
fn request_is_guaranteed_beyond_an_even_split() {
    // Least-usage alone would split 0.5/0.5; a's request of 0.7 comes first.
    let sim = run(vec![
        (spec("a", 700, 1000), Pattern::tiny()),
        (spec("b", 200, 1000), Pattern::long()),
    ]);
    assert_share(&sim, 0, held(&sim, 0, 0.70));
    assert_share(&sim, 1, held(&sim, 1, 0.30));
}

#[test]
fn three_clients_requests_and_limits() {
    let sim = run(vec![
        (spec("a", 200, 400), Pattern::long()),
        (spec("b", 300, 1000), Pattern::tiny()),
        (spec("c", 100, 300), Pattern::medium()),
    ]);
    // Everyone is busy: c is capped at 0.3; a and b split the rest by least usage,
    // a capped at 0.4 -> a 0.35, b 0.35, c 0.3.
    assert_share(&sim, 0, held(&sim, 0, 0.35));
    assert_share(&sim, 1, held(&sim, 1, 0.35));
    assert_share(&sim, 2, held(&sim, 2, 0.30));
    assert_within_limits(&sim);
}

// ---- hot reload keeps state, drops leavers ----

#[test]
fn reload_swaps_limits_and_keeps_clients() {
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("a", 300, 300), Pattern::tiny()),
            (spec("b", 700, 700), Pattern::long()),
        ],
    );
    sim.reconfigs
        .push(vec![spec("a", 700, 700), spec("b", 300, 300)]);
    sim.push(30 * S, Ev::Reconfig(0));
    sim.run(60 * S);
    // A client whose share changes starts a new account: the new split holds in every
    // second from 1 s after the reload, and nobody waits at zero (the window used to need
    // 10 s to forget the old split; the client shrunk to 0.3 got nothing for seconds).
    let (a1, b1) = (sim.share(0, 0, 30 * S), sim.share(1, 0, 30 * S));
    let (a2, b2) = (sim.share(0, 31 * S, 60 * S), sim.share(1, 31 * S, 60 * S));
    for (i, share) in [(0, 0.7), (1, 0.3)] {
        let (lo, hi) = slice_shares(&sim, i, S, 31 * S, 60 * S);
        let want = held(&sim, i, share);
        eprintln!("after the reload, client {i}: per-1 s {lo:.3}..{hi:.3}, expected {want:.3}");
        assert!(
            lo >= want - 0.03 && hi <= want + 0.03,
            "client {i}: per-1 s {lo:.3}..{hi:.3}, expected {want:.3} ± 0.03"
        );
        let gap = longest_gap(&sim, i, 30 * S, 32 * S);
        assert!(
            gap <= 200 * MS,
            "client {i} waited {} ms after the reload",
            gap / MS
        );
    }
    let close = |x: f64, y: f64| (x - y).abs() <= 0.02;
    assert!(
        close(a1, held(&sim, 0, 0.3)) && close(b1, held(&sim, 1, 0.7)),
        "{a1} {b1}"
    );
    assert!(
        close(a2, held(&sim, 0, 0.7)) && close(b2, held(&sim, 1, 0.3)),
        "{a2} {b2}"
    );
    assert_eq!(sim.clients[0].errors + sim.clients[1].errors, 0);
}

#[test]
fn reload_removing_a_client_errors_it_and_frees_the_gpu() {
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("a", 500, 1000), Pattern::long()),
            (spec("b", 500, 1000), Pattern::long()),
        ],
    );
    sim.reconfigs.push(vec![spec("a", 500, 1000)]);
    sim.push(20 * S, Ev::Reconfig(0));
    sim.run(60 * S);
    assert!(
        sim.clients[1].errors >= 1,
        "b's request was answered with an error"
    );
    assert!(sim.share(1, 20 * S + 100 * MS, 60 * S) == 0.0);
    assert!(sim.share(0, 20 * S + 100 * MS, 60 * S) >= 0.98);
    assert_eq!(sim.core.client_ids().collect::<Vec<_>>(), vec!["a"]);
}

// ---- pacing: a capped client is held to its limit over short windows too ----

/// A (0.5, 0.5) client alone, busy from `arrive` on, with pacing window `pace_us`.
fn half_alone(pattern: Pattern, arrive: Micros, pace_us: Micros) -> Sim {
    half_alone_with(
        pattern,
        arrive,
        Params {
            pace_us,
            ..Params::default()
        },
    )
}

fn half_alone_with(pattern: Pattern, arrive: Micros, params: Params) -> Sim {
    let pattern = if arrive > 0 {
        pattern.idle_during(0, arrive)
    } else {
        pattern
    };
    let mut sim = Sim::new(params, vec![(spec("a", 500, 500), pattern)]);
    sim.run(60 * S);
    sim
}

/// The pacing checks of a (0.5, 0.5) client alone: over every pacing-window slice from
/// the end of its first window on, its share is 0.5 less its duty-cycle loss, give or
/// take `tol`; it never waits much longer than the off part of one pacing window.
#[track_caller]
fn assert_paced(sim: &Sim, arrive: Micros, pace: Micros, tol: f64) {
    let expected = held(sim, 0, 0.5);
    let (lo, hi) = slice_shares(sim, 0, pace, arrive + 10 * S, 60 * S);
    let gap = longest_gap(sim, 0, arrive + 10 * S, 60 * S);
    eprintln!(
        "paced alone (arrives {} s, pace {} ms): per-{} ms share {lo:.4}..{hi:.4} (expected {expected:.4}), longest wait {} ms, over 60 s {:.4}",
        arrive / S,
        pace / MS,
        pace / MS,
        gap as f64 / MS as f64,
        sim.share(0, arrive, 60 * S)
    );
    assert!(
        lo >= expected - tol && hi <= expected + tol,
        "per-{} ms share {lo:.4}..{hi:.4}, expected {expected:.4} ± {tol}",
        pace / MS
    );
    // Off for at most (1 - limit) of a pacing window, plus a grant's latency and one
    // grace period (a hold the scheduler waited on).
    assert!(
        gap <= pace / 2 + 2 * Params::default().grace_us,
        "waited {} ms in one stretch",
        gap / MS
    );
    assert_within_limits(sim);
}

const PACE: Micros = 1000 * MS;

#[test]
fn paced_alone_long_from_the_start() {
    assert_paced(&half_alone(Pattern::long(), 0, PACE), 0, PACE, 0.025);
}

#[test]
fn paced_alone_tiny_from_the_start() {
    assert_paced(&half_alone(Pattern::tiny(), 0, PACE), 0, PACE, 0.01);
}

#[test]
fn paced_alone_long_arriving_late() {
    // Arriving when gem-schd has been up a while (an empty window): without pacing it
    // would run 5 s at full speed, then wait 5 s.
    assert_paced(
        &half_alone(Pattern::long(), 12 * S, PACE),
        12 * S,
        PACE,
        0.025,
    );
}

#[test]
fn paced_alone_tiny_arriving_late() {
    assert_paced(
        &half_alone(Pattern::tiny(), 12 * S, PACE),
        12 * S,
        PACE,
        0.01,
    );
}

/// The short pacing window (`pace_short_us`, 100 ms): a capped client alone that arrives
/// late waits at most about the short window's off part, plus one burst and the grace. On
/// the pacing window alone it ran half a second, then waited as long: a batch-1 inference
/// tenant at 0.5 alone on an H100 waited 480 ms every second (docs/gpu-benchmarks.md,
/// round 10).
#[test]
fn a_late_capped_client_alone_waits_no_longer_than_the_short_window_allows() {
    let d = Params::default();
    for p in [Pattern::long(), Pattern::tiny(), Pattern::medium()] {
        let sim = half_alone(p.clone(), 12 * S, PACE);
        let gap = longest_gap(&sim, 0, 22 * S, 60 * S);
        let (lo, hi) = slice_shares(&sim, 0, PACE, 22 * S, 60 * S);
        eprintln!(
            "{} µs kernels: longest wait {} ms, per 1 s {lo:.4}..{hi:.4}",
            p.kernel_us,
            gap / MS
        );
        assert!(
            gap <= d.pace_short_us / 2 + p.kernel_us + d.grace_us,
            "{} µs kernels: waited {} ms in one stretch",
            p.kernel_us,
            gap / MS
        );
        let expected = held(&sim, 0, 0.5);
        assert!(
            lo >= expected - 0.025 && hi <= expected + 0.025,
            "{lo:.4}..{hi:.4}"
        );
        assert_within_limits(&sim);
        // The pacing window alone: the half-second waits.
        let off = half_alone_with(
            p,
            12 * S,
            Params {
                pace_us: PACE,
                pace_short_us: 0,
                ..d
            },
        );
        let gap = longest_gap(&off, 0, 22 * S, 60 * S);
        assert!(gap >= 400 * MS, "without the short window: {} ms", gap / MS);
    }
}

#[test]
fn without_pacing_a_late_capped_client_runs_in_blocks() {
    // The same checks fail with pacing off (the test above can fail): seconds at full
    // speed, then seconds of waiting.
    for p in [Pattern::long(), Pattern::tiny()] {
        let sim = half_alone(p, 12 * S, 0);
        let (lo, hi) = slice_shares(&sim, 0, PACE, 22 * S, 60 * S);
        let gap = longest_gap(&sim, 0, 22 * S, 60 * S);
        eprintln!(
            "unpaced alone: per-1 s share {lo:.4}..{hi:.4}, longest wait {} ms",
            gap / MS
        );
        assert!(lo < 0.1 && hi > 0.9 && gap > 3 * S, "{lo} {hi} {gap}");
        assert_within_limits(&sim);
    }
}

#[test]
fn paced_capped_beside_elastic_keeps_the_shares() {
    // (0.3, 0.5) + (0.2, 1.0), both busy: split by least usage, a at its limit. The
    // shares with pacing are those without it, ± 2 points.
    for (pa, pb) in [
        (Pattern::long(), Pattern::tiny()),
        (Pattern::tiny(), Pattern::long()),
        (Pattern::medium(), Pattern::medium()),
    ] {
        let clients = vec![(spec("a", 300, 500), pa), (spec("b", 200, 1000), pb)];
        let off = run_with(
            Params {
                pace_us: 0,
                ..Params::default()
            },
            clients.clone(),
        );
        let sim = run(clients);
        for i in 0..2 {
            let (before, after) = (off.share(i, 0, 60 * S), sim.share(i, 0, 60 * S));
            eprintln!(
                "  {}: unpaced {before:.4} paced {after:.4}",
                sim.clients[i].spec.id
            );
            assert!((after - before).abs() <= 0.02, "{before:.4} -> {after:.4}");
        }
        assert_share(&sim, 0, held(&sim, 0, 0.5));
        assert_share(&sim, 1, held(&sim, 1, 0.5));
        assert_within_limits(&sim);
        let (lo, hi) = slice_shares(&sim, 0, PACE, 10 * S, 60 * S);
        eprintln!("  a per 1 s: {lo:.4}..{hi:.4}");
        assert!(hi <= 0.5 + 0.025, "a used {hi:.4} of a pacing window");
    }
}

#[test]
fn paced_capped_pair_with_bursts_just_over_a_ninth_of_the_allowance() {
    // Found on the H200: (0.3, 0.3) + (0.7, 0.7) with 34 ms bursts, arriving late. Had
    // a paced client waited for a whole usual-sized grant, only 8 of them would fit in
    // 300 ms per second (a got 0.278 here, 0.273 on the GPU); it waits for a min quota.
    let late = 12 * S;
    let pair = || {
        vec![
            (spec("a", 300, 300), Pattern::matmul().idle_during(0, late)),
            (spec("b", 700, 700), Pattern::matmul().idle_during(0, late)),
        ]
    };
    let off = run_with(
        Params {
            pace_us: 0,
            ..Params::default()
        },
        pair(),
    );
    let sim = run(pair());
    for (i, want) in [(0, 0.3), (1, 0.7)] {
        let (before, after) = (off.share(i, late, 60 * S), sim.share(i, late, 60 * S));
        eprintln!("  unpaced {before:.4} paced {after:.4}");
        assert!((after - before).abs() <= 0.01, "{before:.4} -> {after:.4}");
        assert!((after - held(&sim, i, want)).abs() <= 0.02, "{after:.4}");
    }
    assert_within_limits(&sim);
}

/// How the pacing window trades waits against everything else:
/// `cargo test -p gem-schd --release --test sim pace_table -- --ignored --nocapture`.
#[test]
#[ignore]
fn pace_table() {
    let table = [0, 100, 250, 500, 1000, 2000]
        .map(|pace| (pace, 0))
        .into_iter()
        .chain([25, 50, 100, 200].map(|short| (1000, short)));
    for (pace, short) in table {
        let p = Params {
            pace_us: pace * MS,
            pace_short_us: short * MS,
            ..Params::default()
        };
        let mut line = format!("pace {pace:>4} ms, short {short:>3} ms:");
        for (name, pat) in [("long", Pattern::long()), ("tiny", Pattern::tiny())] {
            let sim = half_alone_with(pat, 12 * S, p);
            let (lo, hi) = slice_shares(&sim, 0, S, 22 * S, 60 * S);
            let (lo1, hi1) = slice_shares(&sim, 0, 100 * MS, 22 * S, 60 * S);
            line += &format!(
                " | alone {name}: per 1 s {lo:.3}..{hi:.3}, per 100 ms {lo1:.2}..{hi1:.2}, longest wait {:>4} ms, grants/s {:>3.0}",
                longest_gap(&sim, 0, 22 * S, 60 * S) / MS,
                sim.core.grants() as f64 / 48.0
            );
        }
        println!("{line}");
        let mut line = String::from("               ");
        for (name, clients) in [
            (
                "(0.3,0.3) medium + (0.7,0.7) tiny",
                vec![
                    (spec("a", 300, 300), Pattern::medium()),
                    (spec("b", 700, 700), Pattern::tiny()),
                ],
            ),
            (
                "(0.3,0.5) long + (0.2,1.0) tiny",
                vec![
                    (spec("a", 300, 500), Pattern::long()),
                    (spec("b", 200, 1000), Pattern::tiny()),
                ],
            ),
            (
                "(0.5,0.5) long + (0.1,1.0) tiny",
                vec![
                    (spec("a", 500, 500), Pattern::long()),
                    (spec("b", 100, 1000), Pattern::tiny()),
                ],
            ),
        ] {
            let sim = run_with(p, clients);
            line += &format!(
                " | {name}: {:.3} / {:.3}, busy {:.3}, grants/s {:.0}",
                sim.share(0, 0, 60 * S),
                sim.share(1, 0, 60 * S),
                total(&sim),
                sim.core.grants() as f64 / 60.0
            );
        }
        println!("{line}");
    }
}

/// Not a test of correctness but of how sharing granularity moves with the quota:
/// `cargo test -p gem-schd --test sim -- --ignored --nocapture quota_table`.
#[test]
#[ignore]
fn quota_table() {
    for (base, min) in [(250, 100), (100, 20), (50, 5), (20, 2), (5, 1)] {
        let params = Params {
            window_us: 10 * S,
            base_quota_us: base * MS,
            min_quota_us: min * MS,
            grace_us: 50 * MS,
            ..Params::default()
        };
        let mut sim = Sim::new(
            params,
            vec![
                (spec("a", 300, 300), Pattern::medium()),
                (spec("b", 700, 700), Pattern::tiny()),
            ],
        );
        sim.run(60 * S);
        // Spread of a's share over 100 ms slices after the first window.
        let slices: Vec<f64> = (100..600)
            .map(|k| sim.share(0, k * 100 * MS, (k + 1) * 100 * MS))
            .collect();
        let mean = slices.iter().sum::<f64>() / slices.len() as f64;
        let sd =
            (slices.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / slices.len() as f64).sqrt();
        println!(
            "base {base:>3} ms min {min:>3} ms: a {:.4} b {:.4} total {:.4}; a per 100 ms: mean {mean:.3} sd {sd:.3}; grants/s {:.0}",
            sim.share(0, 0, 60 * S),
            sim.share(1, 0, 60 * S),
            total(&sim),
            sim.core.grants() as f64 / 60.0
        );
    }
}

// ---- latency-sensitive inference beside training (issue 14) ----

/// Batch-1 inference: a request is 15 small kernels (1.5 ms of GPU time), then a sync and
/// 0.3 ms of CPU before the next one.
fn inference() -> Pattern {
    Pattern {
        kernel_us: 100,
        kernels: 15,
        gap_us: 300,
        idle: vec![],
        blind: false,
        launch_us: 0,
    }
}

/// Training: steps of 40 × 2.5 ms kernels (100 ms), a sync, 1 ms of CPU.
fn training() -> Pattern {
    Pattern {
        kernel_us: 2_500,
        kernels: 40,
        gap_us: 1_000,
        idle: vec![],
        blind: false,
        launch_us: 0,
    }
}

/// (pace window, longest inference wait, longest training wait, inference and training
/// shares per 1 s slice (min, max)).
fn train_infer(pace_us: Micros) -> (Micros, Micros, (f64, f64), (f64, f64)) {
    let params = Params {
        pace_us,
        ..Params::default()
    };
    let mut sim = Sim::new(
        params,
        vec![
            (spec("train", 500, 500), training()),
            (spec("infer", 500, 500), inference()),
        ],
    );
    sim.run(60 * S);
    let gi = longest_gap(&sim, 1, 10 * S, 60 * S);
    let gt = longest_gap(&sim, 0, 10 * S, 60 * S);
    let si = slice_shares(&sim, 1, S, 10 * S, 60 * S);
    let st = slice_shares(&sim, 0, S, 10 * S, 60 * S);
    eprintln!(
        "pace {} ms: longest wait inference {} ms, training {} ms; per-1 s shares inference {:.3}..{:.3}, training {:.3}..{:.3}",
        pace_us / MS,
        gi / MS,
        gt / MS,
        si.0,
        si.1,
        st.0,
        st.1
    );
    (gi, gt, si, st)
}

/// With the default 1 s pacing window, neither waits longer than one training step (the
/// non-preemptible unit, 100 ms) plus the grace period, and both hold their share in every
/// second (inference's GPU time is its held share × its duty cycle, 0.5 × 1.5/1.8). Shorter
/// pacing windows were tried (200, 100, 50 ms): no shorter waits (a training step cannot be cut),
/// and below 200 ms the inference tenant loses share (0.26–0.30 at 100 ms), because its grants
/// no longer fit the window's allowance beside a 100 ms step. So the default stays 1 s.
#[test]
fn inference_beside_training_waits_at_most_one_training_step() {
    let (gi, gt, si, st) = train_infer(PACE);
    let bound = 100 * MS + Params::default().grace_us;
    assert!(gi <= bound, "inference waited {} ms", gi / MS);
    assert!(gt <= bound, "training waited {} ms", gt / MS);
    assert!(st.0 >= 0.49 && st.1 <= 0.51, "training {st:?}");
    let duty = inference().duty();
    assert!(
        si.0 >= 0.5 * duty - 0.02,
        "inference {si:?} (duty {duty:.3})"
    );
    for pace in [200 * MS, 100 * MS, 50 * MS] {
        train_infer(pace);
    }
}

// ---- the usage report (the node daemon's per-pod delivered share) ----

/// What gem-schd reports as each client's token time over the last window (exported
/// by the node daemon as `kubeshare_pod_gpu_delivered_share`) matches the GPU time the
/// simulation measured over that window, for known workloads and shares.
#[test]
fn usage_report_tells_the_delivered_share() {
    for (a, b) in [
        ((300, 300, Pattern::long()), (700, 700, Pattern::matmul())),
        ((200, 1000, Pattern::medium()), (500, 500, Pattern::long())),
    ] {
        let sim = run(vec![(spec("a", a.0, a.1), a.2), (spec("b", b.0, b.1), b.2)]);
        let end = 60 * S;
        let r = gem_schd::usage::report(&sim.core, end);
        assert_eq!(r.window_us, Params::default().window_us);
        for (i, id) in ["a", "b"].into_iter().enumerate() {
            let reported = r.client(id).map(|c| c.share(r.window_us)).unwrap_or(-1.0);
            // GPU time over the window divided by the pattern's duty cycle: the token
            // time (the hold includes the CPU gaps between kernels).
            let measured = sim.share(i, end - r.window_us, end) / sim.clients[i].pattern.duty();
            eprintln!("{id}: reported {reported:.4}, measured {measured:.4}");
            assert!(
                (reported - measured).abs() <= 0.02,
                "{id}: reported {reported:.4}, simulation measured {measured:.4}"
            );
        }
    }
}

// ---- a blind launcher overruns its grants (the hook gates per launch) ----

/// Capped alone with 50 ms bursts queued whole (the H100 run's 0.323 window at limit 0.3):
/// every 1 s window stays within the limit + 1 pp. A regression bound: here the overrun of a
/// short grant is paid for by the client's own old usage sliding out of the pacing window
/// (this holds with or without the overrun allowance; the unit test
/// `a_paced_grant_leaves_room_for_the_clients_usual_overrun` shows the case it closes).
#[test]
fn blind_bursts_stay_within_the_limit_over_every_second() {
    for (lim, gap) in [300u16, 500]
        .into_iter()
        .flat_map(|l| [(l, 2 * MS), (l, 20 * MS), (l, 70 * MS)])
    {
        let sim = run(vec![
            (spec("a", lim, lim), Pattern::blind_50ms(gap)),
            (spec("b", 1000 - lim, 1000 - lim), Pattern::absent()),
        ]);
        let l = f64::from(lim) / 1000.0;
        let worst = sim.max_window_share(0, S, 60 * S);
        let mean = sim.share(0, 0, 60 * S);
        eprintln!(
            "limit {l}, gap {} ms: worst 1 s window {worst:.4}, mean {mean:.4}",
            gap / MS
        );
        assert!(
            worst <= l + 0.01,
            "limit {l}: a 1 s window reached {worst:.4}"
        );
        // Not bought by idling: within 2 pp of what the limit and the duty cycle allow.
        let duty = Pattern::blind_50ms(gap).duty();
        assert!(
            mean >= l.min(duty) - 0.02,
            "limit {l}: only {mean:.4} delivered (duty {duty:.3})"
        );
    }
}

/// The H100 benchmark's reload: two tenants of 16 ms bursts (90 kernels of 180 µs) with 3 ms of
/// CPU between them swap 0.3 / 0.7. The one shrunk to 0.3 started a fresh account: it spent its
/// whole pacing allowance of the next second in the pauses of its neighbour (0.29 s in 0.6 s),
/// ran far ahead of it in virtual time and then waited 423 ms at zero. Its account now carries
/// the last pacing window at the new limit, so its allowance grows at that rate.
#[test]
fn a_tenant_shrunk_by_a_reload_beside_a_bursty_neighbour_never_waits_long() {
    let bursts = Pattern {
        kernel_us: 180,
        kernels: 90,
        gap_us: 3 * MS,
        idle: vec![],
        blind: false,
        launch_us: 10,
    };
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("a", 300, 300), bursts.clone()),
            (spec("b", 700, 700), bursts),
        ],
    );
    sim.reconfigs
        .push(vec![spec("a", 700, 700), spec("b", 300, 300)]);
    sim.push(8 * S, Ev::Reconfig(0));
    sim.run(20 * S);
    let (before, after) = (
        longest_gap(&sim, 1, 3 * S, 8 * S),
        longest_gap(&sim, 1, 8 * S, 10 * S),
    );
    let (a, b) = (sim.share(0, 12 * S, 20 * S), sim.share(1, 12 * S, 20 * S));
    eprintln!(
        "b waited at most {} ms before the reload, {} ms in the 2 s after it; shares after {a:.3} / {b:.3}",
        before / MS,
        after / MS
    );
    assert!(
        after <= 200 * MS,
        "b waited {} ms after the reload",
        after / MS
    );
    assert!(
        b <= 0.3 + 0.01 && a >= 0.6,
        "shares after the reload {a:.3} / {b:.3}"
    );
}

// ---- Co-running (core/corun.rs) ----

/// A batch-1 inference-like tenant: one 300 µs kernel per request, then 700 µs of CPU.
fn launch_bound() -> Pattern {
    Pattern {
        kernel_us: 300,
        kernels: 1,
        gap_us: 700,
        ..Pattern::tiny()
    }
}

/// A GPU-bound tenant launching kernel by kernel with its queue kept about a kernel deep (as
/// the hook's queue-ahead bound keeps it): the GPU's submission order then interleaves another
/// tenant's kernels with its own at kernel boundaries, as the H100 time-slices two contexts.
fn kernel_by_kernel() -> Pattern {
    Pattern {
        launch_us: 1_600,
        ..Pattern::matmul()
    }
}

fn heavy_and_light(co_run: bool) -> Sim {
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("heavy", 500, 500), kernel_by_kernel()),
            (spec("light", 500, 500), launch_bound()),
        ],
    );
    sim.busy_reports = true;
    if co_run {
        sim.core.set_co_run(CoRunSettings {
            below: 0.6,
            ..CoRunSettings::default()
        });
    }
    sim.run(60 * S);
    sim
}

#[test]
fn co_running_charges_the_light_tenant_its_gpu_time_and_keeps_the_heavy_ones_share() {
    // A GPU-bound tenant and a launch-bound one (its kernels fill 0.3 of its time), both at
    // (0.5, 0.5). In turns each holds the token half the time, and the light one gets 0.5 ×
    // 0.3 of the GPU. Co-running, the light one launches beside the heavy one's turns and is
    // charged its GPU time (its fill × its co-holds); the heavy one's limit is raised by what
    // the light one's fill takes of its turns. The simulated GPU runs work in submission
    // order: with the heavy tenant's queue about a kernel deep the two interleave at kernel
    // boundaries, as the H100 time-slices two contexts, but with no cost to switching and
    // with the light kernels also filling the heavy one's own gaps, so the heavy tenant loses
    // less than the light one's fill and its raised limit gives it more than its half here
    // (on the H100 ResNet-50 training lost more than the co-runner's fill: round 15).
    let turns = heavy_and_light(false);
    let co = heavy_and_light(true);
    let (a, b) = (10 * S, 60 * S);
    let (ht, lt) = (turns.share(0, a, b), turns.share(1, a, b));
    let (hc, lc) = (co.share(0, a, b), co.share(1, a, b));
    let raised = f64::from(co.core.limit_in_force("heavy").unwrap()) / 1000.0;
    let charged = co.core.usage_us(60 * S, "light").unwrap() as f64 / 10e6;
    let light_last_10s = co.share(1, 50 * S, 60 * S);
    eprintln!(
        "turns: heavy {ht:.3} light {lt:.3}; co-running: heavy {hc:.3} (limit in force {raised:.3}) light {lc:.3} (charged {charged:.3} of the last 10 s, used {light_last_10s:.3})"
    );
    assert!(
        (lt - 0.5 * launch_bound().duty()).abs() < 0.02,
        "light in turns {lt:.3}"
    );
    // The light tenant: more GPU time than in turns, within its limit, charged what it used.
    assert!(lc > lt + 0.03, "light co-running {lc:.3}, in turns {lt:.3}");
    assert!(lc <= 0.5, "light co-running {lc:.3} past its limit");
    assert!(
        (charged - light_last_10s).abs() <= 0.01,
        "light charged {charged:.3} for {light_last_10s:.3}"
    );
    // The heavy tenant: at least its half of the GPU, at most its raised limit; the GPU busier.
    assert!(
        raised > 0.5,
        "the heavy tenant's limit was not raised beside the co-runner"
    );
    assert!(
        hc >= 0.48 && hc <= raised,
        "heavy co-running got {hc:.3}, limit in force {raised:.3}"
    );
    assert!(
        hc + lc > ht + lt + 0.03,
        "co-running did not keep the GPU busier"
    );
    // The usage report (the node daemon's metrics) tells the co-runner apart: its fill, and
    // its usage charged for co-holds; the heavy tenant ran none.
    let r = gem_schd::usage::report(&co.core, 60 * S);
    let (heavy, light) = (r.client("heavy").unwrap(), r.client("light").unwrap());
    eprintln!("usage report: {heavy:?} {light:?}");
    // (Below its duty alone: beside the heavy tenant its kernels wait in the GPU's queue.)
    let fill = light.fill().unwrap_or(f64::NAN);
    assert!(
        fill > 0.05 && fill < launch_bound().duty(),
        "the light tenant's reported fill {fill:.3}"
    );
    assert!(
        light.co_used_us > 0 && light.co_used_us <= light.used_us,
        "light: {} µs of {} charged for co-holds",
        light.co_used_us,
        light.used_us
    );
    assert!(
        (light.co_share(r.window_us) - charged).abs() <= 0.05,
        "light's co-hold share {:.3}, charged {charged:.3}",
        light.co_share(r.window_us)
    );
    assert_eq!(heavy.co_used_us, 0, "the heavy tenant never co-ran");
    // Its token time may pass its declared limit (its limit is raised beside the co-runner);
    // what the report delivers is GPU time, credited what the co-runner took of its turns.
    let token = (co.core.usage_us(60 * S, "heavy").unwrap()
        + co.core.co_credit_us(60 * S, "heavy").unwrap()) as f64
        / r.window_us as f64;
    let delivered = heavy.share(r.window_us);
    eprintln!("heavy: token time {token:.3}, delivered {delivered:.3}");
    assert!(
        delivered <= 0.5 + 0.01 && delivered < token,
        "heavy delivered {delivered:.3} (token time {token:.3}) at a 0.5 limit"
    );
    assert!(heavy.fill().is_some_and(|f| f > 0.6), "heavy: {heavy:?}");
    assert_within_limits(&turns);
}
