//! The device plugin for `kubeshare.io/gpu` (the I/O around [`super::select`]): serves
//! the kubelet's device-plugin API v1beta1 on a socket in its device-plugin directory,
//! registers there, and registers again when the kubelet restarts (it makes a new
//! `kubelet.sock` and removes the plugins' sockets). A watch of the pods bound to this
//! node keeps the order they arrived in; `Allocate` lists them, takes the one the kubelet
//! is admitting and answers with the CDI devices of its allocation record, which the
//! runtime resolves through the node's CDI spec. What has been answered is checkpointed
//! under the daemon's root before the kubelet hears the answer.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kubeshare_kubelet_rpc::deviceplugin::{
    self as dp, AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse, Device,
    DevicePlugin, DevicePluginOptions, DevicePluginServer, Empty, ListAndWatchResponse,
    PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use tokio::sync::{Mutex, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::select::{self, Answered, Arrivals, Context, PodInfo};
use crate::source::InventorySource;

/// The plugin's socket name in the kubelet's device-plugin directory.
pub const ENDPOINT: &str = "kubeshare-gpu.sock";
/// The checkpoint's file name under the daemon's root.
pub const CHECKPOINT: &str = "cdi-device-plugin.json";

/// What the plugin is told at start.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    pub node: String,
    /// The kubelet's device-plugin directory (its `kubelet.sock` is there).
    pub dir: PathBuf,
    pub resource: String,
    pub slots_per_gpu: u32,
    /// Where the answers are kept (`<root>/cdi-device-plugin.json`).
    pub checkpoint: PathBuf,
    pub inventory: InventorySource,
    /// How often the GPUs are re-read and forgotten pods dropped.
    pub resync: Duration,
}

/// The identity of a socket file: a recreated `kubelet.sock` has a new inode.
pub type SocketId = (u64, u64);

fn socket_id(path: &Path) -> Option<SocketId> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// What the registration loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// No kubelet socket: wait for one (the kubelet is down or starting).
    Wait,
    /// (Re)start the server on a fresh socket and register.
    Register,
    Keep,
}

/// Decides from the `kubelet.sock` registered with, the one there now, and whether the
/// plugin's own socket is still there (the kubelet removes it when it restarts).
pub fn next_step(registered: Option<SocketId>, kubelet: Option<SocketId>, own: bool) -> Step {
    match kubelet {
        None => Step::Wait,
        Some(k) if registered == Some(k) && own => Step::Keep,
        Some(_) => Step::Register,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Reads the checkpoint; a missing file is no answers, an unreadable one is logged and
/// ignored (a wrong count is better than no plugin).
pub fn load_checkpoint(path: &Path) -> Answered {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), error = %e, "device plugin checkpoint unreadable; starting empty");
            Answered::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Answered::default(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "device plugin checkpoint unreadable; starting empty");
            Answered::default()
        }
    }
}

pub fn save_checkpoint(path: &Path, answered: &Answered) -> Result<(), CheckpointError> {
    let mut text = serde_json::to_vec(answered).expect("the checkpoint serialises");
    text.push(b'\n');
    crate::disk::write_if_changed(path, &text)
        .map(|_| ())
        .map_err(|source| CheckpointError::Write {
            path: path.to_path_buf(),
            source,
        })
}

struct State {
    answered: Answered,
    /// The node's GPUs (what the CDI spec names).
    gpus: BTreeSet<String>,
}

/// How long `Allocate` waits for the watch to deliver the pods its list shows.
const ARRIVAL_WAIT: Duration = Duration::from_secs(3);

struct Plugin {
    cfg: PluginConfig,
    pods: Api<Pod>,
    state: Mutex<State>,
    /// Kept by the run loop from the watch (never held across an await).
    arrivals: std::sync::Mutex<Arrivals>,
    /// Bumped after each change of `arrivals`.
    arrived: watch::Sender<u64>,
    devices: watch::Receiver<Vec<String>>,
    /// Bumped to stop the server of the current registration: its `ListAndWatch` streams
    /// end, so its connections close and the kubelet takes the next registration (it
    /// refuses one while the plugin's socket is still connected).
    generation: watch::Sender<u64>,
}

/// Resolves once `generation` has moved past `mine`.
async fn superseded(mut generation: watch::Receiver<u64>, mine: u64) {
    while *generation.borrow_and_update() == mine {
        if generation.changed().await.is_err() {
            return;
        }
    }
}

impl Plugin {
    /// Every pod bound to this node, read from the API at the moment of the call: the
    /// kubelet learns of a pod as soon as it is bound, so the watch could still be
    /// behind.
    async fn list(&self) -> Result<Vec<PodInfo>, kube::Error> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.cfg.node));
        let list = self.pods.list(&lp).await?;
        Ok(list
            .items
            .iter()
            .filter_map(|p| PodInfo::from_pod(p, &self.cfg.resource))
            .collect())
    }

    fn with_arrivals(&self, pods: &mut [PodInfo]) {
        let arrivals = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
        for p in pods {
            p.arrival = arrivals.of(&p.uid);
        }
    }

    /// `pods` with the order they arrived in, once the watch has delivered every
    /// candidate (or [`ARRIVAL_WAIT`] has passed: then the undelivered come last).
    async fn in_arrival_order(&self, ctx: &Context<'_>, pods: &mut [PodInfo], answered: &Answered) {
        let mut arrived = self.arrived.subscribe();
        let deadline = tokio::time::Instant::now() + ARRIVAL_WAIT;
        loop {
            arrived.borrow_and_update();
            self.with_arrivals(pods);
            if !select::awaiting_arrival(ctx, pods, answered) {
                return;
            }
            if tokio::time::timeout_at(deadline, arrived.changed())
                .await
                .is_err()
            {
                tracing::warn!(
                    "device plugin: the pod watch has not delivered every pod waiting for the GPU; those come last"
                );
                return;
            }
        }
    }

    /// Drops the answers of pods that are gone, from a fresh list.
    async fn forget_gone(&self) {
        let mut st = self.state.lock().await;
        let pods = match self.list().await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "device plugin: cannot list pods; answers kept");
                return;
            }
        };
        if st.answered.forget_gone(&pods)
            && let Err(e) = save_checkpoint(&self.cfg.checkpoint, &st.answered)
        {
            tracing::warn!(error = %e, "device plugin checkpoint not written");
        }
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    /// The slots now and after every change; the stream stays open (the kubelet reads
    /// its end as the plugin going away) until its server is stopped.
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let generation = self.generation.subscribe();
        let mine = *generation.borrow();
        let stream = futures::stream::unfold(
            (self.devices.clone(), generation, true),
            move |(mut rx, generation, first)| async move {
                // Ends when its server is stopped (a new registration follows).
                if !first {
                    tokio::select! {
                        changed = rx.changed() => if changed.is_err() { return None },
                        _ = superseded(generation.clone(), mine) => return None,
                    }
                }
                let devices = rx
                    .borrow_and_update()
                    .iter()
                    .map(|id| Device {
                        id: id.clone(),
                        health: dp::HEALTHY.into(),
                    })
                    .collect();
                Some((
                    Ok(ListAndWatchResponse { devices }),
                    (rx, generation, false),
                ))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        // Not offered (options say so): slots are interchangeable.
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let node = &self.cfg.node;
        // One answer at a time: two calls must not both take the same pod's last container.
        let mut st = self.state.lock().await;
        let mut pods = self.list().await.map_err(|e| {
            tracing::warn!(error = %e, "device plugin: cannot list pods for Allocate");
            Status::unavailable(format!("cannot list the pods bound to node {node}: {e}"))
        })?;
        let mut answered = st.answered.clone();
        answered.forget_gone(&pods);
        let scheduler = kubeshare_api::scheduler_name();
        let ctx = Context {
            node,
            scheduler,
            resource: &self.cfg.resource,
            gpus: &st.gpus,
        };
        self.in_arrival_order(&ctx, &mut pods, &answered).await;
        let mut container_responses = Vec::new();
        let mut grants = Vec::new();
        for c in req.into_inner().container_requests {
            let grant = select::select(&ctx, &pods, &answered).map_err(|r| {
                tracing::warn!(slots = ?c.devices_ids, refusal = %r, "device plugin: Allocate refused");
                Status::failed_precondition(r.to_string())
            })?;
            answered.record(&grant);
            container_responses.push(ContainerAllocateResponse {
                cdi_devices: grant
                    .cdi_devices()
                    .into_iter()
                    .map(|name| CdiDevice { name })
                    .collect(),
                ..Default::default()
            });
            grants.push((grant, c.devices_ids));
        }
        // Kept before the kubelet hears it: a restart must not hand the pod out twice.
        save_checkpoint(&self.cfg.checkpoint, &answered).map_err(|e| {
            tracing::error!(error = %e, "device plugin: Allocate refused, checkpoint not written");
            Status::internal(e.to_string())
        })?;
        st.answered = answered;
        for (g, slots) in grants {
            tracing::info!(pod = %g.pod_key, uid = %g.pod_uid, container = g.container, of = g.of, cdi_devices = ?g.cdi_devices(), ?slots, "device plugin: Allocate answered");
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// The node's GPUs the spec offers (MIG instances are not in it).
fn offered(source: &InventorySource) -> Option<BTreeSet<String>> {
    match source.load() {
        Ok(inv) => Some(
            inv.gpus
                .into_iter()
                .map(|g| g.uuid)
                .filter(|u| u.starts_with("GPU-"))
                .collect(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "device plugin: GPU discovery failed; slots kept");
            None
        }
    }
}

/// A server on the plugin's socket, registered with one `kubelet.sock`.
struct Serving {
    task: tokio::task::JoinHandle<()>,
    registered: SocketId,
}

async fn serve(plugin: &Arc<Plugin>, kubelet: SocketId) -> Result<Serving, String> {
    let dir = &plugin.cfg.dir;
    let socket = dir.join(ENDPOINT);
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("cannot remove {}: {e}", socket.display())),
    }
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    let mine = *plugin.generation.borrow();
    let stop = superseded(plugin.generation.subscribe(), mine);
    let server = tonic::transport::Server::builder()
        .add_service(DevicePluginServer::from_arc(plugin.clone()))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            stop,
        );
    let task = tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::warn!(error = %e, "device plugin server ended");
        }
    });
    if let Err(e) = dp::register(dir, ENDPOINT, &plugin.cfg.resource).await {
        task.abort();
        return Err(e.to_string());
    }
    Ok(Serving {
        task,
        registered: kubelet,
    })
}

/// Runs the plugin for ever: keeps the slots current and the registration alive.
pub async fn run(cfg: PluginConfig, client: kube::Client) {
    let answered = load_checkpoint(&cfg.checkpoint);
    let gpus = offered(&cfg.inventory).unwrap_or_default();
    let (devices_tx, devices) = watch::channel(select::slot_ids(gpus.len(), cfg.slots_per_gpu));
    let pods: Api<Pod> = Api::all(client);
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={}", cfg.node));
    let mut arrivals = watcher(pods.clone(), wc).default_backoff().boxed();
    let plugin = Arc::new(Plugin {
        pods,
        state: Mutex::new(State { answered, gpus }),
        arrivals: std::sync::Mutex::new(Arrivals::default()),
        arrived: watch::channel(0).0,
        devices,
        generation: watch::channel(0).0,
        cfg,
    });
    let dir = plugin.cfg.dir.clone();
    tracing::info!(dir = %dir.display(), resource = %plugin.cfg.resource, slots_per_gpu = plugin.cfg.slots_per_gpu, "device plugin: starting");
    let mut resync = tokio::time::interval(plugin.cfg.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // How soon a restarted kubelet gets the plugin back.
    let mut poll = tokio::time::interval(Duration::from_secs(1));
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut serving: Option<Serving> = None;
    let mut waiting_logged = false;
    loop {
        tokio::select! {
            ev = arrivals.next() => {
                let uid = |p: &Pod| p.metadata.uid.clone().unwrap_or_default();
                let mut a = plugin.arrivals.lock().unwrap_or_else(|e| e.into_inner());
                match ev {
                    Some(Ok(watcher::Event::Apply(p))) => a.arrived(&uid(&p)),
                    Some(Ok(watcher::Event::InitApply(p))) => a.listed(&uid(&p)),
                    Some(Ok(watcher::Event::InitDone)) => a.list_done(),
                    Some(Ok(watcher::Event::Delete(p))) => a.gone(&uid(&p)),
                    Some(Ok(watcher::Event::Init)) => {}
                    Some(Err(e)) => tracing::debug!(error = %e, "device plugin: pod watch error; retrying"),
                    // The watcher retries for ever; should it end, pods are answered in
                    // creation order from then on.
                    None => {
                        tracing::error!("device plugin: the pod watch ended");
                        arrivals = futures::stream::pending().boxed();
                    }
                }
                drop(a);
                plugin.arrived.send_modify(|n| *n = n.wrapping_add(1));
            }
            _ = resync.tick() => {
                if let Some(gpus) = offered(&plugin.cfg.inventory) {
                    let ids = select::slot_ids(gpus.len(), plugin.cfg.slots_per_gpu);
                    devices_tx.send_if_modified(|cur| {
                        let changed = *cur != ids;
                        if changed {
                            tracing::info!(gpus = gpus.len(), slots = ids.len(), "device plugin: slots changed");
                            *cur = ids;
                        }
                        changed
                    });
                    plugin.state.lock().await.gpus = gpus;
                }
                plugin.forget_gone().await;
            }
            _ = poll.tick() => {
                let kubelet = socket_id(&dir.join(dp::KUBELET_SOCKET));
                let own = dir.join(ENDPOINT).exists();
                match next_step(serving.as_ref().map(|s| s.registered), kubelet, own) {
                    Step::Keep => {}
                    Step::Wait => {
                        if !waiting_logged {
                            tracing::info!(dir = %dir.display(), "device plugin: no kubelet.sock yet; waiting");
                            waiting_logged = true;
                        }
                    }
                    Step::Register => {
                        let Some(k) = kubelet else { continue };
                        if let Some(mut old) = serving.take() {
                            tracing::info!("device plugin: kubelet.sock changed or our socket is gone; registering again");
                            // Its streams end and its connections close: the kubelet then
                            // takes the new registration.
                            plugin.generation.send_modify(|g| *g += 1);
                            if tokio::time::timeout(Duration::from_secs(5), &mut old.task).await.is_err() {
                                old.task.abort();
                            }
                        }
                        match serve(&plugin, k).await {
                            Ok(s) => {
                                tracing::info!(socket = %dir.join(ENDPOINT).display(), resource = %plugin.cfg.resource, "device plugin: registered with the kubelet");
                                waiting_logged = false;
                                serving = Some(s);
                            }
                            Err(e) => tracing::warn!(error = %e, "device plugin: registration failed; retrying"),
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_again_when_the_kubelet_restarts() {
        let (a, b) = ((1, 10), (1, 11));
        assert_eq!(next_step(None, None, false), Step::Wait);
        assert_eq!(next_step(Some(a), None, true), Step::Wait);
        assert_eq!(next_step(None, Some(a), false), Step::Register);
        assert_eq!(next_step(Some(a), Some(a), true), Step::Keep);
        // A new kubelet.sock, or our socket removed by the kubelet.
        assert_eq!(next_step(Some(a), Some(b), true), Step::Register);
        assert_eq!(next_step(Some(a), Some(a), false), Step::Register);
    }

    #[test]
    fn the_checkpoint_survives_and_a_bad_one_starts_empty() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(CHECKPOINT);
        assert_eq!(load_checkpoint(&p), Answered::default());
        let mut a = Answered::default();
        a.pods.insert("u".into(), 3);
        save_checkpoint(&p, &a).unwrap();
        assert_eq!(load_checkpoint(&p), a);
        std::fs::write(&p, "{").unwrap();
        assert_eq!(load_checkpoint(&p), Answered::default());
    }
}
