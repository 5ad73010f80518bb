//! Engine time: a capped co-runner charged the time its contexts held the GPU's compute engine
//! instead of its co-holds' wall length.
//!
//! A capped client's GPU time never exceeds the wall time it holds the token or a co-hold, so
//! charging that keeps its limit whatever its fills read (`corun.rs`). Beside another context
//! the wall time is a loose bound: the driver time-slices the two, and on an H200 a GPT
//! training loop co-holding beside batch-1 decode held the engine 2.41 s of 3.08 s of co-holds
//! (2.19 s of kernels inside its slices). The time a context held the engine, which the hook
//! reads from CUPTI's context-switch records (gem-proto `Busy::engine_us`), is also an upper
//! bound on its GPU time, and a much closer one.
//!
//! The records come a few ms late: a report sent at a co-hold's end lacks the last slices, and
//! its next report carries them, maybe in a turn. So each capped client keeps a ledger of
//! engine time reported and not yet charged (`owed`):
//! - a report in a co-hold moves the ledger into the co-hold;
//! - a co-hold is charged that, plus its wall time since its last report, never more than its
//!   wall length; what its wall length could not take goes back to the ledger;
//! - a report in a turn first pays with the turn: a capped turn is charged its whole wall
//!   length, which covers the turn's own engine time and late slices up to that length.
//!
//! So over any stretch the charges are at least the engine time reported, less the ledger
//! (late slices of the last few ms), and never more than the wall-time rule's. A co-hold with
//! a report lacking engine time (a hook without CUPTI 13.2, or whose readings ended), with none
//! at all, or with more than one process is charged its wall length.

use super::*;

/// What a co-hold's reports said of the engine time it held.
#[derive(Debug, Clone, Default)]
pub(super) struct CoEngine {
    /// Engine time moved into it from its client's ledger.
    held_us: Micros,
    /// Its last report with engine time (`None`: none yet): its time since counts whole.
    reported_at: Option<Micros>,
    /// A report in it lacked engine time, or a second process joined it: its wall length.
    unmeasured: bool,
}

impl CoEngine {
    /// The charge for a co-hold whose time runs from `start` to `end`: its engine time, its wall
    /// time since its last report, never more than its wall length; its wall length unless
    /// measured.
    pub(super) fn charge(&self, start: Micros, end: Micros) -> Micros {
        let wall = end.saturating_sub(start);
        match self.reported_at {
            Some(at) if !self.unmeasured => wall.min(
                self.held_us
                    .saturating_add(end.saturating_sub(at.max(start))),
            ),
            _ => wall,
        }
    }

    /// What its charge from `start` to `end` leaves of the engine time moved into it.
    pub(super) fn left_over(&self, start: Micros, end: Micros) -> Micros {
        if self.unmeasured {
            return 0;
        }
        self.held_us.saturating_sub(self.charge(start, end))
    }

    /// A report in it lacked engine time, or a second process joined it (their reports cannot
    /// be told apart by process): charged its wall length.
    pub(super) fn set_unmeasured(&mut self) {
        self.unmeasured = true;
    }
}

impl Core {
    /// The engine time of a Busy report of client `key` at `now` (`in_co`: sent in a co-hold):
    /// `engine_us` held since the process's last report (`None`: not measured), over `held_us`
    /// of holds. Used for capped clients only; see the module comment.
    pub(super) fn book_engine(
        &mut self,
        now: Micros,
        key: Key,
        in_co: bool,
        engine_us: Option<Micros>,
        held_us: Micros,
    ) {
        let window = self.params.window_us;
        let Some(c) = self.clients.get_mut(&key) else {
            return;
        };
        if !c.charged_in_wall_time() {
            return;
        }
        let owed = &mut c.co.engine_owed_us;
        match (c.co.hold.as_mut().filter(|_| in_co), engine_us) {
            (Some(h), None) => h.engine.set_unmeasured(),
            (Some(h), Some(e)) => {
                h.engine.held_us = h
                    .engine
                    .held_us
                    .saturating_add(std::mem::take(owed).saturating_add(e));
                h.engine.reported_at = Some(now);
            }
            (None, Some(e)) => *owed = owed.saturating_add(e).saturating_sub(held_us),
            (None, None) => {}
        }
        // Engine time beyond a window's length is no reading of this GPU's clock.
        *owed = (*owed).min(window);
    }

    /// A capped client's engine time reported and not yet charged, in µs.
    pub fn engine_owed_us(&self, id: &str) -> Option<Micros> {
        self.ids.get(id).map(|k| self.clients[k].co.engine_owed_us)
    }
}
