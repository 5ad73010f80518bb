//! What the hook's end-to-end tests share: a scratch directory with the fake libcuda and the
//! hook, gem-schd started on a resource-config, the workload program run as a client's process.
#![allow(dead_code)]

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

pub const GPU: &str = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
pub const LOOKUPS: [&str; 3] = ["symbol", "dlsym", "proc"];

/// The workload of two tenants of 3 ms kernels launched 1 ms apart, for 4 s, sampled every
/// `sample_ms`: their drains run past a fifth of the 5 ms min quota, the hand-overs where
/// gem-schd says Soon. Their queues grow while they launch, so a quota ends with the thread
/// launching and the hook's notice says it drains. (Batches launched at once and then
/// synchronised end most holds in the idle thread's Release instead, which brings no Soon:
/// 0 to 61 queueings ahead of the gate in 4 s from one run to the next.)
pub fn long_drains(sample_ms: &'static str) -> [&'static str; 9] {
    [
        "launch",
        "--kernel-us",
        "3000",
        "--launch-cpu-us",
        "1000",
        "--seconds",
        "4",
        "--sample-ms",
        sample_ms,
    ]
}

/// The tests start processes that share one simulated GPU's time: one at a time.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// target/debug, found from this test binary (target/debug/deps/…).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    /// A scratch directory with `lib/libcuda.so.1` (the fake) and `lib/libgemhook.so.1`.
    pub fn new() -> Env {
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
        // The fake serves NVML too.
        std::os::unix::fs::symlink(b.join("libfake_cuda.so"), lib.join("libnvidia-ml.so.1"))
            .unwrap();
        std::os::unix::fs::symlink(b.join("libgemhook.so"), lib.join("libgemhook.so.1")).unwrap();
        Env { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn client_dir(&self, client: &str) -> PathBuf {
        self.path().join("pods").join(client)
    }

    pub fn write_config(&self, lines: &[(&str, f64, f64, u64)]) {
        let mut s = format!("{}\n", lines.len());
        for (id, req, lim, mem) in lines {
            s.push_str(&format!("{id} {req} {lim} {mem}\n"));
        }
        let tmp = self.path().join("rc.tmp");
        std::fs::write(&tmp, s).unwrap();
        std::fs::rename(tmp, self.path().join("rc.txt")).unwrap();
    }

    /// Starts gem-schd on the config written before; waits for the sockets of `clients`.
    pub fn start_schd(&self, clients: &[&str]) -> Proc {
        self.start_schd_with(clients, &[])
    }

    /// [`Env::start_schd`] with extra gem-schd arguments.
    pub fn start_schd_with(&self, clients: &[&str], extra: &[&str]) -> Proc {
        self.start_schd_logging(clients, extra, "warn", Stdio::inherit())
    }

    /// [`Env::start_schd_with`] logging at debug (every grant, renewal and report) to
    /// `schd.log` in the scratch directory; returns that file's path with the process.
    pub fn start_schd_debug(&self, clients: &[&str], extra: &[&str]) -> (Proc, PathBuf) {
        let log = self.path().join("schd.log");
        let file = std::fs::File::create(&log).unwrap();
        (
            self.start_schd_logging(clients, extra, "gem_schd=debug", file),
            log,
        )
    }

    /// [`Env::start_schd_with`] at log level `level` (`RUST_LOG`), its log written to `log`.
    pub fn start_schd_logging(
        &self,
        clients: &[&str],
        extra: &[&str],
        level: &str,
        log: impl Into<Stdio>,
    ) -> Proc {
        let child = Command::new(bin_dir().join("gem-schd"))
            .args(extra)
            .arg("--gpu")
            .arg(GPU)
            .arg("--config")
            .arg(self.path().join("rc.txt"))
            .arg("--socket-template")
            .arg(format!(
                "{}/pods/{{client}}/{{gpu}}.sock",
                self.path().display()
            ))
            .env("RUST_LOG", level)
            .stdout(Stdio::null())
            .stderr(log)
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
    pub fn workload(&self, client: &str, lookup: &str, args: &[&str]) -> Command {
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

    pub fn run(&self, client: &str, lookup: &str, args: &[&str]) -> Vec<Value> {
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
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// Waits for exit (at most `t`) and returns its JSON lines.
    pub fn finish(mut self, t: Duration) -> Vec<Value> {
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

    pub fn running(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }

    /// Reads the next JSON line of its stdout.
    pub fn next_line(&mut self) -> Value {
        let out = self.0.stdout.as_mut().unwrap();
        let mut line = String::new();
        let mut r = BufReader::new(out);
        r.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }
}

pub fn parse_lines(b: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(b)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

pub fn wait_until(t: Duration, mut f: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + t;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Share of the device's time a launch run got after `skip_ms` (the start-up), from its samples.
pub fn busy_fraction(v: &Value, skip_ms: u64) -> (f64, u64, u64) {
    let s = v["samples"].as_array().unwrap();
    let pt = |x: &Value| (x[0].as_u64().unwrap(), x[1].as_u64().unwrap());
    let first = s.iter().map(pt).find(|(t, _)| *t >= skip_ms).unwrap();
    let last = pt(s.last().unwrap());
    let busy_us = last.1 - first.1;
    let wall_us = (last.0 - first.0) * 1000;
    (busy_us as f64 / wall_us as f64, busy_us, wall_us)
}

/// Two runs side by side after `skip_ms`: each one's share of the device's time
/// ([`busy_fraction`]), and the first one's share of the GPU time the two got.
pub fn pair_busy(a: &Value, b: &Value, skip_ms: u64) -> (f64, f64, f64) {
    let (fa, ba, _) = busy_fraction(a, skip_ms);
    let (fb, bb, _) = busy_fraction(b, skip_ms);
    (fa, fb, ba as f64 / (ba + bb) as f64)
}

/// Drains `child`'s stderr on a thread (the child never blocks on it) and sends once for each
/// line that contains `needle`.
pub fn said_on_stderr(child: &mut Child, needle: &'static str) -> mpsc::Receiver<()> {
    let stderr = child.stderr.take().expect("stderr piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains(needle) {
                let _ = tx.send(());
            }
        }
    });
    rx
}

/// Microseconds since the Unix epoch, as the workload's `first_launch_unix_us` counts them.
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
