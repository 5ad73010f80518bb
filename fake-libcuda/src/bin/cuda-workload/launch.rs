//! The `launch` workload: kernels of a given duration in batches, each followed by a
//! synchronisation, with the CPU paced as a framework's would be; prints the GPU busy time.

use crate::{Api, LaunchKind, check, emit};
use anyhow::Result;
use cuda_abi::*;
use serde_json::json;
use std::ffi::c_void;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What `launch` launches and how it paces its CPU (see its arguments).
#[derive(Default)]
pub(crate) struct Pace {
    pub(crate) kernel_us: u64,
    pub(crate) batch: u64,
    pub(crate) think_us: u64,
    pub(crate) launch_cpu_us: u64,
    pub(crate) pause_us: u64,
    pub(crate) pause_every: u64,
}

pub(crate) fn run_launch(
    api: &Api,
    dev: i32,
    seconds: Option<f64>,
    count: Option<u64>,
    pace: Pace,
    kind: LaunchKind,
    sample_ms: u64,
) -> Result<()> {
    let Pace {
        kernel_us,
        batch,
        think_us,
        launch_cpu_us,
        pause_us,
        pause_every,
    } = pace;
    let deadline = seconds.map(Duration::from_secs_f64);
    // SAFETY: `fakeCudaBusyMicros` takes a device ordinal by value and dereferences nothing.
    let busy = |d| api.busy.map(|f| unsafe { f(d) }).unwrap_or(0);
    let busy0 = busy(dev);
    let mut dur = kernel_us;
    let mut params = [&mut dur as *mut u64 as *mut c_void];
    let f = 0x1000 as CUfunction; // the fake needs no real module
    let cfg = CUlaunchConfig {
        grid_dim: [1, 1, 1],
        block_dim: [1, 1, 1],
        shared_mem_bytes: 0,
        h_stream: std::ptr::null_mut(),
        attrs: std::ptr::null_mut(),
        num_attrs: 0,
    };
    let t0 = Instant::now();
    let mut first_launch_us = None;
    // The same moment on the wall clock, for a test to order it against its own events.
    let mut first_launch_unix_us = None;
    let mut kernels = 0u64;
    let mut samples = vec![];
    let mut next_sample = Duration::ZERO;
    loop {
        if deadline.is_some_and(|d| t0.elapsed() >= d) || count.is_some_and(|c| kernels >= c) {
            break;
        }
        let n = count.map_or(batch, |c| batch.min(c - kernels));
        for _ in 0..n {
            let spin = Instant::now();
            while spin.elapsed() < Duration::from_micros(launch_cpu_us) {
                std::hint::spin_loop();
            }
            // SAFETY: the fake's calling convention; `params` outlives the call.
            let r = unsafe {
                let p = params.as_mut_ptr();
                let (s, x) = (std::ptr::null_mut(), std::ptr::null_mut());
                match kind {
                    LaunchKind::Launch => (api.launch)(f, 1, 1, 1, 1, 1, 1, 0, s, p, x),
                    LaunchKind::Coop => (api.coop)(f, 1, 1, 1, 1, 1, 1, 0, s, p),
                    LaunchKind::Ex => (api.launch_ex)(&cfg, f, p, x),
                    LaunchKind::Graph => (api.graph)(kernel_us as usize as CUgraphExec, s),
                }
            };
            check(r, "launch")?;
            if first_launch_us.is_none() {
                first_launch_us = Some(t0.elapsed().as_micros() as u64);
                first_launch_unix_us = unix_us();
            }
            kernels += 1;
            if pause_us > 0 && pause_every > 0 && kernels.is_multiple_of(pause_every) {
                std::thread::sleep(Duration::from_micros(pause_us));
            }
        }
        // SAFETY: plain driver call.
        check(unsafe { (api.sync)() }, "cuCtxSynchronize")?;
        if think_us > 0 {
            std::thread::sleep(Duration::from_micros(think_us));
        }
        if t0.elapsed() >= next_sample {
            samples.push(json!([t0.elapsed().as_millis() as u64, busy(dev) - busy0]));
            next_sample += Duration::from_millis(sample_ms);
        }
    }
    let wall = t0.elapsed().as_micros() as u64;
    samples.push(json!([wall / 1000, busy(dev) - busy0]));
    emit(json!({
        "kernels": kernels,
        "kernel_us": kernel_us,
        "wall_us": wall,
        "busy_us": busy(dev) - busy0,
        "first_launch_us": first_launch_us,
        "first_launch_unix_us": first_launch_unix_us,
        "samples": samples,
    }));
    Ok(())
}

/// Microseconds since the Unix epoch (None if the clock is before it).
fn unix_us() -> Option<u64> {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_micros() as u64)
}
