//! NVML's memory queries, answered with the pod's cap: `nvidia-smi` (and pynvml, DCGM-style
//! tools) in a capped pod show the cap as the total and the pod's use as used, as
//! `cuMemGetInfo` does. The device is named by its UUID (NVML handles are not CUDA ordinals,
//! and `nvidia-smi` never initialises CUDA): the pod's socket for that UUID is asked; a GPU
//! the pod has no socket for passes through unchanged.

use crate::config::{active, settings};
use crate::debug;
use crate::device::guard;
use crate::state::state;
use cuda_abi::nvml::*;
use gem_proto::{Client, socket_path};
use std::ffi::{CStr, c_char, c_uint, c_void};
use std::time::Duration;

#[allow(non_upper_case_globals)]
mod r {
    crate::nvml_slots!(
        nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetMemoryInfo_v2,
        nvmlDeviceGetUUID
    );
}

/// Like [`crate::real!`], with NVML's signatures and its "function not found" code.
macro_rules! nvml_real {
    ($name:ident $(, $arg:expr)* $(,)?) => {{
        let p = r::$name.get();
        if p.is_null() {
            NVML_ERROR_FUNCTION_NOT_FOUND
        } else {
            // SAFETY: the slot holds the address NVML exports under this name, whose signature
            // is `pfn::$name` (nvml.h's declaration); non-null checked above.
            let f = unsafe { std::mem::transmute::<*mut c_void, pfn::$name>(p) };
            #[allow(unused_unsafe)]
            // SAFETY: the wrappers forward their caller's arguments, bound by NVML's contract;
            // the hook's own call passes a live local buffer and its true length.
            unsafe {
                f($($arg),*)
            }
        }
    }};
}

fn uuid_of(dev: NvmlDevice) -> Option<String> {
    let mut buf = [0 as c_char; 96];
    let rc = nvml_real!(
        nvmlDeviceGetUUID,
        dev,
        buf.as_mut_ptr(),
        buf.len() as c_uint
    );
    if rc != NVML_SUCCESS {
        return None;
    }
    // SAFETY: NVML succeeded, so it wrote a NUL-terminated string of at most `buf.len()`
    // bytes (its terminator included) into the live buffer.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
    // Socket names use NVML's form: `GPU-` then lower-case hex (as NVML prints it).
    let s = s.to_str().ok()?;
    Some(match s.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("GPU-") => format!("GPU-{}", s[4..].to_ascii_lowercase()),
        _ => s.to_string(),
    })
}

/// The pod's (used, cap) on the GPU with this UUID, if the pod has a socket for it.
fn pod_memory(uuid: &str) -> Option<(u64, u64)> {
    // A CUDA process of the pod already talks to gem-schd about this GPU: reuse that.
    for (dev, g) in state().gpus.iter().enumerate() {
        if let Some(Some(u)) = g.uuid.get()
            && u.eq_ignore_ascii_case(uuid)
        {
            return crate::memory::mem_query(dev);
        }
    }
    let s = settings();
    let path = socket_path(&s.socket_dir, uuid);
    if !path.exists() {
        debug!(
            "NVML memory query: no socket {} (not this pod's GPU); passing through",
            path.display()
        );
        return None;
    }
    let timeout = Duration::from_millis(s.io_timeout_ms);
    let mut c = match Client::connect_timeout(&path, std::process::id(), uuid, Some(timeout)) {
        Ok(c) => c,
        Err(e) => {
            debug!("NVML memory query: gem-schd for {uuid}: {e}");
            return None;
        }
    };
    let cap = c.hello().mem_limit;
    match c.mem_query() {
        Ok(v) => Some(v),
        Err(_) => Some((c.hello().mem_used, cap)),
    }
}

fn capped(dev: NvmlDevice, total: u64) -> Option<(u64, u64, u64)> {
    if !active() {
        return None;
    }
    let Some(uuid) = uuid_of(dev) else {
        debug!("NVML memory query: no UUID for the device; passing through");
        return None;
    };
    let (used, cap) = guard(None, || pod_memory(&uuid))?;
    let total = total.min(cap);
    let used = used.min(total);
    Some((total, total - used, used))
}

/// NVML's `nvmlDeviceGetMemoryInfo`, capped.
///
/// # Safety
/// NVML's contract: `dev` is a handle NVML gave, `m` is null or a writable `nvmlMemory_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    dev: NvmlDevice,
    m: *mut NvmlMemory,
) -> NvmlReturn {
    let rc = nvml_real!(nvmlDeviceGetMemoryInfo, dev, m);
    if rc != NVML_SUCCESS || m.is_null() {
        return rc;
    }
    // SAFETY: non-null (checked), and the caller's writable struct, which NVML just filled.
    let m = unsafe { &mut *m };
    if let Some((total, free, used)) = capped(dev, m.total) {
        (m.total, m.free, m.used) = (total, free, used);
    }
    rc
}

/// NVML's `nvmlDeviceGetMemoryInfo_v2`, capped.
///
/// # Safety
/// NVML's contract: `dev` is a handle NVML gave, `m` is null or a writable `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    dev: NvmlDevice,
    m: *mut NvmlMemoryV2,
) -> NvmlReturn {
    let rc = nvml_real!(nvmlDeviceGetMemoryInfo_v2, dev, m);
    if rc != NVML_SUCCESS || m.is_null() {
        return rc;
    }
    // SAFETY: as in `nvmlDeviceGetMemoryInfo`.
    let m = unsafe { &mut *m };
    if let Some((total, free, used)) = capped(dev, m.total) {
        // The driver's reservation is not the pod's: the pod sees its cap, all usable.
        (m.total, m.reserved, m.free, m.used) = (total, 0, free, used);
    }
    rc
}

// The wrappers are exported under NVML's names: their signatures must be NVML's.
const _: pfn::nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo;
const _: pfn::nvmlDeviceGetMemoryInfo_v2 = nvmlDeviceGetMemoryInfo_v2;

/// The hook's function for an NVML name it wraps (for `dlsym`).
pub fn wrapper(name: &str) -> Option<*mut c_void> {
    match name {
        "nvmlDeviceGetMemoryInfo" => Some(nvmlDeviceGetMemoryInfo as *const () as *mut c_void),
        "nvmlDeviceGetMemoryInfo_v2" => {
            Some(nvmlDeviceGetMemoryInfo_v2 as *const () as *mut c_void)
        }
        _ => None,
    }
}
