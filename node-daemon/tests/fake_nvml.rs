//! The node daemon's NVML process list ([`Processes`]) over the fake driver, as the node
//! daemon reads it in fake mode: a `cuda-workload` process (no hook) that makes a context on a
//! simulated GPU is listed on that GPU, by its PID, until it exits. The fake driver's GPUs
//! come from a node inventory file (`FAKE_CUDA_INVENTORY`), as the chart's fake mode gives them.
//!
//! One test in this binary: it sets the fake driver's environment for the whole process.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kubeshare_node_daemon::nvml::Processes;

const G0: &str = "GPU-0000aaaa-0000-4000-8000-000000000001";
const G1: &str = "GPU-0000aaaa-0000-4000-8000-000000000002";

/// target/<profile>/, where `cargo build -p fake-libcuda` puts the fake driver and
/// cuda-workload (mk/node-daemon.mk builds them for `make test`).
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

fn wait_for(mut f: impl FnMut() -> bool, what: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_process_with_a_context_is_listed_on_its_gpu_until_it_exits() {
    let fake = bin_dir().join("libfake_cuda.so");
    let workload = bin_dir().join("cuda-workload");
    assert!(
        fake.is_file() && workload.is_file(),
        "build the fake driver first: cargo build -p fake-libcuda"
    );
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::os::unix::fs::symlink(&fake, lib.join("libcuda.so.1")).unwrap();
    let shared = dir.path().join("fake-gpu");
    std::fs::create_dir_all(&shared).unwrap();
    let inventory = dir.path().join("inventory.json");
    std::fs::write(
        &inventory,
        format!(r#"{{"gpus":[{{"uuid":"{G0}","index":0}},{{"uuid":"{G1}","index":1}}]}}"#),
    )
    .unwrap();
    // SAFETY: the only test of this binary sets these before anything reads the environment.
    unsafe {
        std::env::set_var("FAKE_CUDA_SHARED_DIR", &shared);
        std::env::set_var("FAKE_CUDA_INVENTORY", &inventory);
        std::env::remove_var("FAKE_CUDA_DEVICES");
    }
    let nvml = Processes::open(&fake).expect("the fake driver loads as NVML");
    let empty = nvml.list().unwrap();
    assert_eq!(
        empty.keys().map(String::as_str).collect::<Vec<_>>(),
        [G0, G1],
        "the inventory's GPUs"
    );
    assert!(empty.values().all(Vec::is_empty), "{empty:?}");

    // A process on G1 only (its FAKE_CUDA_DEVICES names it alone), without the hook.
    let mut child = Command::new(&workload)
        .args(["launch", "--kernel-us", "1000", "--seconds", "60"])
        .env("LD_LIBRARY_PATH", &lib)
        .env("FAKE_CUDA_DEVICES", G1)
        .env("FAKE_CUDA_SHARED_DIR", &shared)
        .env_remove("LD_PRELOAD")
        .env_remove("FAKE_CUDA_INVENTORY")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut last = Default::default();
    wait_for(
        || {
            last = nvml.list().unwrap();
            last.get(G1).is_some_and(|p| p == &[pid])
        },
        "the workload on G1",
    );
    assert_eq!(last.get(G0), Some(&vec![]), "{last:?}");

    child.kill().unwrap();
    child.wait().unwrap();
    wait_for(
        || nvml.list().unwrap().values().all(Vec::is_empty),
        "the workload to leave the list",
    );
    // Its record is gone too, not just unheld.
    let records = std::fs::read_dir(shared.join("procs"))
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .count();
    assert_eq!(records, 0);
}
