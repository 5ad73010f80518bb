//! The hook's settings, from the environment, and whether it is active at all.
//!
//! Active means inside a KubeShare pod: the socket directory (`KUBESHARE_SOCKET_DIR`, default
//! `/kubeshare/run`) exists. Otherwise the hook is inert and every call passes straight through.
//! The activity check uses raw `getenv`/`stat`, because it runs inside the hook's `dlsym`,
//! which may be called while libraries are still loading (Rust's std may itself call `dlsym`).

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// What to do while gem-schd cannot be reached (`KUBESHARE_ON_UNREACHABLE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreachable {
    /// Fail closed: block launches and allocations until gem-schd answers, logging.
    Wait,
    /// Fail open: run without gating or memory cap, retrying gem-schd every few seconds.
    Run,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub socket_dir: PathBuf,
    pub on_unreachable: Unreachable,
    /// A holder that launched nothing for this long gives the token back.
    pub idle_release_us: u64,
    /// How long any reply of gem-schd is awaited (`KUBESHARE_HOOK_TIMEOUT_MS`).
    pub io_timeout_ms: u64,
    /// Read the precise clock in the last coarse tick before a hold's deadline
    /// (`KUBESHARE_HOOK_PRECISE_DEADLINE`, default on; `0` = the coarse clock alone).
    pub precise_deadline: bool,
    /// The queue-ahead bound in ns (`KUBESHARE_HOOK_MAX_AHEAD_US`, default 200 µs, 0 = off;
    /// see `ahead.rs`).
    pub max_ahead_ns: u64,
    /// How much more than the bound may be queued while the hold has at least that much time
    /// left, in ns (`KUBESHARE_HOOK_EARLY_AHEAD_US`, default 4 ms; 0 = the bound all hold long).
    pub early_ahead_ns: u64,
    /// How much GPU work may stay queued, in ns, while the process keeps the GPU: its hold
    /// renewed twice in a row, no hand-over due (`KUBESHARE_HOOK_SOLE_AHEAD_US`, default
    /// 5,000 µs; 0 = the bound and the early allowance alone).
    pub sole_ahead_ns: u64,
    /// How much GPU work may stay queued at a hold's end, in ns, when that is more than the
    /// bound (`KUBESHARE_HOOK_HANDOVER_AHEAD_US`, default 0 = the bound): the next holder,
    /// granted when this process stops launching, wakes up and launches while it runs.
    pub handover_ahead_ns: u64,
    /// How long the largest GPU pace the queue-ahead bound measured keeps counting, in ns: it
    /// fades by half every this long (`KUBESHARE_HOOK_PACE_HOLD_MS`, default 0 = the moving
    /// average alone; see `pace.rs`).
    pub pace_hold_ns: u64,
    /// At a quota's end, ask gem-schd to renew the hold before draining
    /// (`KUBESHARE_HOOK_RENEW`, default on; `0` = always drain and ask again, as before).
    pub renew: bool,
    /// One launch in about this many is timed with an event pair, to measure how busy the
    /// process keeps the GPU (`KUBESHARE_HOOK_BUSY_EVERY`; 0 = off; unset: what gem-schd asks
    /// for in OptionsOk, see `busy.rs`).
    pub busy_every: Option<u32>,
    /// After gem-schd's Soon (the holder drains, this process goes next), poll for the Grant
    /// for up to this long, in ns, instead of blocking (`KUBESHARE_HOOK_SOON_SPIN_US`, default
    /// 2,000 µs; 0 = Soon is not asked for).
    pub soon_spin_ns: u64,
    /// After Soon, on a connection with a gate page (gem-proto WantGate), let launches queue
    /// behind the gate while they bring up to this much GPU work, in ns, at the pace the
    /// queue-ahead bound measured, before the thread blocks for the Grant
    /// (`KUBESHARE_HOOK_GATE_AHEAD_US`, default 200 µs, as the queue-ahead bound; 0 = no gate
    /// asked for, Soon is spun on as before; see `gate.rs`).
    pub gate_ahead_ns: u64,
    /// At a hold's end, close the gate word and leave the work queued behind the hold's last
    /// probes parked on the GPU until the next Grant, instead of draining it
    /// (`KUBESHARE_HOOK_PARK`, default off; see `park.rs`).
    pub park: bool,
    /// While the hook reads engine time from CUPTI (`KUBESHARE_HOOK_CUPTI`, see `cupti.rs`),
    /// flush its records this often (`KUBESHARE_HOOK_CUPTI_FLUSH_MS`, default 5 ms)...
    pub cupti_flush_ms: u64,
    /// ... handing back the buffers being filled too (`KUBESHARE_HOOK_CUPTI_FLUSH_FORCED`,
    /// default on; `0` = only full buffers).
    pub cupti_flush_forced: bool,
    /// The size of each buffer the hook gives CUPTI for those records, bytes
    /// (`KUBESHARE_HOOK_CUPTI_BUFFER_KB`, default 64 KiB). Where flushes hand back only full
    /// buffers, a small one brings the records sooner.
    pub cupti_buffer_bytes: usize,
}

pub const DEFAULT_IO_TIMEOUT_MS: u64 = 5000;

pub fn parse_timeout_ms(v: Option<&str>) -> Result<u64, String> {
    parse_whole_ms(
        "KUBESHARE_HOOK_TIMEOUT_MS",
        v,
        10..=600_000,
        DEFAULT_IO_TIMEOUT_MS,
    )
}

/// A whole number of ms within `range`; `default` when unset.
fn parse_whole_ms(
    name: &str,
    v: Option<&str>,
    range: std::ops::RangeInclusive<u64>,
    default: u64,
) -> Result<u64, String> {
    parse_whole(name, "ms", v, range, default)
}

/// A whole number of `unit` in `range`; `default` when unset or empty.
fn parse_whole(
    name: &str,
    unit: &str,
    v: Option<&str>,
    range: std::ops::RangeInclusive<u64>,
    default: u64,
) -> Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(default),
        Some(s) => match s.parse::<u64>() {
            Ok(n) if range.contains(&n) => Ok(n),
            _ => Err(format!(
                "{name}={s:?} is not a whole number of {unit} in {}..={}; using {default}",
                range.start(),
                range.end()
            )),
        },
    }
}

pub const DEFAULT_IDLE_RELEASE_US: u64 = 10_000;

pub fn parse_unreachable(v: Option<&str>) -> Result<Unreachable, String> {
    match v.map(str::trim) {
        None | Some("") | Some("wait") => Ok(Unreachable::Wait),
        Some("run") => Ok(Unreachable::Run),
        Some(other) => Err(format!(
            "KUBESHARE_ON_UNREACHABLE={other:?} is not `wait` or `run`; using `wait`"
        )),
    }
}

pub fn parse_idle_ms(v: Option<&str>) -> Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(DEFAULT_IDLE_RELEASE_US),
        Some(s) => match s.parse::<f64>() {
            Ok(ms) if ms.is_finite() && (0.5..=10_000.0).contains(&ms) => Ok((ms * 1000.0) as u64),
            _ => Err(format!(
                "KUBESHARE_HOOK_IDLE_MS={s:?} is not a number of ms in 0.5..=10000; using {}",
                DEFAULT_IDLE_RELEASE_US / 1000
            )),
        },
    }
}

pub fn parse_flag(name: &str, v: Option<&str>, default: bool) -> Result<bool, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(default),
        Some("1" | "true" | "on") => Ok(true),
        Some("0" | "false" | "off") => Ok(false),
        Some(other) => Err(format!(
            "{name}={other:?} is not 0/1/true/false/on/off; using {default}"
        )),
    }
}

/// The queue-ahead bound's default, µs (beside ResNet-50 training a batch-1 inference tenant's
/// p99 went from 15.4 to 10.7 ms with it, 13.0 ms at 500 µs).
pub const DEFAULT_MAX_AHEAD_US: u64 = 200;

pub fn parse_max_ahead_us(v: Option<&str>) -> Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(DEFAULT_MAX_AHEAD_US),
        Some("0") => Ok(0),
        Some(s) => match s.parse::<u64>() {
            Ok(us) if (20..=1_600).contains(&us) => Ok(us),
            _ => Err(format!(
                "KUBESHARE_HOOK_MAX_AHEAD_US={s:?} is not 0 or a whole number of µs in 20..=1600; using {DEFAULT_MAX_AHEAD_US}"
            )),
        },
    }
}

/// How much more than the queue-ahead bound may be queued early in a hold, µs (what is queued
/// before the deadline runs before it; `ahead.rs`). At 600 µs the queue of a training step
/// ran dry at its CPU's pauses: beside three other tenants on H200s, the TransformerEncoder
/// tenant left the GPU idle between its own kernels 0.036–0.052 of the time at 600 µs and
/// 0.022–0.030 at 4 ms, and the four kept it busy 0.829–0.869 and 0.860–0.877.
pub const DEFAULT_EARLY_AHEAD_US: u64 = 4_000;

pub fn parse_early_ahead_us(v: Option<&str>) -> Result<u64, String> {
    parse_queue_us("KUBESHARE_HOOK_EARLY_AHEAD_US", v, DEFAULT_EARLY_AHEAD_US)
}

/// How much GPU work may stay queued, µs, while the process keeps the GPU (its hold renewed
/// twice in a row; `ahead.rs`): the 0.8 ms queue of the bound and the early allowance
/// cost ResNet-50 training alone 3 pp of its native rate on an H100.
pub const DEFAULT_SOLE_AHEAD_US: u64 = 5_000;

pub fn parse_sole_ahead_us(v: Option<&str>) -> Result<u64, String> {
    parse_queue_us("KUBESHARE_HOOK_SOLE_AHEAD_US", v, DEFAULT_SOLE_AHEAD_US)
}

/// How much GPU work may stay queued at a hold's end, µs (`ahead.rs`): gem-schd hands the token
/// on when the holder stops launching, and the next process's wake-up and first launches run
/// while this drains (the simulation's four tenants, `tests/sim_handover.rs` in gem-schd, kept
/// the GPU 0.965 busy with a 0.3 ms wake-up and the bound's 0.2 ms queued, 0.981 with 0.5 ms).
/// Off by default: where the next process wakes sooner than this drains, the GPU may run its
/// first kernels beside the drain, and gem-schd charges them to this process (docs/hook.md).
pub const DEFAULT_HANDOVER_AHEAD_US: u64 = 0;

pub fn parse_handover_ahead_us(v: Option<&str>) -> Result<u64, String> {
    parse_queue_us(
        "KUBESHARE_HOOK_HANDOVER_AHEAD_US",
        v,
        DEFAULT_HANDOVER_AHEAD_US,
    )
}

/// Default of [`Settings::pace_hold_ns`], ms.
pub const DEFAULT_PACE_HOLD_MS: u64 = 0;

pub fn parse_pace_hold_ms(v: Option<&str>) -> Result<u64, String> {
    parse_whole_ms(
        "KUBESHARE_HOOK_PACE_HOLD_MS",
        v,
        0..=60_000,
        DEFAULT_PACE_HOLD_MS,
    )
}

/// Default of [`Settings::cupti_flush_ms`].
pub const DEFAULT_CUPTI_FLUSH_MS: u64 = 5;

/// Default of [`Settings::cupti_buffer_bytes`], KiB: about 2,700 switch records.
pub const DEFAULT_CUPTI_BUFFER_KB: u64 = 64;

pub fn parse_cupti_buffer_kb(v: Option<&str>) -> Result<u64, String> {
    parse_whole(
        "KUBESHARE_HOOK_CUPTI_BUFFER_KB",
        "KiB",
        v,
        1..=16_384,
        DEFAULT_CUPTI_BUFFER_KB,
    )
}

pub fn parse_cupti_flush_ms(v: Option<&str>) -> Result<u64, String> {
    parse_whole_ms(
        "KUBESHARE_HOOK_CUPTI_FLUSH_MS",
        v,
        1..=60_000,
        DEFAULT_CUPTI_FLUSH_MS,
    )
}

/// Default of [`Settings::soon_spin_ns`], µs: longer than the usual drains it waits for (the
/// matmul and encoder tenants' drains were 1.3-1.4 ms at the median on an H200).
pub const DEFAULT_SOON_SPIN_US: u64 = 2000;

/// Default of [`Settings::gate_ahead_ns`], µs: the queue-ahead bound's default, as much GPU
/// work as a hold leaves queued at its end; more than the next process's wake-up and launch
/// (0.10-0.13 ms on H200s) that it hides.
pub const DEFAULT_GATE_AHEAD_US: u64 = 200;

pub fn parse_gate_ahead_us(v: Option<&str>) -> Result<u64, String> {
    parse_queue_us("KUBESHARE_HOOK_GATE_AHEAD_US", v, DEFAULT_GATE_AHEAD_US)
}

pub fn parse_soon_spin_us(v: Option<&str>) -> Result<u64, String> {
    parse_queue_us("KUBESHARE_HOOK_SOON_SPIN_US", v, DEFAULT_SOON_SPIN_US)
}

/// A queue allowance (or a spin) in whole µs, 0..=50000 (50 ms: a training step's worth).
fn parse_queue_us(name: &str, v: Option<&str>, default: u64) -> Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(default),
        Some(s) => match s.parse::<u64>() {
            Ok(us) if us <= 50_000 => Ok(us),
            _ => Err(format!(
                "{name}={s:?} is not a whole number of µs in 0..=50000; using {default}"
            )),
        },
    }
}

/// See [`Settings::busy_every`]: `None` (unset) leaves it to gem-schd.
pub fn parse_busy_every(v: Option<&str>) -> Result<Option<u32>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => match s.parse::<u32>() {
            Ok(n) if n <= 100_000 => Ok(Some(n)),
            _ => Err(format!(
                "KUBESHARE_HOOK_BUSY_EVERY={s:?} is not a whole number in 0..=100000; leaving it to gem-schd"
            )),
        },
    }
}

/// A setting as parsed, or its default where the value was bad: the parser's message says so.
fn or_logged<T>(parsed: Result<T, String>, default: T) -> T {
    parsed.unwrap_or_else(|e| {
        crate::info!("{e}");
        default
    })
}

pub fn settings() -> &'static Settings {
    static S: OnceLock<Settings> = OnceLock::new();
    S.get_or_init(|| {
        let get = |k: &str| std::env::var(k).ok();
        let on_unreachable = or_logged(
            parse_unreachable(get("KUBESHARE_ON_UNREACHABLE").as_deref()),
            Unreachable::Wait,
        );
        let idle_release_us = or_logged(
            parse_idle_ms(get("KUBESHARE_HOOK_IDLE_MS").as_deref()),
            DEFAULT_IDLE_RELEASE_US,
        );
        let io_timeout_ms = or_logged(
            parse_timeout_ms(get("KUBESHARE_HOOK_TIMEOUT_MS").as_deref()),
            DEFAULT_IO_TIMEOUT_MS,
        );
        const PRECISE: &str = "KUBESHARE_HOOK_PRECISE_DEADLINE";
        let precise_deadline = or_logged(parse_flag(PRECISE, get(PRECISE).as_deref(), true), true);
        let max_ahead_us = or_logged(
            parse_max_ahead_us(get("KUBESHARE_HOOK_MAX_AHEAD_US").as_deref()),
            DEFAULT_MAX_AHEAD_US,
        );
        let early_ahead_us = or_logged(
            parse_early_ahead_us(get("KUBESHARE_HOOK_EARLY_AHEAD_US").as_deref()),
            DEFAULT_EARLY_AHEAD_US,
        );
        let sole_ahead_us = or_logged(
            parse_sole_ahead_us(get("KUBESHARE_HOOK_SOLE_AHEAD_US").as_deref()),
            DEFAULT_SOLE_AHEAD_US,
        );
        let handover_ahead_us = or_logged(
            parse_handover_ahead_us(get("KUBESHARE_HOOK_HANDOVER_AHEAD_US").as_deref()),
            DEFAULT_HANDOVER_AHEAD_US,
        );
        let pace_hold_ms = or_logged(
            parse_pace_hold_ms(get("KUBESHARE_HOOK_PACE_HOLD_MS").as_deref()),
            DEFAULT_PACE_HOLD_MS,
        );
        const RENEW: &str = "KUBESHARE_HOOK_RENEW";
        let renew = or_logged(parse_flag(RENEW, get(RENEW).as_deref(), true), true);
        let busy_every = or_logged(
            parse_busy_every(get("KUBESHARE_HOOK_BUSY_EVERY").as_deref()),
            None,
        );
        let soon_spin_us = or_logged(
            parse_soon_spin_us(get("KUBESHARE_HOOK_SOON_SPIN_US").as_deref()),
            DEFAULT_SOON_SPIN_US,
        );
        let gate_ahead_us = or_logged(
            parse_gate_ahead_us(get("KUBESHARE_HOOK_GATE_AHEAD_US").as_deref()),
            DEFAULT_GATE_AHEAD_US,
        );
        const PARK: &str = "KUBESHARE_HOOK_PARK";
        let park = or_logged(parse_flag(PARK, get(PARK).as_deref(), false), false);
        let cupti_flush_ms = or_logged(
            parse_cupti_flush_ms(get("KUBESHARE_HOOK_CUPTI_FLUSH_MS").as_deref()),
            DEFAULT_CUPTI_FLUSH_MS,
        );
        const FORCED: &str = "KUBESHARE_HOOK_CUPTI_FLUSH_FORCED";
        let cupti_flush_forced = or_logged(parse_flag(FORCED, get(FORCED).as_deref(), true), true);
        let cupti_buffer_kb = or_logged(
            parse_cupti_buffer_kb(get("KUBESHARE_HOOK_CUPTI_BUFFER_KB").as_deref()),
            DEFAULT_CUPTI_BUFFER_KB,
        );
        let socket_dir = get(gem_proto::SOCKET_DIR_ENV)
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| gem_proto::DEFAULT_SOCKET_DIR.to_string())
            .into();
        Settings {
            socket_dir,
            on_unreachable,
            idle_release_us,
            io_timeout_ms,
            precise_deadline,
            max_ahead_ns: max_ahead_us * 1000,
            early_ahead_ns: early_ahead_us * 1000,
            sole_ahead_ns: sole_ahead_us * 1000,
            handover_ahead_ns: handover_ahead_us * 1000,
            pace_hold_ns: pace_hold_ms * 1_000_000,
            renew,
            busy_every,
            soon_spin_ns: soon_spin_us * 1000,
            gate_ahead_ns: gate_ahead_us * 1000,
            park,
            cupti_flush_ms,
            cupti_flush_forced,
            cupti_buffer_bytes: cupti_buffer_kb as usize * 1024,
        }
    })
}

const UNKNOWN: u8 = 0;
const INERT: u8 = 1;
const ACTIVE: u8 = 2;
static MODE: AtomicU8 = AtomicU8::new(UNKNOWN);

/// Whether the hook enforces anything in this process (decided once).
#[inline]
pub fn active() -> bool {
    match MODE.load(Ordering::Relaxed) {
        ACTIVE => true,
        INERT => false,
        _ => {
            let a = socket_dir_exists();
            MODE.store(if a { ACTIVE } else { INERT }, Ordering::Relaxed);
            if a {
                crate::debug!("active: socket directory present");
            }
            a
        }
    }
}

fn socket_dir_exists() -> bool {
    // SAFETY: getenv with a constant name; the result is copied before any env change could
    // matter; stat into a zeroed struct.
    unsafe {
        let env = libc::getenv(c"KUBESHARE_SOCKET_DIR".as_ptr());
        let default: &CStr = kubeshare_api::layout::POD_SOCKET_DIR_C;
        let path = if env.is_null() || *env == 0 {
            default.as_ptr()
        } else {
            env
        };
        let mut st: libc::stat = std::mem::zeroed();
        libc::stat(path, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFDIR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_policy() {
        assert_eq!(parse_unreachable(None), Ok(Unreachable::Wait));
        assert_eq!(parse_unreachable(Some("run")), Ok(Unreachable::Run));
        assert_eq!(parse_unreachable(Some(" wait ")), Ok(Unreachable::Wait));
        assert!(parse_unreachable(Some("yolo")).is_err());
    }

    #[test]
    fn timeout_ms() {
        assert_eq!(parse_timeout_ms(None), Ok(DEFAULT_IO_TIMEOUT_MS));
        assert_eq!(parse_timeout_ms(Some("250")), Ok(250));
        assert!(parse_timeout_ms(Some("0")).is_err());
        assert!(parse_timeout_ms(Some("1.5")).is_err());
        assert!(parse_timeout_ms(Some("18446744073709551616")).is_err());
    }

    #[test]
    fn early_ahead() {
        assert_eq!(parse_early_ahead_us(None), Ok(DEFAULT_EARLY_AHEAD_US));
        assert_eq!(parse_early_ahead_us(Some("0")), Ok(0));
        assert_eq!(parse_early_ahead_us(Some(" 50000 ")), Ok(50_000));
        assert!(parse_early_ahead_us(Some("50001")).is_err());
        assert!(parse_early_ahead_us(Some("-1")).is_err());
        assert!(parse_early_ahead_us(Some("x")).is_err());
    }

    #[test]
    fn sole_ahead() {
        assert_eq!(parse_sole_ahead_us(None), Ok(DEFAULT_SOLE_AHEAD_US));
        assert_eq!(parse_sole_ahead_us(Some("0")), Ok(0));
        assert_eq!(parse_sole_ahead_us(Some("20000")), Ok(20_000));
        let e = parse_sole_ahead_us(Some("50001")).unwrap_err();
        assert!(e.starts_with("KUBESHARE_HOOK_SOLE_AHEAD_US="), "{e}");
        assert!(parse_sole_ahead_us(Some("5ms")).is_err());
    }

    #[test]
    fn pace_hold() {
        assert_eq!(parse_pace_hold_ms(None), Ok(DEFAULT_PACE_HOLD_MS));
        assert_eq!(parse_pace_hold_ms(Some(" 200 ")), Ok(200));
        assert_eq!(parse_pace_hold_ms(Some("60000")), Ok(60_000));
        let e = parse_pace_hold_ms(Some("60001")).unwrap_err();
        assert!(e.starts_with("KUBESHARE_HOOK_PACE_HOLD_MS="), "{e}");
        assert!(parse_pace_hold_ms(Some("-1")).is_err());
    }

    #[test]
    fn cupti_flush() {
        assert_eq!(parse_cupti_flush_ms(None), Ok(DEFAULT_CUPTI_FLUSH_MS));
        assert_eq!(parse_cupti_flush_ms(Some(" 50 ")), Ok(50));
        for bad in ["0", "60001", "-1", "5ms"] {
            let e = parse_cupti_flush_ms(Some(bad)).unwrap_err();
            assert!(e.starts_with("KUBESHARE_HOOK_CUPTI_FLUSH_MS="), "{e}");
        }
    }

    #[test]
    fn cupti_buffer() {
        assert_eq!(parse_cupti_buffer_kb(None), Ok(DEFAULT_CUPTI_BUFFER_KB));
        assert_eq!(parse_cupti_buffer_kb(Some(" 8 ")), Ok(8));
        assert_eq!(parse_cupti_buffer_kb(Some("16384")), Ok(16_384));
        for bad in ["0", "16385", "-1", "8k", "18446744073709551616"] {
            let e = parse_cupti_buffer_kb(Some(bad)).unwrap_err();
            assert!(
                e.starts_with("KUBESHARE_HOOK_CUPTI_BUFFER_KB=") && e.contains("KiB"),
                "{e}"
            );
        }
    }

    #[test]
    fn handover_ahead() {
        assert_eq!(parse_handover_ahead_us(None), Ok(DEFAULT_HANDOVER_AHEAD_US));
        assert_eq!(parse_handover_ahead_us(Some("0")), Ok(0));
        assert_eq!(parse_handover_ahead_us(Some("1500")), Ok(1500));
        let e = parse_handover_ahead_us(Some("50001")).unwrap_err();
        assert!(e.starts_with("KUBESHARE_HOOK_HANDOVER_AHEAD_US="), "{e}");
        assert!(parse_handover_ahead_us(Some("0.5")).is_err());
    }

    #[test]
    fn max_ahead() {
        assert_eq!(parse_max_ahead_us(None), Ok(DEFAULT_MAX_AHEAD_US));
        assert_eq!(parse_max_ahead_us(Some("0")), Ok(0));
        assert_eq!(parse_max_ahead_us(Some("1000")), Ok(1000));
        assert_eq!(parse_max_ahead_us(Some("50")), Ok(50));
        assert!(parse_max_ahead_us(Some("10")).is_err());
        assert!(parse_max_ahead_us(Some("5000")).is_err());
        assert!(parse_max_ahead_us(Some("x")).is_err());
    }

    #[test]
    fn flags() {
        assert_eq!(parse_flag("X", None, true), Ok(true));
        assert_eq!(parse_flag("X", Some("0"), true), Ok(false));
        assert_eq!(parse_flag("X", Some(" off "), true), Ok(false));
        assert_eq!(parse_flag("X", Some("1"), false), Ok(true));
        assert!(parse_flag("X", Some("maybe"), true).is_err());
    }

    #[test]
    fn idle_ms() {
        assert_eq!(parse_idle_ms(None), Ok(DEFAULT_IDLE_RELEASE_US));
        assert_eq!(parse_idle_ms(Some("2.5")), Ok(2500));
        assert!(parse_idle_ms(Some("0")).is_err());
        assert!(parse_idle_ms(Some("NaN")).is_err());
        assert!(parse_idle_ms(Some("-3")).is_err());
    }

    #[test]
    fn busy_every() {
        assert_eq!(parse_busy_every(None), Ok(None));
        assert_eq!(parse_busy_every(Some("")), Ok(None));
        assert_eq!(parse_busy_every(Some(" 0 ")), Ok(Some(0)));
        assert_eq!(parse_busy_every(Some("1")), Ok(Some(1)));
        assert_eq!(parse_busy_every(Some("2")), Ok(Some(2)));
        assert_eq!(parse_busy_every(Some("100000")), Ok(Some(100_000)));
        for bad in ["100001", "-4", "x", "4294967296"] {
            assert!(parse_busy_every(Some(bad)).is_err(), "{bad}");
        }
    }
}
