//! Co-running: a light client launches beside the token holder instead of waiting for turns.
//!
//! Exclusive turns cost a launch-bound tenant its speed: batch-1 inference at 0.5 beside
//! training got 0.28–0.42 of its native rate on an H100, its kernels filling a third of its
//! turns, and two such tenants in turns left the GPU 20–27 % busy on an H100.
//! A client whose fill (its kernels' share of its holds, from the hook's Busy reports) is
//! below `--co-run-below` is granted at once, whoever holds the token: a co-hold, not a hold
//! (no history entry, the holder keeps its turn), and the GPU time-slices the two contexts.
//! The hook needs nothing new: a co-hold is answered with a Grant like any other.
//!
//! Accounting: a capped client (limit below 1) in wall time, an uncapped one in GPU time
//! (`ClientState::charged_in_wall_time`). The fills are sampled by the hook (one launch in
//! ~256 timed with an event pair), and beside another context an event pair also times the
//! other context's slices: on an H200 a GPT training loop capped at 0.5 beside co-running decode
//! was charged 0.078 for 0.404 of GPU time, and a tenant of 25 ms matmuls capped at 0.5 beside
//! co-running attention ran past its limit (the holder's credit too large). A client's GPU time
//! never exceeds the wall time it holds the token or a co-hold, so a capped client is charged
//! that: its co-hold its wall length (up to its last grant's quota plus the grace), no co-hold
//! is granted while it holds a turn (one opened before its turn may still run), and its turns
//! count whole (no credit for what co-runners took of them, no boost). Its limit then holds by
//! construction, whatever the fills read. A light client that asks while a capped client holds
//! a turn waits and is served a co-hold at the event that ends that turn (every end of a hold
//! dispatches); it is never a turn candidate.
//!
//! An uncapped client has no limit to break, and its charge only ranks it: a co-hold is
//! charged what its kernels used of it (its wall time × its fill), and as a holder its turns
//! are charged only what the co-runners leave of them: the window's check counts them less
//! what the co-runners took of them (`co_area.rs`, the integral of their fills), which is
//! what the usage report delivers, so the check and the report agree, and so does pacing,
//! which counts a turn granted now at `1 − f` of its length, `f` the fills of the co-runners
//! open now together (the boost `1 / (1 − f)`, at most 3×, sizes its turns; its request, the
//! guarantee to others, is unchanged).
//!
//! Either way a co-hold's charge counts in its client's usage, pacing and virtual time like a
//! turn's (its open co-hold's so far), and a co-runner over its limit (in the window or the
//! pacing window) waits until it is below it again, for a co-hold: a light client never takes
//! a turn (`dispatch` passes it over). What each then gets of its native *rate* is the GPU's
//! business (training lost 29 % of its rate beside co-running inference on an H100 while its
//! own kernels' events said 8 %: its kernels ran slower) (docs/gem-schd.md, "Co-running").

use super::engine::CoEngine;
use super::window::stride;
use super::*;

/// Co-running settings (`Core::set_co_run`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CoRunSettings {
    /// A client whose fill is below this co-runs (0 = off).
    pub below: f64,
    /// A co-hold's length: the co-runner reports (and is charged) this often.
    pub quota_us: Micros,
}

impl Default for CoRunSettings {
    fn default() -> Self {
        CoRunSettings {
            below: 0.0,
            quota_us: 20_000,
        }
    }
}

/// The largest boost, in thousandths.
const MAX_BOOST_MILLI: u32 = 3000;

/// An open co-hold. Its processes may launch until its latest grant's quota ends and drain
/// for the grace after it: its wall length runs from its start to there (`Core::co_charge`). A
/// process that joins after that starts a new stretch, the one before it charged as an ended
/// co-hold.
#[derive(Debug, Clone)]
pub(super) struct CoHold {
    /// Its connections that have not reported its end.
    conns: Vec<ConnId>,
    /// The start of its current stretch.
    start: Micros,
    /// Its latest grant (a connection joining it, a renewal).
    last_grant: Micros,
    /// The furthest past its quota a process of it reported its work ran (its drain).
    ran_past_quota: Micros,
    /// The engine time its reports said it held (`engine.rs`).
    pub(super) engine: CoEngine,
}

impl CoHold {
    /// How far its processes may have run: its last grant's `quota`, then the `grace` or the
    /// drain they reported past it, whichever is longer.
    pub(super) fn ran_to(&self, quota: Micros, grace: Micros) -> Micros {
        let past = grace.max(self.ran_past_quota);
        self.last_grant.saturating_add(quota.saturating_add(past))
    }
}

/// A client's co-running state.
#[derive(Debug, Clone, Default)]
pub(super) struct CoState {
    /// The open co-hold.
    pub(super) hold: Option<CoHold>,
    /// (end, charge) of its ended co-holds, oldest first, within the window.
    charges: VecDeque<(Micros, Micros)>,
    /// How much its limit is raised while co-runners run, in thousandths (≤ 1000: not).
    boost_milli: u32,
    /// Its last grant was a co-hold: it goes on co-running while its co-holds' fill is below
    /// the threshold; after a turn it starts again only if its turns' fill is (`fill.rs`).
    pub(super) co_mode: bool,
    /// Back in turns from co-holds and maybe ahead of its competitors in virtual time: it waits
    /// a bounded time for a turn (`Core::rank`) until a turn of its own finds it within the
    /// lag of them (`Core::grant`).
    pub(super) repaying: bool,
    /// Capped: engine time reported and not yet charged (`engine.rs`).
    pub(super) engine_owed_us: Micros,
}

impl CoState {
    /// A new account (`Core::forget_usage`): its ended co-holds' charges stay with the old one
    /// (its open co-hold, like its running hold, stays charged).
    pub(super) fn forget_charges(&mut self) {
        self.charges.clear();
        self.engine_owed_us = 0;
    }
}

impl ClientState {
    /// Whether co-running is charged to this client in wall time: a capped client (limit below
    /// 1). Its co-holds are charged their wall length, no co-hold is granted while it holds a
    /// turn, and its turns are neither credited what co-runners took of them nor sized up by
    /// the boost; so its GPU time, never more than the wall time it holds the token or a
    /// co-hold, stays within its limit whatever the sampled fills read; and while it co-runs,
    /// its class is not fully contended (`fully_contended`). An uncapped client keeps the
    /// GPU-time charges (they only rank it). The one place these rules are decided.
    pub(super) fn charged_in_wall_time(&self) -> bool {
        self.spec.limit_milli < 1000
    }

    /// See [`Core::judged_fill`].
    pub(super) fn judged_fill(&self) -> Option<f64> {
        if self.co.co_mode {
            self.fill.co()
        } else {
            self.fill.start_fill()
        }
    }

    /// The limit in force over its turns' token time, for the size of its turns: the
    /// declared one, raised by the co-running boost (pacing counts GPU time against the
    /// declared one, `hold_rate_milli`).
    pub(super) fn boosted_limit_milli(&self) -> u16 {
        let boost = u64::from(self.co.boost_milli.max(1000));
        (u64::from(self.spec.limit_milli) * boost / 1000).min(1000) as u16
    }

    /// The GPU time a µs of a turn granted now counts for, in thousandths: what the
    /// co-runners open now leave of it (`1 / boost`).
    pub(super) fn hold_rate_milli(&self) -> u32 {
        1_000_000 / self.co.boost_milli.max(1000)
    }
}

impl Core {
    /// Turns co-running on (`below` > 0) or off.
    pub fn set_co_run(&mut self, s: CoRunSettings) {
        self.co_run = s;
    }

    /// Charges a turn its client's kernel time (the turn's length × the client's fill of its
    /// turns, at least a third of it) instead of its length, in the window's check, pacing
    /// and virtual time alike. A launch-bound tenant's turns are then longer for the same
    /// GPU time: its request and limit are GPU time, not token time. Off by default.
    pub fn set_charge_by_fill(&mut self, on: bool, now: Micros) {
        self.charge_by_fill = on;
        self.refresh_boost(now);
    }

    /// Whether `conn` of `key` is in its client's co-hold.
    pub(super) fn co_holds(&self, key: Key, conn: ConnId) -> bool {
        self.clients
            .get(&key)
            .and_then(|c| c.co.hold.as_ref())
            .is_some_and(|h| h.conns.contains(&conn))
    }

    /// Whether connection `conn` is in a co-hold now (its last grant was one).
    pub fn in_co_hold(&self, conn: ConnId) -> bool {
        self.conns
            .get(&conn)
            .and_then(|cs| cs.client)
            .is_some_and(|k| self.co_holds(k, conn))
    }

    /// Whether `id` is back in turns from co-holds and repaying its lead with a bounded wait
    /// (`CoState::repaying`): in gem-schd's debug line of a request that waits.
    pub fn repaying(&self, id: &str) -> Option<bool> {
        self.ids.get(id).map(|k| self.clients[k].co.repaying)
    }

    /// Whether `id` is in a co-hold now.
    pub fn co_running(&self, id: &str) -> bool {
        self.ids
            .get(id)
            .is_some_and(|k| self.clients[k].co.hold.is_some())
    }

    /// Whether another client's kernels may run on the GPU during `id`'s hold as granted now:
    /// it is a co-hold, or co-running is on and the hold is an uncapped client's turn (co-holds
    /// start beside it) or a co-hold is open (it runs on into the turn; none starts inside a
    /// capped one). Told to the hook with the Grant (gem-proto `GatePage::shared`): a hook
    /// parks a hold's queue only where nothing else runs, its test of where the GPU stopped
    /// being a matter of microseconds that another context's time slices would stretch.
    pub fn hold_shared(&self, id: &str) -> bool {
        let Some(c) = self.ids.get(id).and_then(|k| self.clients.get(k)) else {
            return false;
        };
        c.co.hold.is_some()
            || (self.co_run.below > 0.0
                && (!c.charged_in_wall_time()
                    || self.clients.values().any(|o| o.co.hold.is_some())))
    }

    /// The part of `id`'s usage in the window ending at `now` charged for co-holds.
    pub fn co_usage_us(&self, now: Micros, id: &str) -> Option<Micros> {
        let key = *self.ids.get(id)?;
        Some(self.co_charged_since(key, now.saturating_sub(self.params.window_us), now))
    }

    /// `id`'s limit in force over its turns' token time, in thousandths: the declared one,
    /// raised by its boost (a capped client's by its own idle part alone, charged by fill).
    pub fn limit_in_force(&self, id: &str) -> Option<u16> {
        self.ids
            .get(id)
            .map(|k| self.clients[k].boosted_limit_milli())
    }

    /// Whether `key` co-runs rather than takes turns: co-running on, its fill as judged
    /// (`judged_fill`) below the threshold, and, if it is capped, an uncapped client connected
    /// to co-run beside (`capped.rs`). A light client waits for co-holds only
    /// (`serve_co_waiters`), never for a turn (`dispatch` passes it over).
    pub(super) fn light(&self, key: Key) -> bool {
        let below = self.co_run.below;
        below > 0.0
            && self.clients.get(&key).is_some_and(|c| {
                c.spec.limit_milli > 0
                    && c.judged_fill().is_some_and(|f| f < below)
                    && (!c.charged_in_wall_time() || self.uncapped_connected())
            })
    }

    /// The fill that decides whether `id` co-runs: of its co-holds while it co-runs, else of its
    /// turns, judged on enough of them (those since it was last sent from co-holds to turns, if
    /// it was: `fill.rs`); `None` before that. [`Core::fill`] reports all its turns'.
    pub fn judged_fill(&self, id: &str) -> Option<f64> {
        self.ids
            .get(id)
            .and_then(|k| self.clients.get(k))
            .and_then(ClientState::judged_fill)
    }

    /// Whether `key` is in a co-hold or was charged for one that ended after `from`.
    pub(super) fn co_ran_since(&self, key: Key, from: Micros, now: Micros) -> bool {
        self.co_charges_after(key, from, now).next().is_some()
    }

    /// What the client's co-holds ended after `from` were charged, and its open one so far.
    pub(super) fn co_charged_since(&self, key: Key, from: Micros, now: Micros) -> Micros {
        self.co_charges_after(key, from, now)
            .map(|(_, ch)| ch)
            .sum()
    }

    /// (end, charge) of the client's co-holds whose time ran to after `from`, oldest first, its
    /// open one's so far among them. The open one counts: a co-hold stays open while any of its
    /// client's processes is in it, and one process joining it as another leaves kept it open
    /// for as long as they took turns, its time counted nowhere until it ended.
    pub(super) fn co_charges_after(
        &self,
        key: Key,
        from: Micros,
        now: Micros,
    ) -> impl Iterator<Item = (Micros, Micros)> + '_ {
        let c = self.clients.get(&key);
        let open = c.and_then(|c| Some(self.co_charge(c, c.co.hold.as_ref()?, now)));
        c.into_iter()
            .flat_map(|c| c.co.charges.iter().copied())
            .chain(open)
            .filter(move |(end, _)| *end > from)
    }

    /// (end, charge) of `c`'s co-hold `h` if it ends at `now`: its processes ran to `now` or to
    /// its last grant's quota plus the grace or the drain they reported past it, whichever is
    /// first (the hook stops launching at the quota's end and drains), and it is charged its
    /// wall length to there, for a client charged in wall time, else that × its co-holds'
    /// fill (capped: at most that, by the engine time it held, `engine.rs`). Its charge is a
    /// piece ending there: it slides out of a window no earlier than its time did (an open
    /// co-hold counted as ending at `now` never left the short pacing window, and its client
    /// waited for good).
    pub(super) fn co_charge(&self, c: &ClientState, h: &CoHold, now: Micros) -> (Micros, Micros) {
        let end = now.min(h.ran_to(self.co_run.quota_us, self.params.grace_us));
        let charge = stretch_charge(c.charged_in_wall_time(), c.fill.co(), h, h.start, end);
        (end, charge)
    }

    /// Whether `key` waits for a turn: it has requests waiting and is not light (a light client
    /// waits for co-holds only: it is neither a candidate for a turn nor counts toward full
    /// contention).
    pub(super) fn waits_for_turn(&self, key: Key, c: &ClientState) -> bool {
        !c.waiting.is_empty() && !self.light(key)
    }

    /// Whether a capped client holds a turn (`ClientState::charged_in_wall_time`): no co-hold
    /// is granted beside it, so what it is charged (its turns' whole length) bounds its GPU
    /// time. A light client that asks meanwhile waits and is served at the event that ends the
    /// turn (`serve_co_waiters`, at every dispatch).
    pub(super) fn capped_turn(&self) -> bool {
        self.holder
            .as_ref()
            .and_then(|h| self.clients.get(&h.client))
            .is_some_and(ClientState::charged_in_wall_time)
    }

    /// Whether a TokenRequest of `key` at `now` is answered with a co-hold: co-running on, the
    /// client light and not the holder, no capped client holding a turn, if it is capped no
    /// other capped client co-holding or waiting ahead of it (`capped.rs`), and its usage
    /// (turns and co-holds) below its limit over the window and the pacing window.
    pub(super) fn co_ok(&self, now: Micros, key: Key) -> bool {
        // A process of the holder waits for (or joins) its client's hold; an opportunistic
        // client does not co-run beside a guaranteed one (`class.rs`), nor anyone beside a
        // capped holder.
        if !self.light(key)
            || self.holder.as_ref().is_some_and(|h| h.client == key)
            || self.capped_turn()
            || self.co_waits_for_guaranteed(key)
            || self.capped_co_hold_until(key, now).is_some()
            || self.capped_waits_ahead(key, now)
        {
            return false;
        }
        let c = &self.clients[&key];
        let lim = u128::from(c.spec.limit_milli);
        // Over the window so far, as a turn is checked: against the whole window a co-runner
        // took up to its limit × 10 s in gem-schd's first seconds (through the fake driver a
        // tenant at 0.3 was charged 0.93 s in its first 2.4 s, and 0.327 of the window that
        // followed). Below its limit, as a turn must be (not with the next co-hold's charge on
        // top: in the band between, a turn would be granted, charged its wall time, and keep
        // the window full; through the fake driver a launch-bound tenant took 600 turns against
        // 50 co-holds that way). A co-hold's charge (its fill of the quota) may pass the limit
        // as a turn's last quota may.
        if !self.below_limit_over_window(key, c, now) {
            return false;
        }
        let p = self.pace_window();
        if p == 0 || lim >= 1000 {
            return true;
        }
        let from = now.saturating_sub(p);
        // Its turns and co-holds in the pacing window in GPU time, as a turn's pacing counts
        // them. A light client that finds the window full (of a turn it took before it was
        // light) waits and is served a co-hold once there is room (`serve_co_waiters`); it is
        // never given a turn meanwhile.
        let in_pace: Micros = self
            .own_since(key, from, now)
            .iter()
            .map(|(s, e)| e - s)
            .sum();
        u128::from(in_pace) * 1000 < lim * u128::from(p)
    }

    /// When a light waiting client passes `co_ok`'s checks, if nothing else happens: its
    /// usage below its limit over the window so far and over the pacing window. (A turn's
    /// wake-up waits for room for a min quota and the client's overrun, later than a co-hold
    /// needs: a paced co-runner woke late unless another client's request dispatched.) An
    /// opportunistic client kept out by a guaranteed one, any light client kept out by a
    /// capped holder and a capped one by a capped client waiting ahead of it have no time of
    /// their own: each is served at the event that ends that hold or grants that client. One
    /// kept out by another capped client's co-hold is served at that co-hold's end, or when its
    /// time is up if its processes never report it.
    pub(super) fn co_ready_at(&self, key: Key, now: Micros) -> Option<Micros> {
        if self.co_waits_for_guaranteed(key)
            || self.capped_turn()
            || self.capped_waits_ahead(key, now)
        {
            return None;
        }
        let c = self.clients.get(&key)?;
        let lim = u128::from(c.spec.limit_milli);
        let w = self.window_ready_at(key, now, false)?;
        let w = w.max(self.capped_co_hold_until(key, now).unwrap_or(w));
        let p = self.pace_window();
        if p == 0 || lim >= 1000 {
            return Some(w);
        }
        // Below `limit × p`: at most the µs under it, with no hold to fit.
        let below = (lim * u128::from(p)).div_ceil(1000) as Micros;
        let rule = PaceRule {
            window: p,
            budget: below.checked_sub(1)?,
            exact: true,
            rate_milli: 1000,
        };
        Some(w.max(self.pace_ready_at(key, now, rule, 0)?))
    }

    /// Waiting clients that may co-run now (light and below their limit again: the window
    /// slid, a fill changed) get co-holds instead of waiting on for a turn, which would charge
    /// them its wall time and keep their window full: through the fake driver a launch-bound
    /// tenant that once reached its limit took turns from then on (600 turns against 50
    /// co-holds). One at a time, the client behind in virtual time first: a co-hold granted
    /// may keep the next out (`capped.rs`).
    pub(super) fn serve_co_waiters(&mut self, now: Micros, out: &mut Vec<Action>) {
        if self.co_run.below <= 0.0 {
            return;
        }
        let mut waiting: Vec<(u128, Key)> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.waiting.is_empty())
            .map(|(k, c)| (c.pass, *k))
            .collect();
        waiting.sort_unstable();
        for (_, key) in waiting {
            if self.co_ok(now, key) {
                for conn in self.take_waiting(key) {
                    out.push(self.co_grant(now, key, conn));
                }
            }
        }
    }

    /// Opens (or joins) `key`'s co-hold for `conn` (a client `co_ok` passed): the Grant that
    /// answers it.
    pub(super) fn co_grant(&mut self, now: Micros, key: Key, conn: ConnId) -> Action {
        let (quota, grace) = (self.co_run.quota_us, self.params.grace_us);
        let mut client = String::new();
        if let Some(c) = self.clients.get_mut(&key) {
            let (capped, fill) = (c.charged_in_wall_time(), c.fill.co());
            match &mut c.co.hold {
                Some(h) => {
                    h.conns.push(conn);
                    let ran_to = h.ran_to(quota, grace);
                    let stretch = (now > ran_to).then_some((h.start, ran_to));
                    if let Some((start, end)) = stretch {
                        // Nothing of it ran since `end`: that gap is not its time, and the
                        // stretch before it is charged as a co-hold that ended there, sliding
                        // out of the window from there (kept with the open co-hold instead, it
                        // came back into the window with each new stretch, and was still
                        // charged a second after a reload had started a new account).
                        let charge = stretch_charge(capped, fill, h, start, end);
                        let left = h.engine.left_over(start, end);
                        c.co.engine_owed_us = c.co.engine_owed_us.saturating_add(left);
                        c.co.charges.push_back((end, charge));
                        c.pass = c.pass.saturating_add(stride(charge, c.spec.request_milli));
                        h.start = now;
                        h.ran_past_quota = 0;
                        h.engine = CoEngine::default();
                    }
                    h.last_grant = now;
                    // Its processes' reports cannot be told apart: its wall length.
                    h.engine.set_unmeasured();
                }
                None => {
                    c.co.hold = Some(CoHold {
                        conns: vec![conn],
                        start: now,
                        last_grant: now,
                        ran_past_quota: 0,
                        engine: CoEngine::default(),
                    })
                }
            }
            if !std::mem::replace(&mut c.co.co_mode, true) {
                c.fill.back_to_co();
            }
            client.clone_from(&c.spec.id);
        }
        // Its turn, if it held one, ended with the request this answers.
        if let Some(cs) = self.conns.get_mut(&conn) {
            cs.turn = None;
        }
        self.refresh_boost(now);
        Action::Grant {
            client,
            conns: vec![conn],
            quota_us: self.co_run.quota_us,
        }
    }

    /// `conn` of `key` reports the end of its part of a co-hold (a request, a release, a
    /// hang-up), its work having run `ran_past_quota` µs past its quota (the overuse a
    /// TokenRequest reports): when it was the last, the co-hold is charged (`co_charge`).
    /// False: `conn` was in none.
    pub(super) fn co_end(
        &mut self,
        now: Micros,
        key: Key,
        conn: ConnId,
        ran_past_quota: Micros,
    ) -> bool {
        let window = self.params.window_us;
        let Some(h) = self
            .clients
            .get_mut(&key)
            .and_then(|c| c.co.hold.as_mut())
            .filter(|h| h.conns.contains(&conn))
        else {
            return false;
        };
        // A drain past the grace is GPU time too: charged only to the grace, a capped encoder
        // draining a deep queue at its co-holds' ends on an H200 had 0.60 of the GPU in a
        // second at its 0.5 limit.
        h.ran_past_quota = h.ran_past_quota.max(ran_past_quota);
        let c = &self.clients[&key];
        let Some(h) = &c.co.hold else {
            return false;
        };
        let (end, charge) = self.co_charge(c, h, now);
        let left = h.engine.left_over(h.start, end);
        let Some(c) = self.clients.get_mut(&key) else {
            return false;
        };
        let Some(h) = &mut c.co.hold else {
            return false;
        };
        h.conns.retain(|x| *x != conn);
        if h.conns.is_empty() {
            c.co.hold = None;
            c.co.engine_owed_us = c.co.engine_owed_us.saturating_add(left);
            c.co.charges.push_back((end, charge));
            // Its virtual time counts the charge as a turn's does its quota: under full
            // contention turns go by virtual time alone (no limit, no pacing), and a co-runner
            // whose co-holds did not count there took its request's share of the turns on top.
            c.pass = c.pass.saturating_add(stride(charge, c.spec.request_milli));
            while c
                .co
                .charges
                .front()
                .is_some_and(|(end, _)| end + window <= now)
            {
                c.co.charges.pop_front();
            }
        }
        self.refresh_boost(now);
        true
    }

    /// Sets every client's boost from the fills of the co-runners open now: an uncapped client
    /// not in a co-hold shares the GPU with them, `f` of the time together, and its pacing
    /// limit is raised by `1 / (1 − f)`; the same `f` (as capped) goes on the co-runners' curve
    /// from `now`, to credit an uncapped holder's turns with it (`co_area.rs`). A client
    /// charged in wall time is not boosted by co-runners. Charged by fill
    /// (`Core::set_charge_by_fill`), a client's own idle part of its turns counts as `f` when
    /// larger (a capped client's alone), and the curve follows the holder's. Called when a
    /// co-hold opens or ends, when a fill changes and when the config drops a client; charged
    /// by fill, also when the token changes hands.
    pub(super) fn refresh_boost(&mut self, now: Micros) {
        let f: f64 = self
            .clients
            .values()
            .filter(|c| c.co.hold.is_some())
            .map(|c| c.fill.co().unwrap_or(1.0))
            .sum();
        let by_fill = self.charge_by_fill;
        for c in self.clients.values_mut() {
            let own_idle = match c.fill.turns_judged() {
                Some(fill) if by_fill => 1.0 - fill,
                _ => 0.0,
            };
            let beside = if c.charged_in_wall_time() { 0.0 } else { f };
            c.co.boost_milli = if c.co.hold.is_some() {
                1000
            } else {
                boost_milli(beside.max(own_idle))
            };
        }
        let holder = self
            .holder
            .as_ref()
            .and_then(|h| self.clients.get(&h.client));
        let boost = match holder {
            Some(c) if by_fill => c.co.boost_milli,
            _ => boost_milli(f),
        };
        self.co_area.set_rate(now, 1.0 - 1000.0 / f64::from(boost));
        self.co_area
            .prune(now.saturating_sub(self.params.window_us));
    }

    /// What `id`'s turns in the window ending at `now` were credited of what co-runners took
    /// of them: its token time less its usage (`Core::usage_us`); 0 for a capped client, whose
    /// turns count whole.
    pub fn co_credit_us(&self, now: Micros, id: &str) -> Option<Micros> {
        let key = *self.ids.get(id)?;
        Some(self.credit(key, now.saturating_sub(self.params.window_us), now))
    }

    /// What co-runners took of `key`'s turns between `from` and `to` (`co_area.rs`); a turn
    /// still running counts to its recorded end at the co-runners' rate now.
    pub(super) fn credit(&self, key: Key, from: Micros, to: Micros) -> Micros {
        // Nobody co-ran then (co-running off, or not lately), or its turns count whole: no
        // turn to look through.
        if self.co_area.between(from, to) <= 0.0 || !self.credited(key) {
            return 0;
        }
        let credit: f64 = self
            .history
            .iter()
            .rev()
            .take_while(|e| e.end > from)
            .filter(|e| e.client == key)
            .map(|e| self.co_area.between(e.start.max(from), e.end.min(to)))
            .sum();
        credit as Micros
    }

    /// What `key`'s turn time between `a` and `b` is credited (µs of it not charged): what the
    /// co-runners' curve took of it, for every credit of a turn (the window's check, pacing,
    /// the usage report).
    pub(super) fn turn_credit(&self, key: Key, a: Micros, b: Micros) -> Micros {
        if self.credited(key) {
            self.co_area.between(a, b) as Micros
        } else {
            0
        }
    }

    /// Whether `key`'s turns are credited from the co-runners' curve: not a client charged in
    /// wall time, whose turns count whole, unless charged by fill (the curve then follows the
    /// holder's boost, which for such a client is its own idle part alone, `refresh_boost`).
    fn credited(&self, key: Key) -> bool {
        self.charge_by_fill
            || self
                .clients
                .get(&key)
                .is_some_and(|c| !c.charged_in_wall_time())
    }
}

/// What co-hold `h`'s time from `start` to `end` is charged: for a capped client (`capped`:
/// charged in wall time) the engine time it held, never more than the wall time
/// (`engine.rs`), otherwise its co-holds' `fill` of the wall time. A free function: a new
/// stretch is charged while its co-hold is borrowed from the client.
fn stretch_charge(
    capped: bool,
    fill: Option<f64>,
    h: &CoHold,
    start: Micros,
    end: Micros,
) -> Micros {
    if capped {
        h.engine.charge(start, end)
    } else {
        (end.saturating_sub(start) as f64 * fill.unwrap_or(1.0)) as Micros
    }
}

/// The boost beside co-runners that keep the GPU busy `f` of the time, in thousandths, within
/// [1000, MAX_BOOST_MILLI].
fn boost_milli(f: f64) -> u32 {
    if f.is_nan() || f <= 0.0 {
        return 1000;
    }
    let left = (1.0 - f).max(1000.0 / f64::from(MAX_BOOST_MILLI));
    ((1000.0 / left) as u32).clamp(1000, MAX_BOOST_MILLI)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boost_is_what_the_co_runners_leave_and_stays_within_bounds() {
        assert_eq!(boost_milli(0.0), 1000);
        assert_eq!(boost_milli(f64::NAN), 1000);
        assert_eq!(boost_milli(-1.0), 1000);
        assert_eq!(boost_milli(0.375), 1600);
        assert_eq!(boost_milli(0.5), 2000);
        assert_eq!(boost_milli(0.9), MAX_BOOST_MILLI);
        assert_eq!(boost_milli(f64::INFINITY), MAX_BOOST_MILLI);
    }
}
