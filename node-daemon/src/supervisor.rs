//! Runs one gem-schd per GPU: starts it, restarts it with exponential backoff when it
//! dies, and stops it (SIGTERM, a grace period, then SIGKILL) on shutdown or when its
//! GPU leaves the inventory.
//!
//! No orphans: each child gets `PR_SET_PDEATHSIG(SIGTERM)`, so it is told to stop when
//! the daemon dies, even by SIGKILL; and its pid goes to `gpus/<uuid>/gem-schd.pid`,
//! so a daemon starting up stops a gem-schd left from before (checked by its command
//! line, not just the pid, which may have been reused).
//!
//! The death signal is sent when the *thread* that forked the child exits; the daemon
//! therefore runs a single-threaded runtime whose only thread lives as long as it does.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::disk::{Layout, write_atomic};

/// First restart delay; doubled per consecutive failure.
pub const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Longest restart delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A child that ran this long is considered healthy: the backoff starts over.
pub const STABLE_AFTER: Duration = Duration::from_secs(30);

/// Delay before the next start after `failures` consecutive quick deaths.
pub fn backoff(failures: u32) -> Duration {
    let factor = 1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX);
    BACKOFF_BASE.saturating_mul(factor).min(BACKOFF_MAX)
}

/// How to run gem-schd.
#[derive(Debug, Clone)]
pub struct GemSchdCommand {
    pub binary: PathBuf,
    /// Appended after the daemon's own arguments.
    pub extra_args: Vec<String>,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Have gem-schd refuse connections from processes outside the socket's pod
    /// (`--verify-pod-peers`): client IDs here are pod UIDs.
    pub verify_pod_peers: bool,
}

impl GemSchdCommand {
    /// The arguments for GPU `gpu`.
    pub fn args(&self, layout: &Layout, gpu: &str) -> Vec<String> {
        let mut a = vec![
            "--gpu".to_string(),
            gpu.to_string(),
            "--config".to_string(),
            layout.config(gpu).display().to_string(),
            "--socket-template".to_string(),
            layout.socket_template(),
            "--usage-file".to_string(),
            layout.usage(gpu).display().to_string(),
            format!("--verify-pod-peers={}", self.verify_pod_peers),
            "--peers-dir".to_string(),
            layout.peers_dir().display().to_string(),
        ];
        a.extend(self.extra_args.iter().cloned());
        a
    }
}

/// What `/metrics` reports about one GPU's gem-schd.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcStat {
    pub running: bool,
    pub pid: Option<u32>,
    /// Starts after the first one.
    pub restarts: u64,
}

pub type ProcStats = Arc<Mutex<BTreeMap<String, ProcStat>>>;

struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// The set of gem-schd processes, one per GPU.
pub struct Supervisor {
    cmd: GemSchdCommand,
    layout: Layout,
    running: BTreeMap<String, Running>,
    stats: ProcStats,
}

impl Supervisor {
    pub fn new(cmd: GemSchdCommand, layout: Layout, stats: ProcStats) -> Supervisor {
        Supervisor {
            cmd,
            layout,
            running: BTreeMap::new(),
            stats,
        }
    }

    /// Makes exactly the GPUs `gpus` have a gem-schd: starts the missing, stops the rest.
    pub async fn ensure(&mut self, gpus: &BTreeSet<String>) {
        let gone: Vec<String> = self
            .running
            .keys()
            .filter(|g| !gpus.contains(*g))
            .cloned()
            .collect();
        for g in gone {
            if let Some(r) = self.running.remove(&g) {
                tracing::info!(gpu = %g, "GPU left the inventory; stopping its gem-schd");
                stop(r).await;
            }
            lock(&self.stats).remove(&g);
        }
        for g in gpus {
            if self.running.contains_key(g) {
                continue;
            }
            kill_leftover(&self.layout, g, self.cmd.grace).await;
            let (tx, rx) = watch::channel(false);
            let task = tokio::spawn(supervise(
                self.cmd.clone(),
                self.layout.clone(),
                g.clone(),
                self.stats.clone(),
                rx,
            ));
            self.running.insert(g.clone(), Running { stop: tx, task });
        }
    }

    /// Stops every gem-schd and waits for them.
    pub async fn shutdown(&mut self) {
        let all = std::mem::take(&mut self.running);
        futures::future::join_all(all.into_values().map(stop)).await;
    }
}

async fn stop(r: Running) {
    let _ = r.stop.send(true);
    let _ = r.task.await;
}

fn lock(stats: &ProcStats) -> std::sync::MutexGuard<'_, BTreeMap<String, ProcStat>> {
    // A poisoned lock only means a panic elsewhere; the map itself is still usable.
    stats.lock().unwrap_or_else(|e| e.into_inner())
}

fn spawn(cmd: &GemSchdCommand, layout: &Layout, gpu: &str) -> std::io::Result<Child> {
    let mut c = Command::new(&cmd.binary);
    c.args(cmd.args(layout, gpu))
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid, _exit).
    let parent = std::process::id() as libc::pid_t;
    unsafe {
        c.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl: then nobody would signal us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    c.spawn()
}

async fn supervise(
    cmd: GemSchdCommand,
    layout: Layout,
    gpu: String,
    stats: ProcStats,
    mut stop_rx: watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    let mut first = true;
    loop {
        if *stop_rx.borrow() {
            break;
        }
        if !first && let Some(s) = lock(&stats).get_mut(&gpu) {
            s.restarts += 1;
        }
        first = false;
        let started = Instant::now();
        match spawn(&cmd, &layout, &gpu) {
            Ok(mut child) => {
                let pid = child.id();
                if let Some(pid) = pid
                    && let Err(e) = std::fs::create_dir_all(layout.gpu_dir(&gpu)).and_then(|()| {
                        write_atomic(&layout.pid_file(&gpu), format!("{pid}\n").as_bytes())
                    })
                {
                    tracing::warn!(gpu = %gpu, error = %e, "cannot write gem-schd pid file");
                }
                {
                    let mut st = lock(&stats);
                    let s = st.entry(gpu.clone()).or_default();
                    s.running = true;
                    s.pid = pid;
                }
                tracing::info!(gpu = %gpu, pid, "gem-schd started");
                tokio::select! {
                    status = child.wait() => {
                        let st = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                        tracing::warn!(gpu = %gpu, pid, status = %st, "gem-schd exited");
                    }
                    _ = stop_rx.changed() => {
                        terminate(&mut child, cmd.grace).await;
                        tracing::info!(gpu = %gpu, pid, "gem-schd stopped");
                        let _ = std::fs::remove_file(layout.pid_file(&gpu));
                        mark_down(&stats, &gpu);
                        break;
                    }
                }
                mark_down(&stats, &gpu);
            }
            Err(e) => {
                lock(&stats).entry(gpu.clone()).or_default();
                tracing::error!(gpu = %gpu, binary = %cmd.binary.display(), error = %e, "cannot start gem-schd");
            }
        }
        if started.elapsed() >= STABLE_AFTER {
            failures = 0;
        }
        let delay = backoff(failures);
        failures = failures.saturating_add(1);
        tracing::info!(gpu = %gpu, delay_ms = delay.as_millis() as u64, "restarting gem-schd after backoff");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop_rx.changed() => break,
        }
    }
    let _ = std::fs::remove_file(layout.pid_file(&gpu));
}

fn mark_down(stats: &ProcStats, gpu: &str) {
    if let Some(s) = lock(stats).get_mut(gpu) {
        s.running = false;
        s.pid = None;
    }
}

async fn terminate(child: &mut Child, grace: Duration) {
    if let Some(pid) = child.id() {
        // SAFETY: signalling our own child, which we have not reaped yet.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        tracing::warn!(pid = child.id(), "gem-schd ignored SIGTERM; killing it");
        let _ = child.kill().await;
    }
}

/// Whether `/proc/<pid>` is a live (not zombie) process whose command line runs
/// gem-schd for `gpu`.
fn is_our_gem_schd(pid: u32, gpu: &str) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let ours = args
        .windows(2)
        .any(|w| w[0] == b"--gpu" && w[1] == gpu.as_bytes());
    ours && alive(pid)
}

fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// How long to wait for a SIGKILLed leftover to disappear.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Stops a gem-schd for `gpu` left running by an earlier daemon (its pid file).
pub async fn kill_leftover(layout: &Layout, gpu: &str, grace: Duration) {
    let pid_file = layout.pid_file(gpu);
    let Some(pid) = read_pid(&pid_file) else {
        return;
    };
    if pid != std::process::id() && is_our_gem_schd(pid, gpu) {
        tracing::warn!(gpu, pid, "stopping a gem-schd left by an earlier daemon");
        // SAFETY: the pid was checked to be a gem-schd for this GPU just above.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + grace;
        while alive(pid) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if alive(pid) {
            // SAFETY: as above; it outlived SIGTERM's grace.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            // SIGKILL ends it unless it sits in an uninterruptible wait; never
            // hang the daemon's start on that, say so and go on.
            let deadline = Instant::now() + KILL_WAIT;
            while alive(pid) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if alive(pid) {
                tracing::error!(
                    gpu,
                    pid,
                    "a leftover gem-schd survived SIGKILL; starting anyway"
                );
            }
        }
    }
    let _ = std::fs::remove_file(pid_file);
}

fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::HostDir as _;

    #[test]
    fn backoff_doubles_and_caps() {
        assert_eq!(backoff(0), Duration::from_millis(500));
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(4));
        assert_eq!(backoff(6), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }

    /// A shell script standing in for gem-schd (it only has to live and obey signals).
    fn fake_gem_schd(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("fake-gem-schd");
        std::fs::write(&p, "#!/bin/sh\nwhile :; do sleep 0.1; done\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    async fn wait_for(mut f: impl FnMut() -> bool) {
        for _ in 0..200 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("condition not met in 5 s");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn restarts_after_death_and_stops_on_shutdown() {
        let d = tempfile::tempdir().unwrap();
        let layout = Layout::new(d.path());
        layout.create().unwrap();
        let gpu = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd".to_string();
        let cmd = GemSchdCommand {
            binary: fake_gem_schd(d.path()),
            extra_args: vec![],
            grace: Duration::from_secs(2),
            verify_pod_peers: true,
        };
        let stats = ProcStats::default();
        let mut sup = Supervisor::new(cmd, layout.clone(), stats.clone());
        sup.ensure(&BTreeSet::from([gpu.clone()])).await;
        wait_for(|| lock(&stats).get(&gpu).is_some_and(|s| s.running)).await;
        let pid1 = lock(&stats)[&gpu].pid.unwrap();
        assert_eq!(read_pid(&layout.pid_file(&gpu)), Some(pid1));
        assert!(is_our_gem_schd(pid1, &gpu));
        // Counted from here: the first start may itself have been retried, as
        // exec fails with ETXTBSY while another test's fork still holds the
        // stand-in's script open for writing.
        let before = lock(&stats)[&gpu].restarts;

        // SAFETY: pid1 is our own child, still running (checked just above).
        unsafe { libc::kill(pid1 as i32, libc::SIGKILL) };
        wait_for(|| {
            lock(&stats)
                .get(&gpu)
                .is_some_and(|s| s.running && s.pid != Some(pid1))
        })
        .await;
        assert_eq!(lock(&stats)[&gpu].restarts, before + 1);
        let pid2 = lock(&stats)[&gpu].pid.unwrap();

        sup.shutdown().await;
        assert!(!alive(pid2), "stopped on shutdown");
        assert!(!layout.pid_file(&gpu).exists());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn leftover_is_stopped_but_a_stranger_is_not() {
        let d = tempfile::tempdir().unwrap();
        let layout = Layout::new(d.path());
        let gpu = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd";
        std::fs::create_dir_all(layout.gpu_dir(gpu)).unwrap();
        // A process whose argv says it is a gem-schd for this GPU (sh stays the
        // process, and its short sleeps end by themselves once it is gone).
        let mut leftover = std::process::Command::new("sh")
            .args([
                "-c",
                "while :; do sleep 0.1; done",
                "gem-schd",
                "--gpu",
                gpu,
            ])
            .spawn()
            .unwrap();
        let mut stranger = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();

        std::fs::write(layout.pid_file(gpu), format!("{}\n", stranger.id())).unwrap();
        kill_leftover(&layout, gpu, Duration::from_secs(2)).await;
        assert!(
            stranger.try_wait().unwrap().is_none(),
            "a stranger is left alone"
        );
        assert!(!layout.pid_file(gpu).exists());

        let pid = leftover.id();
        // spawn returns once exec has begun; the kernel fills in the new command
        // line a moment later (empty until then), so wait for it to show.
        let shown = Instant::now() + Duration::from_secs(10);
        while !is_our_gem_schd(pid, gpu) && Instant::now() < shown {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            is_our_gem_schd(pid, gpu),
            "the stand-in must look like a gem-schd for {gpu}: cmdline {:?}",
            String::from_utf8_lossy(&cmdline)
        );
        std::fs::write(layout.pid_file(gpu), format!("{}\n", pid)).unwrap();
        // Reap it from another thread so `alive` sees it gone rather than a
        // zombie; the thread polls, so a stand-in that is not stopped fails the
        // test instead of hanging it.
        let reaper = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Some(status) = leftover.try_wait().unwrap() {
                    return Some(status);
                }
                if Instant::now() > deadline {
                    let _ = leftover.kill();
                    let _ = leftover.wait();
                    return None;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        kill_leftover(&layout, gpu, Duration::from_secs(2)).await;
        let _ = stranger.kill();
        let _ = stranger.wait();
        let status = reaper.join().unwrap();
        assert!(
            status.is_some_and(|s| !s.success()),
            "the leftover was stopped: {status:?}"
        );
        assert!(!alive(pid));
    }
}
