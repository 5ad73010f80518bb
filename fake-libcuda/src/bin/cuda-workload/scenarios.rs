//! The workload's robustness scenarios (virtual memory, ends of contexts, fork), NVML, and the
//! per-launch cost benchmark. Each prints JSON lines; the hook's tests judge them.

use crate::{Api, check, emit, mem_info};
use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use cuda_abi::*;
use serde_json::json;
use std::ffi::{c_char, c_uint, c_void};
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn prop(dev: i32) -> CUmemAllocationProp {
    CUmemAllocationProp {
        kind: 1, // CU_MEM_ALLOCATION_TYPE_PINNED
        requested_handle_types: 0,
        location_type: CU_MEM_LOCATION_TYPE_DEVICE,
        location_id: dev,
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// create → map → release (still mapped) → a second create → unmap → a third create.
pub fn vmm(api: &Api, dev: i32, bytes: u64) -> Result<()> {
    let n = usize::try_from(bytes).context("size")?;
    // SAFETY: each name with its own signature; out-pointers to locals.
    unsafe {
        let reserve: pfn::cuMemAddressReserve = api.get("cuMemAddressReserve")?;
        let addr_free: pfn::cuMemAddressFree = api.get("cuMemAddressFree")?;
        let map: pfn::cuMemMap = api.get("cuMemMap")?;
        let unmap: pfn::cuMemUnmap = api.get("cuMemUnmap")?;
        let p = prop(dev);
        let mut h = 0;
        check((api.create)(&mut h, n, &p, 0), "cuMemCreate")?;
        let mut va = 0;
        check(reserve(&mut va, n, 0, 0, 0), "cuMemAddressReserve")?;
        check(map(va, n, 0, h, 0), "cuMemMap")?;
        let released = (api.release)(h);
        emit(json!({"step": "released-while-mapped", "rc": released, "mem": mem_info(api, dev)}));
        let mut h2 = 0;
        let second = (api.create)(&mut h2, n, &p, 0);
        emit(json!({"step": "second-create", "rc": second, "mem": mem_info(api, dev)}));
        if second == CUDA_SUCCESS {
            check((api.release)(h2), "cuMemRelease")?;
        }
        check(unmap(va, n), "cuMemUnmap")?;
        emit(json!({"step": "unmapped", "mem": mem_info(api, dev)}));
        let mut h3 = 0;
        let third = (api.create)(&mut h3, n, &p, 0);
        emit(json!({"step": "third-create", "rc": third, "mem": mem_info(api, dev)}));
        if third == CUDA_SUCCESS {
            check((api.release)(h3), "cuMemRelease")?;
        }
        check(addr_free(va, n), "cuMemAddressFree")?;
    }
    Ok(())
}

/// How the context holding the allocation ends.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
pub enum CtxEnd {
    /// `cuCtxCreate_v2`, allocate, `cuCtxDestroy_v2`.
    Destroy,
    /// Allocate in the primary context, `cuDevicePrimaryCtxReset_v2`.
    Reset,
    /// Allocate in the primary context, `cuDevicePrimaryCtxRelease_v2` (its last retain).
    Release,
}

pub fn ctx_end(api: &Api, dev: i32, bytes: u64, how: CtxEnd) -> Result<()> {
    let n = usize::try_from(bytes).context("size")?;
    // SAFETY: each name with its own signature; out-pointers to locals.
    unsafe {
        let mut primary = std::ptr::null_mut();
        check((api.retain)(&mut primary, dev), "cuDevicePrimaryCtxRetain")?;
        // main retained once already: drop that one so a Release below is the last.
        let release: pfn::cuDevicePrimaryCtxRelease_v2 = api.get("cuDevicePrimaryCtxRelease_v2")?;
        check(release(dev), "cuDevicePrimaryCtxRelease_v2")?;
        let mut made = std::ptr::null_mut();
        if how == CtxEnd::Destroy {
            // Made past the lookup path under test: the hook wraps the destroy, not this.
            let create: pfn::cuCtxCreate_v2 = api.sym("cuCtxCreate_v2")?;
            check(create(&mut made, 0, dev), "cuCtxCreate_v2")?;
        }
        let mut p = 0;
        check((api.alloc)(&mut p, n), "cuMemAlloc_v2")?;
        emit(json!({"step": "allocated", "mem": mem_info(api, dev)}));
        let rc = match how {
            CtxEnd::Destroy => {
                let destroy: pfn::cuCtxDestroy_v2 = api.get("cuCtxDestroy_v2")?;
                destroy(made)
            }
            CtxEnd::Reset => {
                let reset: pfn::cuDevicePrimaryCtxReset_v2 =
                    api.get("cuDevicePrimaryCtxReset_v2")?;
                reset(dev)
            }
            CtxEnd::Release => release(dev),
        };
        // Back in a live primary context to ask.
        check((api.retain)(&mut primary, dev), "cuDevicePrimaryCtxRetain")?;
        check((api.set_current)(primary), "cuCtxSetCurrent")?;
        emit(json!({"step": "ended", "rc": rc, "mem": mem_info(api, dev)}));
    }
    Ok(())
}

/// Launches `kernel_us` kernels in batches of 4 until `stop`, counting them.
fn launcher(api: &Api, kernel_us: u64, stop: &AtomicBool, count: &AtomicU64) -> Result<()> {
    let mut dur = kernel_us;
    let mut params = [&mut dur as *mut u64 as *mut c_void];
    let f = 0x1000 as CUfunction;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..4 {
            let (s, x) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: the fake's kernel convention; `params` outlives the call.
            let r = unsafe { (api.launch)(f, 1, 1, 1, 1, 1, 1, 0, s, params.as_mut_ptr(), x) };
            check(r, "launch")?;
            count.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: plain driver call.
        check(unsafe { (api.sync)() }, "cuCtxSynchronize")?;
    }
    Ok(())
}

pub fn fork(api: &Api, dev: i32, bytes: u64, children: u32, kernel_us: u64) -> Result<()> {
    let n = usize::try_from(bytes).context("size")?;
    let mut held = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { (api.alloc)(&mut held, n) }, "cuMemAlloc_v2")?;
    // SAFETY: the primary context, made current in each thread that uses it.
    let ctx = unsafe {
        let mut c = std::ptr::null_mut();
        check((api.retain)(&mut c, dev), "cuDevicePrimaryCtxRetain")?;
        c as usize
    };
    let stop = Arc::new(AtomicBool::new(false));
    let launched = Arc::new(AtomicU64::new(0));
    let queries = Arc::new(AtomicU64::new(0));
    let api_ptr = api as *const Api as usize;
    let threads: Vec<std::thread::JoinHandle<Result<()>>> = vec![
        {
            let (stop, launched) = (stop.clone(), launched.clone());
            std::thread::spawn(move || {
                // SAFETY: `api` outlives the threads (joined below); the context is live.
                let api = unsafe { &*(api_ptr as *const Api) };
                // SAFETY: a context this process retained, made current in this thread; the
                // function type is the one `load` paired with its name.
                unsafe { (api.set_current)(ctx as CUcontext) };
                launcher(api, kernel_us, &stop, &launched)
            })
        },
        {
            let (stop, queries) = (stop.clone(), queries.clone());
            std::thread::spawn(move || {
                // SAFETY: as above.
                let api = unsafe { &*(api_ptr as *const Api) };
                // SAFETY: as above.
                unsafe { (api.set_current)(ctx as CUcontext) };
                while !stop.load(Ordering::Relaxed) {
                    let _ = mem_info(api, dev);
                    queries.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        },
    ];
    std::thread::sleep(Duration::from_millis(300));
    let mut outcomes = vec![];
    for i in 0..children {
        let _ = std::io::stdout().flush();
        // SAFETY: fork; the child only calls the driver (through the hook) and exits.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            bail!("fork failed");
        }
        if pid == 0 {
            child(api, dev, n, kernel_us, i);
        }
        outcomes.push(wait_child(pid, Duration::from_secs(20)));
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = launched.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    let after = launched.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join()
            .map_err(|_| anyhow::anyhow!("a thread panicked"))??;
    }
    // SAFETY: the allocation made above.
    let freed = unsafe { (api.free)(held) };
    emit(json!({
        "parent": true,
        "children": outcomes,
        "launched_after_forks": after - before,
        "queries": queries.load(Ordering::Relaxed),
        "free_rc": freed,
        "mem": mem_info(api, dev),
    }));
    Ok(())
}

/// In the forked child: allocate, launch, report, exit without running the parent's
/// destructors.
fn child(api: &Api, dev: i32, n: usize, kernel_us: u64, i: u32) -> ! {
    let t0 = Instant::now();
    let mut p = 0;
    // SAFETY: driver calls with valid arguments.
    let alloc = unsafe { (api.alloc)(&mut p, n) };
    // SAFETY: a live local out-parameter; the free names what the allocation made.
    let small = unsafe {
        let mut q = 0;
        let r = (api.alloc)(&mut q, 1 << 20);
        if r == CUDA_SUCCESS {
            (api.free)(q);
        }
        r
    };
    let mut dur = kernel_us;
    let mut params = [&mut dur as *mut u64 as *mut c_void];
    let mut rc = CUDA_SUCCESS;
    for _ in 0..3 {
        let (s, x) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the fake's calling convention.
        rc = unsafe {
            (api.launch)(
                0x1000 as CUfunction,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                x,
            )
        };
    }
    // SAFETY: plain driver call.
    let sync = unsafe { (api.sync)() };
    emit(json!({
        "child": i,
        "pid": std::process::id(),
        "alloc_rc": alloc,
        "small_alloc_rc": small,
        "launch_rc": rc,
        "sync_rc": sync,
        "ms": t0.elapsed().as_millis() as u64,
        "mem": mem_info(api, dev),
    }));
    let _ = std::io::stdout().flush();
    // SAFETY: ends the child at once, as a forked worker would.
    unsafe { libc::_exit(0) }
}

/// Waits for a child at most `t`; a child still running then is killed and reported hung.
fn wait_child(pid: i32, t: Duration) -> serde_json::Value {
    let deadline = Instant::now() + t;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
            return json!({"pid": pid, "exited": ok, "status": status});
        }
        if Instant::now() >= deadline {
            // SAFETY: killing our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return json!({"pid": pid, "exited": false, "hung": true});
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn nvml(dev: i32) -> Result<()> {
    // SAFETY: dlopen/dlsym with constant names, each cast to its own signature.
    unsafe {
        let h = libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW);
        if h.is_null() {
            bail!("dlopen(libnvidia-ml.so.1) failed");
        }
        let sym = |n: &std::ffi::CStr| libc::dlsym(h, n.as_ptr());
        let init: nvml::pfn::nvmlInit_v2 = crate::cast(sym(c"nvmlInit_v2"), "nvmlInit_v2")?;
        let by_index: nvml::pfn::nvmlDeviceGetHandleByIndex_v2 = crate::cast(
            sym(c"nvmlDeviceGetHandleByIndex_v2"),
            "nvmlDeviceGetHandleByIndex_v2",
        )?;
        let info: nvml::pfn::nvmlDeviceGetMemoryInfo =
            crate::cast(sym(c"nvmlDeviceGetMemoryInfo"), "nvmlDeviceGetMemoryInfo")?;
        let info2: nvml::pfn::nvmlDeviceGetMemoryInfo_v2 = crate::cast(
            sym(c"nvmlDeviceGetMemoryInfo_v2"),
            "nvmlDeviceGetMemoryInfo_v2",
        )?;
        if init() != 0 {
            bail!("nvmlInit_v2 failed");
        }
        let mut d = std::ptr::null_mut();
        if by_index(dev as c_uint, &mut d) != 0 {
            bail!("no NVML device {dev}");
        }
        let mut m = nvml::NvmlMemory::default();
        let r1 = info(d, &mut m);
        let mut m2 = nvml::NvmlMemoryV2 {
            version: nvml::NVML_MEMORY_V2,
            ..Default::default()
        };
        let r2 = info2(d, &mut m2);
        emit(json!({
            "v1": {"rc": r1, "total": m.total, "free": m.free, "used": m.used},
            "v2": {"rc": r2, "total": m2.total, "free": m2.free, "used": m2.used, "reserved": m2.reserved},
        }));
    }
    Ok(())
}

/// Interleaved rounds of `launches` calls through the hook (the lookup path's
/// `cuLaunchKernel`) and straight to the fake (`fakeCudaRawProc`); per-launch ns of each, and
/// their difference (the hook's added cost), best-of and median over the rounds.
pub fn launch_bench(api: &Api, rounds: u32, launches: u32) -> Result<()> {
    type FnRaw = unsafe extern "C" fn(*const c_char) -> *mut c_void;
    // SAFETY: the fake's own lookup, by name (not a driver name: the hook passes it through).
    let raw: pfn::cuLaunchKernel = unsafe {
        let rp: FnRaw = crate::cast(
            libc::dlsym(api.handle, c"fakeCudaRawProc".as_ptr()),
            "fakeCudaRawProc",
        )?;
        crate::cast(rp(c"cuLaunchKernel".as_ptr()), "raw cuLaunchKernel")?
    };
    let hooked = api.launch;
    let f = 0x1000 as CUfunction;
    let mut dur = 0u64;
    let mut params = [&mut dur as *mut u64 as *mut c_void];
    let pp = params.as_mut_ptr();
    let time = |fun: pfn::cuLaunchKernel| -> f64 {
        let t = Instant::now();
        for _ in 0..launches {
            // SAFETY: the fake's calling convention; a zero-length kernel.
            let r = unsafe {
                fun(
                    f,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    pp,
                    std::ptr::null_mut(),
                )
            };
            std::hint::black_box(r);
        }
        t.elapsed().as_nanos() as f64 / f64::from(launches)
    };
    // Warm up: the first hooked launch connects and takes the token.
    time(hooked);
    time(raw);
    let (mut h, mut r, mut d) = (vec![], vec![], vec![]);
    for i in 0..rounds {
        let (a, b) = if i % 2 == 0 {
            let a = time(hooked);
            (a, time(raw))
        } else {
            let b = time(raw);
            (time(hooked), b)
        };
        h.push(a);
        r.push(b);
        d.push(a - b);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (bh, br) = (best(&h), best(&r));
    emit(json!({
        "rounds": rounds,
        "launches_per_round": launches,
        "hooked_ns": {"best": bh, "median": med(&mut h)},
        "raw_ns": {"best": br, "median": med(&mut r)},
        "added_ns": {"best_of_bests": bh - br, "median_of_pairs": med(&mut d), "min_pair": best(&d)},
    }));
    Ok(())
}
