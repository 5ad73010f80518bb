//! Reading CUPTI's compute-engine context-switch records (CUPTI 13.2 or later) for the engine
//! time this process held (`engine.rs` keeps the books).
//!
//! `KUBESHARE_HOOK_CUPTI` names the libcupti to use. It is loaded when the hook is (an ELF
//! constructor), before the program's own libraries: PyTorch's libcupti.so.13 is older and
//! refuses the switch records, and under one soname the first one loaded is the one bound.
//! The records are turned on once gem-schd asks for Busy reports, and flushed every
//! `KUBESHARE_HOOK_CUPTI_FLUSH_MS` by a thread of their own (a report lacks about that much of
//! the slices that ended before it; they come with the next one); they are never turned off while the process runs
//! (a process that turned them off and on again beside another context hung once on an H200;
//! the cause was not found).
//!
//! CUPTI takes one pair of buffer callbacks per process. A profiler in the program (PyTorch's,
//! or hack/gpu's gputrace) registers its own through the hook's `cuptiActivityRegisterCallbacks`:
//! the hook keeps its own registered and passes each buffer on to the program's after reading
//! its switch records from it, so both see every record. A program that turns the switch
//! records off is ignored; one that finalizes CUPTI ends the hook's readings: its reports then
//! carry no engine time and gem-schd charges wall time, as it does for a hook without CUPTI.
//! So does one that gives CUPTI a clock of its own (PyTorch's profiler does, at the start of
//! each trace): the records' times then jump from one clock to the other, and slices spanning
//! the jump read as nothing or as seconds (a GPT training loop under `torch.profiler` on an
//! H200 reported none in 75 of 402 reports, and 3.28 s in one, though out-of-order buffers,
//! which `engine.rs` now handles, may account for part of that).
//!
//! Measured on H200s it pays little (docs/benchmarks.md, "Engine time"): each forced flush
//! costs the tenant GPU time, and unforced ones hand the records back only as buffers fill,
//! which the hook's own buffers, holding switch records alone, do in seconds at their default
//! size (`KUBESHARE_HOOK_CUPTI_BUFFER_KB`).

use crate::engine::Slices;
use crate::real::real_dlsym;
use crate::state::lock;
use std::alloc::Layout;
use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// `CUPTI_ACTIVITY_KIND_COMPUTE_ENGINE_CTX_SWITCH`.
const KIND_CTX_SWITCH: u32 = 57;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: hand over the buffers being filled too.
const FLUSH_FORCED: u32 = 1;

type WantFn = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type GotFn = unsafe extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);
type RegisterFn = unsafe extern "C" fn(WantFn, GotFn) -> i32;
type KindFn = unsafe extern "C" fn(u32) -> i32;
type FlushFn = unsafe extern "C" fn(u32) -> i32;
type NextFn = unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> i32;
type TimestampFn = unsafe extern "C" fn(*mut u64) -> i32;
type FinalizeFn = unsafe extern "C" fn() -> i32;
type ContextIdFn = unsafe extern "C" fn(*mut c_void, *mut u32) -> i32;
type ClockFn = unsafe extern "C" fn() -> u64;
type SetClockFn = unsafe extern "C" fn(Option<ClockFn>) -> i32;

/// The libcupti loaded from `KUBESHARE_HOOK_CUPTI`.
static LIB: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Where the readings stand.
static STATE: AtomicU8 = AtomicU8::new(OFF);
const OFF: u8 = 0;
const ON: u8 = 1;
/// Ended for good (refused, taken off by the program, a forked child, gem-schd too old).
const ENDED: u8 = 2;

/// The program's own buffer callbacks, once it registered them.
static THEIRS: Mutex<Option<(WantFn, GotFn)>> = Mutex::new(None);
/// The hook's own buffers handed to CUPTI and not yet back (address, layout).
static OURS: Mutex<Vec<(usize, Layout)>> = Mutex::new(Vec::new());
static SLICES: Mutex<Option<Slices>> = Mutex::new(None);
static FLUSHER_STOP: AtomicBool = AtomicBool::new(false);
/// This process's contexts (as the hook noted them), each with its CUPTI id and its device.
static OWN: Mutex<Vec<Own>> = Mutex::new(Vec::new());
/// The devices this process runs nothing on (a bit each), from a drained hold's end to the
/// next hold.
static IDLE: AtomicU64 = AtomicU64::new(0);
/// Reports made, for the one log line naming the contexts.
static TAKES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Loads `KUBESHARE_HOOK_CUPTI` as the process's libcupti, before the program's libraries.
extern "C" fn preload() {
    let Some(path) = std::env::var_os("KUBESHARE_HOOK_CUPTI") else {
        return;
    };
    let Ok(path) = std::ffi::CString::new(path.into_encoded_bytes()) else {
        return;
    };
    // SAFETY: dlopen with a NUL-terminated path; RTLD_GLOBAL so that the program's
    // libraries needing libcupti.so.13 bind to this one.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    LIB.store(h, Ordering::Release);
}

#[used]
#[unsafe(link_section = ".init_array")]
static PRELOAD: extern "C" fn() = preload;

/// The libcupti the hook loaded (null: none), for `real::Lib::Cupti`.
pub fn lib() -> *mut c_void {
    LIB.load(Ordering::Acquire)
}

/// The CUPTI functions the hook calls, each looked up once in the libcupti it loaded.
mod r {
    use crate::real::{Lib, Slot};
    pub static REGISTER: Slot = Slot::of(Lib::Cupti, "cuptiActivityRegisterCallbacks\0");
    pub static ENABLE: Slot = Slot::of(Lib::Cupti, "cuptiActivityEnable\0");
    pub static DISABLE: Slot = Slot::of(Lib::Cupti, "cuptiActivityDisable\0");
    pub static FLUSH: Slot = Slot::of(Lib::Cupti, "cuptiActivityFlushAll\0");
    pub static NEXT: Slot = Slot::of(Lib::Cupti, "cuptiActivityGetNextRecord\0");
    pub static TIMESTAMP: Slot = Slot::of(Lib::Cupti, "cuptiGetTimestamp\0");
    pub static CONTEXT_ID: Slot = Slot::of(Lib::Cupti, "cuptiGetContextId\0");
    pub static FINALIZE: Slot = Slot::of(Lib::Cupti, "cuptiFinalize\0");
    pub static SET_CLOCK: Slot = Slot::of(Lib::Cupti, "cuptiActivityRegisterTimestampCallback\0");
}

/// Slot `s`'s function as `F`, or `None` where the loaded libcupti lacks it (or none is).
fn sym<F: Copy>(s: &crate::real::Slot) -> Option<F> {
    as_fn(s.get())
}

/// `p` as the function type `F`, or `None` for null.
fn as_fn<F: Copy>(p: *mut c_void) -> Option<F> {
    // SAFETY: every caller's `F` is the C signature CUPTI's headers give the function `p` was
    // looked up by (the types above), and a function pointer has a data pointer's size on the
    // targets the hook supports.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// Turns the switch records on (once; gem-schd asked for Busy reports), from a thread of their
/// own, which then flushes them: CUPTI calls into the driver, and the caller may be inside a
/// driver call the hook wraps.
pub fn start() {
    if LIB.load(Ordering::Acquire).is_null()
        || STATE
            .compare_exchange(OFF, ON, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        return;
    }
    if std::thread::Builder::new()
        .name("gemhook-cupti".into())
        .spawn(|| {
            if turn_on() {
                flush_loop();
            }
        })
        .is_err()
    {
        end("no thread to read CUPTI's records");
    }
}

/// Registers the buffer callbacks and turns the switch records on; false (and logged) if not.
fn turn_on() -> bool {
    let (Some(register), Some(enable), Some(_)) = (
        sym::<RegisterFn>(&r::REGISTER),
        sym::<KindFn>(&r::ENABLE),
        sym::<TimestampFn>(&r::TIMESTAMP),
    ) else {
        end("libcupti lacks the activity API");
        return false;
    };
    *lock(&SLICES) = Some(Slices::new());
    // SAFETY: CUPTI's registration with two callbacks of the signatures it documents.
    let r = unsafe { register(want_buffer, got_buffer) };
    if r != 0 {
        end(&format!(
            "registering CUPTI's buffer callbacks failed ({r})"
        ));
        return false;
    }
    // SAFETY: a plain call with an activity kind.
    let r = unsafe { enable(KIND_CTX_SWITCH) };
    if r != 0 {
        end(&format!(
            "CUPTI refused the context-switch records ({r}; they need CUPTI 13.2 or later)"
        ));
        return false;
    }
    // SAFETY: registers a function without arguments, valid for the life of the process.
    unsafe { libc::atexit(stop_flushing) };
    crate::info!("engine time from CUPTI's context-switch records");
    true
}

/// The readings end for good: reports carry no engine time from now on.
fn end(why: &str) {
    if STATE.swap(ENDED, Ordering::AcqRel) != ENDED {
        crate::info!("no engine time in Busy reports: {why}");
    }
}

/// An older gem-schd refused a Busy with engine time: sent without it from now on.
pub fn refused() {
    end("gem-schd does not take it (an older version)");
}

/// In a forked child: its contexts are its own, and no thread flushes for it.
pub fn forked() {
    STATE.store(ENDED, Ordering::Release);
}

/// Whether Busy reports carry engine time.
pub fn on() -> bool {
    STATE.load(Ordering::Acquire) == ON
}

/// The engine time this process's contexts on device `dev` held since the last call for it,
/// µs; `None` when not read.
pub fn take_us(dev: usize) -> Option<u64> {
    if !on() {
        return None;
    }
    let own = own_contexts()?;
    let ids = ids_on(&own, dev);
    let process: Vec<u32> = own.iter().map(|o| o.id).collect();
    let now = timestamp(sym::<TimestampFn>(&r::TIMESTAMP)?);
    let mut slices = lock(&SLICES);
    let s = slices.as_mut()?;
    let held = s.take(now, &ids, &process);
    if TAKES.fetch_add(1, Ordering::Relaxed) == 200 {
        crate::info!(
            "engine time: switch records name contexts {:?}; this process's are {own:?}",
            s.seen()
        );
    }
    Some(held / 1000)
}

/// A hold on device `dev` ended with the process's queue there drained: until its next hold
/// there ([`resumed`]), its contexts there run nothing, whatever their records say. A context
/// stays switched in until another one switches in, and with unforced flushes that switch out
/// may come seconds later: counted up to now meanwhile, batch-1 decode idle 5 s reported 4.0 s
/// at once on an H200, and a GPT training loop 276 ms after a 255 ms wait for its next hold.
pub fn idle(dev: usize) {
    spell(dev, 0, true);
}

/// A hold on device `dev` began `ago_ns` ago: after [`idle`], its contexts there count again
/// from then.
pub fn resumed(dev: usize, ago_ns: u64) {
    if IDLE.load(Ordering::Acquire) & dev_bit(dev) != 0 {
        spell(dev, ago_ns, false);
    }
}

/// Starts (`idle`) or ends an idle spell of device `dev`'s contexts, `ago_ns` before now.
fn spell(dev: usize, ago_ns: u64, idle: bool) {
    if !on() {
        return;
    }
    let (Some(own), Some(now)) = (
        own_contexts(),
        sym::<TimestampFn>(&r::TIMESTAMP).map(timestamp),
    ) else {
        return;
    };
    let (ids, at) = (ids_on(&own, dev), now.saturating_sub(ago_ns));
    if let Some(s) = lock(&SLICES).as_mut() {
        if idle {
            s.idle(at, &ids);
            IDLE.fetch_or(dev_bit(dev), Ordering::AcqRel);
        } else if IDLE.fetch_and(!dev_bit(dev), Ordering::AcqRel) & dev_bit(dev) != 0 {
            s.resumed(at, &ids);
        }
    }
}

/// One of this process's contexts: its handle, CUPTI's id of it and its device's index.
#[derive(Debug, Clone, Copy)]
struct Own {
    ctx: usize,
    id: u32,
    dev: usize,
}

fn dev_bit(dev: usize) -> u64 {
    1u64.checked_shl(dev as u32).unwrap_or(0)
}

fn ids_on(own: &[Own], dev: usize) -> Vec<u32> {
    own.iter().filter(|o| o.dev == dev).map(|o| o.id).collect()
}

/// This process's contexts with their CUPTI ids (the switch records may name other processes'
/// contexts too) and devices; `None`, and the readings end, where the hook lost count of them.
fn own_contexts() -> Option<Vec<Own>> {
    let contexts = crate::state::contexts();
    if contexts.len() >= crate::state::MAX_CONTEXTS {
        end("more contexts than the hook keeps count of");
        return None;
    }
    let mut own = lock(&OWN);
    own.retain(|o| contexts.contains(&o.ctx));
    for c in contexts {
        if own.iter().any(|o| o.ctx == c) {
            continue;
        }
        let Some(dev) = crate::device::context_device(c) else {
            continue; // destroyed behind the hook's back
        };
        let get = sym::<ContextIdFn>(&r::CONTEXT_ID)?;
        let mut id = 0u32;
        // SAFETY: a context the program made current or retained, and a live out-parameter.
        let r = unsafe { get(c as *mut c_void, &mut id) };
        if r != 0 {
            // Its slices could not be told from another process's: none are counted.
            end(&format!("CUPTI has no id for context {c:#x} ({r})"));
            return None;
        }
        own.push(Own { ctx: c, id, dev });
    }
    Some(own.clone())
}

fn timestamp(f: TimestampFn) -> u64 {
    let mut t = 0u64;
    // SAFETY: writes one u64 to a live local.
    unsafe { f(&mut t) };
    t
}

fn flush_loop() {
    let Some(flush) = sym::<FlushFn>(&r::FLUSH) else {
        return end("libcupti lacks cuptiActivityFlushAll");
    };
    let s = crate::config::settings();
    let every = Duration::from_millis(s.cupti_flush_ms);
    let flag = if s.cupti_flush_forced {
        FLUSH_FORCED
    } else {
        0
    };
    while on() && !FLUSHER_STOP.load(Ordering::Acquire) {
        std::thread::sleep(every);
        // SAFETY: a plain call with a flag; the buffers come back through `got_buffer`.
        unsafe { flush(flag) };
    }
}

/// At exit: no flush once the program's teardown has begun.
extern "C" fn stop_flushing() {
    FLUSHER_STOP.store(true, Ordering::Release);
}

/// CUPTI asks for a buffer: the program's callback gives it where it registered one, else the
/// hook's, `KUBESHARE_HOOK_CUPTI_BUFFER_KB` long (a forced flush hands each one back mostly
/// empty, an unforced one only when full: the smaller, the sooner), 8-aligned as CUPTI asks.
unsafe extern "C" fn want_buffer(buf: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    let theirs = *lock(&THEIRS);
    if let Some((want, _)) = theirs {
        // SAFETY: the program's callback, with CUPTI's own out-parameters.
        return unsafe { want(buf, size, max_records) };
    }
    let layout = Layout::from_size_align(crate::config::settings().cupti_buffer_bytes, 8)
        .expect("at most 16 MiB, a valid layout");
    // SAFETY: a layout of non-zero size (the setting is at least 1 KiB).
    let p = unsafe { std::alloc::alloc(layout) };
    if !p.is_null() {
        lock(&OURS).push((p as usize, layout));
    }
    // SAFETY: CUPTI's out-parameters, valid for the call.
    unsafe {
        *buf = p;
        *size = if p.is_null() { 0 } else { layout.size() };
        *max_records = 0;
    }
}

/// CUPTI hands a buffer back: the switch records are read from it, then it goes to the
/// program's callback, or is freed if it was the hook's.
unsafe extern "C" fn got_buffer(
    ctx: *mut c_void,
    stream: u32,
    buf: *mut u8,
    size: usize,
    valid: usize,
) {
    if let Some(next) = sym::<NextFn>(&r::NEXT) {
        read_switches(next, buf, valid);
    }
    let ours = {
        let mut o = lock(&OURS);
        o.iter()
            .position(|(p, _)| *p == buf as usize)
            .map(|i| o.swap_remove(i))
    };
    // Copied out: the program's callback runs without the hook's lock held.
    let theirs = *lock(&THEIRS);
    if let Some((_, layout)) = ours {
        // SAFETY: allocated in `want_buffer` with this layout, and CUPTI is done with it.
        unsafe { std::alloc::dealloc(buf, layout) };
    } else if let Some((_, got)) = theirs {
        // SAFETY: the program's callback, with the buffer its own `want` gave CUPTI.
        unsafe { got(ctx, stream, buf, size, valid) };
    }
}

/// Books the switch records in `buf` (`valid` bytes of records).
fn read_switches(next: NextFn, buf: *mut u8, valid: usize) {
    if buf.is_null() || !on() {
        return;
    }
    let mut switches = Vec::new();
    let mut r: *mut u8 = std::ptr::null_mut();
    // SAFETY: CUPTI's iterator over a buffer it handed back, `valid` bytes long; `r` is its
    // cursor and points at a record while it returns success.
    while unsafe { next(buf, valid, &mut r) } == 0 && !r.is_null() {
        // SAFETY: every record starts with its kind (u32). A context-switch record is
        // { kind u32, contextId u32, timestamp u64, operationType u32, padding u32 }
        // (cupti_activity.h, CUpti_ActivityComputeEngineCtxSwitch), 8-aligned in the buffer.
        unsafe {
            if r.cast::<u32>().read() == KIND_CTX_SWITCH {
                let ctx = r.add(4).cast::<u32>().read();
                let ts = r.add(8).cast::<u64>().read();
                let op = r.add(16).cast::<u32>().read();
                switches.push((ctx, ts, op));
            }
        }
    }
    if switches.is_empty() {
        return;
    }
    let at = sym::<TimestampFn>(&r::TIMESTAMP).map_or(0, timestamp);
    if let Some(s) = lock(&SLICES).as_mut() {
        let newest = switches.iter().map(|(_, ts, _)| *ts).max().unwrap_or(0);
        for (ctx, ts, op) in switches {
            s.record(ctx, ts, op);
        }
        if at > 0 {
            s.delivered(newest, at);
        }
    }
}

/// The program's own libcupti, for its calls made while the hook holds none: the next one in
/// the global scope, or one loaded in a library's local scope (PyTorch's, which Python loads
/// with RTLD_LOCAL), found by soname.
fn next_cupti<F: Copy>(s: &crate::real::Slot) -> Option<F> {
    if !LIB.load(Ordering::Acquire).is_null() {
        return sym(s);
    }
    let dl = real_dlsym()?;
    let name = s.name();
    // SAFETY: glibc's dlsym with a pseudo-handle and a NUL-terminated name.
    let mut p = unsafe { dl(libc::RTLD_NEXT, name.as_ptr()) };
    for soname in [c"libcupti.so.13", c"libcupti.so.12", c"libcupti.so"] {
        if !p.is_null() {
            break;
        }
        // SAFETY: RTLD_NOLOAD loads nothing: it returns a library already loaded under this
        // soname (its reference count raised, never dropped: it stays loaded anyway).
        let h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            // SAFETY: glibc's dlsym on a live handle with a NUL-terminated name.
            p = unsafe { dl(h, name.as_ptr()) };
        }
    }
    as_fn(p)
}

/// CUPTI_ERROR_NOT_INITIALIZED: no libcupti to forward to.
const NOT_INITIALIZED: i32 = 15;

/// The program registers its buffer callbacks: kept, to be served from the hook's once it reads
/// the records (see the module comment), and registered as asked until then.
///
/// # Safety
/// CUPTI's contract: two callbacks of the documented signatures.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityRegisterCallbacks(want: WantFn, got: GotFn) -> i32 {
    if !LIB.load(Ordering::Acquire).is_null() && STATE.load(Ordering::Acquire) != ENDED {
        *lock(&THEIRS) = Some((want, got));
    }
    if on() {
        return 0;
    }
    match next_cupti::<RegisterFn>(&r::REGISTER) {
        // SAFETY: the real function, with the caller's arguments.
        Some(f) => unsafe { f(want, got) },
        None => NOT_INITIALIZED,
    }
}

/// The program turns a kind of record off: the switch records stay on while the hook reads
/// them (it never turns them off itself; see the module comment).
///
/// # Safety
/// CUPTI's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityDisable(kind: u32) -> i32 {
    if kind == KIND_CTX_SWITCH && on() {
        return 0;
    }
    match next_cupti::<KindFn>(&r::DISABLE) {
        // SAFETY: the real function, with the caller's argument.
        Some(f) => unsafe { f(kind) },
        None => NOT_INITIALIZED,
    }
}

/// The program gives CUPTI a clock of its own: the hook's readings end (see the module
/// comment), whether or not they have begun, since the hook's own timestamps stay on CUPTI's.
///
/// # Safety
/// CUPTI's contract: a function returning a timestamp in ns, or none.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiActivityRegisterTimestampCallback(clock: Option<ClockFn>) -> i32 {
    if !LIB.load(Ordering::Acquire).is_null() {
        end("the program gave CUPTI a clock of its own");
    }
    match next_cupti::<SetClockFn>(&r::SET_CLOCK) {
        // SAFETY: the real function, with the caller's argument.
        Some(f) => unsafe { f(clock) },
        None => NOT_INITIALIZED,
    }
}

/// The program finalizes CUPTI: the hook's readings end with it.
///
/// # Safety
/// CUPTI's contract.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuptiFinalize() -> i32 {
    if on() {
        end("the program finalized CUPTI");
    }
    match next_cupti::<FinalizeFn>(&r::FINALIZE) {
        // SAFETY: the real function.
        Some(f) => unsafe { f() },
        None => NOT_INITIALIZED,
    }
}
