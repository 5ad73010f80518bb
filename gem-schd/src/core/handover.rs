//! Hand-overs at the drain: when a holder stops launching at its quota's end and says so
//! (a Renew that is answered Yield, or a Drain notice), the next client is granted at once,
//! while the holder's queued work still runs; the holder reports its drain's end as before.
//!
//! Why: the holder used to drain first (wait for the work its process had queued), then ask,
//! and only then was the next client granted; its process then woke and launched. The GPU
//! idled for the report, the grant, the wake-up and the first launch at every hand-over:
//! four saturating tenants at 0.1 / 0.2 / 0.3 / 0.4 on an H200 kept it busy 0.74 of the time
//! for 0.94 charged. Granted at the notice, the next process wakes and launches while the
//! drain runs: its work queues behind the drain (another context: the GPU runs the drain,
//! then the new work, or time-slices the two).
//!
//! Charging: the holder's hold ends at the notice and its report stretches it to the drain's
//! end; the next hold, granted at the notice, is pushed back to start there (`set_end`:
//! entries never overlap). So the next client is charged from max(grant, drain's end). Its
//! hook's deadline still counts from the grant (gem-schd learns the drain's end only after it),
//! so a drain that took a good part of the next turn (at least a fifth of the min quota) is
//! made up for at that turn's end: its Renew is granted what the drain took, whoever waits
//! (`make_up_for_drain`). Turns stay whole: with its charge reduced alone, a batch-1 inference
//! tenant beside training whose queued work drained for ~3 ms lost most of each turn to it,
//! and its requests, spread over more turns, waited p50 3.7 ms instead of 1.2 in the simulation
//! (`tests/sim_latency.rs`). A hook that does not renew gets the reduced charge alone (exact in
//! GPU time all the same).

use super::*;

impl Core {
    /// Drain on `conn`: the holder stopped launching at its quota's end and now waits for the
    /// work its process queued; its TokenRequest (with the overuse) or Release (with the use)
    /// follows when that is done. The token goes on at once to the client a request of the
    /// holder's at this moment would let in (`hand_over`). No reply; a stray one (no Hello, a
    /// departed client, not the sole process of the running hold) changes nothing. Sent by a
    /// hook that does not renew (a Renew answered Yield is the same notice).
    pub fn drain(&mut self, now: Micros, conn: ConnId) -> Vec<Action> {
        let Ok(key) = self.conn_client(conn) else {
            return Vec::new();
        };
        self.expire(now);
        if !self.drain_notice_applies(key, conn) {
            return Vec::new();
        }
        self.hand_over(now, key, conn).unwrap_or_default()
    }

    /// Whether a drain notice on `conn` may hand the token on: hand-overs at the drain are on,
    /// `conn` is the sole process of `key`'s running turn (`sole_turn`), and trying costs no
    /// more than a renewal's try (`RENEW_MAX_ENTRIES`).
    pub(super) fn drain_notice_applies(&self, key: Key, conn: ConnId) -> bool {
        self.hand_over_at_drain
            && self.sole_turn(key, conn)
            && self.history.len() <= dispatch::RENEW_MAX_ENTRIES
    }

    /// Whether `conn` is the only connection in `key`'s running turn (the processes of a hold
    /// of several end it with their last report) and has no request pending.
    fn sole_turn(&self, key: Key, conn: ConnId) -> bool {
        self.holder
            .as_ref()
            .is_some_and(|h| h.client == key && h.conns == [conn])
            && !self.conns.get(&conn).is_some_and(|c| c.waiting)
    }

    /// The holder `key` (its sole process on `conn`) drains: the token goes now to the client a
    /// TokenRequest from `conn` at this moment would let in, if that is another client. The
    /// decision is the usual one, made on a copy with the holder's hold ended now and its
    /// request queued (so the ranking, full contention and the turn lengths are those of a
    /// hand-over after its report); a copy, because when the holder itself would go next, or
    /// no one may, nothing must change: the hold stands until the report, as before (and the
    /// holder's request then decides). `Some(actions)`: handed on, the grant among them.
    pub(super) fn hand_over(&mut self, now: Micros, key: Key, conn: ConnId) -> Option<Vec<Action>> {
        let mut trial = self.clone();
        if trial.leave_hold(now, conn, |_| now) {
            trial.asked_again = Some(key);
        }
        trial.enqueue(now, key, conn);
        let mut out = Vec::new();
        trial.dispatch(now, &mut out);
        if trial.holder.as_ref().is_none_or(|h| h.client == key) {
            return None;
        }
        // Its request comes after the drain: it does not wait meanwhile.
        if let Some(c) = trial.clients.get_mut(&key) {
            c.waiting.retain(|x| *x != conn);
        }
        if let Some(cs) = trial.conns.get_mut(&conn) {
            cs.waiting = false;
        }
        *self = trial;
        Some(out)
    }

    /// What the running turn of `id` lost to the drain of the hold before it (see
    /// `lost_to_drain`); `None`: `id` holds no turn.
    pub fn lost_to_drain_us(&self, id: &str) -> Option<Micros> {
        let key = *self.ids.get(id)?;
        self.holder
            .as_ref()
            .is_some_and(|h| h.client == key)
            .then(|| self.lost_to_drain(key))
    }

    /// What the running turn of `key` lost to the drain of the hold before it: how far that
    /// hold's report pushed the turn's start past its grant (0 once made up for).
    pub(super) fn lost_to_drain(&self, key: Key) -> Micros {
        match &self.holder {
            Some(h) if h.client == key => self
                .entry(h.seq)
                .map_or(0, |e| e.start.saturating_sub(e.grant)),
            _ => 0,
        }
    }

    /// Renew{..} on `conn`, the sole process of `key`'s running turn, whose start a drain pushed
    /// back by at least a fifth of the min quota: the turn goes on for that long from now (a
    /// Grant), whoever waits, charged without a gap. What a drain took of a turn shorter than
    /// that is left to the reduced charge (each make-up costs the holder a round trip, and its
    /// wake-up, counted in the loss, is no loss). `None`: nothing to make up for.
    pub(super) fn make_up_for_drain(
        &mut self,
        now: Micros,
        key: Key,
        conn: ConnId,
    ) -> Option<Action> {
        let lost = self.lost_to_drain(key);
        if !self.hand_over_at_drain
            || !self.sole_turn(key, conn)
            || lost < (self.params.min_quota_us / 5).max(1)
        {
            return None;
        }
        let quota_end = now.saturating_add(lost);
        let h = self.holder.as_mut()?;
        h.quota_end = quota_end;
        let seq = h.seq;
        let i = usize::try_from(seq.checked_sub(self.first_seq)?).ok()?;
        let e = self.history.get_mut(i)?;
        // Its reports count from now, as from a renewal's grant.
        e.grant = now;
        e.quota_end = quota_end;
        let end = e.end.max(quota_end);
        self.set_end(seq, end);
        self.grants += 1;
        Some(Action::Grant {
            client: self.clients.get(&key)?.spec.id.clone(),
            conns: vec![conn],
            quota_us: lost,
        })
    }
}
