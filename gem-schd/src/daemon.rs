//! The gem-schd server: one actor task owns the [`Core`], one accept task per client
//! socket, one task per connection, and a config watcher. Everything runs on a
//! current-thread runtime: the work is tiny message passing, and one thread keeps the
//! request→grant path free of cross-thread wake-ups.
//!
//! Bounds, so that one pod cannot exhaust the daemon: at most `max_conns` connections per
//! client (more get Error{6} and are closed); a connection with [`MAX_IN_FLIGHT`] requests
//! awaiting replies is not read further until it reads them (back-pressure onto that client
//! only), and one whose unread replies exceed [`MAX_QUEUED_REPLIES`] is closed; the actor's
//! inbox is bounded too.
//!
//! Peer check (`--verify-pod-peers`): a connection whose process does not run in the socket's
//! pod (by its cgroups) gets Error{7} and is closed at accept; refusals are counted in the usage
//! report. Every connection's PID (from its peer credentials) is listed there too, for the node
//! daemon to tell the processes gem-schd gates from those it does not know.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use gem_proto::gate::send_with_fd;
use gem_proto::{FrameError, GatePage, Reply, Request, code};
use gem_schd::config::{self, SocketTemplate};
use gem_schd::core::{
    Action, ClientClass, ClientSpec, CoRunSettings, ConnId, Core, Micros, Params,
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// Requests awaiting a reply on one connection before gem-schd stops reading it.
pub const MAX_IN_FLIGHT: usize = 32;
/// Replies queued for one connection before it is closed (its client does not read).
pub const MAX_QUEUED_REPLIES: usize = 64;
/// Commands queued for the actor (all connections together).
const INBOX: usize = 4096;
/// One launch in this many timed for Busy reports, asked of hooks while co-running is on. A
/// timed launch costs ~6 µs of CPU on an H100: one in 32 added +228–236 ns a launch on
/// average, one in 256 +43–58 ns, as much as nothing timed (+45–58 ns) in the same A/B
/// (docs/hook.md, "How busy a tenant keeps the GPU"); batch-1 inference still gets ~10
/// samples a co-hold.
const BUSY_EVERY_FOR_CO_RUN: u32 = 256;
/// How often the usage report is rewritten.
const USAGE_EVERY: Duration = Duration::from_secs(1);
/// (socket, peer pod) pairs whose refusals are counted; more are logged but not counted, so
/// that a process cycling through cgroups cannot grow the report without bound.
const MAX_REFUSAL_KEYS: usize = 1024;

/// Everything the daemon needs to start.
#[derive(Debug, Clone)]
pub struct Settings {
    pub gpu: String,
    pub config: PathBuf,
    pub template: SocketTemplate,
    pub params: Params,
    pub poll: Duration,
    pub dir_mode: u32,
    pub socket_mode: u32,
    /// Connections one client may have open.
    pub max_conns: usize,
    /// No grant for this long after start (see `Core::hold_grants_until`).
    pub quiet: Duration,
    /// Starvation bound (see `Core::set_max_wait`).
    pub max_wait: Duration,
    /// Where to write the usage report once a second (`gem_schd::usage`), if anywhere.
    pub usage_file: Option<PathBuf>,
    /// Hold cap under contention (see `Core::set_max_hold`).
    pub max_hold: Duration,
    /// Virtual-time ranking's lag bound (see `Core::set_max_lag`).
    pub max_lag: Duration,
    /// No pacing while the waiting clients' requests add up to the whole GPU (see
    /// `Core::set_unpaced_when_full`).
    pub unpaced_when_full: bool,
    /// A capped client's turn under full contention includes its drain (see
    /// `Core::set_turn_includes_drain`).
    pub turn_includes_drain: bool,
    /// The longest usual drain handed over from at a notice (see
    /// `Core::set_handover_drain_max`).
    pub handover_drain_max: Option<Duration>,
    /// Long turns among GPU-bound tenants (see `Core::set_long_turn`; zero: off).
    pub long_turn: Duration,
    /// Soon to the next client at a drain notice that cannot hand the token on (see
    /// `Core::set_soon`), on connections that asked for it (WantSoon) and have no gate page
    /// (those with one are told whatever this says).
    pub soon: bool,
    /// Co-running of light clients (see `Core::set_co_run`).
    pub co_run: CoRunSettings,
    /// Turns charged their kernel time (see `Core::set_charge_by_fill`).
    pub charge_by_fill: bool,
    /// Refuse connections from processes that do not run in the socket's pod (client IDs
    /// are pod UIDs).
    pub verify_pod_peers: bool,
    /// With `verify_pod_peers`: the directory of the clients that several pods share
    /// (a ResourceClaim reserved for several pods); file `<dir>/<client>` lists the pod
    /// UIDs whose processes that client's socket also serves, one a line.
    pub peers_dir: Option<PathBuf>,
}

/// Whether a process of pod `peer_pod` may use the socket of `client`: its own pod, or
/// a pod that `listed` (the client's peers file, one pod UID a line) names.
pub fn peer_allowed(client: &str, peer_pod: Option<&str>, listed: Option<&str>) -> bool {
    let Some(pod) = peer_pod else {
        return false;
    };
    pod == client || listed.is_some_and(|l| l.lines().any(|line| line.trim() == pod))
}

enum Cmd {
    Open {
        conn: ConnId,
        client: String,
        pid: Option<u32>,
        out: mpsc::Sender<Out>,
    },
    Refused {
        client: String,
        peer: Peer,
    },
    Frame {
        conn: ConnId,
        req: Request,
    },
    Closed {
        conn: ConnId,
    },
    Config(Vec<ClientSpec>),
}

struct Conn {
    client: String,
    /// The connecting process, from the socket's peer credentials (`None`: not visible in
    /// gem-schd's PID namespace).
    pid: Option<u32>,
    out: mpsc::Sender<Out>,
    hello: bool,
    /// It sent WantSoon: it reads Soon while it waits for a Grant.
    wants_soon: bool,
    /// Its gate page (it sent WantGate): set before each Grant on this connection.
    gate: Option<GatePage>,
}

/// A reply on its way to a connection's writer, with a descriptor to pass along (the Gate
/// reply's page).
type Out = (Reply, Option<OwnedFd>);

/// Who connected: the process (peer credentials) and the pod its cgroups put it in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Peer {
    pid: Option<u32>,
    pod: Option<String>,
}

impl Peer {
    /// The peer of `stream`; the pod only when `with_pod` (it costs a read of `/proc`).
    fn of(stream: &UnixStream, with_pod: bool) -> Peer {
        // The PID as gem-schd's PID namespace numbers it; 0 or none when the peer is not
        // visible there (another PID namespace that is not below gem-schd's).
        let pid = stream
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0);
        let pod = match pid {
            Some(pid) if with_pod => std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .ok()
                .and_then(|t| kubeshare_api::cgroup::pod_uid_of_process(&t)),
            _ => None,
        };
        Peer { pid, pod }
    }
}

/// Refusals counted per (socket's client, peer pod): the last PID and how many.
type Refusals = BTreeMap<(String, Option<String>), (u32, u64)>;

struct Listener {
    path: PathBuf,
    task: JoinHandle<()>,
}

struct Actor {
    settings: Settings,
    core: Core,
    epoch: Instant,
    conns: HashMap<ConnId, Conn>,
    listeners: HashMap<String, Listener>,
    tx: mpsc::Sender<Cmd>,
    next_conn: std::sync::Arc<std::sync::atomic::AtomicU64>,
    refused: Refusals,
}

/// Run until `shutdown` resolves.
pub async fn run(
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let (text, specs) = config::load(&settings.config).context("initial resource config")?;
    let epoch = Instant::now();
    let (tx, mut rx) = mpsc::channel(INBOX);
    let mut core = Core::new(settings.params, &specs, 0);
    core.hold_grants_until(settings.quiet.as_micros() as Micros);
    core.set_max_wait(settings.max_wait.as_micros() as Micros);
    core.set_max_hold(settings.max_hold.as_micros() as Micros);
    core.set_max_lag(settings.max_lag.as_micros() as Micros);
    core.set_unpaced_when_full(settings.unpaced_when_full);
    core.set_turn_includes_drain(settings.turn_includes_drain);
    core.set_handover_drain_max(settings.handover_drain_max.map(|d| d.as_micros() as Micros));
    core.set_long_turn(settings.long_turn.as_micros() as Micros);
    // Soon goes to gated connections whatever `--soon` says (they queue work ahead on it);
    // the actor sends it to ungated ones only with `--soon`.
    core.set_soon(true);
    core.set_co_run(settings.co_run);
    core.set_charge_by_fill(settings.charge_by_fill, 0);
    let mut actor = Actor {
        core,
        settings,
        epoch,
        conns: HashMap::new(),
        listeners: HashMap::new(),
        tx: tx.clone(),
        next_conn: Default::default(),
        refused: Refusals::new(),
    };
    actor.sync_listeners();
    info!(
        gpu = %actor.settings.gpu,
        clients = specs.len(),
        opportunistic = specs
            .iter()
            .filter(|s| s.class == ClientClass::Opportunistic)
            .count(),
        config = %actor.settings.config.display(),
        verify_pod_peers = actor.settings.verify_pod_peers,
        "gem-schd serving"
    );
    // The watcher compares with the text loaded above and looks once as soon as it watches:
    // an edit made between the load and the watch is not lost.
    let watcher = spawn_watcher(&actor.settings, tx.clone(), text)?;
    tokio::pin!(shutdown);
    let mut usage_tick = tokio::time::interval(USAGE_EVERY);
    usage_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let wake = actor.core.next_wakeup(actor.now());
        let sleep = async {
            match wake {
                Some(w) => {
                    tokio::time::sleep_until((actor.epoch + Duration::from_micros(w)).into()).await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = &mut shutdown => break,
            cmd = rx.recv() => match cmd {
                Some(cmd) => actor.handle(cmd),
                None => break,
            },
            _ = sleep => {
                let acts = actor.core.tick(actor.now());
                actor.perform(acts);
            }
            _ = usage_tick.tick(), if actor.settings.usage_file.is_some() => actor.write_usage(),
        }
    }
    info!("shutting down");
    let acts = actor.core.shutdown();
    actor.perform(acts);
    drop(watcher);
    for (_, l) in actor.listeners.drain() {
        l.task.abort();
        remove_socket(&l.path);
    }
    // Let connection tasks flush the Error{5} frames before the runtime stops.
    actor.conns.clear();
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(())
}

impl Actor {
    fn now(&self) -> Micros {
        self.epoch.elapsed().as_micros() as Micros
    }

    fn write_usage(&self) {
        if let Some(path) = &self.settings.usage_file {
            let mut r = gem_schd::usage::report(&self.core, self.now());
            let mut pids: HashMap<&str, Vec<u32>> = HashMap::new();
            for c in self.conns.values() {
                if let Some(pid) = c.pid {
                    pids.entry(c.client.as_str()).or_default().push(pid);
                }
            }
            for c in &mut r.clients {
                if let Some(mut p) = pids.remove(c.id.as_str()) {
                    p.sort_unstable();
                    p.dedup();
                    c.pids = p;
                }
            }
            r.refused = self
                .refused
                .iter()
                .map(
                    |((socket, peer_pod), (pid, count))| kubeshare_api::Refusal {
                        socket: socket.clone(),
                        peer_pod: peer_pod.clone(),
                        pid: *pid,
                        count: *count,
                    },
                )
                .collect();
            if let Err(e) = gem_schd::usage::write(path, &r) {
                // Metrics only: scheduling goes on.
                warn!(error = %e, path = %path.display(), "writing the usage report failed");
            }
        }
    }

    fn send(&mut self, conn: ConnId, reply: Reply) {
        self.send_with_fd(conn, reply, None);
    }

    fn send_with_fd(&mut self, conn: ConnId, reply: Reply, fd: Option<OwnedFd>) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        match c.out.try_send((reply, fd)) {
            // A closed receiver means the connection is going away; nothing to do.
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                // Its client does not read its replies: close it (dropping the sender ends
                // the connection task, which reports Closed and the core cleans up).
                if let Some(c) = self.conns.remove(&conn) {
                    warn!(conn, client = %c.client, "replies pile up unread; closing the connection");
                }
            }
        }
    }

    fn perform(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Grant {
                    client,
                    conns,
                    quota_us,
                } => {
                    // The client's charged time over the window, to cross-check against
                    // the GPU busy time a benchmark measures with events; `co`: a co-hold.
                    let usage_us = self.core.usage_us(self.now(), &client).unwrap_or(0);
                    let co = self.core.co_running(&client);
                    let vt_us = self.core.virtual_time_us(&client).unwrap_or(0);
                    let shared = self.core.hold_shared(&client);
                    let handover_due = self.core.handover_due(&client);
                    debug!(%client, quota_us, usage_us, vt_us, conns = conns.len(), shared, handover_due, co, "grant");
                    for c in conns {
                        // Before the Grant: the client's work queued behind its gate starts
                        // now, not when its thread has read the Grant.
                        if let Some(gate) = self.conns.get(&c).and_then(|c| c.gate.as_ref()) {
                            gate.open_at(gem_proto::gate::monotonic_ns(), shared, handover_due);
                        }
                        self.send(c, Reply::Grant { quota_us });
                    }
                }
                Action::Error {
                    conn,
                    code,
                    message,
                } => self.send(conn, Reply::error(code, message)),
                Action::Yield { conn } => self.send(conn, Reply::Yield),
                Action::Soon { conns } => {
                    for conn in conns {
                        // A gated connection queues work ahead on Soon; one without a gate
                        // spins for its Grant, which `--soon` allows.
                        let Some(c) = self
                            .conns
                            .get(&conn)
                            .filter(|c| c.wants_soon && (c.gate.is_some() || self.settings.soon))
                        else {
                            continue;
                        };
                        debug!(conn, client = %c.client, "soon");
                        self.send(conn, Reply::Soon);
                    }
                }
            }
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        let now = self.now();
        match cmd {
            Cmd::Refused { client, peer } => {
                let peer_pod = peer.pod.as_deref().unwrap_or("none");
                warn!(socket_pod = %client, %peer_pod, pid = ?peer.pid, "connection refused: the peer does not run in the socket's pod");
                let key = (client, peer.pod);
                if self.refused.len() < MAX_REFUSAL_KEYS || self.refused.contains_key(&key) {
                    let e = self.refused.entry(key).or_default();
                    e.0 = peer.pid.unwrap_or(0);
                    e.1 += 1;
                }
            }
            Cmd::Open {
                conn,
                client,
                pid,
                out,
            } => {
                let open = self.conns.values().filter(|c| c.client == client).count();
                if open >= self.settings.max_conns {
                    warn!(%client, open, "too many connections for one client; refusing one");
                    let msg = format!("client {client} already has {open} connections");
                    let _ = out.try_send((Reply::error(code::TOO_MANY_CONNECTIONS, msg), None));
                    return; // dropping `out` closes the connection after the error
                }
                self.conns.insert(
                    conn,
                    Conn {
                        client,
                        pid,
                        out,
                        hello: false,
                        wants_soon: false,
                        gate: None,
                    },
                );
            }
            Cmd::Closed { conn } => {
                if let Some(c) = self.conns.remove(&conn) {
                    debug!(conn, client = %c.client, "connection closed");
                }
                let acts = self.core.disconnect(now, conn);
                self.perform(acts);
            }
            Cmd::Frame { conn, req } => self.frame(now, conn, req),
            Cmd::Config(specs) => {
                let ids: Vec<&str> = specs.iter().map(|s| s.id.as_str()).collect();
                let opportunistic: Vec<&str> = specs
                    .iter()
                    .filter(|s| s.class == ClientClass::Opportunistic)
                    .map(|s| s.id.as_str())
                    .collect();
                info!(clients = ?ids, ?opportunistic, "resource config reloaded");
                let acts = self.core.set_config(now, &specs);
                self.perform(acts);
                // A limit that changed during a hold changes whether co-holds may start beside
                // it: a hook reads the word again at its hold's end (the next Grant rewrites it).
                for c in self.conns.values() {
                    if let Some(gate) = &c.gate {
                        gate.set_shared(self.core.hold_shared(&c.client));
                    }
                }
                self.sync_listeners();
                // Refusals at sockets that are gone are no one's concern any more.
                self.refused
                    .retain(|(socket, _), _| self.listeners.contains_key(socket));
            }
        }
    }

    fn hello(&mut self, conn: ConnId, pid: u32, gpu_uuid: &str) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let said = c.hello;
        if said {
            self.send(conn, Reply::error(code::PROTOCOL_MISUSE, "second Hello"));
            return;
        }
        if !gpu_uuid.eq_ignore_ascii_case(&self.settings.gpu) {
            let msg = format!("this gem-schd serves {}, not {gpu_uuid}", self.settings.gpu);
            self.send(conn, Reply::error(code::WRONG_GPU, msg));
            return;
        }
        let client = c.client.clone();
        match self.core.hello(conn, &client) {
            Ok(h) => {
                info!(conn, %client, pid, "client connected");
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.hello = true;
                }
                self.send(
                    conn,
                    Reply::HelloOk {
                        request_milli: h.request_milli,
                        limit_milli: h.limit_milli,
                        mem_limit: h.mem_limit,
                        mem_used: h.mem_used,
                        window_ms: h.window_ms,
                    },
                );
            }
            Err(r) => self.send(conn, Reply::error(r.code, r.message)),
        }
    }

    /// Whether `conn` has said Hello; if not, it is answered Error{4}, as the core answers
    /// the frames it handles before Hello.
    fn said_hello(&mut self, conn: ConnId) -> bool {
        if self.conns.get(&conn).is_some_and(|c| c.hello) {
            return true;
        }
        self.send(
            conn,
            Reply::error(code::PROTOCOL_MISUSE, "Hello must be the first frame"),
        );
        false
    }

    fn frame(&mut self, now: Micros, conn: ConnId, req: Request) {
        if !self.conns.contains_key(&conn) {
            return;
        }
        // The core answers frames before Hello with Error{4} (it has no such conn).
        match req {
            Request::Hello { pid, gpu_uuid } => self.hello(conn, pid, &gpu_uuid),
            Request::TokenRequest {
                overuse_us,
                burst_us,
            } => {
                let acts = self.core.token_request(now, conn, overuse_us, burst_us);
                // Not answered at once: it waits for the token (operators see who waits; tests
                // wait for this line instead of sleeping).
                if !acts.iter().any(|a| a.answers(conn))
                    && let Some(c) = self.conns.get(&conn)
                {
                    let vt_us = self.core.virtual_time_us(&c.client).unwrap_or(0);
                    let repaying = self.core.repaying(&c.client).unwrap_or(false);
                    debug!(conn, client = %c.client, overuse_us, burst_us, vt_us, repaying, "token request waits");
                } else if let Some(c) = self.conns.get(&conn) {
                    // Answered at once: its overuse stretched the client's last turn (what a
                    // benchmark lines up against the GPU's clock).
                    debug!(conn, client = %c.client, overuse_us, burst_us, "token request answered");
                }
                self.perform(acts);
            }
            Request::Release { used_us } => {
                if let Some(c) = self.conns.get(&conn) {
                    debug!(conn, client = %c.client, used_us, "release");
                }
                let acts = self.core.release(now, conn, used_us);
                self.perform(acts);
            }
            Request::Renew { burst_us } => {
                if let Some(c) = self.conns.get(&conn) {
                    // When a holder notices its quota's end: the benchmarks time hand-overs by it.
                    debug!(conn, client = %c.client, burst_us, "renew");
                }
                let acts = self.core.renew(now, conn, burst_us);
                self.perform(acts);
            }
            // No reply, as Drain.
            Request::WantSoon => {
                if self.said_hello(conn)
                    && let Some(c) = self.conns.get_mut(&conn)
                {
                    c.wants_soon = true;
                }
            }
            Request::WantGate => {
                if self.said_hello(conn) {
                    self.give_gate(conn);
                }
            }
            // No reply, as Drain.
            Request::Parks => {
                if self.said_hello(conn) {
                    self.core.set_parks(conn);
                }
            }
            Request::Drain => {
                if let Some(c) = self.conns.get(&conn) {
                    debug!(conn, client = %c.client, "drain");
                }
                // No reply: a stray Drain (no Hello, a departed client, no hold) changes nothing.
                let acts = self.core.drain(now, conn);
                self.perform(acts);
            }
            Request::Busy {
                busy_us,
                held_us,
                earlier_us,
                engine_us,
            } => {
                let now = self.now();
                match self
                    .core
                    .busy(now, conn, busy_us, held_us, earlier_us, engine_us)
                {
                    Ok(()) => {
                        if let Some(c) = self.conns.get(&conn) {
                            let fill = self.core.fill(&c.client).unwrap_or(f64::NAN);
                            let limit = self.core.limit_in_force(&c.client).unwrap_or(0);
                            debug!(client = %c.client, busy_us, held_us, engine_us, fill = %format_args!("{fill:.3}"), limit, "busy");
                        }
                    }
                    // Busy has no reply, but a refused one must not be silent.
                    Err(r) => self.send(conn, Reply::error(r.code, r.message)),
                }
            }
            Request::Options => {
                if self.said_hello(conn) {
                    // Busy reports only where they are used: co-running, charging by fill and
                    // long turns need each client's fill.
                    let busy_every = if self.settings.co_run.below > 0.0
                        || self.settings.charge_by_fill
                        || !self.settings.long_turn.is_zero()
                    {
                        BUSY_EVERY_FOR_CO_RUN
                    } else {
                        0
                    };
                    self.send(conn, Reply::OptionsOk { busy_every });
                }
            }
            Request::MemAlloc { bytes } => {
                let r = match self.core.mem_alloc(conn, bytes) {
                    Ok(d) => Reply::MemVerdict {
                        granted: d.granted,
                        used: d.used,
                        limit: d.limit,
                    },
                    Err(r) => Reply::error(r.code, r.message),
                };
                self.send(conn, r);
            }
            Request::MemFree { bytes } => {
                if let Err(r) = self.core.mem_free(conn, bytes) {
                    // MemFree has no reply, but a refused one must not be silent.
                    self.send(conn, Reply::error(r.code, r.message));
                }
            }
            Request::MemQuery => {
                let r = match self.core.mem_query(conn) {
                    Ok((used, limit)) => Reply::MemInfo { used, limit },
                    Err(r) => Reply::error(r.code, r.message),
                };
                self.send(conn, r);
            }
        }
    }

    /// Makes `conn`'s gate page and sends it with the Gate reply (a second WantGate gets the
    /// same page).
    fn give_gate(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let fd = match &mut c.gate {
            Some(p) => p.fd().try_clone_to_owned(),
            slot @ None => {
                GatePage::create().and_then(|p| slot.insert(p).fd().try_clone_to_owned())
            }
        };
        match fd {
            Ok(fd) => {
                debug!(conn, client = %c.client, "gate page given");
                self.core.set_told_handover_due(conn);
                self.send_with_fd(conn, Reply::Gate, Some(fd));
            }
            Err(e) => {
                warn!(conn, client = %c.client, error = %e, "making a gate page failed");
                let msg = format!("no gate page: {e}");
                self.send(conn, Reply::error(code::GATE_UNAVAILABLE, msg));
            }
        }
    }

    /// Open sockets for new clients, close those of clients that left.
    fn sync_listeners(&mut self) {
        let ids: Vec<String> = self.core.client_ids().map(str::to_owned).collect();
        let gone: Vec<String> = self
            .listeners
            .keys()
            .filter(|k| !ids.contains(k))
            .cloned()
            .collect();
        for id in gone {
            if let Some(l) = self.listeners.remove(&id) {
                l.task.abort();
                remove_socket(&l.path);
                info!(client = %id, path = %l.path.display(), "socket removed");
            }
        }
        for id in ids {
            if self.listeners.contains_key(&id) {
                continue;
            }
            let path = self.settings.template.path(&id, &self.settings.gpu);
            match bind(&path, self.settings.dir_mode, self.settings.socket_mode) {
                Ok(listener) => {
                    info!(client = %id, path = %path.display(), "socket created");
                    let peers = self.settings.peers_dir.as_ref().map(|d| d.join(&id));
                    let task = tokio::spawn(accept_loop(
                        listener,
                        id.clone(),
                        self.settings.verify_pod_peers.then_some(peers),
                        self.tx.clone(),
                        self.next_conn.clone(),
                    ));
                    self.listeners.insert(id, Listener { path, task });
                }
                Err(e) => {
                    warn!(client = %id, path = %path.display(), error = %format!("{e:#}"), "cannot create socket")
                }
            }
        }
    }
}

fn bind(path: &Path, dir_mode: u32, socket_mode: u32) -> Result<UnixListener> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(dir_mode)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            // A stale socket from an earlier run.
            std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(socket_mode))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(l)
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %e, "cannot remove socket");
    }
}

/// `verify`: `None` serves every process; `Some(peers)` only those of the client's pod
/// and of the pods its peers file (when there is one) lists, read at each connection.
async fn accept_loop(
    listener: UnixListener,
    client: String,
    verify: Option<Option<PathBuf>>,
    tx: mpsc::Sender<Cmd>,
    next: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let peer = Peer::of(&stream, verify.is_some());
                let refused = verify.as_ref().is_some_and(|peers| {
                    // The node daemon writes the file; absent is no other pod.
                    let listed = peers
                        .as_ref()
                        .filter(|_| peer.pod.as_deref().is_some_and(|p| p != client))
                        .and_then(|f| std::fs::read_to_string(f).ok());
                    !peer_allowed(&client, peer.pod.as_deref(), listed.as_deref())
                });
                if refused {
                    tokio::spawn(refuse(stream, client.clone(), peer, tx.clone()));
                    continue;
                }
                let conn = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(serve(stream, conn, client.clone(), peer.pid, tx.clone()));
            }
            Err(e) => {
                warn!(%client, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A connection from a process outside the socket's pod: Error{7}, closed, reported.
async fn refuse(mut stream: UnixStream, client: String, peer: Peer, tx: mpsc::Sender<Cmd>) {
    let msg = match (&peer.pod, peer.pid) {
        (Some(pod), _) => {
            format!("this socket belongs to pod {client}; the connecting process runs in pod {pod}")
        }
        (None, Some(pid)) => format!(
            "this socket belongs to pod {client}; the connecting process (pid {pid}) runs in no pod"
        ),
        (None, None) => format!(
            "this socket belongs to pod {client}; the connecting process is not visible to gem-schd (another PID namespace), so it cannot be checked"
        ),
    };
    let _ = tx.send(Cmd::Refused { client, peer }).await;
    if let Ok(b) = Reply::error(code::PEER_NOT_IN_POD, msg).encode() {
        let _ = stream.write_all(&b).await;
    }
    // Close the writing side only, and read what the client sends meanwhile (its Hello):
    // closing both at once could fail its write with EPIPE before it reads the error.
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 512];
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// One connection: decode frames to the actor, write its replies back.
async fn serve(
    stream: UnixStream,
    conn: ConnId,
    client: String,
    pid: Option<u32>,
    tx: mpsc::Sender<Cmd>,
) {
    let (out_tx, mut out_rx) = mpsc::channel::<Out>(MAX_QUEUED_REPLIES);
    if tx
        .send(Cmd::Open {
            conn,
            client,
            pid,
            out: out_tx,
        })
        .await
        .is_err()
    {
        return;
    }
    let (mut rd, mut wr) = stream.into_split();
    let mut buf: Vec<u8> = Vec::with_capacity(256);
    let mut chunk = [0u8; 1024];
    let mut wbuf = Vec::with_capacity(64);
    let mut in_flight = 0usize;
    'outer: loop {
        // Forward what is buffered, as far as the in-flight bound allows (the rest waits in
        // `buf`, which so holds at most one read beyond a frame).
        while in_flight < MAX_IN_FLIGHT {
            match Request::decode(&buf) {
                Ok(Some((req, used))) => {
                    buf.drain(..used);
                    if req.expects_reply() {
                        in_flight += 1;
                    }
                    if tx.send(Cmd::Frame { conn, req }).await.is_err() {
                        break 'outer;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    bad_frame(&mut wr, e).await;
                    break 'outer;
                }
            }
        }
        tokio::select! {
            // Not read further while too many of its requests await replies.
            n = rd.read(&mut chunk), if in_flight < MAX_IN_FLIGHT => {
                match n {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            r = out_rx.recv() => {
                let Some((r, fd)) = r else { break };
                in_flight = in_flight.saturating_sub(1);
                wbuf.clear();
                // Replies are built from bounded fields; Reply::error cuts messages.
                if r.encode_into(&mut wbuf).is_err() {
                    break;
                }
                let sent = match fd {
                    None => wr.write_all(&wbuf).await,
                    Some(fd) => write_with_fd(&mut wr, &wbuf, fd.as_fd()).await,
                };
                if sent.is_err() {
                    break;
                }
            }
        }
    }
    let _ = tx.send(Cmd::Closed { conn }).await;
}

/// Writes `data` with `fd` attached to its first byte (`SCM_RIGHTS`).
async fn write_with_fd(
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    data: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let sock: &UnixStream = wr.as_ref();
    let sent = loop {
        sock.writable().await?;
        match sock.try_io(Interest::WRITABLE, || {
            send_with_fd(sock.as_raw_fd(), data, fd)
        }) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    wr.write_all(&data[sent..]).await
}

async fn bad_frame(wr: &mut tokio::net::unix::OwnedWriteHalf, e: FrameError) {
    debug!(error = %e, "bad frame; closing connection");
    if let Ok(b) = Reply::error(code::BAD_FRAME, e.to_string()).encode() {
        let _ = wr.write_all(&b).await;
    }
}

/// Watch the config file (inotify on its directory, so a rename into place is seen,
/// plus a polling fallback) and send every new, valid version to the actor. A
/// malformed file is logged with the line at fault and the last good one stays.
fn spawn_watcher(settings: &Settings, tx: mpsc::Sender<Cmd>, loaded: String) -> Result<WatchGuard> {
    use notify::Watcher;
    let path = settings.config.clone();
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    let (kick_tx, mut kick_rx) = mpsc::unbounded_channel::<()>();
    let name = path.file_name().map(|n| n.to_owned());
    let k = kick_tx.clone();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if let Ok(ev) = ev
            && ev
                .paths
                .iter()
                .any(|p| p.file_name().map(|n| n.to_owned()) == name)
        {
            let _ = k.send(());
        }
    })
    .context("starting file watcher")?;
    if let Err(e) = watcher.watch(&dir, notify::RecursiveMode::NonRecursive) {
        warn!(dir = %dir.display(), error = %e, "cannot watch config dir; polling only");
    }
    // Look once now that the watch is in place: the file may have changed since it was loaded.
    let _ = kick_tx.send(());
    let poll = settings.poll;
    let task = tokio::spawn(async move {
        let mut last_text = Some(loaded);
        let mut last_bad: Option<String> = None;
        let mut last_meta = stamp(&path);
        let mut tick = tokio::time::interval(poll);
        loop {
            tokio::select! {
                k = kick_rx.recv() => if k.is_none() { break },
                _ = tick.tick() => {
                    if stamp(&path) == last_meta { continue }
                }
            }
            // Coalesce a burst of events (write + close + rename).
            tokio::time::sleep(Duration::from_millis(20)).await;
            while kick_rx.try_recv().is_ok() {}
            last_meta = stamp(&path);
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot read resource config; keeping the last good one");
                    continue;
                }
            };
            if Some(&text) == last_text.as_ref() || Some(&text) == last_bad.as_ref() {
                continue;
            }
            match config::parse_specs(&text) {
                Ok(specs) => {
                    last_text = Some(text);
                    last_bad = None;
                    if tx.send(Cmd::Config(specs)).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "malformed resource config; keeping the last good one");
                    last_bad = Some(text);
                }
            }
        }
    });
    Ok(WatchGuard {
        _watcher: watcher,
        task,
        _kick: kick_tx,
    })
}

fn stamp(p: &Path) -> Option<(SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

struct WatchGuard {
    _watcher: notify::RecommendedWatcher,
    task: JoinHandle<()>,
    _kick: mpsc::UnboundedSender<()>,
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::peer_allowed;

    #[test]
    fn a_peer_is_its_sockets_pod_or_one_the_peers_file_lists() {
        assert!(peer_allowed("a", Some("a"), None));
        assert!(!peer_allowed("a", Some("b"), None));
        assert!(peer_allowed("a", Some("b"), Some("a\n b \n")));
        assert!(!peer_allowed("a", Some("b"), Some("bb\nc\n")));
        // A process in no pod is never served, whatever the file says.
        assert!(!peer_allowed("a", None, Some("\n")));
    }
}
