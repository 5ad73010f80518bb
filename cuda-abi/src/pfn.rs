//! The signatures of the driver functions the hook forwards to or exports and the fake
//! driver exports, one type per function, named after it (`cuMemAlloc_v2` is the type of
//! `cuMemAlloc_v2`). Functions of one signature share it under each name (the aliases at
//! the end), so that a caller names the function it means.
//!
//! These are the types a looked-up address is cast to, so each must match `cuda.h` exactly:
//! a wrong one is undefined behaviour at the call. Both implementations check their exported
//! functions against them at compile time.
#![allow(non_camel_case_types)]

use crate::*;
use std::ffi::{c_char, c_int, c_uint, c_void};

/// `void **kernelParams` and `void **extra`.
type Params = *mut *mut c_void;

// ------------------------------------------------------------------------------ init, devices

pub type cuInit = unsafe extern "C" fn(c_uint) -> CUresult;
pub type cuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type cuDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
pub type cuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type cuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult;
pub type cuDeviceGetUuid = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
pub type cuDeviceTotalMem_v2 = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;

// ------------------------------------------------------------------------------ contexts

pub type cuDevicePrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
pub type cuDevicePrimaryCtxRelease_v2 = unsafe extern "C" fn(CUdevice) -> CUresult;
pub type cuDevicePrimaryCtxGetState =
    unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> CUresult;
pub type cuCtxCreate_v2 = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
pub type cuCtxDestroy_v2 = unsafe extern "C" fn(CUcontext) -> CUresult;
pub type cuCtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub type cuCtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
pub type cuCtxSynchronize = unsafe extern "C" fn() -> CUresult;

// ------------------------------------------------------------------------------ streams, events

pub type cuStreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
pub type cuStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
pub type cuStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
pub type cuThreadExchangeStreamCaptureMode = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub type cuEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
pub type cuEventDestroy_v2 = unsafe extern "C" fn(CUevent) -> CUresult;
pub type cuEventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub type cuEventElapsedTime = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
/// `(stream, addr, value, flags)`: the stream waits until the 32-bit word at `addr` meets
/// `value` as `flags` say.
pub type cuStreamWaitValue32_v2 =
    unsafe extern "C" fn(CUstream, CUdeviceptr, u32, c_uint) -> CUresult;

// ------------------------------------------------------------------------------ host memory

pub type cuMemHostRegister_v2 = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
pub type cuMemHostGetDevicePointer_v2 =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult;

// ------------------------------------------------------------------------------ launches

/// `(f, gridDim x/y/z, blockDim x/y/z, sharedMemBytes, stream, kernelParams, extra)`.
pub type cuLaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    Params,
    Params,
) -> CUresult;
/// `cuLaunchKernel` without `extra`.
pub type cuLaunchCooperativeKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    Params,
) -> CUresult;
pub type cuLaunchKernelEx =
    unsafe extern "C" fn(*const CUlaunchConfig, CUfunction, Params, Params) -> CUresult;
pub type cuGraphLaunch = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;

// ------------------------------------------------------------------------------ memory

pub type cuMemAlloc_v2 = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
/// `(dptr, pitch, widthInBytes, height, elementSizeBytes)`.
pub type cuMemAllocPitch_v2 =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
pub type cuMemAllocManaged = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
pub type cuMemAllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
pub type cuMemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
pub type cuMemFree_v2 = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
pub type cuMemFreeAsync = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
pub type cuMemGetInfo_v2 = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
pub type cuMemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
pub type cuMemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
/// `(ptr, size, alignment, addr, flags)`.
pub type cuMemAddressReserve =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CUresult;
/// `(ptr, size)`.
pub type cuMemAddressFree = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
/// `(ptr, size, offset, handle, flags)`.
pub type cuMemMap =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
pub type cuArrayCreate_v2 =
    unsafe extern "C" fn(*mut CUarray, *const CudaArrayDescriptor) -> CUresult;
pub type cuArray3DCreate_v2 =
    unsafe extern "C" fn(*mut CUarray, *const CudaArray3dDescriptor) -> CUresult;
pub type cuArrayDestroy = unsafe extern "C" fn(CUarray) -> CUresult;
/// CUDA ≤ 12: `(ptr, count, dstDevice, stream)`.
pub type cuMemPrefetchAsync =
    unsafe extern "C" fn(CUdeviceptr, usize, CUdevice, CUstream) -> CUresult;
/// CUDA ≥ 12.2 `_v2` (CUDA 13's `cuMemPrefetchAsync`): `(ptr, count, location, flags,
/// stream)`, the location passed by value.
pub type cuMemPrefetchAsync_v2 =
    unsafe extern "C" fn(CUdeviceptr, usize, CUmemLocation, c_uint, CUstream) -> CUresult;
/// `(ptr, count, advice, device)` (CUDA ≤ 12 ABI).
pub type cuMemAdvise = unsafe extern "C" fn(CUdeviceptr, usize, c_int, CUdevice) -> CUresult;

// ------------------------------------------------------------------------------ errors, lookups

pub type cuGetErrorString = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;
/// CUDA 11.3–11.8: `(symbol, pfn, cudaVersion, flags)`.
pub type cuGetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CUresult;
/// CUDA 12+: with the `CUdriverProcAddressQueryResult` out-parameter.
pub type cuGetProcAddress_v2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CUresult;

// ------------------------------------------------------------------------------ same signatures

pub type cuDeviceGetUuid_v2 = cuDeviceGetUuid;
pub type cuDevicePrimaryCtxReset_v2 = cuDevicePrimaryCtxRelease_v2;
pub type cuCtxSetCurrent = cuCtxDestroy_v2;
pub type cuCtxPushCurrent_v2 = cuCtxDestroy_v2;
pub type cuCtxPopCurrent_v2 = cuCtxGetCurrent;
pub type cuStreamQuery = cuStreamSynchronize;
pub type cuEventQuery = cuEventDestroy_v2;
pub type cuEventSynchronize = cuEventDestroy_v2;
pub type cuMemUnmap = cuMemAddressFree;
pub type cuGetErrorName = cuGetErrorString;

/// The per-thread-default-stream variants: their base function's signature.
pub type cuLaunchKernel_ptsz = cuLaunchKernel;
pub type cuLaunchCooperativeKernel_ptsz = cuLaunchCooperativeKernel;
pub type cuLaunchKernelEx_ptsz = cuLaunchKernelEx;
pub type cuGraphLaunch_ptsz = cuGraphLaunch;
pub type cuMemAllocAsync_ptsz = cuMemAllocAsync;
pub type cuMemAllocFromPoolAsync_ptsz = cuMemAllocFromPoolAsync;
pub type cuMemFreeAsync_ptsz = cuMemFreeAsync;
pub type cuStreamSynchronize_ptsz = cuStreamSynchronize;
pub type cuEventRecord_ptsz = cuEventRecord;
