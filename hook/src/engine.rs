//! The time this process's contexts held the GPU's compute engine, from CUPTI's
//! context-switch records (`cupti.rs` reads them), reported to gem-schd in Busy frames
//! (`Busy::engine_us`), which charges a capped co-runner by it instead of its wall time.
//!
//! Where the driver time-slices contexts, each switch in (START) and out (END) of a context is a
//! record, so the sum of a context's slices is an upper bound on its GPU time, and a much closer
//! one than the wall time of its holds when another context runs beside it. The records come
//! late (flushed every few ms) and on a clock of their own, 0.1 to a few ms off CUPTI's
//! timestamp clock and drifting: a slice still open at a report is counted up to an estimate of
//! now on the records' clock that is never later than now (`Slices::delivered`), and the rest of
//! it comes with its END record. The records may name other processes' contexts too: only this process's own are counted
//! (`Slices::take`), each context booked apart.
//!
//! Buffers may come back out of order (with flushes that hand back only full buffers, several
//! at a time): a switch out may come before the switch in that opened its slice. Each context's
//! records are booked in their own order: one older than the newest booked is dropped, and a
//! switch out with no slice open counts from the context's newest record before it, and nothing
//! as its first. (Counted from when the records were turned on every time, such switch outs
//! made a GPT training loop report 3,987 s of engine time over 17.6 s on an H200, up to 69 s
//! at once. Counted so only as a context's first, they still made one report of 3.16 s where
//! the records came late: the turn-on maps onto the records' clock through a lower bound on the
//! offset, as early as they are late.) So a reordering costs the books at most the gaps around
//! the slices it moved; a context already in when the records were turned on loses its first
//! slice's time.
//!
//! An idle context can stay switched in until another one switches in, and that switch out may
//! come seconds later (with flushes that hand back only full buffers, batch-1 decode's first
//! report after idling 5 s read 3.2-5.5 s on H200s). So the hook names the spells in which its
//! process runs nothing on a device (`Slices::idle` at a drained hold's end, `Slices::resumed`
//! at the next hold), and no record counts time inside one.
//!
//! Where the records come late, a slice counted up to now may have ended already. What was
//! counted past a switch out stays counted, and no instant of a context is counted twice: its
//! later slices count only past what was counted. So a late end makes the reports err high,
//! never low, and they never sum to more than the time that passed. (Taking the excess back
//! from the next reports would make them err low: gem-schd keeps engine time reported outside
//! a co-hold in a ledger that the client's turns pay off too, so what a turn paid would be
//! taken back twice, and the co-holds after it charged less than the engine time they held.)
//!
//! This file is the pure bookkeeping; it is unit-tested without a GPU.

/// Switch-record operations (CUPTI's `CUpti_ComputeEngineCtxSwitchOperationType`).
pub const SWITCHED_IN: u32 = 1;
pub const SWITCHED_OUT: u32 = 2;

/// How long a lower bound on the records' clock offset is kept before a fresher one replaces it
/// (the offset drifts by 3-14 µs a second on H200 hosts).
const OFFSET_KEPT_NS: u64 = 2_000_000_000;

/// How many idle spells a context keeps (the oldest goes first); a spell ends a few ms to
/// seconds before the records that close it come.
const IDLE_KEPT: usize = 8;

/// One context's books (records' clock).
#[derive(Debug, Clone)]
struct Context {
    id: u32,
    /// Its newest record booked (`None`: none yet, it was named idle first).
    newest: Option<u64>,
    /// Where its slice started, while one is open.
    open: Option<u64>,
    /// Up to when its time is counted: nothing before is counted again.
    counted_to: u64,
    /// Its ended slices' time not yet reported, ns.
    done: u64,
    /// Spells in which its process ran nothing on the device (`u64::MAX`: not yet over), not
    /// counted whatever the records say: an idle context may stay switched in.
    idle: Vec<(u64, u64)>,
}

impl Context {
    fn new(id: u32) -> Self {
        Context {
            id,
            newest: None,
            open: None,
            counted_to: 0,
            done: 0,
            idle: Vec::new(),
        }
    }

    /// Counts its time from `from` to `to`, less what was counted of it already and its idle
    /// spells.
    fn count(&mut self, from: u64, to: u64) -> u64 {
        let from = from.max(self.counted_to);
        if to <= from {
            return 0;
        }
        self.counted_to = to;
        let idle: u64 = self
            .idle
            .iter()
            .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
            .sum();
        // Spells wholly counted past are done with.
        self.idle.retain(|&(_, b)| b > to);
        (to - from).saturating_sub(idle)
    }

    /// Its open slice, if any, ended at `end`.
    fn close(&mut self, end: u64) {
        if let Some(start) = self.open.take() {
            let d = self.count(start, end);
            self.done = self.done.saturating_add(d);
        }
    }
}

/// The books of the engine time held.
#[derive(Debug, Default)]
pub struct Slices {
    /// Every context named by a switch record so far.
    contexts: Vec<Context>,
    /// Lower bounds on (records' clock − CUPTI's clock), the newest and the one before,
    /// each with when it was taken (CUPTI's clock).
    offset: [Option<(i64, u64)>; 2],
    /// The contexts named by records so far (the first few), for the log.
    seen: Vec<u32>,
}

impl Slices {
    /// Books for records just turned on.
    pub fn new() -> Self {
        Self::default()
    }

    /// One switch record: context `ctx` switched in or out (`op`) at `ts` (records' clock).
    /// Another operation, or a record older than the context's newest booked, is ignored.
    pub fn record(&mut self, ctx: u32, ts: u64, op: u32) {
        if self.seen.len() < 8 && !self.seen.contains(&ctx) {
            self.seen.push(ctx);
        }
        if op != SWITCHED_IN && op != SWITCHED_OUT {
            return;
        }
        let c = self.context(ctx);
        if c.newest.is_some_and(|n| ts < n) {
            return;
        }
        let before = c.newest.replace(ts);
        if op == SWITCHED_IN {
            // A START without the END before it (a dropped record): the slice ran to here.
            c.close(ts);
            c.open = Some(ts);
        } else if c.open.is_some() {
            c.close(ts);
        } else if let Some(from) = before {
            // Its switch in came in a buffer not yet read, or was lost: held since its record
            // before this one at most. As its first record, held since before the records were
            // turned on, which cannot be told on their clock where they come late: not counted.
            let d = c.count(from, ts);
            c.done = c.done.saturating_add(d);
        }
    }

    /// The books of context `ctx`, new ones empty.
    fn context(&mut self, ctx: u32) -> &mut Context {
        let i = match self.contexts.iter().position(|c| c.id == ctx) {
            Some(i) => i,
            None => {
                self.contexts.push(Context::new(ctx));
                self.contexts.len() - 1
            }
        };
        &mut self.contexts[i]
    }

    /// From `at` (CUPTI's clock) the process runs nothing in contexts `ids`: it released the
    /// token idle, its queue drained. Until [`Slices::resumed`], their records count nothing,
    /// not even a slice still open: an idle context can stay switched in until another
    /// context switches in, and that switch out may come seconds later.
    pub fn idle(&mut self, at: u64, ids: &[u32]) {
        let at = self.to_records_clock(at);
        for &id in ids {
            let c = self.context(id);
            if c.idle.last().is_some_and(|&(_, end)| end == u64::MAX) {
                continue;
            }
            if c.idle.len() == IDLE_KEPT {
                c.idle.remove(0);
            }
            c.idle.push((at, u64::MAX));
        }
    }

    /// Contexts `ids` may run work again from `at` (CUPTI's clock): their idle spell ends.
    pub fn resumed(&mut self, at: u64, ids: &[u32]) {
        let at = self.to_records_clock(at);
        for c in self.contexts.iter_mut().filter(|c| ids.contains(&c.id)) {
            if let Some(spell) = c.idle.last_mut().filter(|(_, end)| *end == u64::MAX) {
                spell.1 = at.max(spell.0);
            }
        }
    }

    /// A buffer whose newest switch record is `newest` (records' clock) came at `at` (CUPTI's
    /// clock): the record happened before `at`, so `newest − at` is at most the offset between
    /// the clocks. The largest such bound lately is the estimate (a lower bound).
    pub fn delivered(&mut self, newest: u64, at: u64) {
        let bound = (newest as i128 - at as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        match &mut self.offset {
            [Some((b, taken)), _] if at.saturating_sub(*taken) < OFFSET_KEPT_NS => {
                *b = (*b).max(bound);
            }
            o => {
                o[1] = o[0];
                o[0] = Some((bound, at));
            }
        }
    }

    /// The contexts named by records so far (up to 8).
    pub fn seen(&self) -> &[u32] {
        &self.seen
    }

    /// The offset estimate: the larger of the two latest bounds (0 before any).
    fn offset(&self) -> i64 {
        self.offset
            .iter()
            .flatten()
            .map(|(b, _)| *b)
            .max()
            .unwrap_or(0)
    }

    fn to_records_clock(&self, t: u64) -> u64 {
        (t as i128 + self.offset() as i128).clamp(0, u64::MAX as i128) as u64
    }

    /// The engine time contexts `ids` held since the last call, ns, with slices still open
    /// counted up to `now` (CUPTI's clock) as the records' clock reads it at most. The ended
    /// slices of contexts not the process's (not in `process`) are dropped; those of its other
    /// contexts (on other devices) wait for their own call.
    pub fn take(&mut self, now: u64, ids: &[u32], process: &[u32]) -> u64 {
        let now = self.to_records_clock(now);
        let mut held = 0u64;
        for c in &mut self.contexts {
            if !ids.contains(&c.id) {
                if !process.contains(&c.id) {
                    c.done = 0;
                }
                continue;
            }
            held = held.saturating_add(std::mem::take(&mut c.done));
            if let Some(start) = c.open {
                held = held.saturating_add(c.count(start, now));
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;
    /// The contexts of this process in these tests.
    const OWN: &[u32] = &[1, 2, 3, 7, 9];

    /// The time contexts `ids` held, all of them the process's.
    fn take(s: &mut Slices, now: u64, ids: &[u32]) -> u64 {
        s.take(now, ids, ids)
    }

    #[test]
    fn only_the_processs_own_contexts_count() {
        // Context 5 is another process's: its slices between this one's are not this one's.
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.record(7, 12 * MS, SWITCHED_OUT);
        s.record(5, 12 * MS, SWITCHED_IN);
        s.record(5, 15 * MS, SWITCHED_OUT);
        s.record(5, 16 * MS, SWITCHED_IN);
        assert_eq!(take(&mut s, 20 * MS, &[7]), 2 * MS);
        s.record(5, 21 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 22 * MS, &[7]), 0);
        // Known later, its time since the last report counts.
        s.record(5, 23 * MS, SWITCHED_IN);
        s.record(5, 24 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 25 * MS, &[5, 7]), MS);
    }

    #[test]
    fn ended_slices_add_up() {
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.record(7, 12 * MS, SWITCHED_OUT);
        s.record(7, 20 * MS, SWITCHED_IN);
        s.record(7, 23 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 30 * MS, OWN), 5 * MS);
        assert_eq!(take(&mut s, 40 * MS, OWN), 0);
    }

    #[test]
    fn an_open_slice_is_counted_to_now_and_its_rest_at_its_end() {
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.delivered(10 * MS, 10 * MS);
        assert_eq!(take(&mut s, 14 * MS, OWN), 4 * MS);
        assert_eq!(take(&mut s, 15 * MS, OWN), MS);
        s.record(7, 18 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 19 * MS, OWN), 3 * MS);
    }

    #[test]
    fn an_open_slice_never_runs_ahead_of_the_records_clock() {
        // The records' clock reads 2 ms behind CUPTI's: now on it is 2 ms earlier.
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.delivered(10 * MS, 12 * MS);
        assert_eq!(take(&mut s, 14 * MS, OWN), 2 * MS);
        s.record(7, 13 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 16 * MS, OWN), MS);
        // Ahead by 3 ms: a slice that started at 20 on the records' clock is at 1 ms at 18.
        let mut s = Slices::new();
        s.record(7, 20 * MS, SWITCHED_IN);
        s.delivered(20 * MS, 17 * MS);
        assert_eq!(take(&mut s, 18 * MS, OWN), MS);
    }

    #[test]
    fn the_offset_is_the_largest_recent_bound() {
        let mut s = Slices::new();
        s.delivered(10 * MS, 12 * MS);
        s.delivered(11 * MS, 11 * MS + MS / 2);
        assert_eq!(s.offset(), -(MS as i64) / 2);
        // Two seconds on, a new bound starts; the one before still counts once.
        s.delivered(3000 * MS, 3004 * MS);
        assert_eq!(s.offset(), -(MS as i64) / 2);
        s.delivered(6000 * MS, 6004 * MS);
        assert_eq!(s.offset(), -4 * MS as i64);
    }

    #[test]
    fn contexts_are_booked_apart_and_odd_records_cost_nothing() {
        let mut s = Slices::new();
        // Switched out first: held since before the records were turned on, not counted.
        s.record(1, 8 * MS, SWITCHED_OUT);
        s.record(2, 10 * MS, SWITCHED_IN);
        s.record(2, 11 * MS, 0);
        s.record(1, 11 * MS, SWITCHED_IN);
        s.record(2, 12 * MS, SWITCHED_OUT);
        // A second START of context 1: its slice ended there.
        s.record(1, 13 * MS, SWITCHED_IN);
        s.record(1, 14 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 0, OWN), (2 + 2 + 1) * MS);
        // Timestamps at the type's limits saturate, never wrap.
        s.record(3, u64::MAX, SWITCHED_IN);
        s.record(3, 0, SWITCHED_OUT);
        s.delivered(u64::MAX, 0);
        s.delivered(0, u64::MAX);
        assert_eq!(take(&mut s, u64::MAX, OWN), 0);
    }

    #[test]
    fn a_switch_out_without_its_switch_in_counts_from_the_contexts_record_before() {
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.record(7, 12 * MS, SWITCHED_OUT);
        // The switch in at 20 ms comes in a later buffer: the switch out at 23 ms counts from
        // 12 ms, not from when the records were turned on, and the late switch in is dropped.
        s.record(7, 23 * MS, SWITCHED_OUT);
        s.record(7, 20 * MS, SWITCHED_IN);
        assert_eq!(take(&mut s, 30 * MS, OWN), (2 + 11) * MS);
        assert_eq!(take(&mut s, 40 * MS, OWN), 0);
    }

    #[test]
    fn time_counted_past_a_late_switch_out_stays_counted_once() {
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.delivered(10 * MS, 10 * MS);
        // Counted up to 20 ms; the switch out at 12 ms comes after.
        assert_eq!(take(&mut s, 20 * MS, OWN), 10 * MS);
        s.record(7, 12 * MS, SWITCHED_OUT);
        // A slice inside what was counted already adds nothing; one across its end, its part
        // past it; later ones, all of their time.
        s.record(7, 14 * MS, SWITCHED_IN);
        s.record(7, 17 * MS, SWITCHED_OUT);
        s.record(7, 19 * MS, SWITCHED_IN);
        s.record(7, 24 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 25 * MS, OWN), 4 * MS);
        s.record(7, 30 * MS, SWITCHED_IN);
        s.record(7, 36 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 40 * MS, OWN), 6 * MS);
        // In all 20 ms for the slices' 2 + 3 + 5 + 6: high by the 4 ms out between 12 and 20,
        // never low, and never more than the 40 ms that passed.
    }

    #[test]
    fn an_idle_spell_counts_nothing_though_its_switch_out_comes_late() {
        // Batch-1 decode: released idle at 12 ms with its context still in; another context
        // switched in at 15 ms, but that switch out sits in a buffer until after it resumes.
        let mut s = Slices::new();
        s.record(7, 10 * MS, SWITCHED_IN);
        s.delivered(10 * MS, 10 * MS);
        assert_eq!(take(&mut s, 12 * MS, OWN), 2 * MS);
        s.idle(12 * MS, &[7]);
        s.resumed(5_000 * MS, &[7]);
        assert_eq!(take(&mut s, 5_000 * MS, OWN), 0);
        s.record(7, 15 * MS, SWITCHED_OUT);
        s.record(7, 5_001 * MS, SWITCHED_IN);
        s.record(7, 5_003 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 5_004 * MS, OWN), 2 * MS);
    }

    #[test]
    fn records_that_come_after_an_idle_spell_count_up_to_it() {
        let mut s = Slices::new();
        s.record(7, 2 * MS, SWITCHED_IN);
        s.record(7, 4 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 5 * MS, OWN), 2 * MS);
        // A slice from 6 ms on, its records not yet come when the process goes idle at 8 ms.
        s.idle(8 * MS, &[7]);
        s.resumed(20 * MS, &[7]);
        assert_eq!(take(&mut s, 20 * MS, OWN), 0);
        s.record(7, 6 * MS, SWITCHED_IN);
        s.record(7, 11 * MS, SWITCHED_OUT);
        s.record(7, 21 * MS, SWITCHED_IN);
        s.record(7, 22 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 23 * MS, OWN), (2 + 1) * MS);
        // A spell on a context the records have not named yet holds for it too.
        s.idle(30 * MS, &[3]);
        s.resumed(40 * MS, &[3]);
        s.record(3, 35 * MS, SWITCHED_IN);
        s.record(3, 42 * MS, SWITCHED_OUT);
        assert_eq!(take(&mut s, 43 * MS, OWN), 2 * MS);
    }

    #[test]
    fn contexts_on_another_device_wait_for_their_own_report() {
        // Contexts 1 and 2 are this process's, on two devices; 5 is another process's.
        let mut s = Slices::new();
        for ctx in [1, 2, 5] {
            s.record(ctx, 10 * MS, SWITCHED_IN);
            s.record(ctx, 13 * MS, SWITCHED_OUT);
        }
        assert_eq!(s.take(20 * MS, &[1], &[1, 2]), 3 * MS);
        assert_eq!(s.take(21 * MS, &[1], &[1, 2]), 0);
        assert_eq!(s.take(22 * MS, &[2, 5], &[1, 2, 5]), 3 * MS);
        // One device idle: the other's slices still count.
        s.record(1, 30 * MS, SWITCHED_IN);
        s.record(2, 30 * MS, SWITCHED_IN);
        s.idle(30 * MS, &[2]);
        assert_eq!(s.take(34 * MS, &[1], &[1, 2]), 4 * MS);
        assert_eq!(s.take(34 * MS, &[2], &[1, 2]), 0);
    }

    /// The switch records of slices given as (gap before, length), one after the other from 0,
    /// with the last one's end and the slices' total length.
    fn switches(slices: &[(u64, u64)]) -> (Vec<(u64, u32)>, u64, u64) {
        let mut events = Vec::new();
        let (mut t, mut total) = (0, 0);
        for &(gap, len) in slices {
            t += gap;
            events.push((t, SWITCHED_IN));
            t += len;
            events.push((t, SWITCHED_OUT));
            total += len;
        }
        (events, t, total)
    }

    proptest! {
        /// Records that come late: a slice may be counted past its end meanwhile, so once all
        /// have come the reports add up to at least the slices, by at most the time each report
        /// counted past them, and never to more than the time that passed.
        #[test]
        fn late_records_add_up_to_the_slices(
            slices in prop::collection::vec((1u64..5_000, 1u64..5_000), 1..40),
            takes in prop::collection::vec((0u64..100_000, 0u64..10_000), 0..30),
        ) {
            let (events, t, total) = switches(&slices);
            let mut takes = takes;
            takes.sort();
            let mut s = Slices::new();
            let (mut next, mut reported, mut ahead, mut last_now) = (0, 0, 0, 0);
            for (now, late) in takes {
                last_now = now;
                // The records up to `late` before now have come.
                while next < events.len() && events[next].0 + late <= now {
                    s.record(9, events[next].0, events[next].1);
                    next += 1;
                }
                if next > 0 {
                    s.delivered(events[next - 1].0, now);
                }
                reported += take(&mut s, now, OWN);
                prop_assert!(reported <= now, "{reported} reported by {now}");
                // An open slice is counted at most `late` past where it may have ended.
                ahead += late;
            }
            for &(ts, op) in &events[next..] {
                s.record(9, ts, op);
            }
            reported += take(&mut s, t + 100_000, OWN);
            prop_assert!(reported >= total, "{reported} reported for {total}");
            prop_assert!(reported <= total + ahead, "{reported} for {total}, {ahead} ahead");
            prop_assert!(reported <= t.max(last_now));
        }

        /// Idle spells between the process's reports: whenever the records come, the time in
        /// them is never reported, and the slices' time outside them is, once.
        #[test]
        fn idle_spells_are_never_reported(
            slices in prop::collection::vec((1u64..5_000, 1u64..5_000), 1..40),
            spells in prop::collection::vec((0u64..100_000, 1u64..20_000), 0..6),
            late in 0u64..30_000,
        ) {
            let (events, t, _) = switches(&slices);
            // Spells apart from each other, sorted.
            let mut spells = spells;
            spells.sort();
            let mut apart: Vec<(u64, u64)> = Vec::new();
            for (a, len) in spells {
                if apart.last().is_none_or(|&(_, b)| a > b) {
                    apart.push((a, a + len));
                }
            }
            let outside = |(from, to): (u64, u64)| -> u64 {
                let inside: u64 =
                    apart.iter().map(|&(a, b)| b.min(to).saturating_sub(a.max(from))).sum();
                (to - from) - inside
            };
            let work: u64 = events.chunks(2).map(|p| outside((p[0].0, p[1].0))).sum();
            // Reports at each spell's ends, records `late` behind them.
            let mut s = Slices::new();
            let (mut next, mut reported, mut ahead) = (0, 0, 0);
            let mut deliver = |s: &mut Slices, now: u64| {
                while next < events.len() && events[next].0 + late <= now {
                    s.record(9, events[next].0, events[next].1);
                    next += 1;
                }
                s.delivered(now, now);
            };
            for &(a, b) in &apart {
                deliver(&mut s, a);
                reported += take(&mut s, a, OWN);
                ahead += late;
                s.idle(a, &[9]);
                deliver(&mut s, b);
                s.resumed(b, &[9]);
                reported += take(&mut s, b, OWN);
            }
            let end = t.max(apart.last().map_or(0, |s| s.1)) + late;
            deliver(&mut s, end);
            reported += take(&mut s, end, OWN);
            prop_assert!(reported >= work, "{reported} reported for {work}");
            prop_assert!(reported <= work + ahead, "{reported} for {work}, {ahead} ahead");
        }

        /// Buffers handed back in any order: the engine time reported never exceeds the time
        /// that passed since the records were turned on, and in order it is exact.
        #[test]
        fn reordered_buffers_never_report_more_than_the_time_that_passed(
            slices in prop::collection::vec((1u64..5_000, 1u64..5_000), 1..40),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
            order in any::<u64>(),
        ) {
            let (events, t, total) = switches(&slices);
            // Cut into buffers, handed back in an order drawn from `order`.
            let mut at: Vec<usize> = cuts.iter().map(|c| c.index(events.len())).collect();
            at.push(events.len());
            at.sort();
            at.dedup();
            let mut buffers = Vec::new();
            let mut from = 0;
            for to in at {
                buffers.push(events[from..to].to_vec());
                from = to;
            }
            let in_order = buffers.len() <= 1;
            let mut state = order | 1;
            for i in (1..buffers.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                buffers.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let mut s = Slices::new();
            let (mut newest, mut reported) = (0, 0);
            for b in buffers {
                for &(ts, op) in &b {
                    s.record(9, ts, op);
                    newest = newest.max(ts);
                }
                s.delivered(newest, newest);
                reported += take(&mut s, newest, OWN);
                prop_assert!(reported <= newest, "{reported} reported by {newest}");
            }
            reported += take(&mut s, t, OWN);
            prop_assert!(reported <= t);
            if in_order {
                prop_assert_eq!(reported, total);
            }
        }

        /// Whatever the order of the reports, the engine time reported adds up to the slices'
        /// total once they have ended, and never more.
        #[test]
        fn reports_add_up_to_the_slices(
            slices in prop::collection::vec((1u64..5_000, 1u64..5_000), 1..50),
            takes in prop::collection::vec(0u64..50_000, 0..20),
        ) {
            let mut s = Slices::new();
            let (events, end, total) = switches(&slices);
            let mut reported = 0;
            let mut takes = takes;
            takes.sort();
            let mut takes = takes.into_iter().peekable();
            for (ts, op) in events {
                while let Some(now) = takes.next_if(|n| *n < ts) {
                    s.delivered(now, now);
                    reported += take(&mut s, now, OWN);
                    prop_assert!(reported <= total);
                }
                s.record(9, ts, op);
            }
            reported += take(&mut s, end, OWN);
            prop_assert_eq!(reported, total);
        }
    }
}
