//! The bounded wait of a client above its request beside clients catching up on theirs
//! (`Core::above_due_in`). Clients below their requests go first in the ranking, so one that
//! fell behind (held back by its pacing, back from co-holds) would run until it was back at its
//! request while a client above its own waited: on an H200 batch-1 decode waited 89 ms for one
//! token while a capped encoder was renewed 15 times in a row. `dispatch.rs` grants the waiting
//! client a min-quota turn when this says it is due, and ends a catching-up turn by then.

use super::*;

impl Core {
    /// How long until a client above its request, waiting since `since`, goes before those of
    /// its class below their own, which would otherwise run until they are back at their
    /// requests (0: now; `None`: not before they are). With s the sum of their requests (in
    /// thousandths), once it has waited 2 min quotas × max(1, s / (1 − s)), and once the others
    /// of the class have run 2s / (1 − s) times the length of the last such turn (its overrun
    /// included) since it: those below keep at least 2s / (1 + s) ≥ s of their class's time
    /// while they catch up. The turn is a min quota. Off with the starvation bound (`max_wait`
    /// 0), and for opportunistic clients beside guaranteed ones: their class gets what the
    /// other leaves, so one below its request may never catch up, and the bound would hand
    /// their spare time out by turns (in the simulation, beside a guaranteed tenant at 0.5, the
    /// opportunistic one at 0.2 took more than the one at 0.3).
    pub(super) fn above_due_in(
        &self,
        now: Micros,
        class: ClientClass,
        s: u64,
        since: Micros,
    ) -> Option<Micros> {
        let s = s.min(1000);
        let beside_guaranteed = class != ClientClass::Guaranteed
            && self
                .clients
                .values()
                .any(|c| c.spec.class == ClientClass::Guaranteed);
        if self.max_wait_us == 0 || s == 1000 || beside_guaranteed {
            return None;
        }
        let after = |len: Micros| len.saturating_mul(2 * s) / (1000 - s);
        let wait = after(self.params.min_quota_us).max(2 * self.params.min_quota_us);
        let to_wait = (since + wait).saturating_sub(now);
        let seq = self.overdue_turn[class::index(class)];
        let Some((seq, last)) = seq.and_then(|q| Some((q, self.entry(q)?))) else {
            return Some(to_wait); // none yet, or out of the window
        };
        let need = after(last.end.saturating_sub(last.start)).max(wait);
        let mut ran: Micros = 0;
        // Stops at `need`: a few entries past the last such turn.
        for e in self
            .history
            .iter()
            .skip((seq + 1 - self.first_seq) as usize)
        {
            if e.client != last.client && self.class_of(e.client) == Some(class) {
                ran = ran.saturating_add(e.end.saturating_sub(e.start));
                if ran >= need {
                    return Some(to_wait);
                }
            }
        }
        Some(to_wait.max(need - ran))
    }
}
