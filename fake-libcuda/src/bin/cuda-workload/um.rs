//! Unified-memory scenarios (run with the hook in unified-memory mode, docs/um.md): every
//! allocation path, the refused ones, the ceiling, the prefetch at a grant and exact frees.

use crate::{Api, check, emit, mem_info};
use anyhow::{Context, Result};
use cuda_abi::*;
use serde_json::json;
use std::ffi::c_void;

type FnCounter = unsafe extern "C" fn() -> u64;
type FnDevCounter = unsafe extern "C" fn(CUdevice) -> u64;

/// The fake's counters (through the same lookup path as the driver calls).
pub fn counters(api: &Api, dev: i32) -> serde_json::Value {
    // SAFETY: each name is paired with its signature.
    unsafe {
        let c = |n: &str| api.get::<FnCounter>(n).map(|f| f()).unwrap_or(u64::MAX);
        let used = api
            .get::<FnDevCounter>("fakeCudaMemUsed")
            .map(|f| f(dev))
            .unwrap_or(u64::MAX);
        json!({
            "prefetches": c("fakeCudaPrefetches"),
            "prefetched_bytes": c("fakeCudaPrefetchedBytes"),
            "managed_used": c("fakeCudaManagedUsed"),
            "device_used": used,
        })
    }
}

/// Allocates `bytes` through each of alloc, pitch, managed, async, pool (in that order);
/// tries `cuMemCreate` and one more allocation of `extra` bytes; launches `kernels` kernels
/// of `kernel_us` (the first waits for the token: the grant prefetches); frees everything,
/// then frees the first pointer again.
pub fn paths(
    api: &Api,
    dev: i32,
    bytes: u64,
    extra: u64,
    kernels: u64,
    kernel_us: u64,
) -> Result<()> {
    let n = usize::try_from(bytes).context("size")?;
    let mut codes = vec![];
    let mut held: Vec<(CUdeviceptr, bool)> = vec![];
    // SAFETY: the driver calls below get live locals as out-parameters and free only what
    // they allocated.
    unsafe {
        let mut p = 0;
        codes.push((api.alloc)(&mut p, n));
        held.push((p, false));
        let (mut p, mut pitch) = (0, 0usize);
        // 1000-byte rows: the pitch is the driver's (here: the hook's) choice.
        codes.push((api.pitch)(&mut p, &mut pitch, 1000, n / 1024, 4));
        held.push((p, false));
        let mut p = 0;
        codes.push((api.managed)(&mut p, n, 1));
        held.push((p, false));
        let mut p = 0;
        codes.push((api.alloc_async)(&mut p, n, std::ptr::null_mut()));
        held.push((p, true));
        let mut p = 0;
        codes.push((api.pool)(
            &mut p,
            n,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        ));
        held.push((p, true));
        emit(json!({"phase": "allocated", "codes": codes, "pitch": pitch,
            "fake": counters(api, dev), "mem": mem_info(api, dev)}));

        let prop = CUmemAllocationProp {
            kind: 1,
            requested_handle_types: 0,
            location_type: 1,
            location_id: dev,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        };
        let mut h = 0;
        let create = (api.create)(&mut h, n, &prop, 0);
        let mut p = 0;
        let beyond = (api.alloc)(&mut p, usize::try_from(extra).context("size")?);
        if beyond == CUDA_SUCCESS {
            held.push((p, false));
        }
        emit(json!({"phase": "refusals", "create": create, "beyond": beyond}));

        let mut dur = kernel_us;
        let mut params = [&mut dur as *mut u64 as *mut c_void];
        for _ in 0..kernels {
            let r = (api.launch)(
                0x1000 as CUfunction,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            check(r, "launch")?;
        }
        check((api.sync)(), "cuCtxSynchronize")?;
        emit(json!({"phase": "launched", "fake": counters(api, dev)}));

        let mut free_codes = vec![];
        for (p, asy) in &held {
            free_codes.push(if *asy {
                (api.free_async)(*p, std::ptr::null_mut())
            } else {
                (api.free)(*p)
            });
        }
        let again = (api.free)(held[0].0);
        emit(
            json!({"phase": "freed", "codes": free_codes, "again": again,
            "fake": counters(api, dev), "mem": mem_info(api, dev)}),
        );
    }
    Ok(())
}

/// Holds `bytes` of memory (managed in unified mode), then runs the launch loop.
pub fn hold(api: &Api, bytes: u64) -> Result<CUdeviceptr> {
    let mut p = 0;
    let n = usize::try_from(bytes).context("size")?;
    // SAFETY: a live local out-parameter.
    check(unsafe { (api.alloc)(&mut p, n) }, "cuMemAlloc")?;
    Ok(p)
}
