//! The slice of the CUDA driver API (`cuda.h`) and of NVML (`nvml.h`) that libgemhook and the
//! fake libcuda use, written once: handle types, result codes and flags, the structs the two
//! read as laid out in the C headers, and the signature of every driver function either one
//! calls or exports ([`pfn`], [`nvml::pfn`]).
//!
//! Both sides use these definitions, so a mistake in them would not show as a disagreement
//! between the hook and the fake: the layout tests below pin every struct to the offsets and
//! sizes of the C headers instead. Pure data and arithmetic, no I/O and no `unsafe`.
#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

pub mod nvml;
pub mod pfn;

// ------------------------------------------------------------------------------ handles

/// Every driver call returns a `CUresult` (a C enum: `int`-sized).
pub type CUresult = c_int;
/// A device ordinal (`int`).
pub type CUdevice = c_int;
/// Opaque driver handles: pointers to driver-private structs, never dereferenced by callers.
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type CUarray = *mut c_void;
pub type CUmemoryPool = *mut c_void;
/// Device addresses are 64-bit integers on every 64-bit platform (`unsigned long long`).
pub type CUdeviceptr = u64;
/// `cuMemCreate`'s handle (`unsigned long long`).
pub type CUmemGenericAllocationHandle = u64;
/// `CUuuid`: 16 raw bytes (a struct of `char bytes[16]` in C, passed by pointer).
pub type CUuuid = [u8; 16];

// ------------------------------------------------------------------------------ result codes

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
/// Also what the hook answers when the driver lacks a function it forwards to.
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// An event's or a stream's work is not done yet.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

// ------------------------------------------------------------------------------ flags

/// `cuGetProcAddress` flag: resolve the per-thread-default-stream (`_ptsz`) variants.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;
/// `CUdriverProcAddressQueryResult`, `cuGetProcAddress_v2`'s status.
pub const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
pub const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;
/// `CUstreamCaptureMode`: calls unsafe during a capture are allowed from this thread.
pub const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `CUmemLocationType`: the location is a device (its ordinal is the location's id).
pub const CU_MEM_LOCATION_TYPE_DEVICE: u32 = 1;
/// `cuMemAllocManaged` flags: accessible from any stream (what `cuMemAlloc` memory is), or
/// from the host only until attached.
pub const CU_MEM_ATTACH_GLOBAL: c_uint = 1;
pub const CU_MEM_ATTACH_HOST: c_uint = 2;
/// The host, as a prefetch or advice destination.
pub const CU_DEVICE_CPU: CUdevice = -1;
/// `cuEventCreate` flags: events that record time, and the cheapest events (no timing).
pub const CU_EVENT_DEFAULT: c_uint = 0;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `cuMemHostRegister` flags: the registration holds in every context, and the memory gets a
/// device address.
pub const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
pub const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;
/// `cuStreamWaitValue32` flag: wait until `(int32_t)(*addr - value) >= 0`.
pub const CU_STREAM_WAIT_VALUE_GEQ: c_uint = 0;

// ------------------------------------------------------------------------------ structs

/// `CUlaunchConfig` (CUDA 11.8+), `cuLaunchKernelEx`'s first argument. `#[repr(C)]` with the
/// header's field order: seven `unsigned int`s, then `hStream` at offset 32 (pointer-aligned),
/// the attribute array and its length. Only `h_stream` is read here.
#[repr(C)]
pub struct CUlaunchConfig {
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub h_stream: CUstream,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

/// `CUmemLocation`: a `CUmemLocationType` (an `int`-sized enum) and an id. 8 bytes, passed by
/// value to `cuMemPrefetchAsync_v2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUmemLocation {
    pub kind: u32,
    pub id: c_int,
}

/// `CUmemAllocationProp`, `cuMemCreate`'s description of the memory: its location says which
/// device's memory it takes. Laid out as in the header: type, handle types, the
/// `CUmemLocation` at offset 8, a pointer, then the `allocFlags` struct (8 bytes: four
/// `unsigned char`s and `unsigned short usage`, padded) that only the driver reads.
#[repr(C)]
pub struct CUmemAllocationProp {
    pub kind: u32,
    pub requested_handle_types: u32,
    pub location_type: u32,
    pub location_id: c_int,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUDA_ARRAY_DESCRIPTOR` (the `_v2` ABI: `size_t` extents), `cuArrayCreate_v2`'s argument.
#[repr(C)]
pub struct CudaArrayDescriptor {
    pub width: usize,
    pub height: usize,
    /// A `CUarray_format`.
    pub format: u32,
    pub num_channels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2` ABI), `cuArray3DCreate_v2`'s argument.
#[repr(C)]
pub struct CudaArray3dDescriptor {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    /// A `CUarray_format`.
    pub format: u32,
    pub num_channels: c_uint,
    pub flags: c_uint,
}

// ------------------------------------------------------------------------------ sizes

/// Bytes of one channel of a `CUarray_format`.
pub fn array_format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        _ => 4,                  // 32-bit formats; wider formats are rare and counted low
    }
}

/// Bytes an array's payload takes (the driver may pad): the extents (0 counts as 1 for
/// height and depth, as for 1D and 2D arrays), times the element size.
fn array_bytes(width: usize, height: usize, depth: usize, format: u32, channels: c_uint) -> u64 {
    (width as u64)
        .saturating_mul(height.max(1) as u64)
        .saturating_mul(depth.max(1) as u64)
        .saturating_mul(array_format_bytes(format))
        .saturating_mul(u64::from(channels.max(1)))
}

impl CudaArrayDescriptor {
    /// Bytes of the array's payload.
    pub fn bytes(&self) -> u64 {
        array_bytes(self.width, self.height, 1, self.format, self.num_channels)
    }
}

impl CudaArray3dDescriptor {
    /// Bytes of the array's payload.
    pub fn bytes(&self) -> u64 {
        array_bytes(
            self.width,
            self.height,
            self.depth,
            self.format,
            self.num_channels,
        )
    }
}

/// The pitch alignment of current GPUs, in bytes.
pub const PITCH_ALIGN: usize = 512;

/// The pitch of a row of `width` bytes: the width rounded up to [`PITCH_ALIGN`] (at least one
/// alignment unit). An upper guess of the driver's choice, and the fake driver's choice.
pub fn pitch_for(width: usize) -> usize {
    width
        .div_ceil(PITCH_ALIGN)
        .max(1)
        .saturating_mul(PITCH_ALIGN)
}

// ------------------------------------------------------------------------------ UUIDs

/// NVML's text of a `CUuuid`: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower case (the
/// form gem-schd's socket names use).
pub fn format_uuid(b: &CUuuid) -> String {
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

/// The bytes of an NVML-style UUID text (`GPU-` then 32 hex digits, dashes anywhere).
pub fn parse_uuid(s: &str) -> Option<CUuuid> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_cuda_h() {
        // hStream follows seven unsigned ints, aligned to 8: offset 32; 56 bytes in all.
        assert_eq!(offset_of!(CUlaunchConfig, h_stream), 32);
        assert_eq!(offset_of!(CUlaunchConfig, num_attrs), 48);
        assert_eq!(size_of::<CUlaunchConfig>(), 56);
        assert_eq!(offset_of!(CUmemAllocationProp, location_type), 8);
        assert_eq!(offset_of!(CUmemAllocationProp, location_id), 12);
        assert_eq!(size_of::<CUmemAllocationProp>(), 32);
        assert_eq!(size_of::<CUmemLocation>(), 8);
        assert_eq!(offset_of!(CudaArrayDescriptor, format), 16);
        assert_eq!(size_of::<CudaArrayDescriptor>(), 24);
        assert_eq!(offset_of!(CudaArray3dDescriptor, format), 24);
        assert_eq!(size_of::<CudaArray3dDescriptor>(), 40);
    }

    #[test]
    fn array_sizes() {
        let d2 = |width, height, format, num_channels| CudaArrayDescriptor {
            width,
            height,
            format,
            num_channels,
        };
        assert_eq!(d2(100, 0, 0x20, 4).bytes(), 1600);
        let d3 = CudaArray3dDescriptor {
            width: 10,
            height: 10,
            depth: 10,
            format: 0x01,
            num_channels: 1,
            flags: 0,
        };
        assert_eq!(d3.bytes(), 1000);
        assert_eq!(d2(usize::MAX, 2, 0x20, 4).bytes(), u64::MAX);
    }

    #[test]
    fn pitches() {
        assert_eq!(pitch_for(0), 512);
        assert_eq!(pitch_for(1), 512);
        assert_eq!(pitch_for(512), 512);
        assert_eq!(pitch_for(513), 1024);
        assert!(pitch_for(usize::MAX) >= usize::MAX - PITCH_ALIGN);
    }

    #[test]
    fn uuid_text_round_trips() {
        let b = [
            0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef, 0, 1, 2, 3, 4, 5, 6, 0xff,
        ];
        let s = format_uuid(&b);
        assert_eq!(s, "GPU-0123abcd-4567-89ef-0001-0203040506ff");
        assert_eq!(parse_uuid(&s), Some(b));
        assert_eq!(parse_uuid(&s.to_uppercase()), Some(b));
        assert!(parse_uuid("GPU-123").is_none());
        assert!(parse_uuid("MIG-0123abcd-4567-89ef-0123-456789abcdef").is_none());
        assert!(parse_uuid("GPU-0123abcd-4567-89ef-0123-456789abcdeg").is_none());
    }
}
