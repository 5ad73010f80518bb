//! A new resource config: clients that stay keep their place (a changed share or class starts a
//! new account, carrying the last pacing window at the new limit), clients that left are dropped
//! and their waiting requests refused, new clients start empty.

use super::*;

impl Core {
    /// The config changed: clients that stay keep their history and quota estimate
    /// (their limits take effect now); clients that left are dropped, their waiting
    /// requests answered Error{1}.
    pub fn set_config(&mut self, now: Micros, specs: &[ClientSpec]) -> Vec<Action> {
        let mut out = Vec::new();
        self.expire(now);
        let keep: HashMap<&str, &ClientSpec> = specs.iter().map(|s| (s.id.as_str(), s)).collect();
        let mut gone: Vec<(String, Key)> = self
            .ids
            .iter()
            .filter(|(id, _)| !keep.contains_key(id.as_str()))
            .map(|(id, k)| (id.clone(), *k))
            .collect();
        gone.sort_unstable_by_key(|(_, k)| *k);
        for (id, key) in gone {
            if self.holder.as_ref().is_some_and(|h| h.client == key) {
                self.end_hold(now, |_| now);
            }
            self.ids.remove(&id);
            // Its hold may have ended at its quota before it left: nobody is "the last holder"
            // any more (dispatch would look up a client that is gone).
            if self.asked_again == Some(key) {
                self.asked_again = None;
            }
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
                        changed = (c.spec.request_milli, c.spec.limit_milli, c.spec.class)
                            != (spec.request_milli, spec.limit_milli, spec.class);
                        c.spec = spec.clone();
                    }
                    if changed {
                        self.forget_usage(now, k);
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
                            drain_us: 0,
                            usage_sum: 0,
                            carried: Vec::new(),
                            pass: 0,
                            blocked: false,
                            waiting: Vec::new(),
                            waiting_since: 0,
                            waiting_at: 0,
                            last_entry: None,
                            conns: 0,
                            mem_used: 0,
                            fill: Default::default(),
                            busy_mark: now,
                            co: Default::default(),
                        },
                    );
                }
            }
        }
        // A co-runner that left no longer shares the GPU with the holder.
        self.refresh_boost(now);
        self.dispatch(now, &mut out);
        out
    }

    /// A client's share or class changed: its past usage was measured against the old share
    /// (its virtual time among another class), so it starts a new account (its running hold
    /// or co-hold, if any, stays charged; its ended co-holds' charges go with the old one).
    /// Judged against its new limit, a client that shrinks from 0.7 to
    /// 0.3 would otherwise wait seconds at zero until its window forgot the old usage. Its old entries stay in the history (they still
    /// keep later holds from overlapping), re-keyed to no client. For pacing, the new account
    /// carries the last pacing window as if used at the new limit, so that its allowance grows
    /// at that rate from here: with nothing carried, a client shrunk to 0.3 spent its whole
    /// allowance of the next second at once whenever its neighbour paused between bursts, ran
    /// ahead of it in virtual time, and then waited 0.4 s at zero (the simulation; 0.2–0.3 s on
    /// an H100).
    fn forget_usage(&mut self, now: Micros, key: Key) {
        let hold = self
            .holder
            .as_ref()
            .filter(|h| h.client == key)
            .map(|h| h.seq);
        let mut kept = 0;
        let mut hold_start = None;
        for (i, e) in self.history.iter_mut().enumerate() {
            if e.client != key {
                continue;
            }
            if Some(self.first_seq + i as u64) == hold {
                kept += e.end - e.start;
                hold_start = Some(e.start);
            } else {
                e.client = FORGOTTEN;
            }
        }
        let floor = self.pass_floor(key, now);
        let pace = self.pace_window();
        if let Some(c) = self.clients.get_mut(&key) {
            c.usage_sum = kept;
            c.co.forget_charges();
            c.pass = floor.unwrap_or(0);
            c.carried = carried_pacing(
                now.saturating_sub(pace),
                hold_start.unwrap_or(now).min(now),
                c.spec.limit_milli,
            );
        }
    }
}

/// Usage at `limit_milli` spread evenly over `[from, to)`, in [`CARRIED_PIECES`] pieces, each
/// at the start of its slice (what [`Core::forget_usage`] carries into a new account).
pub(super) fn carried_pacing(from: Micros, to: Micros, limit_milli: u16) -> Vec<(Micros, Micros)> {
    let span = to.saturating_sub(from);
    if span == 0 || limit_milli == 0 || limit_milli >= 1000 {
        return Vec::new();
    }
    let slice = span / CARRIED_PIECES;
    let used = slice * Micros::from(limit_milli) / 1000;
    if used == 0 {
        return Vec::new();
    }
    (0..CARRIED_PIECES)
        .map(|i| {
            let s = from + i * slice;
            (s, s + used)
        })
        .collect()
}

/// How many pieces carried pacing usage comes in: its allowance grows in steps of a
/// twentieth of the pacing window.
const CARRIED_PIECES: Micros = 20;
