//! `gem-schd`: the token scheduler of one GPU. Reads a resource-config file, serves one
//! Unix socket per client, hands out the GPU token by Gemini's algorithm.

mod daemon;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gem_schd::config::SocketTemplate;
use gem_schd::core::{CoRunSettings, Params};
use tracing_subscriber::EnvFilter;

/// Token scheduler for one GPU (Gemini's algorithm): each client gets at least its
/// REQUEST share of GPU time over a sliding window and at most its LIMIT.
#[derive(Debug, Parser)]
#[command(name = "gem-schd", version)]
struct Args {
    /// UUID of the GPU this scheduler serves (NVML form, GPU-xxxxxxxx-...); clients
    /// must name it in their Hello.
    #[arg(long)]
    gpu: String,
    /// Resource-config file: first line N, then N lines `ID REQUEST LIMIT GPU_MEM`.
    /// Reloaded when it changes (also when a new file is renamed into place).
    #[arg(long)]
    config: PathBuf,
    /// Socket path per client, with `{client}` (the ID) and `{gpu}` (the UUID).
    #[arg(long, default_value = kubeshare_api::layout::DEFAULT_SOCKET_TEMPLATE)]
    socket_template: String,
    /// Sliding window over which usage is accounted, ms.
    #[arg(long, default_value_t = 10_000)]
    window_ms: u64,
    /// Quota of a client that has not reported a burst yet, ms.
    #[arg(long, default_value_t = 50)]
    base_quota_ms: u64,
    /// Smallest quota, ms (smaller = finer sharing, more token round trips).
    #[arg(long, default_value_t = 5)]
    min_quota_ms: u64,
    /// How long past a holder's quota to wait for its overuse report before moving
    /// the token on, ms (its last burst still occupies the GPU); a holder that said it
    /// drains is waited for up to four of its usual drains if longer (at most 1 s);
    /// 0 = Gemini's behaviour.
    #[arg(long, default_value_t = 50)]
    grace_ms: u64,
    /// Pacing window, ms: a client with a limit below 1 must also stay within its
    /// limit over any such window (with the slack of one grant), so it runs in short
    /// holds spread over time instead of seconds on, seconds off. Clamped to the
    /// window; 0 = off (the limit holds over the window only, as in Gemini).
    #[arg(long, default_value_t = 1000)]
    pace_ms: u64,
    /// A second, short pacing window, ms, held the same way: over the pacing window alone a
    /// capped client may use its share of it at once and then wait the rest (500 ms at 0.5);
    /// this bounds such a wait to about (1 − limit) × this. At or above --pace-ms it adds nothing; 0 = off.
    #[arg(long, default_value_t = 100)]
    pace_short_ms: u64,
    /// Connections one client (pod) may have open at once; more are refused (Error 6).
    #[arg(long, default_value_t = 256)]
    max_conns: usize,
    /// Grant nothing for this long after start, ms: after a restart, a holder of the old
    /// daemon notices the hang-up and stops launching meanwhile (two holders never run).
    #[arg(long, default_value_t = 200)]
    quiet_ms: u64,
    /// Starvation bound, ms, for a client with a 0.5 share (scaled by (1 − share)/share):
    /// an eligible client that has waited that long goes before the usage ranking (never
    /// one above its request before one below). 0 = off (Gemini).
    #[arg(long, default_value_t = 50)]
    max_wait_ms: u64,
    /// Hold cap under contention, ms: while another client waits or held the token in the
    /// last 100 ms, a grant plus the holder's usual overrun is kept to this, or to the
    /// contenders' shortest quota if longer (at least the min quota), so a latency-sensitive
    /// tenant is not stopped behind long turns. 0 = off.
    #[arg(long, default_value_t = 0)]
    max_hold_ms: u64,
    /// Below their request, clients take turns by virtual time (charged time over
    /// request); one that comes back after more than this many ms without the token may
    /// be at most this far behind the others (it cannot bank idle time). 0 = rank by
    /// usage over the window instead (Gemini's schd_priority).
    #[arg(long, default_value_t = 10)]
    max_lag_ms: u64,
    /// Pacing is not applied while the clients waiting for the token request, together, the
    /// whole GPU (their requests add up to 1): their turns by virtual time already hold each
    /// to its request over short windows, and pacing on top made them wait for their own
    /// usage of a second ago to slide out, with the GPU idle while all were held back.
    /// `false`: pace capped clients always.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    unpaced_when_full: bool,
    /// Under full contention, a capped client's grant is the min quota less its usual drain
    /// (the work its CPU queued ahead, drained past the deadline), so that its turn with the
    /// drain is about the min quota. `false`: the grant is the min quota.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    turn_includes_drain: bool,
    /// The longest usual drain past a quota, µs, that a holder may have for the token to go
    /// on at its drain notice (the next client's work may run beside the drain, charged to
    /// the holder). Default: a fifth of the min quota.
    #[arg(long)]
    handover_drain_max_us: Option<u64>,
    /// Long turns among GPU-bound tenants, ms: under full contention a capped client's turn
    /// is this long instead of the min quota while every client it competes with fills at
    /// least 0.7 of its turns (docs/gem-schd.md, "Long turns"). Above 10 ms a tenant may pass
    /// its limit by more than 1 pp over a second (by up to a turn). 0 = off.
    #[arg(long, default_value_t = 0)]
    long_turn_ms: u64,
    /// At a drain notice that does not hand the token on (the holder's drains run long), tell
    /// the client that goes next (Soon) on connections without a gate page too, so that its
    /// process spins and is running when the grant comes after the holder's report; only
    /// hooks that ask for it are told. Connections with a gate page are told Soon whatever
    /// this says: they queue their launches behind the gate (docs/gem-schd.md, "Hand-over at
    /// the drain").
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    soon: bool,
    /// Co-running: a client whose kernels fill less than this fraction of its holds (its
    /// fill, from the hook's Busy reports) launches beside the token holder instead of
    /// waiting for turns, charged its fill of the time; the holder's turns are charged the
    /// rest (docs/gem-schd.md, "Co-running"). 0 = off (the chart's `nodeDaemon.coRunBelow`).
    #[arg(long, default_value_t = 0.0)]
    co_run_below: f64,
    /// Charge a turn its client's kernel time (the turn's length × its kernels' fill of its
    /// turns, from the hook's Busy reports; at least a third of the length) instead of its
    /// length: requests and limits then hold in GPU time for launch-bound tenants too
    /// (docs/gem-schd.md, "Charging by fill").
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    charge_by_fill: bool,
    /// A co-hold's length, ms: a co-runner reports and is charged this often.
    #[arg(long, default_value_t = 20)]
    co_run_quota_ms: u64,
    /// Poll the config's mtime this often as well as watching it, ms.
    #[arg(long, default_value_t = 1000)]
    poll_ms: u64,
    /// Mode of socket directories gem-schd creates (octal).
    #[arg(long, default_value = "700", value_parser = octal)]
    dir_mode: u32,
    /// Mode of the sockets (octal). Use 666 (and --dir-mode 755) when clients run as
    /// another user than gem-schd; isolation then rests on which directory is
    /// mounted into which pod.
    #[arg(long, default_value = "600", value_parser = octal)]
    socket_mode: u32,
    /// Write each client's token time over the window and its memory here once a
    /// second (replaced atomically; the node daemon exports it per pod).
    #[arg(long)]
    usage_file: Option<PathBuf>,
    /// Refuse a connection (Error 7, closed at once) unless the connecting process runs in
    /// the pod the socket belongs to: its PID from the socket's peer credentials, its pod
    /// UID from its cgroups (/proc/PID/cgroup, the kubelet's layout), which must be the
    /// socket's client ID. For Kubernetes, where client IDs are pod UIDs (the node daemon
    /// turns it on); gem-schd must then see the clients' PID namespace (the host's). Off
    /// for bare metal (gem-share), where client IDs are names.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    verify_pod_peers: bool,
    /// With --verify-pod-peers: the directory of the clients several pods share (a
    /// ResourceClaim reserved for several pods). File DIR/CLIENT lists the pod UIDs, one
    /// a line, whose processes the client's socket also serves. Read at each
    /// connection; the node daemon writes it.
    #[arg(long)]
    peers_dir: Option<PathBuf>,
}

fn octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        // Colour only on a terminal: logs piped to a file or a container log stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if args.window_ms == 0 {
        anyhow::bail!("--window-ms must be positive");
    }
    if !(0.0..=1.0).contains(&args.co_run_below) {
        anyhow::bail!("--co-run-below must be a fill in 0..=1 (0 = off)");
    }
    let settings = daemon::Settings {
        gpu: args.gpu,
        config: args.config,
        template: SocketTemplate::new(&args.socket_template)?,
        params: Params {
            window_us: args.window_ms * 1000,
            base_quota_us: args.base_quota_ms * 1000,
            min_quota_us: args.min_quota_ms * 1000,
            grace_us: args.grace_ms * 1000,
            pace_us: args.pace_ms.saturating_mul(1000),
            pace_short_us: args.pace_short_ms.saturating_mul(1000),
        },
        poll: Duration::from_millis(args.poll_ms.max(10)),
        dir_mode: args.dir_mode,
        socket_mode: args.socket_mode,
        max_conns: args.max_conns.max(1),
        quiet: Duration::from_millis(args.quiet_ms),
        max_wait: Duration::from_millis(args.max_wait_ms),
        usage_file: args.usage_file,
        max_hold: Duration::from_millis(args.max_hold_ms),
        max_lag: Duration::from_millis(args.max_lag_ms),
        unpaced_when_full: args.unpaced_when_full,
        turn_includes_drain: args.turn_includes_drain,
        handover_drain_max: args.handover_drain_max_us.map(Duration::from_micros),
        long_turn: Duration::from_millis(args.long_turn_ms),
        soon: args.soon,
        co_run: CoRunSettings {
            below: args.co_run_below,
            quota_us: args.co_run_quota_ms.max(1) * 1000,
        },
        charge_by_fill: args.charge_by_fill,
        verify_pod_peers: args.verify_pod_peers,
        peers_dir: args.peers_dir,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing SIGTERM handler")?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        daemon::run(settings, shutdown).await
    })
}
