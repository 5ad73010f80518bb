//! The node's CDI spec as a pure function of what the node has: its GPUs, the device
//! nodes present in the host's device directory, the driver libraries found in its
//! library directories, and KubeShare's host layout. No I/O here ([`super::host`] reads
//! the host).

use std::collections::BTreeSet;

use kubeshare_api::GpuInfo;
use kubeshare_api::layout::{self, Layout};

use super::spec::{CDI_VERSION, ContainerEdits, Device, DeviceNode, Mount, Spec};

/// The kind of the spec: `cdi.k8s.io/<name>: kubeshare.io/gpu=<index or UUID>` asks for a GPU.
pub const KIND: &str = "kubeshare.io/gpu";
/// Where devices live in a container (and, by default, on the host).
pub const CONTAINER_DEV_DIR: &str = "/dev";
/// The driver's control nodes a CUDA process opens besides its GPU's node; added when
/// the host has them (`nvidia-uvm*` appear once the uvm module is loaded).
pub const CONTROL_NODES: [&str; 3] = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"];

/// One driver library to bind into containers (same path inside as on the host, as
/// NVIDIA's toolkit does, so the image's loader finds it where the host's would).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LibMount {
    pub host: String,
    pub container: String,
}

/// What a directory entry is, as `lstat` tells (the pure input of library discovery).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    File,
    /// A symlink and its target as `readlink` returns it (relative or absolute).
    Symlink(String),
    Other,
}

/// The entries of one library directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirListing {
    /// The directory's canonical path.
    pub dir: String,
    pub entries: Vec<(String, EntryKind)>,
}

/// The libraries of the driver's user-space part a CUDA program needs: the CUDA driver
/// API and NVML (what NVIDIA's toolkit mounts for the `compute,utility` capabilities,
/// minus the rest of its list that KubeShare's workloads do not load).
pub fn is_driver_lib(name: &str) -> bool {
    ["libcuda.so", "libnvidia-ml.so"].iter().any(|stem| {
        name.strip_prefix(stem)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

/// Picks the driver libraries from directory listings, in search order. A regular file
/// is mounted at its own path; a symlink (`libcuda.so.1 -> libcuda.so.550.54.15`) is
/// mounted as the file it leads to within the same directory, so the container needs
/// no hook to recreate the link. A name found in an earlier directory wins over the same
/// name in a later one (ld.so's order); dangling or out-of-directory links are skipped.
pub fn select_driver_libs(listings: &[DirListing]) -> Vec<LibMount> {
    let mut out = Vec::new();
    let mut names = BTreeSet::new();
    for l in listings {
        let find = |name: &str| l.entries.iter().find(|(n, _)| n == name).map(|(_, k)| k);
        for (name, kind) in &l.entries {
            if !is_driver_lib(name) || names.contains(name) {
                continue;
            }
            let target = match kind {
                EntryKind::File => Some(name.clone()),
                EntryKind::Symlink(_) => {
                    // Follow links inside this directory, a few hops at most (no cycles).
                    let mut cur = kind.clone();
                    let mut hops = 0;
                    loop {
                        match cur {
                            EntryKind::Symlink(t) if hops < 8 => {
                                let t = t
                                    .strip_prefix(&format!("{}/", l.dir))
                                    .unwrap_or(&t)
                                    .to_string();
                                if t.contains('/') {
                                    break None;
                                }
                                match find(&t) {
                                    Some(EntryKind::File) => break Some(t),
                                    Some(k) => cur = k.clone(),
                                    None => break None,
                                }
                                hops += 1;
                            }
                            _ => break None,
                        }
                    }
                }
                EntryKind::Other => None,
            };
            if let Some(file) = target {
                names.insert(name.clone());
                out.push(LibMount {
                    host: format!("{}/{}", l.dir, file),
                    container: format!("{}/{}", l.dir, name),
                });
            }
        }
    }
    out.sort();
    out
}

/// What the host offers, as the I/O edge found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostView {
    /// The host's device directory (`/dev`, or a test's stand-in).
    pub dev_dir: String,
    /// Which of [`CONTROL_NODES`] exist there.
    pub control_nodes: BTreeSet<String>,
    pub libs: Vec<LibMount>,
}

fn node(host_dev_dir: &str, name: &str) -> DeviceNode {
    let path = format!("{CONTAINER_DEV_DIR}/{name}");
    let host = format!("{host_dev_dir}/{name}");
    DeviceNode {
        host_path: (host != path).then_some(host),
        path,
    }
}

/// The spec for kind [`KIND`]: per GPU, a device named by its index and one named by
/// its UUID, each adding the GPU's `/dev/nvidiaN`. The control nodes, driver libraries
/// and the hook's directory are spec-wide edits: the runtime applies them once to a
/// container that gets any of the devices. `None` when the node has no GPU to offer (a
/// spec without devices is invalid).
///
/// No env: a CDI env edit replaces a variable of the same name, so a spec that set
/// `LD_PRELOAD` would drop what the image or the webhook put there (the webhook appends
/// the hook to the pod's own `LD_PRELOAD`), and would give the hook to whole-GPU pods,
/// which the webhook does not. The webhook sets every variable (docs/webhook.md).
///
/// MIG instances (`MIG-` UUIDs) are left out: their nodes are the parent's plus
/// `/dev/nvidia-caps/*` capabilities, which this does not model.
pub fn gpu_spec(gpus: &[GpuInfo], host: &HostView, layout: &Layout) -> Option<Spec> {
    let mut gpus: Vec<&GpuInfo> = gpus.iter().filter(|g| g.uuid.starts_with("GPU-")).collect();
    gpus.sort_by_key(|g| g.index);
    if gpus.is_empty() {
        return None;
    }
    let mut devices = Vec::new();
    for g in gpus {
        let edits = ContainerEdits {
            device_nodes: vec![node(&host.dev_dir, &format!("nvidia{}", g.index))],
            ..Default::default()
        };
        for name in [g.index.to_string(), g.uuid.clone()] {
            devices.push(Device {
                name,
                container_edits: edits.clone(),
            });
        }
    }
    let device_nodes = CONTROL_NODES
        .iter()
        .filter(|n| host.control_nodes.contains(**n))
        .map(|n| node(&host.dev_dir, n))
        .collect();
    let mut mounts: Vec<Mount> = host
        .libs
        .iter()
        .map(|l| Mount::read_only_bind(&l.host, &l.container))
        .collect();
    mounts.push(Mount::read_only_bind(
        &layout.lib_dir().to_string_lossy(),
        layout::POD_LIB_DIR,
    ));
    Some(Spec {
        cdi_version: CDI_VERSION.to_string(),
        kind: KIND.to_string(),
        devices,
        container_edits: ContainerEdits {
            env: Vec::new(),
            device_nodes,
            hooks: Vec::new(),
            mounts,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const U0: &str = "GPU-00000000-0000-4000-8000-000000000000";
    const U1: &str = "GPU-11111111-1111-4111-8111-111111111111";

    fn gpu(index: u32, uuid: &str) -> GpuInfo {
        serde_json::from_value(serde_json::json!({
            "uuid": uuid, "index": index, "model": "NVIDIA-H100", "memory": 1u64 << 34
        }))
        .unwrap()
    }

    fn listing(dir: &str, entries: &[(&str, Option<&str>)]) -> DirListing {
        DirListing {
            dir: dir.into(),
            entries: entries
                .iter()
                .map(|(n, t)| {
                    let k = match t {
                        None => EntryKind::File,
                        Some(t) => EntryKind::Symlink(t.to_string()),
                    };
                    (n.to_string(), k)
                })
                .collect(),
        }
    }

    const LIB: &str = "/usr/lib/x86_64-linux-gnu";

    #[test]
    fn driver_libs_are_cuda_and_nvml_only() {
        for n in [
            "libcuda.so",
            "libcuda.so.1",
            "libcuda.so.550.54.15",
            "libnvidia-ml.so.1",
        ] {
            assert!(is_driver_lib(n), "{n}");
        }
        for n in [
            "libcudart.so.12",
            "libcuda.a",
            "libnvidia-mlx.so",
            "libc.so.6",
            "xlibcuda.so",
        ] {
            assert!(!is_driver_lib(n), "{n}");
        }
    }

    #[test]
    fn links_are_mounted_as_the_file_they_lead_to() {
        let l = listing(
            LIB,
            &[
                ("libcuda.so", Some("libcuda.so.1")),
                ("libcuda.so.1", Some("libcuda.so.550.54.15")),
                ("libcuda.so.550.54.15", None),
                (
                    "libnvidia-ml.so.1",
                    Some(&format!("{LIB}/libnvidia-ml.so.550.54.15")),
                ),
                ("libnvidia-ml.so.550.54.15", None),
                ("libc.so.6", None),
                ("libcuda.so.dangling", Some("libcuda.so.gone")),
                ("libnvidia-ml.so", Some("../elsewhere/libnvidia-ml.so")),
            ],
        );
        let got = select_driver_libs(&[l]);
        let want: Vec<(String, String)> = [
            ("libcuda.so.550.54.15", "libcuda.so"),
            ("libcuda.so.550.54.15", "libcuda.so.1"),
            ("libcuda.so.550.54.15", "libcuda.so.550.54.15"),
            ("libnvidia-ml.so.550.54.15", "libnvidia-ml.so.1"),
            ("libnvidia-ml.so.550.54.15", "libnvidia-ml.so.550.54.15"),
        ]
        .iter()
        .map(|(h, c)| (format!("{LIB}/{h}"), format!("{LIB}/{c}")))
        .collect();
        let got: Vec<(String, String)> = got.into_iter().map(|m| (m.host, m.container)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn link_cycles_end_and_earlier_dirs_win() {
        let a = listing("/usr/lib64", &[("libcuda.so.1", None)]);
        let b = listing(
            LIB,
            &[
                ("libcuda.so.1", None),
                ("libnvidia-ml.so", Some("libnvidia-ml.so.1")),
                ("libnvidia-ml.so.1", Some("libnvidia-ml.so")),
            ],
        );
        let got = select_driver_libs(&[a, b]);
        assert_eq!(
            got,
            vec![LibMount {
                host: "/usr/lib64/libcuda.so.1".into(),
                container: "/usr/lib64/libcuda.so.1".into()
            }]
        );
    }

    fn host(dev_dir: &str, control: &[&str]) -> HostView {
        HostView {
            dev_dir: dev_dir.into(),
            control_nodes: control.iter().map(|s| s.to_string()).collect(),
            libs: vec![LibMount {
                host: format!("{LIB}/libcuda.so.550.54.15"),
                container: format!("{LIB}/libcuda.so.1"),
            }],
        }
    }

    #[test]
    fn one_device_per_gpu_by_index_and_by_uuid() {
        let spec = gpu_spec(
            &[gpu(1, U1), gpu(0, U0)],
            &host("/dev", &["nvidiactl", "nvidia-uvm"]),
            &Layout::default(),
        )
        .unwrap();
        spec.validate().unwrap();
        assert_eq!(spec.kind, "kubeshare.io/gpu");
        let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["0", U0, "1", U1]);
        let node_of = |name: &str| {
            let d = spec.devices.iter().find(|d| d.name == name).unwrap();
            d.container_edits.device_nodes.clone()
        };
        assert_eq!(
            node_of(U1),
            vec![DeviceNode {
                path: "/dev/nvidia1".into(),
                host_path: None
            }]
        );
        assert_eq!(node_of("1"), node_of(U1));
        let common = &spec.container_edits;
        let control: Vec<&str> = common
            .device_nodes
            .iter()
            .map(|n| n.path.as_str())
            .collect();
        assert_eq!(control, ["/dev/nvidiactl", "/dev/nvidia-uvm"]);
        // Env is the webhook's: a CDI env edit would replace the pod's LD_PRELOAD.
        assert!(common.env.is_empty(), "{:?}", common.env);
        assert!(
            spec.devices
                .iter()
                .all(|d| d.container_edits.env.is_empty()),
            "{:?}",
            spec.devices
        );
        let mounts: Vec<(&str, &str)> = common
            .mounts
            .iter()
            .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
            .collect();
        assert_eq!(
            mounts,
            [
                (
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
                ),
                ("/var/lib/kubeshare/lib", "/kubeshare/lib"),
            ]
        );
        assert!(
            common
                .mounts
                .iter()
                .all(|m| m.options.contains(&"ro".to_string()))
        );
    }

    #[test]
    fn a_stand_in_dev_dir_is_the_host_path_and_the_root_is_the_layouts() {
        let spec = gpu_spec(
            &[gpu(0, U0)],
            &host("/run/fake-dev", &["nvidiactl"]),
            &Layout::new("/srv/ks"),
        )
        .unwrap();
        spec.validate().unwrap();
        assert_eq!(
            spec.devices[0].container_edits.device_nodes[0],
            DeviceNode {
                path: "/dev/nvidia0".into(),
                host_path: Some("/run/fake-dev/nvidia0".into())
            }
        );
        assert_eq!(
            spec.container_edits.device_nodes[0].host_path.as_deref(),
            Some("/run/fake-dev/nvidiactl")
        );
        assert_eq!(spec.container_edits.mounts[1].host_path, "/srv/ks/lib");
    }

    #[test]
    fn no_gpus_or_only_mig_gives_no_spec() {
        let h = host("/dev", &[]);
        assert_eq!(gpu_spec(&[], &h, &Layout::default()), None);
        let mig = gpu(0, "MIG-00000000-0000-4000-8000-000000000000");
        assert_eq!(gpu_spec(&[mig], &h, &Layout::default()), None);
    }

    #[test]
    fn the_spec_round_trips_through_json() {
        let spec = gpu_spec(
            &[gpu(0, U0), gpu(1, U1)],
            &host("/dev", &CONTROL_NODES),
            &Layout::default(),
        )
        .unwrap();
        let text = serde_json::to_string_pretty(&spec).unwrap();
        let back: super::super::spec::Spec = serde_json::from_str(&text).unwrap();
        assert_eq!(back, spec);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["cdiVersion"], "0.6.0");
        assert_eq!(
            v["devices"][1]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidia0"
        );
        assert_eq!(
            v["containerEdits"]["mounts"][0]["hostPath"],
            format!("{LIB}/libcuda.so.550.54.15")
        );
    }
}
