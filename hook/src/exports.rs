//! The functions libgemhook exports: driver entry points that shadow libcuda's (LD_PRELOAD
//! interposition), `dlsym` (so `dlsym(libcuda, "cuLaunchKernelEx")` finds the wrapper), and
//! `cuGetProcAddress` / `cuGetProcAddress_v2` (the CUDA 11.3+ runtime's way in), which hand out
//! the wrapper of the exact ABI variant the caller's version selects, themselves included.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::config::active;
use crate::cuda::*;
use crate::device::{current_ctx, current_device, device_index, gate, guard};
use crate::memory::{
    adjust, counted_alloc, counted_free, credit_context, mapped, mem_query, release_handle,
    unmapped,
};
use crate::procaddr;
use crate::real;
use crate::real::real_dlsym;
use crate::state::{Kind, forget_context, note_context, state};
use crate::timing::end;
use crate::um;
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

type Cu = CUresult;
type PP = *mut *mut c_void;
type FnLaunch = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    PP,
    PP,
) -> Cu;
type FnCoop = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    PP,
) -> Cu;
type FnLaunchEx = unsafe extern "C" fn(*const CUlaunchConfig, CUfunction, PP, PP) -> Cu;
type FnGraph = unsafe extern "C" fn(CUgraphExec, CUstream) -> Cu;
type FnAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> Cu;
type FnPitch = unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> Cu;
type FnManaged = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> Cu;
type FnAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> Cu;
type FnPool = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> Cu;
type FnCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> Cu;
type FnArray = unsafe extern "C" fn(*mut CUarray, *const CudaArrayDescriptor) -> Cu;
type FnArray3d = unsafe extern "C" fn(*mut CUarray, *const CudaArray3dDescriptor) -> Cu;
type FnFree = unsafe extern "C" fn(CUdeviceptr) -> Cu;
type FnFreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> Cu;
type FnRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> Cu;
type FnArrayDestroy = unsafe extern "C" fn(CUarray) -> Cu;
type FnMemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> Cu;
type FnTotalMem = unsafe extern "C" fn(*mut usize, CUdevice) -> Cu;
type FnMap =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> Cu;
type FnUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> Cu;
type FnCtx = unsafe extern "C" fn(CUcontext) -> Cu;
type FnRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> Cu;
type FnDev = unsafe extern "C" fn(CUdevice) -> Cu;
type FnPrimaryState = unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> Cu;
type FnGpa = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> Cu;
type FnGpa2 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> Cu;

// ------------------------------------------------------------------------------ launches

macro_rules! launch_wrapper {
    ($name:ident, $slot:ident) => {
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
                r::$slot,
                FnLaunch,
                f,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                shmem,
                stream,
                params,
                extra
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
            let r = real!(
                r::$slot,
                FnCoop,
                f,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                shmem,
                stream,
                params
            );
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
            let r = real!(r::$slot, FnLaunchEx, config, f, params, extra);
            end(timed, r);
            r
        }
    };
}
launch_ex_wrapper!(cuLaunchKernelEx, cuLaunchKernelEx);
launch_ex_wrapper!(cuLaunchKernelEx_ptsz, cuLaunchKernelEx_ptsz);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(g: CUgraphExec, stream: CUstream) -> CUresult {
    let timed = gate(stream);
    let r = real!(r::cuGraphLaunch, FnGraph, g, stream);
    end(timed, r);
    r
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(g: CUgraphExec, stream: CUstream) -> CUresult {
    let timed = gate(stream);
    let r = real!(r::cuGraphLaunch_ptsz, FnGraph, g, stream);
    end(timed, r);
    r
}

// ------------------------------------------------------------------------------ allocations

/// The context that owns an allocation made now (only asked when the hook is active).
fn owner() -> usize {
    if active() { current_ctx() } else { 0 }
}

unsafe fn out_ptr(p: *mut CUdeviceptr) -> u64 {
    if p.is_null() { 0 } else { unsafe { *p } }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if um::enabled() {
        return unsafe { um::alloc(current_device(), owner(), p, bytes, um::MEM_ATTACH_GLOBAL) };
    }
    counted_alloc(current_device(), bytes as u64, Kind::Ptr, owner(), || {
        let rc = real!(r::cuMemAlloc_v2, FnAlloc, p, bytes);
        (rc, unsafe { out_ptr(p) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    p: *mut CUdeviceptr,
    bytes: usize,
    flags: c_uint,
) -> CUresult {
    if um::enabled() {
        return unsafe { um::alloc(current_device(), owner(), p, bytes, flags) };
    }
    counted_alloc(current_device(), bytes as u64, Kind::Ptr, owner(), || {
        let rc = real!(r::cuMemAllocManaged, FnManaged, p, bytes, flags);
        (rc, unsafe { out_ptr(p) })
    })
}

macro_rules! async_wrapper {
    ($name:ident, $slot:ident) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            p: *mut CUdeviceptr,
            bytes: usize,
            stream: CUstream,
        ) -> CUresult {
            if um::enabled() {
                // Managed memory has no stream-ordered form: allocated now (usable by the
                // stream at once), freed after the stream's work (`um::free_async`).
                return unsafe {
                    um::alloc(current_device(), owner(), p, bytes, um::MEM_ATTACH_GLOBAL)
                };
            }
            // Stream-ordered memory belongs to the device's pool, not to a context.
            counted_alloc(current_device(), bytes as u64, Kind::Ptr, 0, || {
                let rc = real!(r::$slot, FnAsync, p, bytes, stream);
                (rc, unsafe { out_ptr(p) })
            })
        }
    };
}
async_wrapper!(cuMemAllocAsync, cuMemAllocAsync);
async_wrapper!(cuMemAllocAsync_ptsz, cuMemAllocAsync_ptsz);

macro_rules! pool_wrapper {
    ($name:ident, $slot:ident) => {
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
                return unsafe {
                    um::alloc(current_device(), owner(), p, bytes, um::MEM_ATTACH_GLOBAL)
                };
            }
            // Stream-ordered memory belongs to the device's pool, not to a context.
            counted_alloc(current_device(), bytes as u64, Kind::Ptr, 0, || {
                let rc = real!(r::$slot, FnPool, p, bytes, pool, stream);
                (rc, unsafe { out_ptr(p) })
            })
        }
    };
}
pool_wrapper!(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync);
pool_wrapper!(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync_ptsz);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    p: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> CUresult {
    if um::enabled() {
        return unsafe { um::alloc_pitch(current_device(), owner(), p, pitch, width, height) };
    }
    let call = || {
        real!(
            r::cuMemAllocPitch_v2,
            FnPitch,
            p,
            pitch,
            width,
            height,
            elem
        )
    };
    let Some(dev) = current_device().filter(|_| active()) else {
        return call();
    };
    // The pitch is the driver's choice: reserve an estimate, then settle on the real size.
    let estimate = pitch_estimate(width, height);
    let mut made = None;
    let rc = counted_alloc(Some(dev), estimate, Kind::Ptr, owner(), || {
        let rc = call();
        if rc == CUDA_SUCCESS && !pitch.is_null() {
            made = Some(unsafe { (out_ptr(p), *pitch) });
        }
        (rc, unsafe { out_ptr(p) })
    });
    if let Some((ptr, pt)) = made {
        let actual = (pt as u64).saturating_mul(height as u64);
        if !guard(true, || adjust(ptr, dev, estimate, actual)) {
            let _ = unsafe { cuMemFree_v2(ptr) };
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    rc
}

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
        let pr = unsafe { &*prop };
        if pr.location_type == MEM_LOCATION_DEVICE {
            device_index(pr.location_id)
        } else {
            None
        }
    };
    counted_alloc(dev, bytes as u64, Kind::Handle, 0, || {
        let rc = real!(r::cuMemCreate, FnCreate, h, bytes, prop, flags);
        (rc, if h.is_null() { 0 } else { unsafe { *h } })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    a: *mut CUarray,
    d: *const CudaArrayDescriptor,
) -> CUresult {
    let bytes = if d.is_null() {
        0
    } else {
        let d = unsafe { &*d };
        array_bytes(d.width, d.height, 1, d.format, d.num_channels)
    };
    counted_alloc(current_device(), bytes, Kind::Array, owner(), || {
        let rc = real!(r::cuArrayCreate_v2, FnArray, a, d);
        (rc, if a.is_null() { 0 } else { unsafe { *a as u64 } })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    a: *mut CUarray,
    d: *const CudaArray3dDescriptor,
) -> CUresult {
    let bytes = if d.is_null() {
        0
    } else {
        let d = unsafe { &*d };
        array_bytes(d.width, d.height, d.depth, d.format, d.num_channels)
    };
    counted_alloc(current_device(), bytes, Kind::Array, owner(), || {
        let rc = real!(r::cuArray3DCreate_v2, FnArray3d, a, d);
        (rc, if a.is_null() { 0 } else { unsafe { *a as u64 } })
    })
}

// ------------------------------------------------------------------------------ frees

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(p: CUdeviceptr) -> CUresult {
    if um::enabled() {
        return um::free(p, || real!(r::cuMemFree_v2, FnFree, p));
    }
    counted_free(Kind::Ptr, p, || real!(r::cuMemFree_v2, FnFree, p))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(p: CUdeviceptr, stream: CUstream) -> CUresult {
    if um::enabled()
        && let Some(rc) = um::free_async(p, stream, || real!(r::cuMemFree_v2, FnFree, p))
    {
        return rc;
    }
    counted_free(Kind::Ptr, p, || {
        real!(r::cuMemFreeAsync, FnFreeAsync, p, stream)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(p: CUdeviceptr, stream: CUstream) -> CUresult {
    if um::enabled()
        && let Some(rc) = um::free_async(p, stream, || real!(r::cuMemFree_v2, FnFree, p))
    {
        return rc;
    }
    counted_free(Kind::Ptr, p, || {
        real!(r::cuMemFreeAsync_ptsz, FnFreeAsync, p, stream)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult {
    release_handle(h, || real!(r::cuMemRelease, FnRelease, h))
}

// ------------------------------------------------------------------------------ VMM mappings

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    va: CUdeviceptr,
    size: usize,
    offset: usize,
    h: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let rc = real!(r::cuMemMap, FnMap, va, size, offset, h, flags);
    if rc == CUDA_SUCCESS {
        guard((), || mapped(va, size as u64, h));
    }
    rc
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(va: CUdeviceptr, size: usize) -> CUresult {
    let rc = real!(r::cuMemUnmap, FnUnmap, va, size);
    if rc == CUDA_SUCCESS {
        guard((), || unmapped(va, size as u64));
    }
    rc
}

// ------------------------------------------------------------------------------ contexts

/// Destroying a context frees the memory it owns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    let rc = real!(r::cuCtxDestroy_v2, FnCtx, ctx);
    if rc == CUDA_SUCCESS && active() {
        guard((), || {
            forget_context(ctx as usize);
            credit_context(ctx as usize)
        });
    }
    rc
}

/// Contexts made current are drained at hand-overs.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    let rc = real!(r::cuCtxSetCurrent, FnCtx, ctx);
    if rc == CUDA_SUCCESS && active() {
        note_context(ctx);
    }
    rc
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    let rc = real!(r::cuCtxPushCurrent_v2, FnCtx, ctx);
    if rc == CUDA_SUCCESS && active() {
        note_context(ctx);
    }
    rc
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let rc = real!(r::cuDevicePrimaryCtxRetain, FnRetain, ctx, dev);
    if rc == CUDA_SUCCESS
        && active()
        && !ctx.is_null()
        && let Some(d) = device_index(dev)
    {
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
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    let rc = real!(r::cuDevicePrimaryCtxRelease_v2, FnDev, dev);
    if rc == CUDA_SUCCESS && active() {
        let (mut flags, mut on): (c_uint, c_int) = (0, 1);
        let st = real!(
            r::cuDevicePrimaryCtxGetState,
            FnPrimaryState,
            dev,
            &mut flags,
            &mut on
        );
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
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    let rc = real!(r::cuDevicePrimaryCtxReset_v2, FnDev, dev);
    if rc == CUDA_SUCCESS && active() {
        let c = primary_of(dev);
        guard((), || credit_context(c));
    }
    rc
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuArrayDestroy(a: CUarray) -> CUresult {
    counted_free(Kind::Array, a as u64, || {
        real!(r::cuArrayDestroy, FnArrayDestroy, a)
    })
}

// ------------------------------------------------------------------------------ memory info

/// free = cap − pod's use, total = cap (never more than the device really has).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let rc = real!(r::cuMemGetInfo_v2, FnMemInfo, free, total);
    if rc != CUDA_SUCCESS || !active() {
        return rc;
    }
    if let Some((used, limit)) = current_device().and_then(|d| guard(None, || mem_query(d))) {
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let rc = real!(r::cuDeviceTotalMem_v2, FnTotalMem, bytes, dev);
    if rc != CUDA_SUCCESS || !active() || bytes.is_null() {
        return rc;
    }
    if let Some((_, limit)) = device_index(dev).and_then(|d| guard(None, || mem_query(d))) {
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
        || unsafe { (*pfn).is_null() }
        || !active()
    {
        return rc;
    }
    let Ok(name) = unsafe { CStr::from_ptr(symbol) }.to_str() else {
        return rc;
    };
    if let Some(w) = procaddr::variant(name, version, flags).and_then(wrapper) {
        unsafe { *pfn = w };
    }
    rc
}

/// CUDA 11.3–11.8 ABI.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    let rc = real!(r::cuGetProcAddress, FnGpa, symbol, pfn, version, flags);
    unsafe { substitute(rc, symbol, pfn, version, flags) }
}

/// CUDA 12+ ABI (with the query result).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> CUresult {
    let rc = real!(
        r::cuGetProcAddress_v2,
        FnGpa2,
        symbol,
        pfn,
        version,
        flags,
        status
    );
    unsafe { substitute(rc, symbol, pfn, version, flags) }
}

/// `dlsym`: the real answer, except that a driver function the hook wraps is answered with the
/// wrapper (only when the real lookup finds the name, so a missing symbol stays missing).
///
/// Known limit, shared with every dlsym-hooking library: `dlsym(RTLD_NEXT, …)` called by
/// another library is resolved relative to this one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real_fn) = real_dlsym() else {
        return std::ptr::null_mut();
    };
    let p = unsafe { real_fn(handle, symbol) };
    // Cheap test first: names not starting with "cu" or "nv" never touch any hook state.
    if p.is_null() || symbol.is_null() {
        return p;
    }
    let (a, b) = unsafe { (*symbol as u8, *symbol.add(1) as u8) };
    if !matches!((a, b), (b'c', b'u') | (b'n', b'v')) {
        return p;
    }
    if !active() {
        return p;
    }
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
