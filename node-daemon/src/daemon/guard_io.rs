//! The edges of [`crate::guard`]: reads gem-schd's usage reports, NVML's process lists and
//! processes' cgroups, and reports what the guard decides (log lines, Events on the pods,
//! metrics) and, where asked, evicts the pods that use a GPU untracked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, EvictParams};
use kube::runtime::events::EventType;
use kubeshare_api::{NodeInventory, UsageReport};

use super::{Daemon, GuardConfig};
use crate::guard::{GpuView, RefusalNews, Refusals, Strangers, Untracked};
use crate::reconcile::PodView;

/// A refusing socket is reported again at most this often: a refused hook retries (every
/// 100 ms under KUBESHARE_ON_UNREACHABLE=wait), and one Event per check would flood the pods.
const REFUSAL_EVENT_EVERY: Duration = Duration::from_secs(300);

/// (gpu, socket pod, peer pod).
type RefusalKey = (String, String, Option<String>);

/// The guard's memory across checks, and its handles.
pub(super) struct GuardState {
    refusals: Refusals,
    strangers: Strangers,
    /// NVML, while the process check runs.
    nvml: Option<crate::nvml::Processes>,
    evict: bool,
    client: Client,
    /// Pods already evicted (uid), so each is asked once.
    evicted: BTreeSet<String>,
    /// When refusals were last reported in Events, per (gpu, socket pod, peer pod), with
    /// how many came since.
    refusal_events: BTreeMap<RefusalKey, (Option<Instant>, u64)>,
}

impl GuardState {
    pub(super) fn new(cfg: &GuardConfig, client: Client) -> GuardState {
        let nvml = match cfg.every {
            None => None,
            Some(_) => match crate::nvml::Processes::open(&cfg.nvml_library) {
                Ok(n) => {
                    tracing::info!(library = %cfg.nvml_library.display(), evict = cfg.evict, "checking the GPUs' processes against gem-schd's clients");
                    Some(n)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no NVML: GPU processes that gem-schd does not know go unnoticed");
                    None
                }
            },
        };
        GuardState {
            refusals: Refusals::default(),
            strangers: Strangers::default(),
            nvml,
            evict: cfg.evict,
            client,
            evicted: BTreeSet::new(),
            refusal_events: BTreeMap::new(),
        }
    }
}

/// The pod UID of process `pid` from its cgroups (`None`: gone, or in no pod).
fn pod_of(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    kubeshare_api::cgroup::pod_uid_of_process(&text)
}

fn describe(pods: &[PodView], uid: Option<&str>) -> String {
    match uid {
        None => "no pod".to_string(),
        Some(u) => match pods.iter().find(|p| p.uid == u) {
            Some(p) => format!("pod {}/{} ({u})", p.namespace, p.name),
            None => format!("pod {u}"),
        },
    }
}

impl Daemon {
    /// One check: gem-schd's new refusals, then the GPUs' processes.
    pub(super) fn guard(&mut self, inventory: &NodeInventory, pods: &[PodView]) {
        let reports = self.fresh_reports(inventory);
        for n in self.guard.refusals.update(&reports) {
            self.report_refusal(&n, pods);
        }
        let checking = self.guard.nvml.is_some();
        let untracked = self.check_processes(inventory, pods, &reports);
        self.shared.update(|s| {
            s.guard.checking = checking;
            if let Some(u) = untracked {
                s.guard.untracked = u;
            }
        });
    }

    /// The usage reports of the GPUs whose gem-schd runs, where fresh.
    fn fresh_reports(&self, inventory: &NodeInventory) -> BTreeMap<String, UsageReport> {
        let procs = self
            .shared
            .procs
            .lock()
            .map(|g| g.clone())
            .unwrap_or_else(|e| e.into_inner().clone());
        inventory
            .gpus
            .iter()
            .filter(|g| procs.get(&g.uuid).is_some_and(|p| p.running))
            .filter_map(|g| {
                crate::http::read_usage(&self.cfg.layout.usage(&g.uuid))
                    .map(|r| (g.uuid.clone(), r))
            })
            .collect()
    }

    fn report_refusal(&mut self, n: &RefusalNews, pods: &[PodView]) {
        self.shared.counters(|c| c.refused_peers += n.new);
        let peer = describe(pods, n.peer_pod.as_deref());
        let owner = describe(pods, Some(&n.socket_pod));
        tracing::warn!(gpu = %n.gpu, socket_pod = %n.socket_pod, peer_pod = n.peer_pod.as_deref().unwrap_or("none"), pid = n.pid, refused = n.new, "gem-schd refused connections to a pod's socket from a process outside that pod");
        let key = (n.gpu.clone(), n.socket_pod.clone(), n.peer_pod.clone());
        let now = Instant::now();
        let (last, pending) = self.guard.refusal_events.entry(key).or_insert((None, 0));
        *pending += n.new;
        if last.is_some_and(|t| now.duration_since(t) < REFUSAL_EVENT_EVERY) {
            return;
        }
        let count = std::mem::take(pending);
        *last = Some(now);
        if let Some(p) = pods.iter().find(|p| p.uid == n.socket_pod) {
            let note = format!(
                "gem-schd refused {count} connection(s) to this pod's socket for GPU {}: the process (pid {} on the node) runs in {peer}",
                n.gpu, n.pid
            );
            self.emit_for(p, EventType::Warning, "GpuSocketPeerRefused", "Guard", note);
        }
        if let Some(uid) = &n.peer_pod
            && let Some(p) = pods.iter().find(|p| &p.uid == uid)
        {
            let note = format!(
                "process {} of this pod connected to the gem-schd socket of {owner} for GPU {} and was refused",
                n.pid, n.gpu
            );
            self.emit_for(
                p,
                EventType::Warning,
                "GpuSocketOfAnotherPod",
                "Guard",
                note,
            );
        }
    }

    /// The driver's processes against gem-schd's clients; `None` when not checked.
    fn check_processes(
        &mut self,
        inventory: &NodeInventory,
        pods: &[PodView],
        reports: &BTreeMap<String, UsageReport>,
    ) -> Option<Vec<Untracked>> {
        let driver = match self.guard.nvml.as_ref()?.list() {
            Ok(d) => d,
            Err(e) => {
                self.shared.counters(|c| c.errors += 1);
                tracing::warn!(error = %e, "cannot list the GPUs' processes");
                return None;
            }
        };
        let whole = self
            .shared
            .snapshot
            .lock()
            .map(|s| s.desired.whole.clone())
            .unwrap_or_default();
        let gpus: BTreeMap<String, GpuView> = inventory
            .gpus
            .iter()
            .map(|g| {
                let v = GpuView {
                    driver: driver.get(&g.uuid).cloned().unwrap_or_default(),
                    known: reports.get(&g.uuid).map(|r| {
                        r.clients
                            .iter()
                            .flat_map(|c| c.pids.iter().copied())
                            .collect()
                    }),
                    held: g.held_by.is_some(),
                    whole_pods: whole
                        .get(&g.uuid)
                        .map(|w| w.iter().cloned().collect())
                        .unwrap_or_default(),
                };
                (g.uuid.clone(), v)
            })
            .collect();
        let key = |uid: &str| {
            pods.iter()
                .find(|p| p.uid == uid)
                .map(|p| format!("{}/{}", p.namespace, p.name))
        };
        let found = self.guard.strangers.check(&gpus, pod_of, key);
        for u in &found.new {
            self.report_untracked(u, pods);
        }
        Some(found.untracked)
    }

    fn report_untracked(&mut self, u: &Untracked, pods: &[PodView]) {
        let pod = u
            .pod_uid
            .as_ref()
            .and_then(|uid| pods.iter().find(|p| &p.uid == uid));
        tracing::warn!(gpu = %u.gpu, pid = u.pid, pod_uid = u.pod_uid.as_deref().unwrap_or("none"), pod = u.pod_key.as_deref().unwrap_or("-"), "a process uses the GPU without gem-schd: no share, no memory cap");
        let Some(p) = pod else { return };
        let note = format!(
            "process {} (pid on the node) uses GPU {} without KubeShare's hook: gem-schd neither shares the GPU's time with it nor caps its memory{}",
            u.pid,
            u.gpu,
            if self.guard.evict {
                "; evicting the pod"
            } else {
                ""
            }
        );
        self.emit_for(p, EventType::Warning, "UntrackedGpuProcess", "Guard", note);
        if self.guard.evict && self.guard.evicted.insert(p.uid.clone()) {
            let api: Api<Pod> = Api::namespaced(self.guard.client.clone(), &p.namespace);
            let (name, ns) = (p.name.clone(), p.namespace.clone());
            let shared = self.shared.clone();
            tokio::spawn(async move {
                match api.evict(&name, &EvictParams::default()).await {
                    Ok(_) => {
                        shared.counters(|c| c.evictions += 1);
                        tracing::warn!(pod = %format!("{ns}/{name}"), "evicted for using a GPU untracked");
                    }
                    Err(e) => {
                        shared.counters(|c| c.errors += 1);
                        tracing::warn!(pod = %format!("{ns}/{name}"), error = %e, "cannot evict a pod that uses a GPU untracked");
                    }
                }
            });
        }
    }
}
