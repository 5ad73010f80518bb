//! The fake driver's device memory: ordinary allocations (owned by the context current when
//! they were made, freed with it), arrays, and the virtual-memory API (`cuMemCreate` handles,
//! address reservations, `cuMemMap` / `cuMemUnmap`), with the real driver's rule that a
//! released handle keeps its memory while any mapping of it remains.

use crate::{current_ctx, current_dev, device, driver, put};
use cuda_abi::*;
use std::collections::HashMap;
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One allocation made with an address (`cuMemAlloc*`, arrays): its device, size, and the
/// context that owns it (0: none, e.g. pool memory that outlives contexts).
#[derive(Clone, Copy)]
struct Alloc {
    dev: usize,
    bytes: u64,
    ctx: usize,
}

/// A physical allocation made by `cuMemCreate`.
struct Handle {
    dev: usize,
    bytes: u64,
    /// Live mappings of it.
    maps: u32,
    /// `cuMemRelease` was called: the memory goes when the last mapping does.
    released: bool,
}

#[derive(Default)]
pub(crate) struct Memory {
    allocs: HashMap<u64, Alloc>,
    handles: HashMap<u64, Handle>,
    /// Mapped virtual address → (handle, size).
    maps: HashMap<u64, (u64, u64)>,
    /// Reserved virtual ranges: start → size.
    reserved: HashMap<u64, u64>,
}

pub(crate) struct MemoryState {
    m: Mutex<Memory>,
    next_addr: AtomicU64,
}

impl MemoryState {
    pub(crate) fn new() -> Self {
        MemoryState {
            m: Mutex::new(Memory::default()),
            next_addr: AtomicU64::new(0x7f00_0000_0000),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Memory> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Addresses are 2 MiB aligned and never reused, like a fresh virtual range.
    pub(crate) fn fresh_range(&self, bytes: u64) -> u64 {
        let span = bytes.max(1).div_ceil(2 << 20) * (2 << 20);
        self.next_addr.fetch_add(span, Ordering::Relaxed)
    }
}

fn mem() -> &'static MemoryState {
    &driver().memory
}

fn alloc_on(dev: usize, bytes: u64, ctx: usize) -> Result<CUdeviceptr, CUresult> {
    if !driver().devices[dev].reserve(bytes) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let addr = mem().fresh_range(bytes);
    mem().lock().allocs.insert(addr, Alloc { dev, bytes, ctx });
    Ok(addr)
}

fn free_addr(addr: u64) -> CUresult {
    if addr == 0 {
        return CUDA_SUCCESS;
    }
    let entry = mem().lock().allocs.remove(&addr);
    match entry {
        Some(a) => {
            driver().devices[a.dev].unreserve(a.bytes);
            CUDA_SUCCESS
        }
        None => crate::managed::free_managed(addr).unwrap_or(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Frees every allocation owned by context `ctx` (it was destroyed or reset).
pub(crate) fn free_context(ctx: usize) {
    let freed: Vec<Alloc> = {
        let mut m = mem().lock();
        let keys: Vec<u64> = m
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(k, _)| *k)
            .collect();
        keys.iter().filter_map(|k| m.allocs.remove(k)).collect()
    };
    for a in freed {
        driver().devices[a.dev].unreserve(a.bytes);
    }
    crate::managed::free_context_managed(ctx);
}

/// Allocates `bytes` on the current context's device and stores the address in `*out`; the
/// allocation belongs to that context when `owned` (else to the device's pool).
///
/// # Safety
/// `out` is null or valid for writes of a `CUdeviceptr`.
unsafe fn alloc_current(out: *mut CUdeviceptr, bytes: usize, owned: bool) -> CUresult {
    if out.is_null() || bytes == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let ctx = if owned { current_ctx() } else { 0 };
    match alloc_on(dev, bytes as u64, ctx) {
        // SAFETY: `out` is null or writable (this function's contract); `put` checks null.
        Ok(p) => unsafe { put(out, p) },
        Err(e) => e,
    }
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut CUdeviceptr, bytes: usize) -> CUresult {
    // SAFETY: `p` is null or writable (this function's contract), as `alloc_current` requires.
    unsafe { alloc_current(p, bytes, true) }
}

/// # Safety
/// The C API's contract: `p`, `pitch` are null or valid for writes of their types.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    p: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    _elem: c_uint,
) -> CUresult {
    if pitch.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let pt = pitch_for(width);
    // SAFETY: `p` is null or writable (this function's contract), as `alloc_current` requires.
    let r = unsafe { alloc_current(p, pt.saturating_mul(height), true) };
    if r == CUDA_SUCCESS {
        // SAFETY: non-null (checked on entry) and writable (this function's contract).
        unsafe { pitch.write(pt) };
    }
    r
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    p: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `alloc_managed`'s.
    unsafe { crate::managed::alloc_managed(p, bytes, flags) }
}

// Stream-ordered allocations come from the device's pool, which is not a context's.
/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    p: *mut CUdeviceptr,
    bytes: usize,
    _s: CUstream,
) -> CUresult {
    // SAFETY: `p` is null or writable (this function's contract), as `alloc_current` requires.
    unsafe { alloc_current(p, bytes, false) }
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type; `s` is null or a handle the
/// driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    p: *mut CUdeviceptr,
    bytes: usize,
    s: CUstream,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuMemAllocAsync`'s.
    unsafe { cuMemAllocAsync(p, bytes, s) }
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    p: *mut CUdeviceptr,
    bytes: usize,
    _pool: CUmemoryPool,
    _s: CUstream,
) -> CUresult {
    // SAFETY: `p` is null or writable (this function's contract), as `alloc_current` requires.
    unsafe { alloc_current(p, bytes, false) }
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type; `pool`, `s` are null or a
/// handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    p: *mut CUdeviceptr,
    bytes: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuMemAllocFromPoolAsync`'s.
    unsafe { cuMemAllocFromPoolAsync(p, bytes, pool, s) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(p: CUdeviceptr) -> CUresult {
    free_addr(p)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(p: CUdeviceptr, _s: CUstream) -> CUresult {
    free_addr(p)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync_ptsz(p: CUdeviceptr, s: CUstream) -> CUresult {
    cuMemFreeAsync(p, s)
}

// ---------------------------------------------------------------- virtual memory

/// # Safety
/// The C API's contract: `h` is null or valid for writes of its type; `prop` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    h: *mut CUmemGenericAllocationHandle,
    bytes: usize,
    prop: *const CUmemAllocationProp,
    _flags: u64,
) -> CUresult {
    if h.is_null() || prop.is_null() || bytes == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null (checked) and pointing to a valid `CUmemAllocationProp` (this function's
    // contract).
    let id = unsafe { (*prop).location_id };
    if device(id).is_none() {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let dev = id as usize;
    if !driver().devices[dev].reserve(bytes as u64) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // Handle values are taken from the address space too: unique, never reused.
    let handle = mem().fresh_range(bytes as u64);
    mem().lock().handles.insert(
        handle,
        Handle {
            dev,
            bytes: bytes as u64,
            maps: 0,
            released: false,
        },
    );
    // SAFETY: `h` is null or writable (this function's contract); `put` checks null.
    unsafe { put(h, handle) }
}

/// Frees a handle's memory if it is released and unmapped.
fn settle(m: &mut Memory, handle: u64) {
    if m.handles
        .get(&handle)
        .is_some_and(|h| h.released && h.maps == 0)
        && let Some(h) = m.handles.remove(&handle)
    {
        driver().devices[h.dev].unreserve(h.bytes);
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult {
    let mut m = mem().lock();
    match m.handles.get_mut(&h) {
        Some(x) if !x.released => {
            x.released = true;
            settle(&mut m, h);
            CUDA_SUCCESS
        }
        _ => CUDA_ERROR_INVALID_VALUE,
    }
}

/// # Safety
/// The C API's contract: `ptr` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    _align: usize,
    _addr: CUdeviceptr,
    _flags: u64,
) -> CUresult {
    if ptr.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let a = mem().fresh_range(size as u64);
    mem().lock().reserved.insert(a, size as u64);
    // SAFETY: `ptr` is null or writable (this function's contract); `put` checks null.
    unsafe { put(ptr, a) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, _size: usize) -> CUresult {
    match mem().lock().reserved.remove(&ptr) {
        Some(_) => CUDA_SUCCESS,
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    h: CUmemGenericAllocationHandle,
    _flags: u64,
) -> CUresult {
    let mut m = mem().lock();
    let inside = m
        .reserved
        .iter()
        .any(|(s, n)| ptr >= *s && ptr.saturating_add(size as u64) <= s + n);
    let ok = m
        .handles
        .get(&h)
        .is_some_and(|x| !x.released && (offset as u64).saturating_add(size as u64) <= x.bytes);
    if !inside || !ok || size == 0 || m.maps.contains_key(&ptr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    m.maps.insert(ptr, (h, size as u64));
    if let Some(x) = m.handles.get_mut(&h) {
        x.maps += 1;
    }
    CUDA_SUCCESS
}

/// Unmaps every mapping that starts inside `[ptr, ptr + size)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let mut m = mem().lock();
    let end = ptr.saturating_add(size as u64);
    let hit: Vec<u64> = m
        .maps
        .keys()
        .filter(|a| **a >= ptr && **a < end)
        .copied()
        .collect();
    if hit.is_empty() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for a in hit {
        if let Some((h, _)) = m.maps.remove(&a) {
            if let Some(x) = m.handles.get_mut(&h) {
                x.maps = x.maps.saturating_sub(1);
            }
            settle(&mut m, h);
        }
    }
    CUDA_SUCCESS
}

// ---------------------------------------------------------------- arrays

/// # Safety
/// The C API's contract: `a` is null or valid for writes of its type; `d` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    a: *mut CUarray,
    d: *const CudaArrayDescriptor,
) -> CUresult {
    if a.is_null() || d.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: both non-null (checked); `d` points to a valid descriptor and `a` is writable
    // (this function's contract).
    unsafe { create_array(a, (*d).bytes()) }
}

/// # Safety
/// The C API's contract: `a` is null or valid for writes of its type; `d` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    a: *mut CUarray,
    d: *const CudaArray3dDescriptor,
) -> CUresult {
    if a.is_null() || d.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: both non-null (checked); `d` points to a valid descriptor and `a` is writable
    // (this function's contract).
    unsafe { create_array(a, (*d).bytes()) }
}

/// Allocates an array of `bytes` on the current device and stores its handle in `*a`.
///
/// # Safety
/// `a` is null or valid for writes of a `CUarray`.
unsafe fn create_array(a: *mut CUarray, bytes: u64) -> CUresult {
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    match alloc_on(dev, bytes, current_ctx()) {
        // SAFETY: `a` is null or writable (this function's contract); `put` checks null.
        Ok(p) => unsafe { put(a, p as CUarray) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuArrayDestroy(a: CUarray) -> CUresult {
    free_addr(a as u64)
}

/// # Safety
/// The C API's contract: `free`, `total` are null or valid for writes of their types.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let d = &driver().devices[dev];
    let (used, tot) = (d.mem_used(), d.mem_total);
    // SAFETY: `free` and `total` are null or writable (this function's contract); `put` checks
    // null.
    unsafe {
        let r = put(free, tot.saturating_sub(used) as usize);
        if r != CUDA_SUCCESS {
            return r;
        }
        put(total, tot as usize)
    }
}

/// Device memory in use on `dev` in this process (for the fake NVML and tests).
#[unsafe(no_mangle)]
pub extern "C" fn fakeCudaMemUsed(dev: i32) -> u64 {
    device(dev).map(|d| d.mem_used()).unwrap_or(0)
}
