//! gem-schd's usage report: the GPU time each client held the token over the last
//! window, and the memory counted for it. gem-schd writes it next to its
//! resource-config (`gpus/<uuid>/usage.txt`, replaced atomically once a second); the
//! node daemon reads it to export each pod's delivered share.
//!
//! ```text
//! gem-schd-usage v1 window_us=10000000 at_us=123456789
//! 6f1c…-pod-uid-a 2987000 1073741824 fill_milli=312 co_used_us=2987000
//! 9b2e…-pod-uid-b 7001000 0 fill_milli=905
//! ```
//! Line 1: the format, the accounting window and gem-schd's clock when written; then
//! one line `ID USED_US MEM_USED_BYTES` per configured client, with co-running's figures
//! after it where there are any (`fill_milli`: how much of its holds the client's kernels
//! keep the GPU busy, once known; `co_used_us`: the part of USED_US charged for running beside
//! the token holder; `pids`: the processes connected to its socket, by the PIDs gem-schd
//! sees, which the node daemon compares with the processes the driver reports on the GPU).
//!
//! Then, where gem-schd refused connections because the peer did not run in the socket's
//! pod (`--verify-pod-peers`), one line per (socket, peer pod), counting since gem-schd
//! started:
//!
//! ```text
//! refused socket=6f1c…-pod-uid-a peer=9b2e…-pod-uid-b pid=4242 count=3
//! refused socket=6f1c…-pod-uid-a peer=- pid=4301 count=1
//! ```
//! (`peer=-`: a process in no pod; `pid`: the last one refused). A client line's second and
//! third fields are numbers, so a client named `refused` is still read as a client.
//! `parse(render(r)) == r`.

use std::fmt::Write as _;

use crate::resource_config::is_valid_id;

/// The file name under a GPU's directory.
pub const USAGE_FILE: &str = "usage.txt";

const MAGIC: &str = "gem-schd-usage v1";

/// One client's figures.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientUsage {
    pub id: String,
    /// GPU time charged within the window ending at `at_us`: the token time held (less what
    /// co-runners took of its turns) plus its co-holds' charges.
    pub used_us: u64,
    /// Device memory counted for the client (all its processes).
    pub mem_used: u64,
    /// How much of its holds the client's kernels kept the GPU busy, in thousandths (from
    /// its hooks' Busy reports; `None` until known, or with co-running off).
    pub fill_milli: Option<u16>,
    /// The part of `used_us` charged for co-holds (running beside the token holder).
    pub co_used_us: u64,
    /// The processes connected to the client's socket (as gem-schd's PID namespace numbers
    /// them), sorted, each once.
    pub pids: Vec<u32>,
}

/// Connections to one pod's socket refused because the peer ran in another pod (or none).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Refusal {
    /// The socket's client ID (the pod UID in Kubernetes).
    pub socket: String,
    /// The pod the refused process ran in; `None`: in no pod, or not found.
    pub peer_pod: Option<String>,
    /// The last refused process (0: unknown).
    pub pid: u32,
    /// Refusals since gem-schd started.
    pub count: u64,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UsageReport {
    pub window_us: u64,
    pub at_us: u64,
    pub clients: Vec<ClientUsage>,
    pub refused: Vec<Refusal>,
}

/// `us` as a share of the window, in [0, 1] (0 for an empty window).
fn of_window(us: u64, window_us: u64) -> f64 {
    if window_us == 0 {
        return 0.0;
    }
    (us as f64 / window_us as f64).min(1.0)
}

/// A malformed report; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("usage report line {line}: {message}")]
pub struct UsageError {
    pub line: usize,
    pub message: String,
}

impl ClientUsage {
    /// The share of the GPU's time the client held over the window, in [0, 1]
    /// (capped: a hold that straddles the window's start is counted whole).
    pub fn share(&self, window_us: u64) -> f64 {
        of_window(self.used_us, window_us)
    }

    /// The part of [`share`](Self::share) charged for co-holds, in [0, 1].
    pub fn co_share(&self, window_us: u64) -> f64 {
        of_window(self.co_used_us, window_us)
    }

    /// The client's fill in [0, 1], once known.
    pub fn fill(&self) -> Option<f64> {
        self.fill_milli.map(|f| f64::from(f) / 1000.0)
    }
}

impl UsageReport {
    pub fn render(&self) -> String {
        let mut out = format!(
            "{MAGIC} window_us={} at_us={}\n",
            self.window_us, self.at_us
        );
        for c in &self.clients {
            let _ = write!(out, "{} {} {}", c.id, c.used_us, c.mem_used);
            if let Some(f) = c.fill_milli {
                let _ = write!(out, " fill_milli={f}");
            }
            if c.co_used_us > 0 {
                let _ = write!(out, " co_used_us={}", c.co_used_us);
            }
            if !c.pids.is_empty() {
                let pids: Vec<String> = c.pids.iter().map(u32::to_string).collect();
                let _ = write!(out, " pids={}", pids.join(","));
            }
            out.push('\n');
        }
        for r in &self.refused {
            let _ = writeln!(
                out,
                "refused socket={} peer={} pid={} count={}",
                r.socket,
                r.peer_pod.as_deref().unwrap_or("-"),
                r.pid,
                r.count
            );
        }
        out
    }

    pub fn parse(text: &str) -> Result<UsageReport, UsageError> {
        let err = |line: usize, message: String| UsageError { line, message };
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
        let (_, head) = lines
            .next()
            .ok_or_else(|| err(1, "empty; expected the header line".into()))?;
        let rest = head.strip_prefix(MAGIC).ok_or_else(|| {
            err(
                1,
                format!("expected {MAGIC:?} at the start, found {head:?}"),
            )
        })?;
        let mut window_us = None;
        let mut at_us = None;
        for field in rest.split_whitespace() {
            let (k, v) = field
                .split_once('=')
                .ok_or_else(|| err(1, format!("{field:?} is not key=value")))?;
            let n: u64 = v
                .parse()
                .map_err(|_| err(1, format!("{k}={v:?} is not a whole number")))?;
            match k {
                "window_us" => window_us = Some(n),
                "at_us" => at_us = Some(n),
                _ => return Err(err(1, format!("unknown field {k:?}"))),
            }
        }
        let window_us = window_us
            .filter(|w| *w > 0)
            .ok_or_else(|| err(1, "window_us missing or 0".into()))?;
        let at_us = at_us.ok_or_else(|| err(1, "at_us missing".into()))?;
        let mut clients: Vec<ClientUsage> = vec![];
        let mut refused: Vec<Refusal> = vec![];
        for (n, line) in lines {
            if line.trim().is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.first() == Some(&"refused") && f.get(1).is_some_and(|s| s.starts_with("socket=")) {
                refused.push(parse_refusal(n, &f[1..])?);
                continue;
            }
            let [id, used, mem, extra @ ..] = f.as_slice() else {
                return Err(err(
                    n,
                    format!("expected `ID USED_US MEM_USED_BYTES`, found {line:?}"),
                ));
            };
            if !is_valid_id(id) {
                return Err(err(n, format!("{id:?} is not a client ID")));
            }
            if clients.iter().any(|c| c.id == *id) {
                return Err(err(n, format!("client {id:?} listed twice")));
            }
            let num = |s: &str, what: &str| {
                s.parse::<u64>()
                    .map_err(|_| err(n, format!("{what} {s:?} is not a whole number")))
            };
            let mut c = ClientUsage {
                id: id.to_string(),
                used_us: num(used, "USED_US")?,
                mem_used: num(mem, "MEM_USED_BYTES")?,
                ..ClientUsage::default()
            };
            for field in extra {
                let (k, v) = field
                    .split_once('=')
                    .ok_or_else(|| err(n, format!("{field:?} is not key=value")))?;
                match k {
                    "fill_milli" => {
                        c.fill_milli =
                            Some(v.parse().ok().filter(|f| *f <= 1000).ok_or_else(|| {
                                err(
                                    n,
                                    format!("fill_milli={v:?} is not a whole number in 0..=1000"),
                                )
                            })?)
                    }
                    "co_used_us" => c.co_used_us = num(v, "co_used_us")?,
                    "pids" => {
                        c.pids = v
                            .split(',')
                            .map(|p| p.parse::<u32>())
                            .collect::<Result<_, _>>()
                            .map_err(|_| err(n, format!("pids={v:?} is not a list of PIDs")))?
                    }
                    _ => return Err(err(n, format!("unknown field {k:?}"))),
                }
            }
            clients.push(c);
        }
        Ok(UsageReport {
            window_us,
            at_us,
            clients,
            refused,
        })
    }

    pub fn client(&self, id: &str) -> Option<&ClientUsage> {
        self.clients.iter().find(|c| c.id == id)
    }
}

/// The fields of a `refused` line after its first word.
fn parse_refusal(n: usize, fields: &[&str]) -> Result<Refusal, UsageError> {
    let err = |message: String| UsageError { line: n, message };
    let mut r = Refusal::default();
    let mut seen = 0;
    for field in fields {
        let (k, v) = field
            .split_once('=')
            .ok_or_else(|| err(format!("{field:?} is not key=value")))?;
        let num = |what: &str| {
            v.parse::<u64>()
                .map_err(|_| err(format!("{what}={v:?} is not a whole number")))
        };
        match k {
            "socket" if is_valid_id(v) => r.socket = v.to_string(),
            "peer" if v == "-" => r.peer_pod = None,
            "peer" if is_valid_id(v) => r.peer_pod = Some(v.to_string()),
            "pid" => {
                r.pid = u32::try_from(num("pid")?)
                    .map_err(|_| err(format!("pid={v:?} is too large")))?
            }
            "count" => r.count = num("count")?,
            "socket" | "peer" => return Err(err(format!("{k}={v:?} is not a client ID"))),
            _ => return Err(err(format!("unknown field {k:?}"))),
        }
        seen += 1;
    }
    if seen != 4 || r.socket.is_empty() {
        return Err(err(
            "expected `refused socket=ID peer=UID|- pid=N count=N`".into()
        ));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_what_it_renders_and_computes_shares() {
        let r = UsageReport {
            window_us: 10_000_000,
            at_us: 42,
            clients: vec![
                ClientUsage {
                    id: "a".into(),
                    used_us: 3_000_000,
                    mem_used: 1 << 30,
                    fill_milli: Some(312),
                    co_used_us: 2_500_000,
                    pids: vec![7, 4242],
                },
                ClientUsage {
                    id: "b".into(),
                    used_us: 12_000_000,
                    mem_used: 0,
                    ..ClientUsage::default()
                },
                // Named like the refusal lines' first word, still a client.
                ClientUsage {
                    id: "refused".into(),
                    used_us: 1,
                    mem_used: 2,
                    ..ClientUsage::default()
                },
            ],
            refused: vec![
                Refusal {
                    socket: "a".into(),
                    peer_pod: Some("b".into()),
                    pid: 99,
                    count: 3,
                },
                Refusal {
                    socket: "a".into(),
                    peer_pod: None,
                    pid: 0,
                    count: 1,
                },
            ],
        };
        let text = r.render();
        assert!(
            text.contains("\na 3000000 1073741824 fill_milli=312 co_used_us=2500000 pids=7,4242\n"),
            "{text}"
        );
        assert!(text.contains("\nb 12000000 0\n"), "{text}");
        assert!(
            text.ends_with(
                "\nrefused socket=a peer=b pid=99 count=3\nrefused socket=a peer=- pid=0 count=1\n"
            ),
            "{text}"
        );
        assert_eq!(UsageReport::parse(&text), Ok(r.clone()));
        assert!((r.clients[0].share(r.window_us) - 0.3).abs() < 1e-12);
        assert_eq!(r.clients[1].share(r.window_us), 1.0);
        assert_eq!(r.client("b").map(|c| c.mem_used), Some(0));
    }

    #[test]
    fn refuses_bad_reports_by_line() {
        for (text, line, needle) in [
            ("", 1, "empty"),
            ("gem-schd-usage v2 window_us=1 at_us=0\n", 1, "expected"),
            ("gem-schd-usage v1 window_us=0 at_us=0\n", 1, "window_us"),
            ("gem-schd-usage v1 window_us=x at_us=0\n", 1, "whole number"),
            (
                "gem-schd-usage v1 window_us=5 at_us=0 extra=1\n",
                1,
                "unknown",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1\n",
                2,
                "expected",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na -1 0\n",
                2,
                "USED_US",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0\na 2 0\n",
                3,
                "twice",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\n../x 1 0\n",
                2,
                "client ID",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 fill_milli=1001\n",
                2,
                "fill_milli",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 fill_milli=-1\n",
                2,
                "fill_milli",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 co_used_us=x\n",
                2,
                "co_used_us",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 fill\n",
                2,
                "key=value",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 color=red\n",
                2,
                "unknown",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\na 1 0 pids=1,x\n",
                2,
                "PIDs",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\nrefused socket=a peer=- pid=1\n",
                2,
                "expected",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\nrefused socket=a peer=- pid=1 count=x\n",
                2,
                "count",
            ),
            (
                "gem-schd-usage v1 window_us=5 at_us=0\nrefused socket=../a peer=- pid=1 count=1\n",
                2,
                "client ID",
            ),
        ] {
            let e = UsageReport::parse(text).expect_err(text);
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.message.contains(needle), "{text:?}: {e}");
        }
    }

    proptest! {
        #[test]
        fn any_text_parses_or_errs_without_panicking(s in "\\PC{0,200}") {
            let _ = UsageReport::parse(&s);
        }

        #[test]
        fn round_trips(window in 1u64..u64::MAX, at in any::<u64>(),
                       cs in proptest::collection::btree_map(
                           "[a-z0-9-]{1,40}",
                           (any::<u64>(), any::<u64>(), proptest::option::of(0u16..=1000), any::<u64>(),
                            proptest::collection::vec(any::<u32>(), 0..4)),
                           0..8),
                       rs in proptest::collection::vec(
                           ("[a-z0-9-]{1,40}", proptest::option::of("[a-z0-9][a-z0-9-]{0,39}"), any::<u32>(), any::<u64>()),
                           0..4)) {
            let r = UsageReport {
                window_us: window,
                at_us: at,
                clients: cs
                    .into_iter()
                    .map(|(id, (u, m, fill_milli, co_used_us, pids))| ClientUsage {
                        id, used_us: u, mem_used: m, fill_milli, co_used_us, pids,
                    })
                    .collect(),
                refused: rs
                    .into_iter()
                    .map(|(socket, peer_pod, pid, count)| Refusal { socket, peer_pod, pid, count })
                    .collect(),
            };
            prop_assert_eq!(UsageReport::parse(&r.render()), Ok(r));
        }
    }
}
