//! GPU discovery through NVML with the `nvml-wrapper` crate, which loads the library at
//! run time, so that the daemon starts (and can run in fake mode) on machines without an
//! NVIDIA driver.
//!
//! The inventory needs: count, UUID, name, index, memory, NUMA node (NVML, else sysfs
//! from the PCI bus id), and NVLink peer-to-peer status between pairs of GPUs (which
//! also covers GPUs joined through NVSwitches, where a link's remote end is the switch,
//! not the peer GPU). Calls an older driver lacks leave out what they give.
//!
//! [`Processes`] lists the processes with a compute context on each GPU, for the check
//! of GPU use that gem-schd does not gate (`crate::guard`).

use std::collections::BTreeMap;
use std::path::Path;

use kubeshare_api::inventory::model_from_nvml_name;
use kubeshare_api::{GpuInfo, NodeInventory};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};

#[derive(Debug, thiserror::Error)]
pub enum NvmlError {
    #[error("cannot load NVML from {lib}: {source}")]
    Load {
        lib: String,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("{call} failed: {source}")]
    Call {
        call: &'static str,
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("NVML returned an invalid inventory: {0}")]
    Invalid(#[from] kubeshare_api::InventoryError),
}

/// The default library name (the driver installs it; never link against it).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

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
    let nvml = Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .map_err(|source| NvmlError::Load {
            lib: library.display().to_string(),
            source,
        })?;
    // nvmlShutdown runs when `nvml` drops.
    let inv = read_all(&nvml)?;
    inv.validate()?;
    Ok(inv)
}

fn read_all(nvml: &Nvml) -> Result<NodeInventory, NvmlError> {
    let call = |call: &'static str| move |source| NvmlError::Call { call, source };
    let count = nvml.device_count().map_err(call("nvmlDeviceGetCount"))?;
    let mut devices = Vec::new();
    let mut gpus = Vec::new();
    for i in 0..count {
        let dev = nvml
            .device_by_index(i)
            .map_err(call("nvmlDeviceGetHandleByIndex"))?;
        let uuid = dev.uuid().map_err(call("nvmlDeviceGetUUID"))?;
        let name = dev.name().map_err(call("nvmlDeviceGetName"))?;
        let index = dev.index().map_err(call("nvmlDeviceGetIndex"))?;
        let memory = dev
            .memory_info()
            .map_err(call("nvmlDeviceGetMemoryInfo"))?
            .total;
        let numa_node = dev.numa_node_id().ok().or_else(|| {
            dev.pci_info()
                .ok()
                .and_then(|pci| numa_from_sysfs(&pci.bus_id))
        });
        gpus.push(GpuInfo {
            uuid,
            index,
            model: model_from_nvml_name(&name),
            memory,
            numa_node,
            nvlink_peers: vec![],
            held_by: None,
        });
        devices.push(dev);
    }
    for a in 0..devices.len() {
        for b in 0..devices.len() {
            if a != b
                && matches!(
                    devices[a].p2p_status(&devices[b], P2pCapabilitiesIndex::NvLink),
                    Ok(P2pStatus::Ok)
                )
            {
                let peer = gpus[b].uuid.clone();
                gpus[a].nvlink_peers.push(peer);
            }
        }
    }
    gpus.sort_by_key(|g| g.index);
    Ok(NodeInventory { gpus })
}

/// NVML kept open to list the GPUs' compute processes again and again.
pub struct Processes {
    nvml: Nvml,
}

impl Processes {
    pub fn open(library: &Path) -> Result<Processes, NvmlError> {
        let nvml = Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|source| NvmlError::Load {
                lib: library.display().to_string(),
                source,
            })?;
        Ok(Processes { nvml })
    }

    /// The PIDs (as this process's PID namespace numbers them) with a compute context on
    /// each GPU, by UUID.
    pub fn list(&self) -> Result<BTreeMap<String, Vec<u32>>, NvmlError> {
        let call = |call: &'static str| move |source| NvmlError::Call { call, source };
        let count = self
            .nvml
            .device_count()
            .map_err(call("nvmlDeviceGetCount"))?;
        let mut out = BTreeMap::new();
        for i in 0..count {
            let dev = self
                .nvml
                .device_by_index(i)
                .map_err(call("nvmlDeviceGetHandleByIndex"))?;
            let uuid = dev.uuid().map_err(call("nvmlDeviceGetUUID"))?;
            let procs = dev
                .running_compute_processes()
                .map_err(call("nvmlDeviceGetComputeRunningProcesses_v3"))?;
            out.insert(uuid, procs.into_iter().map(|p| p.pid).collect());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_error_not_a_crash() {
        let e = discover(Path::new("/nonexistent/libnvidia-ml.so.1")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("cannot load NVML from /nonexistent/libnvidia-ml.so.1"),
            "{e}"
        );
    }

    #[test]
    fn a_library_that_is_not_nvml_is_an_error() {
        let e = discover(Path::new("libc.so.6")).unwrap_err();
        assert!(e.to_string().contains("nvmlInit"), "{e}");
    }
}
