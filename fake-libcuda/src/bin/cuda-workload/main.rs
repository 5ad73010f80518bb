//! A CUDA driver-API workload for tests: it reaches `libcuda.so.1` by one of the three paths a
//! real CUDA stack uses (linked symbols, `dlsym` on the library handle, `cuGetProcAddress_v2`),
//! runs kernels of a given duration (fake-libcuda convention) or allocations, and prints JSON
//! lines on stdout.

mod launch;
mod scenarios;
mod um;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use cuda_abi::*;
use launch::{Pace, run_launch};
use serde_json::json;
use std::ffi::{CString, c_uint, c_void};
use std::io::Write;
use std::time::Duration;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Lookup {
    /// Call the functions the program was linked against (the dynamic linker resolves them).
    Symbol,
    /// `dlopen("libcuda.so.1")` and `dlsym` each function.
    Dlsym,
    /// `dlsym` only `cuGetProcAddress_v2`, ask it for `cuGetProcAddress`, then resolve every
    /// function through that (what the CUDA 12+ runtime does).
    Proc,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum LaunchKind {
    Launch,
    Ex,
    Coop,
    Graph,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum AllocKind {
    Alloc,
    Pitch,
    Managed,
    Async,
    Pool,
    Create,
    Array,
    Array3d,
}

#[derive(Parser)]
#[command(about = "Drive libcuda.so.1 (real or fake) through one lookup path and print JSON")]
struct Cli {
    #[arg(long, value_enum, default_value = "symbol")]
    lookup: Lookup,
    /// Device ordinal whose primary context is made current.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// Resolve per-thread-default-stream variants (`_ptsz`) through cuGetProcAddress.
    #[arg(long)]
    ptsz: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Launch kernels of `--kernel-us` each, in batches followed by a synchronisation.
    Launch {
        #[arg(long, default_value_t = 1000)]
        kernel_us: u64,
        /// Stop after this many seconds (or after `--count` kernels).
        #[arg(long)]
        seconds: Option<f64>,
        #[arg(long)]
        count: Option<u64>,
        #[arg(long, default_value_t = 10)]
        batch: u64,
        #[arg(long, value_enum, default_value = "launch")]
        kind: LaunchKind,
        /// Interval of the (time, busy) samples in the output.
        #[arg(long, default_value_t = 250)]
        sample_ms: u64,
        /// CPU time (a sleep) after each batch's synchronisation, launching nothing: a
        /// framework's work between GPU bursts.
        #[arg(long, default_value_t = 0)]
        think_us: u64,
        /// CPU time spent (spinning) before each launch: a framework's cost per kernel, so
        /// that the CPU queues work at a known pace (`--kernel-us` / this = how far ahead).
        #[arg(long, default_value_t = 0)]
        launch_cpu_us: u64,
        /// CPU time (a sleep) after every `--pause-every` launches, without synchronising: a
        /// framework's pauses between launches (Python, its allocator) while its queue runs.
        #[arg(long, default_value_t = 0)]
        pause_us: u64,
        #[arg(long, default_value_t = 0)]
        pause_every: u64,
    },
    /// Allocate `--count` blocks of `--bytes`, print the outcome and the memory info, hold them,
    /// free them and print the memory info again.
    Alloc {
        #[arg(long, value_enum, default_value = "alloc")]
        kind: AllocKind,
        #[arg(long)]
        bytes: u64,
        #[arg(long, default_value_t = 1)]
        count: u64,
        #[arg(long, default_value_t = 0)]
        hold_ms: u64,
    },
    /// Print `cuMemGetInfo_v2` and `cuDeviceTotalMem_v2`.
    Meminfo,
    /// Virtual memory: create a handle of `--bytes`, map it, release it while mapped, try a
    /// second one, unmap; memory info after each step.
    Vmm {
        #[arg(long)]
        bytes: u64,
    },
    /// Allocate `--bytes` in a context, then end that context (`--how`); memory info after.
    CtxEnd {
        #[arg(long)]
        bytes: u64,
        #[arg(long, value_enum)]
        how: scenarios::CtxEnd,
    },
    /// Hold `--bytes`, keep a launching thread and a memory-querying thread busy, and fork
    /// `--children` children one after another; each allocates `--bytes`, launches kernels and
    /// exits. Prints each child's outcome and the parent's afterwards.
    Fork {
        #[arg(long)]
        bytes: u64,
        #[arg(long, default_value_t = 3)]
        children: u32,
        #[arg(long, default_value_t = 2000)]
        kernel_us: u64,
    },
    /// NVML memory info of device `--device` (without initialising CUDA, like nvidia-smi).
    Nvml,
    /// Per-launch cost of `cuLaunchKernel` through the lookup path (the hook's wrapper when
    /// preloaded) and of the fake's own function, interleaved, `--rounds` × `--launches`.
    /// Run with FAKE_CUDA_NOOP_LAUNCH=1 so that the fake's launch costs next to nothing.
    /// Unified-memory mode: every allocation path with `--bytes`, a `cuMemCreate`, one more
    /// allocation of `--extra`, `--kernels` launches, then the frees (see `um.rs`).
    UmPaths {
        #[arg(long)]
        bytes: u64,
        #[arg(long)]
        extra: u64,
        #[arg(long, default_value_t = 5)]
        kernels: u64,
        #[arg(long, default_value_t = 1000)]
        kernel_us: u64,
    },
    /// `launch`, holding `--hold-bytes` allocated with cuMemAlloc first (managed in
    /// unified-memory mode: each grant prefetches it).
    UmLaunch {
        #[arg(long)]
        hold_bytes: u64,
        #[arg(long, default_value_t = 1000)]
        kernel_us: u64,
        #[arg(long)]
        seconds: f64,
        #[arg(long, default_value_t = 250)]
        sample_ms: u64,
    },
    LaunchBench {
        #[arg(long, default_value_t = 200)]
        rounds: u32,
        #[arg(long, default_value_t = 20000)]
        launches: u32,
    },
}

/// `fakeCudaBusyMicros`: the fake's own export, no driver function.
type FnBusy = unsafe extern "C" fn(CUdevice) -> u64;

#[link(name = "cuda")]
unsafe extern "C" {
    fn cuInit(flags: c_uint) -> CUresult;
    fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult;
    fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult;
    fn cuCtxSynchronize() -> CUresult;
    fn cuLaunchKernel(
        f: CUfunction,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shmem: c_uint,
        s: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult;
    fn cuLaunchCooperativeKernel(
        f: CUfunction,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        shmem: c_uint,
        s: CUstream,
        params: *mut *mut c_void,
    ) -> CUresult;
    fn cuLaunchKernelEx(
        c: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult;
    fn cuGraphLaunch(g: CUgraphExec, s: CUstream) -> CUresult;
    fn cuMemAlloc_v2(p: *mut CUdeviceptr, n: usize) -> CUresult;
    fn cuMemAllocPitch_v2(
        p: *mut CUdeviceptr,
        pitch: *mut usize,
        w: usize,
        h: usize,
        e: c_uint,
    ) -> CUresult;
    fn cuMemAllocManaged(p: *mut CUdeviceptr, n: usize, flags: c_uint) -> CUresult;
    fn cuMemAllocAsync(p: *mut CUdeviceptr, n: usize, s: CUstream) -> CUresult;
    fn cuMemAllocFromPoolAsync(
        p: *mut CUdeviceptr,
        n: usize,
        pool: CUmemoryPool,
        s: CUstream,
    ) -> CUresult;
    fn cuMemFree_v2(p: CUdeviceptr) -> CUresult;
    fn cuMemFreeAsync(p: CUdeviceptr, s: CUstream) -> CUresult;
    fn cuMemCreate(
        h: *mut CUmemGenericAllocationHandle,
        n: usize,
        prop: *const CUmemAllocationProp,
        flags: u64,
    ) -> CUresult;
    fn cuMemRelease(h: CUmemGenericAllocationHandle) -> CUresult;
    fn cuArrayCreate_v2(a: *mut CUarray, d: *const CudaArrayDescriptor) -> CUresult;
    fn cuArray3DCreate_v2(a: *mut CUarray, d: *const CudaArray3dDescriptor) -> CUresult;
    fn cuArrayDestroy(a: CUarray) -> CUresult;
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult;
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult;
}

pub(crate) struct Api {
    lookup: Lookup,
    handle: *mut c_void,
    gpa: Option<pfn::cuGetProcAddress_v2>,
    flags: u64,
    init: pfn::cuInit,
    retain: pfn::cuDevicePrimaryCtxRetain,
    set_current: pfn::cuCtxSetCurrent,
    sync: pfn::cuCtxSynchronize,
    launch: pfn::cuLaunchKernel,
    coop: pfn::cuLaunchCooperativeKernel,
    launch_ex: pfn::cuLaunchKernelEx,
    graph: pfn::cuGraphLaunch,
    alloc: pfn::cuMemAlloc_v2,
    pitch: pfn::cuMemAllocPitch_v2,
    managed: pfn::cuMemAllocManaged,
    alloc_async: pfn::cuMemAllocAsync,
    pool: pfn::cuMemAllocFromPoolAsync,
    free: pfn::cuMemFree_v2,
    free_async: pfn::cuMemFreeAsync,
    create: pfn::cuMemCreate,
    release: pfn::cuMemRelease,
    array: pfn::cuArrayCreate_v2,
    array3d: pfn::cuArray3DCreate_v2,
    array_destroy: pfn::cuArrayDestroy,
    mem_info: pfn::cuMemGetInfo_v2,
    total_mem: pfn::cuDeviceTotalMem_v2,
    busy: Option<FnBusy>,
}

impl Api {
    /// `name` by `dlsym` on the library, whatever the lookup path: for entry points the hook
    /// does not wrap and whose base name `cuGetProcAddress` maps to another signature (the
    /// real driver answers `cuCtxCreate` with `_v3` at 12.0).
    ///
    /// # Safety
    /// `T` must be the function type of the named entry point.
    pub(crate) unsafe fn sym<T: Copy>(&self, name: &str) -> Result<T> {
        let c = CString::new(name)?;
        // SAFETY: dlsym on the library handle with a valid name.
        unsafe { cast(libc::dlsym(self.handle, c.as_ptr()), name) }
    }

    /// Any entry point, through the same lookup path as the rest (`symbol`: the dynamic
    /// linker's global scope, where a preloaded library comes first).
    ///
    /// # Safety
    /// `T` must be the function type of the named entry point.
    pub(crate) unsafe fn get<T: Copy>(&self, name: &str) -> Result<T> {
        let p = match (self.lookup, self.gpa) {
            (Lookup::Symbol, _) => {
                let c = CString::new(name)?;
                // SAFETY: dlsym with a valid name.
                unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) }
            }
            (Lookup::Proc, Some(gpa)) => {
                // cuGetProcAddress takes the base name and picks the variant by version: the
                // real driver finds no `cuDevicePrimaryCtxRelease_v2` (the fake did). 12.0, as
                // for the table above: from 13.0 `cuCtxCreate` is `_v4`, another signature.
                let base = CString::new(name.strip_suffix("_v2").unwrap_or(name))?;
                let mut p = std::ptr::null_mut();
                let mut st = 0;
                // SAFETY: cuGetProcAddress with valid out-pointers.
                unsafe { gpa(base.as_ptr(), &mut p, 12000, self.flags, &mut st) };
                p
            }
            // SAFETY: the caller names the right function type.
            _ => return unsafe { self.sym(name) },
        };
        // SAFETY: the caller names the right function type.
        unsafe { cast(p, name) }
    }
}

/// Looks a function pointer up and casts it to the right type.
///
/// # Safety
/// `T` must be the function type of the named entry point.
pub(crate) unsafe fn cast<T: Copy>(p: *mut c_void, name: &str) -> Result<T> {
    if p.is_null() {
        bail!("{name} not found");
    }
    // SAFETY: the caller names the right function type; function pointers are pointer-sized.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn dlopen_cuda() -> Result<*mut c_void> {
    // SAFETY: dlopen with a constant name.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        bail!("dlopen(libcuda.so.1) failed");
    }
    Ok(h)
}

fn load(lookup: Lookup, ptsz: bool) -> Result<Api> {
    let h = dlopen_cuda()?;
    let dl = |name: &str| -> *mut c_void {
        let c = CString::new(name).unwrap_or_default();
        // SAFETY: a valid handle and name; goes through the process's `dlsym` (the hook's if
        // it is preloaded), as a CUDA program's own dlsym would.
        unsafe { libc::dlsym(h, c.as_ptr()) }
    };
    // SAFETY: the fake's `fakeCudaBusyMicros` has this signature.
    let busy = unsafe { cast::<FnBusy>(dl("fakeCudaBusyMicros"), "fakeCudaBusyMicros").ok() };
    match lookup {
        Lookup::Symbol => Ok(Api {
            lookup,
            handle: h,
            gpa: None,
            flags: 0,
            init: cuInit,
            retain: cuDevicePrimaryCtxRetain,
            set_current: cuCtxSetCurrent,
            sync: cuCtxSynchronize,
            launch: cuLaunchKernel,
            coop: cuLaunchCooperativeKernel,
            launch_ex: cuLaunchKernelEx,
            graph: cuGraphLaunch,
            alloc: cuMemAlloc_v2,
            pitch: cuMemAllocPitch_v2,
            managed: cuMemAllocManaged,
            alloc_async: cuMemAllocAsync,
            pool: cuMemAllocFromPoolAsync,
            free: cuMemFree_v2,
            free_async: cuMemFreeAsync,
            create: cuMemCreate,
            release: cuMemRelease,
            array: cuArrayCreate_v2,
            array3d: cuArray3DCreate_v2,
            array_destroy: cuArrayDestroy,
            mem_info: cuMemGetInfo_v2,
            total_mem: cuDeviceTotalMem_v2,
            busy,
        }),
        // SAFETY: each `dl` name is cast to its own signature (`pfn::` of that name), as `cast`
        // requires.
        Lookup::Dlsym => unsafe {
            Ok(Api {
                lookup,
                handle: h,
                gpa: None,
                flags: 0,
                init: cast(dl("cuInit"), "cuInit")?,
                retain: cast(dl("cuDevicePrimaryCtxRetain"), "cuDevicePrimaryCtxRetain")?,
                set_current: cast(dl("cuCtxSetCurrent"), "cuCtxSetCurrent")?,
                sync: cast(dl("cuCtxSynchronize"), "cuCtxSynchronize")?,
                launch: cast(dl("cuLaunchKernel"), "cuLaunchKernel")?,
                coop: cast(dl("cuLaunchCooperativeKernel"), "cuLaunchCooperativeKernel")?,
                launch_ex: cast(dl("cuLaunchKernelEx"), "cuLaunchKernelEx")?,
                graph: cast(dl("cuGraphLaunch"), "cuGraphLaunch")?,
                alloc: cast(dl("cuMemAlloc_v2"), "cuMemAlloc_v2")?,
                pitch: cast(dl("cuMemAllocPitch_v2"), "cuMemAllocPitch_v2")?,
                managed: cast(dl("cuMemAllocManaged"), "cuMemAllocManaged")?,
                alloc_async: cast(dl("cuMemAllocAsync"), "cuMemAllocAsync")?,
                pool: cast(dl("cuMemAllocFromPoolAsync"), "cuMemAllocFromPoolAsync")?,
                free: cast(dl("cuMemFree_v2"), "cuMemFree_v2")?,
                free_async: cast(dl("cuMemFreeAsync"), "cuMemFreeAsync")?,
                create: cast(dl("cuMemCreate"), "cuMemCreate")?,
                release: cast(dl("cuMemRelease"), "cuMemRelease")?,
                array: cast(dl("cuArrayCreate_v2"), "cuArrayCreate_v2")?,
                array3d: cast(dl("cuArray3DCreate_v2"), "cuArray3DCreate_v2")?,
                array_destroy: cast(dl("cuArrayDestroy"), "cuArrayDestroy")?,
                mem_info: cast(dl("cuMemGetInfo_v2"), "cuMemGetInfo_v2")?,
                total_mem: cast(dl("cuDeviceTotalMem_v2"), "cuDeviceTotalMem_v2")?,
                busy,
            })
        },
        // SAFETY: `first` and `gpa` are the driver's `cuGetProcAddress_v2` ABI (12000 asks for
        // it), called with live local out-parameters; each name is then cast to its own
        // signature, as `cast` requires.
        Lookup::Proc => unsafe {
            let first: pfn::cuGetProcAddress_v2 =
                cast(dl("cuGetProcAddress_v2"), "cuGetProcAddress_v2")?;
            // Like cudart: fetch cuGetProcAddress itself through cuGetProcAddress_v2.
            let mut p = std::ptr::null_mut();
            let mut st = 0;
            let r = first(c"cuGetProcAddress".as_ptr(), &mut p, 12000, 0, &mut st);
            if r != 0 {
                bail!("cuGetProcAddress_v2(cuGetProcAddress) = {r}");
            }
            let gpa: pfn::cuGetProcAddress_v2 = cast(p, "cuGetProcAddress")?;
            let flags = if ptsz {
                CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
            } else {
                0
            };
            let get = |name: &str| -> *mut c_void {
                let c = CString::new(name).unwrap_or_default();
                let mut p = std::ptr::null_mut();
                let mut st = 0;
                gpa(c.as_ptr(), &mut p, 12000, flags, &mut st);
                p
            };
            Ok(Api {
                lookup,
                handle: h,
                gpa: Some(gpa),
                flags,
                init: cast(get("cuInit"), "cuInit")?,
                retain: cast(get("cuDevicePrimaryCtxRetain"), "cuDevicePrimaryCtxRetain")?,
                set_current: cast(get("cuCtxSetCurrent"), "cuCtxSetCurrent")?,
                sync: cast(get("cuCtxSynchronize"), "cuCtxSynchronize")?,
                launch: cast(get("cuLaunchKernel"), "cuLaunchKernel")?,
                coop: cast(
                    get("cuLaunchCooperativeKernel"),
                    "cuLaunchCooperativeKernel",
                )?,
                launch_ex: cast(get("cuLaunchKernelEx"), "cuLaunchKernelEx")?,
                graph: cast(get("cuGraphLaunch"), "cuGraphLaunch")?,
                alloc: cast(get("cuMemAlloc"), "cuMemAlloc")?,
                pitch: cast(get("cuMemAllocPitch"), "cuMemAllocPitch")?,
                managed: cast(get("cuMemAllocManaged"), "cuMemAllocManaged")?,
                alloc_async: cast(get("cuMemAllocAsync"), "cuMemAllocAsync")?,
                pool: cast(get("cuMemAllocFromPoolAsync"), "cuMemAllocFromPoolAsync")?,
                free: cast(get("cuMemFree"), "cuMemFree")?,
                free_async: cast(get("cuMemFreeAsync"), "cuMemFreeAsync")?,
                create: cast(get("cuMemCreate"), "cuMemCreate")?,
                release: cast(get("cuMemRelease"), "cuMemRelease")?,
                array: cast(get("cuArrayCreate"), "cuArrayCreate")?,
                array3d: cast(get("cuArray3DCreate"), "cuArray3DCreate")?,
                array_destroy: cast(get("cuArrayDestroy"), "cuArrayDestroy")?,
                mem_info: cast(get("cuMemGetInfo"), "cuMemGetInfo")?,
                total_mem: cast(get("cuDeviceTotalMem"), "cuDeviceTotalMem")?,
                busy,
            })
        },
    }
}

pub(crate) fn check(r: CUresult, what: &str) -> Result<()> {
    if r != CUDA_SUCCESS {
        bail!("{what} failed: CUresult {r}");
    }
    Ok(())
}

pub(crate) fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

pub(crate) fn mem_info(api: &Api, dev: i32) -> serde_json::Value {
    let (mut free, mut total, mut dev_total) = (0usize, 0usize, 0usize);
    // SAFETY: out-pointers to locals.
    let (r1, r2) = unsafe {
        (
            (api.mem_info)(&mut free, &mut total),
            (api.total_mem)(&mut dev_total, dev),
        )
    };
    json!({"free": free, "total": total, "device_total": dev_total, "rc": [r1, r2]})
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Cmd::Nvml = cli.cmd {
        return scenarios::nvml(cli.device);
    }
    let api = load(cli.lookup, cli.ptsz)?;
    let dev = cli.device;
    // SAFETY: driver calls with valid arguments.
    unsafe {
        check((api.init)(0), "cuInit")?;
        let mut ctx = std::ptr::null_mut();
        check((api.retain)(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
        check((api.set_current)(ctx), "cuCtxSetCurrent")?;
    }
    match cli.cmd {
        Cmd::Launch {
            kernel_us,
            seconds,
            count,
            batch,
            kind,
            sample_ms,
            think_us,
            launch_cpu_us,
            pause_us,
            pause_every,
        } => run_launch(
            &api,
            dev,
            seconds,
            count,
            Pace {
                kernel_us,
                batch: batch.max(1),
                think_us,
                launch_cpu_us,
                pause_us,
                pause_every,
            },
            kind,
            sample_ms,
        ),
        Cmd::Alloc {
            kind,
            bytes,
            count,
            hold_ms,
        } => run_alloc(&api, dev, kind, bytes, count, hold_ms),
        Cmd::Meminfo => {
            emit(mem_info(&api, dev));
            Ok(())
        }
        Cmd::Vmm { bytes } => scenarios::vmm(&api, dev, bytes),
        Cmd::CtxEnd { bytes, how } => scenarios::ctx_end(&api, dev, bytes, how),
        Cmd::Fork {
            bytes,
            children,
            kernel_us,
        } => scenarios::fork(&api, dev, bytes, children, kernel_us),
        Cmd::Nvml => unreachable!("handled before CUDA is initialised"),
        Cmd::UmPaths {
            bytes,
            extra,
            kernels,
            kernel_us,
        } => um::paths(&api, dev, bytes, extra, kernels, kernel_us),
        Cmd::UmLaunch {
            hold_bytes,
            kernel_us,
            seconds,
            sample_ms,
        } => {
            um::hold(&api, hold_bytes)?;
            run_launch(
                &api,
                dev,
                Some(seconds),
                None,
                Pace {
                    kernel_us,
                    batch: 10,
                    ..Pace::default()
                },
                LaunchKind::Launch,
                sample_ms,
            )?;
            emit(um::counters(&api, dev));
            Ok(())
        }
        Cmd::LaunchBench { rounds, launches } => {
            scenarios::launch_bench(&api, rounds, launches.max(1))
        }
    }
}

enum Held {
    Ptr(CUdeviceptr, bool),
    Handle(CUmemGenericAllocationHandle),
    Array(CUarray),
}

fn run_alloc(
    api: &Api,
    dev: i32,
    kind: AllocKind,
    bytes: u64,
    count: u64,
    hold_ms: u64,
) -> Result<()> {
    let n = usize::try_from(bytes).context("size")?;
    let mut held = vec![];
    let mut codes = vec![];
    for _ in 0..count {
        let mut p: CUdeviceptr = 0;
        // SAFETY: out-pointers to locals, descriptors built here.
        let (r, h) = unsafe {
            match kind {
                AllocKind::Alloc => ((api.alloc)(&mut p, n), Held::Ptr(p, false)),
                AllocKind::Pitch => {
                    let mut pitch = 0usize;
                    // `bytes` as 1024-byte-wide rows; the fake's pitch of 1024 is 1024.
                    let r = (api.pitch)(&mut p, &mut pitch, 1024, n / 1024, 4);
                    (r, Held::Ptr(p, false))
                }
                AllocKind::Managed => ((api.managed)(&mut p, n, 1), Held::Ptr(p, false)),
                AllocKind::Async => (
                    (api.alloc_async)(&mut p, n, std::ptr::null_mut()),
                    Held::Ptr(p, true),
                ),
                AllocKind::Pool => (
                    (api.pool)(&mut p, n, std::ptr::null_mut(), std::ptr::null_mut()),
                    Held::Ptr(p, true),
                ),
                AllocKind::Create => {
                    let prop = CUmemAllocationProp {
                        kind: 1,
                        requested_handle_types: 0,
                        location_type: 1,
                        location_id: dev,
                        win32_handle_meta_data: std::ptr::null_mut(),
                        alloc_flags: [0; 8],
                    };
                    let mut hd = 0;
                    let r = (api.create)(&mut hd, n, &prop, 0);
                    (r, Held::Handle(hd))
                }
                AllocKind::Array => {
                    let d = CudaArrayDescriptor {
                        width: n / 4,
                        height: 1,
                        format: 0x20,
                        num_channels: 1,
                    };
                    let mut a = std::ptr::null_mut();
                    let r = (api.array)(&mut a, &d);
                    (r, Held::Array(a))
                }
                AllocKind::Array3d => {
                    let d = CudaArray3dDescriptor {
                        width: n / 4,
                        height: 1,
                        depth: 1,
                        format: 0x20,
                        num_channels: 1,
                        flags: 0,
                    };
                    let mut a = std::ptr::null_mut();
                    let r = (api.array3d)(&mut a, &d);
                    (r, Held::Array(a))
                }
            }
        };
        // The out-value was written after the Held was built for pointer kinds: rebuild.
        let h = match h {
            Held::Ptr(_, asy) => Held::Ptr(p, asy),
            other => other,
        };
        codes.push(r);
        if r == CUDA_SUCCESS {
            held.push(h);
        }
    }
    emit(json!({"phase": "allocated", "codes": codes, "mem": mem_info(api, dev)}));
    std::thread::sleep(Duration::from_millis(hold_ms));
    let mut free_codes = vec![];
    for h in held {
        // SAFETY: handles returned by the allocations above.
        let r = unsafe {
            match h {
                Held::Ptr(p, false) => (api.free)(p),
                Held::Ptr(p, true) => (api.free_async)(p, std::ptr::null_mut()),
                Held::Handle(hd) => (api.release)(hd),
                Held::Array(a) => (api.array_destroy)(a),
            }
        };
        free_codes.push(r);
    }
    emit(json!({"phase": "freed", "codes": free_codes, "mem": mem_info(api, dev)}));
    Ok(())
}
