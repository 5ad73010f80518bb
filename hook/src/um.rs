//! Unified-memory mode (Gemini_UM, docs/um.md): the pod's device allocations become managed
//! memory, so the pods sharing a GPU may together hold more than it has; the driver migrates
//! pages on demand. Three things make that work well and keep it honest:
//!
//! - every allocation path of the normal mode is made managed (`cuMemAlloc_v2`, pitched,
//!   stream-ordered and pool allocations, `cuMemAllocManaged` itself), or refused with
//!   `CUDA_ERROR_NOT_SUPPORTED` and a log line naming the path where the memory cannot be
//!   managed (`cuMemCreate`: the virtual-memory API hands out physical device memory).
//!   Everything is still counted against the pod's cap, which in this mode is the managed
//!   ceiling (gem-schd refuses beyond it: `CUDA_ERROR_OUT_OF_MEMORY`), and credited exactly
//!   at its free (the common counting of `memory.rs`; Gemini_UM never reported allocations
//!   and its frees underflowed the counter).
//!
//! Both optimisations below act only while the GPU is under memory pressure (the driver
//! reports less than [`PRESSURE_FREE_BYTES`] free at the grant): without pressure nothing was
//! evicted, and they cost time for nothing (a 0.3/0.7 pair that fit lost half its throughput
//! to them on an H100).
//!
//! - on a token grant, the allocations the process holds now, newest first, up to its
//!   GPU-resident share, are prefetched to the GPU on the launching stream, before the kernel
//!   that asked for the token (so that the kernel does not fault them in page by page). The
//!   time this takes runs after the grant, so gem-schd charges it to the incoming holder;
//! - when its hold ends, a PyTorch process (detected: `libc10_cuda.so` is loaded and Python's
//!   C API is there) empties PyTorch's caching allocator, so the memory it kept cached but
//!   unused is not migrated back and forth. Elsewhere this is a no-op.
//!
//! Switches (environment): `KUBESHARE_HOOK_UM=1` turns the mode on (the webhook sets it for a
//! pod labelled `sharedgpu/gpu_mem_mode=unified`); `KUBESHARE_UM_RESIDENT_BYTES` is the
//! resident share (the prefetch budget; unset: no limit); `KUBESHARE_UM_PREFETCH=0` and
//! `KUBESHARE_UM_EMPTY_CACHE=0` turn the two optimisations off (to measure what they bring).

use crate::config::active;
use crate::memory::{counted_alloc, counted_free, out_ptr};
use crate::real;
use crate::real::real_dlsym;
use crate::state::Kind;
use crate::{debug, info};
use cuda_abi::*;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

#[allow(non_upper_case_globals)]
mod r {
    crate::slots!(
        cuMemAllocManaged,
        cuMemPrefetchAsync,
        cuMemPrefetchAsync_v2,
        cuStreamSynchronize,
        cuMemGetInfo_v2,
    );
}

/// The GPU is under memory pressure when the driver reports less than this free: only then
/// can managed pages have been evicted, and only then do the optimisations pay. Without
/// pressure, a prefetch of pages that are resident and an emptied cache cost time and save
/// nothing (measured: docs/benchmarks.md, "Unified-memory mode").
pub const PRESSURE_FREE_BYTES: u64 = 2 << 30;

/// Per device: whether the last grant found the GPU under memory pressure.
static PRESSURE: [std::sync::atomic::AtomicBool; crate::state::MAX_DEVICES] =
    [const { std::sync::atomic::AtomicBool::new(true) }; crate::state::MAX_DEVICES];

/// Asks the driver (not the hook: the real free memory of the GPU) in the calling thread's
/// context; unknown counts as pressure.
fn under_pressure() -> bool {
    let (mut free, mut total) = (0usize, 0usize);
    let rc = real!(cuMemGetInfo_v2, &mut free, &mut total);
    rc != CUDA_SUCCESS || (free as u64) < PRESSURE_FREE_BYTES
}

/// The mode's settings, read once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UmSettings {
    pub enabled: bool,
    /// Most bytes prefetched at a grant (the pod's GPU-resident share).
    pub resident: u64,
    pub prefetch: bool,
    pub empty_cache: bool,
}

/// Parses the switches (pure, for tests). A malformed value keeps the safe default and says so.
pub fn parse_settings(
    um: Option<&str>,
    resident: Option<&str>,
    prefetch: Option<&str>,
    empty: Option<&str>,
) -> (UmSettings, Vec<String>) {
    let mut warnings = vec![];
    let mut flag = |name: &str, v: Option<&str>, default: bool| match v.map(str::trim) {
        None | Some("") => default,
        Some("1") | Some("true") | Some("on") => true,
        Some("0") | Some("false") | Some("off") => false,
        Some(other) => {
            warnings.push(format!(
                "{name}={other:?} is not 1 or 0; using {}",
                u8::from(default)
            ));
            default
        }
    };
    let enabled = flag("KUBESHARE_HOOK_UM", um, false);
    let prefetch = flag("KUBESHARE_UM_PREFETCH", prefetch, true);
    let empty_cache = flag("KUBESHARE_UM_EMPTY_CACHE", empty, true);
    let resident = match resident.map(str::trim) {
        None | Some("") => u64::MAX,
        Some(s) => s.parse::<u64>().unwrap_or_else(|_| {
            warnings.push(format!(
                "KUBESHARE_UM_RESIDENT_BYTES={s:?} is not a byte count; prefetching without a limit"
            ));
            u64::MAX
        }),
    };
    (
        UmSettings {
            enabled,
            resident,
            prefetch,
            empty_cache,
        },
        warnings,
    )
}

pub fn settings() -> &'static UmSettings {
    static S: OnceLock<UmSettings> = OnceLock::new();
    S.get_or_init(|| {
        let get = |k: &str| std::env::var(k).ok();
        let (s, warnings) = parse_settings(
            get("KUBESHARE_HOOK_UM").as_deref(),
            get("KUBESHARE_UM_RESIDENT_BYTES").as_deref(),
            get("KUBESHARE_UM_PREFETCH").as_deref(),
            get("KUBESHARE_UM_EMPTY_CACHE").as_deref(),
        );
        for w in warnings {
            info!("{w}");
        }
        if s.enabled {
            info!(
                "unified-memory mode: resident share {} bytes, prefetch {}, empty PyTorch cache {}",
                s.resident, s.prefetch, s.empty_cache
            );
        }
        s
    })
}

/// Whether allocations are made managed in this process.
#[inline]
pub fn enabled() -> bool {
    active() && settings().enabled
}

// ------------------------------------------------------------------------------ tracking

/// One live managed allocation: its device, size, and when it was made (a sequence number:
/// newer is larger).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub dev: usize,
    pub bytes: u64,
    pub seq: u64,
}

/// Live managed allocations by address. Owned by one process: a forked child starts empty
/// (it holds none of its parent's allocations on its own connection).
struct Tracker {
    pid: u32,
    held: Mutex<BTreeMap<u64, Held>>,
    seq: AtomicU64,
    /// The `gemhook-um` thread that empties PyTorch's cache for a hold that ended in a
    /// thread that may not run Python (the idle thread): started on first use.
    empty_tx: Mutex<Option<std::sync::mpsc::Sender<usize>>>,
}

static TRACKER: AtomicPtr<Tracker> = AtomicPtr::new(std::ptr::null_mut());

fn tracker() -> &'static Tracker {
    let pid = std::process::id();
    let p = TRACKER.load(Ordering::Acquire);
    // SAFETY: a non-null TRACKER was made by `Box::into_raw` below and is leaked, never freed.
    if !p.is_null() && unsafe { (*p).pid } == pid {
        // SAFETY: as above: leaked, so valid for 'static.
        return unsafe { &*p };
    }
    // First use, or a forked child: a fresh tracker (the parent's is leaked here, its lock
    // possibly held by a thread that does not exist in this process).
    let fresh = Box::into_raw(Box::new(Tracker {
        pid,
        held: Mutex::new(BTreeMap::new()),
        seq: AtomicU64::new(0),
        empty_tx: Mutex::new(None),
    }));
    match TRACKER.compare_exchange(p, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` came from `Box::into_raw`, is now published and never freed.
        Ok(_) => unsafe { &*fresh },
        Err(now) => {
            // SAFETY: `fresh` came from `Box::into_raw` and the failed exchange never shared it.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: `now` is the tracker another thread published: leaked, never freed
            // (non-null: the exchange from `p` failed because a fresh one was stored).
            unsafe { &*now }
        }
    }
}

fn held() -> MutexGuard<'static, BTreeMap<u64, Held>> {
    tracker().held.lock().unwrap_or_else(|e| e.into_inner())
}

fn track(dev: usize, ptr: u64, bytes: u64) {
    let seq = tracker().seq.fetch_add(1, Ordering::Relaxed);
    held().insert(ptr, Held { dev, bytes, seq });
}

/// Live managed bytes this process holds on `dev` (for tests and logs).
pub fn held_bytes(dev: usize) -> u64 {
    held()
        .values()
        .filter(|h| h.dev == dev)
        .map(|h| h.bytes)
        .sum()
}

/// Which allocations to prefetch within `budget` bytes: newest first, each taken whole if it
/// still fits (a larger one is skipped, smaller older ones may still fit). Pure.
pub fn choose_prefetch(held: &[(u64, Held)], dev: usize, budget: u64) -> Vec<(u64, u64)> {
    let mut v: Vec<&(u64, Held)> = held.iter().filter(|(_, h)| h.dev == dev).collect();
    v.sort_by_key(|x| std::cmp::Reverse(x.1.seq));
    let mut left = budget;
    let mut out = vec![];
    for (ptr, h) in v {
        if h.bytes <= left {
            left -= h.bytes;
            out.push((*ptr, h.bytes));
        }
    }
    out
}

// ------------------------------------------------------------------------------ allocations

/// A device allocation of `bytes`, made managed (any of the `cuMemAlloc*` paths).
///
/// # Safety
/// `p` is null or a writable `CUdeviceptr` (the driver's contract).
pub unsafe fn alloc(
    dev: Option<usize>,
    ctx: usize,
    p: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    let rc = counted_alloc(dev, bytes as u64, Kind::Ptr, ctx, || {
        let rc = real!(cuMemAllocManaged, p, bytes, flags);
        // SAFETY: `p` is null or writable (this function's contract), as `out_ptr` requires.
        (rc, unsafe { out_ptr(p) })
    });
    if rc == CUDA_SUCCESS
        && let Some(d) = dev
    {
        // SAFETY: as above.
        track(d, unsafe { out_ptr(p) }, bytes as u64);
    }
    rc
}

/// `cuMemAllocPitch_v2` made managed: the hook picks the pitch (width rounded up to 512
/// bytes, which satisfies the driver's alignment for every element size) and allocates
/// pitch × height.
///
/// # Safety
/// `p` and `pitch` are null or writable (the driver's contract).
pub unsafe fn alloc_pitch(
    dev: Option<usize>,
    ctx: usize,
    p: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
) -> CUresult {
    if pitch.is_null() || width == 0 || height == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let pt = pitch_for(width);
    let Some(bytes) = pt.checked_mul(height) else {
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    // SAFETY: `p` is null or writable (this function's contract), as `alloc` requires.
    let rc = unsafe { alloc(dev, ctx, p, bytes, CU_MEM_ATTACH_GLOBAL) };
    if rc == CUDA_SUCCESS {
        // SAFETY: checked non-null; the caller passes a writable size_t.
        unsafe { pitch.write(pt) };
    }
    rc
}

/// A path whose memory cannot be managed: refused, naming it.
pub fn refuse(path: &str, why: &str) -> CUresult {
    info!(
        "unified-memory mode: {path} refused with CUDA_ERROR_NOT_SUPPORTED: {why} (run the pod in device mode to use it)"
    );
    CUDA_ERROR_NOT_SUPPORTED
}

/// A free of `ptr` (`cuMemFree_v2`): untracked, then the common counted free.
pub fn free(ptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let was = held().remove(&ptr);
    let rc = counted_free(Kind::Ptr, ptr, call);
    if rc != CUDA_SUCCESS
        && let Some(h) = was
    {
        held().insert(ptr, h);
    }
    rc
}

/// A stream-ordered free of a managed allocation (`cuMemFreeAsync`): managed memory has no
/// stream-ordered free, so wait for the stream's work (which may still use it), then free.
/// `None`: not a managed allocation of this mode; the caller passes it on.
// The stream is an opaque handle handed to the driver, never dereferenced here.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn free_async(
    ptr: u64,
    stream: CUstream,
    free_now: impl FnOnce() -> CUresult,
) -> Option<CUresult> {
    if !held().contains_key(&ptr) {
        return None;
    }
    let rc = real!(cuStreamSynchronize, stream);
    if rc != CUDA_SUCCESS {
        return Some(rc);
    }
    Some(free(ptr, free_now))
}

// ------------------------------------------------------------------------------ the token

/// Counters of what the mode did in this process (logged at debug level, read by tests via
/// the log).
pub static PREFETCHES: AtomicU64 = AtomicU64::new(0);
pub static PREFETCHED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static CACHE_EMPTIED: AtomicU64 = AtomicU64::new(0);

/// After a grant on `dev`, before the launch that asked for it: prefetch the resident set
/// on the launching stream.
pub fn on_grant(dev: usize, stream: CUstream) {
    let s = settings();
    if !s.enabled || !(s.prefetch || s.empty_cache) {
        return;
    }
    let pressed = under_pressure();
    if let Some(p) = PRESSURE.get(dev) {
        p.store(pressed, Ordering::Relaxed);
    }
    if !s.prefetch || !pressed {
        return;
    }
    let snapshot: Vec<(u64, Held)> = held().iter().map(|(k, v)| (*k, *v)).collect();
    let chosen = choose_prefetch(&snapshot, dev, s.resident);
    let (mut n, mut bytes) = (0u64, 0u64);
    let mut stale = vec![];
    for (ptr, len) in chosen {
        match prefetch(ptr, len, dev, stream) {
            CUDA_SUCCESS => {
                n += 1;
                bytes += len;
            }
            // The context that owned it is gone (its memory with it): forget it.
            CUDA_ERROR_INVALID_VALUE => stale.push(ptr),
            rc => debug!("device {dev}: prefetch of {len} bytes at {ptr:#x} failed: {rc}"),
        }
    }
    if !stale.is_empty() {
        let mut h = held();
        for p in stale {
            h.remove(&p);
        }
    }
    PREFETCHES.fetch_add(n, Ordering::Relaxed);
    PREFETCHED_BYTES.fetch_add(bytes, Ordering::Relaxed);
    debug!("device {dev}: prefetched {n} allocations, {bytes} bytes, at the grant");
}

fn prefetch(ptr: u64, len: u64, dev: usize, stream: CUstream) -> CUresult {
    let Ok(ordinal) = c_int::try_from(dev) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if !r::cuMemPrefetchAsync_v2.get().is_null() {
        let loc = CUmemLocation {
            kind: CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        };
        return real!(cuMemPrefetchAsync_v2, ptr, len, loc, 0, stream);
    }
    real!(cuMemPrefetchAsync, ptr, len, ordinal, stream)
}

type FnInitialized = unsafe extern "C" fn() -> c_int;
type FnRunString = unsafe extern "C" fn(*const std::ffi::c_char) -> c_int;
type FnEnsure = unsafe extern "C" fn() -> c_int;
type FnRelease = unsafe extern "C" fn(c_int);

/// Python's C API functions the cache emptying needs.
#[derive(Clone, Copy)]
struct Py {
    run: FnRunString,
    ensure: FnEnsure,
    release: FnRelease,
    initialized: FnInitialized,
}

/// Python's functions when this is a PyTorch process (`libc10_cuda.so` loaded), looked up
/// once.
fn pytorch() -> Option<Py> {
    static P: OnceLock<Option<[usize; 4]>> = OnceLock::new();
    let f = (*P.get_or_init(|| {
        // SAFETY: dlopen with RTLD_NOLOAD only finds a library already loaded; dlsym on the
        // global scope with constant names.
        unsafe {
            let c10 = libc::dlopen(
                c"libc10_cuda.so".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            );
            if c10.is_null() {
                return None;
            }
            let dl = real_dlsym()?;
            let mut out = [0usize; 4];
            for (i, name) in [
                c"PyRun_SimpleString",
                c"PyGILState_Ensure",
                c"PyGILState_Release",
                c"Py_IsInitialized",
            ]
            .iter()
            .enumerate()
            {
                let p = dl(libc::RTLD_DEFAULT, name.as_ptr());
                if p.is_null() {
                    return None;
                }
                out[i] = p as usize;
            }
            info!("unified-memory mode: PyTorch detected; its cache is emptied when a hold ends");
            Some(out)
        }
    }))?;
    let p = |i: usize| f[i] as *mut c_void;
    // SAFETY: the addresses are Python's functions of these types (PyGILState_STATE is an
    // int-sized enum).
    unsafe {
        Some(Py {
            run: std::mem::transmute::<*mut c_void, FnRunString>(p(0)),
            ensure: std::mem::transmute::<*mut c_void, FnEnsure>(p(1)),
            release: std::mem::transmute::<*mut c_void, FnRelease>(p(2)),
            initialized: std::mem::transmute::<*mut c_void, FnInitialized>(p(3)),
        })
    }
}

/// Runs `torch.cuda.empty_cache()` (the caller holds the GIL).
fn empty_now(py: Py, dev: usize) {
    let before = held_bytes(dev);
    // SAFETY: Python's own function, with the GIL held by the caller.
    let rc = unsafe { (py.run)(c"__import__('torch').cuda.empty_cache()".as_ptr()) };
    if rc == 0 {
        CACHE_EMPTIED.fetch_add(1, Ordering::Relaxed);
        debug!(
            "device {dev}: emptied PyTorch's cache at the end of the hold ({before} -> {} managed bytes)",
            held_bytes(dev)
        );
    }
}

/// Hands the emptying to the `gemhook-um` thread, which takes the GIL itself. It holds no
/// hook lock while it waits for the GIL, so a thread that holds the GIL and waits for the
/// token cannot deadlock with it.
fn empty_later(py: Py, dev: usize) {
    let t = tracker();
    let mut tx = t.empty_tx.lock().unwrap_or_else(|e| e.into_inner());
    if tx.is_none() {
        let (s, r) = std::sync::mpsc::channel::<usize>();
        let spawned = std::thread::Builder::new()
            .name("gemhook-um".into())
            .spawn(move || {
                while let Ok(dev) = r.recv() {
                    // Requests that piled up while this one waited are one emptying.
                    while r.try_recv().is_ok() {}
                    // SAFETY: Python's own functions, used as documented: the GIL is
                    // taken and given back around the call.
                    unsafe {
                        if (py.initialized)() == 0 {
                            continue;
                        }
                        let g = (py.ensure)();
                        // Emptying helps the others while this process does not hold the
                        // token; once it holds it again (a busy process whose next grant
                        // came first), its cache is its working set: keep it.
                        if !crate::state::gpu(dev).holding.load(Ordering::Acquire) {
                            empty_now(py, dev);
                        }
                        (py.release)(g);
                    }
                }
            });
        if spawned.is_err() {
            return;
        }
        *tx = Some(s);
    }
    if let Some(s) = tx.as_ref() {
        let _ = s.send(dev);
    }
}

/// The process's hold on `dev` ended (its quota ran out and its work drained, or it went
/// idle and gave the token back): empty PyTorch's cache if this is a PyTorch process. A no-op
/// otherwise.
///
/// Always done by the `gemhook-um` thread, which takes the GIL itself while holding no hook
/// lock: running Python in the caller could let the interpreter switch to another Python
/// thread that then waits on the token lock the caller holds, while holding the GIL the
/// caller needs (a deadlock). After an idle release (a process between requests, usually
/// in Python or asleep) the GIL comes at once; after a hold cut by its quota, the thread
/// that launches holds the GIL while it waits for its next grant, so the cache is emptied
/// early in that next hold instead.
pub fn on_hold_end(dev: usize) {
    let s = settings();
    if !s.enabled || !s.empty_cache {
        return;
    }
    // Only under memory pressure (as the last grant found it): otherwise nobody needs the
    // memory and the process would only allocate and populate it again.
    if !PRESSURE.get(dev).is_some_and(|p| p.load(Ordering::Relaxed)) {
        return;
    }
    if let Some(py) = pytorch() {
        empty_later(py, dev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn switches() {
        let (s, w) = parse_settings(None, None, None, None);
        assert!(!s.enabled && s.prefetch && s.empty_cache && s.resident == u64::MAX);
        assert!(w.is_empty());
        let (s, w) = parse_settings(Some("1"), Some("4096"), Some("0"), Some("off"));
        assert_eq!(
            s,
            UmSettings {
                enabled: true,
                resident: 4096,
                prefetch: false,
                empty_cache: false
            }
        );
        assert!(w.is_empty());
        let (s, w) = parse_settings(Some("yes please"), Some("4Gi"), None, None);
        assert!(!s.enabled && s.resident == u64::MAX);
        assert_eq!(w.len(), 2);
    }

    fn h(dev: usize, bytes: u64, seq: u64) -> Held {
        Held { dev, bytes, seq }
    }

    #[test]
    fn newest_first_within_the_budget() {
        let held = [
            (0x1000, h(0, 100, 1)),
            (0x2000, h(0, 300, 2)),
            (0x3000, h(0, 50, 3)),
            (0x4000, h(1, 10, 4)),
        ];
        assert_eq!(
            choose_prefetch(&held, 0, 360),
            vec![(0x3000, 50), (0x2000, 300)]
        );
        // 300 does not fit in 200: skipped, the older 100 still does.
        assert_eq!(
            choose_prefetch(&held, 0, 200),
            vec![(0x3000, 50), (0x1000, 100)]
        );
        assert_eq!(choose_prefetch(&held, 1, u64::MAX), vec![(0x4000, 10)]);
        assert!(choose_prefetch(&held, 0, 0).is_empty());
    }

    proptest! {
        #[test]
        fn prefetch_stays_within_budget_and_takes_the_newest(
            sizes in proptest::collection::vec((0usize..2, 1u64..1_000_000), 0..40),
            budget in 0u64..5_000_000,
        ) {
            let held: Vec<(u64, Held)> = sizes
                .iter()
                .enumerate()
                .map(|(i, (d, b))| ((i as u64 + 1) << 24, h(*d, *b, i as u64)))
                .collect();
            let chosen = choose_prefetch(&held, 0, budget);
            let total: u64 = chosen.iter().map(|c| c.1).sum();
            prop_assert!(total <= budget);
            // Only device 0's, each once.
            let mut seen = std::collections::HashSet::new();
            for (p, _) in &chosen {
                prop_assert!(seen.insert(*p));
                prop_assert_eq!(held.iter().find(|x| x.0 == *p).map(|x| x.1.dev), Some(0));
            }
            // Anything left out did not fit into what was left when its turn came: in
            // particular the newest allocation is taken whenever it fits the budget.
            if let Some(newest) = held.iter().filter(|x| x.1.dev == 0).max_by_key(|x| x.1.seq)
                && newest.1.bytes <= budget
            {
                prop_assert_eq!(chosen.first().map(|c| c.0), Some(newest.0));
            }
        }
    }
}
