//! The I/O on the daemon's host directory (its paths: [`kubeshare_api::Layout`]) that
//! applies [`crate::reconcile::Action`]s.
//! Files are replaced atomically (a temporary file in the same directory, then
//! `rename`), so gem-schd and the pods never read a half-written file, and a file
//! whose content would not change is not written at all.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, Write};
use std::path::Path;

use crate::reconcile::{Action, Actual};

pub use kubeshare_api::Layout;
pub use kubeshare_api::layout::{HOOK_LIB_NAME, MAX_SOCKET_PATH};

/// The I/O on the host directory: creating it, reading what is there, applying actions.
pub trait HostDir {
    /// Creates `lib/`, `gpus/` and `pods/`.
    fn create(&self) -> io::Result<()>;
    /// What is on disk for the GPUs `gpus`.
    fn read_actual<'a>(&self, gpus: impl IntoIterator<Item = &'a String>) -> io::Result<Actual>;
    /// Applies one action.
    fn apply(&self, action: &Action) -> io::Result<()>;
}

impl HostDir for Layout {
    fn create(&self) -> io::Result<()> {
        for d in [self.lib_dir(), self.gpus_dir(), self.pods_dir()] {
            fs::create_dir_all(d)?;
        }
        Ok(())
    }

    fn read_actual<'a>(&self, gpus: impl IntoIterator<Item = &'a String>) -> io::Result<Actual> {
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
        let mut peers = BTreeMap::new();
        match fs::read_dir(self.peers_dir()) {
            Ok(rd) => {
                for entry in rd {
                    let entry = entry?;
                    if let Some(name) = entry.file_name().to_str()
                        && entry.file_type()?.is_file()
                    {
                        // Unreadable: rewritten, as a config is.
                        let text = fs::read_to_string(entry.path()).unwrap_or_default();
                        peers.insert(name.to_string(), text);
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Actual {
            configs,
            pod_dirs,
            peers,
        })
    }

    fn apply(&self, action: &Action) -> io::Result<()> {
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
            Action::WritePeers { client, text } => {
                fs::create_dir_all(self.peers_dir())?;
                write_atomic(&self.peers(client), text.as_bytes())
            }
            Action::RemovePeers(client) => match fs::remove_file(self.peers(client)) {
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
        l.apply(&Action::RemovePodDir(uid.clone())).unwrap();
        // gem-schd's peers files, outside pods/.
        l.apply(&Action::WritePeers {
            client: uid.clone(),
            text: "a\nb\n".into(),
        })
        .unwrap();
        let a = l.read_actual([&gpu]).unwrap();
        assert_eq!(a.peers, BTreeMap::from([(uid.clone(), "a\nb\n".into())]));
        assert_eq!(fs::read_to_string(l.peers(&uid)).unwrap(), "a\nb\n");
        l.apply(&Action::RemovePeers(uid.clone())).unwrap();
        l.apply(&Action::RemovePeers(uid.clone())).unwrap();
        assert!(l.read_actual([&gpu]).unwrap().peers.is_empty());
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
