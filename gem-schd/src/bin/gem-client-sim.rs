//! `gem-client-sim`: a client of gem-schd that behaves like the hook, for tests and
//! demos without a GPU. `work` simulates kernel bursts by sleeping while it holds the
//! token (asks for it, runs bursts while the quota lasts, reports overuse and its
//! burst, releases when done); `alloc` reserves memory and then waits to be killed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use gem_proto::{Client, ClientError};

#[derive(Debug, Parser)]
#[command(name = "gem-client-sim", version)]
struct Args {
    /// The client's socket (`<dir>/<client>/<gpu>.sock` with gem-share).
    #[arg(long)]
    socket: PathBuf,
    /// GPU UUID to name in Hello.
    #[arg(long)]
    gpu: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run simulated bursts for a while; print `busy_us=.. grants=.. reconnects=..`.
    Work {
        /// Length of one burst (a sleep standing for GPU work), µs.
        #[arg(long, default_value_t = 2000)]
        burst_us: u64,
        /// CPU time between bursts, µs.
        #[arg(long, default_value_t = 0)]
        gap_us: u64,
        /// How long to run, ms.
        #[arg(long, default_value_t = 3000)]
        duration_ms: u64,
        /// Reconnect (for up to this long, ms) when gem-schd goes away.
        #[arg(long, default_value_t = 0)]
        reconnect_ms: u64,
    },
    /// Reserve BYTES of GPU memory, print `allocated used=.. limit=..`, then sleep.
    Alloc {
        #[arg(long)]
        bytes: u64,
    },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let pid = std::process::id();
    match args.cmd {
        Cmd::Alloc { bytes } => {
            let mut c = Client::connect(&args.socket, pid, &args.gpu)?;
            let v = c.mem_alloc(bytes)?;
            if !v.granted {
                bail!("refused: used {} limit {}", v.used, v.limit);
            }
            println!("allocated used={} limit={}", v.used, v.limit);
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Cmd::Work {
            burst_us,
            gap_us,
            duration_ms,
            reconnect_ms,
        } => {
            let connect = || {
                Client::connect_with_retry(
                    &args.socket,
                    pid,
                    &args.gpu,
                    Duration::from_millis(reconnect_ms),
                    Duration::from_millis(20),
                )
                .context("connecting to gem-schd")
            };
            let mut c = connect()?;
            let end = Instant::now() + Duration::from_millis(duration_ms);
            let burst = Duration::from_micros(burst_us);
            let (mut busy, mut grants, mut reconnects, mut overuse) = (0u64, 0u64, 0u64, 0u64);
            while Instant::now() < end {
                let quota = match c.request_token(overuse, burst_us) {
                    Ok(q) => q,
                    Err(e) if e.is_disconnect() && reconnect_ms > 0 => {
                        c = connect()?;
                        reconnects += 1;
                        continue;
                    }
                    Err(e) => return Err(report(e)),
                };
                grants += 1;
                let granted = Instant::now();
                let deadline = granted + Duration::from_micros(quota);
                // Bursts never split: launch one if it is predicted to fit (the first
                // always goes), like the hook's gate.
                loop {
                    let t = Instant::now();
                    std::thread::sleep(burst);
                    busy += t.elapsed().as_micros() as u64;
                    if gap_us > 0 {
                        std::thread::sleep(Duration::from_micros(gap_us));
                    }
                    let now = Instant::now();
                    if now >= end || now + burst > deadline {
                        break;
                    }
                }
                let now = Instant::now();
                overuse = now.saturating_duration_since(deadline).as_micros() as u64;
                if now >= end {
                    let _ = c.release(now.duration_since(granted).as_micros() as u64);
                }
            }
            println!("busy_us={busy} grants={grants} reconnects={reconnects}");
            Ok(())
        }
    }
}

fn report(e: ClientError) -> anyhow::Error {
    anyhow::Error::new(e).context("gem-schd")
}
