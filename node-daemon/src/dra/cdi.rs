//! A prepared claim's CDI spec (pure): what a container that uses the claim gets. One
//! spec file per claim, of kind [`KIND`], with one device per allocated GPU
//! (`<claim uid>-<device>`, its `/dev/nvidiaN`) and, once per container, what the node's
//! spec gives every GPU (control nodes, the driver's libraries, the hook's directory
//! read-only; built by [`crate::cdi::generate::gpu_spec`]) plus what the webhook gives a
//! labelled pod and no webhook gives a claiming one: the hook's `LD_PRELOAD`,
//! `KUBESHARE_SOCKET_DIR` and the pod's socket directory, where gem-schd makes a socket
//! per GPU, and the unified-memory switches.
//!
//! A CDI env edit replaces a variable of the same name: a claiming container's own
//! `LD_PRELOAD` is lost. A container gets one KubeShare share: two claims in one
//! container would both mount a socket directory at the same place.

use kubeshare_api::layout::{self, Layout};
use kubeshare_api::um::{HOOK_UM_ENV, HOOK_UM_RESIDENT_ENV};
use kubeshare_api::{GpuInfo, Milli};

use super::claim::PreparedClaim;
use crate::cdi::generate::{HostView, gpu_spec};
use crate::cdi::spec::{ContainerEdits, Device, Mount, Spec, SpecError};

/// The kind of the claims' specs (`vendor/class`).
pub const KIND: &str = "kubeshare.io/claim";
/// The hook's variables (as the webhook sets them for a labelled pod, webhook/src/inject.rs).
pub const ENV_SOCKET_DIR: &str = "KUBESHARE_SOCKET_DIR";
pub const ENV_LD_PRELOAD: &str = "LD_PRELOAD";

/// The CDI device name of one device of a claim.
pub fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// The fully qualified CDI device ID the kubelet passes to the runtime.
pub fn device_id(claim_uid: &str, device: &str) -> String {
    format!("{KIND}={}", device_name(claim_uid, device))
}

/// The claim's spec file in the spec directory, named as CDI recommends
/// (`<vendor>-<class>_<name>.json`).
pub fn file_name(claim_uid: &str) -> String {
    format!("kubeshare.io-claim_{claim_uid}.json")
}

/// The spec of `claim`. Errors when a GPU cannot be described (a MIG instance, which
/// the node's spec leaves out too) or the spec would not pass the CDI library's checks.
pub fn claim_spec(
    claim: &PreparedClaim,
    host: &HostView,
    layout: &Layout,
) -> Result<Spec, SpecError> {
    let gpus: Vec<GpuInfo> = claim
        .devices
        .iter()
        .map(|d| GpuInfo {
            uuid: d.gpu_uuid.clone(),
            index: d.gpu_index,
            model: String::new(),
            memory: 0,
            numa_node: None,
            nvlink_peers: vec![],
            held_by: None,
        })
        .collect();
    let node = gpu_spec(&gpus, host, layout).ok_or(SpecError::NoDevices)?;
    let mut devices = Vec::new();
    for d in &claim.devices {
        let name = device_name(&claim.uid, &d.device);
        let gpu = node
            .devices
            .iter()
            .find(|n| n.name == d.gpu_uuid)
            .ok_or_else(|| SpecError::DeviceName(name.clone()))?;
        let mut edits = gpu.container_edits.clone();
        if let Some(resident) = d.um_resident {
            edits.env.push(format!("{HOOK_UM_ENV}=1"));
            edits.env.push(format!("{HOOK_UM_RESIDENT_ENV}={resident}"));
        }
        devices.push(Device {
            name,
            container_edits: edits,
        });
    }
    let mut common: ContainerEdits = node.container_edits;
    // A whole-GPU claim gets what the node's spec gives a whole-GPU labelled pod: the GPUs
    // alone, no hook.
    if !claim.whole {
        common.env.extend([
            format!("{ENV_SOCKET_DIR}={}", layout::POD_SOCKET_DIR),
            format!("{ENV_LD_PRELOAD}={}", layout::POD_HOOK_LIB),
        ]);
        common.mounts.push(Mount {
            host_path: layout
                .pod_dir(claim.client())
                .to_string_lossy()
                .into_owned(),
            container_path: layout::POD_SOCKET_DIR.to_string(),
            options: vec!["rw".into(), "nosuid".into(), "nodev".into(), "bind".into()],
        });
    }
    let spec = Spec {
        cdi_version: node.cdi_version,
        kind: KIND.to_string(),
        devices,
        container_edits: common,
    };
    spec.validate()?;
    Ok(spec)
}

/// A claim's shares for a log line: `0.3/0.6 of GPU-… (bytes)`, or `whole GPU-…`.
pub fn describe(claim: &PreparedClaim) -> String {
    if claim.whole {
        return claim
            .devices
            .iter()
            .map(|d| format!("whole {}", d.gpu_uuid))
            .collect::<Vec<_>>()
            .join(", ");
    }
    claim
        .devices
        .iter()
        .map(|d| {
            let m = |v| Milli::new(v).map_or_else(|| v.to_string(), |m| m.to_string());
            format!(
                "{}/{} of {} ({} bytes)",
                m(d.request_milli),
                m(d.limit_milli),
                d.gpu_uuid,
                d.memory_cap
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::super::claim::prepare;
    use super::super::claim::tests::{NODE, POD, U1, claim, inventory, opaque, result};
    use super::*;
    use crate::cdi::generate::LibMount;
    use serde_json::json;

    fn host() -> HostView {
        HostView {
            dev_dir: "/dev".into(),
            control_nodes: ["nvidiactl".to_string()].into(),
            libs: vec![LibMount {
                host: "/usr/lib64/libcuda.so.550.54.15".into(),
                container: "/usr/lib64/libcuda.so.1".into(),
            }],
        }
    }

    #[test]
    fn a_claims_spec_gives_its_gpu_the_hook_and_its_pods_sockets() {
        let c = claim(
            json!([result("gpu-1", "300", "2Gi")]),
            opaque(json!({"limit": "0.6"})),
            &[POD],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        let spec = claim_spec(&p, &host(), &Layout::new("/var/lib/kubeshare")).unwrap();
        assert_eq!(spec.kind, "kubeshare.io/claim");
        assert_eq!(spec.devices.len(), 1);
        assert_eq!(spec.devices[0].name, "claim-uid-1-gpu-1");
        assert_eq!(
            device_id("claim-uid-1", "gpu-1"),
            "kubeshare.io/claim=claim-uid-1-gpu-1"
        );
        let nodes: Vec<&str> = spec.devices[0]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(nodes, ["/dev/nvidia1"]);
        let c = &spec.container_edits;
        assert_eq!(
            c.env,
            [
                "KUBESHARE_SOCKET_DIR=/kubeshare/run",
                "LD_PRELOAD=/kubeshare/lib/libgemhook.so.1"
            ]
        );
        let mounts: Vec<(&str, &str)> = c
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect();
        assert_eq!(
            mounts,
            [
                ("/usr/lib64/libcuda.so.550.54.15", "/usr/lib64/libcuda.so.1"),
                ("/var/lib/kubeshare/lib", "/kubeshare/lib"),
                (
                    "/var/lib/kubeshare/pods/8d9e5c3a-1b2c-4d5e-8f90-0123456789ab",
                    "/kubeshare/run"
                ),
            ]
        );
        assert!(c.mounts[2].options.contains(&"rw".to_string()));
        assert_eq!(c.device_nodes[0].path, "/dev/nvidiactl");
        assert_eq!(
            file_name("claim-uid-1"),
            "kubeshare.io-claim_claim-uid-1.json"
        );
        assert_eq!(describe(&p), format!("0.3/0.6 of {U1} (2147483648 bytes)"));
    }

    #[test]
    fn unified_memory_and_two_gpus() {
        let c = claim(
            json!([result("gpu-0", "250", "1Gi"), result("gpu-1", "250", "1Gi")]),
            opaque(json!({"memoryMode": "unified"})),
            &[POD],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        let spec = claim_spec(&p, &host(), &Layout::default()).unwrap();
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["claim-uid-1-gpu-0", "claim-uid-1-gpu-1"]);
        for d in &spec.devices {
            assert_eq!(
                d.container_edits.env,
                [
                    "KUBESHARE_HOOK_UM=1",
                    "KUBESHARE_UM_RESIDENT_BYTES=1073741824"
                ]
            );
        }
        // The JSON a runtime reads.
        let v = serde_json::to_value(&spec).unwrap();
        assert_eq!(v["cdiVersion"], "0.6.0");
        assert_eq!(
            v["devices"][1]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidia1"
        );
    }

    #[test]
    fn a_whole_gpu_claim_gets_the_gpu_without_the_hook() {
        // No capacity requests: all of the GPU.
        let c = claim(
            json!([{"request": "gpu", "driver": "gpu.kubeshare.io", "pool": NODE, "device": "gpu-1"}]),
            json!(null),
            &[POD],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        assert!(p.whole);
        let spec = claim_spec(&p, &host(), &Layout::new("/var/lib/kubeshare")).unwrap();
        assert_eq!(spec.devices.len(), 1);
        let nodes: Vec<&str> = spec.devices[0]
            .container_edits
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(nodes, ["/dev/nvidia1"]);
        assert!(spec.devices[0].container_edits.env.is_empty());
        let c = &spec.container_edits;
        assert!(
            c.env.is_empty(),
            "no LD_PRELOAD, no socket dir: {:?}",
            c.env
        );
        let mounts: Vec<&str> = c.mounts.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(mounts, ["/usr/lib64/libcuda.so.1", "/kubeshare/lib"]);
        assert_eq!(c.device_nodes[0].path, "/dev/nvidiactl");
        assert_eq!(describe(&p), format!("whole {U1}"));
    }

    #[test]
    fn a_mig_instance_has_no_spec() {
        let mut inv = inventory();
        inv.gpus[0].uuid = "MIG-00000000-0000-4000-8000-000000000000".into();
        let c = claim(json!([result("gpu-0", "100", "1Gi")]), json!(null), &[POD]);
        let p = prepare(&c, "claim-uid-1", NODE, &inv).unwrap();
        assert_eq!(
            claim_spec(&p, &host(), &Layout::default()),
            Err(SpecError::NoDevices)
        );
    }
}
