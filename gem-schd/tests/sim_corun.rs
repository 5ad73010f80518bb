//! Co-running in the virtual-clock simulation (`core/corun.rs`; the harness: `harness/mod.rs`):
//! a light tenant launching beside a GPU-bound holder, charged its GPU time.

mod harness;
use gem_schd::core::CoRunSettings;
use harness::*;

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

/// `heavy` (GPU-bound, kernel by kernel) and `light` (launch-bound) at a request of 0.5 and the
/// given limits, for 60 s, co-running below a fill of 0.6 if `co_run`.
fn heavy_and_light(heavy_limit: u16, light_limit: u16, co_run: bool) -> Sim {
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("heavy", 500, heavy_limit), kernel_by_kernel()),
            (spec("light", 500, light_limit), launch_bound()),
        ],
    );
    sim.busy_reports = true;
    if co_run {
        sim.core.set_co_run(co_run_below_0_6());
    }
    sim.run(60 * S);
    sim
}

fn co_run_below_0_6() -> CoRunSettings {
    CoRunSettings {
        below: 0.6,
        ..CoRunSettings::default()
    }
}

#[test]
fn co_running_charges_an_uncapped_light_tenant_its_gpu_time_and_a_capped_holder_its_turns() {
    // A GPU-bound tenant capped at (0.5, 0.5) and a launch-bound one (its kernels fill 0.3 of
    // its time) at (0.5, 1.0). In turns each holds the token half the time, and the light one
    // gets 0.5 × 0.3 of the GPU. Co-running, the light one launches beside the heavy one's
    // turns and, uncapped, is charged its GPU time (its fill × its co-holds). The heavy one,
    // capped, is charged in wall time: no co-hold is granted while it holds a turn (one
    // opened at the end of its turn runs on into the next), and its turns count whole, so its
    // GPU time, which its turns bound, stays within its limit whatever the fills read. The
    // simulated GPU runs work in submission order: with the heavy tenant's queue about a kernel
    // deep the two interleave at kernel boundaries, as the H100 time-slices two contexts, and
    // the light kernels that run into its turns cost it GPU time it is charged for.
    let turns = heavy_and_light(500, 1000, false);
    let co = heavy_and_light(500, 1000, true);
    let (a, b) = (10 * S, 60 * S);
    let (ht, lt) = (turns.share(0, a, b), turns.share(1, a, b));
    let (hc, lc) = (co.share(0, a, b), co.share(1, a, b));
    let (heavy_charged, light_charged) = (co.charged(60 * S, "heavy"), co.charged(60 * S, "light"));
    let (heavy_last_10s, light_last_10s) =
        (co.share(0, 50 * S, 60 * S), co.share(1, 50 * S, 60 * S));
    let heavy_worst = co.max_window_share(0, S, 60 * S);
    eprintln!(
        "turns: heavy {ht:.3} light {lt:.3}; co-running: heavy {hc:.3} (charged {heavy_charged:.3} of the last 10 s, used {heavy_last_10s:.3}, at most {heavy_worst:.3} of a second) light {lc:.3} (charged {light_charged:.3} of the last 10 s, used {light_last_10s:.3})"
    );
    assert!(
        (lt - 0.5 * launch_bound().duty()).abs() < 0.02,
        "light in turns {lt:.3}"
    );
    // The light tenant: more GPU time than in turns, charged what it used.
    assert!(lc > lt + 0.03, "light co-running {lc:.3}, in turns {lt:.3}");
    assert!(
        (light_charged - light_last_10s).abs() <= 0.01,
        "light charged {light_charged:.3} for {light_last_10s:.3}"
    );
    // The heavy tenant: charged at least what it used, within its limit in every second; its
    // limit is not raised beside the co-runner, nor its turns credited.
    assert!(
        heavy_charged >= heavy_last_10s,
        "heavy charged {heavy_charged:.3} for {heavy_last_10s:.3}"
    );
    assert!(
        heavy_worst <= 0.5 + 0.01,
        "heavy used {heavy_worst:.3} of a second"
    );
    assert_eq!(co.core.limit_in_force("heavy"), Some(500));
    assert_eq!(co.core.co_credit_us(60 * S, "heavy"), Some(0));
    assert!(hc + lc > ht + lt, "co-running did not keep the GPU busier");
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
        (light.co_share(r.window_us) - light_charged).abs() <= 0.05,
        "light's co-hold share {:.3}, charged {light_charged:.3}",
        light.co_share(r.window_us)
    );
    assert_eq!(heavy.co_used_us, 0, "the heavy tenant never co-ran");
    assert!(heavy.fill().is_some_and(|f| f > 0.6), "heavy: {heavy:?}");
    assert_within_limits(&turns);
    assert_within_limits(&co);
}

#[test]
fn an_uncapped_holders_turns_are_credited_what_the_co_runner_took() {
    // Both at (0.5, 1.0): neither has a limit to break, and the heavy one's turns are charged
    // in GPU time, less what the co-runner's fill took of them (which ranks it, nothing more).
    let co = heavy_and_light(1000, 1000, true);
    let r = gem_schd::usage::report(&co.core, 60 * S);
    let heavy = r.client("heavy").unwrap();
    let token = (co.core.usage_us(60 * S, "heavy").unwrap()
        + co.core.co_credit_us(60 * S, "heavy").unwrap()) as f64
        / r.window_us as f64;
    let delivered = heavy.share(r.window_us);
    eprintln!(
        "heavy: token time {token:.3}, delivered {delivered:.3}; light {:.3}",
        co.share(1, 50 * S, 60 * S)
    );
    assert!(
        delivered < token - 0.01,
        "heavy delivered {delivered:.3} for token time {token:.3}"
    );
    assert!(co.core.limit_in_force("heavy") == Some(1000));
}

#[test]
fn a_capped_light_tenant_co_running_is_charged_its_wall_time() {
    // The other way round: the GPU-bound tenant uncapped (0.5, 1.0), the light one capped
    // (0.5, 0.5). Co-running, the light one is charged the wall time of its co-holds, beside a
    // holder that keeps the GPU busy: it reaches its limit with less GPU time than its turns
    // gave it. What it gains is that it never waits for a turn.
    let turns = heavy_and_light(1000, 500, false);
    let co = heavy_and_light(1000, 500, true);
    let (a, b) = (10 * S, 60 * S);
    let (lt, lc) = (turns.share(1, a, b), co.share(1, a, b));
    let charged = co.charged(60 * S, "light");
    let worst = co.max_window_share(1, S, 60 * S);
    eprintln!(
        "light: in turns {lt:.3}, co-running {lc:.3} (charged {charged:.3} of the last 10 s, at most {worst:.3} of a second); heavy {:.3} / {:.3}",
        turns.share(0, a, b),
        co.share(0, a, b)
    );
    assert!(
        co.core.co_usage_us(60 * S, "light").unwrap() > 0,
        "light never co-ran"
    );
    assert!(
        charged > 0.45 && charged >= co.share(1, 50 * S, 60 * S),
        "light charged {charged:.3}"
    );
    assert!(worst <= 0.5 + 0.01, "light used {worst:.3} of a second");
    assert_within_limits(&co);
}

/// (a capped launch-bound tenant at 0.5 beside a light elastic one; two capped launch-bound
/// tenants at 0.3), each with the hook's Busy reports saying half their GPU time.
fn under_read_mixes() -> [(&'static str, Vec<(ClientSpec, Pattern)>); 2] {
    [
        (
            "capped training (0.5, 0.5) beside light decode (0.5, 1.0)",
            vec![
                (spec("training", 500, 500), training_launch_bound()),
                (spec("decode", 500, 1000), launch_bound()),
            ],
        ),
        (
            "two capped training loops (0.3, 0.3)",
            vec![
                (spec("a", 300, 300), training_launch_bound()),
                (spec("b", 300, 300), training_launch_bound()),
            ],
        ),
    ]
}

#[test]
fn capped_tenants_keep_their_limits_when_the_fills_under_read() {
    // The hook samples a tenant's fill (one launch in ~256 timed with an event pair), and
    // beside another context its samples read the other context's time slices too: on an
    // H200 a GPT training loop capped at 0.5 beside co-running decode was charged 0.078 of the
    // GPU for 0.404 of GPU time. Here each hook reports half its GPU time: a launch-bound
    // training loop (busy 0.6 alone) reads 0.3 and co-runs. Charged by its fill it co-ran
    // without end, and passed its limit in GPU time (`cargo test -p gem-schd --release --test
    // sim_corun -- --nocapture`, before capped clients were charged in wall time): training
    // 0.604 of the GPU at a 0.5 limit (0.605 in its busiest second, charged 0.303), each of
    // the two loops 0.472 at 0.3 (0.474 and 0.477, charged 0.236). Charged in wall time, each
    // stays within its limit in every second.
    for (name, clients) in under_read_mixes() {
        for co_run in [false, true] {
            let mut sim = Sim::new(Params::default(), clients.clone());
            sim.busy_reports = true;
            sim.busy_scale = 0.5;
            if co_run {
                sim.core.set_co_run(co_run_below_0_6());
            }
            sim.run(60 * S);
            for (i, c) in sim.clients.iter().enumerate() {
                let id = &c.spec.id;
                let limit = f64::from(c.spec.limit_milli) / 1000.0;
                let used = sim.share(i, 10 * S, 60 * S);
                let worst = sim.max_window_share(i, S, 60 * S);
                let charged = sim.charged(60 * S, id);
                eprintln!(
                    "{name}, co-running {co_run}: {id} used {used:.3} of the GPU (at most {worst:.3} of a second, limit {limit}), charged {charged:.3} of the last 10 s"
                );
                if limit < 1.0 {
                    assert!(
                        worst <= limit + 0.01,
                        "{name}: {id} used {worst:.3} of a second at a {limit} limit"
                    );
                }
            }
        }
    }
}

/// A pattern of `kernels` kernels of `kernel_us` µs, then `gap_us` µs of CPU.
fn bursts((kernel_us, kernels, gap_us): (Micros, u32, Micros)) -> Pattern {
    Pattern {
        kernel_us,
        kernels,
        gap_us,
        ..Pattern::tiny()
    }
}

/// `clients` (id, request, limit, pattern) for 60 s, with Busy reports, co-running below a
/// fill of 0.8 if `co_run`.
fn mix(clients: &[(&str, u16, u16, Pattern)], co_run: bool) -> Sim {
    let clients = clients
        .iter()
        .map(|(id, request, limit, pattern)| (spec(id, *request, *limit), pattern.clone()))
        .collect();
    let mut sim = Sim::new(Params::default(), clients);
    sim.busy_reports = true;
    if co_run {
        sim.core.set_co_run(CoRunSettings {
            below: 0.8,
            ..CoRunSettings::default()
        });
    }
    sim.run(60 * S);
    sim
}

/// The GPU time of every client of `sim` over the last 50 s, and the GPU's busy time.
fn shares(sim: &Sim) -> (Vec<f64>, f64) {
    let used: Vec<f64> = (0..sim.clients.len())
        .map(|i| sim.share(i, 10 * S, 60 * S))
        .collect();
    let busy = used.iter().sum();
    (used, busy)
}

#[test]
fn capped_tenants_alone_take_turns_whatever_their_fills() {
    // Four capped tenants at 0.1–0.4 whose kernels fill about two thirds of their time read
    // light below 0.8, as the GPU benchmark's four training loops did on H200s. Co-running,
    // each was charged the wall time of co-holds that overlapped the others' (and capped
    // turns) while the GPU time-sliced them, so their limits covered less of the clock: the
    // GPU busy 0.583 against 0.731 in turns (two light and two heavy: 0.717 against 0.811;
    // `core/capped.rs`). With no uncapped client to co-run beside they take turns.
    let mixes = [
        (
            "two light, two heavy",
            [
                (500, 4, 1_000),
                (1_700, 4, 250),
                (60, 20, 600),
                (1_000, 8, 1_000),
            ],
        ),
        (
            "all four light",
            [
                (500, 4, 1_000),
                (800, 4, 1_600),
                (60, 20, 600),
                (400, 10, 2_000),
            ],
        ),
    ];
    for (name, [conv, matmul, elem, encoder]) in mixes {
        let clients = [
            ("conv", 100, 100, bursts(conv)),
            ("matmul", 200, 200, bursts(matmul)),
            ("elem", 300, 300, bursts(elem)),
            ("encoder", 400, 400, bursts(encoder)),
        ];
        let [turns, co] = [false, true].map(|co_run| mix(&clients, co_run));
        let ((ut, bt), (uc, bc)) = (shares(&turns), shares(&co));
        eprintln!("{name}: in turns {ut:.3?} busy {bt:.3}; co-running {uc:.3?} busy {bc:.3}");
        let light = co
            .clients
            .iter()
            .filter(|c| co.core.judged_fill(&c.spec.id).is_some_and(|f| f < 0.8))
            .count();
        assert!(light >= 2, "{name}: {light} read light");
        for c in &co.clients {
            let id = &c.spec.id;
            assert_eq!(
                co.core.co_usage_us(60 * S, id),
                Some(0),
                "{name}: {id} co-held"
            );
        }
        assert_eq!(uc, ut, "{name}");
        assert_within_limits(&co);
    }
}

#[test]
fn capped_co_runners_beside_an_uncapped_tenant_keep_the_gpu_busier_than_turns() {
    // Two capped launch-bound tenants (their kernels fill two thirds of their time) co-run
    // beside an uncapped one whose kernels fill 0.9 of its turns. Each capped one is charged
    // the wall time of its co-holds and keeps out of the other's (`core/capped.rs`): conv
    // 0.098 of the GPU, elem 0.119, the GPU busy 0.953. Where their co-holds overlapped, each
    // was charged the whole overlap: 0.089, 0.109 and 0.947. Beside a busy neighbour a capped
    // co-runner gets less GPU time than its turns gave it (0.127, 0.208), and never waits for
    // a turn.
    let decode = Pattern {
        launch_us: 900,
        ..bursts((1_000, 4, 400))
    };
    let clients = [
        ("conv", 200, 200, bursts((500, 4, 1_000))),
        ("elem", 300, 300, bursts((60, 20, 600))),
        ("decode", 500, 1000, decode),
    ];
    let [turns, co] = [false, true].map(|co_run| mix(&clients, co_run));
    let ((ut, bt), (uc, bc)) = (shares(&turns), shares(&co));
    eprintln!("in turns {ut:.3?} busy {bt:.3}; co-running {uc:.3?} busy {bc:.3}");
    for c in co.clients.iter().take(2) {
        let id = &c.spec.id;
        let co_held = co.core.co_usage_us(60 * S, id).unwrap_or(0);
        assert!(co_held > 0, "{id} never co-held");
    }
    assert!(bc > bt + 0.1, "busy {bc:.3} co-running, {bt:.3} in turns");
    assert_within_limits(&turns);
    assert_within_limits(&co);
}
