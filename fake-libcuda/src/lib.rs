//! A fake CUDA driver (`libcuda.so.1`) for tests on machines without a GPU.
//!
//! It exports the driver entry points that libgemhook and its tests use, reachable like the
//! real driver's by symbol, by `dlsym` and by `cuGetProcAddress` / `cuGetProcAddress_v2`.
//! Each device is a simulated GPU: one queue that runs launched kernels one after another, each
//! occupying the device for the duration its arguments name (see
//! [`convention::kernel_duration_us`]),
//! asynchronously, so that synchronisation calls really wait. Memory is counted against a
//! configurable size, with fake device addresses (never dereferenced).
//!
//! Environment: `FAKE_CUDA_DEVICES` (comma-separated NVML-style UUIDs; default one device),
//! `FAKE_CUDA_MEM_BYTES` (memory per device; default 16 GiB), `FAKE_CUDA_DRIVER_VERSION`
//! (default 13000), `FAKE_CUDA_SHARED_DIR` (processes naming the same directory share their
//! simulated devices, as processes share a real GPU, and NVML lists the processes with a
//! context on each, see `procs`), `FAKE_CUDA_INVENTORY` (without `FAKE_CUDA_DEVICES`: the
//! GPUs of a node inventory file). `fakeCudaBusyMicros(dev)` returns the kernel time the
//! device has executed in this process, so tests can measure shares.
#![allow(non_snake_case)]

pub mod convention;
mod engine;
mod launches;
mod managed;
mod memory;
mod nvml;
mod procs;
mod waits;

use convention::kernel_duration_us;
use cuda_abi::*;
use engine::{Device, Job};
use launches::*;
use managed::*;
use memory::*;
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use waits::*;

const DEFAULT_UUID: &str = "GPU-00000000-0000-4000-8000-000000000001";
const DEFAULT_MEM: u64 = 16 << 30;

/// A context: which device it belongs to.
struct Ctx {
    dev: usize,
}

/// A stream: its device and the last job queued on it.
struct Stream {
    dev: usize,
    last: AtomicU64,
}

pub(crate) struct Driver {
    pub(crate) devices: Vec<Arc<Device>>,
    primary: Vec<usize>, // Box<Ctx> addresses, leaked on purpose (primary contexts live forever)
    /// Retain count of each device's primary context (0: inactive).
    primary_refs: Vec<AtomicU32>,
    pub(crate) memory: memory::MemoryState,
    version: i32,
    /// `FAKE_CUDA_NOOP_LAUNCH=1`: launches return at once and run nothing, so that a
    /// benchmark of the hook's per-launch cost measures the hook, not the fake's queue.
    noop_launch: bool,
}

/// The driver's state. A forked child gets a fresh one (see [`after_fork_in_child`]).
static DRIVER: AtomicPtr<Driver> = AtomicPtr::new(std::ptr::null_mut());

pub(crate) fn driver() -> &'static Driver {
    let p = DRIVER.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: a non-null DRIVER was made by `Box::into_raw` below and is leaked, never
        // freed (a forked child's reset leaks it too), so it lives for 'static.
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Box::new(new_driver()));
    match DRIVER.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            static ATFORK: std::sync::Once = std::sync::Once::new();
            ATFORK.call_once(|| {
                // SAFETY: registers an `extern "C" fn()` handler, as pthread_atfork expects,
                // that only stores to an atomic (async-signal-safe in the forked child).
                unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
            });
            // SAFETY: `fresh` came from `Box::into_raw`, is now published and never freed.
            unsafe { &*fresh }
        }
        Err(other) => {
            // Another thread won the race: drop ours, use theirs.
            // SAFETY: `fresh` came from `Box::into_raw` and the failed exchange never shared it.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: `other` is the published driver: leaked, never freed.
            unsafe { &*other }
        }
    }
}

/// A forked child is a new process on the same (shared) simulated GPUs: the parent's queue
/// workers do not exist in it, so it starts from a fresh driver (the old one is leaked).
/// Unlike the real driver, the fake lets a child use CUDA after its parent did: the tests of
/// the hook's fork handling need a child that talks to the GPU.
extern "C" fn after_fork_in_child() {
    DRIVER.store(std::ptr::null_mut(), Ordering::Release);
}

fn new_driver() -> Driver {
    let uuids = std::env::var("FAKE_CUDA_DEVICES")
        .ok()
        .or_else(procs::devices_from_inventory)
        .unwrap_or_else(|| DEFAULT_UUID.into());
    let mem = std::env::var("FAKE_CUDA_MEM_BYTES")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_MEM);
    let devices: Vec<Arc<Device>> = uuids
        .split(',')
        .filter_map(|u| parse_uuid(u.trim()))
        .enumerate()
        .map(|(i, uuid)| Arc::new(Device::new(i, uuid, mem)))
        .collect();
    // Primary contexts keep their addresses across a fork (the child's threads may hold
    // them as current): made once per process image and reused.
    static PRIMARY: OnceLock<Vec<usize>> = OnceLock::new();
    let primary = PRIMARY
        .get_or_init(|| {
            (0..devices.len())
                .map(|dev| Box::into_raw(Box::new(Ctx { dev })) as usize)
                .collect()
        })
        .clone();
    let version = std::env::var("FAKE_CUDA_DRIVER_VERSION")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(13000);
    Driver {
        primary_refs: (0..devices.len()).map(|_| AtomicU32::new(0)).collect(),
        devices,
        primary,
        memory: memory::MemoryState::new(),
        version,
        noop_launch: std::env::var("FAKE_CUDA_NOOP_LAUNCH").is_ok_and(|v| v == "1"),
    }
}

thread_local! {
    static CURRENT: Cell<*mut Ctx> = const { Cell::new(std::ptr::null_mut()) };
    static CTX_STACK: std::cell::RefCell<Vec<*mut Ctx>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(crate) fn device(dev: CUdevice) -> Option<&'static Arc<Device>> {
    usize::try_from(dev)
        .ok()
        .and_then(|d| driver().devices.get(d))
}

/// The calling thread's current context, as an address (0: none).
pub(crate) fn current_ctx() -> usize {
    CURRENT.with(|c| c.get()) as usize
}

pub(crate) fn current_dev() -> Option<usize> {
    let c = CURRENT.with(|c| c.get());
    if c.is_null() {
        None
    } else {
        // SAFETY: a non-null current context is a `Ctx` this library boxed (primary or
        // `cuCtxCreate_v2`) and leaked, never freed; a foreign pointer set as current would be
        // the caller's breach of `cuCtxSetCurrent`'s contract, as with the real driver.
        Some(unsafe { (*c).dev })
    }
}

/// The device a stream handle belongs to (special handles and null: the current context's).
fn stream_dev(s: CUstream) -> Option<usize> {
    if (s as usize) <= 2 {
        current_dev()
    } else {
        // SAFETY: handles above the special values 0-2 are `Box<Stream>`s that
        // `cuStreamCreate` leaked (streams are never freed), as the driver's contract has
        // callers pass only streams it made.
        Some(unsafe { (*(s as *const Stream)).dev })
    }
}

fn enqueue(s: CUstream, job: Job) -> CUresult {
    let Some(dev) = stream_dev(s) else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let seq = driver().devices[dev].submit(job);
    if (s as usize) > 2 {
        // SAFETY: as in `stream_dev`: a leaked `Box<Stream>`.
        unsafe { (*(s as *const Stream)).last.store(seq, Ordering::Release) };
    }
    CUDA_SUCCESS
}

/// Writes an out-parameter: `CUDA_ERROR_INVALID_VALUE` for a null one, as the driver answers.
///
/// # Safety
/// `p` is null or valid for a write of a `T` (the driver's contract for out-parameters).
pub(crate) unsafe fn put<T>(p: *mut T, v: T) -> CUresult {
    if p.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller guarantees it is writable.
    unsafe { p.write(v) };
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- init, version, devices

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    if driver().devices.is_empty() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `v` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    // SAFETY: `v` is null or writable (this function's contract); `put` checks null.
    unsafe { put(v, driver().version) }
}

/// # Safety
/// The C API's contract: `n` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    // SAFETY: `n` is null or writable (this function's contract); `put` checks null.
    unsafe { put(n, driver().devices.len() as c_int) }
}

/// # Safety
/// The C API's contract: `d` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult {
    if device(ordinal).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    // SAFETY: `d` is null or writable (this function's contract); `put` checks null.
    unsafe { put(d, ordinal) }
}

/// # Safety
/// The C API's contract: `name` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let s = b"Fake GPU\0";
    if name.is_null() || (len as usize) < s.len() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked above: `name` is non-null and holds at least `len` >= `s.len()` bytes
    // (the caller's contract), and a static string cannot overlap it.
    unsafe { std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, name, s.len()) };
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `uuid` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    match device(dev) {
        // SAFETY: `uuid` is null or writable (this function's contract); `put` checks null.
        Some(d) => unsafe { put(uuid, d.uuid) },
        None => CUDA_ERROR_INVALID_DEVICE,
    }
}

/// # Safety
/// The C API's contract: `uuid` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuDeviceGetUuid`'s.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

/// # Safety
/// The C API's contract: `bytes` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    match device(dev) {
        // SAFETY: `bytes` is null or writable (this function's contract); `put` checks null.
        Some(d) => unsafe { put(bytes, d.mem_total as usize) },
        None => CUDA_ERROR_INVALID_DEVICE,
    }
}

// ---------------------------------------------------------------- contexts

/// # Safety
/// The C API's contract: `ctx` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    driver().primary_refs[dev as usize].fetch_add(1, Ordering::AcqRel);
    procs::record(dev as usize);
    // SAFETY: `ctx` is null or writable (this function's contract); `put` checks null.
    unsafe { put(ctx, driver().primary[dev as usize] as CUcontext) }
}

/// Drops one retain of the primary context; the last one destroys it, with its memory.
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let d = dev as usize;
    let before = driver().primary_refs[d]
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    match before {
        Ok(1) => {
            free_context(driver().primary[d]);
            CUDA_SUCCESS
        }
        Ok(_) => CUDA_SUCCESS,
        Err(_) => CUDA_ERROR_INVALID_CONTEXT,
    }
}

/// Destroys every allocation of the primary context (it stays retained).
#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let d = &driver().devices[dev as usize];
    d.wait_for(d.submitted());
    free_context(driver().primary[dev as usize]);
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `flags`, `active` are null or valid for writes of their types.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let on = driver().primary_refs[dev as usize].load(Ordering::Acquire) > 0;
    // SAFETY: `flags` and `active` are null or writable (this function's contract); `put`
    // checks null.
    unsafe {
        let r = put(flags, 0);
        if r != CUDA_SUCCESS {
            return r;
        }
        put(active, c_int::from(on))
    }
}

/// # Safety
/// The C API's contract: `ctx` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    ctx: *mut CUcontext,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    if device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let c = Box::into_raw(Box::new(Ctx { dev: dev as usize }));
    procs::record(dev as usize);
    CURRENT.with(|cur| cur.set(c));
    // SAFETY: `ctx` is null or writable (this function's contract); `put` checks null.
    unsafe { put(ctx, c as CUcontext) }
}

/// Destroys a context made by `cuCtxCreate_v2`, freeing the memory it owns.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    if ctx.is_null() || driver().primary.contains(&(ctx as usize)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CURRENT.with(|cur| {
        if cur.get() == ctx as *mut Ctx {
            cur.set(std::ptr::null_mut());
        }
    });
    free_context(ctx as usize);
    // Contexts are leaked rather than freed: another thread may still name it (a test double).
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    CURRENT.with(|cur| cur.set(ctx as *mut Ctx));
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `ctx` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    // SAFETY: `ctx` is null or writable (this function's contract); `put` checks null.
    unsafe { put(ctx, CURRENT.with(|c| c.get()) as CUcontext) }
}

/// # Safety
/// The C API's contract: `dev` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    match current_dev() {
        // SAFETY: `dev` is null or writable (this function's contract); `put` checks null.
        Some(d) => unsafe { put(dev, d as CUdevice) },
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    let prev = CURRENT.with(|c| c.replace(ctx as *mut Ctx));
    CTX_STACK.with(|s| s.borrow_mut().push(prev));
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `ctx` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut CUcontext) -> CUresult {
    let prev = CTX_STACK
        .with(|s| s.borrow_mut().pop())
        .unwrap_or(std::ptr::null_mut());
    let cur = CURRENT.with(|c| c.replace(prev));
    if !ctx.is_null() {
        // SAFETY: non-null (checked) and writable (this function's contract).
        unsafe { ctx.write(cur as CUcontext) };
    }
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    match current_dev() {
        Some(d) => {
            let dev = &driver().devices[d];
            dev.wait_for(dev.submitted());
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

// ---------------------------------------------------------------- errors

/// # Safety
/// The C API's contract: `s` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult {
    let msg: &'static CStr = match e {
        CUDA_SUCCESS => c"no error",
        CUDA_ERROR_OUT_OF_MEMORY => c"out of memory",
        CUDA_ERROR_INVALID_CONTEXT => c"invalid device context",
        _ => c"fake libcuda error",
    };
    // SAFETY: `s` is null or writable (this function's contract); `put` checks null.
    unsafe { put(s, msg.as_ptr()) }
}

/// # Safety
/// The C API's contract: `s` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult {
    let msg: &'static CStr = match e {
        CUDA_SUCCESS => c"CUDA_SUCCESS",
        CUDA_ERROR_OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        _ => c"CUDA_ERROR_UNKNOWN",
    };
    // SAFETY: `s` is null or writable (this function's contract); `put` checks null.
    unsafe { put(s, msg.as_ptr()) }
}

// ---------------------------------------------------------------- cuGetProcAddress

/// Every entry point the fake serves through `cuGetProcAddress`, by exported name.
fn table() -> &'static HashMap<&'static str, usize> {
    static TABLE: OnceLock<HashMap<&'static str, usize>> = OnceLock::new();
    TABLE.get_or_init(|| {
        macro_rules! entries {
            ($($f:ident),* $(,)?) => { HashMap::from([$((stringify!($f), $f as *const () as usize)),*]) };
        }
        entries!(
            cuInit, cuDriverGetVersion, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName,
            cuDeviceGetUuid, cuDeviceGetUuid_v2, cuDeviceTotalMem_v2, cuDevicePrimaryCtxRetain,
            cuDevicePrimaryCtxRelease_v2, cuCtxCreate_v2, cuCtxDestroy_v2, cuCtxSetCurrent,
            cuCtxGetCurrent, cuCtxGetDevice, cuCtxPushCurrent_v2, cuCtxPopCurrent_v2,
            cuCtxSynchronize, cuStreamCreate, cuStreamDestroy_v2, cuStreamSynchronize,
            cuStreamSynchronize_ptsz, cuStreamQuery, cuStreamIsCapturing,
            cuThreadExchangeStreamCaptureMode, cuEventCreate, cuEventDestroy_v2, cuEventRecord,
            cuEventRecord_ptsz, cuEventSynchronize, cuEventQuery, cuEventElapsedTime,
            cuLaunchKernel, cuLaunchKernel_ptsz, cuLaunchCooperativeKernel,
            cuLaunchCooperativeKernel_ptsz, cuLaunchKernelEx, cuLaunchKernelEx_ptsz,
            cuGraphLaunch, cuGraphLaunch_ptsz, cuMemAlloc_v2, cuMemAllocPitch_v2,
            cuMemAllocManaged, cuMemAllocAsync, cuMemAllocAsync_ptsz, cuMemAllocFromPoolAsync,
            cuMemAllocFromPoolAsync_ptsz, cuMemFree_v2, cuMemFreeAsync, cuMemFreeAsync_ptsz,
            cuMemCreate, cuMemRelease, cuArrayCreate_v2, cuArray3DCreate_v2, cuArrayDestroy,
            cuMemGetInfo_v2, cuGetErrorString, cuGetErrorName, cuGetProcAddress,
            cuGetProcAddress_v2, fakeCudaBusyMicros, fakeCudaMemUsed, cuDevicePrimaryCtxReset_v2,
            cuDevicePrimaryCtxGetState, cuMemAddressReserve, cuMemAddressFree, cuMemMap,
            cuMemUnmap, cuMemPrefetchAsync, cuMemPrefetchAsync_v2, cuMemAdvise,
            fakeCudaPrefetches, fakeCudaPrefetchedBytes, fakeCudaManagedUsed,
            cuMemHostRegister_v2, cuMemHostUnregister, cuMemHostGetDevicePointer_v2,
            cuStreamWaitValue32_v2,
        )
    })
}

/// The exported entry points must have the C API's signatures, the ones callers (the hook
/// among them) cast the fake's addresses to: checked at compile time.
macro_rules! signatures_match {
    ($($f:ident),* $(,)?) => { $(const _: pfn::$f = $f;)* };
}
signatures_match!(
    cuInit,
    cuDriverGetVersion,
    cuDeviceGetCount,
    cuDeviceGet,
    cuDeviceGetName,
    cuDeviceGetUuid,
    cuDeviceGetUuid_v2,
    cuDeviceTotalMem_v2,
    cuDevicePrimaryCtxRetain,
    cuDevicePrimaryCtxRelease_v2,
    cuDevicePrimaryCtxReset_v2,
    cuDevicePrimaryCtxGetState,
    cuCtxCreate_v2,
    cuCtxDestroy_v2,
    cuCtxSetCurrent,
    cuCtxGetCurrent,
    cuCtxGetDevice,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuCtxSynchronize,
    cuStreamCreate,
    cuStreamSynchronize,
    cuStreamSynchronize_ptsz,
    cuStreamQuery,
    cuStreamIsCapturing,
    cuThreadExchangeStreamCaptureMode,
    cuEventCreate,
    cuEventDestroy_v2,
    cuEventRecord,
    cuEventRecord_ptsz,
    cuEventSynchronize,
    cuEventQuery,
    cuEventElapsedTime,
    cuLaunchKernel,
    cuLaunchKernel_ptsz,
    cuLaunchCooperativeKernel,
    cuLaunchCooperativeKernel_ptsz,
    cuLaunchKernelEx,
    cuLaunchKernelEx_ptsz,
    cuGraphLaunch,
    cuGraphLaunch_ptsz,
    cuMemAlloc_v2,
    cuMemAllocPitch_v2,
    cuMemAllocManaged,
    cuMemAllocAsync,
    cuMemAllocAsync_ptsz,
    cuMemAllocFromPoolAsync,
    cuMemAllocFromPoolAsync_ptsz,
    cuMemFree_v2,
    cuMemFreeAsync,
    cuMemFreeAsync_ptsz,
    cuMemCreate,
    cuMemRelease,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemMap,
    cuMemUnmap,
    cuArrayCreate_v2,
    cuArray3DCreate_v2,
    cuArrayDestroy,
    cuMemGetInfo_v2,
    cuMemPrefetchAsync,
    cuMemPrefetchAsync_v2,
    cuMemAdvise,
    cuGetErrorString,
    cuGetErrorName,
    cuGetProcAddress,
    cuGetProcAddress_v2,
    cuMemHostRegister_v2,
    cuMemHostGetDevicePointer_v2,
    cuStreamWaitValue32_v2,
);

/// The fake's own `cuLaunchKernel`, reachable without going through the hook: how the
/// per-launch benchmark compares the hook's wrapper with the bare driver function in one
/// process. (Not the exported function's address: inside a shared library that resolves
/// through the GOT, where the preloaded hook interposes.) Other names: null.
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fakeCudaRawProc(name: *const c_char) -> *mut c_void {
    // SAFETY: checked non-null; NUL-terminated (this function's contract).
    if name.is_null() || unsafe { CStr::from_ptr(name) } != c"cuLaunchKernel" {
        return std::ptr::null_mut();
    }
    raw_launch_kernel as *const () as *mut c_void
}

/// A local (not exported, so not interposable) copy of `cuLaunchKernel`.
extern "C" fn raw_launch_kernel(
    _f: CUfunction,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shmem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the fake's kernel convention (see `kernel_duration_us`).
    launches::launch(s, unsafe { kernel_duration_us(params) })
}

/// Resolves a base name the way the driver does: the `_v2`/`_ptsz` variant that the caller's
/// CUDA version and per-thread-stream flag select, else the name itself.
fn resolve(name: &str, version: i32, flags: u64) -> Option<usize> {
    let t = table();
    let ptsz = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let mut candidates: Vec<String> = Vec::new();
    let v2_from = match name {
        "cuGetProcAddress" => 12000,
        "cuDeviceGetUuid" => 11040,
        _ => 3020,
    };
    if ptsz {
        candidates.push(format!("{name}_ptsz"));
    }
    if version >= v2_from {
        candidates.push(format!("{name}_v2"));
    }
    candidates.push(name.to_string());
    candidates.iter().find_map(|c| t.get(c.as_str()).copied())
}

/// Both `cuGetProcAddress` ABIs: the result code and the query result.
///
/// # Safety
/// `symbol` is null or a NUL-terminated string; `pfn` is null or writable.
unsafe fn get_proc(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> (CUresult, i32) {
    if symbol.is_null() || pfn.is_null() {
        return (
            CUDA_ERROR_INVALID_VALUE,
            CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
        );
    }
    // SAFETY: checked non-null; NUL-terminated (this function's contract).
    let name = unsafe { CStr::from_ptr(symbol) }.to_str().unwrap_or("");
    match resolve(name, version, flags) {
        Some(f) => {
            // SAFETY: checked non-null; writable (this function's contract).
            unsafe { pfn.write(f as *mut c_void) };
            (CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS)
        }
        None => {
            // SAFETY: checked non-null; writable (this function's contract).
            unsafe { pfn.write(std::ptr::null_mut()) };
            (CUDA_ERROR_NOT_FOUND, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
        }
    }
}

/// The CUDA 11.3–11.8 ABI (exported name `cuGetProcAddress`).
///
/// # Safety
/// The C API's contract: `pfn` is null or valid for writes of its type; `symbol` is null or a NUL-
/// terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `get_proc`'s.
    unsafe { get_proc(symbol, pfn, version, flags).0 }
}

/// The CUDA 12+ ABI, with the query result.
///
/// # Safety
/// The C API's contract: `pfn`, `status` are null or valid for writes of their types; `symbol` is
/// null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `get_proc`'s.
    let (r, st) = unsafe { get_proc(symbol, pfn, version, flags) };
    if !status.is_null() {
        // SAFETY: non-null (checked) and writable (this function's contract).
        unsafe { status.write(st) };
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_picks_versioned_variants() {
        let t = table();
        assert_eq!(
            resolve("cuMemAlloc", 12000, 0),
            t.get("cuMemAlloc_v2").copied()
        );
        assert_eq!(
            resolve("cuLaunchKernel", 12000, 2),
            t.get("cuLaunchKernel_ptsz").copied()
        );
        assert_eq!(
            resolve("cuLaunchKernel", 12000, 0),
            t.get("cuLaunchKernel").copied()
        );
        assert_eq!(
            resolve("cuGetProcAddress", 11080, 0),
            t.get("cuGetProcAddress").copied()
        );
        assert_eq!(
            resolve("cuGetProcAddress", 12000, 0),
            t.get("cuGetProcAddress_v2").copied()
        );
        assert_eq!(resolve("cuNoSuchThing", 12000, 0), None);
    }

    #[test]
    fn kernels_run_asynchronously_and_sync_waits() {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live local out-parameter.
        unsafe { assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), 0) };
        assert_eq!(cuCtxSetCurrent(ctx), 0);
        let before = fakeCudaBusyMicros(0);
        let mut dur: u64 = 20_000;
        let mut params = [&mut dur as *mut u64 as *mut c_void];
        let t0 = std::time::Instant::now();
        // SAFETY: `params` holds a pointer to a live u64 (the fake's kernel convention); the
        // other pointers are null, which the fake accepts.
        let r = unsafe {
            cuLaunchKernel(
                std::ptr::null_mut(),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(r, 0);
        assert!(t0.elapsed().as_millis() < 15, "launch must not block");
        assert_eq!(cuCtxSynchronize(), 0);
        assert!(
            t0.elapsed().as_millis() >= 20,
            "sync must wait for the kernel"
        );
        assert!(fakeCudaBusyMicros(0) - before >= 20_000);
    }

    #[test]
    fn only_an_events_latest_record_completes_it() {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live local out-parameter.
        unsafe { assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), 0) };
        assert_eq!(cuCtxSetCurrent(ctx), 0);
        let mut e = std::ptr::null_mut();
        let mut dur: u64 = 30_000;
        let mut params = [&mut dur as *mut u64 as *mut c_void];
        let t0 = std::time::Instant::now();
        // SAFETY: a live out-parameter, then the event the fake made; `params` as in the test
        // above.
        unsafe {
            assert_eq!(cuEventCreate(&mut e, 0), 0);
            assert_eq!(cuEventRecord(e, std::ptr::null_mut()), 0);
            let r = cuLaunchKernel(
                std::ptr::null_mut(),
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            assert_eq!(r, 0);
            // Recorded again behind the kernel: the first record, reached at once, is
            // superseded and must not complete it (the driver's rule).
            assert_eq!(cuEventRecord(e, std::ptr::null_mut()), 0);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        // SAFETY: the event made above.
        unsafe {
            assert_eq!(cuEventQuery(e), CUDA_ERROR_NOT_READY);
            assert_eq!(cuEventSynchronize(e), 0);
        }
        assert!(
            t0.elapsed().as_millis() >= 30,
            "done only behind the kernel"
        );
    }

    #[test]
    fn memory_is_capped_and_credited() {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a live local out-parameter.
        unsafe { assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), 0) };
        assert_eq!(cuCtxSetCurrent(ctx), 0);
        let mut p = 0u64;
        // SAFETY: `p` is a live local out-parameter; the frees name addresses the fake made.
        unsafe {
            assert_eq!(
                cuMemAlloc_v2(&mut p, (DEFAULT_MEM + 1) as usize),
                CUDA_ERROR_OUT_OF_MEMORY
            );
            assert_eq!(cuMemAlloc_v2(&mut p, 1 << 20), 0);
        }
        assert_eq!(cuMemFree_v2(p), 0);
        assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
    }
}
