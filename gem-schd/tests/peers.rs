//! gem-schd's peer check (`--verify-pod-peers`) with real processes in real cgroups: a
//! `gem-client-sim` moved into the cgroup of the socket's pod is served; one in another pod's
//! cgroup, and the test itself (in no pod), get Error{7}; the usage report counts the
//! refusals and lists the served process's PID; a pod that the socket's peers file lists
//! (a client several pods share) is served as that client.
//!
//! The cgroups are made under a hierarchy of this machine's cgroup file system, laid out as
//! the kubelet lays them out (cgroupfs and systemd naming), below a directory of this test's
//! own; that needs root and a writable cgroup mount, and the test says so and passes without
//! them (a plain `cargo test` as a user).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gem_proto::{Client, ClientError, code};
use kubeshare_api::UsageReport;
use kubeshare_testkit::cgroups::{TestCgroups, exit_within, sim_client_in};

const GPU: &str = "GPU-00000000-1111-2222-3333-555555555555";
const SCHD: &str = env!("CARGO_BIN_EXE_gem-schd");
const SIM: &str = env!("CARGO_BIN_EXE_gem-client-sim");
const POD_A: &str = "6f1c2d3e-4a5b-4c6d-8e7f-0123456789ab";
const POD_B: &str = "9b2e0000-4a5b-4c6d-8e7f-0123456789ab";

/// A child process, killed and reaped however the test ends (before the cgroups go).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `gem-client-sim alloc` on `sock`, started in cgroup `cg`.
fn client_in(cg: &Path, sock: &Path) -> Child {
    sim_client_in(Path::new(SIM), cg, sock, GPU).unwrap()
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
    let Some(cgs) = TestCgroups::make("ks-peer-test") else {
        eprintln!("skipped: needs root and a writable cgroup hierarchy under /sys/fs/cgroup");
        return;
    };
    let a_cg = cgs
        .dir(&format!("kubepods/besteffort/pod{POD_A}/c1"))
        .unwrap();
    let b_cg = cgs
        .dir(&format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
            POD_B.replace('-', "_")
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("resource-config.txt"),
        format!("2\n{POD_A} 0.5 1.0 1000\n{POD_B} 0.5 1.0 1000\n"),
    )
    .unwrap();
    let usage = dir.path().join("usage.txt");
    let peers = dir.path().join("peers");
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
            .arg("--peers-dir")
            .arg(&peers)
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

    // A client that pods share (a ResourceClaim reserved for both): once its peers file
    // lists pod B, pod B's process is served at pod A's socket, as one client with A.
    std::fs::create_dir_all(&peers).unwrap();
    std::fs::write(peers.join(POD_A), format!("{POD_A}\n{POD_B}\n")).unwrap();
    let mut b = Reaped(client_in(&b_cg, &sock(POD_A)));
    let mut line = String::new();
    BufReader::new(b.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("allocated used="), "{line:?}");
    let b_pid = b.0.id();
    wait_for(
        || {
            let r = UsageReport::parse(&std::fs::read_to_string(&usage).ok()?).ok()?;
            let mut pids = r.client(POD_A)?.pids.clone();
            pids.sort();
            let mut want = vec![a_pid, b_pid];
            want.sort();
            (pids == want).then_some(())
        },
        "pod B's process listed under pod A's client",
    );
}
