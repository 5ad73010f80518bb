//! `kubeshare-webhook-bench`: admission latency under load, from a separate process.
//!
//! Open loop at a fixed rate over N keep-alive HTTPS/1.1 connections: connection k
//! sends its n-th request at `start + (k + n·N) / rate`. Latency is measured from that
//! scheduled time when the connection is behind schedule, so a slow answer also counts
//! against the requests queued behind it (no coordinated omission), and from the
//! timer's wake-up otherwise (tokio's timer has 1 ms granularity). Each request is a CREATE of a fractional-GPU
//! pod with two containers and an init container; an answer counts as an error unless
//! it is HTTP 200 with `allowed: true` and a patch.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "kubeshare-webhook-bench",
    about = "Admission latency of kubeshare-webhook under a fixed request rate"
)]
struct Args {
    /// Address of the webhook (host:port).
    #[arg(long, default_value = "127.0.0.1:18443")]
    addr: SocketAddr,
    /// TLS server name to verify.
    #[arg(long, default_value = "127.0.0.1")]
    server_name: String,
    /// CA certificate (PEM) that signed the webhook's certificate.
    #[arg(long)]
    ca: PathBuf,
    /// Requests per second, all connections together.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Seconds of measured load.
    #[arg(long, default_value_t = 30)]
    duration: u64,
    /// Keep-alive connections.
    #[arg(long, default_value_t = 64)]
    connections: u32,
    /// Seconds of unmeasured load first.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
}

fn pod() -> serde_json::Value {
    let container = |name: &str| {
        json!({"name": name, "image": "nvcr.io/nvidia/pytorch:25.01-py3",
               "command": ["python", "train.py"],
               "env": [{"name": "EPOCHS", "value": "10"}],
               "resources": {"limits": {"cpu": "2", "memory": "8Gi"}}})
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "train-", "namespace": "bench",
                     "labels": {"app": "train", "sharedgpu/gpu_request": "0.5",
                                "sharedgpu/gpu_limit": "1.0", "sharedgpu/gpu_mem": "8Gi"}},
        "spec": {"schedulerName": "default-scheduler",
                 "initContainers": [container("prepare")],
                 "containers": [container("trainer"), container("sidecar")],
                 "volumes": [{"name": "data", "emptyDir": {}}]}
    })
}

struct Worker {
    latencies_us: Vec<u64>,
    errors: u64,
    first_error: Option<String>,
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(args: &Args, tls: &tokio_rustls::TlsConnector) -> anyhow::Result<Sender> {
    let tcp = tokio::net::TcpStream::connect(args.addr).await?;
    tcp.set_nodelay(true)?;
    let name = ServerName::try_from(args.server_name.clone())?;
    let stream = tls.connect(name, tcp).await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

async fn one(sender: &mut Sender, body: &Bytes, host: &str) -> anyhow::Result<()> {
    sender.ready().await?;
    let req = hyper::Request::post("/mutate")
        .header("host", host)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if status != hyper::StatusCode::OK {
        bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    let v: serde_json::Value = serde_json::from_slice(&bytes)?;
    let r = &v["response"];
    if r["allowed"] != json!(true) || !r["patch"].is_string() {
        bail!("unexpected answer: {v}");
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    args: Arc<Args>,
    tls: tokio_rustls::TlsConnector,
    body: Bytes,
    k: u32,
    start: tokio::time::Instant,
    measure_from: tokio::time::Instant,
    end: tokio::time::Instant,
) -> anyhow::Result<Worker> {
    let host = args.addr.to_string();
    let mut sender = connect(&args, &tls).await.context("connecting")?;
    let mut w = Worker {
        latencies_us: Vec::new(),
        errors: 0,
        first_error: None,
    };
    let period = Duration::from_secs_f64(f64::from(args.connections) / f64::from(args.rate));
    let offset = Duration::from_secs_f64(f64::from(k) / f64::from(args.rate));
    let mut n: u32 = 0;
    loop {
        let at = start + offset + period * n;
        n += 1;
        if at >= end {
            break;
        }
        // Latency counts from the scheduled time when this connection is behind (a
        // slow answer delays the next request: that delay is the server's), but from
        // the wake-up when it slept, since tokio's timer wakes up to 1 ms late.
        let from = if at > tokio::time::Instant::now() {
            tokio::time::sleep_until(at).await;
            tokio::time::Instant::now()
        } else {
            at
        };
        let result = one(&mut sender, &body, &host).await;
        let lat = tokio::time::Instant::now().saturating_duration_since(from);
        if at < measure_from {
            continue;
        }
        match result {
            Ok(()) => w.latencies_us.push(lat.as_micros() as u64),
            Err(e) => {
                w.errors += 1;
                w.first_error.get_or_insert_with(|| e.to_string());
                // The connection may be gone: open a new one.
                if let Ok(s) = connect(&args, &tls).await {
                    sender = s;
                }
            }
        }
    }
    Ok(w)
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    if args.rate == 0 || args.connections == 0 {
        bail!("--rate and --connections must be positive");
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = std::fs::read(&args.ca).with_context(|| format!("reading {}", args.ca.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&ca) {
        roots.add(c.context("parsing the CA")?)?;
    }
    let cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let body = Bytes::from(kubeshare_webhook::review::request_body(
        "6ca1f1c4-0d55-4b0a-9b59-3d0c8e2f7a10",
        "CREATE",
        "bench",
        Some(&pod()),
        None,
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let wall = Instant::now();
    let workers = rt.block_on(async {
        let start = tokio::time::Instant::now() + Duration::from_millis(500);
        let measure_from = start + Duration::from_secs(args.warmup);
        let end = measure_from + Duration::from_secs(args.duration);
        let tasks: Vec<_> = (0..args.connections)
            .map(|k| {
                tokio::spawn(worker(
                    args.clone(),
                    tls.clone(),
                    body.clone(),
                    k,
                    start,
                    measure_from,
                    end,
                ))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await?);
        }
        anyhow::Ok(out)
    })?;
    let mut lat = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for w in workers {
        let w = w?;
        lat.extend(w.latencies_us);
        errors += w.errors;
        if first_error.is_none() {
            first_error = w.first_error;
        }
    }
    lat.sort_unstable();
    let total = lat.len() as u64 + errors;
    println!(
        "target {} req/s for {} s over {} connections (after {} s warm-up); wall {:.1} s",
        args.rate,
        args.duration,
        args.connections,
        args.warmup,
        wall.elapsed().as_secs_f64()
    );
    println!(
        "requests {total}  ok {}  errors {errors}  achieved {:.0} req/s",
        lat.len(),
        total as f64 / args.duration as f64
    );
    println!(
        "latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}  max {:.3}",
        pct(&lat, 50.0),
        pct(&lat, 90.0),
        pct(&lat, 99.0),
        pct(&lat, 99.9),
        pct(&lat, 100.0)
    );
    if let Some(e) = first_error {
        println!("first error: {e}");
    }
    if errors > 0 {
        std::process::exit(1);
    }
    Ok(())
}
