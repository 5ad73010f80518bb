//! The extender's HTTP surface without Kubernetes: the upstream wire format,
//! 400 on malformed bodies, /healthz, /readyz and /metrics.

use std::collections::BTreeMap;

use kubeshare_api::{GpuInfo, NodeInventory};
use kubeshare_scheduler::{Config, Extender};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn serve(ext: &Extender) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let router = ext.router();
    tokio::spawn(async move { axum::serve(l, router).await });
    addr
}

/// One HTTP/1.1 request; returns (status, body).
async fn call(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, body)
}

fn gpu_pod(uid: &str, req: &str) -> Value {
    json!({"metadata": {"name": uid, "namespace": "d", "uid": uid,
        "labels": {"sharedgpu/gpu_request": req, "sharedgpu/gpu_limit": "1.0"}},
        "spec": {"schedulerName": "kubeshare-scheduler", "containers": [{"name": "c", "image": "i"}]}})
}

fn extender() -> Extender {
    let ext = Extender::offline(Config::default());
    ext.shared.with_cluster(|c| {
        for (n, used) in [("n1", 0u32), ("n2", 1)] {
            let inv = NodeInventory {
                gpus: vec![GpuInfo {
                    uuid: format!("GPU-0000000{used}-0000-0000-0000-000000000000"),
                    index: 0,
                    model: "M".into(),
                    memory: 1 << 34,
                    numa_node: None,
                    nvlink_peers: vec![],
                    held_by: None,
                }],
            };
            c.apply_node(n, Ok(Some(inv)));
        }
        c.apply_node("cpu-only", Ok(None));
    });
    ext
}

#[tokio::test]
async fn filter_and_prioritize_speak_the_upstream_format() {
    let ext = extender();
    let addr = serve(&ext).await;
    let args =
        json!({"Pod": gpu_pod("p", "0.5"), "Nodes": null, "NodeNames": ["n1", "n2", "cpu-only"]});
    // Not synced yet: an Error, so the scheduler retries later.
    let (st, body) = call(addr, "POST", "/filter", &args.to_string()).await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["Error"].as_str().unwrap().contains("not synced"));
    let (st, _) = call(addr, "GET", "/readyz", "").await;
    assert_eq!(st, 503);

    ext.shared.mark_synced();
    let (st, body) = call(addr, "POST", "/filter", &args.to_string()).await;
    assert_eq!(st, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["NodeNames"], json!(["n1", "n2"]));
    assert_eq!(v["Error"], "");
    assert!(
        v["FailedAndUnresolvableNodes"]["cpu-only"]
            .as_str()
            .unwrap()
            .contains("no KubeShare GPUs")
    );

    let (st, body) = call(addr, "POST", "/prioritize", &args.to_string()).await;
    assert_eq!(st, 200);
    let v: Vec<BTreeMap<String, Value>> = serde_json::from_str(&body).unwrap();
    assert_eq!(v.len(), 3);
    assert_eq!(v[0]["Host"], "n1");
    assert_eq!(v[0]["Score"], 10);
    assert_eq!(v[2]["Score"], 0);

    // A pod that asks for no GPU: every node passes, every score is 0.
    let plain =
        json!({"Pod": {"metadata": {"name": "x", "uid": "x"}}, "NodeNames": ["n1", "cpu-only"]});
    let (_, body) = call(addr, "POST", "/filter", &plain.to_string()).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["NodeNames"], json!(["n1", "cpu-only"]));
    let (_, body) = call(addr, "POST", "/prioritize", &plain.to_string()).await;
    assert_eq!(
        body,
        r#"[{"Host":"n1","Score":0},{"Host":"cpu-only","Score":0}]"#
    );

    let (st, body) = call(addr, "GET", "/metrics", "").await;
    assert_eq!(st, 200);
    assert!(
        body.contains("kubeshare_extender_decisions_total{verb=\"filter\",outcome=\"fits\"} 1")
    );
    assert!(
        body.contains("kubeshare_extender_request_duration_seconds_count{verb=\"prioritize\"} 2")
    );
    assert!(body.contains("kubeshare_gpu_memory_bytes{node=\"n1\",gpu=\"0\""));
    assert_eq!(call(addr, "GET", "/healthz", "").await, (200, "ok".into()));
}

#[tokio::test]
async fn malformed_bodies_get_400_with_a_message() {
    let ext = extender();
    ext.shared.mark_synced();
    let addr = serve(&ext).await;
    for (path, body) in [
        ("/filter", "{"),
        ("/filter", "[]"),
        ("/filter", r#"{"NodeNames": ["n1"]}"#),
        ("/filter", r#"{"Pod": 3, "NodeNames": ["n1"]}"#),
        ("/prioritize", "not json"),
        ("/bind", r#"{"PodName": "p"}"#),
        ("/bind", ""),
    ] {
        let (st, msg) = call(addr, "POST", path, body).await;
        assert_eq!(st, 400, "{path} {body}: {msg}");
        assert!(msg.contains(&path[1..]), "{msg}");
    }
    // The server is still up.
    assert_eq!(call(addr, "GET", "/healthz", "").await.0, 200);
}

#[tokio::test]
async fn bind_without_an_api_client_is_an_error_reply_not_a_crash() {
    let ext = extender();
    ext.shared.mark_synced();
    let addr = serve(&ext).await;
    let b = json!({"PodName": "p", "PodNamespace": "d", "PodUID": "p", "Node": "n1"});
    let (st, body) = call(addr, "POST", "/bind", &b.to_string()).await;
    assert_eq!(st, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(!v["Error"].as_str().unwrap().is_empty());
}

#[tokio::test]
async fn https_serves_the_same_routes_and_shuts_down_gracefully() {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let ext = extender();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kubeshare_scheduler::serve(
        ext.router(),
        addr,
        Some(kubeshare_scheduler::TlsFiles { cert, key }),
        async {
            let _ = rx.await;
        },
    ));
    let der = ck.cert.der().clone();
    let reply = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        // The server may need a moment to bind.
        let tcp = (0..50)
            .find_map(|_| {
                std::net::TcpStream::connect(addr)
                    .map_err(|_| std::thread::sleep(std::time::Duration::from_millis(100)))
                    .ok()
            })
            .expect("server listening");
        let conn = rustls::ClientConnection::new(std::sync::Arc::new(cfg), name).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        let _ = tls.read_to_string(&mut out);
        out
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with("ok"), "{reply}");
    tx.send(()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(15), server)
        .await
        .expect("graceful shutdown finishes")
        .unwrap()
        .unwrap();
}
