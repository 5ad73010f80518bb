//! Which exported driver function a `cuGetProcAddress` request selects.
//!
//! The runtime asks for base names ("cuMemAlloc") with the CUDA version it was built for and a
//! stream flag; the driver answers with the ABI variant of that version (`cuMemAlloc_v2` since
//! 3.2, `cuGetProcAddress_v2` since 12.0, `_ptsz` with the per-thread default stream). The hook
//! must hand back its wrapper of that same variant, or the caller would call a function of
//! another signature. Pure: unit-tested without a driver.

/// The exported functions the hook wraps (the names `dlsym` is answered with a wrapper for).
pub const WRAPPED: &[&str] = &[
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernel_ptsz",
    "cuGraphLaunch",
    "cuGraphLaunch_ptsz",
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemCreate",
    "cuArrayCreate_v2",
    "cuArray3DCreate_v2",
    "cuMemFree_v2",
    "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz",
    "cuMemRelease",
    "cuArrayDestroy",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "cuMemMap",
    "cuMemUnmap",
    "cuCtxDestroy_v2",
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxReset_v2",
];

/// The exported variant that `cuGetProcAddress(base, version, flags)` returns, if the hook wraps
/// it; `None` means "not ours: pass the driver's answer through".
pub fn variant(base: &str, version: i32, flags: u64) -> Option<&'static str> {
    let ptsz = flags & cuda_abi::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let pick =
        |plain: &'static str, per_thread: &'static str| Some(if ptsz { per_thread } else { plain });
    // Functions whose `_v2` ABI arrived with CUDA 3.2 (64-bit sizes); older callers get the
    // 32-bit v1 ABI, which the hook does not wrap.
    let v2 = |name: &'static str| (version >= 3020).then_some(name);
    match base {
        "cuGetProcAddress" => Some(if version >= 12000 {
            "cuGetProcAddress_v2"
        } else {
            "cuGetProcAddress"
        }),
        "cuLaunchKernel" => pick("cuLaunchKernel", "cuLaunchKernel_ptsz"),
        "cuLaunchKernelEx" => pick("cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"),
        "cuLaunchCooperativeKernel" => pick(
            "cuLaunchCooperativeKernel",
            "cuLaunchCooperativeKernel_ptsz",
        ),
        "cuGraphLaunch" => pick("cuGraphLaunch", "cuGraphLaunch_ptsz"),
        "cuMemAllocAsync" => pick("cuMemAllocAsync", "cuMemAllocAsync_ptsz"),
        "cuMemAllocFromPoolAsync" => {
            pick("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz")
        }
        "cuMemFreeAsync" => pick("cuMemFreeAsync", "cuMemFreeAsync_ptsz"),
        "cuMemAlloc" => v2("cuMemAlloc_v2"),
        "cuMemAllocPitch" => v2("cuMemAllocPitch_v2"),
        "cuMemFree" => v2("cuMemFree_v2"),
        "cuMemGetInfo" => v2("cuMemGetInfo_v2"),
        "cuDeviceTotalMem" => v2("cuDeviceTotalMem_v2"),
        "cuArrayCreate" => v2("cuArrayCreate_v2"),
        "cuArray3DCreate" => v2("cuArray3DCreate_v2"),
        // `_v2` of these came with CUDA 4.0 (context stack) and 11.0 (primary contexts).
        "cuCtxDestroy" => (version >= 4000).then_some("cuCtxDestroy_v2"),
        "cuCtxPushCurrent" => (version >= 4000).then_some("cuCtxPushCurrent_v2"),
        "cuDevicePrimaryCtxRelease" => (version >= 11000).then_some("cuDevicePrimaryCtxRelease_v2"),
        "cuDevicePrimaryCtxReset" => (version >= 11000).then_some("cuDevicePrimaryCtxReset_v2"),
        "cuCtxSetCurrent" => Some("cuCtxSetCurrent"),
        "cuDevicePrimaryCtxRetain" => Some("cuDevicePrimaryCtxRetain"),
        "cuMemMap" => Some("cuMemMap"),
        "cuMemUnmap" => Some("cuMemUnmap"),
        "cuMemAllocManaged" => Some("cuMemAllocManaged"),
        "cuMemCreate" => Some("cuMemCreate"),
        "cuMemRelease" => Some("cuMemRelease"),
        "cuArrayDestroy" => Some("cuArrayDestroy"),
        // A caller that already names a variant gets that variant.
        other => WRAPPED.iter().find(|w| **w == other).copied(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn versions_and_streams() {
        assert_eq!(
            variant("cuGetProcAddress", 11080, 0),
            Some("cuGetProcAddress")
        );
        assert_eq!(
            variant("cuGetProcAddress", 12000, 0),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(
            variant("cuGetProcAddress", 13000, 2),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(variant("cuMemAlloc", 13000, 0), Some("cuMemAlloc_v2"));
        assert_eq!(variant("cuMemAlloc", 3010, 0), None);
        assert_eq!(
            variant("cuLaunchKernel", 12080, 2),
            Some("cuLaunchKernel_ptsz")
        );
        assert_eq!(variant("cuLaunchKernel", 12080, 1), Some("cuLaunchKernel"));
        assert_eq!(
            variant("cuGraphLaunch", 12000, 2),
            Some("cuGraphLaunch_ptsz")
        );
        assert_eq!(variant("cuMemGetInfo", 12000, 0), Some("cuMemGetInfo_v2"));
        assert_eq!(
            variant("cuDeviceTotalMem", 12000, 0),
            Some("cuDeviceTotalMem_v2")
        );
        assert_eq!(variant("cuMemcpyHtoD", 12000, 0), None);
        assert_eq!(variant("cuMemAlloc_v2", 12000, 0), Some("cuMemAlloc_v2"));
        assert_eq!(
            variant("cuDevicePrimaryCtxRelease", 12000, 0),
            Some("cuDevicePrimaryCtxRelease_v2")
        );
        assert_eq!(variant("cuDevicePrimaryCtxRelease", 10020, 0), None);
        assert_eq!(variant("cuCtxDestroy", 13000, 2), Some("cuCtxDestroy_v2"));
        assert_eq!(variant("cuMemMap", 13000, 2), Some("cuMemMap"));
    }

    proptest! {
        #[test]
        fn answers_are_always_wrapped_names(name in "cu[A-Za-z0-9_]{0,30}", v in 0i32..20000, f in 0u64..4) {
            if let Some(x) = variant(&name, v, f) {
                prop_assert!(WRAPPED.contains(&x));
            }
        }
    }
}
