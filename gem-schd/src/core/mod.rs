//! The token scheduler's pure core: Gemini's algorithm as a state machine.
//!
//! No I/O and no clock: every event carries `now` (µs on any monotonic scale), and the
//! core answers with [`Action`]s (grants and errors to send to connections) plus
//! [`Core::next_wakeup`], the time at which the driver must call [`Core::tick`]. The
//! daemon drives it with the real clock, the tests with a virtual one.
//!
//! Accounting: every hold is a history entry `[start, end)` in a sliding window. Entries
//! never overlap: when a late overuse report stretches an entry over the holds granted
//! after it, those are pushed back (the GPU was still busy with the first holder's last,
//! non-preemptible burst). So a client's usage in the window is the sum of its entries,
//! less the part of the oldest entry that has slid out, kept incrementally.
//!
//! Pacing: a client with a limit below 1 must also stay within its limit over a short
//! pacing window (with the slack of one min-quota grant), so that the window's limit is
//! not used up in one block of seconds followed by as long a wait.
//!
//! Classes: guaranteed clients go first whenever one of them may take a turn; opportunistic
//! clients get the turns left over, shared among themselves by the same rules (`class`).
//!
//! Layout: this file holds the types, the connections and the public API; `window` the usage
//! accounting, pacing and eligibility; `dispatch` who gets the token next and for how long;
//! `class` what the guaranteed clients leave the opportunistic ones; `handover` the hand-over
//! when a holder says it drains.

use std::collections::{BTreeMap, HashMap, VecDeque};

pub use kubeshare_api::ClientClass;

/// Microseconds on the driver's clock.
pub type Micros = u64;
/// A connection, as numbered by the driver.
pub type ConnId = u64;

/// Tunables of the algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Sliding window over which usage is accounted.
    pub window_us: Micros,
    /// Quota of a client that has reported no burst yet.
    pub base_quota_us: Micros,
    /// Lower bound of every quota.
    pub min_quota_us: Micros,
    /// How long past a holder's quota the token waits for the holder's report
    /// (TokenRequest or Release) before moving on: the GPU is still busy with the
    /// holder's last, non-preemptible burst, and a client granted meanwhile would
    /// only queue behind it (or share the GPU with it) and mis-measure its burst.
    /// 0 = Gemini's behaviour (move on at expiry).
    pub grace_us: Micros,
    /// Pacing window: a client with a limit below 1 must also keep its usage over
    /// any such window within `limit × pace` (with the slack of one grant), so it
    /// is not given its whole `limit × window` in one block of seconds followed by
    /// as long a wait. Clamped to the window; 0 = off (Gemini's behaviour).
    pub pace_us: Micros,
    /// A second, short pacing window for a client that no other client waits beside:
    /// `limit × pace_short` over any such window, but any room in it lets the client in
    /// (the pacing window holds the share exactly). Over the pacing window alone a capped
    /// client whose window is empty may spend its `limit × pace` at once and then wait
    /// `(1 − limit) × pace` (a batch-1 inference tenant at 0.5 alone on an H100: 480 ms
    /// every second); this bounds that wait to about `(1 − limit) × pace_short` plus a
    /// burst. At or above the pacing window it adds nothing (the same rule); 0 = off.
    pub pace_short_us: Micros,
}

/// One pacing rule of a paced client: its usage over any `window` within `budget`
/// (`limit × window`), with the slack of one grant. The pacing window's rule is `exact`:
/// it also counts the client's usual overrun; the short window's lets a burst run past it
/// (it bounds waits, the exact rule holds the share).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PaceRule {
    pub window: Micros,
    /// GPU time allowed over the window.
    pub budget: Micros,
    pub exact: bool,
    /// The GPU time a µs of a new hold counts for, in thousandths (below 1000 while
    /// co-runners share the holder's turns).
    pub rate_milli: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            window_us: 10_000_000,
            base_quota_us: 50_000,
            min_quota_us: 5_000,
            grace_us: 50_000,
            pace_us: 1_000_000,
            pace_short_us: 100_000,
        }
    }
}

/// One client as the config declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSpec {
    pub id: String,
    /// Guaranteed share, 0..=1000.
    pub request_milli: u16,
    /// Ceiling of the share, 0..=1000.
    pub limit_milli: u16,
    /// Memory cap in bytes.
    pub mem_limit: u64,
    /// Guaranteed, or opportunistic: given only the turns guaranteed clients leave.
    pub class: ClientClass,
}

impl From<&kubeshare_api::ResourceEntry> for ClientSpec {
    fn from(e: &kubeshare_api::ResourceEntry) -> Self {
        ClientSpec {
            id: e.id.clone(),
            request_milli: e.request.get(),
            limit_milli: e.limit.get(),
            mem_limit: e.gpu_mem,
            class: e.class,
        }
    }
}

/// What the driver must send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send Grant{quota_us} to each of `conns` (all waiting requests of `client`).
    Grant {
        client: String,
        conns: Vec<ConnId>,
        quota_us: Micros,
    },
    /// Send Error{code, message} to `conn`.
    Error {
        conn: ConnId,
        code: u16,
        message: String,
    },
    /// Send Yield to `conn`: its Renew is refused, its hold stands.
    Yield { conn: ConnId },
    /// Send Soon to each of `conns` (waiting connections of the client that goes next when
    /// the holder's drain ends; see [`Core::set_soon`]). Not an answer: their Grant follows.
    Soon { conns: Vec<ConnId> },
}

impl Action {
    /// Whether this action sends `conn` a reply.
    pub fn answers(&self, conn: ConnId) -> bool {
        match self {
            Action::Grant { conns, .. } => conns.contains(&conn),
            Action::Error { conn: c, .. } | Action::Yield { conn: c } => *c == conn,
            Action::Soon { .. } => false,
        }
    }
}

/// A refusal of a synchronous request (Hello, memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: u16,
    pub message: String,
}

/// The client's limits, for HelloOk: the same type the client reads them into.
pub use gem_proto::HelloInfo;

/// Answer to a memory reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemDecision {
    pub granted: bool,
    pub used: u64,
    pub limit: u64,
}

type Key = u32;
/// Default of [`Core::set_max_wait`].
pub const DEFAULT_MAX_WAIT_US: Micros = 50_000;
/// Default of [`Core::set_max_hold`].
pub const DEFAULT_MAX_HOLD_US: Micros = 10_000;
/// Default of [`Core::set_max_lag`].
pub const DEFAULT_MAX_LAG_US: Micros = 10_000;
/// Another client that held the token this recently still competes for it (a batch-1
/// inference tenant between two requests has given the token back for its CPU time).
const CONTENDED_US: Micros = 100_000;
/// How long the token waits, after a hold that ran to its quota's end was ended by a Release,
/// for that client's next request before going to a client ahead of it in virtual time (see
/// `Core::awaits_reask`). The hook's idle thread releases such a hold while the process is on
/// the CPU between launches, and its next launch asks again a moment later (0.05–0.4 ms on an
/// H200).
const REASK_US: Micros = 500;
/// The key of history entries whose client's usage was forgotten (no client has it).
const FORGOTTEN: Key = Key::MAX;

/// A client whose hold just ended with a Release, whose next request the token waits for until
/// `until` rather than go to a client it goes before (`Core::awaits_reask`).
#[derive(Debug, Clone, Copy)]
struct Reask {
    client: Key,
    until: Micros,
    /// The hold ran to its quota's end (the hook's idle thread found the process between
    /// launches): the token waits for it before a client of its class ahead of it in virtual
    /// time too. Otherwise only before a client of a lower class.
    ran_out: bool,
}

#[derive(Debug, Clone)]
struct ClientState {
    spec: ClientSpec,
    /// Quota estimate (EMA of reported bursts).
    quota_us: Micros,
    /// How far this client's holds run past their quota (a decaying maximum of its
    /// reported overuse): the hook gates at launch time, so a burst queued just before the
    /// deadline runs on after it. A paced grant is shortened by it.
    overrun_us: Micros,
    /// The usual drain past a quota (an average of the overuse reported with TokenRequests,
    /// halfway to each new report): the work the client's CPU queued ahead and the hook
    /// drained at the hand-over. Under full contention a capped client's grant leaves room
    /// for it (see [`Core::set_turn_includes_drain`]).
    drain_us: Micros,
    /// Sum of `end - start` of this client's entries still in `history`.
    usage_sum: Micros,
    /// Pacing usage carried into a new account (see [`Core::forget_usage`]): pieces of the
    /// pacing window before the share changed, as if the client had used its new limit in it.
    carried: Vec<(Micros, Micros)>,
    /// Virtual time (stride scheduling): the time charged to the client since its
    /// account began, divided by its request. Among clients below their request the
    /// smallest pass goes first; see [`Core::set_max_lag`].
    pass: u128,
    /// Held back by its limit or pacing allowance at the last dispatch: when it is eligible
    /// again it comes back like a client back from idle (see `Core::set_max_lag`).
    blocked: bool,
    /// Connections with an unanswered TokenRequest, in arrival order.
    waiting: Vec<ConnId>,
    /// Order of the first waiting request, for FIFO tie-breaks.
    waiting_since: u64,
    /// When the client started waiting (for the starvation bound).
    waiting_at: Micros,
    /// Sequence number of the client's latest history entry.
    last_entry: Option<u64>,
    /// Open connections (Hello done).
    conns: usize,
    mem_used: u64,
    /// How much of its turns and of its co-holds its kernels filled (the hook's Busy reports).
    fill: fill::Fills,
    /// Charged by fill: how far its turns' token time was matched with Busy reports (the next
    /// report's turns are its turns from here on).
    busy_mark: Micros,
    /// Co-running: its co-hold and charges, its boost (`corun.rs`).
    co: corun::CoState,
}

#[derive(Debug, Clone)]
struct ConnState {
    /// `None` once the client has left the config.
    client: Option<Key>,
    mem: u64,
    waiting: bool,
    /// Whether its last Busy report came in a co-hold (`None`: none yet): the kind of hold
    /// its next report's `earlier` time was measured in.
    reported_co: Option<bool>,
    /// The history entry of the turn it was last granted, until it reports that turn's end (a
    /// TokenRequest or a Release): a hang-up before then ends the turn (`Core::disconnect`).
    turn: Option<u64>,
    /// It parks its queued work at a hold's end (gem-proto `Parks`): never handed over from
    /// at its notice (`handover.rs`).
    parks: bool,
    /// Its Grants say whether a hand-over is due at the hold's end (gem-proto
    /// `GatePage::handover_due`): only then is it renewed beside a waiting client
    /// (`Core::renew`), so that a hook never takes such renewals for keeping the GPU and queues
    /// deep into the hand-over.
    told_handover_due: bool,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    client: Key,
    start: Micros,
    end: Micros,
    grant: Micros,
    quota_end: Micros,
    /// The virtual time a µs of it counts for, in thousandths: the GPU time it was charged
    /// at when granted (`Core::set_charge_by_fill`; 1000 otherwise).
    rate_milli: u32,
}

#[derive(Debug, Clone)]
struct Hold {
    client: Key,
    /// Connections the grant answered (or that joined it) and that have not reported its end.
    conns: Vec<ConnId>,
    quota_end: Micros,
    seq: u64,
    /// The latest end reported by a connection that left the hold while others of its client
    /// were still in it (0: none): the entry ends no earlier.
    left_end: Micros,
    /// Whether the token is expected to go to another client when this hold ends
    /// ([`Core::handover_due`]).
    handover_due: bool,
    /// Whether its sole process said it drains (a Renew answered Yield, or a Drain) and the
    /// token stayed: the token then waits for its report past the grace (`Core::expiry`).
    draining: bool,
}

/// The scheduler of one GPU.
#[derive(Debug, Clone)]
pub struct Core {
    params: Params,
    start: Micros,
    ids: HashMap<String, Key>,
    /// Ordered, so that ties (and the order of actions) never depend on a hash: the same
    /// events give the same answers.
    clients: BTreeMap<Key, ClientState>,
    conns: HashMap<ConnId, ConnState>,
    history: VecDeque<Entry>,
    /// Sequence number of `history[0]`.
    first_seq: u64,
    holder: Option<Hold>,
    next_key: Key,
    next_wait: u64,
    grants: u64,
    /// No grant before this time (see [`Core::hold_grants_until`]).
    quiet_until: Micros,
    /// See [`Core::set_max_wait`].
    max_wait_us: Micros,
    /// See [`Core::set_max_hold`].
    max_hold_us: Micros,
    /// See [`Core::set_max_lag`].
    max_lag_us: Micros,
    /// See [`Core::set_unpaced_when_full`].
    unpaced_when_full: bool,
    /// See [`Core::set_turn_includes_drain`].
    turn_includes_drain: bool,
    /// See [`Core::set_hand_over_at_drain`].
    hand_over_at_drain: bool,
    /// See [`Core::set_handover_drain_max`].
    handover_drain_max_us: Option<Micros>,
    /// See [`Core::set_soon`].
    soon: bool,
    /// See [`Core::set_long_turn`].
    long_turn_us: Micros,
    /// The client whose last hold ended at its quota with a request for more (a tenant that
    /// always wants the GPU, not one that went idle): under full contention it does not take
    /// the next turn too unless it is more than a turn behind.
    asked_again: Option<Key>,
    /// The system's virtual time of each class (indexed by [`class::index`]): the largest
    /// virtual time a client of the class had when granted. A client back from idle when no
    /// one else of its class competes starts at most the lag behind it.
    vtime: [u128; 2],
    /// The client whose hold just ended with a Release, whose next request the token may wait
    /// for (`dispatch`).
    reask: Option<Reask>,
    /// The history entry of each class's last turn granted to a client above its request past
    /// its bound (`Core::above_due_in`; indexed by [`class::index`]).
    overdue_turn: [Option<u64>; 2],
    /// See [`Core::set_co_run`].
    co_run: CoRunSettings,
    /// See [`Core::set_charge_by_fill`].
    charge_by_fill: bool,
    /// What co-runners took of the GPU over time (`co_area.rs`), to credit holders' turns.
    co_area: co_area::CoArea,
}

impl Core {
    /// A scheduler started at `now` with the given clients.
    pub fn new(params: Params, specs: &[ClientSpec], now: Micros) -> Self {
        let mut c = Core {
            params,
            start: now,
            ids: HashMap::new(),
            clients: BTreeMap::new(),
            conns: HashMap::new(),
            history: VecDeque::new(),
            first_seq: 0,
            holder: None,
            next_key: 0,
            next_wait: 0,
            grants: 0,
            quiet_until: 0,
            max_wait_us: DEFAULT_MAX_WAIT_US,
            max_hold_us: DEFAULT_MAX_HOLD_US,
            max_lag_us: DEFAULT_MAX_LAG_US,
            unpaced_when_full: true,
            turn_includes_drain: true,
            hand_over_at_drain: true,
            handover_drain_max_us: None,
            soon: false,
            long_turn_us: 0,
            asked_again: None,
            reask: None,
            overdue_turn: [None; 2],
            vtime: [0; 2],
            co_run: CoRunSettings::default(),
            charge_by_fill: false,
            co_area: Default::default(),
        };
        let _ = c.set_config(now, specs);
        c
    }

    /// Grants nothing before `t`. A daemon that (re)starts cannot know whether a holder of
    /// its predecessor is still launching on its old quota; the quiet period lets such a
    /// holder notice the hang-up and stop, so two holders never run at once.
    pub fn hold_grants_until(&mut self, t: Micros) {
        self.quiet_until = t;
    }

    /// Starvation bound: an eligible client (under its limit and pacing allowance) that has
    /// waited this long (at a share of 0.5; scaled by (1 − share)/share otherwise) goes
    /// before the usage ranking (the longest waiting first). Without
    /// it, two clients ranked by usage over the 10 s window settle into blocks: the one that
    /// just held stays ahead of the other until their usages cross, which on an H100 kept a
    /// batch-1 inference tenant waiting 0.5 s at a time beside a training tenant (both 0.5).
    /// 0 = off (rank by usage only, Gemini's behaviour).
    pub fn set_max_wait(&mut self, us: Micros) {
        self.max_wait_us = us;
    }

    /// Hold cap under contention: while another client waits or held the token in the last
    /// 100 ms, a grant plus the holder's usual overrun (the work it queued before the
    /// deadline, drained at the hand-over) is kept to this, or to the shortest quota estimate
    /// of those contenders if longer (never below the min quota).
    /// Quanta then follow the other tenants' bursts instead of the holder's: beside a
    /// training tenant whose grants were ~36 ms plus a drained step, a batch-1 inference
    /// tenant waited 57 ms at p99 on an H100. Shares are unchanged (they follow the
    /// charged time); only the turns are shorter. 0 = off.
    pub fn set_max_hold(&mut self, us: Micros) {
        self.max_hold_us = us;
    }

    /// Order among clients below their request: by virtual time (stride scheduling, each
    /// client's charged time over its request since its account began), where a client that
    /// comes back to the queue may be at most this much GPU time (at its share) behind the
    /// others that compete: it cannot bank what it did not use while idle. Ranking by usage
    /// over the 10 s window instead (Gemini's `schd_priority`, `0` here) replays the window:
    /// a block of turns leaves the window 10 s later as a block of credit, and beside a
    /// training tenant a batch-1 inference tenant then waited ~60–70 ms behind runs of
    /// six or more 5 ms turns on an H100.
    pub fn set_max_lag(&mut self, us: Micros) {
        self.max_lag_us = us;
    }

    /// No pacing while the clients waiting for the token request the whole GPU together
    /// (their requests add up to 1): the turns by virtual time then hold each to its request,
    /// and pacing on top made a (0.5, 0.5) training and inference pair wait for their own
    /// usage of a second ago to slide out, the GPU idle while both were held back. `false`:
    /// pace capped clients always.
    pub fn set_unpaced_when_full(&mut self, on: bool) {
        self.unpaced_when_full = on;
    }

    /// Under full contention (see [`Core::set_unpaced_when_full`]), a capped client's grant
    /// is the min quota less its usual drain (at least a fifth of the min quota), so that its
    /// turn, drain included, is about the min quota: on an H100 a ResNet-50 training tenant's
    /// 5 ms grants became 12.8 ms turns (25 ms at p99) with the work its CPU had queued ahead,
    /// and a batch-1 inference tenant beside it waited that whole turn. `false`: the grant is
    /// the min quota.
    pub fn set_turn_includes_drain(&mut self, on: bool) {
        self.turn_includes_drain = on;
    }

    /// Hand-overs at the drain (`handover.rs`): a holder that stops launching at its quota's
    /// end and says so (a Renew answered Yield, a Drain) hands the token on at once, while its
    /// queued work drains, and is charged up to the drain's end by its report. `false`: the
    /// hold stands until the report (the GPU idled for the report, the grant and the next
    /// process's wake-up at each hand-over).
    pub fn set_hand_over_at_drain(&mut self, on: bool) {
        self.hand_over_at_drain = on;
    }

    /// The longest usual drain (a decaying maximum of a holder's reported overruns) that a
    /// drain notice hands the token on from (`None`: a fifth of the min quota, in a long turn
    /// too).
    pub fn set_handover_drain_max(&mut self, max: Option<Micros>) {
        self.handover_drain_max_us = max;
    }

    /// Soon at a drain notice (`handover.rs`): when the holder's drains are too long for the
    /// token to go on at its notice, the client that would go next is told (`Action::Soon`) so
    /// that its process is running, not blocked, when the grant comes after the report. Off by
    /// default (gem-schd's `--soon`); the decision is unchanged either way.
    pub fn set_soon(&mut self, on: bool) {
        self.soon = on;
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    /// IDs of the configured clients.
    pub fn client_ids(&self) -> impl Iterator<Item = &str> {
        self.ids.keys().map(String::as_str)
    }

    /// The client currently holding the token.
    pub fn holder(&self) -> Option<&str> {
        self.holder
            .as_ref()
            .and_then(|h| self.clients.get(&h.client))
            .map(|c| c.spec.id.as_str())
    }

    /// Number of grants made so far.
    pub fn grants(&self) -> u64 {
        self.grants
    }

    /// Usage of `id` in the window ending at `now` (the running hold and co-hold up to `now`),
    /// as charged: a capped client's turns whole, an uncapped one's less what co-runners took
    /// of them, co-holds as charged (see `corun.rs`).
    pub fn usage_us(&self, now: Micros, id: &str) -> Option<Micros> {
        let key = *self.ids.get(id)?;
        let mut u = self.usage(key, now);
        if let Some(h) = &self.holder
            && h.client == key
            && let Some(e) = self.entry(h.seq)
        {
            // The rest of the running turn, as `usage` counted it.
            let from = now.max(e.start);
            let ahead = e.end.saturating_sub(from);
            u = u.saturating_sub(ahead.saturating_sub(self.turn_credit(key, from, e.end)));
        }
        Some(u)
    }

    /// The virtual time of `id` (its charged time over its request since its account began,
    /// in µs at a request of 1.0): among clients below their request the smallest goes first.
    pub fn virtual_time_us(&self, id: &str) -> Option<u128> {
        self.ids.get(id).map(|k| self.clients[k].pass / 1000)
    }

    /// The current quota estimate of `id`.
    pub fn quota_estimate_us(&self, id: &str) -> Option<Micros> {
        self.ids.get(id).map(|k| self.clients[k].quota_us)
    }

    /// How much of its holds `id`'s kernels kept the GPU busy, in [0, 1] (see `fill`): of its
    /// co-holds while it co-runs, else of its turns; `None` before its processes reported
    /// enough.
    pub fn fill(&self, id: &str) -> Option<f64> {
        self.ids.get(id).and_then(|k| {
            let c = &self.clients[k];
            if c.co.co_mode {
                c.fill.co()
            } else {
                c.fill.turns()
            }
        })
    }

    /// Busy{busy, held, earlier, engine} on `conn` at `now`: adds to its client's fill, and
    /// books a capped client's engine time (`engine.rs`). No reply, no dispatch.
    pub fn busy(
        &mut self,
        now: Micros,
        conn: ConnId,
        busy_us: Micros,
        held_us: Micros,
        earlier_us: Micros,
        engine_us: Option<Micros>,
    ) -> Result<(), Refusal> {
        let key = self.conn_client(conn)?;
        // The report precedes the frame that ends or renews the hold it measured.
        let in_co = self.co_holds(key, conn);
        // What was measured of its earlier grants goes to the kind of hold its last report came
        // in: a client that alternates kinds otherwise had each kind's late samples counted in
        // the other's fill (through the fake driver a GPU-bound tenant's turns read 0.007, so it
        // co-ran after each turn).
        let earlier_co = match self.conns.get_mut(&conn) {
            Some(cs) => cs.reported_co.replace(in_co).unwrap_or(in_co),
            None => in_co,
        };
        // Charged by fill, a turn's fill is its kernels' time over the token time gem-schd
        // charges, not over the hold the hook saw: a turn also holds the grant's trip, the
        // process's wake-up and its first launch, and at each hand-over the drain (a
        // guaranteed matmul tenant on an H200 read 0.97 by the hook's holds and used 0.83 of
        // its charged time).
        let fill_held_us = match self.clients.get(&key) {
            Some(c) if self.charge_by_fill && !in_co => {
                self.turn_time_between(key, c.busy_mark, now)
            }
            _ => held_us,
        };
        if let Some(c) = self.clients.get_mut(&key) {
            if self.charge_by_fill && !in_co {
                c.busy_mark = now;
            }
            if earlier_us > 0 {
                c.fill.report(earlier_co, earlier_us, 0);
            }
            c.fill.report(in_co, busy_us, fill_held_us);
            if c.co.hold.is_some() || self.charge_by_fill {
                self.refresh_boost(now);
            }
        }
        self.book_engine(now, key, in_co, engine_us, held_us);
        Ok(())
    }

    /// Memory counted for `id`.
    pub fn mem_used(&self, id: &str) -> Option<u64> {
        self.ids.get(id).map(|k| self.clients[k].mem_used)
    }

    /// A connection said Hello as client `id`.
    pub fn hello(&mut self, conn: ConnId, id: &str) -> Result<HelloInfo, Refusal> {
        if self.conns.contains_key(&conn) {
            return Err(Refusal {
                code: gem_proto::code::PROTOCOL_MISUSE,
                message: "Hello was already said on this connection".into(),
            });
        }
        let Some(&key) = self.ids.get(id) else {
            return Err(unknown(id));
        };
        let c = self.clients.get_mut(&key).expect("ids and clients agree");
        c.conns += 1;
        self.conns.insert(
            conn,
            ConnState {
                client: Some(key),
                mem: 0,
                waiting: false,
                reported_co: None,
                turn: None,
                parks: false,
                told_handover_due: false,
            },
        );
        Ok(HelloInfo {
            request_milli: c.spec.request_milli,
            limit_milli: c.spec.limit_milli,
            mem_limit: c.spec.mem_limit,
            mem_used: c.mem_used,
            window_ms: u32::try_from(self.params.window_us / 1000).unwrap_or(u32::MAX),
        })
    }

    /// TokenRequest{overuse, burst} on `conn`.
    pub fn token_request(
        &mut self,
        now: Micros,
        conn: ConnId,
        overuse_us: Micros,
        burst_us: Micros,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        let key = match self.conn_client(conn) {
            Ok(k) => k,
            Err(r) => {
                out.push(refusal_action(conn, r));
                return out;
            }
        };
        if self.conns[&conn].waiting {
            out.push(Action::Error {
                conn,
                code: gem_proto::code::PROTOCOL_MISUSE,
                message: "a TokenRequest is already pending on this connection".into(),
            });
            return out;
        }
        self.expire(now);
        let co_ended = self.co_end(now, key, conn, overuse_us);
        let turn = self.conns.get_mut(&conn).and_then(|cs| cs.turn.take());
        self.learn_burst(key, burst_us);
        self.learn_overrun(key, overuse_us);
        self.learn_drain(key, overuse_us);
        let mut queue = true;
        if co_ended {
            // Its co-hold ended with this request and was charged by its fill: there is no
            // hold to leave nor a late report to charge.
        } else if let Some(h) = &mut self.holder
            && h.client == key
        {
            let remaining = h.quota_end.saturating_sub(now);
            if !h.conns.contains(&conn) && remaining > burst_us && remaining > 0 {
                // A process joining its client's running hold gets what is left.
                h.conns.push(conn);
                let seq = h.seq;
                if let Some(cs) = self.conns.get_mut(&conn) {
                    cs.turn = Some(seq);
                }
                out.push(Action::Grant {
                    client: self.clients[&key].spec.id.clone(),
                    conns: vec![conn],
                    quota_us: remaining,
                });
                queue = false;
            } else if self.leave_hold(now, conn, |e| e.quota_end.saturating_add(overuse_us)) {
                self.asked_again = Some(key);
            }
            // Otherwise another process of the client is still in the hold (draining its last
            // burst), or this one was never in it: this request waits for the hold's end.
        } else if let Some(seq) = turn
            && overuse_us > 0
        {
            // A hold that ran past its quota, reported after the token moved on. Without an
            // overuse there is nothing to report: the last hold ended by a Release (before its
            // quota's end) or at its quota; charging it up to its quota's end here pushed the
            // next holder's entry back, so a client that released early and asked again while
            // another held the token was charged time the other used (a (0.5, 0.5) training
            // tenant beside an intermittent neighbour used 0.58 of the GPU in the simulation).
            // Only this process's own turn: an overuse from one that was not in the client's
            // last turn (a process that reconnected) stretched another's turn by it.
            self.report_turn_end(now, seq, |e| e.quota_end.saturating_add(overuse_us));
        }
        if queue {
            if self.co_ok(now, key) {
                out.push(self.co_grant(now, key, conn));
            } else {
                self.enqueue(now, key, conn);
            }
        }
        self.dispatch(now, &mut out);
        out
    }

    /// Release{used} on `conn`: the process went idle.
    pub fn release(&mut self, now: Micros, conn: ConnId, used_us: Micros) -> Vec<Action> {
        let mut out = Vec::new();
        let key = match self.conn_client(conn) {
            Ok(k) => k,
            // Release has no reply; a stray one from a departed client is dropped.
            Err(_) => return out,
        };
        self.expire(now);
        // The hook releases once its drain is done: what it used past a co-hold's quota ran.
        let past = used_us.saturating_sub(self.co_run.quota_us);
        if self.co_end(now, key, conn, past) {
            self.dispatch(now, &mut out);
            return out;
        }
        let turn = self.conns.get_mut(&conn).and_then(|cs| cs.turn.take());
        if let Some(e) = self
            .clients
            .get(&key)
            .and_then(|c| c.last_entry)
            .and_then(|s| self.entry(s))
        {
            let over = e.grant.saturating_add(used_us).saturating_sub(e.quota_end);
            self.learn_overrun(key, over);
        }
        if self.holder.as_ref().is_some_and(|h| h.client == key) {
            let ran_out = self.holder.as_ref().is_some_and(|h| now >= h.quota_end);
            // A guaranteed client's next request goes before an opportunistic turn, however
            // its hold ended: with the hook's coarse clock, the idle thread's Release at the
            // deadline arrives a little before the quota's end by gem-schd's, and a launch-bound
            // training loop at (0.5, 0.5) beside opportunistic clients then waited for an
            // opportunistic turn after each of its own and was charged 0.38 (`sim_priority.rs`).
            let may_wait = ran_out || self.released_before_opportunistic(key);
            // Had the process asked again instead (its next request is on its way), would
            // another client have had the token? Then that one goes now: the wait below is for
            // a request that would win, and one that would not kept the told client (Soon)
            // waiting 0.5 ms and then gave the holder a double turn the request path refuses
            // (the last holder goes again only when more than a turn behind): 255 times in a
            // run of two capped matmul tenants at 0.3 / 0.7 on an H200. Decided on a copy, so
            // only where the token could wait at all.
            let another_goes = may_wait
                && self.anyone_else_waits(key)
                && self.next_at_notice(now, key, conn).is_some();
            // Before the quota's end this is `now`; in the grace period after it, the
            // measured use counts (the last burst ran past the quota).
            let ended = self.leave_hold(now, conn, |e| {
                e.quota_end.max(e.grant.saturating_add(used_us))
            });
            if ended && may_wait && !another_goes {
                self.reask = Some(Reask {
                    client: key,
                    until: now.saturating_add(REASK_US),
                    ran_out,
                });
            }
        } else if let Some(seq) = turn {
            self.report_turn_end(now, seq, |e| {
                e.quota_end.max(e.grant.saturating_add(used_us))
            });
        }
        self.dispatch(now, &mut out);
        out
    }

    /// `conn` closed (or its process died). A process in a turn that hangs up without reporting
    /// its end is charged to the hang-up: a hook that lives reports its drain, so one that
    /// hangs up was draining until then (or killed in its drain). If its hold had expired (or
    /// was handed over at its drain notice), that is no further past its quota's end than the
    /// grace or its client's usual overrun, whichever is longer, as a late report stretches
    /// it, pushing back the holds granted since; charged only to its quota's end, a process
    /// that exited past the grace had its drain, and the token's wait for it, counted nowhere.
    pub fn disconnect(&mut self, now: Micros, conn: ConnId) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(cs) = self.conns.remove(&conn) else {
            return out;
        };
        let Some(key) = cs.client else {
            return out;
        };
        self.expire(now);
        self.co_end(now, key, conn, 0);
        if let Some(c) = self.clients.get_mut(&key) {
            c.waiting.retain(|x| *x != conn);
            c.conns = c.conns.saturating_sub(1);
            c.mem_used = c.mem_used.saturating_sub(cs.mem);
            if c.conns == 0 {
                c.mem_used = 0;
            }
        }
        if let Some(h) = &mut self.holder
            && h.client == key
        {
            h.conns.retain(|c| *c != conn);
            if h.conns.is_empty() {
                // The token was held until now.
                self.end_hold(now, |_| now);
            }
        }
        if let Some(seq) = cs.turn
            && self.holder.as_ref().is_none_or(|h| h.seq != seq)
        {
            let drain = self
                .clients
                .get(&key)
                .map_or(0, |c| c.overrun_us)
                .max(self.params.grace_us);
            self.report_turn_end(now, seq, |e| e.quota_end.saturating_add(drain));
        }
        self.dispatch(now, &mut out);
        out
    }

    /// MemAlloc{bytes} on `conn`.
    pub fn mem_alloc(&mut self, conn: ConnId, bytes: u64) -> Result<MemDecision, Refusal> {
        let key = self.conn_client(conn)?;
        let c = self.clients.get_mut(&key).expect("conn client exists");
        let limit = c.spec.mem_limit;
        let granted = c
            .mem_used
            .checked_add(bytes)
            .is_some_and(|total| total <= limit);
        if granted {
            c.mem_used += bytes;
            if let Some(cs) = self.conns.get_mut(&conn) {
                cs.mem += bytes;
            }
        }
        Ok(MemDecision {
            granted,
            used: c.mem_used,
            limit,
        })
    }

    /// MemFree{bytes} on `conn`: credits at most what the connection had counted.
    pub fn mem_free(&mut self, conn: ConnId, bytes: u64) -> Result<(), Refusal> {
        let key = self.conn_client(conn)?;
        let cs = self.conns.get_mut(&conn).expect("checked");
        let credit = bytes.min(cs.mem);
        cs.mem -= credit;
        let c = self.clients.get_mut(&key).expect("conn client exists");
        c.mem_used = c.mem_used.saturating_sub(credit);
        Ok(())
    }

    /// MemQuery on `conn`: (used, limit).
    pub fn mem_query(&self, conn: ConnId) -> Result<(u64, u64), Refusal> {
        let key = self.conn_client(conn)?;
        let c = &self.clients[&key];
        Ok((c.mem_used, c.spec.mem_limit))
    }

    /// Timer: the driver calls this at (or after) [`Core::next_wakeup`].
    pub fn tick(&mut self, now: Micros) -> Vec<Action> {
        let mut out = Vec::new();
        self.expire(now);
        self.dispatch(now, &mut out);
        out
    }

    /// Shutting down: every waiting request gets Error{5}.
    pub fn shutdown(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        for c in self.clients.values_mut() {
            for conn in c.waiting.drain(..) {
                out.push(Action::Error {
                    conn,
                    code: gem_proto::code::SHUTTING_DOWN,
                    message: "gem-schd is shutting down".into(),
                });
            }
        }
        for cs in self.conns.values_mut() {
            cs.waiting = false;
        }
        out
    }

    /// When the driver must call [`Core::tick`] next (`None`: only on an event).
    pub fn next_wakeup(&self, now: Micros) -> Option<Micros> {
        if let Some(h) = &self.holder {
            return Some(self.expiry(h));
        }
        let ready = self
            .clients
            .iter()
            .filter(|(_, c)| !c.waiting.is_empty())
            .filter_map(|(k, _)| self.ready_at(*k, now))
            .min();
        // While the token waits for a released client's next request, wake at its end.
        let ready = match (ready, self.reask) {
            (Some(r), Some(Reask { until, .. })) if until > now => Some(r.max(until)),
            (r, _) => r,
        };
        ready.map(|t| t.max(self.quiet_until))
    }

    fn conn_client(&self, conn: ConnId) -> Result<Key, Refusal> {
        match self.conns.get(&conn) {
            None => Err(Refusal {
                code: gem_proto::code::PROTOCOL_MISUSE,
                message: "Hello must be the first frame".into(),
            }),
            Some(ConnState { client: None, .. }) => Err(Refusal {
                code: gem_proto::code::UNKNOWN_CLIENT,
                message: "this client has been removed from the resource config".into(),
            }),
            Some(ConnState {
                client: Some(k), ..
            }) => Ok(*k),
        }
    }
}

fn unknown(id: &str) -> Refusal {
    Refusal {
        code: gem_proto::code::UNKNOWN_CLIENT,
        message: format!("client {id:?} is not in the resource config"),
    }
}

fn refusal_action(conn: ConnId, r: Refusal) -> Action {
    Action::Error {
        conn,
        code: r.code,
        message: r.message,
    }
}

mod capped;
mod catch_up;
mod class;
mod co_area;
mod corun;
mod dispatch;
mod engine;
mod fill;
mod handover;
mod long_turn;
mod reload;
mod window;

pub use corun::CoRunSettings;
pub use long_turn::LONG_TURN_FILL;

#[cfg(test)]
mod tests;
