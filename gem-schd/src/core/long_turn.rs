//! Long turns among GPU-bound tenants (`Core::set_long_turn`): under full contention a capped
//! client's turn is the min quota, so that a latency-sensitive neighbour waits no longer than
//! that; when every client it competes with keeps the GPU busy through its turns (a judged
//! fill of at least [`LONG_TURN_FILL`]), nobody waits on a token for latency, and the turn is
//! the long one instead. Off by default.
//!
//! Why: each hand-over costs the GPU the switch between two contexts and the next process's
//! first launch, whatever gem-schd does (on an H200 about 0.3 ms, 6 % of the time at 5 ms
//! turns). Four GPU-bound tenants at 0.1 / 0.2 / 0.3 / 0.4 kept it busy 0.85 of the time with
//! 5 ms turns, 0.89 with 10 ms and 0.92 with 20 ms ones (`--min-quota-ms`, which lengthens
//! every turn); beside a batch-1 decode tenant 20 ms turns took decode's p99 token from 5 ms to
//! 14 ms. The fill is the signal the two differ by: on an H200 the hook's Busy reports put
//! GPU-bound training at a median fill of 0.80–0.96 and batch-1 inference at 0.31–0.41.

use super::*;

/// The judged fill (`fill.rs`) from which a client counts as GPU-bound: between batch-1
/// inference's fills and GPU-bound training's (above), nearer the inference, as a fill that
/// reads low only shortens the turns.
pub const LONG_TURN_FILL: f64 = 0.7;

impl Core {
    /// Long turns under full contention (`long_turn.rs`): `us` for a capped client's turn
    /// while every client it competes with (itself included) is GPU-bound, instead of the min
    /// quota. 0 (or no more than the min quota) = off. Needs the clients' fills: the daemon
    /// asks the hooks for Busy reports while it is on.
    pub fn set_long_turn(&mut self, us: Micros) {
        self.long_turn_us = us;
    }

    /// The turn of a capped client under full contention.
    pub(super) fn full_turn(&self, key: Key, now: Micros) -> Micros {
        let min = self.params.min_quota_us;
        if self.long_turn_us > min && self.all_gpu_bound(key, now) {
            self.long_turn_us
        } else {
            min
        }
    }

    /// Whether `key` and every client it competes with (waiting for the token, holding it, in a
    /// co-hold, or holding it in the last 100 ms) have a judged fill of at least
    /// [`LONG_TURN_FILL`]. A client whose fill is not judged yet is not GPU-bound.
    fn all_gpu_bound(&self, key: Key, now: Micros) -> bool {
        let held = self.recent_holders(now);
        self.clients
            .iter()
            .filter(|(k, c)| {
                **k == key
                    || (self.competes_with(key, **k)
                        && (self.in_contention(**k, c, &held) || c.co.hold.is_some()))
            })
            .all(|(_, c)| c.judged_fill().is_some_and(|f| f >= LONG_TURN_FILL))
    }
}
