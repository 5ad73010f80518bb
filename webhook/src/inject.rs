//! What the webhook injects into a KubeShare pod (docs/design.md, "How the GPU reaches the
//! container"): the names, paths and the exact env, volume and mount objects.
//!
//! Kept apart from the decision logic so that the documentation, the tests and the
//! mutation all read the same constants.

use k8s_openapi::api::core::v1::{
    EnvVar, EnvVarSource, HostPathVolumeSource, ObjectFieldSelector, Volume, VolumeMount,
};
use kubeshare_api::{annotations, layout};

/// The hook library, as the container sees it.
pub const HOOK_PATH: &str = layout::POD_HOOK_LIB;

pub const ENV_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
pub const ENV_POD_UID: &str = "KUBESHARE_POD_UID";
pub const ENV_SOCKET_DIR: &str = "KUBESHARE_SOCKET_DIR";
pub const ENV_LD_PRELOAD: &str = "LD_PRELOAD";
/// Where a user's `LD_PRELOAD` given through `valueFrom` is moved, so that our
/// `LD_PRELOAD=$(KUBESHARE_USER_LD_PRELOAD):<hook>` can extend it (the kubelet expands
/// `$(VAR)` from variables defined earlier in the container's env).
pub const ENV_USER_LD_PRELOAD: &str = "KUBESHARE_USER_LD_PRELOAD";

/// `NVIDIA_VISIBLE_DEVICES` comes from the allocation annotation the extender writes at bind.
pub fn visible_devices_field_path() -> String {
    format!("metadata.annotations['{}']", annotations::GPU_UUID)
}
/// A unified-memory pod's resident share (bytes), from the record the extender writes at bind.
pub fn um_resident_field_path() -> String {
    format!(
        "metadata.annotations['{}']",
        kubeshare_api::um::GPU_MEM_RESIDENT
    )
}
pub const POD_UID_FIELD_PATH: &str = "metadata.uid";

pub const LIB_VOLUME: &str = "kubeshare-lib";
pub const LIB_HOST_PATH: &str = layout::HOST_LIB_DIR;
pub const LIB_MOUNT_PATH: &str = layout::POD_LIB_DIR;
pub const RUN_VOLUME: &str = "kubeshare-run";
pub const RUN_HOST_PATH: &str = layout::HOST_PODS_DIR;
pub const RUN_MOUNT_PATH: &str = layout::POD_SOCKET_DIR;
/// Each pod sees only its own directory of sockets.
pub const RUN_SUB_PATH_EXPR: &str = "$(KUBESHARE_POD_UID)";
/// The host directories must exist (the node daemon makes them): a pod on a node
/// without KubeShare fails to start visibly instead of running unthrottled.
pub const HOST_PATH_TYPE: &str = "Directory";

/// An env var read through the downward API. `apiVersion: v1` is what the apiserver
/// defaults it to, so the stored pod equals the patched one.
pub fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: Some("v1".to_string()),
                field_path: field_path.to_string(),
            }),
            ..Default::default()
        }),
    }
}

pub fn value_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        value_from: None,
    }
}

pub fn host_volume(name: &str, path: &str) -> Volume {
    Volume {
        name: name.to_string(),
        host_path: Some(HostPathVolumeSource {
            path: path.to_string(),
            type_: Some(HOST_PATH_TYPE.to_string()),
        }),
        ..Default::default()
    }
}

pub fn lib_volume() -> Volume {
    host_volume(LIB_VOLUME, LIB_HOST_PATH)
}

pub fn run_volume() -> Volume {
    host_volume(RUN_VOLUME, RUN_HOST_PATH)
}

pub fn lib_mount() -> VolumeMount {
    VolumeMount {
        name: LIB_VOLUME.to_string(),
        mount_path: LIB_MOUNT_PATH.to_string(),
        read_only: Some(true),
        ..Default::default()
    }
}

pub fn run_mount() -> VolumeMount {
    VolumeMount {
        name: RUN_VOLUME.to_string(),
        mount_path: RUN_MOUNT_PATH.to_string(),
        sub_path_expr: Some(RUN_SUB_PATH_EXPR.to_string()),
        ..Default::default()
    }
}

/// Whether an `LD_PRELOAD` value already loads the hook (ld.so separates entries
/// with ':' or spaces).
pub fn preloads_hook(value: &str) -> bool {
    value
        .split(|c: char| c == ':' || c.is_ascii_whitespace())
        .any(|p| p == HOOK_PATH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_path_is_the_layouts() {
        assert_eq!(
            HOOK_PATH,
            format!("{}/{}", layout::POD_LIB_DIR, layout::HOOK_LIB_NAME)
        );
    }
}
