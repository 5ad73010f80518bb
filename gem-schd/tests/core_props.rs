//! Property tests of the core under random event sequences: every TokenRequest is
//! answered exactly once, one holder at a time (co-holds beside it when co-running is on,
//! only for clients whose fill is light; a holder that said it drains beside the next one,
//! until its report), memory never granted past a limit,
//! and (liveness) every waiting request is eventually granted. Classes: no opportunistic client
//! is granted a turn, nor renewed, while a guaranteed client waits that may take one, and a GPU
//! of opportunistic clients only is scheduled exactly as one of guaranteed clients only.

use std::collections::{HashMap, HashSet};

use gem_schd::core::{
    Action, ClientClass, ClientSpec, CoRunSettings, ConnId, Core, Micros, Params,
};
use proptest::prelude::*;

const IDS: [&str; 3] = ["a", "b", "c"];

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
    /// The connection last granted a turn.
    last_turn: Option<ConnId>,
}

impl World {
    fn check(&mut self, acts: Vec<Action>) -> Result<(), TestCaseError> {
        self.trace.extend(acts.iter().cloned());
        let mut granted_clients = HashSet::new();
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
                        if self.core.in_co_hold(c) {
                            // A co-hold runs beside the holder, granted to a light client
                            // only (its fill may rise before the co-hold ends).
                            prop_assert!(self.below > 0.0, "{client} co-runs with co-running off");
                            let fill = self.core.fill(&client);
                            prop_assert!(
                                fill.is_some_and(|f| f < self.below),
                                "{client} granted a co-hold at a fill of {fill:?}"
                            );
                        } else {
                            self.check_turn(&client)?;
                            self.last_turn = Some(c);
                            granted_clients.insert(client.clone());
                        }
                    }
                }
                // A second request on a waiting connection is refused (code 4) and
                // leaves the first one waiting; other errors answer it.
                Action::Error { conn, code, .. } if code != gem_proto::code::PROTOCOL_MISUSE => {
                    self.pending.remove(&conn);
                }
                Action::Error { .. } | Action::Yield { .. } => {}
            }
        }
        prop_assert!(granted_clients.len() <= 1, "one holder at a time");
        if let Some(h) = self.core.holder() {
            prop_assert!(self.config.contains(h));
        }
        for id in &self.config {
            let u = self.core.usage_us(self.now, id).unwrap();
            prop_assert!(u <= self.core.params().window_us + 200_000);
        }
        Ok(())
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
            .any(|a| matches!(a, Action::Grant { client, .. } if !self.core.co_running(client)));
        if !turn {
            return Ok(false);
        }
        prop_assert!(holder.is_some(), "handed on with no holder: {acts:?}");
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

/// Applies `ops` to a core with three clients and six connections (co-running on if `co`),
/// checking the invariants after each, then runs the clock until every waiting request is
/// served. Returns every action, in order.
fn run(ops: Vec<Op>, co: bool, classes: Classes) -> Result<Vec<Action>, TestCaseError> {
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
        last_turn: None,
    };
    w.core.set_co_run(CoRunSettings {
        below: w.below,
        quota_us: 5_000,
    });
    for s in 0..6 {
        w.core.hello(s as ConnId, IDS[s % 3]).unwrap();
    }
    for op in ops {
        w.grants_before = w.core.grants();
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
                w.core.release(w.now, c, u)
            }
            // A renewal goes to the holder alone, with no request of its class or above waiting
            // (an opportunistic holder gives the token back when a guaranteed client waits),
            // and answers its Renew; anything else is a Yield (or an error for a connection the
            // core does not know), with, when others wait, the next client's grant: the holder
            // drains beside it.
            Op::Renew(s, b) => {
                let c = w.slots[s].0;
                let holder = w.core.holder().map(str::to_owned);
                let holder_class = holder.as_deref().and_then(|h| w.core.class(h));
                let waiting = w.waiting_classes();
                let acts = w.core.renew(w.now, c, b);
                match acts.as_slice() {
                    [Action::Grant { client, conns, .. }] if w.core.co_running(client) => {
                        // A co-hold goes on beside whatever waits.
                        prop_assert_eq!(conns, &vec![c]);
                        w.pending.insert(c);
                    }
                    [Action::Grant { client, conns, .. }] => {
                        prop_assert!(
                            waiting.iter().all(|k| Some(*k) < holder_class),
                            "renewed ({holder_class:?}) while requests of {waiting:?} waited",
                        );
                        prop_assert_eq!(Some(client), holder.as_ref());
                        prop_assert_eq!(conns, &vec![c]);
                        // What `check` expects of a grant: an answered request.
                        w.pending.insert(c);
                    }
                    [Action::Yield { conn }] => prop_assert_eq!(*conn, c),
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
                w.handed_over(c, holder.as_deref(), &acts)?;
                acts
            }
            Op::HolderRenew(_) | Op::HolderDrain | Op::DrainerAsks(_) => {
                unreachable!("mapped above")
            }
            Op::Reconnect(s) => {
                let (c, client) = w.slots[s];
                w.pending.remove(&c);
                w.draining.remove(&c);
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
                w.config = sp.iter().map(|s| s.id.clone()).collect();
                for &(c, client) in &w.slots {
                    if !w.config.contains(IDS[client]) {
                        w.live.remove(&c);
                    }
                }
                for s in &sp {
                    w.limits.insert(s.id.clone(), s.mem_limit);
                }
                let acts = w.core.set_config(w.now, &sp);
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
                let r = w.core.busy(w.now, w.slots[s].0, b, h, 0);
                prop_assert_eq!(r.is_ok(), w.conn_ok(s));
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
