//! The fake driver's streams, events and kernel launches: each launch queues a kernel of the
//! duration its arguments name on the device's simulated queue (or nothing, with
//! `FAKE_CUDA_NOOP_LAUNCH=1`); synchronisation calls wait on that queue.
#![allow(clippy::missing_safety_doc)]

use crate::abi::*;
use crate::engine::{Event, Job};
use crate::{Stream, current_dev, device, driver, enqueue, put, stream_dev};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

// ---------------------------------------------------------------- streams and events

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(s: *mut CUstream, _flags: c_uint) -> CUresult {
    let Some(dev) = current_dev() else {
        return CUDA_ERROR_INVALID_CONTEXT;
    };
    let b = Box::into_raw(Box::new(Stream {
        dev,
        last: AtomicU64::new(0),
    }));
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
        // SAFETY: a `Box<Stream>` from cuStreamCreate.
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(_s: CUstream, status: *mut c_int) -> CUresult {
    unsafe { put(status, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_int) -> CUresult {
    if mode.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(e: *mut CUevent, _flags: c_uint) -> CUresult {
    let ev = Arc::new(Event::default());
    unsafe { put(e, Arc::into_raw(ev) as CUevent) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    if e.is_null() {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // SAFETY: made by Arc::into_raw in cuEventCreate; queued markers hold their own clones.
    drop(unsafe { Arc::from_raw(e as *const Event) });
    CUDA_SUCCESS
}

unsafe fn event<'a>(e: CUevent) -> Option<&'a Event> {
    if e.is_null() {
        None
    } else {
        Some(unsafe { &*(e as *const Event) })
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    if e.is_null() {
        return CUDA_ERROR_INVALID_HANDLE;
    }
    // SAFETY: a live event from cuEventCreate; clone a reference for the queue.
    let ev = unsafe {
        Arc::increment_strong_count(e as *const Event);
        Arc::from_raw(e as *const Event)
    };
    ev.arm();
    enqueue(s, Job::Marker(ev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord_ptsz(e: CUevent, s: CUstream) -> CUresult {
    unsafe { cuEventRecord(e, s) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    match unsafe { event(e) } {
        Some(ev) => {
            ev.wait();
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    match unsafe { event(e) } {
        Some(ev) if ev.done_at().is_some() || !ev.armed() => CUDA_SUCCESS,
        Some(_) => CUDA_ERROR_NOT_READY,
        None => CUDA_ERROR_INVALID_HANDLE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    let (Some(a), Some(b)) = (unsafe { event(start) }, unsafe { event(end) }) else {
        return CUDA_ERROR_INVALID_HANDLE;
    };
    match (a.done_at(), b.done_at()) {
        (Some(ta), Some(tb)) => unsafe {
            put(ms, (tb.saturating_duration_since(ta)).as_secs_f32() * 1e3)
        },
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
    launch(s, unsafe { kernel_duration_us(params) })
}

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
    unsafe { cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params, extra) }
}

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
    unsafe { cuLaunchCooperativeKernel(f, gx, gy, gz, bx, by, bz, shmem, s, params) }
}

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
    let s = unsafe { (*config).h_stream };
    launch(s, unsafe { kernel_duration_us(params) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
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
