//! Serving certificates for the webhook: a CA and a leaf signed by it (rcgen), written
//! as PEM files in the layout of a `kubernetes.io/tls` Secret plus the CA, and the
//! `caBundle` for the webhook configuration.
//!
//! A separate CA and leaf, because rustls/webpki refuse a CA certificate used as the
//! server's own; the apiserver (Go) needs SANs, so every name and IP goes in the SAN.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// The CA's common name; `--reuse-ca` rebuilds the issuer from it and the key.
pub const CA_COMMON_NAME: &str = "kubeshare-webhook-ca";
const CA_DAYS: u64 = 3650;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("no --dns name and no --ip address given")]
    NoNames,
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a PEM certificate")]
    Pem { path: PathBuf },
    #[error("the new serving certificate does not verify against {path}: {why}")]
    Verify { path: PathBuf, why: String },
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct CertRequest {
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// Validity of the serving certificate.
    pub days: u64,
    /// Sign with the CA already in the output directory (rotation keeps the caBundle).
    pub reuse_ca: bool,
}

/// The files written.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub dir: PathBuf,
    pub ca_pem: String,
}

impl CertFiles {
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join(CA_CERT)
    }
    pub fn cert(&self) -> PathBuf {
        self.dir.join(TLS_CERT)
    }
    pub fn key(&self) -> PathBuf {
        self.dir.join(TLS_KEY)
    }
    /// The `caBundle` value: base64 of the CA's PEM.
    pub fn ca_bundle(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.ca_pem.as_bytes())
    }
}

fn ca_params() -> Result<CertificateParams, CertError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CertError + '_ {
    move |source| CertError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `data` to `path` atomically (temp file + rename), so that a running server
/// never reads half a file; `private` files are readable by the owner only.
fn write_atomic(path: &Path, data: &str, private: bool) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(data.as_bytes()).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// Generates (or, with `reuse_ca`, loads) the CA and a serving certificate for the
/// given names, writes them into `dir`, and checks that the leaf verifies.
pub fn generate(req: &CertRequest, dir: &Path) -> Result<CertFiles, CertError> {
    if req.dns.is_empty() && req.ips.is_empty() {
        return Err(CertError::NoNames);
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    // An hour of slack for clocks that disagree.
    let not_before = epoch + now.saturating_sub(Duration::from_secs(3600));
    let days = |d: u64| epoch + now + Duration::from_secs(d * 86_400);

    let (ca_key, ca_pem) = if req.reuse_ca {
        let key_path = dir.join(CA_KEY);
        let cert_path = dir.join(CA_CERT);
        let key_pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
        let cert_pem = std::fs::read_to_string(&cert_path).map_err(io(&cert_path))?;
        (KeyPair::from_pem(&key_pem)?, cert_pem)
    } else {
        let key = KeyPair::generate()?;
        let mut p = ca_params()?;
        p.not_before = not_before;
        p.not_after = days(CA_DAYS);
        let cert = p.self_signed(&key)?;
        write_atomic(&dir.join(CA_KEY), &key.serialize_pem(), true)?;
        write_atomic(&dir.join(CA_CERT), &cert.pem(), false)?;
        (key, cert.pem())
    };
    let issuer = Issuer::new(ca_params()?, ca_key);

    let mut leaf = CertificateParams::new(req.dns.clone())?;
    for ip in &req.ips {
        leaf.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    let cn = req
        .dns
        .first()
        .cloned()
        .or_else(|| req.ips.first().map(|i| i.to_string()))
        .unwrap_or_default();
    leaf.distinguished_name = DistinguishedName::new();
    leaf.distinguished_name.push(DnType::CommonName, cn);
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = not_before;
    leaf.not_after = days(req.days);
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

    let files = CertFiles {
        dir: dir.to_path_buf(),
        ca_pem,
    };
    let name = req
        .dns
        .first()
        .cloned()
        .or_else(|| req.ips.first().map(|i| i.to_string()))
        .unwrap_or_default();
    verify(&files.ca_cert(), &files.ca_pem, &leaf_cert.pem(), &name)?;
    // Key first: a reloading server that sees the new key with the old certificate
    // fails that reload and keeps serving, then picks up the pair.
    write_atomic(&files.key(), &leaf_key.serialize_pem(), true)?;
    write_atomic(&files.cert(), &leaf_cert.pem(), false)?;
    Ok(files)
}

/// Checks that `leaf_pem` is a valid server certificate for `name` under `ca_pem`, as
/// a rustls client would.
pub fn verify(ca_path: &Path, ca_pem: &str, leaf_pem: &str, name: &str) -> Result<(), CertError> {
    let bad = |why: String| CertError::Verify {
        path: ca_path.to_path_buf(),
        why,
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let c = c.map_err(|_| CertError::Pem {
            path: ca_path.to_path_buf(),
        })?;
        roots.add(c).map_err(|e| bad(e.to_string()))?;
    }
    let leaf = CertificateDer::from_pem_slice(leaf_pem.as_bytes())
        .map_err(|e| bad(format!("leaf: {e}")))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
            .build()
            .map_err(|e| bad(e.to_string()))?;
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| bad(e.to_string()))?;
    verifier
        .verify_server_cert(&leaf, &[], &server_name, &[], UnixTime::now())
        .map_err(|e| bad(e.to_string()))?;
    Ok(())
}
