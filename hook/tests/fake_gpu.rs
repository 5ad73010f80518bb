//! libgemhook end to end, without a GPU: real gem-schd processes, the workload program
//! (`cuda-workload`) with the hook preloaded, and the fake libcuda as `libcuda.so.1`, reached
//! by each of the three lookup paths (linked symbols, `dlsym`, `cuGetProcAddress_v2`).
//!
//! Needs `make hook-prereqs` (builds gemhook, fake-libcuda and gem-schd into target/debug).

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const GPU: &str = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const LOOKUPS: [&str; 3] = ["symbol", "dlsym", "proc"];

/// The tests start processes that share one simulated GPU's time: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// target/debug, found from this test binary (target/debug/deps/…).
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    /// A scratch directory with `lib/libcuda.so.1` (the fake) and `lib/libgemhook.so.1`.
    fn new() -> Env {
        let b = bin_dir();
        for f in [
            "libgemhook.so",
            "libfake_cuda.so",
            "cuda-workload",
            "gem-schd",
        ] {
            assert!(
                b.join(f).exists(),
                "{} missing: run `make hook-prereqs` (cargo build -p gemhook -p fake-libcuda -p gem-schd)",
                b.join(f).display()
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib");
        std::fs::create_dir(&lib).unwrap();
        std::os::unix::fs::symlink(b.join("libfake_cuda.so"), lib.join("libcuda.so.1")).unwrap();
        std::os::unix::fs::symlink(b.join("libgemhook.so"), lib.join("libgemhook.so.1")).unwrap();
        Env { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn client_dir(&self, client: &str) -> PathBuf {
        self.path().join("pods").join(client)
    }

    fn write_config(&self, lines: &[(&str, f64, f64, u64)]) {
        let mut s = format!("{}\n", lines.len());
        for (id, req, lim, mem) in lines {
            s.push_str(&format!("{id} {req} {lim} {mem}\n"));
        }
        let tmp = self.path().join("rc.tmp");
        std::fs::write(&tmp, s).unwrap();
        std::fs::rename(tmp, self.path().join("rc.txt")).unwrap();
    }

    /// Starts gem-schd on the config written before; waits for the sockets of `clients`.
    fn start_schd(&self, clients: &[&str]) -> Proc {
        let child = Command::new(bin_dir().join("gem-schd"))
            .arg("--gpu")
            .arg(GPU)
            .arg("--config")
            .arg(self.path().join("rc.txt"))
            .arg("--socket-template")
            .arg(format!(
                "{}/pods/{{client}}/{{gpu}}.sock",
                self.path().display()
            ))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let p = Proc(child);
        for c in clients {
            let sock = self.client_dir(c).join(format!("{GPU}.sock"));
            wait_until(
                Duration::from_secs(10),
                || sock.exists(),
                &format!("socket {}", sock.display()),
            );
        }
        p
    }

    /// The workload with the hook preloaded, as a process of `client`.
    fn workload(&self, client: &str, lookup: &str, args: &[&str]) -> Command {
        let lib = self.path().join("lib");
        let mut c = Command::new(bin_dir().join("cuda-workload"));
        c.arg("--lookup")
            .arg(lookup)
            .args(args)
            .env("LD_LIBRARY_PATH", &lib)
            .env("LD_PRELOAD", lib.join("libgemhook.so.1"))
            .env("KUBESHARE_SOCKET_DIR", self.client_dir(client))
            .env("KUBESHARE_HOOK_LOG", "off")
            .env("FAKE_CUDA_DEVICES", GPU)
            .env("FAKE_CUDA_MEM_BYTES", (16 * GIB).to_string())
            .env("FAKE_CUDA_SHARED_DIR", self.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        c
    }

    fn run(&self, client: &str, lookup: &str, args: &[&str]) -> Vec<Value> {
        let out = self.workload(client, lookup, args).output().unwrap();
        assert!(
            out.status.success(),
            "workload {lookup} {args:?} failed: {:?}",
            out.status
        );
        parse_lines(&out.stdout)
    }
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Waits for exit (at most `t`) and returns its JSON lines.
    fn finish(mut self, t: Duration) -> Vec<Value> {
        let deadline = Instant::now() + t;
        loop {
            if let Some(st) = self.0.try_wait().unwrap() {
                assert!(st.success(), "process failed: {st:?}");
                let mut out = Vec::new();
                std::io::Read::read_to_end(self.0.stdout.as_mut().unwrap(), &mut out).unwrap();
                return parse_lines(&out);
            }
            assert!(
                Instant::now() < deadline,
                "process still running after {t:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn running(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }

    /// Reads the next JSON line of its stdout.
    fn next_line(&mut self) -> Value {
        let out = self.0.stdout.as_mut().unwrap();
        let mut line = String::new();
        let mut r = BufReader::new(out);
        r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }
}

fn parse_lines(b: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(b)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn wait_until(t: Duration, mut f: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + t;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Share of the device's time a launch run got after `skip_ms` (the start-up), from its samples.
fn busy_fraction(v: &Value, skip_ms: u64) -> (f64, u64, u64) {
    let s = v["samples"].as_array().unwrap();
    let pt = |x: &Value| (x[0].as_u64().unwrap(), x[1].as_u64().unwrap());
    let first = s.iter().map(pt).find(|(t, _)| *t >= skip_ms).unwrap();
    let last = pt(s.last().unwrap());
    let busy_us = last.1 - first.1;
    let wall_us = (last.0 - first.0) * 1000;
    (busy_us as f64 / wall_us as f64, busy_us, wall_us)
}

#[test]
fn launches_wait_for_the_token_on_every_lookup_path_and_kind() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, 4 * GIB)]);
    // The pod's socket directory exists but gem-schd is not running yet: no token.
    std::fs::create_dir_all(env.client_dir("a")).unwrap();
    let mut procs = vec![];
    for lookup in LOOKUPS {
        for kind in ["launch", "ex", "coop", "graph"] {
            let p = env
                .workload(
                    "a",
                    lookup,
                    &[
                        "launch",
                        "--kernel-us",
                        "1000",
                        "--count",
                        "5",
                        "--kind",
                        kind,
                    ],
                )
                .spawn()
                .unwrap();
            procs.push((lookup, kind, Proc(p)));
        }
    }
    std::thread::sleep(Duration::from_millis(1500));
    for (lookup, kind, p) in procs.iter_mut() {
        assert!(p.running(), "{lookup}/{kind}: launched without a token");
    }
    // The same program outside a pod (no socket directory) runs at once: the hook is inert.
    let inert = env
        .workload(
            "a",
            "proc",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_SOCKET_DIR", env.path().join("no-such-dir"))
        .output()
        .unwrap();
    assert!(inert.status.success(), "{inert:?}");
    assert_eq!(parse_lines(&inert.stdout)[0]["kernels"], 5);

    let _schd = env.start_schd(&["a"]);
    for (lookup, kind, p) in procs {
        let out = p.finish(Duration::from_secs(20));
        assert_eq!(out[0]["kernels"], 5, "{lookup}/{kind}");
        let busy = out[0]["busy_us"].as_u64().unwrap();
        assert!(busy >= 5000, "{lookup}/{kind}: the kernels ran ({busy} µs)");
    }
}

#[test]
fn unreachable_policy_run_passes_through() {
    let _s = serial();
    let env = Env::new();
    std::fs::create_dir_all(env.client_dir("a")).unwrap();
    let out = env
        .workload(
            "a",
            "dlsym",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_ON_UNREACHABLE", "run")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(parse_lines(&out.stdout)[0]["kernels"], 5);
}

#[test]
fn memory_cap_and_faked_meminfo_on_every_lookup_path_and_allocator() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    for lookup in LOOKUPS {
        for kind in [
            "alloc", "pitch", "managed", "async", "pool", "create", "array", "array3d",
        ] {
            let what = format!("{lookup}/{kind}");
            let bytes = (400 * MIB).to_string();
            let out = env.run(
                "a",
                lookup,
                &["alloc", "--kind", kind, "--bytes", &bytes, "--count", "3"],
            );
            let (alloc, freed) = (&out[0], &out[1]);
            // Two fit under the 1 GiB cap, the third is refused with CUDA_ERROR_OUT_OF_MEMORY
            // although the (fake) device has 16 GiB.
            assert_eq!(alloc["codes"], serde_json::json!([0, 0, 2]), "{what}");
            assert_eq!(alloc["mem"]["total"], GIB, "{what}");
            assert_eq!(alloc["mem"]["device_total"], GIB, "{what}");
            assert_eq!(alloc["mem"]["free"], GIB - 800 * MIB, "{what}");
            assert_eq!(freed["codes"], serde_json::json!([0, 0]), "{what}");
            assert_eq!(freed["mem"]["free"], GIB, "{what}: frees are credited");
        }
    }
    // Outside a pod the real (fake) device is reported.
    let out = env
        .workload("a", "proc", &["meminfo"])
        .env("KUBESHARE_SOCKET_DIR", env.path().join("no-such-dir"))
        .output()
        .unwrap();
    assert_eq!(parse_lines(&out.stdout)[0]["total"], 16 * GIB);
}

#[test]
fn processes_of_one_client_share_its_memory_budget() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let bytes = (600 * MIB).to_string();
    let mut first = Proc(
        env.workload(
            "a",
            "symbol",
            &["alloc", "--bytes", &bytes, "--hold-ms", "4000"],
        )
        .spawn()
        .unwrap(),
    );
    let held = first.next_line();
    assert_eq!(held["codes"], serde_json::json!([0]));
    // A second process of the same pod sees the first one's use and cannot exceed the cap.
    let second = env.run("a", "proc", &["alloc", "--bytes", &bytes]);
    assert_eq!(second[0]["codes"], serde_json::json!([2]));
    assert_eq!(second[0]["mem"]["free"], GIB - 600 * MIB);
    let small = env.run(
        "a",
        "dlsym",
        &["alloc", "--bytes", &(300 * MIB).to_string()],
    );
    assert_eq!(small[0]["codes"], serde_json::json!([0]));
    // Killed without freeing: gem-schd reclaims its memory when its connections close.
    drop(first);
    let mut ok = false;
    for _ in 0..50 {
        let again = env.run("a", "proc", &["alloc", "--bytes", &bytes]);
        if again[0]["codes"] == serde_json::json!([0]) {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ok, "memory of a killed process was not reclaimed");
}

#[test]
fn two_clients_get_their_shares_and_one_clients_processes_share_a_token() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.3, 0.3, GIB), ("b", 0.7, 0.7, GIB)]);
    let _schd = env.start_schd(&["a", "b"]);
    let args = [
        "launch",
        "--kernel-us",
        "2000",
        "--seconds",
        "8",
        "--sample-ms",
        "200",
    ];
    // Client a: two processes (dlsym and cuGetProcAddress paths); client b: one (symbols).
    let a1 = Proc(env.workload("a", "dlsym", &args).spawn().unwrap());
    let a2 = Proc(env.workload("a", "proc", &args).spawn().unwrap());
    let b = Proc(env.workload("b", "symbol", &args).spawn().unwrap());
    let t = Duration::from_secs(30);
    let (a1, a2, b) = (a1.finish(t), a2.finish(t), b.finish(t));
    let skip = 1500;
    let (fa1, ba1, _) = busy_fraction(&a1[0], skip);
    let (fa2, ba2, _) = busy_fraction(&a2[0], skip);
    let (fb, bb, _) = busy_fraction(&b[0], skip);
    let total = (ba1 + ba2 + bb) as f64;
    let share_a = (ba1 + ba2) as f64 / total;
    let share_b = bb as f64 / total;
    let used = fa1 + fa2 + fb;
    eprintln!(
        "GPU time: a = {fa1:.3} + {fa2:.3}, b = {fb:.3} of wall time; shares a {share_a:.3}, b {share_b:.3}"
    );
    // The three processes share one simulated GPU (FAKE_CUDA_SHARED_DIR): without gating
    // each would get about a third. The GPU must not idle much while both clients are busy.
    assert!(used <= 1.02, "more GPU time than wall time: {used:.3}");
    assert!(used >= 0.85, "GPU mostly idle: {used:.3}");
    assert!(
        (share_a - 0.3).abs() <= 0.03,
        "client a got {share_a:.3}, not 0.3 ± 0.03"
    );
    assert!(
        (share_b - 0.7).abs() <= 0.03,
        "client b got {share_b:.3}, not 0.7 ± 0.03"
    );
}

#[test]
fn a_tenant_waiting_on_its_own_burst_is_not_idle() {
    // Bursts of 10 × 3 ms kernels, each followed by a sync: the process launches nothing for
    // 30 ms while its GPU work runs. Releasing the token then (as if idle) would make the two
    // clients alternate burst by burst, 0.5/0.5, instead of their requests 0.3/0.7.
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.3, 1.0, GIB), ("f", 0.7, 1.0, GIB)]);
    let _schd = env.start_schd(&["e", "f"]);
    let args = [
        "launch",
        "--kernel-us",
        "3000",
        "--batch",
        "10",
        "--seconds",
        "8",
        "--sample-ms",
        "200",
    ];
    let e = Proc(env.workload("e", "proc", &args).spawn().unwrap());
    let f = Proc(env.workload("f", "dlsym", &args).spawn().unwrap());
    let t = Duration::from_secs(30);
    let (e, f) = (e.finish(t), f.finish(t));
    let (fe, be, _) = busy_fraction(&e[0], 1500);
    let (ff, bf, _) = busy_fraction(&f[0], 1500);
    let share_e = be as f64 / (be + bf) as f64;
    eprintln!("GPU time: e = {fe:.3}, f = {ff:.3} of wall time; share of e {share_e:.3}");
    assert!(
        (share_e - 0.3).abs() <= 0.03,
        "client e got {share_e:.3}, not 0.3 ± 0.03"
    );
    assert!(fe + ff >= 0.85, "GPU mostly idle: {:.3}", fe + ff);
}
