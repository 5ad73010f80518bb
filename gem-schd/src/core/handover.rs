//! Hand-overs at the drain: when a holder stops launching at its quota's end and says so
//! (a Renew that is answered Yield, or a Drain notice), the next client is granted at once,
//! while the holder's queued work still runs; the holder reports its drain's end as before.
//!
//! Why: the holder used to drain first (wait for the work its process had queued), then ask,
//! and only then was the next client granted; its process then woke and launched. The GPU
//! idled for the report, the grant, the wake-up and the first launch at every hand-over:
//! four saturating tenants at 0.1 / 0.2 / 0.3 / 0.4 on an H200 kept it busy 0.74 of the time
//! for 0.94 charged. Granted at the notice, the next process wakes and launches while the
//! drain runs: its work queues behind the drain.
//!
//! Charging: the holder's hold ends at the notice and its report stretches it to the drain's
//! end; the next hold, granted at the notice, is pushed back to start there (`set_end`:
//! entries never overlap). So the next client is charged from max(grant, drain's end): its
//! charge is reduced by what it waited, not its turn lengthened, because gem-schd learns the
//! drain's end only after the grant (the hook's deadline counts from the grant), and because
//! a lengthened turn would hand it GPU time it may already have had: the GPU does not always
//! run the drain first and the new work after, it may time-slice the two contexts, and the
//! drain's end then comes later by the new work that ran beside it.
//!
//! That is also the limit of the hand-over: what the next client runs beside the drain is
//! charged to the holder. So only a holder whose drains are short is handed over from (its
//! overrun, a decaying maximum of the drains it reported, at most a fifth of the min quota):
//! through the fake driver, which interleaves the kernels of two processes one by one, a
//! client whose 20 ms batches drained at its hand-overs had its neighbour's kernels charged to
//! it, and the neighbour got 0.44 of the GPU time for 0.29 charged.

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
        let out = self.hand_over(now, key, conn).unwrap_or_default();
        self.note_draining(key, conn);
        out
    }

    /// The longest usual drain a holder may have to be handed over from at its notice
    /// (`Core::set_handover_drain_max`; by default a fifth of the min quota, in a long turn
    /// too: on an H200 a fifth of a 10 ms turn let the next tenant's work run beside 1.5 ms
    /// drains, and the gap per hand-over stayed the same).
    fn handover_drain_max(&self) -> Micros {
        self.handover_drain_max_us
            .unwrap_or((self.params.min_quota_us / 5).max(1))
    }

    /// Whether a drain notice from `key` on `conn` may hand the token on, once it counts
    /// (`notice_counts`): hand-overs at the drain are on, `key`'s drains are short (its
    /// overrun at most `handover_drain_max`: what the next client runs beside a drain is
    /// charged to the holder), and `conn` does not park (its hook stops the GPU at a wait
    /// after the notice and can tell where only while no other context runs).
    fn hands_over(&self, key: Key, conn: ConnId) -> bool {
        self.hand_over_at_drain
            && self.drains_short(key)
            && !self.conns.get(&conn).is_some_and(|c| c.parks)
    }

    /// `conn` parks its queued work at a hold's end (gem-proto `Parks`): its drain notices
    /// hand nothing on, they only tell the next client Soon. No reply; an unknown connection
    /// changes nothing.
    pub fn set_parks(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.parks = true;
        }
    }

    /// Whether `key`'s usual drain (its overrun) is at most `handover_drain_max`.
    fn drains_short(&self, key: Key) -> bool {
        self.clients
            .get(&key)
            .is_some_and(|c| c.overrun_us <= self.handover_drain_max())
    }

    /// Whether a drain notice on `conn` says who goes next, and a Renew on it may be tried:
    /// `conn` is the sole process of `key`'s running turn (`sole_turn`), and trying costs no
    /// more than a renewal's try (`RENEW_MAX_ENTRIES`).
    pub(super) fn notice_counts(&self, key: Key, conn: ConnId) -> bool {
        self.sole_turn(key, conn) && self.history.len() <= dispatch::RENEW_MAX_ENTRIES
    }

    /// Whether `conn` is the only connection in `key`'s running turn (the processes of a hold
    /// of several end it with their last report) and has no request pending.
    fn sole_turn(&self, key: Key, conn: ConnId) -> bool {
        self.sole_holder(key, conn) && !self.conns.get(&conn).is_some_and(|c| c.waiting)
    }

    /// The holder `key` (its sole process on `conn`) drains: the token goes now to the client a
    /// TokenRequest from `conn` at this moment would let in, if that is another client, the
    /// notice counts (`notice_counts`) and may hand the token on (`hands_over`). When only the
    /// holder's drains are too long for that, that client's waiting connections are told Soon
    /// (`set_soon`): the token comes after the holder's report. `Some(actions)`: handed on
    /// (the grant among them) or told.
    pub(super) fn hand_over(&mut self, now: Micros, key: Key, conn: ConnId) -> Option<Vec<Action>> {
        let hands_over = self.hands_over(key, conn);
        if !((hands_over || self.soon) && self.notice_counts(key, conn)) {
            return None;
        }
        let (trial, out) = self.next_at_notice(now, key, conn)?;
        if hands_over {
            *self = trial;
            return Some(out);
        }
        // The next turn's connections (a co-hold the copy granted too is not the next turn).
        let conns = trial.holder.map(|h| h.conns)?;
        Some(vec![Action::Soon { conns }])
    }

    /// Who goes next if `key`'s hold ends now: the usual decision, made on a copy with the
    /// holder's hold ended now and its request queued (so the ranking, full contention and
    /// the turn lengths are those of a hand-over after its report); a copy, because when the
    /// holder itself would go next, or no one may, nothing must change: the hold stands until
    /// the report, as before (and the holder's request then decides). `Some((copy, actions))`
    /// when another client is granted on the copy.
    pub(super) fn next_at_notice(
        &self,
        now: Micros,
        key: Key,
        conn: ConnId,
    ) -> Option<(Core, Vec<Action>)> {
        let mut trial = self.clone();
        if trial.leave_hold(now, conn, |_| now) {
            trial.asked_again = Some(key);
        }
        // A light holder's request would be answered with a co-hold, not wait for a turn: it is
        // no candidate, and a co-hold granted here would answer the drain notice itself.
        if !trial.light(key) {
            trial.enqueue(now, key, conn);
        }
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
        Some((trial, out))
    }
}
