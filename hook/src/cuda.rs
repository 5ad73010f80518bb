//! The slice of the CUDA driver ABI the hook needs: handle types, structs as laid out in
//! `cuda.h`, result codes, and the size arithmetic of allocations whose size is implicit.
#![allow(non_camel_case_types, dead_code)]

use std::ffi::c_void;

pub type CUresult = i32;
pub type CUdevice = i32;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUdeviceptr = u64;
pub type CUarray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = u64;
pub type CUevent = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// An event's work is not done yet.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub const CAPTURE_MODE_RELAXED: i32 = 2;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const MEM_LOCATION_DEVICE: u32 = 1;

/// `CUlaunchConfig` (CUDA 11.8+): only `hStream` is read.
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim: [u32; 3],
    pub block_dim: [u32; 3],
    pub shared_mem_bytes: u32,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: u32,
}

/// `CUmemAllocationProp`: its location says which device's memory `cuMemCreate` takes.
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

/// Bytes of one channel of a `CUarray_format`.
pub fn array_format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        _ => 4,                  // 32-bit formats; wider formats are rare and counted low
    }
}

/// Bytes an array takes (the driver may pad; this is the payload).
pub fn array_bytes(width: usize, height: usize, depth: usize, format: u32, channels: u32) -> u64 {
    (width as u64)
        .saturating_mul(height.max(1) as u64)
        .saturating_mul(depth.max(1) as u64)
        .saturating_mul(array_format_bytes(format))
        .saturating_mul(u64::from(channels.max(1)))
}

/// An upper guess of a pitched allocation before the driver has chosen the pitch: the width
/// rounded up to 512 bytes (the pitch alignment of current GPUs), times the rows.
pub fn pitch_estimate(width: usize, height: usize) -> u64 {
    (width.div_ceil(512).max(1) as u64 * 512).saturating_mul(height as u64)
}

/// NVML-style UUID text of a `CUuuid`: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower case.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uuid_text() {
        let b = [
            0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef, 0, 1, 2, 3, 4, 5, 6, 0xff,
        ];
        assert_eq!(format_uuid(&b), "GPU-0123abcd-4567-89ef-0001-0203040506ff");
    }

    #[test]
    fn sizes() {
        assert_eq!(array_bytes(100, 0, 0, 0x20, 4), 1600);
        assert_eq!(array_bytes(10, 10, 10, 0x01, 1), 1000);
        assert_eq!(pitch_estimate(1, 3), 1536);
        assert_eq!(pitch_estimate(1024, 2), 2048);
    }

    #[test]
    fn launch_config_layout_matches_cuda_h() {
        // hStream follows seven u32s, aligned to 8: offset 32; with attrs and numAttrs, 56 bytes.
        assert_eq!(std::mem::offset_of!(CUlaunchConfig, h_stream), 32);
        assert_eq!(std::mem::size_of::<CUlaunchConfig>(), 56);
        assert_eq!(std::mem::offset_of!(CUmemAllocationProp, location_id), 12);
    }

    proptest! {
        #[test]
        fn pitch_estimate_covers_width(w in 0usize..1 << 20, h in 0usize..4096) {
            prop_assert!(pitch_estimate(w, h) >= (w as u64) * (h as u64));
        }
    }
}
