//! The slice of NVML (`libnvidia-ml.so.1`) that memory-reporting tools such as `nvidia-smi`
//! use: device handles, return codes, the memory structs as laid out in `nvml.h`, and the
//! signatures of the functions the hook wraps and the fake serves.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

/// `nvmlReturn_t` (a C enum: `int`-sized).
pub type NvmlReturn = c_int;
/// `nvmlDevice_t`: an opaque pointer.
pub type NvmlDevice = *mut c_void;

pub const NVML_SUCCESS: NvmlReturn = 0;
pub const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
/// Also what the hook answers when NVML lacks a function it forwards to.
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

/// `nvmlMemory_t`: three `unsigned long long`s, 24 bytes.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmlMemory {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2_t`: a version word (padded to 8), then four `unsigned long long`s.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct NvmlMemoryV2 {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `nvmlMemory_v2`, the version a caller puts in `NvmlMemoryV2::version`
/// (`NVML_STRUCT_VERSION(Memory, 2)`: the struct's size, and the version in the top byte).
pub const NVML_MEMORY_V2: c_uint = (std::mem::size_of::<NvmlMemoryV2>() as c_uint) | (2 << 24);

/// Function signatures, one type per function, named after it.
pub mod pfn {
    use super::*;
    use std::ffi::c_char;

    pub type nvmlInit_v2 = unsafe extern "C" fn() -> NvmlReturn;
    pub type nvmlShutdown = nvmlInit_v2;
    pub type nvmlDeviceGetCount_v2 = unsafe extern "C" fn(*mut c_uint) -> NvmlReturn;
    pub type nvmlDeviceGetHandleByIndex_v2 =
        unsafe extern "C" fn(c_uint, *mut NvmlDevice) -> NvmlReturn;
    pub type nvmlDeviceGetUUID =
        unsafe extern "C" fn(NvmlDevice, *mut c_char, c_uint) -> NvmlReturn;
    pub type nvmlDeviceGetMemoryInfo =
        unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> NvmlReturn;
    pub type nvmlDeviceGetMemoryInfo_v2 =
        unsafe extern "C" fn(NvmlDevice, *mut NvmlMemoryV2) -> NvmlReturn;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_nvml_h() {
        assert_eq!(size_of::<NvmlMemory>(), 24);
        assert_eq!(offset_of!(NvmlMemoryV2, total), 8);
        assert_eq!(offset_of!(NvmlMemoryV2, used), 32);
        assert_eq!(size_of::<NvmlMemoryV2>(), 40);
    }
}
