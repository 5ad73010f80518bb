//! The fake driver's streams, events and kernel launches: each launch queues a kernel of the
//! duration its arguments name on the device's simulated queue (or nothing, with
//! `FAKE_CUDA_NOOP_LAUNCH=1`); synchronisation calls wait on that queue.

use crate::convention::kernel_duration_us;
use crate::engine::{Event, Job};
use crate::{Stream, current_dev, device, driver, enqueue, put, stream_dev};
use cuda_abi::*;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

// ---------------------------------------------------------------- streams and events

/// # Safety
/// The C API's contract: `s` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(s: *mut CUstream, _flags: c_uint) -> CUresult {
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let b = Box::into_raw(Box::new(Stream {
        dev,
        last: AtomicU64::new(0),
    }));
    // SAFETY: `s` is null or writable (this function's contract); `put` checks null.
    unsafe { put(s, b as CUstream) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(_s: CUstream) -> CUresult {
    // Leaked on purpose: work queued on it may still reference its device.
    CUDA_SUCCESS
}

fn stream_target(s: CUstream) -> Option<(usize, u64)> {
    let dev = stream_dev(s)?;
    let seq = if (s as usize) <= 2 {
        driver().devices[dev].submitted()
    } else {
        // SAFETY: above the special handles 0-2: a `Box<Stream>` `cuStreamCreate` leaked.
        unsafe { (*(s as *const Stream)).last.load(Ordering::Acquire) }
    };
    Some((dev, seq))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    match stream_target(s) {
        Some((dev, seq)) => {
            driver().devices[dev].wait_for(seq);
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize_ptsz(s: CUstream) -> CUresult {
    cuStreamSynchronize(s)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    match stream_target(s) {
        Some((dev, seq)) if driver().devices[dev].completed() >= seq => CUDA_SUCCESS,
        Some(_) => CUDA_ERROR_NOT_READY,
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

/// # Safety
/// The C API's contract: `status` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(_s: CUstream, status: *mut c_int) -> CUresult {
    // SAFETY: `status` is null or writable (this function's contract); `put` checks null.
    unsafe { put(status, 0) }
}

/// # Safety
/// The C API's contract: `mode` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    if mode.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUDA_SUCCESS
}

/// # Safety
/// The C API's contract: `e` is null or valid for writes of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(e: *mut CUevent, _flags: c_uint) -> CUresult {
    let ev = Arc::new(Event::default());
    // SAFETY: `e` is null or writable (this function's contract); `put` checks null.
    unsafe { put(e, Arc::into_raw(ev) as CUevent) }
}

/// # Safety
/// The C API's contract: `e` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    if e.is_null() {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // SAFETY: non-null, so (this function's contract) the `Arc::into_raw` of `cuEventCreate`,
    // destroyed once; queued markers hold their own clones.
    drop(unsafe { Arc::from_raw(e as *const Event) });
    CUDA_SUCCESS
}

/// The event behind a handle (`None` for null).
///
/// # Safety
/// `e` is null or a live handle from `cuEventCreate` (not yet destroyed), and the reference
/// is not kept past its destruction.
unsafe fn event<'a>(e: CUevent) -> Option<&'a Event> {
    if e.is_null() {
        None
    } else {
        // SAFETY: non-null: an `Arc<Event>` leaked by `cuEventCreate` and not yet destroyed
        // (this function's contract), which `'a` must not outlive.
        Some(unsafe { &*(e as *const Event) })
    }
}

/// # Safety
/// The C API's contract: `e`, `s` are null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    if e.is_null() {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // SAFETY: non-null (checked), so by this function's contract the live `Arc::into_raw` of
    // `cuEventCreate`: the count is raised first, so the new `Arc` (the queue's) owns its own.
    let ev = unsafe {
        Arc::increment_strong_count(e as *const Event);
        Arc::from_raw(e as *const Event)
    };
    let generation = ev.arm();
    enqueue(s, Job::Marker(ev, generation))
}

/// # Safety
/// The C API's contract: `e`, `s` are null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord_ptsz(e: CUevent, s: CUstream) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuEventRecord`'s.
    unsafe { cuEventRecord(e, s) }
}

/// # Safety
/// The C API's contract: `e` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    // SAFETY: `e` is null or a live event (this function's contract), as `event` requires.
    match unsafe { event(e) } {
        Some(ev) => {
            ev.wait();
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

/// # Safety
/// The C API's contract: `e` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    // SAFETY: `e` is null or a live event (this function's contract), as `event` requires.
    match unsafe { event(e) } {
        Some(ev) if ev.done_at().is_some() || !ev.armed() => CUDA_SUCCESS,
        Some(_) => CUDA_ERROR_NOT_READY,
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

/// # Safety
/// The C API's contract: `ms` is null or valid for writes of its type; `start`, `end` are null or a
/// handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    // SAFETY: both are null or live events (this function's contract), as `event` requires.
    let (Some(a), Some(b)) = (unsafe { event(start) }, unsafe { event(end) }) else {
        return CUDA_ERROR_INVALID_HANDLE;
    };
    match (a.done_at(), b.done_at()) {
        // SAFETY: `ms` is null or writable (this function's contract); `put` checks null.
        (Some(ta), Some(tb)) => unsafe { put(ms, tb.saturating_sub(ta) as f32 / 1e6) },
        _ => CUDA_ERROR_NOT_READY,
    }
}

// ---------------------------------------------------------------- launches

pub(crate) fn launch(s: CUstream, dur_us: u64) -> CUresult {
    if driver().noop_launch {
        return CUDA_SUCCESS;
    }
    enqueue(s, Job::Kernel(dur_us))
}

/// # Safety
/// The C API's contract: `params` is as `cuda.h` documents it for this call; `s` is null or a
/// handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
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
    // SAFETY: `params` follows the fake's kernel convention (the workload's contract with the
    // fake).
    launch(s, unsafe { kernel_duration_us(params) })
}

/// # Safety
/// The C API's contract: `params`, `extra` are as `cuda.h` documents them for this call; `f`, `s`
/// are null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel_ptsz(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuLaunchKernel`'s.
    unsafe { cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra) }
}

/// # Safety
/// The C API's contract: `params` is as `cuda.h` documents it for this call; `f`, `s` are null or a
/// handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuLaunchKernel`'s.
    unsafe {
        cuLaunchKernel(
            f,
            gx,
            gy,
            gz,
            bx,
            by,
            bz,
            shmem,
            s,
            params,
            std::ptr::null_mut(),
        )
    }
}

/// # Safety
/// The C API's contract: `params` is as `cuda.h` documents it for this call; `f`, `s` are null or a
/// handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchCooperativeKernel_ptsz(
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuLaunchCooperativeKernel`'s.
    unsafe { cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params) }
}

/// # Safety
/// The C API's contract: `config` is null or valid for reads of its type; `params` is as `cuda.h`
/// documents it for this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    _f: CUfunction,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    if config.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null (checked) and pointing to a valid `CUlaunchConfig` (this function's
    // contract).
    let s = unsafe { (*config).h_stream };
    // SAFETY: `params` follows the fake's kernel convention (the workload's contract with the
    // fake).
    launch(s, unsafe { kernel_duration_us(params) })
}

/// # Safety
/// The C API's contract: `config` is null or valid for reads of its type; `params`, `extra` are as
/// `cuda.h` documents them for this call; `f` is null or a handle the driver made.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the caller's own arguments, under the same contract as `cuLaunchKernelEx`'s.
    unsafe { cuLaunchKernelEx(config, f, params, extra) }
}

/// The fake's graph convention: a `CUgraphExec` handle's numeric value is the duration, in
/// microseconds, of the work one replay runs.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(g: CUgraphExec, s: CUstream) -> CUresult {
    launch(s, g as u64)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch_ptsz(g: CUgraphExec, s: CUstream) -> CUresult {
    cuGraphLaunch(g, s)
}

/// Kernel time, in microseconds, that device `dev` has executed for this process.
#[unsafe(no_mangle)]
pub extern "C" fn fakeCudaBusyMicros(dev: CUdevice) -> u64 {
    device(dev).map(|d| d.busy_us()).unwrap_or(0)
}
