//! The subset of the Container Device Interface spec format the node daemon writes
//! (<https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md>), and a
//! check of the fields the CDI library requires before a runtime will use a spec.
//!
//! Field names and omission rules follow the reference Go types (`specs-go/config.go`),
//! so a spec written here reads back the same through containerd's CDI cache.

use serde::{Deserialize, Serialize};

/// The CDI format version the spec declares: 0.6.0 is the oldest that accepts
/// everything written here, and every CDI-enabled runtime (containerd 1.7+, CRI-O
/// 1.28+, the NVIDIA container toolkit) reads it. Runtimes refuse a spec newer than
/// their library, so the lowest version that fits is the most portable.
pub const CDI_VERSION: &str = "0.6.0";

/// One CDI spec file: a kind and its devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    /// `vendor/class`, e.g. `kubeshare.io/gpu`.
    pub kind: String,
    pub devices: Vec<Device>,
    /// Edits applied once to a container that gets any device of this spec.
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `KEY=VALUE` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    pub fn is_empty(&self) -> bool {
        self.env.is_empty()
            && self.device_nodes.is_empty()
            && self.hooks.is_empty()
            && self.mounts.is_empty()
    }
}

/// A device node; the runtime reads its type and major/minor from `host_path` (or
/// `path`) when the container is created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host, when it differs from `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Mount {
    /// A read-only bind mount (what NVIDIA's toolkit writes for driver files).
    pub fn read_only_bind(host: &str, container: &str) -> Mount {
        Mount {
            host_path: host.to_string(),
            container_path: container.to_string(),
            options: vec!["ro".into(), "nosuid".into(), "nodev".into(), "bind".into()],
        }
    }
}

/// An OCI hook (none written today; part of the format so a spec that has them parses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

/// Why a spec would be refused by the CDI library (`pkg/cdi` validation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("cdiVersion {0:?} is not a version this writer knows")]
    Version(String),
    #[error("kind {0:?} is not vendor/class")]
    Kind(String),
    #[error("the spec has no devices")]
    NoDevices,
    #[error("device name {0:?} is not valid")]
    DeviceName(String),
    #[error("device {0:?} appears twice")]
    DuplicateDevice(String),
    #[error("device {0:?} has no container edits")]
    EmptyDevice(String),
    #[error("{what} {path:?} is not an absolute path")]
    RelativePath { what: &'static str, path: String },
    #[error("env entry {0:?} is not KEY=VALUE")]
    Env(String),
}

fn alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// Vendor: starts with a letter, ends with a letter or digit, letters, digits, `-_.` between.
fn valid_vendor(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.ends_with(alnum)
        && s.chars().all(|c| alnum(c) || "-_.".contains(c))
}

/// Class: as a vendor, without dots.
fn valid_class(s: &str) -> bool {
    valid_vendor(s) && !s.contains('.')
}

/// Device name: starts and ends with a letter or digit, letters, digits, `-_.:` between.
pub fn valid_device_name(s: &str) -> bool {
    s.starts_with(alnum) && s.ends_with(alnum) && s.chars().all(|c| alnum(c) || "-_.:".contains(c))
}

fn absolute(what: &'static str, path: &str) -> Result<(), SpecError> {
    if path.starts_with('/') {
        Ok(())
    } else {
        Err(SpecError::RelativePath {
            what,
            path: path.to_string(),
        })
    }
}

fn validate_edits(e: &ContainerEdits) -> Result<(), SpecError> {
    for v in &e.env {
        match v.split_once('=') {
            Some((k, _)) if !k.is_empty() => {}
            _ => return Err(SpecError::Env(v.clone())),
        }
    }
    for d in &e.device_nodes {
        absolute("device node", &d.path)?;
        if let Some(h) = &d.host_path {
            absolute("device node host path", h)?;
        }
    }
    for m in &e.mounts {
        absolute("mount host path", &m.host_path)?;
        absolute("mount container path", &m.container_path)?;
    }
    for h in &e.hooks {
        absolute("hook", &h.path)?;
    }
    Ok(())
}

impl Spec {
    /// The checks `cdi.ValidateSpec` makes on the fields written here.
    pub fn validate(&self) -> Result<(), SpecError> {
        let known = [
            "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0",
        ];
        if !known.contains(&self.cdi_version.as_str()) {
            return Err(SpecError::Version(self.cdi_version.clone()));
        }
        match self.kind.split_once('/') {
            Some((v, c)) if valid_vendor(v) && valid_class(c) => {}
            _ => return Err(SpecError::Kind(self.kind.clone())),
        }
        if self.devices.is_empty() {
            return Err(SpecError::NoDevices);
        }
        validate_edits(&self.container_edits)?;
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.devices {
            if !valid_device_name(&d.name) {
                return Err(SpecError::DeviceName(d.name.clone()));
            }
            if !seen.insert(d.name.as_str()) {
                return Err(SpecError::DuplicateDevice(d.name.clone()));
            }
            if d.container_edits.is_empty() {
                return Err(SpecError::EmptyDevice(d.name.clone()));
            }
            validate_edits(&d.container_edits)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one() -> Spec {
        Spec {
            cdi_version: CDI_VERSION.into(),
            kind: "kubeshare.io/gpu".into(),
            devices: vec![Device {
                name: "0".into(),
                container_edits: ContainerEdits {
                    device_nodes: vec![DeviceNode {
                        path: "/dev/nvidia0".into(),
                        host_path: None,
                    }],
                    ..Default::default()
                },
            }],
            container_edits: ContainerEdits::default(),
        }
    }

    #[test]
    fn a_minimal_spec_is_valid_and_omits_empty_fields() {
        let s = one();
        s.validate().unwrap();
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "cdiVersion": "0.6.0",
                "kind": "kubeshare.io/gpu",
                "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]
            })
        );
    }

    #[test]
    fn parses_a_spec_with_hooks_as_nvidia_writes_them() {
        let text = r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"all",
            "containerEdits":{"deviceNodes":[{"path":"/dev/nvidia0"}]}}],
            "containerEdits":{"env":["NVIDIA_VISIBLE_DEVICES=void"],"hooks":[{"hookName":"createContainer",
            "path":"/usr/bin/nvidia-cdi-hook","args":["nvidia-cdi-hook","update-ldcache"]}],
            "mounts":[{"hostPath":"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
            "containerPath":"/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15","options":["ro","nosuid","nodev","bind"]}]}}"#;
        let s: Spec = serde_json::from_str(text).unwrap();
        s.validate().unwrap();
        assert_eq!(s.container_edits.hooks[0].hook_name, "createContainer");
        let back: Spec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn refuses_what_the_cdi_library_refuses() {
        let mut s = one();
        s.cdi_version = "0.6".into();
        assert!(matches!(s.validate(), Err(SpecError::Version(_))));
        for kind in [
            "kubeshare.io",
            "kubeshare.io/gpu.x",
            "/gpu",
            "1vendor/gpu",
            "v/",
        ] {
            let mut s = one();
            s.kind = kind.into();
            assert!(matches!(s.validate(), Err(SpecError::Kind(_))), "{kind}");
        }
        let mut s = one();
        s.devices.clear();
        assert_eq!(s.validate(), Err(SpecError::NoDevices));
        for name in ["", "-a", "a-", "a/b", "a b"] {
            let mut s = one();
            s.devices[0].name = name.into();
            assert!(
                matches!(s.validate(), Err(SpecError::DeviceName(_))),
                "{name:?}"
            );
        }
        let mut s = one();
        s.devices.push(s.devices[0].clone());
        assert!(matches!(s.validate(), Err(SpecError::DuplicateDevice(_))));
        let mut s = one();
        s.devices[0].container_edits = ContainerEdits::default();
        assert!(matches!(s.validate(), Err(SpecError::EmptyDevice(_))));
        let mut s = one();
        s.devices[0].container_edits.device_nodes[0].path = "dev/nvidia0".into();
        assert!(matches!(s.validate(), Err(SpecError::RelativePath { .. })));
        let mut s = one();
        s.container_edits.env.push("=x".into());
        assert!(matches!(s.validate(), Err(SpecError::Env(_))));
        let mut s = one();
        s.container_edits
            .mounts
            .push(Mount::read_only_bind("/a", "b"));
        assert!(matches!(s.validate(), Err(SpecError::RelativePath { .. })));
    }

    #[test]
    fn gpu_uuids_and_indices_are_valid_device_names() {
        assert!(valid_device_name(
            "GPU-8d5e2f8a-0c3b-4a51-9c2e-5f1d7a3b9e01"
        ));
        assert!(valid_device_name(
            "MIG-8d5e2f8a-0c3b-4a51-9c2e-5f1d7a3b9e01"
        ));
        assert!(valid_device_name("0"));
        assert!(valid_device_name("12"));
    }
}
