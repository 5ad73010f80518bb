//! Pacing in the virtual-clock simulation (the harness and its clients: `harness/mod.rs`,
//! `sim.rs`): a capped client held to its limit over short windows too, the tables that chose
//! the pacing window and the quota, and latency-sensitive inference beside training.

mod harness;
use harness::*;

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
/// tenant at 0.5 alone on an H100 waited 480 ms every second.
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
/// `cargo test -p gem-schd --release --test sim_pacing pace_table -- --ignored --nocapture`.
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
/// `cargo test -p gem-schd --test sim_pacing -- --ignored --nocapture quota_table`.
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

// ---- latency-sensitive inference beside training ----

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
