//! Gives the fake driver the real one's soname, and builds a link-time stub `libcuda.so` so
//! that the workload program can be linked against "libcuda" like a real CUDA program (its
//! symbol lookup path then goes through the dynamic linker, where LD_PRELOAD interposes).
use std::process::Command;

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");

    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    let names = [
        "cuInit",
        "cuDriverGetVersion",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetUuid",
        "cuDeviceTotalMem_v2",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuCtxSynchronize",
        "cuStreamCreate",
        "cuStreamSynchronize",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cuGraphLaunch",
        "cuMemAlloc_v2",
        "cuMemAllocPitch_v2",
        "cuMemAllocManaged",
        "cuMemAllocAsync",
        "cuMemAllocFromPoolAsync",
        "cuMemFree_v2",
        "cuMemFreeAsync",
        "cuMemCreate",
        "cuMemRelease",
        "cuArrayCreate_v2",
        "cuArray3DCreate_v2",
        "cuArrayDestroy",
        "cuMemGetInfo_v2",
        "cuGetProcAddress_v2",
    ];
    let mut src = String::from("#![allow(non_snake_case)]\n");
    for n in names {
        src.push_str(&format!(
            "#[unsafe(no_mangle)] pub extern \"C\" fn {n}() {{}}\n"
        ));
    }
    let stub = format!("{out}/cuda_stub.rs");
    std::fs::write(&stub, src).expect("write stub source");
    let status = Command::new(rustc)
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "cdylib",
            "--crate-name",
            "cuda",
            "--target",
        ])
        .arg(&target)
        .args(["-C", "link-arg=-Wl,-soname,libcuda.so.1", "-o"])
        .arg(format!("{out}/libcuda.so"))
        .arg(&stub)
        .status()
        .expect("run rustc for the link stub");
    assert!(status.success(), "building the libcuda link stub failed");
    println!("cargo:rustc-link-search=native={out}");
}
