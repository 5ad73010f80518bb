//! The slice of NVML (`libnvidia-ml.so.1`) that `nvidia-smi`-like tools use to show memory,
//! served by the same fake library (tests link it under that name too): devices by index,
//! their UUIDs, and `nvmlDeviceGetMemoryInfo` / `_v2` over the fake devices.

use crate::{device, driver};
use std::ffi::{c_char, c_int, c_uint};

pub type NvmlReturn = c_int;
pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;

/// `nvmlMemory_t`.
#[repr(C)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// A device handle is its index + 1 (never null).
type Handle = usize;

fn dev_of(h: Handle) -> Option<usize> {
    h.checked_sub(1).filter(|d| device(*d as i32).is_some())
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> NvmlReturn {
    if n.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    unsafe { n.write(driver().devices.len() as c_uint) };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(i: c_uint, h: *mut Handle) -> NvmlReturn {
    if h.is_null() || device(i as i32).is_none() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    unsafe { h.write(i as usize + 1) };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(h: Handle, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    let Some(d) = dev_of(h) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    let u = driver().devices[d].uuid;
    let hex =
        |r: std::ops::Range<usize>| u[r].iter().map(|b| format!("{b:02x}")).collect::<String>();
    let s = format!(
        "GPU-{}-{}-{}-{}-{}\0",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    );
    if buf.is_null() || (len as usize) < s.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsafe { std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, s.len()) };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(h: Handle, m: *mut NvmlMemory) -> NvmlReturn {
    let Some(d) = dev_of(h).map(|d| &driver().devices[d]) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if m.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let used = d.mem_used();
    unsafe {
        m.write(NvmlMemory {
            total: d.mem_total,
            free: d.mem_total.saturating_sub(used),
            used,
        })
    };
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(h: Handle, m: *mut NvmlMemoryV2) -> NvmlReturn {
    let Some(d) = dev_of(h).map(|d| &driver().devices[d]) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if m.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let used = d.mem_used();
    // The driver reserves some memory for itself; the fake reserves none.
    unsafe {
        (*m).total = d.mem_total;
        (*m).reserved = 0;
        (*m).free = d.mem_total.saturating_sub(used);
        (*m).used = used;
    }
    NVML_SUCCESS
}
