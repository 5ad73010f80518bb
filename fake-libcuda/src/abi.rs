//! The slice of the CUDA driver ABI that the fake libcuda and its workload program share:
//! handle types, structs laid out as in `cuda.h`, result codes and the fake's conventions.
//! Written apart from the hook's own `hook/src/cuda.rs` on purpose: a test double that
//! shared the hook's definitions would let a mistake in them pass on both sides.
#![allow(dead_code, non_camel_case_types)]

use std::ffi::c_void;

pub type CUresult = i32;
pub type CUdevice = i32;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUdeviceptr = u64;
pub type CUarray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
/// `CUdriverProcAddressQueryResult`.
pub const CU_GET_PROC_ADDRESS_SUCCESS: i32 = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: i32 = 1;

/// `CUlaunchConfig` (CUDA 11.8+).
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim: [u32; 3],
    pub block_dim: [u32; 3],
    pub shared_mem_bytes: u32,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: u32,
}

/// `CUmemAllocationProp` (only the fields read here are named).
#[repr(C)]
pub struct CUmemAllocationProp {
    pub kind: u32,
    pub requested_handle_types: u32,
    pub location_type: u32,
    pub location_id: i32,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUDA_ARRAY_DESCRIPTOR`.
#[repr(C)]
pub struct CudaArrayDescriptor {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub num_channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR`.
#[repr(C)]
pub struct CudaArray3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

/// Bytes of one channel element of a `CUarray_format`.
pub fn array_format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        _ => 4,                  // 32-bit ints, FLOAT and anything else
    }
}

/// Size of a 2D array, as the fake (and the hook) count it.
pub fn array_bytes(d: &CudaArrayDescriptor) -> u64 {
    (d.width as u64)
        .saturating_mul((d.height as u64).max(1))
        .saturating_mul(array_format_bytes(d.format))
        .saturating_mul(u64::from(d.num_channels.max(1)))
}

/// Size of a 3D array.
pub fn array3d_bytes(d: &CudaArray3dDescriptor) -> u64 {
    (d.width as u64)
        .saturating_mul((d.height as u64).max(1))
        .saturating_mul((d.depth as u64).max(1))
        .saturating_mul(array_format_bytes(d.format))
        .saturating_mul(u64::from(d.num_channels.max(1)))
}

/// Pitch the fake gives to `cuMemAllocPitch`: the width rounded up to 512 bytes.
pub fn fake_pitch(width: usize) -> usize {
    width.div_ceil(512).max(1) * 512
}

/// The fake's kernel convention: `kernelParams[0]` points to a `u64` holding the kernel's
/// duration in microseconds. A null `kernelParams` is a kernel of zero length.
///
/// # Safety
/// `params` must be null or point to at least one pointer, itself null or pointing to a u64.
pub unsafe fn kernel_duration_us(params: *mut *mut c_void) -> u64 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: the caller guarantees the layout above.
    unsafe {
        let first = *params as *const u64;
        if first.is_null() {
            0
        } else {
            first.read_unaligned()
        }
    }
}

/// Parses an NVML-style UUID (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`) into its 16 bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s
        .strip_prefix("GPU-")?
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
