//! One capped client on the GPU at a time: a capped client's turns and co-holds never overlap
//! another capped client's.
//!
//! A capped client is charged the wall time it holds a turn or a co-hold
//! (`ClientState::charged_in_wall_time`): that bounds its GPU time whatever the sampled fills
//! read. Two capped clients holding at once are each charged the whole overlap while the GPU
//! time-slices it between them, so the wall time their limits allow covers less of the clock:
//! four capped tenants at 0.1–0.4 co-running below a fill of 0.8 were charged their limits and
//! kept the GPU busy 0.49–0.65 of the time on H200s, against 0.87 in turns (the simulation:
//! 0.583 against 0.731, `capped_tenants_alone_take_turns_whatever_their_fills` in
//! tests/sim_corun.rs). So among capped clients a co-hold is as exclusive as a turn: none is
//! granted beside another capped client's co-hold or turn, nor a capped turn beside another
//! capped client's co-hold (until the time it may run, its quota and grace, is up). Uncapped
//! clients, charged their GPU time, overlap anyone as before: a capped training loop co-holding
//! beside an elastic decode loop's turns is the overlap co-running is for.
//!
//! Where no uncapped client is connected, a capped client does not co-run at all: beside capped
//! clients alone a co-hold is a turn with none of a turn's rules (full contention lifting the
//! limits, hand-overs at the drain), and four light capped clients taking co-holds one at a
//! time left the GPU idle 6.5 % of the time in the simulation, each waiting for room in its
//! pacing window.
//!
//! Among capped clients that wait, virtual time decides as it does for turns: a capped client
//! is not granted a co-hold (nor renewed one) while another capped client that competes with it
//! waits, may go now and is behind it in virtual time; otherwise a light capped client renewing
//! its co-holds kept the others out until it reached its limit.

use super::window::stride;
use super::*;

impl Core {
    /// Until when another capped client's open co-hold keeps `key` (if capped) off the GPU:
    /// the latest time that co-hold's processes may run (its last grant's quota, then the grace
    /// or the drain they reported). `None`: `key` is uncapped, or no such co-hold runs now.
    pub(super) fn capped_co_hold_until(&self, key: Key, now: Micros) -> Option<Micros> {
        if !self.clients.get(&key)?.charged_in_wall_time() {
            return None;
        }
        let (quota, grace) = (self.co_run.quota_us, self.params.grace_us);
        self.clients
            .iter()
            .filter(|(k, c)| **k != key && c.charged_in_wall_time())
            .filter_map(|(_, c)| c.co.hold.as_ref())
            .map(|h| h.ran_to(quota, grace))
            .filter(|until| *until > now)
            .max()
    }

    /// Whether a capped client other than `key` (itself capped) waits, may go now (for a turn:
    /// within its limit and pacing allowance; for a co-hold: below its limit over the window)
    /// and goes first: it is of a higher class, or of `key`'s and behind it in virtual time.
    pub(super) fn capped_waits_ahead(&self, key: Key, now: Micros) -> bool {
        let Some(me) = self.clients.get(&key).filter(|c| c.charged_in_wall_time()) else {
            return false;
        };
        let mine = self.pass_now(me, now);
        self.clients.iter().any(|(&k, c)| {
            k != key
                && c.charged_in_wall_time()
                && !c.waiting.is_empty()
                && (self.class_of(k) > self.class_of(key)
                    || (self.peers(key, k) && self.pass_now(c, now) < mine))
                && if self.light(k) {
                    self.below_limit_over_window(k, c, now)
                } else {
                    self.turn_room(k, c, now, false).is_some()
                }
        })
    }

    /// `c`'s virtual time with its open co-hold charged so far (a co-hold's charge counts there
    /// when it ends; at a renewal, the one ending is still open).
    fn pass_now(&self, c: &ClientState, now: Micros) -> u128 {
        let open =
            c.co.hold
                .as_ref()
                .map_or(0, |h| self.co_charge(c, h, now).1);
        c.pass.saturating_add(stride(open, c.spec.request_milli))
    }

    /// Whether an uncapped client (limit 1, charged its GPU time) is connected: one whose
    /// turns a capped client may co-run beside.
    pub(super) fn uncapped_connected(&self) -> bool {
        self.clients
            .values()
            .any(|c| c.conns > 0 && c.spec.limit_milli > 0 && !c.charged_in_wall_time())
    }
}
