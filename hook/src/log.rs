//! Minimal logging to stderr (`KUBESHARE_HOOK_LOG=debug|info|off`, default info), written with
//! one `write(2)` per line so lines of concurrent threads do not interleave. No logging crate:
//! the hook lives inside other programs and must stay small.

use std::sync::atomic::{AtomicU8, Ordering};

pub const OFF: u8 = 0;
pub const INFO: u8 = 1;
pub const DEBUG: u8 = 2;
const UNSET: u8 = u8::MAX;

static LEVEL: AtomicU8 = AtomicU8::new(UNSET);

/// The level named by a `KUBESHARE_HOOK_LOG` value.
pub fn parse_level(v: Option<&str>) -> u8 {
    match v.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        Some("off") | Some("none") | Some("0") => OFF,
        Some("debug") | Some("trace") => DEBUG,
        _ => INFO,
    }
}

pub fn enabled(level: u8) -> bool {
    let mut l = LEVEL.load(Ordering::Relaxed);
    if l == UNSET {
        l = parse_level(std::env::var("KUBESHARE_HOOK_LOG").ok().as_deref());
        LEVEL.store(l, Ordering::Relaxed);
    }
    level <= l
}

pub fn write(level: u8, args: std::fmt::Arguments<'_>) {
    let tag = if level >= DEBUG { "debug" } else { "info" };
    let line = format!("[gemhook {} {tag}] {args}\n", std::process::id());
    // SAFETY: writes a live buffer to fd 2; a failed write is ignored on purpose.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

#[macro_export]
macro_rules! info {
    ($($a:tt)*) => { if $crate::log::enabled($crate::log::INFO) { $crate::log::write($crate::log::INFO, format_args!($($a)*)) } };
}

#[macro_export]
macro_rules! debug {
    ($($a:tt)*) => { if $crate::log::enabled($crate::log::DEBUG) { $crate::log::write($crate::log::DEBUG, format_args!($($a)*)) } };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(parse_level(None), INFO);
        assert_eq!(parse_level(Some("OFF")), OFF);
        assert_eq!(parse_level(Some("debug")), DEBUG);
        assert_eq!(parse_level(Some("bogus")), INFO);
    }
}
