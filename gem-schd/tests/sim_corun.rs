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
    // (on the H100 ResNet-50 training lost more than the co-runner's fill).
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
