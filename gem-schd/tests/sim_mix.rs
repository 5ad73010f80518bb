//! Shares for mixes of tenants whose limits differ: a tenant capped at its request beside
//! an elastic one with the same request must still get its request in GPU time (the GPU
//! model's busy segments, not gem-schd's charge).

mod harness;
use harness::*;

/// `training_launch_bound` with a larger batch: GPU-bound (the CPU queues ahead of the GPU).
fn training_gpu_bound() -> Pattern {
    Pattern {
        kernel_us: 250,
        kernels: 120,
        gap_us: 400,
        idle: vec![],
        blind: true,
        launch_us: 60,
    }
}

/// Batch-1 decode: one CUDA-graph replay per token (a single launch), then the CPU reads
/// the token back and launches the next replay.
fn decode() -> Pattern {
    Pattern {
        kernel_us: 120,
        kernels: 1,
        gap_us: 60,
        idle: vec![],
        blind: true,
        launch_us: 0,
    }
}

/// The tenants start when gem-schd has been up for a while (as on a node, where it runs before
/// the pods do): their quota estimates start from the base quota, not from grants cut by a young
/// window's headroom.
const ARRIVE: Micros = 12 * S;

/// Runs the pair with gem-schd's daemon defaults and returns (training, decode) GPU time
/// over [5 s, 35 s) and gem-schd's charge at the end.
fn pair(
    train: Pattern,
    train_spec: ClientSpec,
    decode_spec: ClientSpec,
) -> ((f64, f64), (f64, f64)) {
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (train_spec, train.idle_during(0, ARRIVE)),
            (decode_spec, decode().idle_during(0, ARRIVE - 500 * MS)),
        ],
    );
    sim.core.set_max_hold(0);
    sim.tick = 4 * MS;
    sim.renew = true;
    sim.release_idle = 10 * MS;
    sim.release_at_deadline = Some(2 * MS);
    let horizon = ARRIVE + 30 * S;
    sim.run(horizon);
    let (a, b) = (ARRIVE + 2 * S, horizon);
    let gpu = (sim.share(0, a, b), sim.share(1, a, b));
    let charged = (
        sim.charged(horizon, "train"),
        sim.charged(horizon, "decode"),
    );
    let (t0, t1) = (turns(&sim, 0, a), turns(&sim, 1, a));
    eprintln!(
        "turns p50/p99 ms: training {:.1}/{:.1}, decode {:.1}/{:.1}",
        pct(&t0, 0.5) as f64 / 1e3,
        pct(&t0, 0.99) as f64 / 1e3,
        pct(&t1, 0.5) as f64 / 1e3,
        pct(&t1, 0.99) as f64 / 1e3
    );
    eprintln!(
        "GPU time: training {:.3}, decode {:.3} (busy {:.3}); charged {:.3} / {:.3}",
        gpu.0,
        gpu.1,
        gpu.0 + gpu.1,
        charged.0,
        charged.1
    );
    (gpu, charged)
}

/// The pair as measured on an H200: both holds end mostly with a Release from the hook's idle
/// thread, and the elastic client's quota estimate is 4x the capped one's turns. gem-schd's own
/// books must give each its request (the GPU time follows what each can use of its turns).
#[test]
fn capped_training_beside_elastic_decode_gets_its_request() {
    let (_, (train, decode)) = pair(
        training_launch_bound(),
        spec("train", 500, 500),
        spec("decode", 500, 1000),
    );
    assert!(train >= 0.48, "training charged {train:.3}");
    assert!(decode >= 0.48, "decode charged {decode:.3}");
}

/// A training loop that can use its whole share gets it in GPU time beside the decode loop.
#[test]
fn gpu_bound_training_beside_elastic_decode_gets_its_request_in_gpu_time() {
    let ((train, _), (charged, _)) = pair(
        training_gpu_bound(),
        spec("train", 500, 500),
        spec("decode", 500, 1000),
    );
    assert!(train >= 0.48, "training got {train:.3} of the GPU's time");
    assert!(charged >= 0.48, "training charged {charged:.3}");
}

/// Two elastic clients (0.3 and 0.7, limit 1.0) whose bursts (10 × 3 ms kernels queued at
/// once, then a sync) outlast any turn: each keeps its request whoever is ahead.
#[test]
fn elastic_clients_with_long_bursts_keep_their_requests() {
    let bursts = Pattern {
        kernel_us: 3_000,
        kernels: 10,
        gap_us: 100,
        idle: vec![],
        blind: true,
        launch_us: 0,
    };
    let mut sim = Sim::new(
        Params::default(),
        vec![
            (spec("e", 300, 1000), bursts.clone().idle_during(0, ARRIVE)),
            (spec("f", 700, 1000), bursts.idle_during(0, ARRIVE)),
        ],
    );
    sim.core.set_max_hold(0);
    sim.tick = 4 * MS;
    sim.release_idle = 10 * MS;
    sim.release_at_deadline = Some(2 * MS);
    let horizon = ARRIVE + 20 * S;
    sim.run(horizon);
    let (a, b) = (ARRIVE + 2 * S, horizon);
    let (e, f) = (sim.share(0, a, b), sim.share(1, a, b));
    eprintln!("e {e:.3}, f {f:.3}");
    let share_e = e / (e + f);
    assert!(
        (share_e - 0.3).abs() <= 0.02,
        "e got {share_e:.3} of the GPU time"
    );
}
