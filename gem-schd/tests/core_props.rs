//! Property tests of the core under random event sequences: every TokenRequest is
//! answered exactly once, one holder at a time (co-holds beside it when co-running is on,
//! only for clients whose fill is light, and none while a capped client holds a turn; a holder
//! that said it drains beside the next one, until its report), memory never granted past a
//! limit, and (liveness) every waiting request is eventually granted. A capped client is
//! charged its co-holds' wall length (no more, with engine time reported), and its usage stays
//! within its limit but for one grant and what its reports say it ran past its grants.
//! Classes: no opportunistic client is granted a turn, nor renewed, while a guaranteed client
//! waits that may take one, and a GPU of opportunistic clients only is scheduled exactly as one
//! of guaranteed clients only.

use std::collections::{HashMap, HashSet};

use gem_schd::core::{
    Action, ClientClass, ClientSpec, CoRunSettings, ConnId, Core, Micros, Params,
};
use proptest::prelude::*;

const IDS: [&str; 3] = ["a", "b", "c"];
/// The co-holds' quota in these runs.
const CO_QUOTA_US: Micros = 5_000;

#[derive(Debug, Clone)]
enum Op {
    Request(usize, Micros, Micros),
    Release(usize, Micros),
    Renew(usize, Micros),
    /// The holder's notice that it drains (a hook that does not renew).
    Drain(usize),
    /// A Renew, or a Drain, from the connection last granted a turn (the hook sends them at
    /// its quota's end: hand-overs at the drain need the holder's own).
    HolderRenew(Micros),
    HolderDrain,
    /// A TokenRequest with this overuse from a connection that drains (its report).
    DrainerAsks(Micros),
    Reconnect(usize),
    Alloc(usize, u64),
    Free(usize, u64),
    /// (client, request, limit, memory, opportunistic)
    Config(Vec<(usize, u16, u16, u64, bool)>),
    Advance(Micros),
    /// A Busy report: busy and held µs.
    Busy(usize, Micros, Micros),
    /// A Busy report with engine time (`None`: not measured) and held µs.
    Engine(usize, Option<Micros>, Micros),
    /// A Busy report of 600 ms held at this fill (in thousandths): enough for the fill to
    /// judge a start of co-running on.
    Fill(usize, u16),
    /// The connection says it parks its queue at a hold's end (gem-proto `Parks`).
    Parks(usize),
    /// The same from the connection last granted a turn.
    HolderParks,
    /// The connection's Grants say whether a hand-over is due at its end (its gate page).
    Told(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..6usize, 0..20_000u64, 0..50_000u64).prop_map(|(c, o, b)| Op::Request(c, o, b)),
        3 => (0..6usize, 0..100_000u64).prop_map(|(c, u)| Op::Release(c, u)),
        2 => (0..6usize, 0..50_000u64).prop_map(|(c, b)| Op::Renew(c, b)),
        1 => (0..6usize).prop_map(Op::Drain),
        3 => (0..50_000u64).prop_map(Op::HolderRenew),
        1 => Just(Op::HolderDrain),
        2 => (0..5_000u64).prop_map(Op::DrainerAsks),
        1 => (0..6usize).prop_map(Op::Reconnect),
        2 => (0..6usize, 0..700u64).prop_map(|(c, b)| Op::Alloc(c, b)),
        1 => (0..6usize, 0..700u64).prop_map(|(c, b)| Op::Free(c, b)),
        1 => prop::collection::vec(
            (0..3usize, 0..=1000u16, 1..=1000u16, 0..1500u64, any::<bool>()),
            0..4,
        )
        .prop_map(Op::Config),
        4 => (0..200_000u64).prop_map(Op::Advance),
        3 => (0..6usize, 0..60_000u64, 0..60_000u64).prop_map(|(c, b, h)| Op::Busy(c, b, h)),
        2 => (0..6usize, proptest::option::of(0..60_000u64), 0..60_000u64)
            .prop_map(|(c, e, h)| Op::Engine(c, e, h)),
        1 => (0..6usize, 0..1000u16).prop_map(|(c, f)| Op::Fill(c, f)),
        1 => (0..6usize).prop_map(Op::Parks),
        1 => Just(Op::HolderParks),
        2 => (0..6usize).prop_map(Op::Told),
    ]
}

/// The clients' classes in a run.
#[derive(Debug, Clone, Copy)]
enum Classes {
    /// As each config entry says.
    AsDrawn,
    /// Every client of this class.
    All(ClientClass),
}

fn specs(v: &[(usize, u16, u16, u64, bool)], classes: Classes) -> Vec<ClientSpec> {
    let mut seen = HashSet::new();
    v.iter()
        .filter(|(i, ..)| seen.insert(*i))
        .map(|&(i, req, lim, mem, opp)| ClientSpec {
            id: IDS[i].into(),
            request_milli: req.min(lim),
            limit_milli: lim,
            mem_limit: mem,
            class: match classes {
                Classes::All(c) => c,
                Classes::AsDrawn if opp => ClientClass::Opportunistic,
                Classes::AsDrawn => ClientClass::Guaranteed,
            },
        })
        .collect()
}

/// The observer: which connections wait, and which client each belongs to.
struct World {
    core: Core,
    now: Micros,
    /// Slot (0..6) -> current connection id and its client index.
    slots: Vec<(ConnId, usize)>,
    next_conn: ConnId,
    pending: HashSet<ConnId>,
    limits: HashMap<String, u64>,
    config: HashSet<String>,
    /// Connections that said Hello and whose client has not left since.
    live: HashSet<ConnId>,
    /// The co-running threshold (0: off).
    below: f64,
    /// The core's count of turns granted before the event being checked: a grant that is no new
    /// turn is a process joining its client's running hold (granted what is left of it,
    /// whatever waits).
    grants_before: u64,
    /// Every action, in order (to compare runs).
    trace: Vec<Action>,
    /// Connections that said they drain and were handed over from, until they report (a
    /// TokenRequest or a Release) or reconnect: the drain overlaps the next hold.
    draining: HashSet<ConnId>,
    /// Connections that said they drain and kept the token, until they report or hang up: the
    /// core waits for the report past the grace (`Core::expiry`), so a hang-up may be charged
    /// that wait.
    said_drain: HashSet<ConnId>,
    /// Connections that said they park: never handed over from at their notice.
    parks: HashSet<ConnId>,
    /// The connection last granted a turn.
    last_turn: Option<ConnId>,
    /// The client whose turn its gate page says no other client's kernels run beside
    /// (`Core::hold_shared` false at its grant, or when a config reload said it again).
    unshared_turn: Option<String>,
    /// A config reload in the event being checked: gem-schd says again, to every connection,
    /// whether its hold may be shared.
    restamp: bool,
    /// Each configured client's spec.
    configured: HashMap<String, ClientSpec>,
    /// Each client's co-holds as granted and ended (see `CoSeen`).
    co_seen: HashMap<String, CoSeen>,
    /// The largest time past its quota each of a client's connections reported (overuse, or a
    /// Release's use past its grant): the GPU ran its work that long, and it is charged for it.
    /// Per connection: each process's report stretches its own turn.
    overran: HashMap<String, HashMap<ConnId, Micros>>,
    /// The quota of the connection's last grant.
    quotas: HashMap<ConnId, Micros>,
    /// Each client's fill as judged for co-running before the event being checked.
    judged: HashMap<String, Option<f64>>,
    /// A client whose share changed while it held a turn or a co-hold: what either may be
    /// charged, and until when it may count in the window (its new account keeps them, granted
    /// at the old limit).
    kept: HashMap<String, Vec<(Micros, Micros)>>,
    /// Clients that reported engine time: their co-holds may be charged less than their wall
    /// length, never more.
    engine_reported: HashSet<String>,
}

/// A client's co-holds as the observer sees them: opened by a co-hold's Grant, joined by more,
/// left by each connection's next frame (a TokenRequest, a Release, a Renew granted again, a
/// hang-up).
#[derive(Debug, Default)]
struct CoSeen {
    /// The open co-hold (a process that joined after the others' last grant had run out, with
    /// its grace or reported drain, started a new stretch; the one before it counts as an ended
    /// co-hold).
    open: Option<OpenCo>,
    /// The ended ones (and ended stretches of the open one): (the end of their time, wall
    /// length as charged, whether the client was capped then).
    ended: Vec<(Micros, Micros, bool)>,
}

/// An open co-hold as the observer sees it.
#[derive(Debug)]
struct OpenCo {
    conns: HashSet<ConnId>,
    /// The start of its current stretch.
    start: Micros,
    /// Its last grant.
    last: Micros,
    /// The furthest past its quota a process of it reported running (overuse, or a Release's
    /// use past its grant) in this stretch.
    past: Micros,
}

impl OpenCo {
    /// How far its processes may have run: its last grant's quota, then the grace or the drain
    /// reported past it, whichever is longer.
    fn reach(&self, grace: Micros) -> Micros {
        self.last + CO_QUOTA_US + grace.max(self.past)
    }

    /// Its charge if it ends at `now`: its wall length, up to its reach.
    fn wall(&self, now: Micros, grace: Micros) -> Micros {
        now.min(self.reach(grace)).saturating_sub(self.start)
    }
}

impl World {
    fn check(&mut self, acts: Vec<Action>) -> Result<(), TestCaseError> {
        self.trace.extend(acts.iter().cloned());
        let mut granted_clients = HashSet::new();
        // A co-hold granted in this event after its last new turn, if any: the holder now held
        // the token when it was granted (a hold never ends after a grant in the same event).
        let mut co_after_turn: Option<String> = None;
        for a in acts {
            match a {
                Action::Grant {
                    client,
                    conns,
                    quota_us,
                } => {
                    prop_assert!(quota_us > 0);
                    for c in conns {
                        prop_assert!(self.pending.remove(&c), "grant to {c} without a request");
                        let slot = self.slots.iter().find(|s| s.0 == c).unwrap();
                        prop_assert_eq!(IDS[slot.1], client.as_str());
                        // (A process joining its client's running hold is no new turn.)
                        if self.core.in_co_hold(c) || self.core.grants() > self.grants_before {
                            self.check_capped_apart(&client)?;
                        }
                        if self.core.in_co_hold(c) {
                            // A co-hold runs beside the holder, granted to a light client
                            // only (its fill may rise before the co-hold ends), its fill as
                            // judged before the grant (after turns it was sent to, on those
                            // turns alone; a co-hold's grant starts its co-holds' fill over).
                            prop_assert!(self.below > 0.0, "{client} co-runs with co-running off");
                            let fill = self.judged.get(&client).copied().flatten();
                            prop_assert!(
                                fill.is_some_and(|f| f < self.below),
                                "{client} granted a co-hold at a fill of {fill:?}"
                            );
                            co_after_turn = Some(client.clone());
                            self.co_join(&client, c);
                        } else {
                            self.check_turn(&client)?;
                            self.last_turn = Some(c);
                            granted_clients.insert(client.clone());
                            if self.core.grants() > self.grants_before {
                                co_after_turn = None;
                            }
                        }
                        self.quotas.insert(c, quota_us);
                    }
                }
                // A second request on a waiting connection is refused (code 4) and
                // leaves the first one waiting; other errors answer it.
                Action::Error { conn, code, .. } if code != gem_proto::code::PROTOCOL_MISUSE => {
                    self.pending.remove(&conn);
                }
                Action::Soon { conns } => {
                    // Only to requests that wait, and never an answer.
                    for c in &conns {
                        prop_assert!(
                            self.pending.contains(c),
                            "Soon to conn {c}, which does not wait"
                        );
                    }
                }
                Action::Error { .. } | Action::Yield { .. } => {}
            }
        }
        prop_assert!(granted_clients.len() <= 1, "one holder at a time");
        if let Some(x) = granted_clients.iter().next() {
            self.unshared_turn = (!self.core.hold_shared(x)).then(|| x.clone());
        }
        if std::mem::take(&mut self.restamp) {
            self.unshared_turn = self
                .core
                .holder()
                .filter(|h| !self.core.hold_shared(h))
                .map(str::to_owned);
        }
        // A turn told it is not shared has no other client's co-hold beside it while it is the
        // holder's: a parking hook relies on that to tell where the GPU stopped.
        if let Some(x) = self.unshared_turn.as_deref()
            && self.core.holder() == Some(x)
        {
            for id in self.config.iter().filter(|id| id.as_str() != x) {
                prop_assert!(
                    !self.core.co_running(id),
                    "{id} co-runs beside {x}'s turn, told it is not shared"
                );
            }
        }
        if let Some(h) = self.core.holder() {
            prop_assert!(self.config.contains(h));
            if let Some(co) = co_after_turn {
                prop_assert!(
                    !self.capped(h),
                    "{co} granted a co-hold while {h} (capped) held a turn"
                );
            }
        }
        for id in &self.config {
            let u = self.core.usage_us(self.now, id).unwrap();
            prop_assert!(u <= self.core.params().window_us + 200_000);
        }
        self.check_capped()
    }

    /// Notes each client's fill as judged now, before an event.
    fn note_fills(&mut self) {
        self.judged = IDS
            .iter()
            .map(|id| (id.to_string(), self.core.judged_fill(id)))
            .collect();
    }

    fn capped(&self, id: &str) -> bool {
        self.configured
            .get(id)
            .is_some_and(|s| s.limit_milli < 1000)
    }

    /// A capped client is charged its co-holds' wall length (up to the last grant's quota and
    /// the grace), the open one's so far; and its usage over the window (turns and co-holds)
    /// stays within `limit × window` but for one grant (a turn's min quota or a co-hold's
    /// quota and grace: either may start just below the limit, as may a co-hold that one of
    /// its processes joins) and what it reported running past its grants.
    fn check_capped(&self) -> Result<(), TestCaseError> {
        let p = *self.core.params();
        let from = self.now.saturating_sub(p.window_us);
        let w_eff = self.now.clamp(1, p.window_us);
        let quota_and_grace = CO_QUOTA_US + p.grace_us;
        let grace = p.grace_us;
        for id in self.config.iter().filter(|id| self.capped(id)) {
            let seen = self.co_seen.get(id);
            let ended: Vec<_> = seen
                .into_iter()
                .flat_map(|s| s.ended.iter())
                .filter(|(end, ..)| *end > from)
                .collect();
            if ended.iter().all(|(.., wall)| *wall) {
                // The open one's time so far, if it ran to after the window's start.
                let open = seen
                    .and_then(|s| s.open.as_ref())
                    .filter(|o| self.now.min(o.reach(grace)) > from)
                    .map_or(0, |o| o.wall(self.now, grace));
                let expected = ended.iter().map(|(_, ch, _)| ch).sum::<Micros>() + open;
                let charged = self.core.co_usage_us(self.now, id).unwrap();
                if self.engine_reported.contains(id) {
                    prop_assert!(
                        charged <= expected,
                        "{id}'s co-holds charged {charged} µs, wall {expected} µs"
                    );
                } else {
                    prop_assert_eq!(charged, expected, "{}'s co-holds charged", id);
                }
            }
            let limit = u64::from(self.configured[id].limit_milli);
            let grant = p.min_quota_us.max(quota_and_grace);
            let kept: Micros = self
                .kept
                .get(id)
                .into_iter()
                .flatten()
                .filter(|(_, until)| self.now < *until)
                .map(|(us, _)| us)
                .sum();
            let overran: Micros = self
                .overran
                .get(id)
                .into_iter()
                .flat_map(|o| o.values())
                .sum();
            let bound = limit * w_eff / 1000 + grant + kept + overran;
            let used = self.core.usage_us(self.now, id).unwrap();
            prop_assert!(
                used <= bound,
                "{id} (limit {limit}) used {used} µs of {w_eff} µs, bound {bound}"
            );
        }
        Ok(())
    }

    /// A grant (a turn or a co-hold) to `client`: if it is capped, no other capped client's
    /// co-hold may still run (its last grant's quota and grace, or the drain reported past it,
    /// not yet up), so capped clients, each charged the wall time it holds, never hold at once
    /// (`core/capped.rs`); a co-hold beside a capped turn is checked in `check`. (A reload
    /// that caps two clients holding at once leaves them so until their holds end.)
    fn check_capped_apart(&self, client: &str) -> Result<(), TestCaseError> {
        if !self.capped(client) {
            return Ok(());
        }
        let grace = self.core.params().grace_us;
        for (id, seen) in &self.co_seen {
            if id == client || !self.config.contains(id) || !self.capped(id) {
                continue;
            }
            if let Some(o) = &seen.open {
                prop_assert!(
                    o.reach(grace) <= self.now,
                    "{client} (capped) granted while {id} (capped) co-holds until {}, now {}",
                    o.reach(grace),
                    self.now
                );
            }
        }
        Ok(())
    }

    /// A co-hold's Grant to `conn` of `client`: it opens the client's co-hold or joins it.
    fn co_join(&mut self, client: &str, conn: ConnId) {
        let grace = self.core.params().grace_us;
        let now = self.now;
        let capped = self.capped(client);
        let seen = self.co_seen.entry(client.to_owned()).or_default();
        match &mut seen.open {
            Some(o) => {
                o.conns.insert(conn);
                if now > o.reach(grace) {
                    seen.ended
                        .push((o.reach(grace), o.wall(now, grace), capped));
                    o.start = now;
                    o.past = 0;
                }
                o.last = now;
            }
            None => {
                seen.open = Some(OpenCo {
                    conns: HashSet::from([conn]),
                    start: now,
                    last: now,
                    past: 0,
                })
            }
        }
    }

    /// `conn`'s next frame (or its hang-up) ends its part of its client's co-hold, if it is in
    /// it, its work having run `past` its quota; the last one out ends it.
    fn co_leave(&mut self, conn: ConnId, past: Micros) {
        let Some(&(_, i)) = self.slots.iter().find(|s| s.0 == conn) else {
            return;
        };
        let grace = self.core.params().grace_us;
        let capped = self.capped(IDS[i]);
        let now = self.now;
        let Some(seen) = self.co_seen.get_mut(IDS[i]) else {
            return;
        };
        let Some(o) = &mut seen.open else {
            return;
        };
        if o.conns.remove(&conn) {
            o.past = o.past.max(past);
            if o.conns.is_empty() {
                seen.ended
                    .push((now.min(o.reach(grace)), o.wall(now, grace), capped));
                seen.open = None;
            }
        }
    }

    /// A report from `conn` that its hold ran `past` its quota (its last grant's).
    fn overran(&mut self, conn: ConnId, past: Micros) {
        let Some(&(_, i)) = self.slots.iter().find(|s| s.0 == conn) else {
            return;
        };
        let o = self
            .overran
            .entry(IDS[i].to_owned())
            .or_default()
            .entry(conn)
            .or_default();
        *o = (*o).max(past);
    }

    fn conn_ok(&self, slot: usize) -> bool {
        self.live.contains(&self.slots[slot].0)
    }

    /// A turn granted to `client` (not a co-hold): an opportunistic client is granted none while
    /// a guaranteed client may take one, unless it joins its client's running hold.
    fn check_turn(&self, client: &str) -> Result<(), TestCaseError> {
        if self.core.class(client) != Some(ClientClass::Opportunistic)
            || self.core.grants() == self.grants_before
        {
            return Ok(());
        }
        for id in &self.config {
            let guaranteed = self.core.class(id) == Some(ClientClass::Guaranteed);
            prop_assert!(
                !(guaranteed && self.core.may_take_turn(self.now, id)),
                "{client} (opportunistic) granted a turn while {id} (guaranteed) may take one"
            );
        }
        Ok(())
    }

    /// After a drain notice on `c` by the holder `holder` (its client before the notice): a
    /// turn granted now goes to another client, the sender drains beside it and is not in a
    /// hold any more. Returns whether the token was handed on.
    fn handed_over(
        &mut self,
        c: ConnId,
        holder: Option<&str>,
        acts: &[Action],
    ) -> Result<bool, TestCaseError> {
        let turn = acts
            .iter()
            .any(|a| matches!(a, Action::Grant { conns, .. } if !conns.iter().all(|c| self.core.in_co_hold(*c))));
        if !turn {
            return Ok(false);
        }
        prop_assert!(holder.is_some(), "handed on with no holder: {acts:?}");
        prop_assert!(
            !self.parks.contains(&c),
            "handed on at the notice of {c}, which parks: {acts:?}"
        );
        prop_assert!(
            self.core.holder().is_some() && self.core.holder() != holder,
            "handed from {holder:?} to {:?}",
            self.core.holder()
        );
        self.draining.insert(c);
        Ok(true)
    }

    /// The classes of the clients whose requests wait.
    fn waiting_classes(&self) -> Vec<ClientClass> {
        self.pending
            .iter()
            .filter_map(|c| self.slots.iter().find(|s| s.0 == *c))
            .filter_map(|s| self.core.class(IDS[s.1]))
            .collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn random_events_keep_the_invariants(ops in prop::collection::vec(op(), 1..120), co in any::<bool>()) {
        run(ops, co, Classes::AsDrawn)?;
    }

    /// Opportunistic clients compete among themselves by their requests and limits exactly as
    /// guaranteed ones do: the same events give the same answers.
    #[test]
    fn opportunistic_clients_alone_are_scheduled_as_guaranteed_ones(
        ops in prop::collection::vec(op(), 1..120),
        co in any::<bool>(),
    ) {
        let opportunistic = run(ops.clone(), co, Classes::All(ClientClass::Opportunistic))?;
        let guaranteed = run(ops, co, Classes::All(ClientClass::Guaranteed))?;
        prop_assert_eq!(opportunistic, guaranteed);
    }

    /// Soon only tells: with it on and off, the same events give the same answers.
    #[test]
    fn soon_changes_no_decision(ops in prop::collection::vec(op(), 1..120), co in any::<bool>()) {
        let told = run_with(ops.clone(), co, Classes::AsDrawn, true)?;
        let soons = told.iter().filter(|a| matches!(a, Action::Soon { .. })).count();
        let answers: Vec<Action> = told
            .into_iter()
            .filter(|a| !matches!(a, Action::Soon { .. }))
            .collect();
        let untold = run_with(ops, co, Classes::AsDrawn, false)?;
        let untold_soons = untold.iter().filter(|a| matches!(a, Action::Soon { .. })).count();
        prop_assert_eq!(untold_soons, 0, "Soon with it off");
        prop_assert_eq!(answers, untold, "{} Soon", soons);
    }
}

/// A case proptest found (CI, 2026-11-27): a client's hold ended at its quota, it asked again,
/// and a config reload removed it; the next dispatch looked the removed client up as "the last
/// holder" and panicked. Kept as a test of its own: proptest cannot persist failures of an
/// integration test (it looks for lib.rs or main.rs beside it).
#[test]
fn a_reload_that_drops_the_last_holder() {
    use Op::*;
    let ops = vec![
        Request(5, 0, 0),
        Release(5, 0),
        Request(1, 0, 0),
        Request(1, 0, 0),
        Advance(21_286),
        Advance(173_134),
        Config(vec![(0, 398, 398, 0, false), (2, 602, 602, 0, false)]),
        Request(0, 4109, 0),
        Request(2, 0, 0),
    ];
    if let Err(e) = run(ops, false, Classes::AsDrawn) {
        panic!("{e}");
    }
}

/// Cases proptest found, each kept as a test of its own (see above), run as drawn and with
/// every client guaranteed, then opportunistic.
#[test]
fn cases_proptest_found() {
    use Op::*;
    let cases = [
        // A co-hold's charge on its client's own turn: the pacing wake-up and the turn's
        // headroom disagreed, and the client was woken for a turn it was refused, forever.
        vec![
            Fill(2, 29),
            Request(5, 0, 0),
            DrainerAsks(280),
            Config(vec![(2, 0, 72, 0, false)]),
            Request(5, 12_381, 0),
            Fill(2, 977),
        ],
        vec![
            Config(vec![(0, 0, 1, 0, false)]),
            DrainerAsks(1),
            Request(0, 0, 0),
            Fill(0, 0),
            Request(0, 0, 0),
            Advance(14_015),
            Request(3, 1, 0),
        ],
        vec![
            Fill(4, 0),
            Request(1, 0, 0),
            Advance(78_962),
            Advance(103_598),
            Config(vec![(1, 0, 1, 0, false)]),
            Request(4, 0, 0),
            Config(vec![(1, 0, 131, 0, false)]),
            Fill(1, 600),
        ],
        vec![
            Advance(182_315),
            Renew(0, 0),
            Advance(40_552),
            Config(vec![(2, 0, 45, 0, false)]),
            Advance(26_355),
            Advance(51_208),
            Advance(134_488),
            Request(2, 0, 0),
            Advance(190_155),
            Advance(86_861),
            Release(2, 16_579),
            Request(5, 0, 0),
            Advance(163_872),
            Request(2, 0, 0),
            Advance(0),
            Advance(37_521),
            Release(2, 37_521),
            Release(5, 37_271),
        ],
        vec![
            Release(3, 0),
            Request(2, 0, 0),
            Request(5, 0, 2_000),
            Advance(51_002),
            Advance(91_739),
            Release(5, 55_823),
            Reconnect(2),
        ],
        vec![
            Fill(0, 0),
            Request(0, 0, 0),
            Request(3, 0, 0),
            Advance(30_001),
            Renew(3, 0),
            Config(vec![(0, 0, 1, 0, false)]),
            Request(0, 0, 0),
        ],
        // A client in a co-hold on one connection granted a turn on another.
        vec![
            Busy(3, 23_929, 0),
            Fill(0, 63),
            Advance(0),
            Request(0, 0, 0),
            Request(1, 0, 0),
            Fill(3, 937),
            Request(3, 0, 0),
            HolderRenew(0),
        ],
    ];
    for (i, ops) in cases.into_iter().enumerate() {
        for classes in [
            Classes::AsDrawn,
            Classes::All(ClientClass::Guaranteed),
            Classes::All(ClientClass::Opportunistic),
        ] {
            if let Err(e) = run(ops.clone(), !(3..5).contains(&i), classes) {
                panic!("case {i}, {classes:?}: {e}");
            }
        }
    }
}

/// Applies `ops` to a core with three clients and six connections (co-running on if `co`),
/// checking the invariants after each, then runs the clock until every waiting request is
/// served. Returns every action, in order.
fn run(ops: Vec<Op>, co: bool, classes: Classes) -> Result<Vec<Action>, TestCaseError> {
    run_with(ops, co, classes, true)
}

/// [`run`], with Soon (`Core::set_soon`) on or off.
fn run_with(
    ops: Vec<Op>,
    co: bool,
    classes: Classes,
    soon: bool,
) -> Result<Vec<Action>, TestCaseError> {
    let params = Params {
        window_us: 1_000_000,
        base_quota_us: 20_000,
        min_quota_us: 2_000,
        grace_us: 10_000,
        pace_us: 200_000,
        pace_short_us: 50_000,
    };
    let init = specs(
        &[
            (0, 300, 500, 1000, false),
            (1, 200, 1000, 1000, true),
            (2, 0, 300, 500, true),
        ],
        classes,
    );
    let mut w = World {
        core: Core::new(params, &init, 0),
        now: 0,
        slots: (0..6).map(|s| (s as ConnId, s % 3)).collect(),
        next_conn: 6,
        pending: HashSet::new(),
        limits: init.iter().map(|s| (s.id.clone(), s.mem_limit)).collect(),
        config: init.iter().map(|s| s.id.clone()).collect(),
        live: (0..6).collect(),
        below: if co { 0.6 } else { 0.0 },
        grants_before: 0,
        trace: Vec::new(),
        draining: HashSet::new(),
        said_drain: HashSet::new(),
        parks: HashSet::new(),
        last_turn: None,
        unshared_turn: None,
        restamp: false,
        configured: init.iter().map(|s| (s.id.clone(), s.clone())).collect(),
        co_seen: HashMap::new(),
        overran: HashMap::new(),
        quotas: HashMap::new(),
        kept: HashMap::new(),
        judged: HashMap::new(),
        engine_reported: HashSet::new(),
    };
    w.core.set_co_run(CoRunSettings {
        below: w.below,
        quota_us: CO_QUOTA_US,
    });
    // On, Soon's conditions are checked too (`soon_changes_no_decision`: it changes none).
    w.core.set_soon(soon);
    for s in 0..6 {
        w.core.hello(s as ConnId, IDS[s % 3]).unwrap();
    }
    for op in ops {
        w.grants_before = w.core.grants();
        w.note_fills();
        // The holder's own notices, from the slot of the connection last granted a turn; a
        // drainer's report from the slot of a connection that drains.
        let holder_slot = w
            .last_turn
            .and_then(|c| w.slots.iter().position(|s| s.0 == c))
            .unwrap_or(0);
        let drainer_slot = w
            .draining
            .iter()
            .min()
            .and_then(|c| w.slots.iter().position(|s| s.0 == *c));
        let op = match op {
            Op::HolderRenew(b) => Op::Renew(holder_slot, b),
            Op::HolderDrain => Op::Drain(holder_slot),
            Op::HolderParks => Op::Parks(holder_slot),
            Op::DrainerAsks(o) => match drainer_slot {
                Some(s) => Op::Request(s, o, 0),
                None => Op::Advance(o),
            },
            op => op,
        };
        let acts = match op {
            Op::Request(s, o, b) => {
                let c = w.slots[s].0;
                w.draining.remove(&c);
                w.said_drain.remove(&c);
                if w.conn_ok(s) && !w.pending.contains(&c) {
                    w.co_leave(c, o);
                    w.overran(c, o);
                }
                let was_pending = w.pending.contains(&c);
                if w.conn_ok(s) && !was_pending {
                    w.pending.insert(c);
                }
                let acts = w.core.token_request(w.now, c, o, b);
                if !w.conn_ok(s) || was_pending {
                    // Refused at once.
                    let refused =
                        matches!(acts.first(), Some(Action::Error { conn, .. }) if *conn == c);
                    prop_assert!(refused, "request on {} not refused: {:?}", c, acts);
                }
                acts
            }
            Op::Release(s, u) => {
                let c = w.slots[s].0;
                w.draining.remove(&c);
                w.said_drain.remove(&c);
                if w.conn_ok(s) {
                    let quota = w.quotas.get(&c).copied().unwrap_or(0);
                    w.co_leave(c, u.saturating_sub(quota));
                    w.overran(c, u.saturating_sub(quota));
                }
                w.core.release(w.now, c, u)
            }
            // A renewal goes to the holder alone and answers its Renew as its request at this
            // moment would be answered: granted to it, whoever waits (so an opportunistic holder
            // is not renewed while a guaranteed client that may go waits). Anything else is a
            // Yield (or an error for a connection the core does not know), with, when others
            // wait, the next client's grant: the holder drains beside it.
            Op::Renew(s, b) => {
                let c = w.slots[s].0;
                let holder = w.core.holder().map(str::to_owned);
                let waiting = w.waiting_classes();
                // Who a request now would be granted to (its quota may differ by rounding).
                let asked: Vec<_> = w
                    .core
                    .clone()
                    .token_request(w.now, c, 0, b)
                    .into_iter()
                    .filter_map(|a| match a {
                        Action::Grant { client, conns, .. } => Some((client, conns)),
                        _ => None,
                    })
                    .collect();
                let acts = w.core.renew(w.now, c, b);
                let granted = acts
                    .iter()
                    .any(|a| matches!(a, Action::Grant { .. }) && a.answers(c));
                if granted && w.core.in_co_hold(c) {
                    // A co-hold renewed: its part ended, and a new one is granted.
                    w.co_leave(c, 0);
                }
                match acts.as_slice() {
                    [Action::Grant { conns, .. }] if w.core.in_co_hold(c) => {
                        // A co-hold goes on beside whatever waits.
                        prop_assert_eq!(conns, &vec![c]);
                        w.pending.insert(c);
                    }
                    [
                        Action::Grant {
                            client,
                            conns,
                            quota_us: quota,
                        },
                    ] => {
                        prop_assert_eq!(
                            &asked,
                            &vec![(client.clone(), conns.clone())],
                            "renewed while a request now would be granted otherwise (waiting: {:?})",
                            waiting
                        );
                        prop_assert_eq!(Some(client), holder.as_ref());
                        prop_assert_eq!(conns, &vec![c]);
                        // The Grant says whether a hand-over is due at the renewed hold's end:
                        // nothing else happening, a Renew there is then not granted back, and
                        // the holder's request there goes to another client only if it was.
                        let due = w.core.handover_due(client);
                        let quota = *quota;
                        let mut later = w.core.clone();
                        // (No burst learnt on the way: the hook's next one is not known yet.)
                        let again = later.renew(w.now + quota, c, 0);
                        let renewed_again = matches!(again.as_slice(),
                            [Action::Grant { client: x, .. }] if x == client);
                        prop_assert!(
                            !(due && renewed_again),
                            "said to hand over, renewed again at its end: {:?}",
                            again
                        );
                        // (A co-hold granted there runs beside; the turn is what the flag is of.)
                        let mut asked = w.core.clone();
                        let asked_at_end = asked.token_request(w.now + quota, c, 0, 0);
                        prop_assert!(
                            due || asked.holder().is_none_or(|h| h == client),
                            "handed over at the end of a renewal not said to: {:?} (a Renew there: {:?})",
                            asked_at_end,
                            again
                        );
                        // What `check` expects of a grant: an answered request.
                        w.pending.insert(c);
                    }
                    [Action::Yield { conn }] => {
                        prop_assert_eq!(*conn, c);
                        w.said_drain.insert(c);
                    }
                    // Told, not handed on: the hold stands until the report.
                    [Action::Soon { .. }, Action::Yield { conn }] if *conn == c => {
                        prop_assert!(!waiting.is_empty(), "Soon with nobody waiting: {:?}", acts);
                        prop_assert_eq!(w.core.holder(), holder.as_deref());
                        w.said_drain.insert(c);
                    }
                    [grants @ .., Action::Yield { conn }] if *conn == c => {
                        prop_assert!(
                            !waiting.is_empty(),
                            "handed on with nobody waiting: {:?}",
                            acts
                        );
                        let handed = w.handed_over(c, holder.as_deref(), grants)?;
                        prop_assert!(handed, "Renew answered {:?}", acts);
                    }
                    [Action::Error { conn, .. }] => {
                        prop_assert_eq!(*conn, c);
                        prop_assert!(!w.conn_ok(s));
                    }
                    other => prop_assert!(false, "Renew answered {:?}", other),
                }
                acts
            }
            // No reply: the token goes on to a client that waited, or nothing changes.
            Op::Drain(s) => {
                let c = w.slots[s].0;
                let holder = w.core.holder().map(str::to_owned);
                let acts = w.core.drain(w.now, c);
                prop_assert!(
                    !acts.iter().any(|a| a.answers(c)),
                    "a Drain answered: {:?}",
                    acts
                );
                if !acts.is_empty() {
                    prop_assert!(w.conn_ok(s), "a Drain on {} did something: {:?}", c, acts);
                }
                if let [Action::Soon { .. }] = acts.as_slice() {
                    prop_assert_eq!(w.core.holder(), holder.as_deref(), "Soon handed on");
                }
                if !w.handed_over(c, holder.as_deref(), &acts)? {
                    w.said_drain.insert(c);
                }
                acts
            }
            Op::HolderRenew(_) | Op::HolderDrain | Op::HolderParks | Op::DrainerAsks(_) => {
                unreachable!("mapped above")
            }
            Op::Reconnect(s) => {
                let (c, client) = w.slots[s];
                // A process that hangs up in a turn it has not reported is charged past its
                // quota the grace or its client's usual overrun, whichever is longer; one that
                // said it drains and kept the token, up to four usual overruns (at most 1 s),
                // the wait for its report.
                let usual = w
                    .overran
                    .get(IDS[client])
                    .and_then(|o| o.values().max().copied())
                    .unwrap_or(0);
                let usual = if w.said_drain.remove(&c) {
                    usual.saturating_mul(4).min(1_000_000)
                } else {
                    usual
                };
                w.overran(c, usual.max(w.core.params().grace_us));
                w.pending.remove(&c);
                w.draining.remove(&c);
                w.co_leave(c, 0);
                let acts = w.core.disconnect(w.now, c);
                let n = w.next_conn;
                w.next_conn += 1;
                w.slots[s] = (n, client);
                w.live.remove(&c);
                let r = w.core.hello(n, IDS[client]);
                prop_assert_eq!(r.is_ok(), w.config.contains(IDS[client]));
                if r.is_ok() {
                    w.live.insert(n);
                } else {
                    // Not in the config: the slot stays unknown to the core.
                    w.slots[s] = (u64::MAX - n, client);
                }
                acts
            }
            Op::Alloc(s, b) => {
                let c = w.slots[s].0;
                if let Ok(d) = w.core.mem_alloc(c, b) {
                    let lim = w.limits[IDS[w.slots[s].1]];
                    if d.granted {
                        prop_assert!(d.used <= lim);
                    }
                    prop_assert_eq!(d.limit, lim);
                } else {
                    prop_assert!(!w.conn_ok(s));
                }
                vec![]
            }
            Op::Free(s, b) => {
                let _ = w.core.mem_free(w.slots[s].0, b);
                vec![]
            }
            Op::Config(v) => {
                let sp = specs(&v, classes);
                // A client whose share or class changes starts a new account: its ended
                // co-holds are forgotten, and a turn or co-hold it holds is kept (granted at the
                // old limit).
                let holder = w.core.holder().map(str::to_owned);
                let window = w.core.params().window_us;
                let grace = w.core.params().grace_us;
                for s in &sp {
                    let Some(old) = w.configured.get(&s.id) else {
                        continue;
                    };
                    if (old.request_milli, old.limit_milli, old.class)
                        == (s.request_milli, s.limit_milli, s.class)
                    {
                        continue;
                    }
                    let kept = w.kept.entry(s.id.clone()).or_default();
                    if let Some(seen) = w.co_seen.get_mut(&s.id) {
                        seen.ended.clear();
                        if let Some(o) = &seen.open {
                            let most = o.reach(grace) - o.start;
                            kept.push((most, o.reach(grace) + window));
                        }
                    }
                    if holder.as_deref() == Some(s.id.as_str()) {
                        // Its turn's quota: at most the largest of its processes' grants.
                        let quota = w
                            .slots
                            .iter()
                            .filter(|(_, i)| IDS[*i] == s.id)
                            .filter_map(|(c, _)| w.quotas.get(c))
                            .max()
                            .copied()
                            .unwrap_or(0);
                        kept.push((quota, w.now + quota + window));
                    }
                }
                w.config = sp.iter().map(|s| s.id.clone()).collect();
                w.configured = sp.iter().map(|s| (s.id.clone(), s.clone())).collect();
                // A client that leaves is forgotten, its co-hold with it.
                let config = &w.config;
                w.co_seen.retain(|id, _| config.contains(id));
                w.kept.retain(|id, _| config.contains(id));
                w.overran.retain(|id, _| config.contains(id));
                for &(c, client) in &w.slots {
                    if !w.config.contains(IDS[client]) {
                        w.live.remove(&c);
                    }
                }
                for s in &sp {
                    w.limits.insert(s.id.clone(), s.mem_limit);
                }
                let acts = w.core.set_config(w.now, &sp);
                w.restamp = true;
                // Waiting requests of clients that left are answered with errors.
                for a in &acts {
                    if let Action::Error { conn, code, .. } = a {
                        prop_assert_eq!(*code, gem_proto::code::UNKNOWN_CLIENT);
                        let slot = w.slots.iter().find(|s| s.0 == *conn).unwrap();
                        prop_assert!(!w.config.contains(IDS[slot.1]));
                    }
                }
                acts
            }
            Op::Advance(dt) => {
                w.now += dt;
                w.core.tick(w.now)
            }
            Op::Busy(s, b, h) => {
                let r = w.core.busy(w.now, w.slots[s].0, b, h, 0, None);
                prop_assert_eq!(r.is_ok(), w.conn_ok(s));
                vec![]
            }
            Op::Engine(s, e, h) => {
                let conn = w.slots[s].0;
                let r = w.core.busy(w.now, conn, 0, h, 0, e);
                prop_assert_eq!(r.is_ok(), w.conn_ok(s));
                if r.is_ok() && e.is_some() {
                    w.engine_reported.insert(IDS[w.slots[s].1].to_owned());
                }
                vec![]
            }
            Op::Fill(s, f) => {
                let held = 600_000;
                let r = w.core.busy(
                    w.now,
                    w.slots[s].0,
                    held * Micros::from(f) / 1000,
                    held,
                    0,
                    None,
                );
                prop_assert_eq!(r.is_ok(), w.conn_ok(s));
                vec![]
            }
            Op::Parks(s) => {
                let c = w.slots[s].0;
                w.core.set_parks(c);
                w.parks.insert(c);
                vec![]
            }
            Op::Told(s) => {
                w.core.set_told_handover_due(w.slots[s].0);
                vec![]
            }
        };
        w.check(acts)?;
        // Requests of clients that left the config are no longer pending.
        let gone: Vec<ConnId> = w
            .pending
            .iter()
            .copied()
            .filter(|c| !w.live.contains(c))
            .collect();
        prop_assert!(
            gone.is_empty(),
            "requests of departed clients left unanswered: {gone:?}"
        );
    }
    // Liveness: run the clock, releasing every grant at once; all waiters get served.
    let mut steps = 0;
    while !w.pending.is_empty() {
        w.grants_before = w.core.grants();
        w.note_fills();
        steps += 1;
        prop_assert!(steps < 100_000, "waiters never served: {:?}", w.pending);
        let next = w.core.next_wakeup(w.now);
        prop_assert!(next.is_some(), "waiters but no wake-up: {:?}", w.pending);
        w.now = next.unwrap().max(w.now);
        let acts = w.core.tick(w.now);
        let granted: Vec<ConnId> = acts
            .iter()
            .flat_map(|a| match a {
                Action::Grant { conns, .. } => conns.clone(),
                _ => vec![],
            })
            .collect();
        w.check(acts)?;
        for c in granted {
            w.grants_before = w.core.grants();
            w.note_fills();
            w.co_leave(c, 0);
            let acts = w.core.release(w.now, c, 0);
            w.check(acts)?;
        }
    }
    Ok(w.trace)
}

proptest! {
    /// The config reader never panics, and what it accepts round-trips through the
    /// API crate's renderer.
    #[test]
    fn config_text_never_panics(text in "[0-9a-z. \\n\\t-]{0,200}") {
        if let Ok(specs) = gem_schd::config::parse_specs(&text) {
            let again = gem_schd::config::parse_specs(
                &kubeshare_api::ResourceConfig::parse(&text).unwrap().render(),
            ).unwrap();
            prop_assert_eq!(specs, again);
        }
    }

    #[test]
    fn config_lines_parse_to_specs(entries in prop::collection::vec(
        ("[a-z][a-z0-9-]{0,20}", 0..=1000u16, 0..=1000u16, any::<u64>()), 0..6)
    ) {
        let mut seen = HashSet::new();
        let entries: Vec<_> = entries.into_iter()
            .filter(|e| seen.insert(e.0.clone()))
            .map(|(id, a, b, m)| (id, a.min(b), a.max(b), m))
            .collect();
        let mut text = format!("{}\n", entries.len());
        for (id, r, l, m) in &entries {
            text += &format!("{id} {}.{:03} {}.{:03} {m}\n", r / 1000, r % 1000, l / 1000, l % 1000);
        }
        let specs = gem_schd::config::parse_specs(&text).unwrap();
        prop_assert_eq!(specs.len(), entries.len());
        for (s, (id, r, l, m)) in specs.iter().zip(&entries) {
            prop_assert_eq!((&s.id, s.request_milli, s.limit_milli, s.mem_limit), (id, *r, *l, *m));
        }
    }
}

/// A case proptest found: a holder that became light during its turn (its turns' fill fell
/// below the threshold) said it drains; the hand-over's trial queued its request, which a
/// co-hold then answered, so the drain notice itself was answered with a Grant.
#[test]
fn a_light_holder_that_drains_is_not_answered() {
    use Op::*;
    let ops = vec![Request(2, 0, 0), Request(0, 0, 0), Fill(2, 0), Drain(2)];
    if let Err(e) = run(ops, true, Classes::AsDrawn) {
        panic!("{e}");
    }
}

/// A case proptest found: a capped client's open co-hold, counted as a piece ending at `now`,
/// never slid out of its short pacing window, and its next request waited for good.
#[test]
fn an_open_co_hold_slides_out_of_the_pacing_window() {
    use Op::*;
    let ops = vec![
        Fill(1, 0),
        Request(1, 0, 0),
        Request(2, 0, 0),
        Fill(2, 0),
        HolderRenew(0),
        Advance(1),
        Request(5, 0, 0),
        Fill(2, 600),
    ];
    if let Err(e) = run(ops, true, Classes::AsDrawn) {
        panic!("{e}");
    }
}

/// A case proptest found: a turn's sole process said it drains, so the token waited past the
/// grace for its report (four of its client's usual overruns), and it hung up there; it is
/// charged to the hang-up, which the model must allow (with every class, co-running off).
#[test]
fn a_drainer_that_hangs_up_in_the_wait_for_its_report() {
    use Op::*;
    let ops = vec![
        Request(4, 0, 0),
        Request(1, 0, 2_000),
        Release(1, 34_254),
        Advance(23_860),
        Config(vec![(1, 0, 1, 0, false)]),
        Drain(1),
        Advance(60_339),
        Reconnect(1),
    ];
    for classes in [
        Classes::AsDrawn,
        Classes::All(ClientClass::Guaranteed),
        Classes::All(ClientClass::Opportunistic),
    ] {
        if let Err(e) = run(ops.clone(), false, classes) {
            panic!("{classes:?}: {e}");
        }
    }
}
