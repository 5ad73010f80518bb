//! The daemon's host directory and the I/O that applies [`crate::reconcile::Action`]s.
//!
//! ```text
//! <root>/lib/libgemhook.so.1
//! <root>/gpus/<uuid>/resource-config.txt
//! <root>/gpus/<uuid>/gem-schd.pid
//! <root>/gpus/<uuid>/usage.txt           written by gem-schd (kubeshare_api::usage)
//! <root>/pods/<pod-uid>/<gpu-uuid>.sock
//! ```
//! Files are replaced atomically (a temporary file in the same directory, then
//! `rename`), so gem-schd and the pods never read a half-written file, and a file
//! whose content would not change is not written at all.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::reconcile::{Action, Actual};

/// The hook library's file name under `lib/`, as the webhook's `LD_PRELOAD` names it.
pub const HOOK_LIB_NAME: &str = "libgemhook.so.1";

/// Longest Unix socket path (`sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Paths under the root.
#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
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
    pub fn gpu_dir(&self, gpu: &str) -> PathBuf {
        self.root.join("gpus").join(gpu)
    }
    pub fn config(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join("resource-config.txt")
    }
    pub fn pid_file(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join("gem-schd.pid")
    }
    /// gem-schd's usage report (`--usage-file`).
    pub fn usage(&self, gpu: &str) -> PathBuf {
        self.gpu_dir(gpu).join(kubeshare_api::USAGE_FILE)
    }
    pub fn pods_dir(&self) -> PathBuf {
        self.root.join("pods")
    }
    pub fn pod_dir(&self, uid: &str) -> PathBuf {
        self.pods_dir().join(uid)
    }
    /// The `--socket-template` gem-schd gets: `{client}` is the pod UID, `{gpu}` the UUID.
    pub fn socket_template(&self) -> String {
        format!("{}/{{client}}/{{gpu}}.sock", self.pods_dir().display())
    }

    /// Length of the longest socket path gem-schd will make under this root
    /// (`pods/<36-char pod UID>/<40-char GPU UUID>.sock`).
    pub fn longest_socket_path(&self) -> usize {
        self.pods_dir().as_os_str().len() + 1 + 36 + 1 + 40 + ".sock".len()
    }

    /// Creates `lib/`, `gpus/` and `pods/`.
    pub fn create(&self) -> io::Result<()> {
        for d in [self.lib_dir(), self.root.join("gpus"), self.pods_dir()] {
            fs::create_dir_all(d)?;
        }
        Ok(())
    }

    /// What is on disk for the GPUs `gpus`.
    pub fn read_actual<'a>(
        &self,
        gpus: impl IntoIterator<Item = &'a String>,
    ) -> io::Result<Actual> {
        let mut configs = BTreeMap::new();
        for g in gpus {
            let text = match fs::read_to_string(self.config(g)) {
                Ok(t) => Some(t),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                // Unreadable (e.g. not UTF-8): treat as absent so it is rewritten.
                Err(e) if e.kind() == io::ErrorKind::InvalidData => None,
                Err(e) => return Err(e),
            };
            configs.insert(g.clone(), text);
        }
        let mut pod_dirs = BTreeSet::new();
        match fs::read_dir(self.pods_dir()) {
            Ok(rd) => {
                for entry in rd {
                    let entry = entry?;
                    if entry.file_type()?.is_dir()
                        && let Some(name) = entry.file_name().to_str()
                    {
                        pod_dirs.insert(name.to_string());
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Actual { configs, pod_dirs })
    }

    /// Applies one action.
    pub fn apply(&self, action: &Action) -> io::Result<()> {
        match action {
            Action::CreatePodDir(uid) => fs::create_dir_all(self.pod_dir(uid)),
            Action::WriteConfig { gpu, text } => {
                fs::create_dir_all(self.gpu_dir(gpu))?;
                write_atomic(&self.config(gpu), text.as_bytes())
            }
            Action::RemovePodDir(uid) => match fs::remove_dir_all(self.pod_dir(uid)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }
}

/// Replaces `path` with `bytes` through a temporary file and a rename; a no-op (returns
/// `false`) when the file already holds exactly these bytes.
pub fn write_if_changed(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    match fs::read(path) {
        Ok(cur) if cur == bytes => return Ok(false),
        _ => {}
    }
    write_atomic(path, bytes)?;
    Ok(true)
}

/// Writes `bytes` to `path` atomically: readers see the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Installs the hook library from `src` into `lib/` (mode 0755), unless identical.
/// Returns whether it was written. Running processes keep the old file's inode.
pub fn install_hook_lib(layout: &Layout, src: &Path) -> io::Result<bool> {
    use std::os::unix::fs::PermissionsExt;
    let bytes = fs::read(src)?;
    fs::create_dir_all(layout.lib_dir())?;
    let dst = layout.hook_lib();
    let written = write_if_changed(&dst, &bytes)?;
    fs::set_permissions(&dst, fs::Permissions::from_mode(0o755))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn atomic_write_skips_identical_content() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.txt");
        assert!(write_if_changed(&p, b"1\n").unwrap());
        let ino = fs::metadata(&p).unwrap().ino();
        assert!(!write_if_changed(&p, b"1\n").unwrap());
        assert_eq!(fs::metadata(&p).unwrap().ino(), ino, "not rewritten");
        assert!(write_if_changed(&p, b"2\n").unwrap());
        assert_ne!(fs::metadata(&p).unwrap().ino(), ino, "replaced by rename");
        assert_eq!(fs::read(&p).unwrap(), b"2\n");
        // No temporary file is left behind.
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn actions_and_actual() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path());
        l.create().unwrap();
        let gpu = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd".to_string();
        let uid = "00000001-1111-2222-3333-444444444444".to_string();
        let a = l.read_actual([&gpu]).unwrap();
        assert_eq!(a.configs[&gpu], None);
        assert!(a.pod_dirs.is_empty());
        l.apply(&Action::CreatePodDir(uid.clone())).unwrap();
        fs::write(l.pod_dir(&uid).join(format!("{gpu}.sock")), b"").unwrap();
        l.apply(&Action::WriteConfig {
            gpu: gpu.clone(),
            text: "0\n".into(),
        })
        .unwrap();
        // A stray file in pods/ is not a pod dir.
        fs::write(l.pods_dir().join("README"), b"x").unwrap();
        let a = l.read_actual([&gpu]).unwrap();
        assert_eq!(a.configs[&gpu].as_deref(), Some("0\n"));
        assert_eq!(a.pod_dirs, BTreeSet::from([uid.clone()]));
        l.apply(&Action::RemovePodDir(uid.clone())).unwrap();
        assert!(!l.pod_dir(&uid).exists());
        // Removing twice is fine.
        l.apply(&Action::RemovePodDir(uid)).unwrap();
        assert_eq!(
            Layout::new("/var/lib/kubeshare").longest_socket_path(),
            106,
            "the default root leaves room for the socket names"
        );
        assert_eq!(
            l.socket_template(),
            format!("{}/pods/{{client}}/{{gpu}}.sock", d.path().display())
        );
    }

    #[test]
    fn hook_install() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path().join("root"));
        let src = d.path().join("libgemhook.so");
        fs::write(&src, b"\x7fELF fake").unwrap();
        assert!(install_hook_lib(&l, &src).unwrap());
        assert!(!install_hook_lib(&l, &src).unwrap());
        assert_eq!(fs::read(l.hook_lib()).unwrap(), b"\x7fELF fake");
        assert!(install_hook_lib(&l, &d.path().join("missing")).is_err());
    }
}
