//! `gem-bench`: latency of the token over real sockets against a real gem-schd.
//! Round trip = TokenRequest sent → Grant received, with the token free. Handoff gap =
//! one holder's Release sent → the next (waiting) holder's Grant received: the time
//! the GPU sits without a holder. Renewal = Renew sent → Grant received by a lone holder
//! (gem-schd decides it on a copy of its state, so its cost grows with the grants in the
//! window). Prints p50/p90/p99 in µs.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use gem_proto::Client;

/// A client thread's log: (ns since epoch, true = grant received / false = release sent).
type Holder = std::thread::JoinHandle<Result<Vec<(u64, bool)>>>;

const GPU: &str = "GPU-bench000-0000-0000-0000-000000000000";

#[derive(Debug, Parser)]
#[command(name = "gem-bench", version)]
struct Args {
    /// Iterations of each measurement.
    #[arg(long, default_value_t = 20_000)]
    iterations: usize,
    /// How long each holder keeps the token in the handoff test (busy wait), µs.
    #[arg(long, default_value_t = 50)]
    hold_us: u64,
    /// The gem-schd binary (default: next to gem-bench).
    #[arg(long)]
    schd: Option<PathBuf>,
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let schd = match args.schd {
        Some(s) => s,
        None => std::env::current_exe()?
            .parent()
            .context("no exe dir")?
            .join("gem-schd"),
    };
    let dir = std::env::temp_dir().join(format!("gem-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let cfg = dir.join("resource-config.txt");
    std::fs::write(&cfg, "3\nsolo 0.5 1.0 0\na 0.5 1.0 0\nb 0.5 1.0 0\n")?;
    let tmpl = kubeshare_api::layout::socket_template_in(&dir);
    let _schd = Kill(
        Command::new(&schd)
            .args(["--gpu", GPU, "--config"])
            .arg(&cfg)
            .args(["--socket-template", &tmpl])
            .env("RUST_LOG", "warn")
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", schd.display()))?,
    );
    let sock = |c: &str| {
        dir.join(c)
            .join(kubeshare_api::layout::gpu_socket_name(GPU))
    };
    let connect = |c: &str| {
        Client::connect_with_retry(
            sock(c),
            1,
            GPU,
            Duration::from_secs(10),
            Duration::from_millis(10),
        )
    };

    // Renewals of a lone holder, first (the window holds only their own grants): each is
    // decided on a copy of gem-schd's state, up to a bound on the grants in the window
    // (beyond it the answer is Yield without a try, and the holder asks again).
    let mut solo = connect("solo")?;
    solo.request_token(0, 0)?;
    let (mut ren, mut yielded) = (Vec::with_capacity(args.iterations), Vec::new());
    for _ in 0..args.iterations {
        let t = Instant::now();
        match solo.renew(1)? {
            Some(_) => ren.push(t.elapsed()),
            None => {
                yielded.push(t.elapsed());
                solo.request_token(0, 1)?;
            }
        }
    }
    solo.release(1)?;
    drop(solo);
    report("renewal granted (renew -> grant, nobody waiting)", &mut ren);
    if !yielded.is_empty() {
        report(
            "renewal yielded (too many grants in the window)",
            &mut yielded,
        );
    }

    // Round trip with a free token.
    let mut solo = connect("solo")?;
    let mut rtt = Vec::with_capacity(args.iterations);
    for _ in 0..args.iterations {
        let t = Instant::now();
        let q = solo.request_token(0, 0)?;
        rtt.push(t.elapsed());
        if q == 0 {
            bail!("zero quota");
        }
        solo.release(1)?;
    }
    drop(solo);
    report("round trip (request -> grant, token free)", &mut rtt);

    // Handoff between two always-busy clients.
    let epoch = Instant::now();
    let hold = Duration::from_micros(args.hold_us);
    let n = args.iterations;
    let run = |name: &'static str| -> Result<Holder> {
        let mut c = connect(name)?;
        Ok(std::thread::spawn(move || {
            // (µs since epoch, true = grant received / false = release sent)
            let mut ev = Vec::with_capacity(2 * n);
            for _ in 0..n / 2 {
                c.request_token(0, 0)?;
                ev.push((epoch.elapsed().as_nanos() as u64, true));
                let t = Instant::now();
                while t.elapsed() < hold {
                    std::hint::spin_loop();
                }
                ev.push((epoch.elapsed().as_nanos() as u64, false));
                c.release(hold.as_micros() as u64)?;
            }
            Ok(ev)
        }))
    };
    let ta = run("a")?;
    let tb = run("b")?;
    let ea = ta
        .join()
        .map_err(|_| anyhow::anyhow!("thread a panicked"))??;
    let eb = tb
        .join()
        .map_err(|_| anyhow::anyhow!("thread b panicked"))??;
    let mut all: Vec<(u64, bool, u8)> = ea
        .iter()
        .map(|&(t, g)| (t, g, 0))
        .chain(eb.iter().map(|&(t, g)| (t, g, 1)))
        .collect();
    all.sort();
    let mut gaps = Vec::new();
    let mut handoffs = 0;
    for w in all.windows(2) {
        // A release by one client followed by a grant to the other.
        if let [(t0, false, c0), (t1, true, c1)] = w
            && c0 != c1
        {
            gaps.push(Duration::from_nanos(t1 - t0));
            handoffs += 1;
        }
    }
    println!("handoffs observed: {handoffs} of {} grants", n / 2 * 2);
    report(
        "handoff gap (release sent -> other client's grant)",
        &mut gaps,
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn report(what: &str, v: &mut [Duration]) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)].as_secs_f64() * 1e6;
    println!(
        "{what}: n={} p50={:.1}us p90={:.1}us p99={:.1}us max={:.1}us",
        v.len(),
        p(0.5),
        p(0.9),
        p(0.99),
        p(1.0)
    );
}
