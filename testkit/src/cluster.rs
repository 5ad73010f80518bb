//! Finding or starting the test cluster, and the handle tests use to reach it.
//!
//! Lifecycle: `make test` runs `hack/with-cluster.sh`, which brings one cluster up,
//! exports `KUBESHARE_TEST_CLUSTER=<run dir>` for every test process, and brings it
//! down afterwards whatever the outcome. A test process started without that
//! variable (e.g. `cargo test -p x` by hand) starts its own cluster on first use
//! with `hack/cluster.sh up <dir> --owner-pid <this pid>`: a watchdog process
//! started by the script brings that cluster down within about a second of this
//! process exiting, whether it exits normally, panics, aborts or is killed. A
//! `Drop` in a static would never run, so the rig does not rely on one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::error::{Error, Result};

/// Env var naming the run dir of a running cluster to connect to.
pub const CLUSTER_ENV: &str = "KUBESHARE_TEST_CLUSTER";

/// Who the client authenticates as. Each has its own client certificate; the
/// kubeshare identities get exactly the rights of `manifests/rbac.yaml`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Identity {
    /// `kubeshare:admin`, group `system:masters`.
    Admin,
    /// `system:kube-scheduler` (both schedulers run as this user).
    KubeScheduler,
    /// `system:kube-controller-manager`.
    KubeControllerManager,
    /// `kubeshare:kwok`, group `system:masters` (kwok plays every kubelet).
    Kwok,
    /// `kubeshare:scheduler-extender`.
    Extender,
    /// `kubeshare:webhook` (no rights at all).
    Webhook,
    /// `kubeshare:node-daemon`.
    NodeDaemon,
}

impl Identity {
    /// Every identity the rig issues a certificate for.
    pub const ALL: [Identity; 7] = [
        Identity::Admin,
        Identity::KubeScheduler,
        Identity::KubeControllerManager,
        Identity::Kwok,
        Identity::Extender,
        Identity::Webhook,
        Identity::NodeDaemon,
    ];

    /// Key in `cluster.json`'s `kubeconfigs` (and the kubeconfig's file stem).
    pub fn name(self) -> &'static str {
        match self {
            Identity::Admin => "admin",
            Identity::KubeScheduler => "kube-scheduler",
            Identity::KubeControllerManager => "kube-controller-manager",
            Identity::Kwok => "kwok",
            Identity::Extender => "extender",
            Identity::Webhook => "webhook",
            Identity::NodeDaemon => "node-daemon",
        }
    }

    /// The Kubernetes user name (certificate CN) of this identity.
    pub fn user(self) -> &'static str {
        match self {
            Identity::Admin => "kubeshare:admin",
            Identity::KubeScheduler => "system:kube-scheduler",
            Identity::KubeControllerManager => "system:kube-controller-manager",
            Identity::Kwok => "kubeshare:kwok",
            Identity::Extender => "kubeshare:scheduler-extender",
            Identity::Webhook => "kubeshare:webhook",
            Identity::NodeDaemon => "kubeshare:node-daemon",
        }
    }
}

/// Ports chosen at `up` (all on 127.0.0.1).
#[derive(Debug, Clone, Deserialize)]
pub struct Ports {
    pub etcd: u16,
    pub etcd_peer: u16,
    pub apiserver: u16,
    pub kube_controller_manager: u16,
    pub kube_scheduler: u16,
    pub kubeshare_scheduler: u16,
    pub kwok: u16,
    /// Where the `kubeshare-scheduler` profile's extender `urlPrefix` points
    /// (`http://127.0.0.1:<extender>`, verbs `filter`, `prioritize`, `bind`).
    pub extender: u16,
    /// Reserved for our admission webhook (nothing listens there until a test does).
    pub webhook: u16,
}

/// `RUN_DIR/cluster.json`, as written by `hack/cluster.sh up`.
#[derive(Debug, Clone, Deserialize)]
pub struct ClusterInfo {
    pub run_dir: PathBuf,
    pub bin_dir: PathBuf,
    pub apiserver_url: String,
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub webhook_serving_cert: PathBuf,
    pub webhook_serving_key: PathBuf,
    pub scheduler_name: String,
    pub ports: Ports,
    pub kubeconfigs: BTreeMap<String, PathBuf>,
    pub users: BTreeMap<String, String>,
}

impl ClusterInfo {
    /// Reads and parses `run_dir/cluster.json`.
    pub fn load(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join("cluster.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| Error::ClusterJson { path, source })
    }
}

/// A running test cluster.
#[derive(Debug)]
pub struct Cluster {
    info: ClusterInfo,
    owned: bool,
}

static SHARED: OnceLock<std::result::Result<Cluster, String>> = OnceLock::new();

impl Cluster {
    /// The cluster all tests of this process share: the one named by
    /// `KUBESHARE_TEST_CLUSTER` if set, else one started on first call (and
    /// stopped by its watchdog when this process exits). Safe to call from many
    /// tests at once; the first caller starts it, the others wait.
    pub fn shared() -> Result<&'static Cluster> {
        SHARED
            .get_or_init(|| {
                let found = match std::env::var_os(CLUSTER_ENV) {
                    Some(dir) if !dir.is_empty() => Cluster::connect(Path::new(&dir)),
                    _ => Cluster::start(&default_run_root()),
                };
                found.map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Other(format!("test cluster unavailable: {e}")))
    }

    /// Connects to a cluster that `hack/cluster.sh up <run_dir>` brought up.
    pub fn connect(run_dir: &Path) -> Result<Cluster> {
        if !run_dir.join("ready").is_file() {
            return Err(Error::NotReady(run_dir.to_path_buf()));
        }
        Ok(Cluster {
            info: ClusterInfo::load(run_dir)?,
            owned: false,
        })
    }

    /// Starts a new cluster in a fresh run dir under `run_root`, owned by this
    /// process: it is brought down when this process exits (see module docs).
    pub fn start(run_root: &Path) -> Result<Cluster> {
        std::fs::create_dir_all(run_root).map_err(|source| Error::Io {
            path: run_root.to_path_buf(),
            source,
        })?;
        remove_stopped_run_dirs(run_root);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let run_dir = run_root.join(format!("{}-{nanos:09}", std::process::id()));
        std::fs::create_dir_all(&run_dir).map_err(|source| Error::Io {
            path: run_dir.clone(),
            source,
        })?;
        let log = run_dir.join("up.log");
        let out = std::fs::File::create(&log).map_err(|source| Error::Io {
            path: log.clone(),
            source,
        })?;
        let err = out.try_clone().map_err(|source| Error::Io {
            path: log.clone(),
            source,
        })?;
        let script = cluster_script();
        let command = format!(
            "{} up {} --owner-pid {}",
            script.display(),
            run_dir.display(),
            std::process::id()
        );
        tracing::info!(%command, "starting a test cluster for this process");
        let status = Command::new("bash")
            .arg(&script)
            .arg("up")
            .arg(&run_dir)
            .arg("--owner-pid")
            .arg(std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .status()
            .map_err(|source| Error::Spawn {
                command: command.clone(),
                source,
            })?;
        if !status.success() {
            return Err(Error::Script {
                command,
                status: status.to_string(),
                log,
            });
        }
        let mut cluster = Cluster::connect(&run_dir)?;
        cluster.owned = true;
        Ok(cluster)
    }

    /// Everything `cluster.json` says.
    pub fn info(&self) -> &ClusterInfo {
        &self.info
    }

    /// Whether this process started the cluster (and its exit stops it).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// Path of the kubeconfig file for `identity`.
    pub fn kubeconfig(&self, identity: Identity) -> Result<&Path> {
        self.info
            .kubeconfigs
            .get(identity.name())
            .map(PathBuf::as_path)
            .ok_or_else(|| Error::UnknownIdentity(identity.name().to_string()))
    }

    /// A client authenticated as `identity`. Build one per test (per tokio
    /// runtime): a client keeps background tasks on the runtime that made it.
    pub async fn client(&self, identity: Identity) -> Result<kube::Client> {
        client_from_kubeconfig(self.kubeconfig(identity)?).await
    }

    /// `https://127.0.0.1:<port>` of the kube-apiserver.
    pub fn apiserver_url(&self) -> &str {
        &self.info.apiserver_url
    }

    /// The port the `kubeshare-scheduler` profile's extender calls.
    pub fn extender_port(&self) -> u16 {
        self.info.ports.extender
    }

    /// The port reserved for our admission webhook.
    pub fn webhook_port(&self) -> u16 {
        self.info.ports.webhook
    }

    /// All ports of the cluster.
    pub fn ports(&self) -> &Ports {
        &self.info.ports
    }

    /// The CA certificate (PEM) that signed every certificate of the rig;
    /// the `caBundle` of a webhook configuration served with a cert it signed.
    pub fn ca_cert_path(&self) -> &Path {
        &self.info.ca_cert
    }

    /// The CA private key (PKCS#8 PEM, ECDSA P-256), to sign more certificates.
    pub fn ca_key_path(&self) -> &Path {
        &self.info.ca_key
    }

    /// A serving certificate and key (PEM) for 127.0.0.1/localhost, signed by the CA.
    pub fn webhook_serving_cert_paths(&self) -> (&Path, &Path) {
        (
            &self.info.webhook_serving_cert,
            &self.info.webhook_serving_key,
        )
    }

    /// The cluster's run dir (logs in `logs/`, pids in `pids/`).
    pub fn run_dir(&self) -> &Path {
        &self.info.run_dir
    }

    /// Where kube-apiserver, kubectl, etcd, kwok and friends live.
    pub fn bin_dir(&self) -> &Path {
        &self.info.bin_dir
    }

    /// `schedulerName` of the scheduler that calls our extender.
    pub fn scheduler_name(&self) -> &str {
        &self.info.scheduler_name
    }

    /// A `kubectl` command already pointed at the cluster as admin.
    pub fn kubectl(&self) -> Result<Command> {
        let mut cmd = Command::new(self.info.bin_dir.join("kubectl"));
        cmd.arg("--kubeconfig")
            .arg(self.kubeconfig(Identity::Admin)?);
        Ok(cmd)
    }
}

/// A client from a kubeconfig file (any identity, or one a test wrote).
pub async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    Ok(kube::Client::try_from(config_from_kubeconfig(path).await?)?)
}

/// The client configuration of the kubeconfig at `path` (for a client of another server
/// with the same credentials, as `metrics::scheduler_client` makes).
pub(crate) async fn config_from_kubeconfig(path: &Path) -> Result<kube::Config> {
    // kube builds its rustls config with the process-wide provider; pick ring
    // explicitly so a dependency that also compiles aws-lc-rs cannot make that
    // ambiguous. A second install is refused harmlessly.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig_err = |source| Error::Kubeconfig {
        path: path.to_path_buf(),
        source,
    };
    let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(kubeconfig_err)?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(kubeconfig_err)?;
    Ok(config)
}

fn repo_root() -> PathBuf {
    // testkit/ sits at the top of the workspace.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn cluster_script() -> PathBuf {
    std::env::var_os("KUBESHARE_CLUSTER_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("hack").join("cluster.sh"))
}

fn default_run_root() -> PathBuf {
    std::env::var_os("KUBESHARE_TEST_RUN_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target").join("kubeshare-test-clusters"))
}

/// Run dirs of earlier test processes whose cluster was brought down (owner
/// process gone, no `ready` marker, no `pids/*.pid`) are only logs by now; keep
/// the root small. Dir names start with the owner's pid.
fn remove_stopped_run_dirs(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        let owner_alive = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('-').next())
            .is_some_and(|pid| Path::new("/proc").join(pid).exists());
        let stopped = dir.is_dir()
            && !owner_alive
            && !dir.join("ready").exists()
            && dir.join("cluster.json").exists()
            && std::fs::read_dir(dir.join("pids"))
                .map(|mut d| d.next().is_none())
                .unwrap_or(true);
        if stopped {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_names_are_distinct_and_match_the_script() {
        let names: std::collections::BTreeSet<_> = Identity::ALL.iter().map(|i| i.name()).collect();
        assert_eq!(names.len(), Identity::ALL.len());
        // hack/cluster.sh is the one place that issues the certificates; the
        // identity table there must list the same names and users.
        let script = std::fs::read_to_string(repo_root().join("hack/cluster.sh")).unwrap();
        for id in Identity::ALL {
            let needle = format!("\"{} {} ", id.name(), id.user());
            assert!(script.contains(&needle), "cluster.sh lacks {needle}");
        }
    }

    #[test]
    fn cluster_json_parses_and_missing_fields_are_errors() {
        let dir = std::env::temp_dir().join(format!("testkit-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = serde_json::json!({
            "run_dir": "/r", "bin_dir": "/b", "apiserver_url": "https://127.0.0.1:1",
            "ca_cert": "/r/ca.crt", "ca_key": "/r/ca.key",
            "webhook_serving_cert": "/r/w.crt", "webhook_serving_key": "/r/w.key",
            "scheduler_name": "kubeshare-scheduler",
            "ports": {"etcd": 1, "etcd_peer": 2, "apiserver": 3, "kube_controller_manager": 4,
                      "kube_scheduler": 5, "kubeshare_scheduler": 6, "kwok": 7,
                      "extender": 8, "webhook": 9},
            "kubeconfigs": {"admin": "/r/admin.kubeconfig"},
            "users": {"admin": "kubeshare:admin"}
        });
        std::fs::write(dir.join("cluster.json"), json.to_string()).unwrap();
        let info = ClusterInfo::load(&dir).unwrap();
        assert_eq!(info.ports.extender, 8);
        assert_eq!(
            info.kubeconfigs["admin"],
            PathBuf::from("/r/admin.kubeconfig")
        );

        // Not ready without the marker.
        assert!(matches!(Cluster::connect(&dir), Err(Error::NotReady(_))));
        std::fs::write(dir.join("ready"), "now").unwrap();
        let c = Cluster::connect(&dir).unwrap();
        assert!(matches!(
            c.kubeconfig(Identity::Webhook),
            Err(Error::UnknownIdentity(_))
        ));

        std::fs::write(dir.join("cluster.json"), r#"{"run_dir": "/r"}"#).unwrap();
        assert!(matches!(
            ClusterInfo::load(&dir),
            Err(Error::ClusterJson { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
