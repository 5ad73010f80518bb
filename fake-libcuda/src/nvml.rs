//! The slice of NVML (`libnvidia-ml.so.1`) that `nvidia-smi`-like tools use to show memory,
//! served by the same fake library (tests link it under that name too): devices by index,
//! their UUIDs, and `nvmlDeviceGetMemoryInfo` / `_v2` over the fake devices.

use crate::{device, driver};
use cuda_abi::format_uuid;
use cuda_abi::nvml::*;
use std::ffi::{c_char, c_uint};

/// A device handle is its index + 1 (never null), never dereferenced.
fn handle_of(index: c_uint) -> NvmlDevice {
    (index as usize + 1) as NvmlDevice
}

fn dev_of(h: NvmlDevice) -> Option<usize> {
    (h as usize)
        .checked_sub(1)
        .filter(|d| device(*d as i32).is_some())
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    NVML_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

/// # Safety
/// NVML's contract: `n` is null or valid for writes of a `c_uint`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(n: *mut c_uint) -> NvmlReturn {
    if n.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null (checked) and writable (this function's contract).
    unsafe { n.write(driver().devices.len() as c_uint) };
    NVML_SUCCESS
}

/// # Safety
/// NVML's contract: `h` is null or valid for writes of a handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    i: c_uint,
    h: *mut NvmlDevice,
) -> NvmlReturn {
    if h.is_null() || device(i as i32).is_none() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null (checked) and writable (this function's contract).
    unsafe { h.write(handle_of(i)) };
    NVML_SUCCESS
}

/// # Safety
/// NVML's contract: `buf` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    h: NvmlDevice,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    let Some(d) = dev_of(h) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    let s = format!("{}\0", format_uuid(&driver().devices[d].uuid));
    if buf.is_null() || (len as usize) < s.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: `buf` is non-null and holds `len` >= `s.len()` bytes (checked above, and this
    // function's contract); a fresh String cannot overlap it.
    unsafe { std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, buf, s.len()) };
    NVML_SUCCESS
}

/// # Safety
/// NVML's contract: `m` is null or valid for writes of an `nvmlMemory_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(h: NvmlDevice, m: *mut NvmlMemory) -> NvmlReturn {
    let Some(d) = dev_of(h).map(|d| &driver().devices[d]) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if m.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let used = d.mem_used();
    // SAFETY: non-null (checked) and writable (this function's contract).
    unsafe {
        m.write(NvmlMemory {
            total: d.mem_total,
            free: d.mem_total.saturating_sub(used),
            used,
        })
    };
    NVML_SUCCESS
}

/// # Safety
/// NVML's contract: `m` is null or valid for reads and writes of an `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    h: NvmlDevice,
    m: *mut NvmlMemoryV2,
) -> NvmlReturn {
    let Some(d) = dev_of(h).map(|d| &driver().devices[d]) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if m.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    let used = d.mem_used();
    // The driver reserves some memory for itself; the fake reserves none. The caller's
    // `version` field is left as it is.
    // SAFETY: non-null (checked) and writable (this function's contract).
    unsafe {
        (*m).total = d.mem_total;
        (*m).reserved = 0;
        (*m).free = d.mem_total.saturating_sub(used);
        (*m).used = used;
    }
    NVML_SUCCESS
}

// The exports must have NVML's signatures, the ones callers cast the addresses to.
const _: pfn::nvmlInit_v2 = nvmlInit_v2;
const _: pfn::nvmlShutdown = nvmlShutdown;
const _: pfn::nvmlDeviceGetCount_v2 = nvmlDeviceGetCount_v2;
const _: pfn::nvmlDeviceGetHandleByIndex_v2 = nvmlDeviceGetHandleByIndex_v2;
const _: pfn::nvmlDeviceGetUUID = nvmlDeviceGetUUID;
const _: pfn::nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo;
const _: pfn::nvmlDeviceGetMemoryInfo_v2 = nvmlDeviceGetMemoryInfo_v2;
