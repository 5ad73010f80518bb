//! The fake driver's own conventions, shared by the fake and its workload program (the CUDA
//! and NVML definitions themselves come from `cuda-abi`): how a launch names the duration of
//! the kernel it stands for.

use std::ffi::c_void;

/// The fake's kernel convention: `kernelParams[0]` points to a `u64` holding the kernel's
/// duration in microseconds. A null `kernelParams` is a kernel of zero length.
///
/// # Safety
/// `params` must be null or point to at least one pointer, itself null or pointing to a u64.
pub unsafe fn kernel_duration_us(params: *mut *mut c_void) -> u64 {
    if params.is_null() {
        return 0;
    }
    // SAFETY: `params` is non-null and points to at least one pointer (the caller's
    // guarantee); that pointer is checked for null before the (unaligned) read of the u64.
    unsafe {
        let first = *params as *const u64;
        if first.is_null() {
            0
        } else {
            first.read_unaligned()
        }
    }
}
