//! The daemon's main loop: the edges around the pure decisions of [`crate::reconcile`].
//!
//! Inputs: the pods bound to the node (a list-then-watch on `spec.nodeName=<node>`),
//! the ResourceClaims the DRA kubelet plugin prepared (with `--dra`), the inventory
//! (re-read every resync), a resync tick. Each change recomputes the
//! desired state from everything known and applies the difference to the disk, so
//! after a restart the daemon rebuilds its state from the API and the files alone.
//! Nothing on disk is touched until the first list of pods has completed.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event as KEvent, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use kubeshare_api::NodeInventory;

use crate::disk::{HostDir as _, Layout, install_hook_lib};
use crate::dra::book::{Applied, Book, Changes};
use crate::dra::claim::PreparedClaim;
use crate::metrics::{Counters, Snapshot};
use crate::reconcile::{self, Action, ClaimShare, Desired, Placement, PodView};
use crate::source::InventorySource;
use crate::supervisor::{GemSchdCommand, ProcStats, Supervisor};

mod guard_io;

/// The name the daemon reports events under.
pub const CONTROLLER_NAME: &str = "kubeshare-node-daemon";

/// Everything the daemon is told at start.
#[derive(Debug, Clone)]
pub struct Config {
    pub node: String,
    pub layout: Layout,
    pub inventory: InventorySource,
    pub hook_lib: Option<std::path::PathBuf>,
    pub gem_schd: Option<GemSchdCommand>,
    pub listen: SocketAddr,
    pub resync: Duration,
    /// Put the GPU-node taint `kubeshare.io/gpu=shared:NoSchedule` on the Node while it
    /// has GPUs (`--taint-node`, on by default). Off: the daemon leaves taints alone.
    pub taint: bool,
    /// Learn from the kubelet which GPUs other device plugins gave whole to pods, and
    /// publish them as held (docs/device-plugin.md). `None`: never asks.
    pub device_plugins: Option<DevicePluginWatch>,
    /// The check of GPU use that gem-schd does not gate (`crate::guard`).
    pub guard: GuardConfig,
}

/// How to check for GPU use that gem-schd does not gate.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// How often: gem-schd's refusals are read, and the driver's processes compared with
    /// gem-schd's clients. `None`: never.
    pub every: Option<Duration>,
    /// NVML, to list the driver's processes; the process check is off if it cannot be loaded.
    pub nvml_library: std::path::PathBuf,
    /// Evict the pods found using a GPU untracked.
    pub evict: bool,
}

/// Where and how often to ask the kubelet's PodResources API.
#[derive(Debug, Clone)]
pub struct DevicePluginWatch {
    pub socket: std::path::PathBuf,
    /// Resource names whose devices are this node's GPUs (`nvidia.com/gpu`).
    pub resources: Vec<String>,
    pub interval: Duration,
}

/// State shared with the HTTP server.
#[derive(Clone, Default)]
pub struct Shared {
    pub snapshot: Arc<Mutex<Snapshot>>,
    pub procs: ProcStats,
    pub supervised: bool,
    /// Where gem-schd's usage reports are (read at each scrape).
    pub layout: Option<crate::disk::Layout>,
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        f(&mut self.snapshot.lock().unwrap_or_else(|e| e.into_inner()));
    }
    fn counters(&self, f: impl FnOnce(&mut Counters)) {
        self.update(|s| f(&mut s.counters));
    }
}

/// Checks the root and makes its directories, installs the hook library.
fn prepare(cfg: &Config) -> anyhow::Result<()> {
    let layout = &cfg.layout;
    let longest = layout.longest_socket_path();
    anyhow::ensure!(
        longest <= crate::disk::MAX_SOCKET_PATH,
        "root {} is too long: socket paths under it would be {longest} bytes, Unix sockets allow {}",
        layout.root.display(),
        crate::disk::MAX_SOCKET_PATH
    );
    layout.create().with_context(|| {
        format!(
            "cannot create the directories under {}",
            layout.root.display()
        )
    })?;
    if let Some(src) = &cfg.hook_lib {
        let written = install_hook_lib(layout, src)
            .with_context(|| format!("cannot install the hook library from {}", src.display()))?;
        tracing::info!(from = %src.display(), to = %layout.hook_lib().display(), written, "hook library installed");
    }
    Ok(())
}

/// Runs until `shutdown` resolves, then stops the gem-schd children and returns.
pub async fn run(
    cfg: Config,
    client: Client,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    run_with_claims(cfg, client, shutdown, None).await
}

/// [`run`], with the claims in `claims` (the DRA kubelet plugin's book) written into
/// the GPUs' configs beside the pods; each change it signals is answered once applied.
pub async fn run_with_claims(
    cfg: Config,
    client: Client,
    shutdown: impl Future<Output = ()>,
    claims: Option<(Book, Changes)>,
) -> anyhow::Result<()> {
    let (book, mut changes) = claims.unzip();
    // Changes waiting for the first list of pods to complete.
    let mut applied: Vec<Applied> = Vec::new();
    prepare(&cfg)?;
    let layout = cfg.layout.clone();
    // As discovered; `inventory` is what is published: the same with the GPUs that
    // device-plugin pods hold marked.
    let mut discovered = cfg.inventory.load().context("GPU discovery failed")?;
    tracing::info!(node = %cfg.node, gpus = discovered.gpus.len(), inventory = %discovered.to_json(), "inventory");
    let mut inventory = discovered.clone();
    let mut held_devices = Vec::new();

    let shared = Shared {
        supervised: cfg.gem_schd.is_some(),
        layout: Some(layout.clone()),
        ..Shared::default()
    };
    shared.update(|s| {
        s.node = cfg.node.clone();
        s.inventory = inventory.clone();
        // The checkpoint's claims, shown from the start (the loop's first pass waits
        // for the pods).
        s.claims = book.as_ref().map(Book::snapshot);
    });

    let (http_stop_tx, http_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    tracing::info!(addr = %listener.local_addr()?, "serving /healthz, /readyz, /metrics");
    let http = tokio::spawn(crate::http::serve(listener, shared.clone(), async {
        let _ = http_stop_rx.await;
    }));

    seed_configs(&layout, &inventory)?;
    let mut supervisor = cfg
        .gem_schd
        .clone()
        .map(|c| Supervisor::new(c, layout.clone(), shared.procs.clone()));
    if let Some(s) = supervisor.as_mut() {
        s.ensure(&gpu_set(&inventory)).await;
    }

    let mut daemon = Daemon::new(&cfg, &client, &shared);
    daemon.publish(&inventory).await;

    let pods: Api<Pod> = Api::all(client.clone());
    let wc = watcher::Config::default().fields(&format!("spec.nodeName={}", cfg.node));
    let mut stream = watcher(pods, wc).default_backoff().boxed();
    let (store, mut writer) = reflector::store::<Pod>();
    let mut synced = false;
    let mut tick = interval(cfg.resync);
    tick.tick().await;
    let mut shutdown = std::pin::pin!(shutdown);
    let mut held_tick = cfg.device_plugins.as_ref().map(|w| interval(w.interval));
    let mut socket_seen: Option<bool> = None;
    let mut guard_tick = cfg.guard.every.map(interval);

    loop {
        let mut dirty = false;
        tokio::select! {
            _ = &mut shutdown => break,
            change = next_change(&mut changes) => match change {
                Some(ack) => {
                    applied.push(ack);
                    dirty = true;
                }
                None => changes = None,
            },
            ev = stream.next() => {
                // Every event already waiting, then one reconcile.
                let burst = crate::pods::apply_burst(ev, &mut stream, &mut writer, "pods");
                if burst.ended {
                    anyhow::bail!("the pod watch ended");
                }
                synced |= burst.listed;
                dirty |= burst.changed;
            }
            _ = tick_if_any(&mut held_tick) => {
                let Some(watch) = cfg.device_plugins.as_ref() else { continue };
                if let Some(devices) = held_by_device_plugins(watch, &mut socket_seen, &shared).await {
                    held_devices = devices;
                }
                let next = crate::held::mark_held(&discovered, &held_devices, &watch.resources);
                dirty |= daemon.held_changed(&mut inventory, next).await;
            }
            _ = tick_if_any(&mut guard_tick) => {
                if synced {
                    daemon.guard(&inventory, &crate::pods::visible(&store));
                }
            }
            _ = tick.tick() => {
                match cfg.inventory.load() {
                    Ok(inv) if inv != discovered => {
                        tracing::info!(inventory = %inv.to_json(), "inventory changed");
                        discovered = inv;
                        inventory = match cfg.device_plugins.as_ref() {
                            Some(w) => crate::held::mark_held(&discovered, &held_devices, &w.resources),
                            None => discovered.clone(),
                        };
                        shared.update(|s| s.inventory = inventory.clone());
                        if let Some(s) = supervisor.as_mut() {
                            s.ensure(&gpu_set(&inventory)).await;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        shared.counters(|c| c.errors += 1);
                        tracing::warn!(error = %e, "inventory re-read failed; keeping the last one");
                    }
                }
                daemon.publish(&inventory).await;
                // Repairs files changed behind our back.
                dirty = true;
            }
        }
        if dirty && synced {
            // One look at the book: the configs and the metrics say the same claims.
            let prepared = book.as_ref().map(Book::snapshot);
            daemon.reconcile(&inventory, &crate::pods::visible(&store), prepared);
            for ack in applied.drain(..) {
                let _ = ack.send(());
            }
        }
    }

    tracing::info!("shutting down");
    if let Some(s) = supervisor.as_mut() {
        s.shutdown().await;
    }
    let _ = http_stop_tx.send(());
    let _ = http.await;
    Ok(())
}

/// A tick every `every`; late ticks are not made up in a burst.
fn interval(every: Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(every);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// The next change of the prepared claims; never without a book.
async fn next_change(changes: &mut Option<Changes>) -> Option<Applied> {
    match changes.as_mut() {
        Some(c) => c.next().await,
        None => std::future::pending().await,
    }
}

/// The next tick of `t`; never without one.
async fn tick_if_any(t: &mut Option<tokio::time::Interval>) {
    match t.as_mut() {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// gem-schd needs a config file to start; keep what is there (the last truth), else
/// start it empty until the first list of pods says otherwise.
fn seed_configs(layout: &Layout, inventory: &NodeInventory) -> anyhow::Result<()> {
    for g in &inventory.gpus {
        if !layout.config(&g.uuid).exists() {
            layout.apply(&Action::WriteConfig {
                gpu: g.uuid.clone(),
                text: "0\n".into(),
            })?;
        }
    }
    Ok(())
}

/// The devices pods hold, as the kubelet lists them; `Some(empty)` when the node has
/// no PodResources socket (no kubelet API to ask: nothing is held), `None` when the
/// call failed (keep what was known).
async fn held_by_device_plugins(
    watch: &DevicePluginWatch,
    socket_seen: &mut Option<bool>,
    shared: &Shared,
) -> Option<Vec<kubeshare_kubelet_rpc::podresources::HeldDevice>> {
    let exists = watch.socket.exists();
    if *socket_seen != Some(exists) {
        *socket_seen = Some(exists);
        if exists {
            tracing::info!(socket = %watch.socket.display(), resources = ?watch.resources, "asking the kubelet which GPUs device-plugin pods hold");
        } else {
            tracing::info!(socket = %watch.socket.display(), "no kubelet PodResources socket: no GPU is held by another device plugin");
        }
    }
    if !exists {
        return Some(Vec::new());
    }
    match kubeshare_kubelet_rpc::podresources::list(&watch.socket).await {
        Ok(d) => Some(d),
        Err(e) => {
            shared.counters(|c| c.errors += 1);
            tracing::warn!(error = %e, "cannot list pod resources; keeping the GPUs held as they were");
            None
        }
    }
}

fn gpu_set(inv: &NodeInventory) -> BTreeSet<String> {
    inv.gpus.iter().map(|g| g.uuid.clone()).collect()
}

struct Daemon {
    cfg: Config,
    nodes: Api<Node>,
    recorder: Recorder,
    shared: Shared,
    /// Pods whose placement was announced with an event (uid).
    announced: BTreeSet<String>,
    /// Problems already reported (uid, message): one event each, not one per pass.
    reported: BTreeSet<(String, String)>,
    last_overcommit: Vec<(String, u32)>,
    guard: guard_io::GuardState,
}

impl Daemon {
    fn new(cfg: &Config, client: &Client, shared: &Shared) -> Daemon {
        Daemon {
            cfg: cfg.clone(),
            nodes: Api::all(client.clone()),
            recorder: Recorder::new(
                client.clone(),
                Reporter {
                    controller: CONTROLLER_NAME.into(),
                    instance: Some(format!("{CONTROLLER_NAME}-{}", cfg.node)),
                },
            ),
            shared: shared.clone(),
            announced: BTreeSet::new(),
            reported: BTreeSet::new(),
            last_overcommit: Vec::new(),
            guard: guard_io::GuardState::new(&cfg.guard, client.clone()),
        }
    }

    /// Takes `next` (the inventory with device-plugin holders marked) if it differs, and
    /// publishes it; whether it did.
    async fn held_changed(&mut self, inventory: &mut NodeInventory, next: NodeInventory) -> bool {
        if next == *inventory {
            return false;
        }
        let held: Vec<String> = next
            .gpus
            .iter()
            .filter_map(|g| g.held_by.as_ref().map(|h| format!("{}={h}", g.uuid)))
            .collect();
        tracing::info!(held = ?held, "GPUs held by device-plugin pods changed");
        *inventory = next;
        self.shared.update(|s| s.inventory = inventory.clone());
        self.publish(inventory).await;
        true
    }

    /// Makes the Node's labels and annotation say `inventory`.
    async fn publish(&mut self, inventory: &NodeInventory) {
        let node = match self.nodes.get(&self.cfg.node).await {
            Ok(n) => n,
            Err(e) => {
                self.shared.counters(|c| c.errors += 1);
                tracing::warn!(node = %self.cfg.node, error = %e, "cannot read my Node; will retry");
                return;
            }
        };
        let labels = node.metadata.labels.clone().unwrap_or_default();
        let annotations = node.metadata.annotations.clone().unwrap_or_default();
        if self.cfg.taint && !inventory.gpus.is_empty() {
            self.taint(node.clone()).await;
        }
        let Some(patch) = crate::node::inventory_patch(&labels, &annotations, inventory) else {
            return;
        };
        match self
            .nodes
            .patch(
                &self.cfg.node,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {
                self.shared.counters(|c| c.inventory_patches += 1);
                tracing::info!(node = %self.cfg.node, patch = %patch, "inventory published on the Node");
            }
            Err(e) => {
                self.shared.counters(|c| c.errors += 1);
                tracing::warn!(node = %self.cfg.node, error = %e, "cannot patch my Node; will retry");
            }
        }
    }

    /// Puts the GPU-node taint on the Node. The patch is guarded by the Node's
    /// resourceVersion; on a conflict the Node is read again (a few times, then the next
    /// resync tries again).
    async fn taint(&mut self, mut node: Node) {
        for _ in 0..3 {
            let rv = node.metadata.resource_version.clone().unwrap_or_default();
            let taints = node
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default();
            let Some(patch) = crate::node::taint_patch(&rv, &taints) else {
                return;
            };
            let patch: json_patch::Patch = match serde_json::from_value(patch) {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(error = %e, "taint patch does not serialize; not tainting");
                    return;
                }
            };
            match self
                .nodes
                .patch(
                    &self.cfg.node,
                    &PatchParams::default(),
                    &Patch::<()>::Json(patch),
                )
                .await
            {
                Ok(_) => {
                    tracing::info!(node = %self.cfg.node, taint = "kubeshare.io/gpu=shared:NoSchedule", "GPU-node taint set");
                    return;
                }
                Err(e) => {
                    tracing::info!(node = %self.cfg.node, error = %e, "taint patch refused (the Node changed?); reading it again");
                }
            }
            match self.nodes.get(&self.cfg.node).await {
                Ok(n) => node = n,
                Err(e) => {
                    self.shared.counters(|c| c.errors += 1);
                    tracing::warn!(node = %self.cfg.node, error = %e, "cannot read my Node; will retry");
                    return;
                }
            }
        }
        self.shared.counters(|c| c.errors += 1);
        tracing::warn!(node = %self.cfg.node, "could not set the GPU-node taint; the next resync tries again");
    }

    /// `prepared`: the kubelet plugin's claims (by UID), `None` without the plugin.
    fn reconcile(
        &mut self,
        inventory: &NodeInventory,
        pods: &[PodView],
        prepared: Option<BTreeMap<String, PreparedClaim>>,
    ) {
        let claims: Vec<ClaimShare> = prepared
            .iter()
            .flat_map(|p| p.values().map(PreparedClaim::share))
            .collect();
        let desired = reconcile::desired_with_claims(&self.cfg.node, inventory, pods, &claims);
        let layout = &self.cfg.layout;
        let mut writes = 0u64;
        let mut errors = 0u64;
        // Pods whose directory this pass created: new here, so worth an event (a
        // restarted daemon finds the directories there and stays quiet).
        let mut created = BTreeSet::new();
        match layout.read_actual(desired.configs.keys()) {
            Ok(actual) => {
                for action in reconcile::diff(&desired, &actual) {
                    match layout.apply(&action) {
                        Ok(()) => match &action {
                            Action::WriteConfig { gpu, text } => {
                                writes += 1;
                                tracing::info!(gpu = %gpu, config = %text.replace('\n', "; "), "resource-config written");
                            }
                            Action::CreatePodDir(uid) => {
                                created.insert(uid.clone());
                                tracing::info!(?action, "applied");
                            }
                            Action::RemovePodDir(_)
                            | Action::WritePeers { .. }
                            | Action::RemovePeers(_) => tracing::info!(?action, "applied"),
                        },
                        Err(e) => {
                            errors += 1;
                            tracing::error!(?action, error = %e, "cannot apply");
                        }
                    }
                }
            }
            Err(e) => {
                errors += 1;
                tracing::error!(root = %layout.root.display(), error = %e, "cannot read the node's files");
            }
        }
        if desired.overcommitted != self.last_overcommit {
            for (gpu, milli) in &desired.overcommitted {
                tracing::warn!(gpu = %gpu, requested_milli = milli, "guaranteed shares add up to more than one GPU");
            }
            self.last_overcommit = desired.overcommitted.clone();
        }
        self.events(pods, &desired, &created);
        self.conflicts(pods, inventory, &desired);
        self.shared.update(|s| {
            s.synced = true;
            s.counters.reconciles += 1;
            s.counters.config_writes += writes;
            s.counters.errors += errors;
            s.desired = desired;
            s.claims = prepared;
        });
    }

    /// One event per new placement (its directory was just created) and per new
    /// problem; forgets pods that left.
    fn events(&mut self, pods: &[PodView], desired: &Desired, created: &BTreeSet<String>) {
        let by_uid: BTreeMap<&str, &PodView> = pods.iter().map(|p| (p.uid.as_str(), p)).collect();
        self.announced.retain(|u| by_uid.contains_key(u.as_str()));
        self.reported
            .retain(|(u, _)| by_uid.contains_key(u.as_str()));
        for p in &desired.placements {
            if !created.contains(&p.pod_uid) || !self.announced.insert(p.pod_uid.clone()) {
                continue;
            }
            let Some(pod) = by_uid.get(p.pod_uid.as_str()) else {
                continue;
            };
            tracing::info!(pod = %p.pod_key, uid = %p.pod_uid, gpus = ?p.gpus, whole = p.whole, "pod configured");
            self.emit(
                pod,
                EventType::Normal,
                "GpuConfigured",
                placement_note(p, &self.cfg.node),
            );
        }
        for prob in &desired.problems {
            if !self
                .reported
                .insert((prob.pod_uid.clone(), prob.message.clone()))
            {
                continue;
            }
            tracing::warn!(pod = %prob.pod_key, uid = %prob.pod_uid, problem = %prob.message, "pod not configured");
            if let Some(pod) = by_uid.get(prob.pod_uid.as_str()) {
                self.emit(
                    pod,
                    EventType::Warning,
                    "GpuNotConfigured",
                    prob.message.clone(),
                );
            }
        }
    }

    /// A warning on each KubeShare pod whose GPU a device-plugin pod holds too.
    fn conflicts(&mut self, pods: &[PodView], inventory: &NodeInventory, desired: &Desired) {
        for (uid, why) in crate::held::conflicts(inventory, &desired.placements) {
            if !self.reported.insert((uid.clone(), why.clone())) {
                continue;
            }
            tracing::warn!(uid = %uid, problem = %why, "GPU shared with a device-plugin pod");
            if let Some(pod) = pods.iter().find(|p| p.uid == uid) {
                self.emit(pod, EventType::Warning, "GpuHeldByDevicePlugin", why);
            }
        }
    }

    fn emit(&self, pod: &PodView, type_: EventType, reason: &str, note: String) {
        self.emit_for(pod, type_, reason, "Configure", note);
    }

    fn emit_for(&self, pod: &PodView, type_: EventType, reason: &str, action: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: Some(pod.uid.clone()),
            ..ObjectReference::default()
        };
        let ev = KEvent {
            type_,
            reason: reason.into(),
            // The API caps a note at 1 kB.
            note: Some(note.chars().take(1000).collect()),
            action: action.into(),
            secondary: None,
        };
        let recorder = self.recorder.clone();
        // Events are best effort; they never hold up the loop.
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &reference).await {
                tracing::debug!(error = %e, "cannot publish event");
            }
        });
    }
}

fn placement_note(p: &Placement, node: &str) -> String {
    if p.whole {
        format!(
            "whole GPU(s) {} on {node}: no time-slicing",
            p.gpus.join(",")
        )
    } else {
        format!(
            "added to the resource-config of GPU(s) {} on {node}; socket directory pods/{}/",
            p.gpus.join(","),
            p.pod_uid
        )
    }
}
