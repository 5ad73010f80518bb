//! GPU discovery through NVML, loaded at run time with `dlopen`, so that the daemon
//! starts (and can run in fake mode) on machines without an NVIDIA driver.
//!
//! Only the few calls needed for the inventory are bound: count, handle, UUID, name,
//! index, memory, PCI bus id, NUMA node, and NVLink peer-to-peer status between pairs
//! of GPUs (which also covers GPUs joined through NVSwitches, where a link's remote
//! end is the switch, not the peer GPU).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::Path;

use kubeshare_api::inventory::model_from_nvml_name;
use kubeshare_api::{GpuInfo, NodeInventory};
use libloading::Library;

type Ret = c_int;
type Device = *mut c_void;

const NVML_SUCCESS: Ret = 0;
/// `NVML_P2P_CAPS_INDEX_NVLINK`.
const P2P_CAPS_INDEX_NVLINK: c_int = 2;
/// `NVML_P2P_STATUS_OK`.
const P2P_STATUS_OK: c_int = 0;
/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`, `NVML_DEVICE_NAME_V2_BUFFER_SIZE`.
const BUF: usize = 96;

#[repr(C)]
struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlPciInfo_t` (as filled by `nvmlDeviceGetPciInfo_v3`).
#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load {lib}: {source}")]
    Load {
        lib: String,
        source: libloading::Error,
    },
    #[error("{lib} lacks {symbol}: {source}")]
    Symbol {
        lib: String,
        symbol: &'static str,
        source: libloading::Error,
    },
    #[error("{call} failed: {message} (NVML error {code})")]
    Call {
        call: &'static str,
        code: Ret,
        message: String,
    },
    #[error("NVML returned an invalid inventory: {0}")]
    Invalid(#[from] kubeshare_api::InventoryError),
}

/// The default library name (the driver installs it; never link against it).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

struct Nvml {
    lib: Library,
    name: String,
}

impl Nvml {
    fn open(path: &Path) -> Result<Nvml, NvmlError> {
        let name = path.display().to_string();
        // SAFETY: loading the NVIDIA management library runs its initialisers, which
        // is what every NVML user does; we call nothing before nvmlInit.
        let lib = unsafe { Library::new(path) }.map_err(|source| NvmlError::Load {
            lib: name.clone(),
            source,
        })?;
        Ok(Nvml { lib, name })
    }

    fn sym<T: Copy>(&self, symbol: &'static str) -> Result<T, NvmlError> {
        // SAFETY: every T used below is the C signature that nvml.h declares for `symbol`.
        unsafe { self.lib.get::<T>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|source| NvmlError::Symbol {
                lib: self.name.clone(),
                symbol,
                source,
            })
    }

    fn check(&self, call: &'static str, code: Ret) -> Result<(), NvmlError> {
        if code == NVML_SUCCESS {
            return Ok(());
        }
        let message = self
            .sym::<unsafe extern "C" fn(Ret) -> *const c_char>("nvmlErrorString")
            .ok()
            .map(|f| {
                // SAFETY: nvmlErrorString returns a static NUL-terminated string.
                let p = unsafe { f(code) };
                if p.is_null() {
                    String::new()
                } else {
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            })
            .unwrap_or_default();
        Err(NvmlError::Call {
            call,
            code,
            message,
        })
    }

    fn string(&self, call: &'static str, dev: Device) -> Result<String, NvmlError> {
        let f = self.sym::<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Ret>(call)?;
        let mut buf = [0 as c_char; BUF];
        // SAFETY: the buffer is BUF bytes and we say so; NVML NUL-terminates within it.
        self.check(call, unsafe { f(dev, buf.as_mut_ptr(), BUF as c_uint) })?;
        buf[BUF - 1] = 0;
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The NUMA node of a PCI device from sysfs (`-1` there means none).
fn numa_from_sysfs(bus_id: &str) -> Option<u32> {
    // NVML writes an 8-digit domain (`00000000:17:00.0`); sysfs uses 4 (`0000:17:00.0`).
    let id = bus_id.to_ascii_lowercase();
    let id = match id.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => id,
    };
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{id}/numa_node")).ok()?;
    text.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// Reads the node's GPUs through NVML at `library`.
pub fn discover(library: &Path) -> Result<NodeInventory, NvmlError> {
    let nvml = Nvml::open(library)?;
    let init = nvml.sym::<unsafe extern "C" fn() -> Ret>("nvmlInit_v2")?;
    // SAFETY: plain C calls with the signatures of nvml.h.
    nvml.check("nvmlInit_v2", unsafe { init() })?;
    let result = read_all(&nvml);
    if let Ok(shutdown) = nvml.sym::<unsafe extern "C" fn() -> Ret>("nvmlShutdown") {
        unsafe { shutdown() };
    }
    let inv = result?;
    inv.validate()?;
    Ok(inv)
}

fn read_all(nvml: &Nvml) -> Result<NodeInventory, NvmlError> {
    let count_f = nvml.sym::<unsafe extern "C" fn(*mut c_uint) -> Ret>("nvmlDeviceGetCount_v2")?;
    let handle_f = nvml
        .sym::<unsafe extern "C" fn(c_uint, *mut Device) -> Ret>("nvmlDeviceGetHandleByIndex_v2")?;
    let index_f =
        nvml.sym::<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>("nvmlDeviceGetIndex")?;
    let mem_f =
        nvml.sym::<unsafe extern "C" fn(Device, *mut Memory) -> Ret>("nvmlDeviceGetMemoryInfo")?;
    // Optional calls: older drivers lack some; the inventory then omits what they give.
    let pci_f = nvml
        .sym::<unsafe extern "C" fn(Device, *mut PciInfo) -> Ret>("nvmlDeviceGetPciInfo_v3")
        .ok();
    let numa_f = nvml
        .sym::<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>("nvmlDeviceGetNumaNodeId")
        .ok();
    let p2p_f = nvml
        .sym::<unsafe extern "C" fn(Device, Device, c_int, *mut c_int) -> Ret>(
            "nvmlDeviceGetP2PStatus",
        )
        .ok();

    let mut count: c_uint = 0;
    // SAFETY (this function): C calls with nvml.h signatures and valid out-pointers;
    // device handles come from NVML and are used while it is initialised.
    nvml.check("nvmlDeviceGetCount_v2", unsafe { count_f(&mut count) })?;
    let mut devices = Vec::new();
    let mut gpus = Vec::new();
    for i in 0..count {
        let mut dev: Device = std::ptr::null_mut();
        nvml.check("nvmlDeviceGetHandleByIndex_v2", unsafe {
            handle_f(i, &mut dev)
        })?;
        let uuid = nvml.string("nvmlDeviceGetUUID", dev)?;
        let name = nvml.string("nvmlDeviceGetName", dev)?;
        let mut index: c_uint = i;
        nvml.check("nvmlDeviceGetIndex", unsafe { index_f(dev, &mut index) })?;
        let mut mem = Memory {
            total: 0,
            free: 0,
            used: 0,
        };
        nvml.check("nvmlDeviceGetMemoryInfo", unsafe { mem_f(dev, &mut mem) })?;
        let mut numa_node = numa_f.and_then(|f| {
            let mut n: c_uint = 0;
            (unsafe { f(dev, &mut n) } == NVML_SUCCESS).then_some(n)
        });
        if numa_node.is_none()
            && let Some(f) = pci_f
        {
            // SAFETY: PciInfo is plain integers and bytes; all-zero is a valid value.
            let mut pci: PciInfo = unsafe { std::mem::zeroed() };
            if unsafe { f(dev, &mut pci) } == NVML_SUCCESS {
                numa_node = numa_from_sysfs(&c_chars_to_string(&pci.bus_id));
            }
        }
        devices.push(dev);
        gpus.push(GpuInfo {
            uuid,
            index,
            model: model_from_nvml_name(&name),
            memory: mem.total,
            numa_node,
            nvlink_peers: vec![],
        });
    }
    if let Some(p2p) = p2p_f {
        for a in 0..devices.len() {
            for b in 0..devices.len() {
                if a == b {
                    continue;
                }
                let mut status: c_int = -1;
                let rc = unsafe { p2p(devices[a], devices[b], P2P_CAPS_INDEX_NVLINK, &mut status) };
                if rc == NVML_SUCCESS && status == P2P_STATUS_OK {
                    let peer = gpus[b].uuid.clone();
                    gpus[a].nvlink_peers.push(peer);
                }
            }
        }
    }
    gpus.sort_by_key(|g| g.index);
    Ok(NodeInventory { gpus })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_not_a_crash() {
        let e = discover(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot load /nonexistent/libnvidia-ml.so.1"),
            "{e}"
        );
    }

    #[test]
    fn a_library_that_is_not_nvml_is_an_error() {
        let e = discover(Path::new("libc.so.6")).unwrap_err();
        assert!(e.to_string().contains("lacks nvmlInit_v2"), "{e}");
    }

    #[test]
    fn c_strings() {
        let raw: Vec<c_char> = b"00000000:17:00.0\0junk"
            .iter()
            .map(|b| *b as c_char)
            .collect();
        assert_eq!(c_chars_to_string(&raw), "00000000:17:00.0");
    }
}
