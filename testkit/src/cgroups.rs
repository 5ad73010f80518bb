//! Cgroups made by a test, laid out as the kubelet lays out pods' cgroups, and gem-schd
//! clients started inside them: what the peer-check tests of gem-schd and the node daemon
//! share. Needs root and a writable cgroup mount; `TestCgroups::make` says `None` without.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A directory of the test's own on the first writable cgroup hierarchy, removed (deepest
/// first) when dropped.
#[derive(Debug)]
pub struct TestCgroups {
    top: PathBuf,
}

impl TestCgroups {
    /// `<hierarchy>/<name>-<pid>`; `None` when not root or no hierarchy is writable.
    pub fn make(name: &str) -> Option<TestCgroups> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let name = format!("{name}-{}", std::process::id());
        [
            "/sys/fs/cgroup/unified",
            "/sys/fs/cgroup",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup/systemd",
        ]
        .iter()
        .map(Path::new)
        .filter(|h| h.join("cgroup.procs").exists())
        .map(|h| h.join(&name))
        .find(|top| std::fs::create_dir(top).is_ok())
        .map(|top| TestCgroups { top })
    }

    /// `rel` below the test's directory, created.
    pub fn dir(&self, rel: &str) -> std::io::Result<PathBuf> {
        let d = self.top.join(rel);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }

    /// The cgroup of pod `uid` in QoS class `qos` (cgroupfs driver naming), created.
    pub fn pod(&self, qos: &str, uid: &str) -> std::io::Result<PathBuf> {
        self.dir(&format!("kubepods/{qos}/pod{uid}"))
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        // rmdir only (cgroup directories cannot be emptied of their files), deepest first.
        let mut dirs = vec![];
        let mut stack = vec![self.top.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                stack.extend(
                    rd.flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
            dirs.push(d);
        }
        for d in dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// `gem-client-sim alloc` (program `sim`) on `sock` for GPU `gpu`, started in cgroup `cg`: the
/// shell moves itself there, then becomes the client.
pub fn sim_client_in(sim: &Path, cg: &Path, sock: &Path, gpu: &str) -> std::io::Result<Child> {
    Command::new("sh")
        .args([
            "-c",
            r#"echo $$ > "$1/cgroup.procs" && exec "$2" --socket "$3" --gpu "$4" alloc --bytes 1"#,
            "sh",
        ])
        .arg(cg)
        .arg(sim)
        .arg(sock)
        .arg(gpu)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// The output of `child` once it exits, or `None` (and it is killed) if it runs past `limit`:
/// a served `gem-client-sim alloc` waits to be killed.
pub fn exit_within(mut child: Child, limit: Duration) -> Option<Output> {
    let end = Instant::now() + limit;
    while child.try_wait().ok()?.is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().ok()
}
