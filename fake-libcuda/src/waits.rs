//! Registered host memory and stream-ordered waits on it: `cuMemHostRegister_v2`,
//! `cuMemHostGetDevicePointer_v2` (the host address itself, as under unified addressing) and
//! `cuStreamWaitValue32_v2` (a job on the device's queue that holds everything behind it until
//! the word meets the value, as the hook's gate needs). Only registered ranges may be waited
//! on: the queue's worker reads the word, so it must stay mapped, which the hook's gate pages
//! do for the process's life.

use crate::engine::Job;
use crate::{enqueue, put};
use cuda_abi::*;
use std::ffi::{c_uint, c_void};
use std::sync::Mutex;

/// Registered (address, length) ranges.
static REGISTERED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn registered(addr: usize, len: usize) -> bool {
    REGISTERED.lock().is_ok_and(|r| {
        r.iter()
            .any(|(a, l)| addr >= *a && addr.saturating_add(len) <= a.saturating_add(*l))
    })
}

/// # Safety
/// The C API's contract: `p` points at `bytes` of host memory the caller keeps mapped while
/// registered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    if p.is_null() || bytes == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match REGISTERED.lock() {
        Ok(mut r) => {
            r.push((p as usize, bytes));
            CUDA_SUCCESS
        }
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    match REGISTERED.lock() {
        Ok(mut r) => match r.iter().position(|(a, _)| *a == p as usize) {
            Some(i) => {
                r.swap_remove(i);
                CUDA_SUCCESS
            }
            None => CUDA_ERROR_INVALID_VALUE,
        },
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// # Safety
/// The C API's contract: `d` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    d: *mut CUdeviceptr,
    p: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    if !registered(p as usize, 1) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: `d` is null or writable (this function's contract); `put` checks null.
    unsafe { put(d, p as CUdeviceptr) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitValue32_v2(
    s: CUstream,
    addr: CUdeviceptr,
    value: u32,
    flags: c_uint,
) -> CUresult {
    if flags != CU_STREAM_WAIT_VALUE_GEQ {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let addr = addr as usize;
    if !addr.is_multiple_of(4) || !registered(addr, 4) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    enqueue(s, Job::WaitWord { addr, value })
}
