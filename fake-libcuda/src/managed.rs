//! The fake driver's managed (unified) memory: `cuMemAllocManaged`, `cuMemPrefetchAsync`
//! (both ABIs), `cuMemAdvise`. Managed memory lives in host memory and migrates to the GPU on
//! demand, so it is not limited by the device's memory: it is counted against a separate
//! managed capacity (`FAKE_CUDA_MANAGED_BYTES`, default 4 × the device's memory, standing for
//! the host's). A prefetch occupies the device's queue for `bytes / FAKE_CUDA_MIGRATE_BYTES_PER_US`
//! microseconds (default: no time), counted as busy time of the process that asked, as a
//! migration occupies a real GPU's copy engine for its client. Counters let tests see what
//! was prefetched: `fakeCudaPrefetches`, `fakeCudaPrefetchedBytes`, `fakeCudaManagedUsed`.

use crate::engine::Job;
use crate::{current_ctx, current_dev, device, driver, enqueue, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

#[derive(Clone, Copy)]
struct Managed {
    bytes: u64,
    ctx: usize,
}

/// The process's managed allocations; a forked child gets a fresh set (like the driver).
struct State {
    pid: u32,
    allocs: Mutex<HashMap<u64, Managed>>,
    used: AtomicU64,
    prefetches: AtomicU64,
    prefetched: AtomicU64,
    advises: AtomicU64,
}

static STATE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());

fn state() -> &'static State {
    let pid = std::process::id();
    let p = STATE.load(Ordering::Acquire);
    // SAFETY: a non-null STATE was made by `Box::into_raw` below and is leaked, never freed.
    if !p.is_null() && unsafe { (*p).pid } == pid {
        // SAFETY: as above: leaked, so valid for 'static.
        return unsafe { &*p };
    }
    let fresh = Box::into_raw(Box::new(State {
        pid,
        allocs: Mutex::new(HashMap::new()),
        used: AtomicU64::new(0),
        prefetches: AtomicU64::new(0),
        prefetched: AtomicU64::new(0),
        advises: AtomicU64::new(0),
    }));
    match STATE.compare_exchange(p, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` came from `Box::into_raw`, is now published and never freed.
        Ok(_) => unsafe { &*fresh },
        Err(now) => {
            // SAFETY: `fresh` came from `Box::into_raw` and the failed exchange never shared it.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: `now` is the published state: leaked, never freed (non-null: the
            // exchange from `p` failed only because another thread stored a fresh one).
            unsafe { &*now }
        }
    }
}

fn allocs() -> MutexGuard<'static, HashMap<u64, Managed>> {
    state().allocs.lock().unwrap_or_else(|e| e.into_inner())
}

fn env_u64(k: &str) -> Option<u64> {
    std::env::var(k).ok().and_then(|s| s.trim().parse().ok())
}

fn capacity(dev: usize) -> u64 {
    env_u64("FAKE_CUDA_MANAGED_BYTES")
        .unwrap_or_else(|| driver().devices[dev].mem_total.saturating_mul(4))
}

/// `cuMemAllocManaged`: counted against the managed capacity, not the device's memory.
///
/// # Safety
/// `p` is null or valid for writes of a `CUdeviceptr`.
pub(crate) unsafe fn alloc_managed(p: *mut CUdeviceptr, bytes: usize, flags: c_uint) -> CUresult {
    // Exactly one of the attach flags.
    if p.is_null() || bytes == 0 || !(flags == CU_MEM_ATTACH_GLOBAL || flags == CU_MEM_ATTACH_HOST)
    {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let st = state();
    let cap = capacity(dev);
    let ok = st
        .used
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
            u.checked_add(bytes as u64).filter(|n| *n <= cap)
        })
        .is_ok();
    if !ok {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let addr = driver().memory.fresh_range(bytes as u64);
    allocs().insert(
        addr,
        Managed {
            bytes: bytes as u64,
            ctx: current_ctx(),
        },
    );
    // SAFETY: `p` is null or writable (this function's contract); `put` checks null.
    unsafe { put(p, addr) }
}

/// Frees a managed allocation; `None` when `addr` is not one.
pub(crate) fn free_managed(addr: u64) -> Option<CUresult> {
    let m = allocs().remove(&addr)?;
    let _ = state()
        .used
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
            Some(u.saturating_sub(m.bytes))
        });
    Some(CUDA_SUCCESS)
}

/// A destroyed or reset context frees its managed allocations too.
pub(crate) fn free_context_managed(ctx: usize) {
    let gone: Vec<u64> = allocs()
        .iter()
        .filter(|(_, m)| m.ctx == ctx)
        .map(|(k, _)| *k)
        .collect();
    for a in gone {
        free_managed(a);
    }
}

/// The allocation `[ptr, ptr + count)` lies in, if any.
fn inside(ptr: u64, count: usize) -> Option<Managed> {
    let end = ptr.checked_add(count as u64)?;
    allocs()
        .iter()
        .find(|(a, m)| ptr >= **a && end <= **a + m.bytes)
        .map(|(_, m)| *m)
}

fn prefetch(ptr: u64, count: usize, dst: CUdevice, s: CUstream) -> CUresult {
    if count == 0 || inside(ptr, count).is_none() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if dst != CU_DEVICE_CPU && device(dst).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let st = state();
    st.prefetches.fetch_add(1, Ordering::Relaxed);
    st.prefetched.fetch_add(count as u64, Ordering::Relaxed);
    match env_u64("FAKE_CUDA_MIGRATE_BYTES_PER_US").filter(|r| *r > 0) {
        Some(rate) => enqueue(s, Job::Kernel((count as u64).div_ceil(rate))),
        None => CUDA_SUCCESS,
    }
}

/// CUDA ≤ 12 ABI: `(ptr, count, dstDevice, stream)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPrefetchAsync(
    ptr: CUdeviceptr,
    count: usize,
    dst: CUdevice,
    s: CUstream,
) -> CUresult {
    prefetch(ptr, count, dst, s)
}

/// CUDA 12.2+ `_v2` (CUDA 13's `cuMemPrefetchAsync`): `(ptr, count, location, flags, stream)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemPrefetchAsync_v2(
    ptr: CUdeviceptr,
    count: usize,
    loc: CUmemLocation,
    flags: c_uint,
    s: CUstream,
) -> CUresult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let dst = if loc.kind == CU_MEM_LOCATION_TYPE_DEVICE {
        loc.id
    } else {
        CU_DEVICE_CPU
    };
    prefetch(ptr, count, dst, s)
}

/// `cuMemAdvise` (CUDA ≤ 12 ABI): checked and counted, no effect on the simulation.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemAdvise(
    ptr: CUdeviceptr,
    count: usize,
    advice: c_int,
    dev: CUdevice,
) -> CUresult {
    if !(1..=6).contains(&advice) || count == 0 || inside(ptr, count).is_none() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if dev != CU_DEVICE_CPU && device(dev).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    state().advises.fetch_add(1, Ordering::Relaxed);
    CUDA_SUCCESS
}

/// Prefetch calls this process made (any ABI, any destination).
#[unsafe(no_mangle)]
pub extern "C" fn fakeCudaPrefetches() -> u64 {
    state().prefetches.load(Ordering::Relaxed)
}

/// Bytes this process prefetched.
#[unsafe(no_mangle)]
pub extern "C" fn fakeCudaPrefetchedBytes() -> u64 {
    state().prefetched.load(Ordering::Relaxed)
}

/// Managed bytes this process holds.
#[unsafe(no_mangle)]
pub extern "C" fn fakeCudaManagedUsed() -> u64 {
    state().used.load(Ordering::Relaxed)
}
