//! The I/O edge of CDI: reads the host (device nodes, library directories) into a
//! [`HostView`], and writes the spec file atomically, only when its bytes change.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kubeshare_api::Layout;

use super::generate::{self, CONTROL_NODES, DirListing, EntryKind, HostView, LibMount};
use crate::source::InventorySource;

/// The directories NVIDIA's container toolkit searches for driver libraries when the
/// loader cache does not name them (its default search paths, x86_64 and arm64).
pub const DEFAULT_LIB_DIRS: [&str; 6] = [
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
];

/// The spec's file name in the spec directory (CDI reads `*.json` and `*.yaml`; one
/// file per kind, named after it, as NVIDIA's toolkit names `nvidia.com-gpu`).
pub const SPEC_FILE: &str = "kubeshare.io-gpu.json";

/// Where the spec goes and where the host's devices and libraries are looked for.
#[derive(Debug, Clone)]
pub struct CdiConfig {
    /// `/etc/cdi` or `/var/run/cdi` on a real node (the runtime's `cdi_spec_dirs`).
    pub spec_dir: PathBuf,
    pub dev_dir: PathBuf,
    pub lib_dirs: Vec<PathBuf>,
    pub layout: Layout,
}

/// Lists one directory; `None` when it does not exist or cannot be read.
pub fn list_dir(dir: &Path) -> Option<DirListing> {
    let rd = fs::read_dir(dir).ok()?;
    let mut entries = Vec::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(meta) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        let kind = if meta.file_type().is_symlink() {
            match fs::read_link(e.path()) {
                Ok(t) => EntryKind::Symlink(t.to_string_lossy().into_owned()),
                Err(_) => continue,
            }
        } else if meta.is_file() {
            EntryKind::File
        } else {
            EntryKind::Other
        };
        entries.push((name, kind));
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Some(DirListing {
        dir: dir.to_string_lossy().into_owned(),
        entries,
    })
}

/// The driver libraries in `dirs`, in order. Each directory is canonicalised first, so
/// that on merged-/usr hosts `/lib/x86_64-linux-gnu` (a link to `/usr/lib/…`) is read once.
pub fn discover_driver_libs(dirs: &[PathBuf]) -> Vec<LibMount> {
    let mut seen = BTreeSet::new();
    let listings: Vec<DirListing> = dirs
        .iter()
        .filter_map(|d| fs::canonicalize(d).ok())
        .filter(|d| seen.insert(d.clone()))
        .filter_map(|d| list_dir(&d))
        .collect();
    generate::select_driver_libs(&listings)
}

/// Reads the host into a [`HostView`].
pub fn host_view(cfg: &CdiConfig) -> HostView {
    HostView {
        dev_dir: cfg.dev_dir.to_string_lossy().into_owned(),
        control_nodes: CONTROL_NODES
            .iter()
            .filter(|n| cfg.dev_dir.join(n).exists())
            .map(|n| n.to_string())
            .collect(),
        libs: discover_driver_libs(&cfg.lib_dirs),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("generated an invalid CDI spec: {0}")]
    Invalid(#[from] super::spec::SpecError),
    #[error("cannot write the CDI spec {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// What [`sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    Written,
    Unchanged,
    /// The node has no GPU to offer, and the spec file is gone.
    Removed,
}

/// Writes the spec for `gpus` into the spec directory (temp file + rename, skipped when
/// the bytes are the same, so the runtime's directory watch sees no churn).
///
/// The file is deliberately not removed when the daemon stops: the runtime resolves CDI
/// names each time it creates a container, including when the kubelet restarts a
/// crashed container of a running pod. Removing the spec during a daemon restart or a
/// DaemonSet rollout would make those restarts fail ("unresolvable CDI devices") while
/// the GPUs themselves have not changed. It goes only when the node has no GPU left.
pub fn sync(
    cfg: &CdiConfig,
    gpus: &[kubeshare_api::GpuInfo],
    host: &HostView,
) -> Result<Synced, CdiError> {
    let path = cfg.spec_dir.join(SPEC_FILE);
    let werr = |source| CdiError::Write {
        path: path.clone(),
        source,
    };
    let Some(spec) = generate::gpu_spec(gpus, host, &cfg.layout) else {
        return match fs::remove_file(&path) {
            Ok(()) => Ok(Synced::Removed),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Synced::Unchanged),
            Err(e) => Err(werr(e)),
        };
    };
    spec.validate()?;
    let mut text = serde_json::to_string_pretty(&spec).expect("a spec serialises");
    text.push('\n');
    fs::create_dir_all(&cfg.spec_dir).map_err(werr)?;
    match crate::disk::write_if_changed(&path, text.as_bytes()) {
        Ok(true) => Ok(Synced::Written),
        Ok(false) => Ok(Synced::Unchanged),
        Err(e) => Err(werr(e)),
    }
}

/// Keeps the spec current: re-reads the inventory and the host every `every`. A failed
/// inventory read leaves the last spec in place (see [`sync`] on why it must stay).
pub async fn run(cfg: CdiConfig, inventory: InventorySource, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let gpus = match inventory.load() {
            Ok(inv) => inv.gpus,
            Err(e) => {
                tracing::warn!(error = %e, "CDI: GPU discovery failed; spec left as it was");
                continue;
            }
        };
        let host = host_view(&cfg);
        match sync(&cfg, &gpus, &host) {
            Ok(Synced::Unchanged) => {}
            Ok(s) => tracing::info!(
                dir = %cfg.spec_dir.display(),
                gpus = gpus.len(),
                libs = host.libs.len(),
                "CDI spec {s:?}"
            ),
            Err(e) => tracing::warn!(error = %e, "CDI spec not written"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const U0: &str = "GPU-00000000-0000-4000-8000-000000000000";

    fn gpu0() -> kubeshare_api::GpuInfo {
        serde_json::from_value(serde_json::json!({
            "uuid": U0, "index": 0, "model": "NVIDIA-H100", "memory": 1u64 << 34
        }))
        .unwrap()
    }

    #[test]
    fn reads_a_host_and_writes_the_spec_once() {
        let t = tempfile::tempdir().unwrap();
        let dev = t.path().join("dev");
        let lib = t.path().join("lib");
        let lib_link = t.path().join("lib-link");
        fs::create_dir_all(&dev).unwrap();
        fs::create_dir_all(&lib).unwrap();
        symlink(&lib, &lib_link).unwrap();
        fs::write(dev.join("nvidiactl"), "").unwrap();
        fs::write(lib.join("libcuda.so.1"), "elf").unwrap();
        symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
        fs::write(lib.join("libm.so.6"), "elf").unwrap();
        let cfg = CdiConfig {
            spec_dir: t.path().join("cdi"),
            dev_dir: dev.clone(),
            // The link and a missing dir: read once, skipped.
            lib_dirs: vec![lib.clone(), lib_link, t.path().join("none")],
            layout: Layout::new(t.path().join("ks")),
        };
        let host = host_view(&cfg);
        let canon = fs::canonicalize(&lib).unwrap();
        assert_eq!(
            host.control_nodes,
            BTreeSet::from(["nvidiactl".to_string()])
        );
        assert_eq!(
            host.libs,
            vec![
                LibMount {
                    host: format!("{}/libcuda.so.1", canon.display()),
                    container: format!("{}/libcuda.so", canon.display()),
                },
                LibMount {
                    host: format!("{}/libcuda.so.1", canon.display()),
                    container: format!("{}/libcuda.so.1", canon.display()),
                },
            ]
        );
        assert_eq!(sync(&cfg, &[gpu0()], &host).unwrap(), Synced::Written);
        let path = cfg.spec_dir.join(SPEC_FILE);
        let before = fs::metadata(&path).unwrap().modified().unwrap();
        let spec: super::super::spec::Spec =
            serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        spec.validate().unwrap();
        assert_eq!(spec.devices.len(), 2);
        assert_eq!(sync(&cfg, &[gpu0()], &host).unwrap(), Synced::Unchanged);
        assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), before);
        // No temp files left beside it (the runtime would try to parse them).
        let names: Vec<_> = fs::read_dir(&cfg.spec_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [SPEC_FILE]);
        assert_eq!(sync(&cfg, &[], &host).unwrap(), Synced::Removed);
        assert!(!path.exists());
        assert_eq!(sync(&cfg, &[], &host).unwrap(), Synced::Unchanged);
    }
}
