//! Classes in the simulation: a guaranteed client keeps its request beside opportunistic
//! clients (`sharedgpu/priority` 0), whatever they request; the opportunistic clients share what
//! it leaves by their requests, as guaranteed clients share a GPU, and get the whole GPU while
//! it is idle. Hook-like clients (a coarse clock, renewals, the idle thread's release at the
//! deadline) under gem-schd's daemon defaults, as in `sim_mix.rs`.

mod harness;
use harness::*;

/// The clients start when gem-schd has been up for a while (as on a node).
const ARRIVE: Micros = 12 * S;

/// A training loop through the gate, GPU-bound (the CPU queues ahead of the GPU): its holds
/// end with a drain of the work queued before the deadline.
fn training() -> Pattern {
    Pattern {
        kernel_us: 250,
        kernels: 120,
        gap_us: 400,
        idle: vec![],
        blind: true,
        launch_us: 60,
    }
}

/// `g` guaranteed beside opportunistic `o` and `p`, each with its pattern, from `ARRIVE` for
/// `seconds`.
fn trio(clients: [(ClientSpec, Pattern); 3], seconds: Micros) -> Sim {
    let mut sim = Sim::new(
        Params::default(),
        clients
            .into_iter()
            .map(|(s, p)| (s, p.idle_during(0, ARRIVE)))
            .collect(),
    );
    sim.core.set_max_hold(0);
    sim.tick = 4 * MS;
    sim.renew = true;
    sim.release_idle = 10 * MS;
    sim.release_at_deadline = Some(2 * MS);
    sim.run(ARRIVE + seconds);
    sim
}

/// The three clients' GPU time over `[a, b)`.
fn shares(sim: &Sim, a: Micros, b: Micros) -> [f64; 3] {
    let s = [sim.share(0, a, b), sim.share(1, a, b), sim.share(2, a, b)];
    eprintln!(
        "g {:.3}, o {:.3}, p {:.3}: busy {:.3}",
        s[0],
        s[1],
        s[2],
        s.iter().sum::<f64>()
    );
    s
}

/// Requests of `o` and `p` that add up to the half `g` leaves, more, or less.
const REQUESTS: [(u16, u16); 5] = [(300, 200), (500, 500), (200, 600), (300, 100), (100, 100)];

#[test]
fn a_guaranteed_client_keeps_its_request_beside_opportunistic_ones() {
    for (g, o, p) in [
        (training(), Pattern::matmul(), Pattern::medium()),
        (Pattern::medium(), training(), Pattern::long()),
    ] {
        for (ro, rp) in REQUESTS {
            eprint!("o {ro}, p {rp}: ");
            let sim = trio(
                [
                    (spec("g", 500, 500), g.clone()),
                    (opportunistic("o", ro, 1000), o.clone()),
                    (opportunistic("p", rp, 1000), p.clone()),
                ],
                30 * S,
            );
            let [g_got, o_got, p_got] = shares(&sim, ARRIVE + 2 * S, ARRIVE + 30 * S);
            assert!(g_got >= 0.48, "g got {g_got:.3} beside o {ro}, p {rp}");
            // The rest is used: the opportunistic clients take what g leaves.
            assert!(g_got + o_got + p_got >= 0.97);
            // Where their requests cover what is left, they share it in proportion to them
            // (below their requests both rank by virtual time); past them, the spare time goes
            // by usage, as between guaranteed clients.
            if ro + rp >= 500 {
                let want = (o_got + p_got) * f64::from(ro) / f64::from(ro + rp);
                assert!(
                    (o_got - want).abs() <= 0.02,
                    "o got {o_got:.3}, its share of the rest is {want:.3}"
                );
            }
        }
    }
}

#[test]
fn a_launch_bound_guaranteed_client_keeps_its_request_beside_opportunistic_ones() {
    // Its holds mostly end with the idle thread's Release, and its next request comes a moment
    // later: the opportunistic clients must not take its place meanwhile. Charged its request in
    // gem-schd's books (the mean over the last 18 s, sampled every 0.5 s), it gets in GPU time
    // what it gets alone at its limit.
    let g = || (spec("g", 500, 500), training_launch_bound());
    let run = |o: Pattern, p: Pattern| {
        let mut sim = trio(
            [
                g(),
                (opportunistic("o", 300, 1000), o),
                (opportunistic("p", 200, 1000), p),
            ],
            12 * S,
        );
        let mut charged = vec![];
        for k in 0..=36 {
            let t = ARRIVE + 12 * S + k * 500 * MS;
            sim.run(t);
            charged.push(sim.charged(t, "g"));
        }
        let mean = charged.iter().sum::<f64>() / charged.len() as f64;
        eprint!(
            "charged {mean:.3} (lowest {:.3}); ",
            charged.iter().fold(1.0, |a: f64, b| a.min(*b))
        );
        (mean, shares(&sim, ARRIVE + 2 * S, ARRIVE + 30 * S))
    };
    let (_, [alone, ..]) = run(Pattern::absent(), Pattern::absent());
    let (charged, [got, o, p]) = run(training(), Pattern::matmul());
    assert!(charged >= 0.48, "g charged {charged:.3}");
    assert!(
        got >= 0.95 * alone,
        "g got {got:.3} of the GPU's time, {alone:.3} alone"
    );
    assert!(o > p && p > 0.1, "o {o:.3}, p {p:.3}");
}

#[test]
fn while_the_guaranteed_client_is_idle_the_opportunistic_ones_get_everything() {
    // g works for 10 s, idles for 10 s, works again.
    let g = training().idle_during(ARRIVE + 10 * S, ARRIVE + 20 * S);
    let sim = trio(
        [
            (spec("g", 500, 500), g),
            (opportunistic("o", 300, 1000), Pattern::matmul()),
            (opportunistic("p", 200, 1000), Pattern::medium()),
        ],
        30 * S,
    );
    let [g1, ..] = shares(&sim, ARRIVE + 2 * S, ARRIVE + 10 * S);
    let [g_idle, o, p] = shares(&sim, ARRIVE + 10 * S + 200 * MS, ARRIVE + 20 * S);
    let [g3, ..] = shares(&sim, ARRIVE + 21 * S, ARRIVE + 30 * S);
    assert!(g1 >= 0.48 && g3 >= 0.48, "g got {g1:.3}, then {g3:.3}");
    assert_eq!(g_idle, 0.0);
    assert!(o + p >= 0.97, "o and p got {:.3} of an idle GPU", o + p);
}

#[test]
fn an_elastic_guaranteed_client_leaves_opportunistic_ones_only_what_it_does_not_use() {
    // g at (0.5, 1.0) always has work: beside guaranteed clients it would get its request and an
    // even part of the spare time; beside opportunistic ones it takes every turn.
    let sim = trio(
        [
            (spec("g", 500, 1000), training()),
            (opportunistic("o", 300, 1000), Pattern::matmul()),
            (opportunistic("p", 200, 1000), Pattern::medium()),
        ],
        20 * S,
    );
    let [g, o, p] = shares(&sim, ARRIVE + 2 * S, ARRIVE + 20 * S);
    assert!(g >= 0.97, "g got {g:.3}");
    assert!(o + p <= 0.01, "o and p got {:.3}", o + p);
}
