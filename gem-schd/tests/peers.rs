//! gem-schd's peer check (`--verify-pod-peers`) with real processes in real cgroups: a
//! `gem-client-sim` moved into the cgroup of the socket's pod is served; one in another pod's
//! cgroup, and the test itself (in no pod), get Error{7}; the usage report counts the
//! refusals and lists the served process's PID.
//!
//! The cgroups are made under a hierarchy of this machine's cgroup file system, laid out as
//! the kubelet lays them out (cgroupfs and systemd naming), below a directory of this test's
//! own; that needs root and a writable cgroup mount, and the test says so and passes without
//! them (a plain `cargo test` as a user).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gem_proto::{Client, ClientError, code};
use kubeshare_api::UsageReport;

const GPU: &str = "GPU-00000000-1111-2222-3333-555555555555";
const SCHD: &str = env!("CARGO_BIN_EXE_gem-schd");
const SIM: &str = env!("CARGO_BIN_EXE_gem-client-sim");
const POD_A: &str = "6f1c2d3e-4a5b-4c6d-8e7f-0123456789ab";
const POD_B: &str = "9b2e0000-4a5b-4c6d-8e7f-0123456789ab";

/// Cgroups made by the test, removed (deepest first) when dropped.
struct Cgroups {
    top: PathBuf,
}

impl Cgroups {
    /// A directory of this test's own on the first writable cgroup hierarchy.
    fn make() -> Option<Cgroups> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let name = format!("ks-peer-test-{}", std::process::id());
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
        .map(|top| Cgroups { top })
    }

    /// `rel` below the test's directory, created.
    fn dir(&self, rel: &str) -> PathBuf {
        let d = self.top.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        // rmdir only (cgroup directories cannot be emptied of their files), deepest first.
        let mut dirs = vec![];
        let mut stack = vec![self.top.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        for d in dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// A child process, killed and reaped however the test ends (before the cgroups go).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `gem-client-sim alloc` on `sock`, started in cgroup `cg` (the shell moves itself there,
/// then becomes the client).
fn client_in(cg: &Path, sock: &Path) -> Child {
    Command::new("sh")
        .args([
            "-c",
            r#"echo $$ > "$1/cgroup.procs" && exec "$2" --socket "$3" --gpu "$4" alloc --bytes 1"#,
            "sh",
        ])
        .arg(cg)
        .arg(SIM)
        .arg(sock)
        .arg(GPU)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The output of `child` once it exits, or `None` (and it is killed) if it runs past `limit`:
/// a served `gem-client-sim alloc` waits to be killed.
fn exit_within(mut child: Child, limit: Duration) -> Option<std::process::Output> {
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

#[track_caller]
fn wait_for<T>(mut f: impl FnMut() -> Option<T>, what: &str) -> T {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn only_processes_of_the_sockets_pod_are_served() {
    let Some(cgs) = Cgroups::make() else {
        eprintln!("skipped: needs root and a writable cgroup hierarchy under /sys/fs/cgroup");
        return;
    };
    let a_cg = cgs.dir(&format!("kubepods/besteffort/pod{POD_A}/c1"));
    let b_cg = cgs.dir(&format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
        POD_B.replace('-', "_")
    ));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("resource-config.txt"),
        format!("2\n{POD_A} 0.5 1.0 1000\n{POD_B} 0.5 1.0 1000\n"),
    )
    .unwrap();
    let usage = dir.path().join("usage.txt");
    let sock = |pod: &str| dir.path().join(pod).join(format!("{GPU}.sock"));
    let _schd = Reaped(
        Command::new(SCHD)
            .args(["--gpu", GPU, "--config"])
            .arg(dir.path().join("resource-config.txt"))
            .arg("--socket-template")
            .arg(format!("{}/{{client}}/{{gpu}}.sock", dir.path().display()))
            .arg("--usage-file")
            .arg(&usage)
            .arg("--verify-pod-peers")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(|| sock(POD_A).exists().then_some(()), "pod A's socket");

    // A process of pod A is served.
    let mut a = Reaped(client_in(&a_cg, &sock(POD_A)));
    let mut line = String::new();
    BufReader::new(a.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("allocated used=1"), "{line:?}");

    // A process of pod B at pod A's socket is refused, naming both pods.
    let b = exit_within(client_in(&b_cg, &sock(POD_A)), Duration::from_secs(10))
        .expect("pod B's process was served at pod A's socket");
    let err = String::from_utf8_lossy(&b.stderr);
    assert!(!b.status.success(), "{err}");
    assert!(
        err.contains("code 7")
            && err.contains(POD_A)
            && err.contains(&format!("runs in pod {POD_B}")),
        "{err}"
    );
    // So is a process in no pod (this test).
    match Client::connect(sock(POD_A), std::process::id(), GPU) {
        Err(ClientError::Server { code: c, message }) => {
            assert_eq!(c, code::PEER_NOT_IN_POD, "{message}");
            assert!(message.contains("runs in no pod"), "{message}");
        }
        other => panic!("expected PEER_NOT_IN_POD, got {other:?}"),
    }

    // The report counts both refusals and lists the served process.
    let a_pid = a.0.id();
    let report = wait_for(
        || {
            let r = UsageReport::parse(&std::fs::read_to_string(&usage).ok()?).ok()?;
            (r.refused.len() == 2).then_some(r)
        },
        "two refusals in the usage report",
    );
    let by_peer = |p: Option<&str>| {
        report
            .refused
            .iter()
            .find(|r| r.peer_pod.as_deref() == p)
            .unwrap_or_else(|| panic!("no refusal from {p:?}: {report:?}"))
    };
    assert_eq!(
        (
            by_peer(Some(POD_B)).socket.as_str(),
            by_peer(Some(POD_B)).count
        ),
        (POD_A, 1)
    );
    assert_eq!(by_peer(None).pid, std::process::id());
    assert_eq!(report.client(POD_A).unwrap().pids, vec![a_pid]);
    assert!(report.client(POD_B).unwrap().pids.is_empty());
}
