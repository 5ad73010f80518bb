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

use std::collections::{HashMap, VecDeque};

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
}

impl Default for Params {
    fn default() -> Self {
        Params {
            window_us: 10_000_000,
            base_quota_us: 50_000,
            min_quota_us: 5_000,
            grace_us: 50_000,
            pace_us: 1_000_000,
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
}

impl From<&kubeshare_api::ResourceEntry> for ClientSpec {
    fn from(e: &kubeshare_api::ResourceEntry) -> Self {
        ClientSpec {
            id: e.id.clone(),
            request_milli: e.request.get(),
            limit_milli: e.limit.get(),
            mem_limit: e.gpu_mem,
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
/// Another client that held the token this recently still competes for it (a batch-1
/// inference tenant between two requests has given the token back for its CPU time).
const CONTENDED_US: Micros = 100_000;
/// The key of history entries whose client's usage was forgotten (no client has it).
const FORGOTTEN: Key = Key::MAX;

#[derive(Debug)]
struct ClientState {
    spec: ClientSpec,
    /// Quota estimate (EMA of reported bursts).
    quota_us: Micros,
    /// How far this client's holds run past their quota (a decaying maximum of its
    /// reported overuse): the hook gates at launch time, so a burst queued just before the
    /// deadline runs on after it. A paced grant is shortened by it.
    overrun_us: Micros,
    /// Sum of `end - start` of this client's entries still in `history`.
    usage_sum: Micros,
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
}

#[derive(Debug)]
struct ConnState {
    /// `None` once the client has left the config.
    client: Option<Key>,
    mem: u64,
    waiting: bool,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    client: Key,
    start: Micros,
    end: Micros,
    grant: Micros,
    quota_end: Micros,
}

#[derive(Debug)]
struct Hold {
    client: Key,
    /// Connections the grant answered (or that joined it).
    conns: Vec<ConnId>,
    quota_end: Micros,
    seq: u64,
}

/// The scheduler of one GPU.
#[derive(Debug)]
pub struct Core {
    params: Params,
    start: Micros,
    ids: HashMap<String, Key>,
    clients: HashMap<Key, ClientState>,
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
}

impl Core {
    /// A scheduler started at `now` with the given clients.
    pub fn new(params: Params, specs: &[ClientSpec], now: Micros) -> Self {
        let mut c = Core {
            params,
            start: now,
            ids: HashMap::new(),
            clients: HashMap::new(),
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

    /// The shortest quota estimate among the clients other than `key` that wait for the
    /// token or held it recently (`None`: no contention).
    fn contenders_quota(&self, key: Key, now: Micros) -> Option<Micros> {
        let recent = now.saturating_sub(CONTENDED_US);
        let held: Vec<Key> = self
            .history
            .iter()
            .rev()
            .take_while(|e| e.end > recent)
            .map(|e| e.client)
            .collect();
        self.clients
            .iter()
            .filter(|(k, c)| **k != key && (!c.waiting.is_empty() || held.contains(k)))
            .map(|(_, c)| c.quota_us)
            .min()
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

    /// Usage of `id` in the window ending at `now` (the running hold up to `now`).
    pub fn usage_us(&self, now: Micros, id: &str) -> Option<Micros> {
        let key = *self.ids.get(id)?;
        let mut u = self.usage(key, now);
        if let Some(h) = &self.holder
            && h.client == key
            && let Some(e) = self.entry(h.seq)
        {
            u = u.saturating_sub(e.end.saturating_sub(now.max(e.start)));
        }
        Some(u)
    }

    /// The current quota estimate of `id`.
    pub fn quota_estimate_us(&self, id: &str) -> Option<Micros> {
        self.ids.get(id).map(|k| self.clients[k].quota_us)
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
        self.learn_burst(key, burst_us);
        self.learn_overrun(key, overuse_us);
        let mut queue = true;
        if let Some(h) = &mut self.holder
            && h.client == key
        {
            let remaining = h.quota_end.saturating_sub(now);
            if !h.conns.contains(&conn) && remaining > burst_us && remaining > 0 {
                // A process joining its client's running hold gets what is left.
                h.conns.push(conn);
                out.push(Action::Grant {
                    client: self.clients[&key].spec.id.clone(),
                    conns: vec![conn],
                    quota_us: remaining,
                });
                queue = false;
            } else {
                self.end_hold(now, |e| e.quota_end.saturating_add(overuse_us));
            }
        } else {
            self.report_late(now, key, |e| e.quota_end.saturating_add(overuse_us));
        }
        if queue {
            self.enqueue(now, key, conn);
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
        if let Some(e) = self
            .clients
            .get(&key)
            .and_then(|c| c.last_entry)
            .and_then(|s| self.entry(s))
        {
            let over = e.grant.saturating_add(used_us).saturating_sub(e.quota_end);
            self.learn_overrun(key, over);
        }
        if let Some(h) = &mut self.holder
            && h.client == key
        {
            h.conns.retain(|c| *c != conn);
            if h.conns.is_empty() {
                // Before the quota's end this is `now`; in the grace period after it,
                // the measured use counts (the last burst ran past the quota).
                self.end_hold(now, |e| e.quota_end.max(e.grant.saturating_add(used_us)));
            }
        } else {
            self.report_late(now, key, |e| {
                e.quota_end.max(e.grant.saturating_add(used_us))
            });
        }
        self.dispatch(now, &mut out);
        out
    }

    /// `conn` closed (or its process died).
    pub fn disconnect(&mut self, now: Micros, conn: ConnId) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(cs) = self.conns.remove(&conn) else {
            return out;
        };
        let Some(key) = cs.client else {
            return out;
        };
        self.expire(now);
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

    /// The config changed: clients that stay keep their history and quota estimate
    /// (their limits take effect now); clients that left are dropped, their waiting
    /// requests answered Error{1}.
    pub fn set_config(&mut self, now: Micros, specs: &[ClientSpec]) -> Vec<Action> {
        let mut out = Vec::new();
        self.expire(now);
        let keep: HashMap<&str, &ClientSpec> = specs.iter().map(|s| (s.id.as_str(), s)).collect();
        let gone: Vec<(String, Key)> = self
            .ids
            .iter()
            .filter(|(id, _)| !keep.contains_key(id.as_str()))
            .map(|(id, k)| (id.clone(), *k))
            .collect();
        for (id, key) in gone {
            if self.holder.as_ref().is_some_and(|h| h.client == key) {
                self.end_hold(now, |_| now);
            }
            self.ids.remove(&id);
            if let Some(c) = self.clients.remove(&key) {
                for conn in c.waiting {
                    out.push(refusal_action(conn, unknown(&id)));
                }
            }
            for cs in self.conns.values_mut() {
                if cs.client == Some(key) {
                    cs.client = None;
                    cs.mem = 0;
                    cs.waiting = false;
                }
            }
        }
        for spec in specs {
            match self.ids.get(&spec.id).copied() {
                Some(k) => {
                    let mut changed = false;
                    if let Some(c) = self.clients.get_mut(&k) {
                        changed = (c.spec.request_milli, c.spec.limit_milli)
                            != (spec.request_milli, spec.limit_milli);
                        c.spec = spec.clone();
                    }
                    if changed {
                        self.forget_usage(k);
                    }
                }
                None => {
                    let key = self.next_key;
                    self.next_key += 1;
                    self.ids.insert(spec.id.clone(), key);
                    self.clients.insert(
                        key,
                        ClientState {
                            spec: spec.clone(),
                            quota_us: self.params.base_quota_us,
                            overrun_us: 0,
                            usage_sum: 0,
                            waiting: Vec::new(),
                            waiting_since: 0,
                            waiting_at: 0,
                            last_entry: None,
                            conns: 0,
                            mem_used: 0,
                        },
                    );
                }
            }
        }
        self.dispatch(now, &mut out);
        out
    }

    /// A client's share changed: its past usage was measured against the old share, so it
    /// starts a new account (its running hold, if any, stays charged). Judged against its new
    /// limit, a client that shrinks from 0.7 to 0.3 would otherwise wait seconds at zero
    /// until its window forgot the old usage. Its old entries stay in the history (they still
    /// keep later holds from overlapping), re-keyed to no client.
    fn forget_usage(&mut self, key: Key) {
        let hold = self
            .holder
            .as_ref()
            .filter(|h| h.client == key)
            .map(|h| h.seq);
        let mut kept = 0;
        for (i, e) in self.history.iter_mut().enumerate() {
            if e.client != key {
                continue;
            }
            if Some(self.first_seq + i as u64) == hold {
                kept += e.end - e.start;
            } else {
                e.client = FORGOTTEN;
            }
        }
        if let Some(c) = self.clients.get_mut(&key) {
            c.usage_sum = kept;
        }
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
            return Some(h.quota_end.saturating_add(self.params.grace_us));
        }
        self.clients
            .iter()
            .filter(|(_, c)| !c.waiting.is_empty())
            .filter_map(|(k, _)| self.ready_at(*k, now))
            .min()
            .map(|t| t.max(self.quiet_until))
    }

    // ---- internals ----

    /// When a waiting client passes both its limit and its pacing allowance, if
    /// nothing else happens (both only loosen as time passes, so the later of the two).
    fn ready_at(&self, key: Key, now: Micros) -> Option<Micros> {
        let c = self.clients.get(&key)?;
        let usage = u128::from(self.usage(key, now)) * 1000;
        let window_ok = usage < u128::from(c.spec.limit_milli) * u128::from(self.w_eff(now));
        let w = if window_ok {
            now
        } else {
            self.eligible_at(key, now)?
        };
        let p = match self.pace_budget(c) {
            None => now,
            Some(budget) => self.pace_ready_at(key, now, budget, self.pace_need(c, budget))?,
        };
        Some(w.max(p))
    }

    /// The pacing window in force (never longer than the window, whose history it reads).
    fn pace_window(&self) -> Micros {
        self.params.pace_us.min(self.params.window_us)
    }

    /// `limit × pace` of a paced client; `None` when pacing does not apply (off, an
    /// uncapped client, or a limit of 0, which the window check already holds back).
    fn pace_budget(&self, c: &ClientState) -> Option<Micros> {
        let pace = self.pace_window();
        let lim = c.spec.limit_milli;
        if pace == 0 || lim == 0 || lim >= 1000 {
            return None;
        }
        Some(((u128::from(lim) * u128::from(pace) / 1000) as u64).max(1))
    }

    /// The pacing headroom a paced client waits for: the min quota (or the whole
    /// allowance, if smaller). Waiting for a grant of the usual size instead would
    /// leave up to one grant of every pacing window unused (only whole grants fit),
    /// which cost a 0.3 client with 33 ms bursts 2-3 points of its share.
    ///
    /// A client that overruns its grants waits for that much more: the overrun lands in the
    /// same pacing window, and a 0.3 client with 50 ms bursts (its whole burst queued in a
    /// 5 ms grant) otherwise used 0.323 of a 1 s window on an H100.
    fn pace_need(&self, c: &ClientState, budget: Micros) -> Micros {
        self.params
            .min_quota_us
            .saturating_add(c.overrun_us)
            .min(budget)
            .max(1)
    }

    /// The client's own history from `from` on, clipped to it, oldest first.
    fn own_since(&self, key: Key, from: Micros) -> Vec<(Micros, Micros)> {
        // Entries are in order and never overlap, so their ends are ordered too.
        let mut v: Vec<(Micros, Micros)> = self
            .history
            .iter()
            .rev()
            .take_while(|e| e.end > from)
            .filter(|e| e.client == key)
            .map(|e| (e.start.max(from), e.end))
            .collect();
        v.reverse();
        v
    }

    /// The longest hold `q` starting at `now` that keeps the client's usage over the
    /// pacing window ending at `now + q` within `budget`: `q` plus its usage in
    /// `[now + q - pace, ..)` (old usage slides out while the new hold runs).
    fn pace_headroom(&self, key: Key, now: Micros, budget: Micros) -> Micros {
        let from = now.saturating_sub(self.pace_window());
        let segs = self.own_since(key, from);
        let used: Micros = segs.iter().map(|(s, e)| e - s).sum();
        let Some(slack) = budget.checked_sub(used) else {
            return 0;
        };
        // Moving the window's start from `from`, the hold may grow by the gaps between
        // the client's old pieces only up to `slack` (over its own pieces, the old
        // usage sliding out pays for the new).
        let (mut pos, mut gaps) = (from, 0);
        for (s, e) in segs {
            if s > pos {
                // Strictly more: a gap that uses the slack up exactly still lets the
                // hold run on over the next old piece (it slides out 1:1).
                if gaps + (s - pos) > slack {
                    break;
                }
                gaps += s - pos;
            }
            pos = pos.max(e);
        }
        pos + (slack - gaps) - from
    }

    /// When the pacing headroom reaches `need` (`now` if it has), assuming no new use:
    /// the first `t` with `need + usage in [t + need - pace, ..) <= budget`.
    fn pace_ready_at(&self, key: Key, now: Micros, budget: Micros, need: Micros) -> Option<Micros> {
        let pace = self.pace_window();
        let from = now.saturating_sub(pace);
        let segs = self.own_since(key, from);
        let used: Micros = segs.iter().map(|(s, e)| e - s).sum();
        // `excess` of the old usage must slide out of the window.
        let Some(excess) = used
            .checked_sub(budget.checked_sub(need)?)
            .filter(|x| *x > 0)
        else {
            return Some(now);
        };
        let mut gone = 0;
        for (s, e) in segs {
            if gone + (e - s) >= excess {
                let cutoff = s + (excess - gone);
                return Some((cutoff + pace).saturating_sub(need).max(now));
            }
            gone += e - s;
        }
        None
    }

    /// When a waiting client at its limit becomes eligible, if nothing else happens.
    fn eligible_at(&self, key: Key, now: Micros) -> Option<Micros> {
        let c = self.clients.get(&key)?;
        let lim = u128::from(c.spec.limit_milli);
        if lim == 0 {
            return None;
        }
        let w = self.params.window_us;
        let uptime = now.saturating_sub(self.start);
        let used = u128::from(self.usage(key, now)) * 1000;
        let allowed = lim * u128::from(self.w_eff(now));
        let excess = used.checked_sub(allowed)?; // None: eligible already
        if uptime < w {
            // The window is still growing: the allowance rises by `lim` per µs.
            let dt = u64::try_from(excess / lim + 1).unwrap_or(u64::MAX);
            return Some(now + dt.min(w - uptime).max(1));
        }
        // The window slides: the client loses its oldest usage as the cutoff passes.
        let need = u64::try_from(excess / 1000 + 1).unwrap_or(u64::MAX);
        let cutoff = now.saturating_sub(w);
        let mut lost = 0;
        for e in self
            .history
            .iter()
            .filter(|e| e.client == key && e.end > cutoff)
        {
            let s = e.start.max(cutoff);
            let seg = e.end.min(now).saturating_sub(s);
            if lost + seg >= need {
                return Some(now + (s + (need - lost) - cutoff).max(1));
            }
            lost += seg;
        }
        None
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

    fn w_eff(&self, now: Micros) -> Micros {
        now.saturating_sub(self.start)
            .clamp(1, self.params.window_us.max(1))
    }

    fn entry(&self, seq: u64) -> Option<&Entry> {
        let i = seq.checked_sub(self.first_seq)?;
        self.history.get(usize::try_from(i).ok()?)
    }

    /// Usage of `key` in the window ending at `now`, entries counted as recorded.
    fn usage(&self, key: Key, now: Micros) -> Micros {
        let Some(c) = self.clients.get(&key) else {
            return 0;
        };
        let cutoff = now.saturating_sub(self.params.window_us);
        let mut u = c.usage_sum;
        // Entries never overlap and are pruned when they end before the cutoff, so
        // only those at the front can straddle it (normally just the first).
        for e in &self.history {
            if e.start >= cutoff {
                break;
            }
            if e.client == key {
                u = u.saturating_sub(e.end.min(cutoff) - e.start);
            }
        }
        u
    }

    fn prune(&mut self, now: Micros) {
        let cutoff = now.saturating_sub(self.params.window_us);
        let hold_seq = self.holder.as_ref().map(|h| h.seq);
        while let Some(e) = self.history.front() {
            if e.end > cutoff || Some(self.first_seq) == hold_seq {
                break;
            }
            if let Some(c) = self.clients.get_mut(&e.client) {
                c.usage_sum = c.usage_sum.saturating_sub(e.end - e.start);
            }
            self.history.pop_front();
            self.first_seq += 1;
        }
    }

    /// Set the end of entry `seq`, pushing later entries back if it now overlaps them.
    fn set_end(&mut self, seq: u64, end: Micros) {
        let Some(i) = seq
            .checked_sub(self.first_seq)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|i| *i < self.history.len())
        else {
            return;
        };
        let e = &mut self.history[i];
        let end = end.max(e.start);
        let (old, client) = (e.end - e.start, e.client);
        e.end = end;
        let new = end - e.start;
        self.adjust(client, old, new);
        for j in i + 1..self.history.len() {
            let f = &mut self.history[j];
            if f.start >= end {
                break;
            }
            let old = f.end - f.start;
            f.start = end;
            f.end = f.end.max(end);
            let (new, client) = (f.end - f.start, f.client);
            self.adjust(client, old, new);
        }
    }

    fn adjust(&mut self, key: Key, old: Micros, new: Micros) {
        if let Some(c) = self.clients.get_mut(&key) {
            c.usage_sum = c.usage_sum - old + new;
        }
    }

    /// The holder's quota and grace ran out without a report: the token is free
    /// (its entry stays open to a late overuse report).
    fn expire(&mut self, now: Micros) {
        let grace = self.params.grace_us;
        if self
            .holder
            .as_ref()
            .is_some_and(|h| now >= h.quota_end.saturating_add(grace))
        {
            self.holder = None;
        }
    }

    /// End the running hold, charging it up to `end_of(&entry)` but never past `now`.
    fn end_hold(&mut self, now: Micros, end_of: impl Fn(&Entry) -> Micros) {
        let Some(h) = self.holder.take() else { return };
        let Some(e) = self.entry(h.seq).copied() else {
            return;
        };
        self.set_end(h.seq, now.min(end_of(&e)));
    }

    /// A client that no longer holds the token reports how far its last hold ran.
    fn report_late(&mut self, now: Micros, key: Key, end_of: impl Fn(&Entry) -> Micros) {
        let Some(seq) = self.clients.get(&key).and_then(|c| c.last_entry) else {
            return;
        };
        let Some(e) = self.entry(seq).copied() else {
            return;
        };
        let end = now.min(end_of(&e));
        if end > e.end {
            self.set_end(seq, end);
        }
    }

    /// A decaying maximum (halved at each report), so one long overrun shortens the next few
    /// paced grants, and the allowance comes back once the client stops overrunning.
    fn learn_overrun(&mut self, key: Key, overuse_us: Micros) {
        let w = self.params.window_us;
        if let Some(c) = self.clients.get_mut(&key) {
            c.overrun_us = overuse_us.min(w).max(c.overrun_us / 2);
        }
    }

    fn learn_burst(&mut self, key: Key, burst_us: Micros) {
        if burst_us == 0 {
            return;
        }
        let w = self.params.window_us;
        if let Some(c) = self.clients.get_mut(&key) {
            // Gemini: q <- 0.5 burst + 0.5 q (clamped when granting).
            c.quota_us = c.quota_us / 2 + burst_us.min(w) / 2;
        }
    }

    fn enqueue(&mut self, now: Micros, key: Key, conn: ConnId) {
        if let Some(cs) = self.conns.get_mut(&conn) {
            cs.waiting = true;
        }
        let c = self.clients.get_mut(&key).expect("conn client exists");
        if c.waiting.is_empty() {
            c.waiting_since = self.next_wait;
            c.waiting_at = now;
            self.next_wait += 1;
        }
        c.waiting.push(conn);
    }

    /// Grant the token if it is free and someone eligible waits.
    fn dispatch(&mut self, now: Micros, out: &mut Vec<Action>) {
        self.expire(now);
        if self.holder.is_some() || now < self.quiet_until {
            return;
        }
        self.prune(now);
        let w_eff = u128::from(self.w_eff(now));
        let window = u128::from(self.params.window_us);
        // (key, rank, headroom under the limit, headroom under the pacing allowance)
        let mut best: Option<(Key, Rank, u64, u64)> = None;
        // The eligible client below its request waiting longest past the starvation bound.
        // Only guarantees are bounded: spare time above the request follows usage alone
        // (a FIFO bound there hands spare time out per turn, so the client with the longer
        // bursts took 0.80 of an elastic pair instead of 0.50).
        let mut starved: Option<(Key, Micros, u64, u64)> = None;
        for (&key, c) in &self.clients {
            if c.waiting.is_empty() {
                continue;
            }
            let usage = u128::from(self.usage(key, now));
            let allowed_milli = u128::from(c.spec.limit_milli) * w_eff;
            if usage * 1000 >= allowed_milli {
                continue; // at its limit: waits
            }
            let headroom = ((allowed_milli - usage * 1000).div_ceil(1000)) as u64;
            // Pacing: wait until at least a min-quota grant fits the allowance.
            let pace_room = match self.pace_budget(c) {
                None => Micros::MAX,
                Some(budget) => {
                    let room = self.pace_headroom(key, now, budget);
                    if room < self.pace_need(c, budget) {
                        continue;
                    }
                    // The grant leaves room for the client's usual overrun.
                    room.saturating_sub(c.overrun_us)
                }
            };
            let require_milli = u128::from(c.spec.request_milli) * w_eff;
            let rank = if usage * 1000 < require_milli {
                // Below its request: the smaller usage/require goes first (the
                // larger missing/(missing+usage) in Gemini's words).
                Rank::Below {
                    usage,
                    require: require_milli,
                    order: c.waiting_since,
                }
            } else {
                Rank::Above {
                    usage,
                    order: c.waiting_since,
                }
            };
            if best.as_ref().is_none_or(|(_, r, _, _)| rank.before(r)) {
                best = Some((key, rank, headroom, pace_room));
            }
            let below = matches!(rank, Rank::Below { .. });
            let waited = now.saturating_sub(c.waiting_at);
            // Scaled by the client's request: at share s, proportional turns make it wait
            // (1 − s)/s of the others' hold, so the bound is the same fraction of `max_wait`
            // (50 ms at 0.5, 117 ms at 0.3, 21 ms at 0.7) and does not shift shares toward an
            // even split.
            let share = u64::from(c.spec.request_milli).clamp(1, 1000);
            let bound = self.max_wait_us.saturating_mul(1000 - share) / share;
            if below
                && self.max_wait_us > 0
                && waited >= bound
                && starved
                    .as_ref()
                    .is_none_or(|(_, at, _, _)| c.waiting_at < *at)
            {
                starved = Some((key, c.waiting_at, headroom, pace_room));
            }
        }
        let pick = match starved {
            Some((key, _, headroom, pace_room)) => Some((key, headroom, pace_room)),
            None => best.map(|(key, _, headroom, pace_room)| (key, headroom, pace_room)),
        };
        let Some((key, headroom, pace_room)) = pick else {
            return;
        };
        let p = self.params;
        // A turn need not be shorter than the contenders' own (two tenants with 34 ms
        // bursts keep 34 ms turns: cutting them only turns each burst into an overrun).
        let hold_cap = match self.max_hold_us {
            0 => None,
            m => self
                .contenders_quota(key, now)
                .map(|q| m.saturating_sub(self.clients[&key].overrun_us).max(q)),
        };
        let c = self.clients.get_mut(&key).expect("picked from clients");
        let cap = (u128::from(c.spec.limit_milli) * window / 1000) as u64;
        let mut quota = c.quota_us.max(p.min_quota_us).min(cap.max(1));
        // Do not hand out much more than the limit allows in this window.
        quota = quota.min(headroom.max(p.min_quota_us)).max(1);
        // Nor more than the pacing allowance (the min quota is the slack: a burst is
        // never cut below it).
        quota = quota.min(pace_room.max(p.min_quota_us)).max(1);
        if let Some(cap) = hold_cap {
            quota = quota.min(cap.max(p.min_quota_us)).max(1);
        }
        let conns = std::mem::take(&mut c.waiting);
        let seq = self.first_seq + self.history.len() as u64;
        c.last_entry = Some(seq);
        let client = c.spec.id.clone();
        for conn in &conns {
            if let Some(cs) = self.conns.get_mut(conn) {
                cs.waiting = false;
            }
        }
        let quota_end = now + quota;
        self.history.push_back(Entry {
            client: key,
            start: now,
            end: quota_end,
            grant: now,
            quota_end,
        });
        self.clients.get_mut(&key).expect("picked").usage_sum += quota;
        self.holder = Some(Hold {
            client: key,
            conns: conns.clone(),
            quota_end,
            seq,
        });
        self.grants += 1;
        out.push(Action::Grant {
            client,
            conns,
            quota_us: quota,
        });
    }
}

/// Gemini's `schd_priority`, as a total order with FIFO tie-break.
#[derive(Debug, Clone, Copy)]
enum Rank {
    Below {
        usage: u128,
        require: u128,
        order: u64,
    },
    Above {
        usage: u128,
        order: u64,
    },
}

impl Rank {
    fn before(&self, other: &Rank) -> bool {
        match (*self, *other) {
            (
                Rank::Below {
                    usage: u1,
                    require: r1,
                    order: o1,
                },
                Rank::Below {
                    usage: u2,
                    require: r2,
                    order: o2,
                },
            ) => {
                // u1*1000/r1 < u2*1000/r2, cross-multiplied (usages are in µs,
                // requires in milli-µs).
                let (a, b) = (u1 * r2, u2 * r1);
                a < b || (a == b && o1 < o2)
            }
            (Rank::Below { .. }, Rank::Above { .. }) => true,
            (Rank::Above { .. }, Rank::Below { .. }) => false,
            (
                Rank::Above {
                    usage: u1,
                    order: o1,
                },
                Rank::Above {
                    usage: u2,
                    order: o2,
                },
            ) => u1 < u2 || (u1 == u2 && o1 < o2),
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

#[cfg(test)]
mod tests {
    use super::*;
    use gem_proto::code;

    const MS: Micros = 1000;
    /// Events start one window after the core: the effective window is then full.
    const T0: Micros = 1_000_000;
    fn t(ms: Micros) -> Micros {
        T0 + ms * MS
    }

    fn spec(id: &str, req: u16, lim: u16, mem: u64) -> ClientSpec {
        ClientSpec {
            id: id.into(),
            request_milli: req,
            limit_milli: lim,
            mem_limit: mem,
        }
    }

    fn params() -> Params {
        Params {
            window_us: 1000 * MS,
            base_quota_us: 10 * MS,
            min_quota_us: 2 * MS,
            grace_us: 5 * MS,
            pace_us: 0,
        }
    }

    /// Core with clients a, b (0.5/1.0 each); conns 1,2 = a; 3 = b.
    fn two() -> Core {
        let mut c = Core::new(
            params(),
            &[spec("a", 500, 1000, 100), spec("b", 500, 1000, 100)],
            0,
        );
        c.hello(1, "a").unwrap();
        c.hello(2, "a").unwrap();
        c.hello(3, "b").unwrap();
        c
    }

    fn grant(acts: &[Action]) -> Option<(&str, Vec<ConnId>, Micros)> {
        acts.iter().find_map(|a| match a {
            Action::Grant {
                client,
                conns,
                quota_us,
            } => Some((client.as_str(), conns.clone(), *quota_us)),
            _ => None,
        })
    }

    #[test]
    fn unknown_client_and_early_frames_are_refused() {
        let mut c = two();
        assert_eq!(c.hello(9, "zz").unwrap_err().code, code::UNKNOWN_CLIENT);
        assert_eq!(c.hello(1, "a").unwrap_err().code, code::PROTOCOL_MISUSE);
        let acts = c.token_request(t(0), 42, 0, 0);
        assert!(matches!(
            &acts[..],
            [Action::Error {
                conn: 42,
                code: 4,
                ..
            }]
        ));
        assert_eq!(c.mem_query(42).unwrap_err().code, code::PROTOCOL_MISUSE);
    }

    #[test]
    fn free_token_is_granted_at_once_with_the_base_quota() {
        let mut c = two();
        let acts = c.token_request(t(0), 1, 0, 0);
        assert_eq!(grant(&acts), Some(("a", vec![1], 10 * MS)));
        assert_eq!(c.holder(), Some("a"));
    }

    #[test]
    fn a_grant_answers_every_waiting_connection_of_the_client() {
        let mut c = two();
        c.token_request(t(0), 3, 0, 0); // b holds
        assert!(grant(&c.token_request(1, 1, 0, 0)).is_none());
        assert!(grant(&c.token_request(2, 2, 0, 0)).is_none());
        let acts = c.release(t(3), 3, 3 * MS);
        assert_eq!(grant(&acts).map(|g| (g.0, g.1)), Some(("a", vec![1, 2])));
    }

    #[test]
    fn release_is_work_conserving() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 0);
        assert!(grant(&c.token_request(t(1), 3, 0, 0)).is_none());
        // a goes idle after 2 ms of its 10 ms: b gets the token then, not at 10 ms.
        let acts = c.release(t(2), 1, 2 * MS);
        assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
        assert_eq!(c.usage_us(t(2), "a"), Some(2 * MS));
    }

    #[test]
    fn a_new_process_joins_the_running_hold() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 0); // a holds until 10 ms
        let acts = c.token_request(t(4), 2, 0, MS);
        assert_eq!(grant(&acts), Some(("a", vec![2], 6 * MS)));
        // The hold ends when both have released.
        c.token_request(t(4), 3, 0, 0);
        assert!(grant(&c.release(t(5), 1, 0)).is_none());
        assert_eq!(grant(&c.release(t(6), 2, 0)).map(|g| g.0), Some("b"));
    }

    #[test]
    fn expiry_waits_for_the_holders_report_within_the_grace() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 0); // a: 10 ms
        c.token_request(t(1), 3, 0, 0); // b waits
        assert_eq!(c.next_wakeup(t(1)), Some(t(15)));
        assert!(grant(&c.tick(t(12))).is_none(), "a's last burst still runs");
        // a reports 3 ms of overuse and asks again: b goes, a is charged 13 ms.
        let acts = c.token_request(t(13), 1, 3 * MS, 0);
        assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
        assert_eq!(c.usage_us(t(13), "a"), Some(13 * MS));
    }

    #[test]
    fn a_silent_holder_loses_the_token_after_the_grace_and_overuse_pushes_back() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 0);
        c.token_request(t(1), 3, 0, 0);
        let acts = c.tick(t(15));
        assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
        // a reports late: it ran until 18 ms; b's hold is charged from then on.
        c.token_request(t(18), 1, 8 * MS, 0);
        assert_eq!(c.usage_us(t(18), "a"), Some(18 * MS));
        assert_eq!(c.usage_us(t(18), "b"), Some(0));
        assert_eq!(c.usage_us(t(20), "b"), Some(2 * MS));
    }

    #[test]
    fn quota_follows_reported_bursts_within_bounds() {
        let mut c = two();
        // EMA: 10 -> (10+30)/2 = 20 ms.
        assert_eq!(
            grant(&c.token_request(t(0), 1, 0, 30 * MS)).unwrap().2,
            20 * MS
        );
        // Tiny bursts: clamped up to the 2 ms minimum eventually.
        let mut now = t(20);
        let mut q = 0;
        for _ in 0..10 {
            q = grant(&c.token_request(now, 1, 0, 100)).unwrap().2;
            now += MS;
        }
        assert_eq!(q, 2 * MS);
        assert!(
            c.quota_estimate_us("a").unwrap() < 2 * MS,
            "the estimate itself follows the bursts"
        );
    }

    #[test]
    fn below_request_goes_first_then_least_usage() {
        let mut c = Core::new(
            params(),
            &[
                spec("hi", 800, 1000, 0),
                spec("lo", 100, 1000, 0),
                spec("z", 0, 1000, 0),
            ],
            0,
        );
        c.hello(1, "hi").unwrap();
        c.hello(2, "lo").unwrap();
        c.hello(3, "z").unwrap();
        // Run `conn` alone for `ms` of holds starting at `now`; returns the end.
        let run = |c: &mut Core, conn, mut now: Micros, ms: Micros| {
            let end = now + ms * MS;
            while now < end {
                let q = grant(&c.token_request(now, conn, 0, 0))
                    .unwrap()
                    .2
                    .min(end - now);
                now += q;
                c.release(now, conn, q);
            }
            now
        };
        // hi used 300 ms (37% of its request), lo 50 ms (50% of its), z 20 ms.
        let now = run(&mut c, 1, t(0), 300);
        let now = run(&mut c, 2, now, 50);
        let now = run(&mut c, 3, now, 20);
        c.token_request(now, 3, 0, 0); // z holds; all three then wait
        c.token_request(now, 2, 0, 0);
        c.token_request(now, 1, 0, 0);
        // Both below their requests: the smaller usage/request goes first (hi),
        // although lo has used less.
        let acts = c.release(now + MS, 3, MS);
        assert_eq!(grant(&acts).map(|g| g.0), Some("hi"));
        // lo (below its request) beats z (above its request of 0) despite more usage.
        let acts = c.release(now + 5 * MS, 1, 4 * MS);
        assert_eq!(grant(&acts).map(|g| g.0), Some("lo"));
    }

    #[test]
    fn a_client_at_its_limit_waits_even_on_an_idle_gpu() {
        let mut c = Core::new(params(), &[spec("a", 0, 100, 0)], 0);
        c.hello(1, "a").unwrap();
        // 10% of the 1 s window is 100 ms: ten 10 ms holds, then it must wait.
        let mut now = t(0);
        for _ in 0..10 {
            let q = grant(&c.token_request(now, 1, 0, 0))
                .expect("below its limit")
                .2;
            now += q;
            c.release(now, 1, q);
        }
        assert_eq!(now, t(100));
        assert!(grant(&c.token_request(now, 1, 0, 0)).is_none());
        // Eligible again just after the first hold begins to slide out of the window.
        let wake = c.next_wakeup(now).unwrap();
        assert_eq!(wake, t(1000) + 1);
        assert!(grant(&c.tick(wake - 1)).is_none());
        assert!(grant(&c.tick(wake)).is_some());
    }

    /// Pacing over 100 ms (window 1 s), one client with the given limit.
    fn paced(limit_milli: u16) -> Core {
        let p = Params {
            pace_us: 100 * MS,
            ..params()
        };
        let mut c = Core::new(p, &[spec("a", 0, limit_milli, 0)], 0);
        c.hello(1, "a").unwrap();
        c
    }

    /// Back-to-back holds from `now` while granted at once; returns the time of the
    /// first request that waits.
    fn run_until_paced(c: &mut Core, mut now: Micros) -> Micros {
        while let Some((_, _, q)) = grant(&c.token_request(now, 1, 0, 0)) {
            now += q;
            c.release(now, 1, q);
            assert!(now < t(10_000), "never paced");
        }
        now
    }

    #[test]
    fn pacing_holds_a_capped_client_to_its_limit_over_the_pace_window() {
        let mut c = paced(500);
        // 0.5 of 100 ms: five 10 ms holds, then it waits, far below its window limit.
        let now = run_until_paced(&mut c, t(0));
        assert_eq!(now, t(50));
        // Exact wake-up: when a whole 10 ms quota fits, i.e. when the first hold
        // starts to slide out of the pace window (the new hold replaces it).
        let wake = c.next_wakeup(now).unwrap();
        assert_eq!(wake, t(100));
        assert!(grant(&c.tick(wake - 1)).is_none());
        assert_eq!(grant(&c.tick(wake)).map(|g| g.2), Some(10 * MS));
    }

    #[test]
    fn a_paced_grant_leaves_room_for_the_clients_usual_overrun() {
        // 0.5 of 100 ms = 50 ms per pace window, min quota 2 ms.
        let mut c = paced(500);
        assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().2, 10 * MS);
        // The whole queued burst ran 20 ms past the 10 ms quota: [0, 30) is charged, 20 ms of
        // the allowance are left. Without the overrun allowance a 10 ms grant went out now
        // and, overrunning again, the window [−60, 40) held 60 ms > 50.
        assert!(grant(&c.token_request(t(30), 1, 20 * MS, 10 * MS)).is_none());
        // It waits until room − overrun fits a min quota: the window ending at the grant's
        // end plus the overrun holds at most 50 ms.
        let wake = c.next_wakeup(t(30)).unwrap();
        assert_eq!(wake, t(80));
        assert!(grant(&c.tick(wake - 1)).is_none());
        let q = grant(&c.tick(wake)).unwrap().2;
        assert_eq!(q, 10 * MS);
        // The allowance decays once the client stops overrunning (halved per report).
        c.token_request(wake + q, 1, 0, 10 * MS);
        assert_eq!(c.clients[&0].overrun_us, 10 * MS);
    }

    /// a (40 ms bursts) and b (2 ms bursts) alternate; returns a's grant after b's turn.
    fn long_turn_after_short(max_hold: Micros) -> Micros {
        let mut c = two();
        c.set_max_hold(max_hold);
        // Alone, a gets its own estimate (10 → 25 ms): nobody contends.
        assert_eq!(
            grant(&c.token_request(t(0), 1, 0, 40 * MS)).unwrap().2,
            25 * MS
        );
        assert!(grant(&c.token_request(t(10), 3, 0, 2 * MS)).is_none());
        // a's turn ends; b (less usage) goes, with its own short quota (10 → 6 ms).
        let g = c.token_request(t(25), 1, 0, 40 * MS);
        assert_eq!(grant(&g).map(|g| (g.0, g.2)), Some(("b", 6 * MS)));
        grant(&c.release(t(27), 3, 2 * MS)).unwrap().2
    }

    #[test]
    fn under_contention_a_turn_follows_the_contenders_quanta() {
        // b just held: a's turn is cut to max(max_hold − a's overrun, b's quota) = 6 ms.
        assert_eq!(long_turn_after_short(5 * MS), 6 * MS);
        // Off: a gets its own 32 ms estimate and b waits that long.
        assert_eq!(long_turn_after_short(0), 32_500);
    }

    #[test]
    fn pacing_is_off_at_zero_and_for_uncapped_clients() {
        // Limit 1.0: one second of back-to-back holds, each granted at once.
        let mut c = paced(1000);
        let mut now = t(0);
        while now < t(1000) {
            let q = grant(&c.token_request(now, 1, 0, 0))
                .expect("never paced")
                .2;
            now += q;
            c.release(now, 1, q);
        }
        let mut c = Core::new(params(), &[spec("a", 0, 500, 0)], 0);
        c.hello(1, "a").unwrap();
        // pace_us = 0: the 0.5 limit holds over the 1 s window only (500 ms at once).
        assert_eq!(run_until_paced(&mut c, t(0)), t(500));
    }

    #[test]
    fn a_grant_never_exceeds_the_pace_allowance_nor_drops_below_min_quota() {
        let mut c = paced(500);
        // A 150 ms burst moves the estimate to 80 ms; the allowance is 50 ms.
        assert_eq!(
            grant(&c.token_request(t(0), 1, 0, 150 * MS)).unwrap().2,
            50 * MS
        );
        // A limit whose allowance (1 ms) is below the min quota gets the min quota.
        let mut c = paced(10);
        assert_eq!(grant(&c.token_request(t(0), 1, 0, 0)).unwrap().2, 2 * MS);
    }

    #[test]
    fn memory_is_per_client_and_reclaimed_per_connection() {
        let mut c = two();
        assert!(c.mem_alloc(1, 60).unwrap().granted);
        let d = c.mem_alloc(2, 50).unwrap();
        assert_eq!((d.granted, d.used, d.limit), (false, 60, 100));
        assert!(c.mem_alloc(2, 40).unwrap().granted);
        // MemFree credits only what that connection counted.
        c.mem_free(2, 1000).unwrap();
        assert_eq!(c.mem_query(1).unwrap(), (60, 100));
        c.mem_alloc(2, 30).unwrap();
        c.disconnect(t(0), 1); // a killed process: its 60 bytes are freed
        assert_eq!(c.mem_query(2).unwrap(), (30, 100));
        c.disconnect(t(0), 2);
        assert_eq!(c.mem_used("a"), Some(0));
    }

    #[test]
    fn reload_keeps_stayers_and_errors_leavers() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 40 * MS); // a holds, quota estimate moves to 25 ms
        c.token_request(t(1), 3, 0, 0); // b waits
        let acts = c.set_config(t(2), &[spec("a", 500, 800, 50)]);
        assert!(matches!(
            &acts[..],
            [Action::Error {
                conn: 3,
                code: 1,
                ..
            }]
        ));
        assert_eq!(c.quota_estimate_us("a"), Some(25 * MS));
        assert_eq!(c.holder(), Some("a"));
        assert_eq!(c.mem_query(1).unwrap(), (0, 50));
        // b's connection now gets Error{1} for everything.
        assert_eq!(c.mem_query(3).unwrap_err().code, code::UNKNOWN_CLIENT);
        let acts = c.token_request(t(3), 3, 0, 0);
        assert!(matches!(
            &acts[..],
            [Action::Error {
                conn: 3,
                code: 1,
                ..
            }]
        ));
    }

    /// b used 300 ms just before; a and b then both always want the token, a re-asking every
    /// 10 ms. Ranked by usage alone, a (below b) would keep the token until their usages
    /// cross, 300 ms; with the starvation bound b waits at most the bound plus one hold.
    fn longest_wait_of_b(max_wait: Micros) -> Micros {
        let mut c = two();
        c.set_max_wait(max_wait);
        let acts = c.token_request(t(0), 3, 0, 0);
        assert_eq!(grant(&acts).map(|g| g.0), Some("b"));
        let _ = c.release(t(300), 3, 300 * MS);
        let _ = c.token_request(t(300), 1, 0, 0);
        let _ = c.token_request(t(300), 3, 0, 0);
        let (mut b_since, mut longest, mut now) = (t(300), 0, t(300));
        let mut holder = c.holder().map(str::to_owned);
        while now < t(1300) {
            now += 10 * MS;
            let conn = if holder.as_deref() == Some("a") { 1 } else { 3 };
            let _ = c.token_request(now, conn, 0, 10 * MS);
            holder = c.holder().map(str::to_owned);
            match (holder.as_deref(), conn) {
                (Some("b"), 1) => longest = longest.max(now - b_since), // b's turn came
                (Some("a"), 3) => b_since = now,                        // b lost the token
                _ => {}
            }
        }
        longest
    }

    #[test]
    fn a_waiting_client_is_served_within_the_starvation_bound() {
        let off = longest_wait_of_b(0);
        let on = longest_wait_of_b(50 * MS);
        assert!(
            off >= 250 * MS,
            "without the bound b waited only {} ms",
            off / MS
        );
        assert!(on <= 60 * MS, "b waited {} ms with a 50 ms bound", on / MS);
    }

    #[test]
    fn nothing_is_granted_during_the_quiet_period() {
        let mut c = two();
        c.hold_grants_until(t(200));
        let acts = c.token_request(t(10), 1, 0, 0);
        assert!(grant(&acts).is_none(), "granted during the quiet period");
        assert_eq!(c.next_wakeup(t(10)), Some(t(200)));
        assert!(grant(&c.tick(t(199))).is_none());
        let acts = c.tick(t(200));
        assert_eq!(grant(&acts).map(|g| g.0), Some("a"));
    }

    #[test]
    fn shutdown_errors_every_waiter() {
        let mut c = two();
        c.token_request(t(0), 1, 0, 0);
        c.token_request(t(0), 3, 0, 0);
        let acts = c.shutdown();
        assert!(matches!(
            &acts[..],
            [Action::Error {
                conn: 3,
                code: 5,
                ..
            }]
        ));
    }
}
