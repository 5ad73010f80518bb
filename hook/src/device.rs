//! Per-GPU enforcement: the launch gate (gem-schd's token) and the memory budget.
//!
//! Each device the process uses has its own token connection and memory connection to the
//! gem-schd of that GPU (`<socket dir>/<uuid>.sock`): a token request may wait a long time, and
//! memory requests must not queue behind it.
//!
//! Launch gate. While the token is valid, a launch reads the current context's device, the
//! coarse clock (vDSO) and one atomic deadline: no lock, no system call. When the deadline has
//! passed, the launching thread takes the device's token lock, waits for the work it queued
//! (`cuCtxSynchronize`), reports how far it overran the quota, and asks again (gem-schd then
//! hands the token to whoever is due). A background thread gives the token back (Release) when
//! the process has launched nothing for `KUBESHARE_HOOK_IDLE_MS`, once its queued work is done,
//! so an idle tenant does not hold the GPU.
//!
//! Memory: every allocation is reserved with gem-schd before the driver sees it (refused
//! beyond the pod's cap), released if the driver fails, and credited when freed; a map from
//! pointer or handle to size remembers what each free gives back.

use crate::clock::{coarse_ns, precise_ns};
use crate::config::{Unreachable, active, settings};
use crate::cuda::*;
use crate::{debug, info, real};
use gem_proto::{Client, socket_path};
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub const MAX_DEVICES: usize = 64;
/// Under `KUBESHARE_ON_UNREACHABLE=run`, how long a device runs unmanaged before retrying.
const BYPASS_NS: u64 = 5_000_000_000;

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(
        cuCtxGetDevice,
        cuDeviceGetCount,
        cuCtxGetCurrent,
        cuCtxSetCurrent,
        cuCtxSynchronize,
        cuStreamIsCapturing,
        cuThreadExchangeStreamCaptureMode,
        cuDeviceGetUuid_v2,
        cuDeviceGetUuid,
    );
}

type FnGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
type FnGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
type FnGetCtx = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
type FnSetCtx = unsafe extern "C" fn(CUcontext) -> CUresult;
type FnSync = unsafe extern "C" fn() -> CUresult;
type FnIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
type FnCaptureMode = unsafe extern "C" fn(*mut c_int) -> CUresult;
type FnUuid = unsafe extern "C" fn(*mut [u8; 16], CUdevice) -> CUresult;

struct Token {
    client: Option<Client>,
    /// Precise time of the grant, and the quota granted (µs).
    grant_ns: u64,
    quota_us: u64,
    /// The context the holder launched in (the idle thread synchronises it).
    ctx: usize,
    /// Length of the last burst that ended by going idle, reported with the next request.
    idle_burst_us: u64,
}

struct MemConn {
    client: Option<Client>,
    /// Until then (precise ns) the device runs without memory accounting (`run` policy).
    bypass_until_ns: u64,
}

/// One GPU as seen from this process.
pub struct Gpu {
    /// Coarse-clock time until which launches pass without any check (0: no token).
    deadline: AtomicU64,
    last_launch: AtomicU64,
    /// Coarse time at which the idle thread saw this process's queued work finished (with no
    /// launch since it looked): the GPU has been idle for this process since then.
    drained_at: AtomicU64,
    holding: AtomicBool,
    /// Bytes this process has counted against the pod on this device.
    outstanding: AtomicU64,
    token: Mutex<Token>,
    mem: Mutex<MemConn>,
    uuid: OnceLock<Option<String>>,
}

impl Gpu {
    const fn new() -> Self {
        Gpu {
            deadline: AtomicU64::new(0),
            last_launch: AtomicU64::new(0),
            drained_at: AtomicU64::new(0),
            holding: AtomicBool::new(false),
            outstanding: AtomicU64::new(0),
            token: Mutex::new(Token {
                client: None,
                grant_ns: 0,
                quota_us: 0,
                ctx: 0,
                idle_burst_us: 0,
            }),
            mem: Mutex::new(MemConn {
                client: None,
                bypass_until_ns: 0,
            }),
            uuid: OnceLock::new(),
        }
    }
}

static GPUS: [Gpu; MAX_DEVICES] = [const { Gpu::new() }; MAX_DEVICES];
/// One past the highest device index that has held a token (the idle thread scans that far).
static DEVICES_SEEN: AtomicUsize = AtomicUsize::new(0);
static IDLE_THREAD: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f`, turning a panic into `fallback`: no panic may cross the C ABI.
pub fn guard<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// How many devices the process sees (0: not asked yet). A process that sees one device (a
/// pod with one GPU) needs no `cuCtxGetDevice` call per launch to know which device it
/// launches on, which keeps the launch fast path free of driver calls.
static DEVICE_COUNT: AtomicI32 = AtomicI32::new(0);

/// The device of the calling thread's current context.
#[inline]
pub fn current_device() -> Option<usize> {
    match DEVICE_COUNT.load(Ordering::Relaxed) {
        1 => return Some(0),
        0 => {
            let mut n: c_int = 0;
            if real!(r::cuDeviceGetCount, FnGetCount, &mut n) == CUDA_SUCCESS && n > 0 {
                DEVICE_COUNT.store(n, Ordering::Relaxed);
                if n == 1 {
                    return Some(0);
                }
            }
        }
        _ => {}
    }
    let mut d: CUdevice = -1;
    let rc = real!(r::cuCtxGetDevice, FnGetDevice, &mut d);
    if rc == CUDA_SUCCESS {
        usize::try_from(d).ok().filter(|d| *d < MAX_DEVICES)
    } else {
        None
    }
}

/// `CUdevice` ordinal as an index into the device table.
pub fn device_index(d: CUdevice) -> Option<usize> {
    usize::try_from(d).ok().filter(|d| *d < MAX_DEVICES)
}

fn current_ctx() -> usize {
    let mut c: CUcontext = std::ptr::null_mut();
    let _ = real!(r::cuCtxGetCurrent, FnGetCtx, &mut c);
    c as usize
}

/// Waits for all work queued in the current context. Done in relaxed capture mode, so that it
/// cannot invalidate a CUDA-graph capture running in another thread.
fn sync_current() {
    let mut mode: c_int = CAPTURE_MODE_RELAXED;
    let swapped = real!(
        r::cuThreadExchangeStreamCaptureMode,
        FnCaptureMode,
        &mut mode
    ) == CUDA_SUCCESS;
    let rc = real!(r::cuCtxSynchronize, FnSync);
    if rc != CUDA_SUCCESS {
        debug!("cuCtxSynchronize at a token boundary returned {rc}");
    }
    if swapped {
        let _ = real!(
            r::cuThreadExchangeStreamCaptureMode,
            FnCaptureMode,
            &mut mode
        );
    }
}

fn uuid(dev: usize) -> Option<String> {
    GPUS[dev]
        .uuid
        .get_or_init(|| {
            let mut b = [0u8; 16];
            let d = dev as CUdevice;
            let mut rc = real!(r::cuDeviceGetUuid_v2, FnUuid, &mut b, d);
            if rc != CUDA_SUCCESS {
                rc = real!(r::cuDeviceGetUuid, FnUuid, &mut b, d);
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

/// Connects to the gem-schd of device `dev`, following the unreachable policy: `None` means
/// "run unmanaged for now" (policy `run`, or a device without a UUID).
fn connect(dev: usize, purpose: &str) -> Option<Client> {
    let uuid = uuid(dev)?;
    let s = settings();
    let path = socket_path(&s.socket_dir, &uuid);
    let mut logged: Option<Instant> = None;
    let started = Instant::now();
    loop {
        match Client::connect(&path, std::process::id(), &uuid) {
            Ok(c) => {
                let h = *c.hello();
                info!(
                    "{purpose} connection to gem-schd for {uuid}: request {} limit {} (milli), memory cap {} bytes{}",
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
                    if logged.is_none_or(|t| t.elapsed() > Duration::from_secs(30)) {
                        info!(
                            "gem-schd for {uuid} unreachable at {}: {e}; waiting (KUBESHARE_ON_UNREACHABLE=wait)",
                            path.display()
                        );
                        logged = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            },
        }
    }
}

// ------------------------------------------------------------------------------ launch gate

/// Called before every kernel/graph launch on `stream`.
#[inline]
pub fn gate(stream: CUstream) {
    if !active() {
        return;
    }
    let Some(dev) = current_device() else { return };
    let g = &GPUS[dev];
    let now = coarse_ns();
    if now < g.deadline.load(Ordering::Acquire) {
        g.last_launch.store(now, Ordering::Relaxed);
        return;
    }
    guard((), || acquire(dev, stream));
}

fn capturing(stream: CUstream) -> bool {
    let mut status: c_int = 0;
    real!(r::cuStreamIsCapturing, FnIsCapturing, stream, &mut status) == CUDA_SUCCESS && status != 0
}

#[cold]
fn acquire(dev: usize, stream: CUstream) {
    // A launch into a stream being captured into a graph runs nothing now: let it through
    // (and never synchronise during a capture). The graph's replay is gated.
    if capturing(stream) {
        return;
    }
    let g = &GPUS[dev];
    let mut t = lock(&g.token);
    loop {
        let now = coarse_ns();
        if now < g.deadline.load(Ordering::Acquire) {
            g.last_launch.store(now, Ordering::Relaxed);
            return; // another thread renewed it, or the device runs unmanaged for now
        }
        let (overuse_us, burst_us) = if g.holding.load(Ordering::Acquire) {
            end_hold(g, &t)
        } else {
            (0, std::mem::take(&mut t.idle_burst_us))
        };
        if t.client.is_none() {
            t.client = connect(dev, "token");
            if t.client.is_none() {
                g.deadline.store(coarse_ns() + BYPASS_NS, Ordering::Release);
                return;
            }
        }
        let Some(c) = t.client.as_mut() else { continue };
        let asked = precise_ns();
        match c.request_token(overuse_us, burst_us) {
            Ok(quota_us) => {
                t.grant_ns = precise_ns();
                t.quota_us = quota_us;
                t.ctx = current_ctx();
                g.holding.store(true, Ordering::Release);
                let now = coarse_ns();
                g.last_launch.store(now, Ordering::Relaxed);
                g.deadline.store(
                    now.saturating_add(quota_us.saturating_mul(1000)),
                    Ordering::Release,
                );
                DEVICES_SEEN.fetch_max(dev + 1, Ordering::Relaxed);
                start_idle_thread();
                debug!(
                    "device {dev}: granted {quota_us} µs after waiting {} µs (reported overuse {overuse_us} µs)",
                    (t.grant_ns - asked) / 1000
                );
                return;
            }
            Err(e) => {
                info!("device {dev}: token request failed: {e}; reconnecting");
                t.client = None;
            }
        }
    }
}

/// Ends a hold whose quota ran out, in the launching thread: waits for the queued work and
/// returns (overuse, burst) to report with the next request.
fn end_hold(g: &Gpu, t: &Token) -> (u64, u64) {
    g.deadline.store(0, Ordering::Release);
    sync_current();
    g.holding.store(false, Ordering::Release);
    let used_us = precise_ns().saturating_sub(t.grant_ns) / 1000;
    // The burst was cut by the quota, not ended by the program: report the quota as its
    // length, so that a busy tenant's quota estimate stays put instead of creeping up by each
    // overrun; the overrun itself is reported (and charged) as overuse.
    (used_us.saturating_sub(t.quota_us), used_us.min(t.quota_us))
}

fn start_idle_thread() {
    if IDLE_THREAD.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gemhook-idle".into())
        .spawn(|| {
            let mut mode: c_int = CAPTURE_MODE_RELAXED;
            let _ = real!(
                r::cuThreadExchangeStreamCaptureMode,
                FnCaptureMode,
                &mut mode
            );
            let idle_ns = settings().idle_release_us * 1000;
            let tick = Duration::from_nanos((idle_ns / 2).clamp(500_000, 50_000_000));
            loop {
                std::thread::sleep(tick);
                for dev in 0..DEVICES_SEEN.load(Ordering::Relaxed) {
                    guard((), || release_if_idle(dev, idle_ns));
                }
            }
        });
    if spawned.is_err() {
        IDLE_THREAD.store(false, Ordering::Release);
    }
}

/// Idle means: no launch for `idle_ns` *after the queued work finished*. A program blocked in
/// its own synchronisation while the GPU runs its burst is busy, not idle, so the thread first
/// drains the queue (the token stays valid meanwhile, launches keep passing) and only releases
/// once the GPU has been idle for this process for `idle_ns` with no launch since.
fn release_if_idle(dev: usize, idle_ns: u64) {
    let g = &GPUS[dev];
    let last = g.last_launch.load(Ordering::Relaxed);
    if !g.holding.load(Ordering::Acquire) || coarse_ns().saturating_sub(last) < idle_ns {
        return;
    }
    let mut t = match g.token.try_lock() {
        Ok(t) => t,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return, // a launching thread is at the gate
    };
    if !g.holding.load(Ordering::Acquire) {
        return;
    }
    let _ = real!(r::cuCtxSetCurrent, FnSetCtx, t.ctx as CUcontext);
    let drained = g.drained_at.load(Ordering::Relaxed);
    if drained <= last {
        // Not yet seen drained since the last launch: wait for the queued work, note when.
        sync_current();
        if g.last_launch.load(Ordering::Relaxed) == last {
            g.drained_at
                .store(coarse_ns().max(last + 1), Ordering::Relaxed);
        }
        return;
    }
    if coarse_ns().saturating_sub(drained) < idle_ns {
        return;
    }
    // Idle for long enough: stop launches, make sure nothing slipped in, give the token back.
    g.deadline.store(0, Ordering::Release);
    sync_current();
    if g.last_launch.load(Ordering::Relaxed) != last {
        // A launch raced with the check: it ran on the token still held; the next launch
        // ends the hold the usual way (overuse report and a new request).
        g.deadline.store(coarse_ns() + 1, Ordering::Release);
        return;
    }
    g.holding.store(false, Ordering::Release);
    let used_us = precise_ns().saturating_sub(t.grant_ns) / 1000;
    // A burst that ended by itself is the program's natural burst: gem-schd learns its
    // quota estimate from it (sent with the next request; Release carries no burst).
    t.idle_burst_us = used_us;
    if let Some(c) = t.client.as_mut()
        && let Err(e) = c.release(used_us)
    {
        info!("device {dev}: release failed: {e}");
        t.client = None;
    }
    debug!("device {dev}: idle, released the token after {used_us} µs");
}

// ------------------------------------------------------------------------------ memory

/// Outcome of asking gem-schd for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserve {
    /// Not accounted (inert, unmanaged device, or `run` policy while gem-schd is away).
    Bypass,
    Denied,
    Reserved,
}

fn mem_conn(dev: usize) -> Option<MutexGuard<'static, MemConn>> {
    let g = &GPUS[dev];
    let mut m = lock(&g.mem);
    if precise_ns() < m.bypass_until_ns {
        return None;
    }
    if m.client.is_none() {
        m.client = connect(dev, "memory");
        match m.client.as_mut() {
            None => {
                m.bypass_until_ns = precise_ns() + BYPASS_NS;
                return None;
            }
            Some(c) => {
                // After a reconnect (gem-schd restarted and forgot this connection), count
                // again what this process still holds.
                let held = g.outstanding.load(Ordering::Relaxed);
                if held > 0 {
                    match c.mem_alloc(held) {
                        Ok(v) if v.granted => {
                            info!("device {dev}: re-registered {held} bytes held")
                        }
                        Ok(v) => info!(
                            "device {dev}: {held} bytes held exceed the cap now ({} of {})",
                            v.used, v.limit
                        ),
                        Err(e) => info!("device {dev}: re-registering memory failed: {e}"),
                    }
                }
            }
        }
    }
    Some(m)
}

/// Reserves `bytes` on device `dev` before the driver allocates them.
pub fn mem_reserve(dev: usize, bytes: u64) -> Reserve {
    if !active() {
        return Reserve::Bypass;
    }
    loop {
        let Some(mut m) = mem_conn(dev) else {
            return Reserve::Bypass;
        };
        let Some(c) = m.client.as_mut() else { continue };
        match c.mem_alloc(bytes) {
            Ok(v) if v.granted => {
                GPUS[dev].outstanding.fetch_add(bytes, Ordering::Relaxed);
                return Reserve::Reserved;
            }
            Ok(v) => {
                debug!(
                    "device {dev}: refused {bytes} bytes ({} of {} in use)",
                    v.used, v.limit
                );
                return Reserve::Denied;
            }
            Err(e) => {
                info!("device {dev}: memory request failed: {e}; reconnecting");
                m.client = None;
            }
        }
    }
}

/// Credits `bytes` on device `dev` (a free, or an allocation the driver refused).
pub fn mem_credit(dev: usize, bytes: u64) {
    let g = &GPUS[dev];
    let _ = g
        .outstanding
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |o| {
            Some(o.saturating_sub(bytes))
        });
    let mut m = lock(&g.mem);
    if let Some(c) = m.client.as_mut()
        && let Err(e) = c.mem_free(bytes)
    {
        info!("device {dev}: memory free report failed: {e}");
        m.client = None;
    }
}

/// The pod's (used, limit) on device `dev`, or `None` when not accounted.
pub fn mem_query(dev: usize) -> Option<(u64, u64)> {
    if !active() {
        return None;
    }
    loop {
        let mut m = mem_conn(dev)?;
        let Some(c) = m.client.as_mut() else { continue };
        match c.mem_query() {
            Ok(v) => return Some(v),
            Err(e) => {
                info!("device {dev}: memory query failed: {e}; reconnecting");
                m.client = None;
            }
        }
    }
}

/// What kind of object an allocation record is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Ptr,
    Handle,
    Array,
}

/// What each live allocation counted: (kind, pointer or handle) → (device, bytes).
type Records = HashMap<(Kind, u64), (usize, u64)>;

fn records() -> MutexGuard<'static, Records> {
    static M: OnceLock<Mutex<Records>> = OnceLock::new();
    lock(M.get_or_init(|| Mutex::new(HashMap::new())))
}

pub fn remember(kind: Kind, key: u64, dev: usize, bytes: u64) {
    records().insert((kind, key), (dev, bytes));
}

pub fn forget(kind: Kind, key: u64) -> Option<(usize, u64)> {
    records().remove(&(kind, key))
}

/// An allocation of `bytes` on `dev`: reserve, call the driver (`call` returns its result and
/// the key of what it made), then record or roll back.
pub fn counted_alloc(
    dev: Option<usize>,
    bytes: u64,
    kind: Kind,
    call: impl FnOnce() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = dev.filter(|_| active()) else {
        return call().0;
    };
    match guard(Reserve::Bypass, || mem_reserve(dev, bytes)) {
        Reserve::Bypass => call().0,
        Reserve::Denied => CUDA_ERROR_OUT_OF_MEMORY,
        Reserve::Reserved => {
            let (rc, key) = call();
            if rc == CUDA_SUCCESS {
                guard((), || remember(kind, key, dev, bytes));
            } else {
                guard((), || mem_credit(dev, bytes));
            }
            rc
        }
    }
}

/// A free of what `key` names: forget it first (its address may be reused at once), credit it
/// if the driver freed it, put it back if not.
pub fn counted_free(kind: Kind, key: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    if !active() {
        return call();
    }
    let entry = guard(None, || forget(kind, key));
    let rc = call();
    if let Some((dev, bytes)) = entry {
        if rc == CUDA_SUCCESS {
            guard((), || mem_credit(dev, bytes));
        } else {
            guard((), || remember(kind, key, dev, bytes));
        }
    }
    rc
}

/// After a pitched allocation: the driver's pitch may differ from the estimate reserved.
pub fn adjust(kind: Kind, key: u64, dev: usize, reserved: u64, actual: u64) -> bool {
    if actual > reserved {
        if mem_reserve(dev, actual - reserved) == Reserve::Denied {
            return false;
        }
    } else if actual < reserved {
        mem_credit(dev, reserved - actual);
    }
    remember(kind, key, dev, actual);
    true
}
