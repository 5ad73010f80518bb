//! The accounting window: usage from the history of holds, the pacing allowance and when a
//! waiting client becomes eligible, and how holds end (expiry, reports, overuse pushing later
//! holds back).

use super::*;

impl Core {
    /// When a waiting client passes both its limit and its pacing allowance, if
    /// nothing else happens (both only loosen as time passes, so the later of the two).
    pub(super) fn ready_at(&self, key: Key, now: Micros) -> Option<Micros> {
        // A light client waits for a co-hold, whose checks full contention does not lift.
        if self.light(key) {
            return self.co_ready_at(key, now);
        }
        let c = self.clients.get(&key)?;
        let w = self.window_ready_at(key, now, self.fully_contended(c.spec.class, now))?;
        let mut p = self.capped_co_hold_until(key, now).unwrap_or(now);
        for rule in self.pace_rules(key, c, now) {
            p = p.max(self.pace_ready_at(key, now, rule, self.pace_need(c, rule))?);
        }
        Some(w.max(p))
    }

    /// When a waiting client is below its limit over the window (`now` if it is, or if
    /// `unchecked`: full contention lifts the check for turns), if nothing else happens.
    pub(super) fn window_ready_at(&self, key: Key, now: Micros, unchecked: bool) -> Option<Micros> {
        let c = self.clients.get(&key)?;
        if unchecked || self.below_limit_over_window(key, c, now) {
            Some(now)
        } else {
            self.eligible_at(key, now)
        }
    }

    /// Whether the client's usage is below its limit over the window so far (a turn's and a
    /// co-hold's check alike).
    pub(super) fn below_limit_over_window(&self, key: Key, c: &ClientState, now: Micros) -> bool {
        u128::from(self.usage(key, now)) * 1000
            < u128::from(c.spec.limit_milli) * u128::from(self.w_eff(now))
    }

    /// The pacing window in force (never longer than the window, whose history it reads).
    pub(super) fn pace_window(&self) -> Micros {
        self.params.pace_us.min(self.params.window_us)
    }

    /// The pacing rules of a client: `limit × pace` of GPU time over the pacing window, and
    /// `limit × pace short` over the short one while no other client waits for the token (of
    /// any class); none when pacing does not apply (off, an uncapped client, a limit of 0, which
    /// the window check already holds back, or full contention of its class).
    ///
    /// The short rule is for a client that has the GPU to itself, which would otherwise
    /// spend its pacing allowance in one block and then wait out the rest of the window.
    /// Beside waiting clients the turns already spread its use, and there the short rule
    /// only lost it time: headroom that came back while a neighbour ran a 20 ms burst was
    /// gone 100 ms later, and a (0.5, 0.5) client beside a (0.1, 1.0) one with such bursts
    /// got 0.44 (`capped_and_elastic_busy_swapped_patterns` in tests/sim.rs). Beside waiting
    /// opportunistic clients likewise: a guaranteed client at (0.5, 0.5) let in by any room in
    /// the short window cut their turns to the min quota, whose drains it then waited for, and
    /// got 0.45 (`sim_priority.rs`).
    ///
    /// Past turns count as charged (`own_since`), a new one at the rate its boost leaves it
    /// (`rate_milli`): whole for a paced (capped) client, which co-runners do not boost, unless
    /// charged by fill. Pacing once read token time against a limit raised while co-runners
    /// ran, so when a co-hold ended the turns of the last second counted whole against the
    /// declared limit again: training at 0.5 waited ~50 ms beside co-running batch-8
    /// inference, the GPU idle (inference's co-holds waited up to 70 ms on an H200).
    pub(super) fn pace_rules(
        &self,
        key: Key,
        c: &ClientState,
        now: Micros,
    ) -> impl Iterator<Item = PaceRule> {
        let lim = c.spec.limit_milli;
        let on = lim > 0 && lim < 1000 && !self.fully_contended(c.spec.class, now);
        let rate_milli = c.hold_rate_milli();
        let long = self.pace_window();
        let alone = !self
            .clients
            .iter()
            .any(|(k, o)| *k != key && !o.waiting.is_empty());
        // Shorter than the pacing window, or it would only repeat that window's rule.
        let short = match self.params.pace_short_us {
            w if alone && w < long => w,
            _ => 0,
        };
        [long, short]
            .into_iter()
            .filter(move |w| on && *w > 0)
            .map(move |window| PaceRule {
                window,
                budget: ((u128::from(lim) * u128::from(window) / 1000) as u64).max(1),
                exact: window == long,
                rate_milli,
            })
    }

    /// Whether the clients of `class` waiting for the token request, together, the whole GPU
    /// (the classes are scheduled one after the other, `class.rs`). Then the
    /// turns by virtual time give each exactly its request (≤ its limit) over any stretch,
    /// and neither the window's limit nor pacing is checked (a client alone or beside clients
    /// that do not ask for the rest of the GPU is held to both as before): they only added
    /// waits: both tenants of a (0.5, 0.5) pair sat at their
    /// pacing allowance, so a client was let in only when its own usage of a second ago slid
    /// out (a wait, once made, recurred a second later), and both were held back at once
    /// ~2 % of the time with the GPU idle (the allowance must fit a min quota plus the usual
    /// overrun).
    ///
    /// Only with turns by virtual time (`max_lag` > 0): ranked by usage over the window
    /// (Gemini), the checks are what keeps a client from running ahead. And not while one of
    /// those clients is charged in wall time for co-holds in the window (`co_ran_since`): its
    /// co-holds run beside the others' turns and are charged too, so the charges add up to more
    /// than the time and shares of them by virtual time no longer bound anyone's limit (a
    /// capped client at 0.3 that alternated turns and co-holds beside one at 0.7 used 0.313 of
    /// a window and the other 0.707: `turns_and_co_holds_are_paced_together`).
    pub(super) fn fully_contended(&self, class: ClientClass, now: Micros) -> bool {
        let from = now.saturating_sub(self.params.window_us);
        // Called at every dispatch and pacing check: the waiting clients are walked, not
        // collected.
        let waiting = || {
            self.clients
                .iter()
                .filter(move |(k, c)| c.spec.class == class && self.waits_for_turn(**k, c))
        };
        self.unpaced_when_full
            && self.max_lag_us > 0
            && waiting()
                .map(|(_, c)| u32::from(c.spec.request_milli))
                .sum::<u32>()
                >= 1000
            && !waiting().any(|(k, c)| c.charged_in_wall_time() && self.co_ran_since(*k, from, now))
    }

    /// The pacing headroom a paced client waits for: the min quota (or the whole
    /// allowance, if smaller). Waiting for a grant of the usual size instead would
    /// leave up to one grant of every pacing window unused (only whole grants fit),
    /// which cost a 0.3 client with 33 ms bursts 2-3 points of its share.
    ///
    /// A client that overruns its grants waits for that much more under the exact rule:
    /// the overrun lands in the same pacing window, and a 0.3 client with 50 ms bursts (its
    /// whole burst queued in a 5 ms grant) otherwise used 0.323 of a 1 s window on an H100.
    /// Not under the short window's rule, which bounds waits and leaves the share to the
    /// exact one: waiting there for a min quota plus a 15 ms overrun left a (0.5, 0.5)
    /// client of 20 ms bursts two of them per 100 ms, 0.43 of the GPU beside a (0.1, 1.0)
    /// one (`pace_table` in tests/sim_pacing.rs).
    pub(super) fn pace_need(&self, c: &ClientState, rule: PaceRule) -> Micros {
        if !rule.exact {
            return 1;
        }
        self.params
            .min_quota_us
            .saturating_add(c.overrun_us)
            .min(rule.budget)
            .max(1)
    }

    /// The client's own use from `from` on, as charged, clipped to it, ordered by start: its
    /// turns, each less what it is credited of it (`turn_credit`: what co-runners took of an
    /// uncapped client's turn), as a piece of that length ending with the turn (it slides out
    /// of a window no earlier than its GPU time did), after the usage its account carried (all
    /// of which precedes its entries in the history), and its co-holds' charges, each likewise
    /// a piece ending where the co-hold's time did (its open one's so far among them).
    /// Pacing holds turns and co-holds together: with each check counting only one kind (or
    /// the other at a discount), a tenant at 0.3 that alternated them was charged 0.33 of its
    /// first 10 s through the fake driver (the real-node test with co-running on).
    pub(super) fn own_since(&self, key: Key, from: Micros, now: Micros) -> Vec<(Micros, Micros)> {
        // Entries are in order and never overlap, so their ends are ordered too.
        let mut v: Vec<(Micros, Micros)> = self
            .history
            .iter()
            .rev()
            .take_while(|e| e.end > from)
            .filter(|e| e.client == key)
            .map(|e| {
                let start = e.start.max(from);
                let credit = self.turn_credit(key, start, e.end);
                (start.saturating_add(credit).min(e.end), e.end)
            })
            .collect();
        if let Some(c) = self.clients.get(&key) {
            v.extend(
                c.carried
                    .iter()
                    .rev()
                    .take_while(|(_, e)| *e > from)
                    .map(|&(s, e)| (s.max(from), e)),
            );
        }
        let co = v.len();
        v.extend(
            self.co_charges_after(key, from, now)
                .map(|(end, charge)| (end.saturating_sub(charge).max(from), end)),
        );
        if v.len() > co {
            v.sort_unstable();
        } else {
            v.reverse();
        }
        v
    }

    /// The longest hold `q` starting at `now` that keeps the client's usage over the
    /// rule's window ending at `now + q` within its budget: its usage in `[now + q - window,
    /// ..)` plus the hold's, `q` at the rule's rate (old usage slides out while the new hold
    /// runs). Checked at the hold's end, as [`Core::pace_ready_at`] checks it: a client over
    /// its budget by the overlap of a co-hold's charge and its turn, which slides out twice
    /// as fast, was woken for a turn this refused, at the same instant, forever.
    pub(super) fn pace_headroom(&self, key: Key, now: Micros, rule: PaceRule) -> Micros {
        let PaceRule {
            window,
            budget,
            rate_milli,
            ..
        } = rule;
        let rate = i128::from(rate_milli.clamp(1, 1000));
        let from = now.saturating_sub(window);
        let segs = self.own_since(key, from, now);
        let used: Micros = segs.iter().map(|(s, e)| e - s).sum();
        // In thousandths of a µs of GPU time, what is left of the budget with the hold run to
        // `pos`. As the window's start moves on from `from`, the hold grows as much: over a
        // gap between the client's old pieces that costs the rate, over old pieces they slide
        // out as fast as they lie on top of each other (at a rate below 1, or over pieces that
        // overlap, what is left grows).
        let mut left = (i128::from(budget) - i128::from(used)) * 1000;
        let mut pos = from;
        let mut longest = 0;
        // The longest hold ending in the gap from `pos`, of `gap` µs (unbounded: the tail).
        let in_gap = |left: i128, pos: Micros, gap: Micros| -> Option<Micros> {
            // (Not `left / rate` alone: it rounds a small shortfall up to 0.)
            let more = u64::try_from(left).ok()? / rate as u64;
            Some((pos - from).saturating_add(more.min(gap)))
        };
        for (s, e, depth) in layers(&segs) {
            if s > pos {
                longest = longest.max(in_gap(left, pos, s - pos).unwrap_or(0));
                left -= i128::from(s - pos) * rate;
            }
            left += i128::from(e - s) * (i128::from(depth) * 1000 - rate);
            pos = e;
            if left >= 0 {
                longest = longest.max(pos - from);
            }
        }
        longest.max(in_gap(left, pos, Micros::MAX).unwrap_or(0))
    }

    /// When the rule's headroom reaches `need` (`now` if it has), assuming no new use:
    /// the first `t` with `need + usage in [t + need - window, ..) <= budget`. The hold
    /// counts whole here, as if nobody co-ran: at a lower rate it fits no later (each µs of
    /// it costs less), and taking the rate into this formula alone woke gem-schd before the
    /// headroom was there, again and again (a gap at the window's start costs the rate
    /// before the old usage slides out); a dispatch on another event finds the hold sooner.
    pub(super) fn pace_ready_at(
        &self,
        key: Key,
        now: Micros,
        rule: PaceRule,
        need: Micros,
    ) -> Option<Micros> {
        let PaceRule {
            window: pace,
            budget,
            ..
        } = rule;
        let from = now.saturating_sub(pace);
        let segs = self.own_since(key, from, now);
        let used: Micros = segs.iter().map(|(s, e)| e - s).sum();
        // `excess` of the old usage must slide out of the window.
        let Some(excess) = used
            .checked_sub(budget.checked_sub(need)?)
            .filter(|x| *x > 0)
        else {
            return Some(now);
        };
        let mut gone = 0;
        for (s, e, depth) in layers(&segs) {
            let depth = Micros::from(depth);
            if gone + (e - s) * depth >= excess {
                let cutoff = s + (excess - gone).div_ceil(depth);
                return Some((cutoff + pace).saturating_sub(need).max(now));
            }
            gone += (e - s) * depth;
        }
        None
    }

    /// When a waiting client at its limit becomes eligible, if nothing else happens.
    pub(super) fn eligible_at(&self, key: Key, now: Micros) -> Option<Micros> {
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
        // The window slides: the client loses its oldest usage as the cutoff passes, a hold's
        // bit by bit (its GPU time: evenly over its wall time), a co-hold's charge whole once
        // its end leaves the window.
        let need = u64::try_from(excess / 1000 + 1).unwrap_or(u64::MAX);
        let cutoff = now.saturating_sub(w);
        // (time from which it slides out, GPU time, wall time over which it slides out: 0 at once)
        let mut pieces: Vec<(Micros, Micros, Micros)> = self
            .history
            .iter()
            .filter(|e| e.client == key && e.end > cutoff)
            .map(|e| {
                let (s, end) = (e.start.max(cutoff), e.end.min(now));
                let wall = end.saturating_sub(s);
                let credit = self.turn_credit(key, s, end);
                (s, wall.saturating_sub(credit), wall)
            })
            .chain(
                self.co_charges_after(key, cutoff, now)
                    .map(|(end, ch)| (end, ch, 0)),
            )
            .collect();
        pieces.sort_unstable_by_key(|p| p.0);
        let mut lost = 0;
        for (s, amount, wall) in pieces {
            if lost + amount >= need {
                let rest = u128::from(need - lost) * u128::from(wall) / u128::from(amount.max(1));
                let at = s + u64::try_from(rest).unwrap_or(u64::MAX).min(wall);
                return Some(now + (at - cutoff).max(1));
            }
            lost += amount;
        }
        None
    }

    pub(super) fn w_eff(&self, now: Micros) -> Micros {
        now.saturating_sub(self.start)
            .clamp(1, self.params.window_us.max(1))
    }

    pub(super) fn entry(&self, seq: u64) -> Option<&Entry> {
        let i = seq.checked_sub(self.first_seq)?;
        self.history.get(usize::try_from(i).ok()?)
    }

    /// Usage of `key` in the window ending at `now`, as charged: its turns, counted as recorded
    /// (an uncapped client's less what co-runners took of them, `turn_credit`), plus its
    /// co-holds' charges (its open one's so far).
    pub(super) fn usage(&self, key: Key, now: Micros) -> Micros {
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
        // Co-holds count with what they were charged (`corun.rs`).
        u.saturating_sub(self.credit(key, cutoff, Micros::MAX))
            + self.co_charged_since(key, cutoff, now)
    }

    pub(super) fn prune(&mut self, now: Micros) {
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
    pub(super) fn set_end(&mut self, seq: u64, end: Micros) {
        let Some(i) = seq
            .checked_sub(self.first_seq)
            .and_then(|i| usize::try_from(i).ok())
            .filter(|i| *i < self.history.len())
        else {
            return;
        };
        let e = &mut self.history[i];
        let end = end.max(e.start);
        let (old, client, rate) = (e.end - e.start, e.client, e.rate_milli);
        e.end = end;
        let new = end - e.start;
        self.adjust(client, old, new, rate);
        for j in i + 1..self.history.len() {
            let f = &mut self.history[j];
            if f.start >= end {
                break;
            }
            let old = f.end - f.start;
            f.start = end;
            f.end = f.end.max(end);
            let (new, client, rate) = (f.end - f.start, f.client, f.rate_milli);
            self.adjust(client, old, new, rate);
        }
    }

    /// An entry of `key` charged at `rate_milli` changed from `old` to `new` µs long.
    pub(super) fn adjust(&mut self, key: Key, old: Micros, new: Micros, rate_milli: u32) {
        if let Some(c) = self.clients.get_mut(&key) {
            c.usage_sum = c.usage_sum - old + new;
            let req = c.spec.request_milli;
            c.pass = (c.pass + stride(at_rate(new, rate_milli), req))
                .saturating_sub(stride(at_rate(old, rate_milli), req));
        }
    }

    /// The token time of `key`'s turns between `from` and `to`, its last turn up to `to`:
    /// a report before the frame that ends a turn comes after its drain, which the frame
    /// charges to it.
    pub(super) fn turn_time_between(&self, key: Key, from: Micros, to: Micros) -> Micros {
        let last = self.clients.get(&key).and_then(|c| c.last_entry);
        let mut seq = self.first_seq + self.history.len() as u64;
        let mut sum = 0;
        for e in self.history.iter().rev() {
            seq -= 1;
            if e.client != key {
                continue;
            }
            let end = if Some(seq) == last { to } else { e.end.min(to) };
            if end <= from {
                break;
            }
            sum += end.saturating_sub(e.start.max(from));
        }
        sum
    }

    /// The clients that held the token in the last 100 ms (they still compete for it: a
    /// batch-1 inference tenant between two requests has given it back for its CPU time).
    pub(super) fn recent_holders(&self, now: Micros) -> Vec<Key> {
        let recent = now.saturating_sub(CONTENDED_US);
        self.history
            .iter()
            .rev()
            .take_while(|e| e.end > recent)
            .map(|e| e.client)
            .collect()
    }

    /// The smallest virtual time among the clients of `key`'s class other than `key` that
    /// compete: wait for the token, hold it, or held it in the last 100 ms (`None`: no one
    /// else). Virtual times of different classes are not compared (`class.rs`).
    pub(super) fn pass_floor(&self, key: Key, now: Micros) -> Option<u128> {
        let held = self.recent_holders(now);
        self.clients
            .iter()
            .filter(|(k, c)| {
                **k != key && self.peers(key, **k) && self.in_contention(**k, c, &held)
            })
            .map(|(_, c)| c.pass)
            .min()
    }

    /// Whether `k` is in contention for the token now: it waits for it, holds it, or held it
    /// in the last 100 ms (`held`: `recent_holders`).
    pub(super) fn in_contention(&self, k: Key, c: &ClientState, held: &[Key]) -> bool {
        !c.waiting.is_empty()
            || self.holder.as_ref().is_some_and(|h| h.client == k)
            || held.contains(&k)
    }

    /// The holder's quota and grace ran out without a report (`expiry`): the token is free
    /// (its entry stays open to a late overuse report).
    pub(super) fn expire(&mut self, now: Micros) {
        if self.holder.as_ref().is_some_and(|h| now >= self.expiry(h)) {
            self.holder = None;
            if self.charge_by_fill {
                self.refresh_boost(now);
            }
        }
    }

    /// When the running hold `h` expires if no report comes: the grace past its quota, or, once
    /// its process has said it drains, as long past it as its client's usual drain allows
    /// ([`DRAIN_WAIT_OVERRUNS`] of its overrun, at most [`DRAIN_WAIT_MAX_US`]), if longer.
    ///
    /// Why: a process that said it drains is alive and reports its drain's end; a client
    /// granted before that runs beside the drain (the GPU time-slices the two contexts), and
    /// the late report then charges the drainer for the whole of the time they shared. A
    /// tenant of 20 ms kernels capped at 0.5 (drains of 43 ms at the median, 77 ms at p90)
    /// beside an elastic one on an H200 got 0.464–0.479 of the GPU's time for 0.498 charged
    /// with the grace alone, 0.501 with this wait. A grace of 0 keeps Gemini's behaviour.
    pub(super) fn expiry(&self, h: &Hold) -> Micros {
        let grace = self.params.grace_us;
        let wait = if h.draining && grace > 0 {
            let usual = self.clients.get(&h.client).map_or(0, |c| c.overrun_us);
            grace.max(
                usual
                    .saturating_mul(DRAIN_WAIT_OVERRUNS)
                    .min(DRAIN_WAIT_MAX_US),
            )
        } else {
            grace
        };
        h.quota_end.saturating_add(wait)
    }

    /// `conn`, the sole process of `key`'s running hold, said it drains and the hold stands
    /// (no hand-over at the notice): its report is waited for past the grace (`expiry`).
    pub(super) fn note_draining(&mut self, key: Key, conn: ConnId) {
        if self.sole_holder(key, conn)
            && let Some(h) = self.holder.as_mut()
        {
            h.draining = true;
        }
    }

    /// Whether `conn` is the only connection in `key`'s running turn.
    pub(super) fn sole_holder(&self, key: Key, conn: ConnId) -> bool {
        self.holder
            .as_ref()
            .is_some_and(|h| h.client == key && h.conns == [conn])
    }

    /// End the running hold, charging it up to `end_of(&entry)` but never past `now`.
    pub(super) fn end_hold(&mut self, now: Micros, end_of: impl Fn(&Entry) -> Micros) {
        let Some(h) = self.holder.take() else { return };
        self.asked_again = None;
        if self.charge_by_fill {
            self.refresh_boost(now);
        }
        let Some(e) = self.entry(h.seq).copied() else {
            return;
        };
        self.set_end(h.seq, now.min(end_of(&e).max(h.left_end)));
    }

    /// `conn`, in the running hold, reports where its part of it ended (`end_of(&entry)`, never
    /// past `now`). A hold of several processes ends when the last of them has reported,
    /// charged up to the latest end any of them reported: ending it at the first one's
    /// request granted the next client while the others still drained their last bursts
    /// beside it, and their late reports charged this client for the shared time (through the
    /// fake driver, a client of two processes got 0.25–0.29 of the GPU for 0.31 of the token
    /// time). Returns whether the hold ended. A connection outside the hold reports nothing
    /// about it.
    pub(super) fn leave_hold(
        &mut self,
        now: Micros,
        conn: ConnId,
        end_of: impl Fn(&Entry) -> Micros,
    ) -> bool {
        let Some(h) = self.holder.as_mut() else {
            return false;
        };
        let before = h.conns.len();
        h.conns.retain(|c| *c != conn);
        if h.conns.len() == before {
            return false;
        }
        if h.conns.is_empty() {
            self.end_hold(now, end_of);
            return true;
        }
        let seq = h.seq;
        let end = self.entry(seq).map_or(now, |e| end_of(e).min(now));
        if let Some(h) = self.holder.as_mut() {
            h.left_end = h.left_end.max(end);
        }
        false
    }

    /// Turn `seq`, no longer held, ran to `end_of(&entry)` (never past `now`): its entry is
    /// stretched that far if it ends sooner.
    pub(super) fn report_turn_end(
        &mut self,
        now: Micros,
        seq: u64,
        end_of: impl Fn(&Entry) -> Micros,
    ) {
        let Some(e) = self.entry(seq).copied() else {
            return;
        };
        let end = now.min(end_of(&e));
        if end > e.end {
            self.set_end(seq, end);
        }
    }
}

/// How many of its client's usual overruns (a decaying maximum of its reported drains) the
/// token waits past a draining holder's quota for its report (`Core::expiry`): drains vary by
/// the queue left at the quota's end, and one a few times the last still comes.
pub(super) const DRAIN_WAIT_OVERRUNS: Micros = 4;
/// The longest wait for a draining holder's report (`Core::expiry`): a process that hangs in
/// its drain holds the token no longer.
pub(super) const DRAIN_WAIT_MAX_US: Micros = 1_000_000;

/// `us` of a turn charged at `rate_milli` thousandths of GPU time per µs.
pub(super) fn at_rate(us: Micros, rate_milli: u32) -> Micros {
    if rate_milli >= 1000 {
        return us;
    }
    (u128::from(us) * u128::from(rate_milli) / 1000) as Micros
}

/// `us` of GPU time in virtual time at a request of `request_milli`.
pub(super) fn stride(us: Micros, request_milli: u16) -> u128 {
    u128::from(us) * 1_000_000 / u128::from(request_milli.max(1))
}

/// The client's pieces of use (sorted by start, `own_since`) as disjoint spans, each with how
/// many pieces lie on it, in order; gaps are left out. Pieces overlap where a co-hold's charge
/// lies beside a turn: both slide out of a window together, so the span gives back their sum
/// as the window's start passes it (walking them one after the other counted the overlap once
/// as it slid out but twice in the usage, and a client waiting for that room was woken for a
/// turn it was then refused, at the same instant, forever).
pub(super) fn layers(pieces: &[(Micros, Micros)]) -> Vec<(Micros, Micros, u32)> {
    let mut edges: Vec<(Micros, i32)> = pieces
        .iter()
        .filter(|(s, e)| e > s)
        .flat_map(|&(s, e)| [(s, 1), (e, -1)])
        .collect();
    edges.sort_unstable();
    let mut out: Vec<(Micros, Micros, u32)> = Vec::new();
    let (mut depth, mut at) = (0i32, 0);
    for (x, d) in edges {
        if depth > 0 && x > at {
            out.push((at, x, depth as u32));
        }
        depth += d;
        at = x;
    }
    out
}
