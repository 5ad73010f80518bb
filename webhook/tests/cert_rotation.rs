//! The webhook's serving certificate rotates under load with no failed admission: the
//! real kube-apiserver sends a burst of 200 pod creations (KubeShare pods, whose
//! webhook entry has failurePolicy Fail, so any failed call would fail a create) while
//! the serving certificate is replaced on disk again and again, as `kubeshare-webhook
//! certs --reuse-ca` (or a Secret update) replaces it; the server reloads it from the
//! files. Every create succeeds and is mutated; new TLS connections made meanwhile
//! all succeed and meet the new certificates; the server ends up serving the last one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use kubeshare_testkit::{Cluster, Identity, wait_until};
use kubeshare_webhook::certs::{self, CertRequest};
use kubeshare_webhook::server::{self, ServeConfig};
use serde_json::json;

mod cluster_rig;
use cluster_rig::{Cleanup, labelled_namespace, webhook_by_url, webhook_called};

const WAIT: Duration = Duration::from_secs(60);
const TEST_LABEL: &str = "kubeshare-cert-rotation-test";
const PODS: usize = 200;
const CONCURRENCY: usize = 16;

fn pod(name: &str) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"sharedgpu/gpu_request": "0.1", "sharedgpu/gpu_limit": "0.2"}},
        // No node matches: the pods stay Pending, out of every scheduler's way.
        "spec": {"nodeSelector": {TEST_LABEL: "no-such-node"},
                 "containers": [{"name": "c", "image": "x"}]},
    }))?)
}

/// The DER of the leaf the server presents on a new connection.
async fn served_leaf(port: u16, ca_pem: &str) -> Result<Vec<u8>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c?)?;
    }
    let cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let tls = connector
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    let (_, conn) = tls.get_ref();
    Ok(conn
        .peer_certificates()
        .and_then(|c| c.first())
        .context("no peer certificate")?
        .to_vec())
}

fn leaf_der(path: &std::path::Path) -> Result<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    Ok(CertificateDer::from_pem_file(path)?.to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_certificate_rotates_during_a_burst_with_no_failed_admission() -> Result<()> {
    server::install_crypto_provider();
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let (ns, token) = labelled_namespace(cluster, &admin, "certrot", TEST_LABEL).await?;

    let tls = tempfile::tempdir()?;
    let request = CertRequest {
        dns: vec!["localhost".into()],
        ips: vec!["127.0.0.1".parse()?],
        days: 1,
        reuse_ca: false,
    };
    let files = certs::generate(&request, tls.path())?;
    let running = server::start(ServeConfig {
        listen: "127.0.0.1:0".parse()?,
        cert: files.cert(),
        key: files.key(),
        // The fallback poll; file events normally trigger the reload at once.
        poll: Duration::from_secs(1),
        admit: Default::default(),
    })
    .await?;
    let port = running.addr.port();
    let name = format!("kubeshare-cert-rotation-{token}");
    let config = webhook_by_url(&name, port, &files.ca_bundle(), TEST_LABEL, &token)?;
    let _guard = Cleanup {
        cluster,
        objects: vec![("mutatingwebhookconfiguration", name)],
    };
    Api::<MutatingWebhookConfiguration>::all(admin.clone())
        .create(&PostParams::default(), &serde_json::from_value(config)?)
        .await?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns.name());
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let probe = pod("probe")?;
    webhook_called(&pods, &probe).await?;
    let first_leaf = leaf_der(&files.cert())?;

    // The rotator: a new serving certificate from the same CA every 150 ms until the
    // burst ends.
    let done = Arc::new(AtomicBool::new(false));
    let rotations = Arc::new(AtomicU32::new(0));
    let rotator = {
        let (done, rotations, dir) = (done.clone(), rotations.clone(), tls.path().to_path_buf());
        let req = CertRequest {
            reuse_ca: true,
            ..request.clone()
        };
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                let (req, dir) = (req.clone(), dir.clone());
                tokio::task::spawn_blocking(move || certs::generate(&req, &dir))
                    .await
                    .expect("rotation task")
                    .expect("rotation");
                rotations.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };

    // Beside the apiserver (which keeps its connection open), a client that makes a
    // new TLS connection again and again: every handshake must succeed, and it must
    // meet more than one certificate while the burst runs.
    let prober = {
        let (done, ca) = (done.clone(), files.ca_pem.clone());
        tokio::spawn(async move {
            let mut leaves = std::collections::HashSet::new();
            let mut failures = Vec::new();
            let mut handshakes = 0u32;
            while !done.load(Ordering::SeqCst) {
                match served_leaf(port, &ca).await {
                    Ok(leaf) => {
                        leaves.insert(leaf);
                    }
                    Err(e) => failures.push(e.to_string()),
                }
                handshakes += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (handshakes, leaves.len(), failures)
        })
    };

    // The burst: 200 creates, 16 at a time.
    let sem = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    let mut set = tokio::task::JoinSet::new();
    let start = std::time::Instant::now();
    for i in 0..PODS {
        let (pods, sem) = (pods.clone(), sem.clone());
        let p = pod(&format!("burst-{i}"))?;
        set.spawn(async move {
            let _permit = sem.acquire_owned().await.expect("semaphore");
            pods.create(&PostParams::default(), &p).await
        });
    }
    let mut errors = Vec::new();
    let mut mutated = 0;
    while let Some(r) = set.join_next().await {
        match r? {
            Ok(p) => {
                if p.spec.and_then(|s| s.scheduler_name).as_deref() == Some("kubeshare-scheduler") {
                    mutated += 1;
                }
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    let took = start.elapsed();
    let during = rotations.load(Ordering::SeqCst);
    done.store(true, Ordering::SeqCst);
    rotator.await?;
    let (handshakes, leaves, failures) = prober.await?;
    eprintln!(
        "{PODS} creates in {took:.2?}, {during} rotations meanwhile, {} reloads ok, {} failed (half-rotated pairs, retried); {handshakes} new handshakes met {leaves} certificates",
        running.stats.tls_reloads(true),
        running.stats.tls_reloads(false)
    );
    assert!(failures.is_empty(), "failed handshakes: {failures:?}");
    assert!(
        leaves >= 2,
        "the new connections met {leaves} certificate(s) during the burst"
    );
    assert!(
        errors.is_empty(),
        "{} failed creates: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    assert_eq!(mutated, PODS, "every pod went through the webhook");
    assert!(
        during >= 3,
        "only {during} rotations during the burst ({took:?}): not a test of rotation"
    );

    // The server picked the rotations up and serves the last certificate.
    let last_leaf = leaf_der(&files.cert())?;
    assert_ne!(last_leaf, first_leaf);
    wait_until("the server to serve the last certificate", WAIT, || {
        let (ca, last) = (files.ca_pem.clone(), last_leaf.clone());
        async move {
            match served_leaf(port, &ca).await {
                Ok(served) if served == last => Ok(Some(())),
                Ok(_) => Err("an older certificate".to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    assert!(running.stats.tls_reloads(true) >= 1);
    // And admission still works on the new certificate.
    let after = pods.create(&dry, &pod("after")?).await?;
    assert_eq!(
        after.spec.and_then(|s| s.scheduler_name).as_deref(),
        Some("kubeshare-scheduler")
    );

    running.shutdown(Duration::from_secs(1)).await?;
    ns.delete().await?;
    Ok(())
}
