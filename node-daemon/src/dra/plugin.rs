//! The DRA kubelet plugin of `gpu.kubeshare.io` (the I/O around [`super::claim`] and
//! [`super::cdi`]): registered with the kubelet under its root directory, it serves
//! `NodePrepareResources` and `NodeUnprepareResources`.
//!
//! Preparing a claim: read the ResourceClaim, work out its shares, write its CDI spec,
//! checkpoint it, add it to the [`Book`] and wait for the daemon's loop to write the
//! GPUs' configs, then answer with the CDI device IDs. Unpreparing undoes it in the
//! other order. Both are idempotent: a claim prepared already gets the same answer, an
//! unknown claim is unprepared already. Calls are handled one at a time.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::ListParams;
use kubeshare_api::Layout;
use kubeshare_api::dra::DRIVER_NAME;
use kubeshare_kubelet_rpc::dra::{
    Claim, DraPlugin, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse, PluginServer, PluginSockets,
};
use kubeshare_kubelet_rpc::{ServeError, dra::Device};

use super::book::{Book, Changes};
use super::cdi;
use super::checkpoint;
use super::claim::PreparedClaim;
use crate::cdi::host::{CdiConfig, host_view};
use crate::disk::HostDir as _;
use crate::reconcile::Action;
use crate::source::InventorySource;

/// What the plugin is told at start.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub node: String,
    /// The claims' specs go to `cdi.spec_dir`; the GPUs' device nodes and the driver's
    /// libraries are found as for the node's spec.
    pub cdi: CdiConfig,
    pub inventory: InventorySource,
    /// [`checkpoint_path`] of the daemon's root.
    pub checkpoint: PathBuf,
    /// How long a call waits for the daemon's loop to write the configs; past it the
    /// call succeeds anyway (the claim is checkpointed and the loop writes it later).
    pub apply_timeout: Duration,
}

/// Where the checkpoint lives under the daemon's root.
pub fn checkpoint_path(layout: &Layout) -> PathBuf {
    layout.root.join("dra").join(checkpoint::FILE)
}

/// The plugin service.
pub struct Plugin {
    cfg: PluginConfig,
    client: kube::Client,
    book: Book,
    one_at_a_time: tokio::sync::Mutex<()>,
}

fn layout(cfg: &PluginConfig) -> &Layout {
    &cfg.cdi.layout
}

fn spec_path(cfg: &PluginConfig, claim_uid: &str) -> PathBuf {
    cfg.cdi.spec_dir.join(cdi::file_name(claim_uid))
}

fn remove_file(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The answer for a prepared claim: one device per GPU, for the request it serves.
fn devices(claim: &PreparedClaim) -> Vec<Device> {
    claim
        .devices
        .iter()
        .map(|d| Device {
            request_names: vec![d.request.clone()],
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: vec![cdi::device_id(&claim.uid, &d.device)],
            share_id: d.share_id.clone(),
        })
        .collect()
}

impl Plugin {
    pub fn new(cfg: PluginConfig, client: kube::Client, book: Book) -> Plugin {
        Plugin {
            cfg,
            client,
            book,
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// Writes `claim`'s CDI spec (unchanged bytes are not rewritten).
    fn write_spec(&self, claim: &PreparedClaim) -> Result<(), String> {
        let host = host_view(&self.cfg.cdi);
        let spec = cdi::claim_spec(claim, &host, layout(&self.cfg))
            .map_err(|e| format!("cannot describe the claim's devices in CDI: {e}"))?;
        let mut text = serde_json::to_string_pretty(&spec).map_err(|e| e.to_string())?;
        text.push('\n');
        let path = spec_path(&self.cfg, &claim.uid);
        std::fs::create_dir_all(&self.cfg.cdi.spec_dir)
            .and_then(|()| crate::disk::write_if_changed(&path, text.as_bytes()))
            .map(|_| ())
            .map_err(|e| format!("cannot write the CDI spec {}: {e}", path.display()))
    }

    /// Rewrites the specs of the checkpointed claims: after a reboot the runtime's spec
    /// directory (often a tmpfs) may have lost them, and the host may have changed.
    pub fn restore_specs(&self) {
        for claim in self.book.snapshot().values() {
            if let Err(e) = self.write_spec(claim) {
                tracing::warn!(claim = %claim.key(), error = %e, "DRA: cannot restore a prepared claim's CDI spec");
            }
        }
    }

    async fn wait_applied(&self, what: &str, claim: &PreparedClaim) {
        if !self.book.applied(self.cfg.apply_timeout).await {
            tracing::warn!(claim = %claim.key(), timeout = ?self.cfg.apply_timeout, "DRA: {what}: the daemon has not written the GPUs' configs yet; it will");
        }
    }

    async fn prepare(&self, c: &Claim) -> Result<Vec<Device>, String> {
        if let Some(done) = self.book.get(&c.uid) {
            self.write_spec(&done)?;
            return Ok(devices(&done));
        }
        let claim = Api::<ResourceClaim>::namespaced(self.client.clone(), &c.namespace)
            .get(&c.name)
            .await
            .map_err(|e| format!("cannot read ResourceClaim {}/{}: {e}", c.namespace, c.name))?;
        let inventory = self
            .cfg
            .inventory
            .load()
            .map_err(|e| format!("GPU discovery failed: {e}"))?;
        let prepared = super::claim::prepare(&claim, &c.uid, &self.cfg.node, &inventory)
            .map_err(|e| e.to_string())?;
        // Refused here so the kubelet shows why; the loop would only report it.
        let mut claims = self.book.snapshot();
        let mine = prepared.pod_uids();
        for other in claims
            .values()
            .filter(|o| o.pod_uids().iter().any(|p| mine.contains(p)))
        {
            if let Some(d) = other
                .devices
                .iter()
                .find(|d| prepared.devices.iter().any(|p| p.gpu_uuid == d.gpu_uuid))
            {
                return Err(format!(
                    "the pod already has a share of GPU {} through ResourceClaim {}: one share per pod and GPU",
                    d.gpu_uuid,
                    other.key()
                ));
            }
        }
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={}", self.cfg.node)))
            .await
            .map_err(|e| format!("cannot list the pods of node {}: {e}", self.cfg.node))?;
        let labels = super::publish::label_use_of(&self.cfg.node, &inventory, &pods.items);
        super::claim::check_books(&prepared, claims.values(), &labels, &inventory)
            .map_err(|e| e.to_string())?;
        self.write_spec(&prepared)?;
        claims.insert(prepared.uid.clone(), prepared.clone());
        if let Err(e) = checkpoint::store(&self.cfg.checkpoint, &claims) {
            let _ = remove_file(&spec_path(&self.cfg, &prepared.uid));
            return Err(e.to_string());
        }
        self.book.insert(prepared.clone());
        // The runtime bind-mounts the socket directory: it must exist before the
        // container does, whatever the loop is doing. A whole GPU has none.
        if !prepared.whole
            && let Err(e) =
                layout(&self.cfg).apply(&Action::CreatePodDir(prepared.client().to_string()))
        {
            tracing::warn!(claim = %prepared.key(), error = %e, "DRA: cannot create the pod's socket directory; the daemon's loop will");
        }
        self.wait_applied("prepare", &prepared).await;
        tracing::info!(claim = %prepared.key(), uid = %prepared.uid, pods = ?prepared.pod_uids(), client = %prepared.client(), share = %cdi::describe(&prepared), "DRA: claim prepared");
        Ok(devices(&prepared))
    }

    async fn unprepare(&self, c: &Claim) -> Result<(), String> {
        let spec = spec_path(&self.cfg, &c.uid);
        let Some(prepared) = self.book.get(&c.uid) else {
            // Unknown: nothing to undo but a spec a crash may have left.
            return remove_file(&spec)
                .map_err(|e| format!("cannot remove the CDI spec {}: {e}", spec.display()));
        };
        let mut claims = self.book.snapshot();
        claims.remove(&c.uid);
        checkpoint::store(&self.cfg.checkpoint, &claims).map_err(|e| e.to_string())?;
        self.book.remove(&c.uid);
        self.wait_applied("unprepare", &prepared).await;
        remove_file(&spec)
            .map_err(|e| format!("cannot remove the CDI spec {}: {e}", spec.display()))?;
        tracing::info!(claim = %prepared.key(), uid = %prepared.uid, "DRA: claim unprepared");
        Ok(())
    }
}

#[tonic::async_trait]
impl DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        req: tonic::Request<NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<NodePrepareResourcesResponse>, tonic::Status> {
        let _one = self.one_at_a_time.lock().await;
        let mut resp = NodePrepareResourcesResponse::default();
        for c in req.into_inner().claims {
            let r = match self.prepare(&c).await {
                Ok(devices) => NodePrepareResourceResponse {
                    devices,
                    error: String::new(),
                },
                Err(error) => {
                    tracing::warn!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, %error, "DRA: claim not prepared");
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            resp.claims.insert(c.uid, r);
        }
        Ok(tonic::Response::new(resp))
    }

    async fn node_unprepare_resources(
        &self,
        req: tonic::Request<NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<NodeUnprepareResourcesResponse>, tonic::Status> {
        let _one = self.one_at_a_time.lock().await;
        let mut resp = NodeUnprepareResourcesResponse::default();
        for c in req.into_inner().claims {
            let error = self.unprepare(&c).await.err().unwrap_or_default();
            if !error.is_empty() {
                tracing::warn!(claim = %format!("{}/{}", c.namespace, c.name), uid = %c.uid, %error, "DRA: claim not unprepared");
            }
            resp.claims
                .insert(c.uid, NodeUnprepareResourceResponse { error });
        }
        Ok(tonic::Response::new(resp))
    }
}

/// The default directory of the claims' CDI specs (without `--cdi-spec-dir`): the
/// one every CDI-enabled runtime reads and that is meant for generated specs.
pub const DEFAULT_SPEC_DIR: &str = "/var/run/cdi";

/// Binds the plugin's sockets under the kubelet's root directory `kubelet_root`: the
/// kubelet sees the plugin from here on and waits for [`serve`] to answer.
pub fn bind(kubelet_root: &Path) -> Result<(PluginServer, PluginSockets), ServeError> {
    let sockets = PluginSockets::under(kubelet_root, DRIVER_NAME);
    let server = PluginServer::bind(DRIVER_NAME, &sockets)?;
    Ok((server, sockets))
}

/// Serves `plugin` on `server` until `shutdown`; then the registration socket goes
/// first, so the kubelet stops calling before the service stops answering.
pub async fn serve(
    server: PluginServer,
    plugin: Plugin,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    plugin.restore_specs();
    let registration = server.registration();
    tracing::info!(
        prepared = plugin.book.snapshot().len(),
        "DRA: kubelet plugin serving"
    );
    let result = server.serve(plugin, shutdown).await;
    tracing::info!(kubelet_said = ?registration.status(), "DRA: kubelet plugin stopped; its registration is removed");
    result
}

/// Why the plugin cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error("cannot serve the DRA kubelet plugin (--kubelet-root-dir): {0}")]
    Serve(#[from] ServeError),
}

/// The plugin, started: its task, and the daemon loop's side of its claims.
pub struct Started {
    pub task: tokio::task::JoinHandle<Result<(), ServeError>>,
    pub book: Book,
    pub changes: Changes,
}

/// Loads the checkpoint (before the daemon's loop reads any pod, so the first configs
/// it writes hold the prepared claims), binds the sockets under `kubelet_root` and
/// serves until `shutdown`.
pub fn start(
    cfg: PluginConfig,
    kubelet_root: &Path,
    client: kube::Client,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Started, StartError> {
    let claims = checkpoint::load(&cfg.checkpoint)?;
    let (book, changes) = Book::new(claims);
    let (server, sockets) = bind(kubelet_root)?;
    tracing::info!(registration = %sockets.registration.display(), service = %sockets.service.display(), checkpoint = %cfg.checkpoint.display(), "DRA: kubelet plugin sockets bound");
    let plugin = Plugin::new(cfg, client, book.clone());
    let task = tokio::spawn(serve(server, plugin, shutdown));
    Ok(Started {
        task,
        book,
        changes,
    })
}

/// Waits (10 s at most) for the plugin's task to end after its shutdown, so that the
/// registration socket is gone before the daemon exits.
pub async fn join(task: tokio::task::JoinHandle<Result<(), ServeError>>) {
    match tokio::time::timeout(Duration::from_secs(10), task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::error!(error = %e, "DRA: kubelet plugin failed"),
        Ok(Err(e)) => tracing::error!(error = %e, "DRA: kubelet plugin task failed"),
        Err(_) => tracing::warn!("DRA: kubelet plugin did not stop within 10 s"),
    }
}
