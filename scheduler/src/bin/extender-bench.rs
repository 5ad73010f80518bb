//! `extender-bench`: decision latency of filter + prioritize + bind on a large
//! simulated cluster (default 1,000 nodes × 8 GPUs with 5,000 pods placed).
//!
//! In-process: the same `Shared` methods the HTTP handlers call, lock included,
//! from the decoded request on. With `--http`: filter and prioritize as the
//! kube-scheduler sends them (1,000 NodeNames as JSON over loopback HTTP/1.1 with
//! keep-alive). Bind's API writes are not part of the decision and not measured.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use axum::serve::ListenerExt;
use clap::Parser;
use kubeshare_api::{GpuInfo, NodeInventory};
use kubeshare_scheduler::convert::WirePod;
use kubeshare_scheduler::wire::{ExtenderArgs, HostPriority};
use kubeshare_scheduler::{Config, Extender, PodInfo};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

#[derive(Debug, Parser)]
#[command(about = "Decision latency of the KubeShare extender on a simulated cluster")]
struct Args {
    #[arg(long, default_value_t = 1000)]
    nodes: u32,
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Pods placed before measuring.
    #[arg(long, default_value_t = 5000)]
    placed: u32,
    /// Decisions measured (each followed by the delete of an old pod, so the
    /// cluster stays at `placed` pods).
    #[arg(long, default_value_t = 2000)]
    decisions: u32,
    /// Also measure filter + prioritize over HTTP with JSON bodies.
    #[arg(long)]
    http: bool,
    /// Give every fractional pod its own `gpu_mem` so that no two demands are
    /// equal and the filter's memo never helps (its worst case).
    #[arg(long)]
    distinct_demands: bool,
    /// Also time a restart's rebuild: a fresh extender given the nodes and every
    /// placed pod's record, as its watches would list them; its books must equal
    /// the live ones.
    #[arg(long)]
    rebuild: bool,
}

/// A mix of demands: mostly fractions, some with memory, some spread, some
/// multi-GPU; with `distinct`, each fractional pod's memory differs.
fn labels(i: u32, distinct: bool) -> BTreeMap<String, String> {
    let kv: &[(&str, &str)] = match i % 10 {
        0..=2 => &[("gpu_request", "0.25"), ("gpu_limit", "0.5")],
        3 | 4 => &[("gpu_request", "0.5"), ("gpu_limit", "1.0")],
        5 => &[
            ("gpu_request", "0.1"),
            ("gpu_limit", "0.3"),
            ("gpu_mem", "8Gi"),
        ],
        6 => &[
            ("gpu_request", "0.3"),
            ("gpu_limit", "1"),
            ("priority", "50"),
        ],
        7 => &[
            ("gpu_request", "0.2"),
            ("gpu_limit", "0.2"),
            ("gpu_count", "2"),
        ],
        8 => &[
            ("gpu_request", "0.4"),
            ("gpu_limit", "0.8"),
            ("sched_anti-affinity", "web"),
        ],
        _ => &[("gpu_request", "1.0"), ("gpu_limit", "1.0")],
    };
    let mut m: BTreeMap<String, String> = kv
        .iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
        .collect();
    if distinct && i % 10 != 9 {
        m.insert("sharedgpu/gpu_mem".into(), format!("{}Mi", 1024 + i % 4096));
    }
    m
}

fn wire_pod(i: u32, distinct: bool) -> WirePod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("p{i}"), "namespace": "bench", "uid": format!("uid-{i}"),
                     "labels": labels(i, distinct)},
        "spec": {"schedulerName": "kubeshare-scheduler"}
    }))
    .unwrap_or_default()
}

fn inventory(n: u32, gpus: u32) -> NodeInventory {
    NodeInventory {
        gpus: (0..gpus)
            .map(|g| GpuInfo {
                uuid: format!("GPU-{n:08x}-0000-0000-0000-{g:012x}"),
                index: g,
                model: "NVIDIA-H100-80GB-HBM3".into(),
                memory: 80 << 30,
                numa_node: Some(g / 4),
                nvlink_peers: vec![],
                held_by: None,
            })
            .collect(),
    }
}

#[derive(Default)]
struct Samples(Vec<Duration>);

impl Samples {
    fn line(&mut self, what: &str) -> String {
        self.0.sort_unstable();
        let q = |p: f64| {
            let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
            self.0.get(i).copied().unwrap_or_default().as_secs_f64() * 1e3
        };
        format!(
            "{what:<28} n={:<5} p50={:.3} ms  p90={:.3} ms  p99={:.3} ms  max={:.3} ms",
            self.0.len(),
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0)
        )
    }
}

/// CPU time of this thread: unlike wall time, not inflated when other
/// processes take the (shared, 2-core) machine.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// This process's resident set in MiB (0 if /proc cannot tell).
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Filter, prioritize and bind latencies of one decision.
type Latencies = (Duration, Duration, Duration);

/// Filter → prioritize → bind → the watch confirms; returns the three latencies.
fn decide(
    ext: &Extender,
    i: u32,
    names: &[String],
    distinct: bool,
) -> Result<Option<(Latencies, PodInfo)>> {
    let s = &ext.shared;
    let pod = wire_pod(i, distinct);
    let args = ExtenderArgs {
        pod: Some(pod.clone()),
        nodes: None,
        node_names: Some(names.to_vec()),
    };
    let t0 = Instant::now();
    let (f, _) = s.filter(&args).map_err(|e| anyhow::anyhow!(e.0))?;
    let t1 = Instant::now();
    let passed = f.node_names.unwrap_or_default();
    if passed.is_empty() {
        return Ok(None);
    }
    let pargs = ExtenderArgs {
        node_names: Some(passed),
        ..args
    };
    let scores = s.prioritize(&pargs).map_err(|e| anyhow::anyhow!(e.0))?;
    let t2 = Instant::now();
    let best = scores
        .iter()
        .max_by(|a, b| a.score.cmp(&b.score).then(b.host.cmp(&a.host)))
        .map(|h| h.host.clone())
        .context("no scores")?;
    let uid = format!("uid-{i}");
    let now = s.now_ms();
    let d = match s
        .with_cluster(|c| c.bind(&uid, &best, now))
        .map_err(|e| anyhow::anyhow!(e))?
    {
        kubeshare_scheduler::BindStep::Go(d) => *d,
        kubeshare_scheduler::BindStep::Wait => anyhow::bail!("the bench has no groups"),
    };
    let t3 = Instant::now();
    let mut info = pod.info();
    info.node_name = Some(best);
    info.allocation = Ok(d.allocation);
    s.with_cluster(|c| c.apply_pod(&info));
    Ok(Some(((t1 - t0, t2 - t1, t3 - t2), info)))
}

async fn http_call(
    r: &mut BufReader<tokio::net::TcpStream>,
    path: &str,
    body: &[u8],
) -> Result<Vec<u8>> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    // One write: a split request meets Nagle and delayed ACKs (40 ms).
    let mut req = head.into_bytes();
    req.extend_from_slice(body);
    r.get_mut().write_all(&req).await?;
    let mut len = 0usize;
    let mut status = String::new();
    r.read_line(&mut status).await?;
    if !status.contains(" 200 ") {
        bail!("{path}: {status}");
    }
    loop {
        let mut line = String::new();
        r.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse()?;
        }
    }
    let mut out = vec![0; len];
    r.read_exact(&mut out).await?;
    Ok(out)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let a = Args::parse();
    let distinct = a.distinct_demands;
    let ext = Extender::offline(Config::default());
    let setup = Instant::now();
    ext.shared.with_cluster(|c| {
        for n in 0..a.nodes {
            c.apply_node(&format!("node-{n:04}"), Ok(Some(inventory(n, a.gpus))));
        }
    });
    ext.shared.mark_synced();
    let names = ext.shared.with_cluster(|c| c.node_names());
    let rss_nodes = rss_mib();
    let mut live: VecDeque<u32> = VecDeque::new();
    let mut records: HashMap<u32, PodInfo> = HashMap::new();
    for i in 0..a.placed {
        if let Some((_, info)) = decide(&ext, i, &names, distinct)? {
            live.push_back(i);
            records.insert(i, info);
        }
    }
    let (obs, _, _) = ext.shared.with_cluster(|c| c.booking_counts());
    let used: u64 = ext
        .shared
        .with_cluster(|c| c.usage().iter().map(|g| u64::from(g.used_milli)).sum());
    println!(
        "cluster: {} nodes x {} GPUs, {} pods placed ({obs} allocations, {:.1}% of GPU share booked), setup {:.1} s{}",
        a.nodes,
        a.gpus,
        live.len(),
        used as f64 / (f64::from(a.nodes * a.gpus) * 10.0),
        setup.elapsed().as_secs_f64(),
        if distinct {
            ", every demand distinct"
        } else {
            ""
        }
    );

    let (mut f, mut p, mut b, mut total) = Default::default();
    let (fs, ps, bs, ts): (&mut Samples, &mut Samples, &mut Samples, &mut Samples) =
        (&mut f, &mut p, &mut b, &mut total);
    let mut cpu = Samples::default();
    let mut next = a.placed;
    for _ in 0..a.decisions {
        let c0 = thread_cpu();
        let r = decide(&ext, next, &names, distinct)?;
        cpu.0.push(thread_cpu().saturating_sub(c0));
        if let Some(((x, y, z), info)) = r {
            fs.0.push(x);
            ps.0.push(y);
            bs.0.push(z);
            ts.0.push(x + y + z);
            live.push_back(next);
            records.insert(next, info);
        }
        next += 1;
        if let Some(old) = live.pop_front() {
            ext.shared
                .with_cluster(|c| c.delete_pod(&format!("uid-{old}")));
            records.remove(&old);
        }
    }
    println!("in-process (decoded request, lock held, no JSON):");
    println!("  {}", fs.line(&format!("filter ({} nodes)", a.nodes)));
    println!("  {}", ps.line("prioritize"));
    println!("  {}", bs.line("bind decision"));
    println!("  {}", ts.line("filter+prioritize+bind"));
    println!("  {}", cpu.line("  same, thread CPU time"));
    // A Prometheus scrape: the books as gauges, five series per GPU.
    let t = Instant::now();
    let (usage, counts) = ext.shared.with_cluster(|c| (c.usage(), c.booking_counts()));
    let text = ext.shared.metrics.render(&usage, counts, true);
    println!(
        "/metrics: {:.1} ms for {} GPUs ({:.1} MiB of text)",
        t.elapsed().as_secs_f64() * 1000.0,
        usage.len(),
        text.len() as f64 / f64::from(1u32 << 20)
    );
    ext.shared
        .with_cluster(|c| c.check_invariants())
        .map_err(|e| anyhow::anyhow!(e))?;
    if a.rebuild {
        rebuild_check(&ext, &a, &records)?;
    }
    if a.http {
        http_bench(&ext, &a, &names, next).await?;
    }
    // Memory: the process also holds each pod's record as the watch delivered it
    // (`records`), so "with pods" overstates the extender's own books.
    let rss_pods = rss_mib();
    ext.shared.with_cluster(|c| {
        for i in &live {
            c.delete_pod(&format!("uid-{i}"));
        }
    });
    drop(records);
    ext.shared.with_cluster(|c| c.compact());
    kubeshare_scheduler::tasks::release_free_memory();
    println!(
        "RSS: {rss_nodes:.1} MiB with the nodes, {rss_pods:.1} MiB with {} pods placed, {:.1} MiB after every pod was deleted (heap trimmed as the extender's timer does)",
        live.len(),
        rss_mib()
    );
    Ok(())
}

/// Rebuilds the books as a restart's relist does, and checks they equal the live ones.
fn rebuild_check(ext: &Extender, a: &Args, records: &HashMap<u32, PodInfo>) -> Result<()> {
    let fresh = Extender::offline(Config::default());
    fresh.shared.with_cluster(|c| {
        for n in 0..a.nodes {
            c.apply_node(&format!("node-{n:04}"), Ok(Some(inventory(n, a.gpus))));
        }
    });
    let t = Instant::now();
    fresh.shared.with_cluster(|c| {
        for info in records.values() {
            c.apply_pod(info);
        }
    });
    let took = t.elapsed();
    let (live_books, rebuilt) = (
        ext.shared.with_cluster(|c| c.usage()),
        fresh.shared.with_cluster(|c| c.usage()),
    );
    if live_books != rebuilt {
        bail!("the rebuilt books differ from the live ones");
    }
    println!(
        "rebuild (a restart's relist): {} pods with records onto {} nodes in {:.3} s; books equal the live ones",
        records.len(),
        a.nodes,
        took.as_secs_f64()
    );
    Ok(())
}

/// The filter and prioritize verbs over HTTP, as kube-scheduler calls them.
async fn http_bench(ext: &Extender, a: &Args, names: &[String], mut next: u32) -> Result<()> {
    let distinct = a.distinct_demands;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let l = l.tap_io(|t| {
        let _ = t.set_nodelay(true);
    });
    let router = ext.router();
    tokio::spawn(async move { axum::serve(l, router).await });
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let mut conn = BufReader::new(stream);
    let (mut hf, mut hp, mut ht) = (Samples::default(), Samples::default(), Samples::default());
    for _ in 0..a.decisions {
        let i = next;
        next += 1;
        let body = serde_json::to_vec(&json!({
            "Pod": {"metadata": {"name": format!("p{i}"), "namespace": "bench",
                    "uid": format!("uid-{i}"), "labels": labels(i, distinct)},
                    "spec": {"schedulerName": "kubeshare-scheduler",
                             "containers": [{"name": "main", "image": "x"}]}},
            "Nodes": null,
            "NodeNames": names,
        }))?;
        let t0 = Instant::now();
        let fr = http_call(&mut conn, "/filter", &body).await?;
        let t1 = Instant::now();
        let v: serde_json::Value = serde_json::from_slice(&fr)?;
        let passed = v["NodeNames"].clone();
        let pbody = serde_json::to_vec(&json!({
            "Pod": {"metadata": {"name": format!("p{i}"), "namespace": "bench",
                    "uid": format!("uid-{i}"), "labels": labels(i, distinct)}},
            "Nodes": null, "NodeNames": passed}))?;
        let t2 = Instant::now();
        let pr = http_call(&mut conn, "/prioritize", &pbody).await?;
        let t3 = Instant::now();
        let _: Vec<HostPriority> = serde_json::from_slice(&pr)?;
        hf.0.push(t1 - t0);
        hp.0.push(t3 - t2);
        ht.0.push((t1 - t0) + (t3 - t2));
    }
    println!(
        "over HTTP (JSON with {} NodeNames, loopback, keep-alive):",
        a.nodes
    );
    println!("  {}", hf.line("filter"));
    println!("  {}", hp.line("prioritize"));
    println!("  {}", ht.line("filter+prioritize"));
    Ok(())
}
