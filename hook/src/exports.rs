//! The functions libgemhook exports: driver entry points that shadow libcuda's (LD_PRELOAD
//! interposition), `dlsym` (so `dlsym(libcuda, "cuLaunchKernelEx")` finds the wrapper), and
//! `cuGetProcAddress` / `cuGetProcAddress_v2` (the CUDA 11.3+ runtime's way in), which hand out
//! the wrapper of the exact ABI variant the caller's version selects, themselves included.
#![allow(non_snake_case, clippy::too_many_arguments)]

use crate::config::active;
use crate::device::{current_ctx, current_device, device_index, gate, guard};
use crate::memory::{
    adjust, counted_alloc, counted_free, credit_context, mapped, mem_query, out_ptr,
    release_handle, unmapped,
};
use crate::procaddr;
use crate::real;
use crate::real::real_dlsym;
use crate::state::{Kind, forget_context, note_context, state};
use crate::timing::end;
use crate::um;
use cuda_abi::*;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::Ordering;

/// Every driver function the hook exports and wraps, once: `$m!(names...)` receives the list,
/// so the slots of the real functions and the lookup table of wrappers cannot drift apart.
macro_rules! intercepted {
    ($($m:tt)+) => {
        $($m)+! {
            cuLaunchKernel,
            cuLaunchKernel_ptsz,
            cuLaunchKernelEx,
            cuLaunchKernelEx_ptsz,
            cuLaunchCooperativeKernel,
            cuLaunchCooperativeKernel_ptsz,
            cuGraphLaunch,
            cuGraphLaunch_ptsz,
            cuMemAlloc_v2,
            cuMemAllocPitch_v2,
            cuMemAllocManaged,
            cuMemAllocAsync,
            cuMemAllocAsync_ptsz,
            cuMemAllocFromPoolAsync,
            cuMemAllocFromPoolAsync_ptsz,
            cuMemCreate,
            cuArrayCreate_v2,
            cuArray3DCreate_v2,
            cuMemFree_v2,
            cuMemFreeAsync,
            cuMemFreeAsync_ptsz,
            cuMemRelease,
            cuArrayDestroy,
            cuMemGetInfo_v2,
            cuDeviceTotalMem_v2,
            cuMemMap,
            cuMemUnmap,
            cuCtxDestroy_v2,
            cuCtxSetCurrent,
            cuCtxPushCurrent_v2,
            cuDevicePrimaryCtxRetain,
            cuDevicePrimaryCtxRelease_v2,
            cuDevicePrimaryCtxReset_v2,
            cuGetProcAddress,
            cuGetProcAddress_v2,
        }
    };
}

#[allow(non_upper_case_globals)]
mod r {
    intercepted!(crate::slots);
    crate::slots!(cuDevicePrimaryCtxGetState);
}

type PP = *mut *mut c_void;

// ------------------------------------------------------------------------------ launches

macro_rules! launch_wrapper {
    ($name:ident, $slot:ident) => {
        /// # Safety
        /// The C API's contract: `params`, `extra` are as `cuda.h` documents them for this call;
        /// `f`, `stream` are null or a handle the driver made.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shmem: c_uint,
            stream: CUstream,
            params: PP,
            extra: PP,
        ) -> CUresult {
            let timed = gate(stream);
            let r = real!(
                $slot, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra
            );
            end(timed, r);
            r
        }
    };
}
launch_wrapper!(cuLaunchKernel, cuLaunchKernel);
launch_wrapper!(cuLaunchKernel_ptsz, cuLaunchKernel_ptsz);

macro_rules! coop_wrapper {
    ($name:ident, $slot:ident) => {
        /// # Safety
        /// The C API's contract: `params` is as `cuda.h` documents it for this call; `f`, `stream`
        /// are null or a handle the driver made.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            f: CUfunction,
            gx: c_uint,
            gy: c_uint,
            gz: c_uint,
            bx: c_uint,
            by: c_uint,
            bz: c_uint,
            shmem: c_uint,
            stream: CUstream,
            params: PP,
        ) -> CUresult {
            let timed = gate(stream);
            let r = real!($slot, f, gx, gy, gz, bx, by, bz, shmem, stream, params);
            end(timed, r);
            r
        }
    };
}
coop_wrapper!(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel);
coop_wrapper!(
    cuLaunchCooperativeKernel_ptsz,
    cuLaunchCooperativeKernel_ptsz
);

macro_rules! launch_ex_wrapper {
    ($name:ident, $slot:ident) => {
        /// # Safety
        /// The C API's contract: `config` is null or valid for reads of its type; `params`, `extra`
        /// are as `cuda.h` documents them for this call; `f` is null or a handle the driver made.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            config: *const CUlaunchConfig,
            f: CUfunction,
            params: PP,
            extra: PP,
        ) -> CUresult {
            let timed = if config.is_null() {
                None
            } else {
                // SAFETY: the caller passes a valid CUlaunchConfig (the driver reads it too).
                gate(unsafe { (*config).h_stream })
            };
            let r = real!($slot, config, f, params, extra);
            end(timed, r);
            r
        }
    };
}
launch_ex_wrapper!(cuLaunchKernelEx, cuLaunchKernelEx);
launch_ex_wrapper!(cuLaunchKernelEx_ptsz, cuLaunchKernelEx_ptsz);

/// # Safety
/// The C API's contract: `g`, `stream` are null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(g: CUgraphExec, stream: CUstream) -> CUresult {
    let timed = gate(stream);
    let r = real!(cuGraphLaunch, g, stream);
    end(timed, r);
    r
}

/// # Safety
/// The C API's contract: `g`, `stream` are null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(g: CUgraphExec, stream: CUstream) -> CUresult {
    let timed = gate(stream);
    let r = real!(cuGraphLaunch_ptsz, g, stream);
    end(timed, r);
    r
}

// ------------------------------------------------------------------------------ allocations

/// The context that owns an allocation made now (only asked when the hook is active).
fn owner() -> usize {
    if active() { current_ctx() } else { 0 }
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if um::enabled() {
        // SAFETY: `p` is null or writable (this function's contract), as `um::alloc` requires.
        return unsafe { um::alloc(current_device(), owner(), p, bytes, CU_MEM_ATTACH_GLOBAL) };
    }
    counted_alloc(current_device(), bytes as u64, Kind::Ptr, owner(), || {
        let rc = real!(cuMemAlloc_v2, p, bytes);
        // SAFETY: `p` is null or the caller's writable out-parameter (this function's contract).
        (rc, unsafe { out_ptr(p) })
    })
}

/// # Safety
/// The C API's contract: `p` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    p: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    if um::enabled() {
        // SAFETY: `p` is null or writable (this function's contract), as `um::alloc` requires.
        return unsafe { um::alloc(current_device(), owner(), p, bytes, flags) };
    }
    counted_alloc(current_device(), bytes as u64, Kind::Ptr, owner(), || {
        let rc = real!(cuMemAllocManaged, p, bytes, flags);
        // SAFETY: `p` is null or the caller's writable out-parameter (this function's contract).
        (rc, unsafe { out_ptr(p) })
    })
}

macro_rules! async_wrapper {
    ($name:ident, $slot:ident) => {
        /// # Safety
        /// The C API's contract: `p` is null or valid for writes of its type; `stream` is null or a
        /// handle the driver made.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            p: *mut CUdeviceptr,
            bytes: usize,
            stream: CUstream,
        ) -> CUresult {
            if um::enabled() {
                // Managed memory has no stream-ordered form: allocated now (usable by the
                // stream at once), freed after the stream's work (`um::free_async`).
                // SAFETY: `p` is null or writable (this function's contract), as `um::alloc`
                // requires.
                return unsafe {
                    um::alloc(current_device(), owner(), p, bytes, CU_MEM_ATTACH_GLOBAL)
                };
            }
            // Stream-ordered memory belongs to the device's pool, not to a context.
            counted_alloc(current_device(), bytes as u64, Kind::Ptr, 0, || {
                let rc = real!($slot, p, bytes, stream);
                // SAFETY: `p` is null or the caller's writable out-parameter (this function's contract).
                (rc, unsafe { out_ptr(p) })
            })
        }
    };
}
async_wrapper!(cuMemAllocAsync, cuMemAllocAsync);
async_wrapper!(cuMemAllocAsync_ptsz, cuMemAllocAsync_ptsz);

macro_rules! pool_wrapper {
    ($name:ident, $slot:ident) => {
        /// # Safety
        /// The C API's contract: `p` is null or valid for writes of its type; `pool`, `stream` are
        /// null or a handle the driver made.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            p: *mut CUdeviceptr,
            bytes: usize,
            pool: CUmemoryPool,
            stream: CUstream,
        ) -> CUresult {
            if um::enabled() {
                // Managed memory has no stream-ordered form: allocated now (usable by the
                // stream at once), freed after the stream's work (`um::free_async`).
                // SAFETY: `p` is null or writable (this function's contract), as `um::alloc`
                // requires.
                return unsafe {
                    um::alloc(current_device(), owner(), p, bytes, CU_MEM_ATTACH_GLOBAL)
                };
            }
            // Stream-ordered memory belongs to the device's pool, not to a context.
            counted_alloc(current_device(), bytes as u64, Kind::Ptr, 0, || {
                let rc = real!($slot, p, bytes, pool, stream);
                // SAFETY: `p` is null or the caller's writable out-parameter (this function's contract).
                (rc, unsafe { out_ptr(p) })
            })
        }
    };
}
pool_wrapper!(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync);
pool_wrapper!(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync_ptsz);

/// # Safety
/// The C API's contract: `p`, `pitch` are null or valid for writes of their types.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    p: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> CUresult {
    if um::enabled() {
        // SAFETY: `p` and `pitch` are null or writable (this function's contract), as
        // `um::alloc_pitch` requires.
        return unsafe { um::alloc_pitch(current_device(), owner(), p, pitch, width, height) };
    }
    let call = || real!(cuMemAllocPitch_v2, p, pitch, width, height, elem);
    let Some(dev) = current_device().filter(|_| active()) else {
        return call();
    };
    // The pitch is the driver's choice: reserve an estimate, then settle on the real size.
    let estimate = (pitch_for(width) as u64).saturating_mul(height as u64);
    let mut made = None;
    let rc = counted_alloc(Some(dev), estimate, Kind::Ptr, owner(), || {
        let rc = call();
        if rc == CUDA_SUCCESS && !pitch.is_null() {
            // SAFETY: `pitch` is non-null (checked) and was just written by the driver; `p` is
            // null or writable (this function's contract).
            made = Some(unsafe { (out_ptr(p), *pitch) });
        }
        // SAFETY: `p` is null or the caller's writable out-parameter (this function's contract).
        (rc, unsafe { out_ptr(p) })
    });
    if let Some((ptr, pt)) = made {
        let actual = (pt as u64).saturating_mul(height as u64);
        if !guard(true, || adjust(ptr, dev, estimate, actual)) {
            // SAFETY: the caller's own arguments, under the same contract as `cuMemFree_v2`'s.
            let _ = unsafe { cuMemFree_v2(ptr) };
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    rc
}

/// # Safety
/// The C API's contract: `h` is null or valid for writes of its type; `prop` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    h: *mut CUmemGenericAllocationHandle,
    bytes: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    if um::enabled() {
        return um::refuse(
            "cuMemCreate (virtual memory management)",
            "it allocates physical device memory, which cannot be made managed",
        );
    }
    // Only device memory counts; host-located (pinned) allocations pass.
    let dev = if prop.is_null() {
        None
    } else {
        // SAFETY: non-null (checked) and a valid `CUmemAllocationProp` (this function's
        // contract; the driver reads it too).
        let pr = unsafe { &*prop };
        if pr.location_type == CU_MEM_LOCATION_TYPE_DEVICE {
            device_index(pr.location_id)
        } else {
            None
        }
    };
    counted_alloc(dev, bytes as u64, Kind::Handle, 0, || {
        let rc = real!(cuMemCreate, h, bytes, prop, flags);
        // SAFETY: non-null (checked) and writable (this function's contract); the driver wrote
        // the handle on success.
        (rc, if h.is_null() { 0 } else { unsafe { *h } })
    })
}

/// # Safety
/// The C API's contract: `a` is null or valid for writes of its type; `d` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    a: *mut CUarray,
    d: *const CudaArrayDescriptor,
) -> CUresult {
    let bytes = if d.is_null() {
        0
    } else {
        // SAFETY: non-null (checked) and a valid descriptor (this function's contract; the
        // driver reads it too).
        let d = unsafe { &*d };
        d.bytes()
    };
    counted_alloc(current_device(), bytes, Kind::Array, owner(), || {
        let rc = real!(cuArrayCreate_v2, a, d);
        // SAFETY: non-null (checked) and writable (this function's contract).
        (rc, if a.is_null() { 0 } else { unsafe { *a as u64 } })
    })
}

/// # Safety
/// The C API's contract: `a` is null or valid for writes of its type; `d` is null or valid for
/// reads of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    a: *mut CUarray,
    d: *const CudaArray3dDescriptor,
) -> CUresult {
    let bytes = if d.is_null() {
        0
    } else {
        // SAFETY: non-null (checked) and a valid descriptor (this function's contract; the
        // driver reads it too).
        let d = unsafe { &*d };
        d.bytes()
    };
    counted_alloc(current_device(), bytes, Kind::Array, owner(), || {
        let rc = real!(cuArray3DCreate_v2, a, d);
        // SAFETY: non-null (checked) and writable (this function's contract).
        (rc, if a.is_null() { 0 } else { unsafe { *a as u64 } })
    })
}

// ------------------------------------------------------------------------------ frees

/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(p: CUdeviceptr) -> CUresult {
    if um::enabled() {
        return um::free(p, || real!(cuMemFree_v2, p));
    }
    counted_free(Kind::Ptr, p, || real!(cuMemFree_v2, p))
}

/// # Safety
/// The C API's contract: `stream` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(p: CUdeviceptr, stream: CUstream) -> CUresult {
    if um::enabled()
        && let Some(rc) = um::free_async(p, stream, || real!(cuMemFree_v2, p))
    {
        return rc;
    }
    counted_free(Kind::Ptr, p, || real!(cuMemFreeAsync, p, stream))
}

/// # Safety
/// The C API's contract: `stream` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(p: CUdeviceptr, stream: CUstream) -> CUresult {
    if um::enabled()
        && let Some(rc) = um::free_async(p, stream, || real!(cuMemFree_v2, p))
    {
        return rc;
    }
    counted_free(Kind::Ptr, p, || real!(cuMemFreeAsync_ptsz, p, stream))
}

/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult {
    release_handle(h, || real!(cuMemRelease, h))
}

// ------------------------------------------------------------------------------ VMM mappings

/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    va: CUdeviceptr,
    size: usize,
    offset: usize,
    h: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let rc = real!(cuMemMap, va, size, offset, h, flags);
    if rc == CUDA_SUCCESS {
        guard((), || mapped(va, size as u64, h));
    }
    rc
}

/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(va: CUdeviceptr, size: usize) -> CUresult {
    let rc = real!(cuMemUnmap, va, size);
    if rc == CUDA_SUCCESS {
        guard((), || unmapped(va, size as u64));
    }
    rc
}

// ------------------------------------------------------------------------------ contexts

/// Destroying a context frees the memory it owns.
///
/// # Safety
/// The C API's contract: `ctx` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let rc = real!(cuCtxDestroy_v2, ctx);
    if rc == CUDA_SUCCESS && active() {
        guard((), || {
            forget_context(ctx as usize);
            credit_context(ctx as usize)
        });
    }
    rc
}

/// Contexts made current are drained at hand-overs.
///
/// # Safety
/// The C API's contract: `ctx` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    let rc = real!(cuCtxSetCurrent, ctx);
    if rc == CUDA_SUCCESS && active() {
        note_context(ctx);
    }
    rc
}

/// # Safety
/// The C API's contract: `ctx` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    let rc = real!(cuCtxPushCurrent_v2, ctx);
    if rc == CUDA_SUCCESS && active() {
        note_context(ctx);
    }
    rc
}

/// # Safety
/// The C API's contract: `ctx` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let rc = real!(cuDevicePrimaryCtxRetain, ctx, dev);
    if rc == CUDA_SUCCESS
        && active()
        && !ctx.is_null()
        && let Some(d) = device_index(dev)
    {
        // SAFETY: non-null (checked) and writable (this function's contract), and the driver
        // just wrote it.
        let c = unsafe { *ctx };
        state().primary[d].store(c as usize, Ordering::Release);
        note_context(c);
    }
    rc
}

/// The primary context of `dev` as last retained (0: never seen).
fn primary_of(dev: CUdevice) -> usize {
    device_index(dev).map_or(0, |d| state().primary[d].load(Ordering::Acquire))
}

/// The last release destroys the primary context, and its memory with it.
///
/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let rc = real!(cuDevicePrimaryCtxRelease_v2, dev);
    if rc == CUDA_SUCCESS && active() {
        let (mut flags, mut on): (c_uint, c_int) = (0, 1);
        let st = real!(cuDevicePrimaryCtxGetState, dev, &mut flags, &mut on);
        if st == CUDA_SUCCESS && on == 0 {
            let c = primary_of(dev);
            guard((), || {
                forget_context(c);
                credit_context(c)
            });
        }
    }
    rc
}

/// A reset frees every allocation of the primary context.
///
/// # Safety
/// None beyond the C API's: no argument is dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let rc = real!(cuDevicePrimaryCtxReset_v2, dev);
    if rc == CUDA_SUCCESS && active() {
        let c = primary_of(dev);
        guard((), || credit_context(c));
    }
    rc
}

/// # Safety
/// The C API's contract: `a` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(a: CUarray) -> CUresult {
    counted_free(Kind::Array, a as u64, || real!(cuArrayDestroy, a))
}

// ------------------------------------------------------------------------------ memory info

/// free = cap − pod's use, total = cap (never more than the device really has).
///
/// # Safety
/// The C API's contract: `free`, `total` are null or valid for writes of their types.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let rc = real!(cuMemGetInfo_v2, free, total);
    if rc != CUDA_SUCCESS || !active() {
        return rc;
    }
    if let Some((used, limit)) = current_device().and_then(|d| guard(None, || mem_query(d))) {
        // SAFETY: each pointer is checked non-null and is writable (this function's contract);
        // the driver just wrote them.
        unsafe {
            if !free.is_null() {
                *free = (*free).min(limit.saturating_sub(used) as usize);
            }
            if !total.is_null() {
                *total = (*total).min(limit as usize);
            }
        }
    }
    rc
}

/// # Safety
/// The C API's contract: `bytes` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let rc = real!(cuDeviceTotalMem_v2, bytes, dev);
    if rc != CUDA_SUCCESS || !active() || bytes.is_null() {
        return rc;
    }
    if let Some((_, limit)) = device_index(dev).and_then(|d| guard(None, || mem_query(d))) {
        // SAFETY: non-null (checked) and writable (this function's contract); the driver just
        // wrote it.
        unsafe { *bytes = (*bytes).min(limit as usize) };
    }
    rc
}

// ------------------------------------------------------------------------------ lookups

/// The hook's function for an exported driver name it wraps.
pub fn wrapper(name: &str) -> Option<*mut c_void> {
    macro_rules! table {
        ($($f:ident),* $(,)?) => {
            match name {
                $(stringify!($f) => Some($f as *const () as *mut c_void),)*
                _ => None,
            }
        };
    }
    intercepted!(table)
}

/// Replaces the driver's answer to a `cuGetProcAddress` request by the hook's wrapper of the
/// same variant.
///
/// # Safety
/// `symbol` is null or NUL-terminated; `pfn` is null or valid for reads and writes.
unsafe fn substitute(
    rc: CUresult,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    if rc != CUDA_SUCCESS
        || symbol.is_null()
        || pfn.is_null()
        // SAFETY: `pfn` is non-null (checked just before) and readable (the contract of
        // `substitute`).
        || unsafe { (*pfn).is_null() }
        || !active()
    {
        return rc;
    }
    // SAFETY: `symbol` is non-null (checked) and NUL-terminated (the contract of `substitute`).
    let Ok(name) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
        return rc;
    };
    if let Some(w) = procaddr::variant(name, version, flags).and_then(wrapper) {
        // SAFETY: `pfn` is non-null (checked) and writable (the contract of `substitute`).
        unsafe { *pfn = w };
    }
    rc
}

/// CUDA 11.3–11.8 ABI.
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
    let rc = real!(cuGetProcAddress, symbol, pfn, version, flags);
    // SAFETY: the caller's own arguments, which the driver has just used under the same
    // contract.
    unsafe { substitute(rc, symbol, pfn, version, flags) }
}

/// CUDA 12+ ABI (with the query result).
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
    let rc = real!(cuGetProcAddress_v2, symbol, pfn, version, flags, status);
    // SAFETY: the caller's own arguments, which the driver has just used under the same
    // contract.
    unsafe { substitute(rc, symbol, pfn, version, flags) }
}

/// `dlsym`: the real answer, except that a driver function the hook wraps is answered with the
/// wrapper (only when the real lookup finds the name, so a missing symbol stays missing).
///
/// Known limit, shared with every dlsym-hooking library: `dlsym(RTLD_NEXT, …)` called by
/// another library is resolved relative to this one.
///
/// # Safety
/// `dlsym`'s contract: `handle` is a handle from `dlopen` or a pseudo-handle, `symbol` a
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real_fn) = real_dlsym() else {
        return std::ptr::null_mut();
    };
    // SAFETY: glibc's `dlsym` with the caller's own arguments, under the same contract.
    let p = unsafe { real_fn(handle, symbol) };
    // Cheap test first: names not starting with "cu" or "nv" never touch any hook state.
    if p.is_null() || symbol.is_null() {
        return p;
    }
    // SAFETY: `symbol` is non-null (checked) and NUL-terminated (`dlsym`'s contract), and the
    // real `dlsym` found it, so it has at least one character before the NUL: the second byte
    // is in bounds (the NUL itself for a one-letter name).
    let (a, b) = unsafe { (*symbol as u8, *symbol.add(1) as u8) };
    if !matches!((a, b), (b'c', b'u') | (b'n', b'v')) {
        return p;
    }
    if !active() {
        return p;
    }
    // SAFETY: non-null (checked) and NUL-terminated (`dlsym`'s contract).
    let Ok(name) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
        return p;
    };
    if a == b'n' {
        return crate::nvml::wrapper(name).unwrap_or(p);
    }
    wrapper(name).unwrap_or(p)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_wrapped_name_has_a_wrapper() {
        for n in crate::procaddr::WRAPPED {
            assert!(super::wrapper(n).is_some(), "{n}");
        }
        assert!(super::wrapper("cuMemcpyHtoD_v2").is_none());
    }
}
