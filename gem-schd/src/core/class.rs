//! Classes of clients: a guaranteed client's request is a guarantee; an opportunistic client
//! (a pod of `sharedgpu/priority` 0) gets only the GPU time that guaranteed clients leave.
//!
//! The rule: while a guaranteed client waits for a turn it may take (within its limit and
//! pacing allowance), no opportunistic client is granted one, nor a co-hold beside a
//! guaranteed holder; an opportunistic holder is not renewed while a guaranteed client waits
//! (it gives the token back at its next hand-over). An opportunistic turn granted while
//! guaranteed clients are held back by their limits ends when the first of them may go again,
//! and one granted within 100 ms of a guaranteed client's hold is the min quota (that client is
//! on the CPU between launches); both leave room for the opportunistic client's usual drain.
//! After a guaranteed client's Release the token waits a moment for its next request before it
//! goes to an opportunistic client (`awaits_reask`).
//!
//! Each class is a world of its own otherwise: virtual time, full contention, the even turn
//! and the lag floor are computed among the clients of one class, so guaranteed clients share
//! the GPU as if the opportunistic ones were absent, and opportunistic clients share what is
//! left by their requests and limits exactly as guaranteed clients share the whole GPU (a GPU
//! of opportunistic clients only is scheduled as one of guaranteed clients only). The short
//! pacing window alone looks at every waiting client, whatever its class (`pace_rules`).

use super::*;

/// The classes in the order they are served.
pub(super) const SERVED_FIRST: [ClientClass; 2] =
    [ClientClass::Guaranteed, ClientClass::Opportunistic];

/// A class's slot in per-class arrays.
pub(super) fn index(class: ClientClass) -> usize {
    match class {
        ClientClass::Guaranteed => 0,
        ClientClass::Opportunistic => 1,
    }
}

impl Core {
    /// The class of `id`.
    pub fn class(&self, id: &str) -> Option<ClientClass> {
        self.ids.get(id).map(|k| self.clients[k].spec.class)
    }

    /// Whether `id` waits for a turn and may take it now: below its limit over the window and
    /// within its pacing allowance (the checks of the ranking; under full contention of its
    /// class neither is checked), and, if capped, no other capped client's co-hold running
    /// (`capped.rs`). While a guaranteed client may, no opportunistic one is granted a turn.
    pub fn may_take_turn(&self, now: Micros, id: &str) -> bool {
        let Some(&key) = self.ids.get(id) else {
            return false;
        };
        let c = &self.clients[&key];
        let full = self.fully_contended(c.spec.class, now);
        self.waits_for_turn(key, c)
            && self.turn_room(key, c, now, full).is_some()
            && self.capped_co_hold_until(key, now).is_none()
    }

    pub(super) fn class_of(&self, key: Key) -> Option<ClientClass> {
        self.clients.get(&key).map(|c| c.spec.class)
    }

    /// Whether `other` is of `key`'s class: the clients it shares virtual time, full contention
    /// and pacing with.
    pub(super) fn peers(&self, key: Key, other: Key) -> bool {
        self.class_of(key) == self.class_of(other)
    }

    /// Whether `other` competes with `key` for turns: of its class or above. A turn of `key`
    /// is kept short for such a client (`contenders_quota`), and its waiting ends `key`'s hold
    /// at the next hand-over (`renew`); an opportunistic client's waiting changes neither for
    /// a guaranteed one.
    pub(super) fn competes_with(&self, key: Key, other: Key) -> bool {
        self.class_of(other) >= self.class_of(key)
    }

    /// Whether the released client that the token may wait for (`awaits_reask`) goes before
    /// `pick`: it is of a higher class, or its hold ran out (`ran_out`) and it is of the same
    /// class and behind in virtual time.
    pub(super) fn goes_before(&self, released: Key, pick: Key, ran_out: bool) -> bool {
        let (Some(r), Some(p)) = (self.clients.get(&released), self.clients.get(&pick)) else {
            return false;
        };
        match r.spec.class.cmp(&p.spec.class) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Equal => ran_out && r.pass < p.pass,
        }
    }

    /// Whether the token waits for the next request of `key`, whose hold ended with a Release
    /// before its quota's end, rather than go to an opportunistic client: `key` is guaranteed
    /// and an opportunistic client waits for a turn.
    pub(super) fn released_before_opportunistic(&self, key: Key) -> bool {
        self.class_of(key) == Some(ClientClass::Guaranteed)
            && self.clients.iter().any(|(k, c)| {
                c.spec.class == ClientClass::Opportunistic && self.waits_for_turn(*k, c)
            })
    }

    /// Whether a guaranteed client holds the token or waits for a turn: an opportunistic
    /// client then co-runs with no one (its co-hold would share the GPU with the guaranteed
    /// holder, or with the turn the guaranteed client waits for).
    pub(super) fn guaranteed_active(&self) -> bool {
        let holder = self.holder.as_ref().map(|h| h.client);
        self.clients.iter().any(|(k, c)| {
            c.spec.class == ClientClass::Guaranteed
                && (holder == Some(*k) || self.waits_for_turn(*k, c))
        })
    }

    /// The longest turn opportunistic `key` may take now (`None`: no cut, for a guaranteed
    /// client or with no guaranteed one about): until the first guaranteed client that waits
    /// for a turn may take one (it is held back by its limit or pacing, or `key` would not have
    /// been picked), else the min quota while a guaranteed client held the token in the last
    /// 100 ms (it is on the CPU between two launches, and asks again in a moment).
    ///
    /// Why the second: a launch-bound training loop at (0.5, 0.5), whose holds mostly end with
    /// the idle thread's Release and whose next request comes 1 ms later, waited each time for a
    /// whole opportunistic turn of its quota estimate, and was charged 0.33 (the simulation,
    /// `sim_priority.rs`).
    pub(super) fn leftover_turn(&self, key: Key, now: Micros) -> Option<Micros> {
        if self.class_of(key)? != ClientClass::Opportunistic {
            return None;
        }
        let min = self.params.min_quota_us;
        let guaranteed = |k: &Key| self.class_of(*k) == Some(ClientClass::Guaranteed);
        let next = self
            .clients
            .iter()
            .filter(|(k, c)| guaranteed(k) && self.waits_for_turn(**k, c))
            .filter_map(|(k, _)| self.ready_at(*k, now))
            .min();
        let until = match next {
            Some(t) => t.saturating_sub(now).max(min),
            None => self
                .recent_holders(now)
                .iter()
                .any(guaranteed)
                .then_some(min)?,
        };
        // Its usual drain runs on past the turn: the turn leaves room for it (as a capped
        // client's turn under full contention does, `full_turn_grant`).
        let drain = self.clients.get(&key).map_or(0, |c| c.drain_us);
        Some(dispatch::full_turn_grant(
            until,
            drain,
            self.turn_includes_drain,
        ))
    }

    /// Whether opportunistic `key` must wait for its co-hold while a guaranteed client is active
    /// (`guaranteed_active`); it is served when that one's hold ends.
    pub(super) fn co_waits_for_guaranteed(&self, key: Key) -> bool {
        self.class_of(key) == Some(ClientClass::Opportunistic) && self.guaranteed_active()
    }
}
