//! The pieces every scale run shares: the extender as a child process, kwok
//! nodes with simulated GPUs, signals to a control-plane process, paged lists,
//! and the CPU time and memory of a process read from /proc.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use kubeshare_api::inventory::INVENTORY_ANNOTATION;
use kubeshare_api::{GpuInfo, NodeInventory};
use kubeshare_testkit::metrics::{label, sample};
pub use kubeshare_testkit::metrics::{metrics_text, scheduler_client};
use kubeshare_testkit::{KwokNode, create_kwok_node, node_is_ready};

const GIB: u64 = 1 << 30;

/// The label every node and pod of a bench carries (value: the bench's name).
pub const BENCH_LABEL: &str = "kubeshare.io/bench";

/// The extender as a child process, restarted when a bench kills it.
pub struct Extender {
    child: Child,
    bin: PathBuf,
    kubeconfig: PathBuf,
    port: u16,
    log: PathBuf,
}

impl Extender {
    fn spawn(
        bin: &Path,
        kubeconfig: &Path,
        port: u16,
        log: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Child> {
        let out = OpenOptions::new().create(true).append(true).open(log)?;
        let mut cmd = Command::new(bin);
        // SAFETY: prctl is async-signal-safe; the child dies with the bench, even
        // when the bench is killed and its destructors never run.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd.args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))
    }

    pub fn start(bin: &Path, kubeconfig: &Path, port: u16, log: &Path) -> anyhow::Result<Extender> {
        let child = Self::spawn(bin, kubeconfig, port, log, &[])?;
        Ok(Extender {
            child,
            bin: bin.to_owned(),
            kubeconfig: kubeconfig.to_owned(),
            port,
            log: log.to_owned(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        self.child.kill().context("killing the extender")?;
        self.child.wait()?;
        self.child = Self::spawn(&self.bin, &self.kubeconfig, self.port, &self.log, &[])?;
        Ok(())
    }

    /// Stops the extender (SIGTERM, so it finishes what it serves), starts it again with
    /// `extra` arguments and waits until it is ready (plain HTTP only).
    pub async fn restart_with(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        signal(self.pid(), "TERM")?;
        self.child
            .wait()
            .context("waiting for the extender to stop")?;
        self.child = Self::spawn(&self.bin, &self.kubeconfig, self.port, &self.log, extra)?;
        let t = Instant::now();
        while extender_get(self.port, "/readyz").await.is_err() {
            if t.elapsed() > Duration::from_secs(60) {
                bail!("the extender restarted with {extra:?} is not ready after 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

impl Drop for Extender {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kill -SIG pid`.
pub fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .context("running kill")?
        .success();
    if !ok {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}

/// The pid of a component of the local cluster (hack/cluster.sh writes them).
pub fn component_pid(run_dir: &Path, name: &str) -> anyhow::Result<u32> {
    let f = run_dir.join(format!("pids/{name}.pid"));
    std::fs::read_to_string(&f)
        .with_context(|| format!("reading {}", f.display()))?
        .trim()
        .parse()
        .with_context(|| format!("{}: not a pid", f.display()))
}

/// User + system CPU time a process has used so far.
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields after it are plain.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("malformed /proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        f.get(i)
            .context("short /proc stat")?
            .parse::<u64>()
            .context("bad /proc stat field")
    };
    // Linux reports in USER_HZ, 100 on every architecture it runs on here.
    Ok(Duration::from_millis((ticks(11)? + ticks(12)?) * 10))
}

/// The whole machine's CPU ticks so far, from the first line of /proc/stat: what
/// every process used (busy), what the hypervisor took from this VM (steal), and
/// all of them (total), in USER_HZ ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MachineCpu {
    pub busy: u64,
    pub steal: u64,
    pub total: u64,
}

impl MachineCpu {
    /// Reads /proc/stat now.
    pub fn now() -> anyhow::Result<MachineCpu> {
        let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        MachineCpu::parse(&stat)
    }

    /// Parses the aggregate `cpu` line: user nice system idle iowait irq softirq steal.
    fn parse(stat: &str) -> anyhow::Result<MachineCpu> {
        let line = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("/proc/stat has no aggregate cpu line")?;
        let f = line
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse::<u64>().context("bad /proc/stat field"))
            .collect::<anyhow::Result<Vec<u64>>>()?;
        let at = |i: usize| f.get(i).copied().context("short /proc/stat cpu line");
        let (idle, iowait, steal) = (at(3)?, at(4)?, at(7)?);
        // guest time is already inside user and nice, so the first eight make the total.
        let total: u64 = f.iter().take(8).sum();
        Ok(MachineCpu {
            busy: total - idle - iowait - steal,
            steal,
            total,
        })
    }

    /// Cores busy and cores stolen, on average, from `self` to `later` over `wall`.
    pub fn cores_until(&self, later: &MachineCpu, wall: Duration) -> (f64, f64) {
        let secs = wall.as_secs_f64().max(1e-9);
        let cores = |a: u64, b: u64| b.saturating_sub(a) as f64 / 100.0 / secs;
        (cores(self.busy, later.busy), cores(self.steal, later.steal))
    }
}

/// TCP connections opened on this machine so far (`/proc/net/snmp`): every
/// connection between the control plane's processes is a loopback one, opened once
/// (active) and accepted once (passive). A client that keeps too few idle
/// connections for its concurrent calls opens one per call beyond them.
pub fn tcp_passive_opens() -> anyhow::Result<u64> {
    let snmp = std::fs::read_to_string("/proc/net/snmp").context("reading /proc/net/snmp")?;
    parse_passive_opens(&snmp)
}

/// The `PassiveOpens` field of the `Tcp:` header and value lines.
fn parse_passive_opens(snmp: &str) -> anyhow::Result<u64> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (
        tcp.next().context("/proc/net/snmp has no Tcp lines")?,
        tcp.next().context("/proc/net/snmp has no Tcp values")?,
    );
    let at = names
        .split_whitespace()
        .position(|n| n == "PassiveOpens")
        .context("/proc/net/snmp has no PassiveOpens")?;
    values
        .split_whitespace()
        .nth(at)
        .context("short Tcp values line")?
        .parse()
        .context("bad PassiveOpens value")
}

/// How fast this machine runs a fixed piece of work while a run goes on: the CPU
/// time one batch takes on a thread of its own, sampled every `every`. Waiting for a
/// core does not count; a slower core, a busier cache or cycles a hypervisor takes
/// without reporting them as steal do. So when a run costs more CPU per pod than
/// another of its configuration, a slower machine is told from slower processes
/// (seen: runs of one configuration 30 % apart in CPU per pod while it read
/// within 10 %).
pub struct SpeedProbe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl SpeedProbe {
    pub fn start(every: Duration) -> SpeedProbe {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(Ordering::Acquire) {
                let t0 = thread_cpu();
                std::hint::black_box(probe_batch(std::hint::black_box(0x9e37_79b9)));
                samples.push((thread_cpu() - t0).as_secs_f64() * 1e6);
                std::thread::sleep(every);
            }
            samples
        });
        SpeedProbe { stop, thread }
    }

    /// Stops the probe: the median CPU µs per batch (None if it took no sample).
    pub fn finish(self) -> Option<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let mut v = self.thread.join().ok()?;
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }
}

/// The probe's fixed work: a million steps of xorshift, ~2 ms on this machine.
fn probe_batch(mut x: u64) -> u64 {
    for _ in 0..1_000_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    x
}

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid one given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// CPU time used so far by each named process.
pub fn cpu_snapshot(pids: &BTreeMap<String, u32>) -> anyhow::Result<BTreeMap<String, Duration>> {
    pids.iter()
        .map(|(n, &p)| Ok((n.clone(), cpu_time(p)?)))
        .collect()
}

/// Creates an empty namespace.
pub async fn create_namespace(admin: &Client, name: &str) -> anyhow::Result<()> {
    let nss: Api<Namespace> = Api::all(admin.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?,
    )
    .await
    .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

/// Resident memory of a process, bytes.
pub fn rss(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no VmRSS")?;
    Ok(kb * 1024)
}

fn uuid(node: u32, gpu: u32) -> String {
    format!("GPU-{node:08x}-0000-0000-0000-{gpu:012x}")
}

/// `gpus` simulated H100s.
pub fn inventory(node: u32, gpus: u32) -> NodeInventory {
    NodeInventory {
        gpus: (0..gpus)
            .map(|i| GpuInfo {
                uuid: uuid(node, i),
                index: i,
                model: "NVIDIA-H100-80GB-HBM3".into(),
                memory: 80 * GIB,
                numa_node: Some(0),
                nvlink_peers: vec![],
                held_by: None,
            })
            .collect(),
    }
}

/// Creates `n` kwok nodes `bench-00000…` with `gpus` simulated GPUs each,
/// labelled `BENCH_LABEL=bench`, and waits until all are Ready.
pub async fn create_gpu_nodes(
    admin: &Client,
    bench: &str,
    n: u32,
    gpus: u32,
    concurrency: usize,
) -> anyhow::Result<()> {
    let t = Instant::now();
    let nodes: Api<Node> = Api::all(admin.clone());
    // Nodes an earlier bench left in this cluster (same names, maybe other GPUs).
    nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(BENCH_LABEL),
        )
        .await
        .context("deleting an earlier bench's nodes")?;
    stream::iter(0..n)
        .map(|i| {
            let admin = admin.clone();
            let inv = inventory(i, gpus);
            async move {
                let spec = KwokNode::new(format!("bench-{i:05}"))
                    .label(BENCH_LABEL, bench)
                    .annotation(INVENTORY_ANNOTATION, inv.to_json());
                create_kwok_node(&admin, &spec).await
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<_>>()
        .await
        .context("creating nodes")?;
    let lp = ListParams::default().labels(&format!("{BENCH_LABEL}={bench}"));
    // Ready is not enough: a new node carries `node.kubernetes.io/not-ready:NoSchedule`
    // (admission) until the node lifecycle controller takes it off, a GET and a PATCH
    // per node at its own pace; 1,000 nodes took minutes, so the first runs were timed
    // while kube-scheduler still failed tainted nodes and followed ~200 node updates
    // a run (measured: the taint filter 0.6-1.2 s of an 8 s window, 0.03-0.2 after).
    loop {
        let listed = nodes.list(&lp).await?.items;
        let settled = listed
            .iter()
            .filter(|n| node_is_ready(n) && !has_node_condition_taint(n))
            .count();
        if settled as u32 >= n {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(300) {
            let ready = listed.iter().filter(|n| node_is_ready(n)).count();
            bail!("only {ready} of {n} nodes Ready and {settled} untainted after 300 s");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Whether a node still carries a taint the control plane manages
/// (`node.kubernetes.io/...`: not-ready, unreachable, pressure conditions).
pub fn has_node_condition_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key.starts_with("node.kubernetes.io/")))
}

/// Every pod of `pods`, in pages (one list of thousands of pods is slow to
/// serve on a loaded apiserver and is cut off by its request timeout).
pub async fn list_all(pods: &Api<Pod>) -> anyhow::Result<Vec<Pod>> {
    let mut all = Vec::new();
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = pods.list(&lp).await?;
        all.extend(page.items);
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(all),
        }
    }
}

/// `apiserver_request_total`, summed by "VERB resource[/subresource]", from the
/// apiserver's Prometheus text.
pub fn api_requests(metrics: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some((labels, v)) = sample(line, "apiserver_request_total") else {
            continue;
        };
        let sub = label(labels, "subresource");
        let key = format!(
            "{} {}{}{}",
            label(labels, "verb"),
            label(labels, "resource"),
            if sub.is_empty() { "" } else { "/" },
            sub
        );
        *out.entry(key).or_default() += v;
    }
    out
}

/// What the apiserver sent its watchers, by resource: "events R" (`apiserver_watch_events_total`)
/// and "KiB R" (`apiserver_watch_events_sizes`), every watcher's copy counted: each extra
/// watcher of a resource costs the apiserver an encoding of each event in its format.
pub fn watch_events(metrics: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let (what, labels, v) = if let Some((l, v)) = sample(line, "apiserver_watch_events_total") {
            ("events", l, v)
        } else if let Some((l, v)) = sample(line, "apiserver_watch_events_sizes_sum") {
            ("KiB", l, v / 1024.0)
        } else {
            continue;
        };
        // The label is `resource` in recent releases, `kind` before.
        let r = match label(labels, "resource") {
            "" => label(labels, "kind"),
            r => r,
        };
        *out.entry(format!("{what} {r}")).or_default() += v;
    }
    out
}

/// The apiserver's metrics text.
pub async fn apiserver_metrics(admin: &Client) -> anyhow::Result<String> {
    Ok(metrics_text(admin, "the apiserver").await?)
}

/// The extender's metrics text (plain HTTP on `127.0.0.1:port`, as the bench runs it).
pub async fn extender_metrics(port: u16) -> anyhow::Result<String> {
    extender_get(port, "/metrics").await
}

/// The body of `GET path` from the extender on plain HTTP, if it answers 200.
async fn extender_get(port: u16, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .context("connecting to the extender")?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .with_context(|| format!("asking the extender for {path}"))?;
    let mut body = Vec::new();
    s.read_to_end(&mut body)
        .await
        .with_context(|| format!("reading the extender's {path}"))?;
    let text = String::from_utf8_lossy(&body);
    match text.split_once("\r\n\r\n") {
        Some((head, rest)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(rest.to_string())
        }
        _ => bail!(
            "the extender's {path} answered {:?}",
            text.lines().next().unwrap_or("")
        ),
    }
}

/// The histogram `name`'s (sum, count), from Prometheus text, summed over every label but
/// those in `keep`: keyed by the kept labels (`{k="v",...}` in text order; "" when none).
pub fn histogram_sums(metrics: &str, name: &str, keep: &[&str]) -> BTreeMap<String, (f64, f64)> {
    let (sum, count) = (format!("{name}_sum"), format!("{name}_count"));
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in metrics.lines() {
        let (is_sum, (labels, v)) = match (sample(line, &sum), sample(line, &count)) {
            (Some(x), _) => (true, x),
            (None, Some(x)) => (false, x),
            (None, None) => continue,
        };
        let kept: Vec<&str> = labels
            .split(',')
            .filter(|kv| {
                kv.split_once('=')
                    .is_some_and(|(k, _)| keep.contains(&k.trim()))
            })
            .collect();
        let key = if kept.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", kept.join(","))
        };
        let e = out.entry(key).or_default();
        if is_sum {
            e.0 += v;
        } else {
            e.1 += v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condition_taints_are_told_from_the_users() {
        use k8s_openapi::api::core::v1::{NodeSpec, Taint};
        let node = |keys: &[&str]| Node {
            spec: Some(NodeSpec {
                taints: Some(
                    keys.iter()
                        .map(|k| Taint {
                            key: k.to_string(),
                            effect: "NoSchedule".into(),
                            ..Taint::default()
                        })
                        .collect(),
                ),
                ..NodeSpec::default()
            }),
            ..Node::default()
        };
        assert!(has_node_condition_taint(&node(&[
            "node.kubernetes.io/not-ready"
        ])));
        assert!(!has_node_condition_taint(&node(&["example.com/gpu"])));
        assert!(!has_node_condition_taint(&node(&[])));
        assert!(!has_node_condition_taint(&Node::default()));
    }

    #[test]
    fn passive_opens_are_read_by_name() {
        let snmp = "Ip: Forwarding\nIp: 1\nTcp: RtoAlgorithm ActiveOpens PassiveOpens\nTcp: 1 164824 144368\n";
        assert_eq!(parse_passive_opens(snmp).unwrap(), 144368);
        assert!(parse_passive_opens("Tcp: PassiveOpens\n").is_err());
        assert!(parse_passive_opens("Tcp: PassiveOpens\nTcp: x\n").is_err());
    }

    #[test]
    fn the_speed_probe_reports_the_cpu_time_of_its_batches() {
        let probe = SpeedProbe::start(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(50));
        let us = probe.finish().expect("samples");
        // A million dependent steps take at least a few hundred µs of CPU on any core.
        assert!(us > 100.0 && us < 1_000_000.0, "{us} µs");
    }

    #[test]
    fn the_machine_cpu_line_is_split_into_busy_steal_and_total() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n";
        let m = MachineCpu::parse(stat).unwrap();
        assert_eq!(
            m,
            MachineCpu {
                busy: 160,
                steal: 10,
                total: 990
            }
        );
        let later = MachineCpu {
            busy: 360,
            steal: 60,
            total: 1990,
        };
        let (busy, steal) = m.cores_until(&later, Duration::from_secs(2));
        assert!((busy - 1.0).abs() < 1e-9 && (steal - 0.25).abs() < 1e-9);
        assert!(MachineCpu::parse("intr 1 2\n").is_err());
        assert!(MachineCpu::parse("cpu  1 2 x\n").is_err());
    }

    #[test]
    fn requests_are_summed_by_verb_and_resource() {
        let m = r#"# HELP apiserver_request_total x
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="binding",verb="POST",version="v1"} 7
apiserver_request_total{code="409",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="binding",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 3.5
apiserver_request_total{broken 1
"#;
        let r = api_requests(m);
        assert_eq!(r.get("POST pods/binding"), Some(&9.0));
        assert_eq!(r.get("LIST pods"), Some(&3.5));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn watch_events_are_summed_by_resource() {
        let m = r#"apiserver_watch_events_total{component="apiserver",group="",resource="pods",version="v1"} 40
apiserver_watch_events_total{component="apiserver",group="",resource="nodes",version="v1"} 5
apiserver_watch_events_sizes_bucket{group="",resource="pods",version="v1",le="1024"} 3
apiserver_watch_events_sizes_sum{group="",resource="pods",version="v1"} 2048
apiserver_watch_events_total{group="",kind="Lease",version="v1"} 2
"#;
        let w = watch_events(m);
        assert_eq!(w.get("events pods"), Some(&40.0));
        assert_eq!(w.get("events nodes"), Some(&5.0));
        assert_eq!(w.get("KiB pods"), Some(&2.0));
        assert_eq!(w.get("events Lease"), Some(&2.0));
        assert_eq!(w.len(), 4);
    }

    #[test]
    fn histograms_are_summed_over_the_labels_not_kept() {
        let m = r#"# HELP scheduler_scheduling_algorithm_duration_seconds x
scheduler_scheduling_algorithm_duration_seconds_bucket{le="0.001"} 3
scheduler_scheduling_algorithm_duration_seconds_sum 0.25
scheduler_scheduling_algorithm_duration_seconds_count 100
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",profile="a",status="Success"} 0.5
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",profile="b",status="Unschedulable"} 0.25
scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",profile="a",status="Success"} 10
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Score",profile="a",status="Success"} 1
scheduler_framework_extension_point_duration_seconds_sum{broken 1
"#;
        let algorithm = histogram_sums(m, "scheduler_scheduling_algorithm_duration_seconds", &[]);
        assert_eq!(algorithm.get(""), Some(&(0.25, 100.0)));
        assert_eq!(algorithm.len(), 1);
        let plugins = histogram_sums(
            m,
            "scheduler_framework_extension_point_duration_seconds",
            &["extension_point"],
        );
        assert_eq!(
            plugins.get(r#"{extension_point="Filter"}"#),
            Some(&(0.75, 10.0))
        );
        assert_eq!(plugins.len(), 2);
    }
}
