//! The HTTPS server on loopback: TLS only, /healthz, HTTP 400 for malformed bodies,
//! and certificate reload when the PEM files change (new CA, same CA, broken files).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kubeshare_webhook::certs::{self, CertRequest};
use kubeshare_webhook::server::{self, ServeConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn cert_request(reuse_ca: bool) -> CertRequest {
    CertRequest {
        dns: vec!["localhost".into()],
        ips: vec!["127.0.0.1".parse().unwrap()],
        days: 30,
        reuse_ca,
    }
}

/// One request over a fresh TLS connection that trusts only `ca_pem`; returns the
/// status, the body and the server's leaf certificate.
async fn request(
    addr: SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>, Vec<u8>), String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let stream = tls
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, bytes.to_vec(), leaf))
}

async fn start(dir: &Path) -> server::Running {
    server::start(ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        cert: dir.join(certs::TLS_CERT),
        key: dir.join(certs::TLS_KEY),
        poll: Duration::from_secs(1),
        admit: Default::default(),
    })
    .await
    .expect("server starts")
}

fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "p-", "labels": {"sharedgpu/gpu_limit": "0.5", "sharedgpu/gpu_mem": "1Gi"}},
           "spec": {"containers": [{"name": "a", "image": "x"}]}})
}

#[tokio::test]
async fn serves_admission_over_tls_only() {
    server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let files = certs::generate(&cert_request(false), dir.path()).unwrap();
    let running = start(dir.path()).await;
    let addr = running.addr;

    let (status, body, _) = request(addr, &files.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();
    assert_eq!((status, body.as_slice()), (200, b"ok".as_slice()));

    let review = kubeshare_webhook::review::request_body("u-1", "CREATE", "ns", Some(&pod()), None);
    let (status, body, _) = request(addr, &files.ca_pem, "POST", "/mutate", review.clone())
        .await
        .unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["uid"], "u-1");
    assert_eq!(v["response"]["allowed"], true);
    assert_eq!(v["response"]["patchType"], "JSONPatch");
    let (status, body, _) = request(addr, &files.ca_pem, "POST", "/validate", review)
        .await
        .unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v["response"].get("patch").is_none());

    for bad in [
        b"{".to_vec(),
        b"{}".to_vec(),
        vec![0u8; 100],
        b"null".to_vec(),
    ] {
        let (status, body, _) = request(addr, &files.ca_pem, "POST", "/mutate", bad)
            .await
            .unwrap();
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    }
    let (status, body, _) = request(addr, &files.ca_pem, "GET", "/metrics", vec![])
        .await
        .unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains(
            "kubeshare_webhook_requests_total{endpoint=\"mutate\",outcome=\"malformed\"} 4"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "kubeshare_webhook_requests_total{endpoint=\"mutate\",outcome=\"patched\"} 1"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "kubeshare_webhook_requests_total{endpoint=\"validate\",outcome=\"allowed\"} 1"
        ),
        "{text}"
    );
    // The server keeps serving after bad input.
    let (status, _, _) = request(addr, &files.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();
    assert_eq!(status, 200);

    // Plain HTTP on the port gets no HTTP answer.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/"),
        "{}",
        String::from_utf8_lossy(&buf)
    );

    // A client that does not trust the CA is refused.
    let other = tempfile::tempdir().unwrap();
    let other_ca = certs::generate(&cert_request(false), other.path()).unwrap();
    assert!(
        request(addr, &other_ca.ca_pem, "GET", "/healthz", vec![])
            .await
            .is_err()
    );

    running.shutdown(Duration::from_secs(1)).await.unwrap();
}

/// Polls until `f` holds or 15 s pass.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for: {what}");
}

#[tokio::test]
async fn reloads_the_certificate_when_the_files_change() {
    server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let first = certs::generate(&cert_request(false), dir.path()).unwrap();
    let running = start(dir.path()).await;
    let addr = running.addr;
    let (_, _, leaf1) = request(addr, &first.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();

    // Same CA, new leaf: the caBundle stays valid and the new leaf is served.
    let same_ca = certs::generate(&cert_request(true), dir.path()).unwrap();
    assert_eq!(same_ca.ca_pem, first.ca_pem);
    eventually("new leaf under the same CA", || async {
        matches!(request(addr, &first.ca_pem, "GET", "/healthz", vec![]).await,
                 Ok((200, _, leaf)) if leaf != leaf1)
    })
    .await;

    let (_, _, leaf2) = request(addr, &first.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();
    let stats = running.stats.clone();
    assert!(
        stats.tls_reloads(true) >= 1,
        "the new leaf's reload is counted"
    );
    // A half-written pair may have failed once on the way: count from here.
    let failed_before = stats.tls_reloads(false);

    // A broken certificate file: the server keeps its current certificate.
    std::fs::write(
        dir.path().join(certs::TLS_CERT),
        b"-----BEGIN CERTIFICATE-----\ngarbage\n",
    )
    .unwrap();
    // Wait for the reloader to have tried the broken file and refused it, then check that
    // the certificate it served before is still served.
    eventually("the broken certificate refused", || {
        let stats = stats.clone();
        async move { stats.tls_reloads(false) > failed_before }
    })
    .await;
    let (status, _, leaf) = request(addr, &first.ca_pem, "GET", "/healthz", vec![])
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(leaf, leaf2, "the certificate served before the broken file");

    // A new CA: clients of the new bundle get in, clients of the old one no longer do.
    let second = certs::generate(&cert_request(false), dir.path()).unwrap();
    assert_ne!(second.ca_pem, first.ca_pem);
    eventually("certificate of the new CA", || async {
        request(addr, &second.ca_pem, "GET", "/healthz", vec![])
            .await
            .is_ok()
    })
    .await;
    assert!(
        request(addr, &first.ca_pem, "GET", "/healthz", vec![])
            .await
            .is_err()
    );

    running.shutdown(Duration::from_secs(1)).await.unwrap();
}

#[test]
fn certs_need_a_name_and_verify() {
    server::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let req = CertRequest {
        dns: vec![],
        ips: vec![],
        days: 1,
        reuse_ca: false,
    };
    assert!(matches!(
        certs::generate(&req, dir.path()),
        Err(certs::CertError::NoNames)
    ));
    let req = CertRequest {
        dns: vec!["kubeshare-webhook.kubeshare-system.svc".into()],
        ips: vec![],
        days: 1,
        reuse_ca: false,
    };
    let files = certs::generate(&req, dir.path()).unwrap();
    let leaf = std::fs::read_to_string(files.cert()).unwrap();
    certs::verify(
        &files.ca_cert(),
        &files.ca_pem,
        &leaf,
        "kubeshare-webhook.kubeshare-system.svc",
    )
    .unwrap();
    // Not valid for a name it was not made for.
    assert!(certs::verify(&files.ca_cert(), &files.ca_pem, &leaf, "evil.example").is_err());
    // Keys are private.
    use std::os::unix::fs::PermissionsExt;
    for f in [certs::TLS_KEY, certs::CA_KEY] {
        let mode = std::fs::metadata(dir.path().join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{f} is readable by others");
    }
    // The caBundle decodes to the CA's PEM.
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(files.ca_bundle())
        .unwrap();
    assert_eq!(decoded, files.ca_pem.as_bytes());
}
