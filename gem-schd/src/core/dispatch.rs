//! Who gets the token next and for how long: the ranking (Gemini's `schd_priority`), the
//! starvation bound, the quota estimate, the overrun allowance, the hold cap under contention,
//! and the renewal of a hold (`Core::renew`: the same decision, tried on a copy).

use super::window::{at_rate, stride};
use super::*;

/// The shortest turn worth a hand-over: a fifth of the min quota (a shorter grant would be
/// mostly hand-over).
fn min_turn(min_quota_us: Micros) -> Micros {
    (min_quota_us / 5).max(1)
}

/// A capped client's grant under full contention: the min quota, less its usual drain when
/// the turn is to include it, never below `min_turn`.
pub(super) fn full_turn_grant(min_quota_us: Micros, drain_us: Micros, less_drain: bool) -> Micros {
    let q = min_quota_us.max(1);
    if less_drain {
        q.saturating_sub(drain_us).max(min_turn(q))
    } else {
        q
    }
}

/// Above this many grants in the window a Renew is answered Yield without trying it: the try
/// copies the state, history included, and past a few thousand entries (a 10 s window of
/// sub-millisecond grants, e.g. just after a crowd of short holds) the copy costs more than
/// the hand-over it spares (gem-bench, a lone holder renewing: p50 18 µs with up to 2,000
/// grants in the window, 342 µs with 18,000–20,000).
pub(super) const RENEW_MAX_ENTRIES: usize = 4096;

impl Core {
    /// Renew{burst} on `conn`: the holder's quota ran out, its last work still queued, and it
    /// wants more. The hold goes on (a Grant) exactly when a TokenRequest at this moment,
    /// after a hold ended now, would be granted straight back to it: the same books, the
    /// same rules (limit, pacing, quota), decided by running them on a copy. Otherwise
    /// Yield, and nothing changes: the hold stands until the holder, drained, reports with a
    /// TokenRequest. Only the sole process in the hold. Where others wait, it is renewed only
    /// when none of them would go next (each held back by its limit or pacing, or behind it in
    /// the ranking) and its Grants say whether one will at the renewed hold's end
    /// (`set_told_handover_due`, [`Core::handover_due`]: a hook takes renewals in a row for
    /// keeping the GPU and queues deeper); when one would, the Yield is the
    /// holder's notice that it drains, and the token may go on at once (`handover.rs`). An
    /// opportunistic holder is renewed beside a waiting guaranteed client only while that one
    /// is held back, up to its return (`class.rs`).
    ///
    /// Why: a capped tenant alone is granted min-quota holds back to back (its pacing room is
    /// never larger, ~90 a second at 0.5); each ended with a drain, a round trip and the GPU
    /// idle until the next launches. Renewed, batch-1 inference alone at 0.5 served 5–9 %
    /// more requests on an H100 (ResNet-50 training: no measurable change). The same round
    /// trip, inside the holder's charged time, cost a GPU-bound tenant at 0.7 beside one at 0.3
    /// 0.648 of its native rate on an H200 when a waiting neighbour meant Yield (0.674 renewed).
    pub fn renew(&mut self, now: Micros, conn: ConnId, burst_us: Micros) -> Vec<Action> {
        let key = match self.conn_client(conn) {
            Ok(k) => k,
            Err(r) => return vec![refusal_action(conn, r)],
        };
        self.expire(now);
        if self.co_holds(key, conn) {
            // A co-hold goes on as a new one when the client may still co-run; otherwise it
            // stands until the client, drained, asks with a TokenRequest (and waits for turns).
            if !self.co_ok(now, key) {
                return vec![Action::Yield { conn }];
            }
            self.co_end(now, key, conn, 0);
            return vec![self.co_grant(now, key, conn)];
        }
        let out = self.renew_turn(now, key, conn, burst_us);
        // A Yield to the turn's holder is its notice that it drains.
        if out
            .iter()
            .any(|a| matches!(a, Action::Yield { conn: c } if *c == conn))
        {
            self.note_draining(key, conn);
        }
        out
    }

    /// [`Core::renew`] of a turn (not a co-hold): a Grant renewing it, or Yield.
    fn renew_turn(&mut self, now: Micros, key: Key, conn: ConnId, burst_us: Micros) -> Vec<Action> {
        if self.others_wait_for(key) {
            // Another client goes next: the holder drains now, and the token may go on at
            // once (or that client is told Soon).
            let hand_over = self.hand_over(now, key, conn);
            let told = self.conns.get(&conn).is_some_and(|c| c.told_handover_due);
            if hand_over.is_some() || !told {
                let mut out = hand_over.unwrap_or_default();
                out.push(Action::Yield { conn });
                return out;
            }
        }
        // (A hand-over that did not happen changed nothing.)
        if !self.notice_counts(key, conn) {
            return vec![Action::Yield { conn }];
        }
        let mut trial = self.clone();
        trial.learn_burst(key, burst_us);
        if trial.leave_hold(now, conn, |_| now) {
            trial.asked_again = Some(key);
        }
        trial.enqueue(now, key, conn);
        let mut out = Vec::new();
        trial.dispatch(now, &mut out);
        if matches!(out.as_slice(), [Action::Grant { conns, .. }] if conns == &[conn]) {
            *self = trial;
            // The grant set the flag where another client waits; for a renewal it says more:
            // whether that client goes at the renewed quota's end.
            let flagged = self.holder.as_ref().filter(|h| h.handover_due);
            if let Some(end) = flagged.map(|h| h.quota_end) {
                let due = self.next_at_notice(end, key, conn).is_some();
                if let Some(h) = self.holder.as_mut() {
                    h.handover_due = due;
                }
            }
            out
        } else {
            // Not handed on to a client of a lower class either: a launch-bound guaranteed
            // client beside opportunistic ones was charged 0.438 of its 0.5 that way, 0.486
            // with the token going on at its report
            // (`a_launch_bound_guaranteed_client_keeps_its_request_...` in tests/sim_priority.rs).
            vec![Action::Yield { conn }]
        }
    }

    /// The clients other than `key`, of any class, that wait for the token.
    fn others_waiting(&self, key: Key) -> impl Iterator<Item = Key> + '_ {
        self.clients
            .iter()
            .filter(move |(k, c)| **k != key && !c.waiting.is_empty())
            .map(|(k, _)| *k)
    }

    /// Whether a client other than `key`, of its class or above, waits for the token.
    fn others_wait_for(&self, key: Key) -> bool {
        self.others_waiting(key).any(|k| self.competes_with(key, k))
    }

    /// Whether a client other than `key`, of any class, waits for the token.
    pub(super) fn anyone_else_waits(&self, key: Key) -> bool {
        self.others_waiting(key).next().is_some()
    }

    /// Whether the token is expected to go to another client when `id`'s hold ends: told to
    /// the hook with each Grant (gem-proto `GatePage::handover_due`), which keeps its queue
    /// short toward such a hold's end. For a renewal, whether the client that would go next at
    /// its quota's end, nothing else changing, already waits (so a holder renewed while the
    /// waiting client is held back by its limit, or behind it in the ranking for longer, keeps
    /// its queue deep); for any other grant (a co-hold too), whether any other client waits.
    pub fn handover_due(&self, id: &str) -> bool {
        let Some(&key) = self.ids.get(id) else {
            return false;
        };
        match &self.holder {
            Some(h) if h.client == key => h.handover_due,
            _ => self.anyone_else_waits(key),
        }
    }

    /// `conn`'s Grants say whether a hand-over is due at the hold's end (its gate page): it may
    /// be renewed beside a waiting client. No reply; an unknown connection changes nothing.
    pub fn set_told_handover_due(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.told_handover_due = true;
        }
    }

    /// The shortest quota estimate among the clients other than `key`, of its class or above,
    /// in contention for the token (`None`: no contention).
    pub(super) fn contenders_quota(&self, key: Key, now: Micros) -> Option<Micros> {
        let held = self.recent_holders(now);
        self.clients
            .iter()
            .filter(|(k, c)| {
                **k != key && self.competes_with(key, **k) && self.in_contention(**k, c, &held)
            })
            .map(|(_, c)| c.quota_us)
            .min()
    }

    /// Whether the token waits a moment for the client whose hold just ran out and ended with a
    /// Release, rather than go to `pick`, which is ahead of it in virtual time or of a lower
    /// class (an opportunistic turn there took the guaranteed client's place). That client's
    /// next request is on its way (the hook's idle thread released the hold while the process
    /// was between launches); granting the one client waiting meanwhile gave it a turn it was
    /// not owed at every such hand-over: a capped GPT training loop (0.5/0.5) beside an elastic
    /// decode loop (0.5/1.0) on an H200 was charged 0.36 against 0.63, and two elastic clients
    /// at 0.3/0.7 with 30 ms non-preemptible bursts alternated burst by burst, 0.5/0.5
    /// (`elastic_clients_with_long_bursts_keep_their_requests` in tests/sim_mix.rs).
    pub(super) fn awaits_reask(&self, now: Micros, pick: Key) -> bool {
        let Some(Reask {
            client,
            until,
            ran_out,
        }) = self.reask
        else {
            return false;
        };
        if now >= until || client == pick || self.max_lag_us == 0 {
            return false;
        }
        self.clients
            .get(&client)
            .is_some_and(|released| released.waiting.is_empty())
            && self.goes_before(client, pick, ran_out)
    }

    /// The longest turn `key` may take without running ahead, in virtual time, of a client
    /// that competes for the token (waits for it, or held it in the last 100 ms): what `key`
    /// is behind the furthest-behind of them, at least the min quota. `None`: no one competes.
    ///
    /// Why: a hold ends as often with a Release from the hook's idle thread (its quota ran out
    /// while the process was on the CPU between launches, as a launch-bound framework mostly
    /// is) as with a TokenRequest, and the next request comes a moment later. The token then
    /// went to the one other client waiting, for a whole turn of its own quota estimate, not
    /// by the ranking: an elastic decode loop (0.5/1.0, 21.5 ms turns) beside a capped
    /// training loop (0.5/0.5, 5 ms turns) on an H200 was charged 0.63 against training's
    /// 0.36, ahead by 190 ms of virtual time and still ahead after every turn
    /// (`capped_training_beside_elastic_decode_gets_its_request` in tests/sim_mix.rs: 0.81 /
    /// 0.19 before). Turn lengths that follow virtual time keep any two competing clients
    /// within a min quota of each other, whoever happens to be waiting at a hand-over.
    /// Only with turns by virtual time (`max_lag` > 0); ranked by usage over the window
    /// (Gemini's order) there is no virtual time to keep even.
    pub(super) fn even_turn(&self, key: Key, now: Micros) -> Option<Micros> {
        if self.max_lag_us == 0 {
            return None;
        }
        let floor = self.pass_floor(key, now)?;
        let mine = self.clients.get(&key)?;
        let behind = floor.saturating_sub(mine.pass);
        let mut us = behind * u128::from(mine.spec.request_milli.max(1)) / 1_000_000;
        if self.charge_by_fill {
            // Virtual time counts GPU time: a turn at a lower rate runs that much longer.
            us = us * 1000 / u128::from(mine.hold_rate_milli().max(1));
        }
        Some(
            Micros::try_from(us)
                .unwrap_or(Micros::MAX)
                .max(self.params.min_quota_us),
        )
    }

    /// A decaying maximum (halved at each report), so one long overrun shortens the next few
    /// paced grants, and the allowance comes back once the client stops overrunning.
    pub(super) fn learn_overrun(&mut self, key: Key, overuse_us: Micros) {
        let w = self.params.window_us;
        if let Some(c) = self.clients.get_mut(&key) {
            c.overrun_us = overuse_us.min(w).max(c.overrun_us / 2);
        }
    }

    /// A slow average (an eighth of the way to each report), not the decaying maximum above:
    /// the grant it shortens changes the next drain (the CPU queues ahead in proportion to
    /// the hold), and one short drain (a training step's end, when the CPU waits in its own
    /// sync) pulled a faster estimate down, so the next grant ran long: in the simulation
    /// (`tests/sim_latency.rs`) training's p99 turn was 8.2 ms halfway to each report, 6.0 ms
    /// an eighth of the way, 9.8 ms with the decaying maximum.
    pub(super) fn learn_drain(&mut self, key: Key, overuse_us: Micros) {
        let w = self.params.window_us;
        if let Some(c) = self.clients.get_mut(&key) {
            c.drain_us = (c.drain_us * 7 + overuse_us.min(w)) / 8;
        }
    }

    pub(super) fn learn_burst(&mut self, key: Key, burst_us: Micros) {
        if burst_us == 0 {
            return;
        }
        let w = self.params.window_us;
        if let Some(c) = self.clients.get_mut(&key) {
            // Gemini: q <- 0.5 burst + 0.5 q (clamped when granting).
            c.quota_us = c.quota_us / 2 + burst_us.min(w) / 2;
        }
    }

    pub(super) fn enqueue(&mut self, now: Micros, key: Key, conn: ConnId) {
        if let Some(cs) = self.conns.get_mut(&conn) {
            cs.waiting = true;
        }
        let lag = self.max_lag_us;
        // Back after more than `lag` without the token: it may be no more than `lag`
        // behind the others that compete (a client that has just held it keeps its place:
        // its lead or lag is what the ranking is still evening out).
        let idle = self.clients[&key].waiting.is_empty()
            && self.clients[&key]
                .last_entry
                .and_then(|s| self.entry(s))
                .is_none_or(|e| e.end.saturating_add(lag) <= now);
        // With no one else competing, against the system's virtual time: two clients that come
        // back together after idling (tenants that warmed up, then waited for a common start)
        // otherwise kept the difference of their warm-ups, and on an H100 a training tenant
        // waited 0.78 s while inference caught up with its warm-up.
        let class = class::index(self.clients[&key].spec.class);
        let floor = if idle {
            Some(self.pass_floor(key, now).unwrap_or(self.vtime[class]))
        } else {
            None
        };
        let c = self.clients.get_mut(&key).expect("conn client exists");
        if c.waiting.is_empty() {
            if let Some(f) = floor {
                c.pass = c
                    .pass
                    .max(f.saturating_sub(stride(lag, c.spec.request_milli)));
            }
            c.waiting_since = self.next_wait;
            c.waiting_at = now;
            self.next_wait += 1;
        }
        c.waiting.push(conn);
    }

    /// Takes `key`'s waiting connections, no longer waiting: a grant answers them.
    pub(super) fn take_waiting(&mut self, key: Key) -> Vec<ConnId> {
        let conns = self
            .clients
            .get_mut(&key)
            .map(|c| std::mem::take(&mut c.waiting))
            .unwrap_or_default();
        for conn in &conns {
            if let Some(cs) = self.conns.get_mut(conn) {
                cs.waiting = false;
            }
        }
        conns
    }

    /// Grant the token if it is free and someone eligible waits.
    pub(super) fn dispatch(&mut self, now: Micros, out: &mut Vec<Action>) {
        self.expire(now);
        if now >= self.quiet_until {
            self.serve_co_waiters(now, out);
        }
        if self.holder.is_some() || now < self.quiet_until {
            return;
        }
        self.prune(now);
        // Guaranteed clients first; opportunistic ones when none of those may take a turn.
        for class in class::SERVED_FIRST {
            match self.dispatch_class(now, class) {
                Served::Granted(grant) => {
                    out.push(grant);
                    return;
                }
                Served::Waits => return,
                Served::NoOne => {}
            }
        }
    }

    /// Grants the token to the first client of `class` that may take a turn, if any (or waits
    /// for a released client's next request, `awaits_reask`).
    fn dispatch_class(&mut self, now: Micros, class: ClientClass) -> Served {
        let full = self.fully_contended(class, now);
        // Under full contention the client whose hold just ended at its quota goes again only
        // if it is more than one turn behind: a turn cut short (a training step's end) left it
        // a little behind, and taking the next turn too made a double turn that an inference
        // request waited for (the simulation's p99 turn 10.0 ms without this, 6.0 ms with it).
        let last_holder = self.asked_again.filter(|k| {
            full && self.turn_includes_drain
                && self.class_of(*k) == Some(class)
                && self.history.back().is_some_and(|e| e.client == *k)
        });
        let ranked = self.rank(now, class, full, last_holder);
        for key in &ranked.held_back {
            if let Some(c) = self.clients.get_mut(key) {
                c.blocked = true;
            }
        }
        for (key, pass) in &ranked.back {
            if let Some(c) = self.clients.get_mut(key) {
                c.blocked = false;
                c.pass = *pass;
            }
        }
        let overdue = ranked.starved.is_none() && ranked.overdue.is_some();
        let Some(pick) = ranked.starved.or(ranked.overdue).or(ranked.best) else {
            return Served::NoOne;
        };
        if self.awaits_reask(now, pick.key) {
            return Served::Waits;
        }
        self.reask = None;
        let mut quota = self.grant_quota(now, pick, full, last_holder);
        if overdue {
            // A min-quota turn between two stretches of the catching-up client's.
            quota = quota.min(self.params.min_quota_us).max(1);
            self.overdue_turn[class::index(class)] =
                Some(self.first_seq + self.history.len() as u64);
        }
        // Nor does the turn run past the due time of a client above its request waiting beside
        // it catching up, or of a co-runner under its short bound (`rank`): a 15 ms turn of a
        // capped GPT training tenant, renewed, kept batch-1 decode waiting 21 ms on an H200,
        // and renewed a whole min quota 0.6 ms before decode was due, a capped encoder kept it
        // waiting 17 ms.
        let above = ranked.above_due_in.filter(|_| !overdue);
        let bound = ranked
            .bound_due_in
            .filter(|(waiter, _)| *waiter != pick.key)
            .map(|(_, due)| due);
        if ranked.starved.is_none()
            && let Some(due) = above.into_iter().chain(bound).min()
        {
            quota = quota.min(due.max(self.min_turn_us())).max(1);
        }
        Served::Granted(self.grant(now, pick.key, quota))
    }

    /// `min_turn` of this core's min quota: a turn that would end within it of a waiting
    /// client's due time ends at that time instead, and a client due within it goes now.
    fn min_turn_us(&self) -> Micros {
        min_turn(self.params.min_quota_us)
    }

    /// Whether `key` may take a turn now, and with how much room: its headroom under its limit
    /// over the window and under its pacing allowance (less its usual overrun), and its usage.
    /// `None`: held back by its limit or pacing. Under full contention of its class (`full`)
    /// neither is checked.
    pub(super) fn turn_room(
        &self,
        key: Key,
        c: &ClientState,
        now: Micros,
        full: bool,
    ) -> Option<TurnRoom> {
        let w_eff = u128::from(self.w_eff(now));
        // GPU time (turns credited what co-runners took of them) against the declared limit.
        let usage = u128::from(self.usage(key, now));
        let allowed_milli = u128::from(c.spec.limit_milli) * w_eff;
        // Under full contention the window's limit is not checked either, for the reason
        // pacing is not (`fully_contended`): on an H100 a (0.5, 0.5) training tenant whose
        // window still held its warm-up sat at its 10 s limit, each of its turns waiting for
        // an old hold to leave the window (the inference tenant's turns likewise, up to
        // 0.3 s), while their shares were already even.
        if usage * 1000 >= allowed_milli && !full {
            return None; // at its limit: waits
        }
        let headroom = (allowed_milli.saturating_sub(usage * 1000).div_ceil(1000)) as u64;
        // Pacing: wait until at least a min-quota grant fits the allowance.
        let mut pace_room = Micros::MAX;
        for rule in self.pace_rules(key, c, now) {
            let room = self.pace_headroom(key, now, rule);
            if room < self.pace_need(c, rule) {
                return None;
            }
            // Under the exact rule the grant leaves room for the client's usual overrun.
            let overrun = if rule.exact { c.overrun_us } else { 0 };
            pace_room = pace_room.min(room.saturating_sub(overrun));
        }
        Some(TurnRoom {
            usage,
            headroom,
            pace_room,
        })
    }

    /// Who of `class` may have the token now and in what order: every client of the class
    /// waiting for a turn, checked against its limit and pacing allowance and ranked (below its
    /// request by virtual time, above it by usage), and the one past the starvation bound.
    fn rank(
        &self,
        now: Micros,
        class: ClientClass,
        full: bool,
        last_holder: Option<Key>,
    ) -> Ranked {
        let w_eff = u128::from(self.w_eff(now));
        let mut best: Option<(Pick, Rank)> = None;
        // The eligible client below its request waiting longest past the starvation bound.
        // Only guarantees are bounded: spare time above the request follows usage alone
        // (a FIFO bound there hands spare time out per turn, so the client with the longer
        // bursts took 0.80 of an elastic pair instead of 0.50).
        let mut starved: Option<(Pick, Micros)> = None;
        // The eligible client above its request waiting longest, and the requests of those
        // below their own (`above_due_in`).
        let mut above: Option<(Pick, Micros)> = None;
        let mut below_requests = 0;
        // The co-runner repaying its lead (under its short bound) due soonest, and when.
        let mut bound_due_in: Option<(Key, Micros)> = None;
        // Clients held back now, and clients eligible again after being held back.
        let (mut held_back, mut back) = (Vec::new(), Vec::new());
        for (&key, c) in &self.clients {
            // A light client waits for a co-hold, not a turn: its turn, charged wall time,
            // filled the pacing window that its next co-hold needed room in, so it waited,
            // and under full contention (no checks on turns) it was granted a turn again, and
            // so on (on an H200 batch-1 inference beside training took 542 turns against 717
            // co-holds in one run, p99 3.4× native).
            if c.spec.class != class || !self.waits_for_turn(key, c) {
                continue;
            }
            // Nor does a capped client take a turn beside another's co-hold (`capped.rs`). That
            // is not its own limit or pacing holding it back: it keeps its place in virtual
            // time (a client held back comes back no further behind than the lag).
            if self.capped_co_hold_until(key, now).is_some() {
                continue;
            }
            let Some(TurnRoom {
                usage,
                headroom,
                pace_room,
            }) = self.turn_room(key, c, now, full)
            else {
                held_back.push(key);
                continue;
            };
            let require_milli = u128::from(c.spec.request_milli) * w_eff;
            // A client held back by its limit or pacing did not fall behind by choice: like
            // one back from idle, it is at most the lag behind the others. (Otherwise it
            // catches up in a run of turns, uses its allowance early in the next pacing
            // window, and is held back again at the same phase: a 0.28 s wait of a batch-1
            // inference tenant beside training recurred every second on an H100.)
            let mut pass = c.pass;
            let mut rank_pass = c.pass;
            if last_holder == Some(key) {
                rank_pass = rank_pass.saturating_add(stride(
                    full_turn_grant(self.full_turn(key, now), c.drain_us, false),
                    c.spec.request_milli,
                ));
            }
            if c.blocked {
                if let Some(f) = self.pass_floor(key, now) {
                    pass =
                        pass.max(f.saturating_sub(stride(self.max_lag_us, c.spec.request_milli)));
                }
                back.push((key, pass));
            }
            // Under full contention there is no spare time to rank by usage: every client is
            // ranked by virtual time (one at its request over the window, ranked after the
            // others by usage, otherwise waited ~2 s at a time while a window that still held
            // an earlier block of its own slid by: the blocks then recurred every 10 s).
            let rank = if full || usage * 1000 < require_milli {
                if self.max_lag_us > 0 {
                    // Below its request: the smaller virtual time goes first.
                    Rank::Below {
                        usage: rank_pass.max(pass),
                        require: 1,
                        order: c.waiting_since,
                    }
                } else {
                    // The smaller usage/require goes first (the larger
                    // missing/(missing+usage) in Gemini's words).
                    Rank::Below {
                        usage,
                        require: require_milli,
                        order: c.waiting_since,
                    }
                }
            } else {
                Rank::Above {
                    usage,
                    order: c.waiting_since,
                }
            };
            let pick = Pick {
                key,
                headroom,
                pace_room,
            };
            if best.as_ref().is_none_or(|(_, r)| rank.before(r)) {
                best = Some((pick, rank));
            }
            let below = matches!(rank, Rank::Below { .. });
            if below {
                below_requests += u64::from(c.spec.request_milli);
            } else if above.as_ref().is_none_or(|(_, at)| c.waiting_at < *at) {
                above = Some((pick, c.waiting_at));
            }
            let waited = now.saturating_sub(c.waiting_at);
            // Scaled by the client's request: at share s, proportional turns make it wait
            // (1 − s)/s of the others' hold, so the bound is the same fraction of `max_wait`
            // (50 ms at 0.5, 117 ms at 0.3, 21 ms at 0.7) and does not shift shares toward an
            // even split.
            let share = u64::from(c.spec.request_milli).clamp(1, 1000);
            let bound = self.max_wait_us.saturating_mul(1000 - share) / share;
            // Not under full contention: virtual time alone then gives proportional turns, and
            // the bound (first come, first served past it) gave a training tenant with 100 ms
            // non-preemptible steps a turn after every 50 ms wait, 0.64–0.69 of the GPU
            // beside a 0.5 inference tenant (`inference_beside_training_...` in tests/sim_pacing.rs).
            // A client back from co-holds is ahead of its competitors by what it ran beside
            // their turns, charged its fill. They catch up, but not in one run of turns: it
            // goes first after two min quotas of waiting, until a turn of its own finds it
            // within the lag of them (`grant`). (In one run, batch-1 decode whose co-holds
            // filled 0.68 at a request of 0.5 waited 110 ms for a turn beside a capped encoder
            // on an H200; let off its lead instead, the encoder lost 3.5 pp of its request in
            // `corun.rs`'s unit test.) Judged at every dispatch instead, the lead came within
            // the lag while the client waited (the others' turns and drains charged), and it
            // waited on through the rest of their catching-up: up to 18 ms beside a renewing
            // holder that drains 5 ms, 12 ms so (`corun.rs`'s unit tests). This holds whether
            // or not the class is fully contended: for a window after a capped encoder co-held
            // (`fully_contended`), decode back from co-holds 159 ms ahead waited 57 ms under
            // the starvation bound on an H200.
            let (mut bound, mut bounded) = (bound, !full);
            if c.co.repaying || (c.co.co_mode && self.ahead_past_lag(key, c, pass, now)) {
                // Due within the shortest turn worth a hand-over, it goes now.
                bound = (2 * self.params.min_quota_us).saturating_sub(self.min_turn_us());
                bounded = true;
                let due = bound.saturating_sub(waited);
                if below && due > 0 && bound_due_in.is_none_or(|(_, d)| due < d) {
                    bound_due_in = Some((key, due));
                }
            }
            if below
                && bounded
                && self.max_wait_us > 0
                && waited >= bound
                && starved.as_ref().is_none_or(|(_, at)| c.waiting_at < *at)
            {
                starved = Some((pick, c.waiting_at));
            }
        }
        let (overdue, above_due_in) = match (best, above) {
            (Some((_, Rank::Below { .. })), Some((a, since))) => {
                // Due within the shortest turn worth a hand-over, it goes now.
                match self.above_due_in(now, class, below_requests, since) {
                    Some(due) if due < self.min_turn_us() => (Some(a), None),
                    due => (None, due),
                }
            }
            _ => (None, None),
        };
        Ranked {
            best: best.map(|(p, _)| p),
            starved: starved.map(|(p, _)| p),
            overdue,
            above_due_in,
            bound_due_in,
            held_back,
            back,
        }
    }

    /// The length of `pick`'s turn: its quota estimate, within its limit's headroom and
    /// pacing allowance, the hold cap, what keeps it even with its competitors in virtual
    /// time, and under full contention a capped client's turn (the min quota, or a long one:
    /// `long_turn.rs`).
    fn grant_quota(&self, now: Micros, pick: Pick, full: bool, last_holder: Option<Key>) -> Micros {
        let Pick {
            key,
            headroom,
            pace_room,
        } = pick;
        let p = self.params;
        // Picked ahead of the last holder although that one is behind (by less than a turn):
        // this turn is shorter by the lead, which evens them out without back-to-back turns.
        let lead_us = match last_holder {
            Some(last) if last != key => match (self.clients.get(&key), self.clients.get(&last)) {
                (Some(mine), Some(theirs)) => {
                    let lead = mine.pass.saturating_sub(theirs.pass);
                    Micros::try_from(lead * u128::from(mine.spec.request_milli.max(1)) / 1_000_000)
                        .unwrap_or(Micros::MAX)
                }
                _ => 0,
            },
            _ => 0,
        };
        // A turn need not be shorter than the contenders' own (two tenants with 34 ms
        // bursts keep 34 ms turns: cutting them only turns each burst into an overrun).
        let hold_cap = match self.max_hold_us {
            0 => None,
            m => self
                .contenders_quota(key, now)
                .map(|q| m.saturating_sub(self.clients[&key].overrun_us).max(q)),
        };
        let even_turn = self.even_turn(key, now);
        let window = u128::from(self.params.window_us);
        let c = &self.clients[&key];
        // Under full contention a capped client's turn is the min quota or a long one.
        let turn = if full && c.spec.limit_milli < 1000 {
            self.full_turn(key, now)
        } else {
            p.min_quota_us
        };
        let cap = (u128::from(c.boosted_limit_milli()) * window / 1000) as u64;
        let mut quota = c.quota_us.max(turn).min(cap.max(1));
        // Do not hand out much more than the limit allows in this window (under full
        // contention the limit is not checked: the turns by virtual time hold it).
        quota = quota.min(headroom.max(turn)).max(1);
        // Nor more than the pacing allowance (the min quota, or the long turn, is the slack:
        // a burst is never cut below it; nor is a turn by the caps below).
        quota = quota.min(pace_room.max(turn)).max(1);
        if let Some(cap) = hold_cap {
            quota = quota.min(cap.max(turn)).max(1);
        }
        if let Some(even) = even_turn {
            quota = quota.min(even.max(turn)).max(1);
        }
        // An opportunistic turn ends when a guaranteed client held back now may go again.
        if let Some(turn) = self.leftover_turn(key, now) {
            quota = quota.min(turn).max(1);
        }
        // Unpaced under full contention, a capped client takes min-quota turns, as it did
        // when its pacing allowance cut every grant to the min quota: a turn of its usual
        // quota (the base 50 ms for a hook that never goes idle, which reports the quota as
        // its burst) left the other tenants 50 ms and more without the GPU, and made its
        // share over a second swing by a whole turn (0.15–0.22 for a 0.2 tenant on an H100).
        if full && c.spec.limit_milli < 1000 {
            quota = quota.min(full_turn_grant(
                turn,
                c.drain_us.saturating_add(lead_us),
                self.turn_includes_drain,
            ));
        }
        quota
    }

    /// Whether `key` (`c`), at virtual time `pass`, is more than the lag (`set_max_lag`) ahead
    /// of the others in contention of its class.
    fn ahead_past_lag(&self, key: Key, c: &ClientState, pass: u128, now: Micros) -> bool {
        let lag = stride(self.max_lag_us, c.spec.request_milli);
        self.pass_floor(key, now)
            .is_some_and(|f| pass > f.saturating_add(lag))
    }

    /// Grants `key` the token for `quota`: its history entry, virtual time and hold.
    fn grant(&mut self, now: Micros, key: Key, quota: Micros) -> Action {
        let seq = self.first_seq + self.history.len() as u64;
        // Only a repaying client's lead is looked at (a walk of the clients and the recent
        // history), not every turn's.
        let repaid = self.clients.get(&key).is_some_and(|c| {
            c.co.repaying && !c.co.co_mode && !self.ahead_past_lag(key, c, c.pass, now)
        });
        let c = self.clients.get_mut(&key).expect("picked from clients");
        c.last_entry = Some(seq);
        // A turn: whether it co-runs again is judged on its turns' fill, from this turn on
        // if it co-ran until now (`Fills::left_co`). A
        // co-runner at its limit is not sent here: it waits and is served a co-hold when
        // below it again (`serve_co_waiters`). Back from co-holds it repays its lead with a
        // bounded wait (`rank`) until a turn of its own finds it within the lag.
        if std::mem::replace(&mut c.co.co_mode, false) {
            c.fill.left_co();
            c.co.repaying = true;
        } else if repaid {
            c.co.repaying = false;
        }
        let client = c.spec.id.clone();
        let conns = self.take_waiting(key);
        for conn in &conns {
            if let Some(cs) = self.conns.get_mut(conn) {
                cs.turn = Some(seq);
            }
        }
        let quota_end = now + quota;
        let rate_milli = if self.charge_by_fill {
            self.clients[&key].hold_rate_milli()
        } else {
            1000
        };
        self.history.push_back(Entry {
            client: key,
            start: now,
            end: quota_end,
            grant: now,
            quota_end,
            rate_milli,
        });
        let c = self.clients.get_mut(&key).expect("picked");
        let vtime = &mut self.vtime[class::index(c.spec.class)];
        *vtime = (*vtime).max(c.pass);
        c.usage_sum += quota;
        c.pass += stride(at_rate(quota, rate_milli), c.spec.request_milli);
        let handover_due = self.anyone_else_waits(key);
        self.holder = Some(Hold {
            client: key,
            conns: conns.clone(),
            quota_end,
            seq,
            left_end: 0,
            handover_due,
            draining: false,
        });
        self.grants += 1;
        if self.charge_by_fill {
            self.refresh_boost(now);
        }
        Action::Grant {
            client,
            conns,
            quota_us: quota,
        }
    }
}

/// What `Core::dispatch_class` did.
enum Served {
    Granted(Action),
    /// The token waits for a released client's next request (`Core::awaits_reask`).
    Waits,
    /// No client of the class may take a turn now.
    NoOne,
}

/// A client's room for a turn now (`Core::turn_room`).
pub(super) struct TurnRoom {
    /// Its usage over the window (GPU time).
    usage: u128,
    /// What its limit leaves of the window.
    headroom: u64,
    /// What its pacing allows (`Micros::MAX`: not paced).
    pace_room: u64,
}

/// A client that may have the token, with its headroom under its limit and pacing allowance.
#[derive(Debug, Clone, Copy)]
struct Pick {
    key: Key,
    headroom: u64,
    pace_room: u64,
}

/// What the ranking found (`Core::rank`).
struct Ranked {
    /// First by the ranking.
    best: Option<Pick>,
    /// Waiting longest past the starvation bound (goes before `best`).
    starved: Option<Pick>,
    /// Above its request and waiting past the bound beside `best` catching up
    /// (`Core::above_due_in`; goes before `best`, after `starved`).
    overdue: Option<Pick>,
    /// Otherwise, how long until that client goes before `best` (`best`'s turn ends then).
    above_due_in: Option<Micros>,
    /// A co-runner under its short bound, and how long until it is past it (another client's
    /// turn ends then).
    bound_due_in: Option<(Key, Micros)>,
    /// Held back by their limit or pacing now.
    held_back: Vec<Key>,
    /// Eligible again after being held back, with their floored virtual time.
    back: Vec<(Key, u128)>,
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
