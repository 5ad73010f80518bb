//! Connections to the gem-schd of each GPU: connecting under the unreachable policy
//! (`KUBESHARE_ON_UNREACHABLE`), what a token connection asks for on the way (Options,
//! WantSoon, WantGate, Parks), and the frames an older gem-schd refused, which are not sent
//! again.
//!
//! Each device the process uses has its own token connection and memory connection to the
//! gem-schd of that GPU (`<socket dir>/<uuid>.sock`): a token request may wait a long time, and
//! memory requests must not queue behind it.

use crate::config::{Unreachable, settings};
use crate::state::{gpu, watch_forks};
use crate::{debug, info, real};
use cuda_abi::*;
use gem_proto::{Client, ClientError, socket_path};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(cuDeviceGetUuid_v2, cuDeviceGetUuid,);
}

/// The UUID of device `dev`, as gem-schd's socket is named (read once); `None`: the driver
/// gave none, and the device runs unmanaged.
fn uuid(dev: usize) -> Option<String> {
    gpu(dev)
        .uuid
        .get_or_init(|| {
            let mut b = [0u8; 16];
            let d = dev as CUdevice;
            let mut rc = real!(cuDeviceGetUuid_v2, &mut b, d);
            if rc != CUDA_SUCCESS {
                rc = real!(cuDeviceGetUuid, &mut b, d);
            }
            if rc == CUDA_SUCCESS {
                Some(format_uuid(&b))
            } else {
                info!("device {dev}: cuDeviceGetUuid failed ({rc}); it runs unmanaged");
                None
            }
        })
        .clone()
}

/// What a connection is for: the read timeout and the waiting policy differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Token,
    Memory,
}

/// Connects to the gem-schd of device `dev`, following the unreachable policy: `None` means
/// "not now": policy `run` (run unmanaged for a while), a device without a UUID, or, for
/// memory, a gem-schd unreachable for longer than the I/O timeout under `wait` (memory calls
/// never wait forever; the caller fails closed).
pub fn connect(dev: usize, purpose: Purpose) -> Option<Client> {
    let uuid = uuid(dev)?;
    let s = settings();
    let path = socket_path(&s.socket_dir, &uuid);
    watch_forks();
    let mut logged: Option<Instant> = None;
    let started = Instant::now();
    let timeout = Duration::from_millis(s.io_timeout_ms);
    loop {
        let attempt = Client::connect_timeout(&path, std::process::id(), &uuid, Some(timeout))
            .and_then(|mut c| {
                if purpose == Purpose::Token {
                    ask_options(&uuid, &mut c)?;
                    ask_soon(&mut c)?;
                    ask_gate(&uuid, &mut c)?;
                    ask_park(&mut c)?;
                }
                Ok(c)
            });
        match attempt {
            // An older gem-schd refused Options, WantSoon or WantGate and closed the
            // connection: connect again, without it.
            Err(e)
                if matches!(
                    e.refused_kind(),
                    Some(
                        gem_proto::kind::OPTIONS
                            | gem_proto::kind::WANT_SOON
                            | gem_proto::kind::WANT_GATE
                    )
                ) =>
            {
                note_refusal(&e);
                continue;
            }
            Ok(c) => {
                let h = *c.hello();
                gpu(dev).cap.store(h.mem_limit, Ordering::Relaxed);
                let fd = match purpose {
                    Purpose::Token => &gpu(dev).token_fd,
                    Purpose::Memory => &gpu(dev).mem_fd,
                };
                fd.store(c.raw_fd(), Ordering::Release);
                info!(
                    "{purpose:?} connection to gem-schd for {uuid}: request {} limit {} (milli), memory cap {} bytes{}",
                    h.request_milli,
                    h.limit_milli,
                    h.mem_limit,
                    if logged.is_some() {
                        format!(", after waiting {:?}", started.elapsed())
                    } else {
                        String::new()
                    }
                );
                return Some(c);
            }
            Err(e) => match s.on_unreachable {
                Unreachable::Run => {
                    info!(
                        "gem-schd for {uuid} unreachable at {}: {e}; running unmanaged (KUBESHARE_ON_UNREACHABLE=run)",
                        path.display()
                    );
                    return None;
                }
                Unreachable::Wait => {
                    if purpose == Purpose::Memory && started.elapsed() >= timeout {
                        info!(
                            "gem-schd for {uuid} unreachable at {} for {:?}: {e}; refusing memory calls meanwhile",
                            path.display(),
                            started.elapsed()
                        );
                        return None;
                    }
                    if logged.is_none_or(|t| t.elapsed() > Duration::from_secs(30)) {
                        info!(
                            "gem-schd for {uuid} unreachable at {}: {e}; waiting (KUBESHARE_ON_UNREACHABLE=wait)",
                            path.display()
                        );
                        logged = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            },
        }
    }
}

/// Set once a gem-schd refused WantSoon (one older than it): not asked again.
static SOON_REFUSED: AtomicBool = AtomicBool::new(false);

/// Asks for Soon on a new token connection, unless the spin is off or gem-schd refused it
/// before. No reply: an older gem-schd's refusal arrives as the answer to the next request
/// (`note_refusal`), and the connection after it asks no more.
fn ask_soon(c: &mut Client) -> Result<(), ClientError> {
    let s = settings();
    if (s.soon_spin_ns == 0 && s.gate_ahead_ns == 0) || refused(gem_proto::kind::WANT_SOON) {
        return Ok(());
    }
    c.want_soon()
}

/// Set once a gem-schd refused WantGate (one older than it): not asked again.
static GATE_REFUSED: AtomicBool = AtomicBool::new(false);

/// Asks for the connection's gate page (`gate.rs`), after WantSoon: a gem-schd that sends no
/// Soon has no use for it. Not in unified-memory mode. A gem-schd that cannot make one says
/// so and the connection goes on without.
fn ask_gate(uuid: &str, c: &mut Client) -> Result<(), ClientError> {
    if settings().gate_ahead_ns == 0
        || refused(gem_proto::kind::WANT_SOON)
        || refused(gem_proto::kind::WANT_GATE)
        || crate::um::enabled()
    {
        return Ok(());
    }
    match c.want_gate() {
        Ok(()) => Ok(()),
        Err(ClientError::Server { code, message }) if code == gem_proto::code::GATE_UNAVAILABLE => {
            info!("gem-schd for {uuid} gave no gate page ({message}); blocking for each Grant");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Set once a gem-schd refused Parks (one older than it): not sent again, and holds drain.
static PARK_REFUSED: AtomicBool = AtomicBool::new(false);

/// Tells gem-schd that this connection parks its queue at a hold's end (`park.rs`), when
/// parking is on and the connection has a gate page: gem-schd then never hands the token on
/// at its notice. A connection that did not say so never parks.
fn ask_park(c: &mut Client) -> Result<(), ClientError> {
    if !crate::park::enabled() || c.gate().is_none() || refused(gem_proto::kind::PARKS) {
        return Ok(());
    }
    c.parks()
}

/// Set once a gem-schd refused Options (one older than it): not asked again.
static OPTIONS_REFUSED: AtomicBool = AtomicBool::new(false);

/// Asks gem-schd's Options on a new token connection (unless the environment decided them).
/// A refusal (an older gem-schd, which then hangs up) is remembered: not asked again.
fn ask_options(uuid: &str, c: &mut Client) -> Result<(), ClientError> {
    if settings().busy_every.is_some() || refused(gem_proto::kind::OPTIONS) {
        return Ok(());
    }
    match c.options() {
        Ok(busy_every) => {
            crate::timing::asked(busy_every);
            debug!(
                "gem-schd for {uuid} asks for Busy reports every {busy_every} launches (0: none)"
            );
            Ok(())
        }
        Err(e) => {
            if e.refused_kind() == Some(gem_proto::kind::OPTIONS) {
                info!(
                    "gem-schd for {uuid} does not know Options (an older version): connecting again without"
                );
            }
            Err(e)
        }
    }
}

/// Forgets a connection (after an error): its descriptor is no longer polled.
pub fn drop_client(slot: &mut Option<Client>, fd: &AtomicI32) {
    fd.store(-1, Ordering::Release);
    *slot = None;
}

/// Set once a gem-schd answered Renew with an error (one older than Renew): from then on
/// this process drains and asks with a TokenRequest at every quota's end, as before Renew.
static RENEW_REFUSED: AtomicBool = AtomicBool::new(false);

/// Set once a gem-schd refused Drain (one older than it): from then on the token moves on
/// after this process's drain and report, as before Drain.
static DRAIN_REFUSED: AtomicBool = AtomicBool::new(false);

/// A gem-schd older than a frame refuses it (Error{2} "unknown frame kind N") and hangs up;
/// the refusal arrives as the answer to whatever this process asked next. From then on the
/// frame is not sent again: Renew (the hold drains and asks again, as before it), Drain (the
/// token moves on after the drain, as before it), Busy (gem-schd learns no fill), Options
/// (no Busy reports asked for), WantSoon (the process blocks for every Grant), WantGate (no
/// launch queues ahead of a Grant) or Parks (holds drain). One reconnection per frame it
/// lacks.
pub(crate) fn note_refusal(e: &ClientError) {
    match e.refused_kind() {
        Some(gem_proto::kind::OPTIONS) => OPTIONS_REFUSED.store(true, Ordering::Relaxed),
        Some(gem_proto::kind::RENEW) => RENEW_REFUSED.store(true, Ordering::Relaxed),
        Some(gem_proto::kind::DRAIN) => DRAIN_REFUSED.store(true, Ordering::Relaxed),
        // Refused with the engine time: an older gem-schd; without it, older still.
        Some(gem_proto::kind::BUSY) if crate::cupti::on() => crate::cupti::refused(),
        Some(gem_proto::kind::BUSY) => crate::timing::refused(),
        Some(gem_proto::kind::WANT_SOON) => SOON_REFUSED.store(true, Ordering::Relaxed),
        Some(gem_proto::kind::WANT_GATE) => GATE_REFUSED.store(true, Ordering::Relaxed),
        Some(gem_proto::kind::PARKS) => PARK_REFUSED.store(true, Ordering::Relaxed),
        _ => {}
    }
}

/// Whether an older gem-schd refused frames of `kind` (`note_refusal`): the hook then goes on
/// as before that frame.
pub(crate) fn refused(kind: u8) -> bool {
    match kind {
        gem_proto::kind::RENEW => RENEW_REFUSED.load(Ordering::Relaxed),
        gem_proto::kind::DRAIN => DRAIN_REFUSED.load(Ordering::Relaxed),
        gem_proto::kind::WANT_SOON => SOON_REFUSED.load(Ordering::Relaxed),
        gem_proto::kind::WANT_GATE => GATE_REFUSED.load(Ordering::Relaxed),
        gem_proto::kind::PARKS => PARK_REFUSED.load(Ordering::Relaxed),
        gem_proto::kind::OPTIONS => OPTIONS_REFUSED.load(Ordering::Relaxed),
        _ => false,
    }
}
