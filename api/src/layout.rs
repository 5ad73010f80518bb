//! The node's host directory: where the node daemon, gem-schd, the hook and the
//! volumes the webhook injects meet. One place for these paths (pure, no I/O).
//!
//! ```text
//! <root>/lib/libgemhook.so.1                  mounted read-only at /kubeshare/lib in pods
//! <root>/gpus/<uuid>/resource-config.txt      node daemon -> gem-schd
//! <root>/gpus/<uuid>/gem-schd.pid
//! <root>/gpus/<uuid>/usage.txt                gem-schd -> node daemon (crate::usage)
//! <root>/pods/<pod-uid>/<gpu-uuid>.sock       gem-schd's socket; the pod sees its own
//!                                             directory at /kubeshare/run
//! ```

use std::ffi::CStr;
use std::path::PathBuf;

/// The root on every KubeShare node.
pub const DEFAULT_ROOT: &str = "/var/lib/kubeshare";
/// `<DEFAULT_ROOT>/lib` and `<DEFAULT_ROOT>/pods`, as the webhook's hostPath volumes
/// name them (a test checks they agree with [`Layout`]).
pub const HOST_LIB_DIR: &str = "/var/lib/kubeshare/lib";
pub const HOST_PODS_DIR: &str = "/var/lib/kubeshare/pods";
/// Where a KubeShare pod sees the hook library's directory and its socket directory.
pub const POD_LIB_DIR: &str = "/kubeshare/lib";
pub const POD_SOCKET_DIR: &str = match POD_SOCKET_DIR_C.to_str() {
    Ok(s) => s,
    Err(_) => panic!("the socket directory is ASCII"),
};
/// [`POD_SOCKET_DIR`], NUL-terminated: the hook checks it before it may allocate.
pub const POD_SOCKET_DIR_C: &CStr = c"/kubeshare/run";
/// The hook library's file name, as `LD_PRELOAD` names it.
pub const HOOK_LIB_NAME: &str = "libgemhook.so.1";
/// The hook library as a pod sees it: `POD_LIB_DIR/HOOK_LIB_NAME` (a test checks they agree).
pub const POD_HOOK_LIB: &str = "/kubeshare/lib/libgemhook.so.1";
/// gem-schd's `--socket-template` default: [`Layout::socket_template`] of the default root
/// (a test checks they agree).
pub const DEFAULT_SOCKET_TEMPLATE: &str = "/var/lib/kubeshare/pods/{client}/{gpu}.sock";
/// gem-schd's config, one per GPU.
pub const CONFIG_FILE: &str = "resource-config.txt";
/// The kubelet's PodResources socket (its default `--root-dir` is /var/lib/kubelet):
/// which device-plugin devices each pod holds (docs/device-plugin.md).
pub const KUBELET_POD_RESOURCES_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// The kubelet's device-plugin directory: plugins put their sockets here and register
/// through `kubelet.sock` in it.
pub const KUBELET_DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// The file name of gem-schd's socket for one GPU, in a client's socket directory.
pub fn gpu_socket_name(gpu_uuid: &str) -> String {
    format!("{gpu_uuid}.sock")
}

/// gem-schd's `--socket-template` for clients' directories under `dir`:
/// `<dir>/{client}/{gpu}.sock`, so that `<dir>/<client>` is a client's socket directory.
pub fn socket_template_in(dir: &std::path::Path) -> String {
    format!("{}/{{client}}/{}", dir.display(), gpu_socket_name("{gpu}"))
}

/// Paths under a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub root: PathBuf,
}

impl Default for Layout {
    fn default() -> Self {
        Layout::new(DEFAULT_ROOT)
    }
}

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Layout {
        Layout { root: root.into() }
    }
    pub fn lib_dir(&self) -> PathBuf {
        self.root.join("lib")
    }
    pub fn hook_lib(&self) -> PathBuf {
        self.lib_dir().join(HOOK_LIB_NAME)
    }
    pub fn gpus_dir(&self) -> PathBuf {
        self.root.join("gpus")
    }
    pub fn gpu_dir(&self, gpu: &str) -> PathBuf {
        self.gpus_dir().join(gpu)
    }
    pub fn config(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join(CONFIG_FILE)
    }
    pub fn pid_file(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join("gem-schd.pid")
    }
    /// gem-schd's usage report (`--usage-file`).
    pub fn usage(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join(crate::usage::USAGE_FILE)
    }
    pub fn pods_dir(&self) -> PathBuf {
        self.root.join("pods")
    }
    pub fn pod_dir(&self, uid: &str) -> PathBuf {
        self.pods_dir().join(uid)
    }
    /// gem-schd's `--peers-dir`: for a client several pods share (a ResourceClaim
    /// reserved for several pods), file `<client>` lists the pods it serves. Not
    /// mounted into any pod.
    pub fn peers_dir(&self) -> PathBuf {
        self.root.join("peers")
    }
    pub fn peers(&self, client: &str) -> PathBuf {
        self.peers_dir().join(client)
    }
    /// The `--socket-template` gem-schd gets: `{client}` is the pod UID, `{gpu}` the UUID.
    pub fn socket_template(&self) -> String {
        socket_template_in(&self.pods_dir())
    }
    /// Length of the longest socket path gem-schd will make under this root
    /// (`pods/<36-char pod UID>/<40-char GPU UUID>.sock`).
    pub fn longest_socket_path(&self) -> usize {
        self.pods_dir().as_os_str().len() + 1 + 36 + 1 + 40 + ".sock".len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constants_agree_with_the_default_layout() {
        let l = Layout::default();
        assert_eq!(l.lib_dir(), PathBuf::from(HOST_LIB_DIR));
        assert_eq!(l.pods_dir(), PathBuf::from(HOST_PODS_DIR));
        assert_eq!(
            l.config("GPU-1"),
            PathBuf::from("/var/lib/kubeshare/gpus/GPU-1/resource-config.txt")
        );
        assert_eq!(
            l.socket_template(),
            "/var/lib/kubeshare/pods/{client}/{gpu}.sock"
        );
        assert_eq!(l.socket_template(), DEFAULT_SOCKET_TEMPLATE);
        assert!(l.longest_socket_path() <= MAX_SOCKET_PATH);
        assert_eq!(
            PathBuf::from(POD_LIB_DIR).join(HOOK_LIB_NAME),
            PathBuf::from(POD_HOOK_LIB)
        );
        assert_eq!(POD_SOCKET_DIR, "/kubeshare/run");
    }
}
