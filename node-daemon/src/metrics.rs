//! `/metrics` (OpenMetrics text through `prometheus-client`), rendered from the last
//! reconcile and the supervisor's process table: per GPU (what label pods and prepared
//! DRA claims hold), per pod and per node figures, and the guard's findings (a pure
//! function of them, so it is unit-tested as text).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use kubeshare_api::{NodeInventory, UsageReport};

use crate::dra::claim::{PreparedClaim, claimed_per_gpu};
use crate::reconcile::Desired;
use crate::supervisor::ProcStat;

/// Counters kept by the daemon's main loop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub reconciles: u64,
    pub config_writes: u64,
    pub errors: u64,
    pub inventory_patches: u64,
    /// Connections gem-schd refused at a pod's socket (another pod's process, or none's).
    pub refused_peers: u64,
    /// Pods evicted for untracked GPU use.
    pub evictions: u64,
}

/// Everything `/metrics` and `/healthz` show.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub node: String,
    pub synced: bool,
    pub inventory: NodeInventory,
    pub desired: Desired,
    pub counters: Counters,
    /// The last check of the GPUs' processes.
    pub guard: GuardView,
    /// The claims the DRA kubelet plugin had prepared (by claim UID) at the last
    /// reconcile, or at start from its checkpoint. `None`: no plugin (no `--dra`), so
    /// no claim figures.
    pub claims: Option<BTreeMap<String, PreparedClaim>>,
}

/// What `/metrics` shows of the untracked-process check.
#[derive(Debug, Clone, Default)]
pub struct GuardView {
    /// The check runs (`--gpu-process-check-secs` > 0).
    pub checking: bool,
    pub untracked: Vec<crate::guard::Untracked>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    node: String,
    gpu: String,
    index: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    namespace: String,
    pod: String,
    gpu_uuid: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

type FGauge = Gauge<f64, AtomicU64>;

/// The exposition text (OpenMetrics, through `prometheus-client`): a registry built
/// from the snapshot on each scrape, so the figures are the last reconcile's.
///
/// `usage`: gem-schd's last report per GPU (fresh ones only), for the delivered shares.
pub fn render(
    s: &Snapshot,
    procs: &BTreeMap<String, ProcStat>,
    supervised: bool,
    usage: &BTreeMap<String, UsageReport>,
) -> String {
    // One registry, two prefixes: the node's and its GPUs' figures, and the pods'.
    let mut root = Registry::default();
    let reg = root.sub_registry_with_prefix("kubeshare_node");
    register_gpus(reg, s, procs, supervised);
    register_claims(reg, s);
    register_node(reg, s);
    register_guard(reg, s);
    let pod_reg = root.sub_registry_with_prefix("kubeshare_pod");
    register_pods(pod_reg, s, usage);
    register_pod_guard(pod_reg, s);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &root);
    out
}

fn gpu_labels(s: &Snapshot, g: &kubeshare_api::GpuInfo) -> GpuLabels {
    GpuLabels {
        node: s.node.clone(),
        gpu: g.uuid.clone(),
        index: g.index.to_string(),
    }
}

/// The time-shared entries of `gpu`'s resource-config.
fn entries<'a>(s: &'a Snapshot, gpu: &str) -> &'a [kubeshare_api::ResourceEntry] {
    s.desired
        .configs
        .get(gpu)
        .map(|c| c.entries.as_slice())
        .unwrap_or(&[])
}

/// Per GPU: what its pods ask of it, its memory, and its gem-schd.
fn register_gpus(
    reg: &mut Registry,
    s: &Snapshot,
    procs: &BTreeMap<String, ProcStat>,
    supervised: bool,
) {
    let whole = |gpu: &str| s.desired.whole.get(gpu).map_or(0, Vec::len);
    let pods = Family::<GpuLabels, Gauge>::default();
    let requested = Family::<GpuLabels, FGauge>::default();
    let limits = Family::<GpuLabels, FGauge>::default();
    let memory = Family::<GpuLabels, Gauge>::default();
    let allocated = Family::<GpuLabels, Gauge>::default();
    let up = Family::<GpuLabels, Gauge>::default();
    let restarts = Family::<GpuLabels, Counter>::default();
    let held = Family::<GpuLabels, Gauge>::default();
    for g in &s.inventory.gpus {
        let l = gpu_labels(s, g);
        let e = entries(s, &g.uuid);
        pods.get_or_create(&l)
            .set(to_i64(e.len() as u64 + whole(&g.uuid) as u64));
        let milli = |v: u64| v as f64 / 1000.0;
        requested.get_or_create(&l).set(milli(
            e.iter().map(|e| u64::from(e.request.get())).sum::<u64>()
                + 1000 * whole(&g.uuid) as u64,
        ));
        limits
            .get_or_create(&l)
            .set(milli(e.iter().map(|e| u64::from(e.limit.get())).sum()));
        memory.get_or_create(&l).set(to_i64(g.memory));
        held.get_or_create(&l).set(i64::from(g.held_by.is_some()));
        allocated
            .get_or_create(&l)
            .set(to_i64(e.iter().map(|e| e.gpu_mem).sum()));
        if supervised {
            let p = procs.get(&g.uuid);
            up.get_or_create(&l)
                .set(i64::from(p.is_some_and(|p| p.running)));
            restarts
                .get_or_create(&l)
                .inc_by(p.map_or(0, |p| p.restarts));
        }
    }
    reg.register(
        "gpu_pods",
        "Pods and DRA claims placed on the GPU (time-shared ones in its resource-config, plus whole-GPU ones)",
        pods,
    );
    reg.register(
        "gpu_requested_share",
        "Sum of the guaranteed shares (gpu_request) of the GPU's pods and claims, in GPUs",
        requested,
    );
    reg.register(
        "gpu_limit_share",
        "Sum of the share ceilings (gpu_limit) of the GPU's time-shared pods, in GPUs",
        limits,
    );
    reg.register_with_unit("gpu_memory", "Total memory of the GPU", Unit::Bytes, memory);
    reg.register(
        "gpu_held_by_device_plugin",
        "1 while the kubelet has given the GPU whole to a pod through another device plugin (nvidia.com/gpu)",
        held,
    );
    reg.register_with_unit(
        "gpu_allocated_memory",
        "Sum of the memory caps of the GPU's time-shared pods",
        Unit::Bytes,
        allocated,
    );
    if supervised {
        reg.register("gem_schd_up", "1 when the GPU's gem-schd is running", up);
        reg.register(
            "gem_schd_restarts",
            "Times the GPU's gem-schd was started again after it died",
            restarts,
        );
    }
}

/// Per GPU: what the prepared DRA claims hold of it, named as the extender's
/// `kubeshare_gpu_claims` and kin, which say it from the allocations (shares here in GPUs).
fn register_claims(reg: &mut Registry, s: &Snapshot) {
    let Some(claims) = &s.claims else {
        return;
    };
    let per_gpu = claimed_per_gpu(claims.values());
    let count = Family::<GpuLabels, Gauge>::default();
    let share = Family::<GpuLabels, FGauge>::default();
    let memory = Family::<GpuLabels, Gauge>::default();
    for g in &s.inventory.gpus {
        let l = gpu_labels(s, g);
        let c = per_gpu.get(&g.uuid).copied().unwrap_or_default();
        count.get_or_create(&l).set(i64::from(c.claims));
        share.get_or_create(&l).set(f64::from(c.milli) / 1000.0);
        memory.get_or_create(&l).set(to_i64(c.memory));
    }
    reg.register(
        "gpu_claims",
        "DRA ResourceClaims of gpu.kubeshare.io prepared on this node with a share of the GPU",
        count,
    );
    reg.register(
        "gpu_claimed_share",
        "Sum of the guaranteed shares (booked compute) of the GPU's prepared claims, in GPUs (1.0 for a whole GPU)",
        share,
    );
    reg.register_with_unit(
        "gpu_memory_claimed",
        "Sum of the GPU memory the GPU's prepared claims book (in unified-memory mode the resident share)",
        Unit::Bytes,
        memory,
    );
}

fn node_gauge(s: &Snapshot, v: u64) -> Family<NodeLabels, Gauge> {
    let f = Family::<NodeLabels, Gauge>::default();
    f.get_or_create(&NodeLabels {
        node: s.node.clone(),
    })
    .set(to_i64(v));
    f
}

fn node_counter(s: &Snapshot, v: u64) -> Family<NodeLabels, Counter> {
    let f = Family::<NodeLabels, Counter>::default();
    f.get_or_create(&NodeLabels {
        node: s.node.clone(),
    })
    .inc_by(v);
    f
}

/// The daemon's own work: sync state and counters.
fn register_node(reg: &mut Registry, s: &Snapshot) {
    let c = &s.counters;
    reg.register(
        "synced",
        "1 once the first list of the node's pods is in",
        node_gauge(s, u64::from(s.synced)),
    );
    reg.register(
        "rejected_pods",
        "Pods with an allocation on this node that could not be configured",
        node_gauge(s, s.desired.problems.len() as u64),
    );
    reg.register(
        "reconciles",
        "Reconcile passes",
        node_counter(s, c.reconciles),
    );
    reg.register(
        "config_writes",
        "resource-config files written",
        node_counter(s, c.config_writes),
    );
    reg.register(
        "errors",
        "Failed reconcile or publish steps",
        node_counter(s, c.errors),
    );
    reg.register(
        "inventory_patches",
        "Patches of the Node's inventory labels and annotation",
        node_counter(s, c.inventory_patches),
    );
}

/// GPU use that gem-schd does not gate: refused socket peers, processes it does not know.
fn register_guard(reg: &mut Registry, s: &Snapshot) {
    let c = &s.counters;
    reg.register(
        "refused_socket_peers",
        "Connections to a pod's gem-schd socket refused because the process ran in another pod or none",
        node_counter(s, c.refused_peers),
    );
    if !s.guard.checking {
        return;
    }
    let untracked = Family::<GpuLabels, Gauge>::default();
    for g in &s.inventory.gpus {
        let n = s.guard.untracked.iter().filter(|u| u.gpu == g.uuid).count();
        untracked.get_or_create(&gpu_labels(s, g)).set(n as i64);
    }
    reg.register(
        "untracked_gpu_processes",
        "Processes the driver reports on the GPU that its gem-schd does not know (no hook, or a second driver copy), seen in two checks in a row",
        untracked,
    );
    reg.register(
        "untracked_gpu_pod_evictions",
        "Pods evicted for using a GPU untracked (--evict-untracked-gpu-pods)",
        node_counter(s, c.evictions),
    );
}

/// Per pod: what its record grants it, per GPU it holds, and what gem-schd
/// delivered (token time over its window) and counted (memory).
fn register_pods(reg: &mut Registry, s: &Snapshot, usage: &BTreeMap<String, UsageReport>) {
    let pod_request = Family::<PodLabels, FGauge>::default();
    let pod_limit = Family::<PodLabels, FGauge>::default();
    let pod_mem = Family::<PodLabels, Gauge>::default();
    let pod_delivered = Family::<PodLabels, FGauge>::default();
    let pod_co_run = Family::<PodLabels, FGauge>::default();
    let pod_fill = Family::<PodLabels, FGauge>::default();
    let pod_mem_used = Family::<PodLabels, Gauge>::default();
    for p in &s.desired.placements {
        for gpu in &p.gpus {
            let l = pod_labels(&p.pod_key, gpu);
            if p.whole {
                pod_request.get_or_create(&l).set(1.0);
                pod_limit.get_or_create(&l).set(1.0);
            } else if let Some(e) = entries(s, gpu).iter().find(|e| e.id == p.pod_uid) {
                pod_request
                    .get_or_create(&l)
                    .set(f64::from(e.request.get()) / 1000.0);
                pod_limit
                    .get_or_create(&l)
                    .set(f64::from(e.limit.get()) / 1000.0);
                pod_mem.get_or_create(&l).set(to_i64(e.gpu_mem));
                if let Some(r) = usage.get(gpu)
                    && let Some(c) = r.client(&p.pod_uid)
                {
                    pod_delivered.get_or_create(&l).set(c.share(r.window_us));
                    pod_co_run.get_or_create(&l).set(c.co_share(r.window_us));
                    if let Some(f) = c.fill() {
                        pod_fill.get_or_create(&l).set(f);
                    }
                    pod_mem_used.get_or_create(&l).set(to_i64(c.mem_used));
                }
            }
        }
    }
    reg.register(
        "gpu_request_share",
        "The pod's guaranteed share of the GPU (its record's granted request)",
        pod_request,
    );
    reg.register(
        "gpu_limit_share",
        "The pod's share ceiling on the GPU (its record's granted limit)",
        pod_limit,
    );
    reg.register_with_unit(
        "gpu_memory_cap",
        "The pod's GPU memory cap (time-shared pods)",
        Unit::Bytes,
        pod_mem,
    );
    reg.register(
        "gpu_delivered_share",
        "Share of gem-schd's window (10 s by default) charged to the pod: the token time it held, less what co-runners took of its turns, plus its co-holds",
        pod_delivered,
    );
    reg.register(
        "gpu_co_run_share",
        "The part of the delivered share charged for running beside the token holder (co-running)",
        pod_co_run,
    );
    reg.register(
        "gpu_fill",
        "How much of its holds the pod's kernels keep the GPU busy (from its hooks' timed launches; while co-running is on)",
        pod_fill,
    );
    reg.register_with_unit(
        "gpu_memory_used",
        "GPU memory gem-schd counts for the pod (all its processes)",
        Unit::Bytes,
        pod_mem_used,
    );
}

/// Per pod: its processes on a GPU that gem-schd does not know.
fn register_pod_guard(reg: &mut Registry, s: &Snapshot) {
    if !s.guard.checking {
        return;
    }
    let fam = Family::<PodLabels, Gauge>::default();
    for u in &s.guard.untracked {
        if let Some(key) = &u.pod_key {
            fam.get_or_create(&pod_labels(key, &u.gpu)).inc();
        }
    }
    reg.register(
        "untracked_gpu_processes",
        "The pod's processes on the GPU that gem-schd does not know (no hook, or a second driver copy)",
        fam,
    );
}

/// Labels of a pod (`namespace/name`) on a GPU.
fn pod_labels(pod_key: &str, gpu: &str) -> PodLabels {
    let (namespace, pod) = pod_key.split_once('/').unwrap_or(("", pod_key));
    PodLabels {
        namespace: namespace.to_string(),
        pod: pod.to_string(),
        gpu_uuid: gpu.to_string(),
    }
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::claim::{ClaimDevice, PreparedClaim};
    use crate::reconcile::Placement;
    use kubeshare_api::{ClientClass, GpuInfo, Milli, ResourceConfig, ResourceEntry};

    /// A prepared claim with a share (`gpu`, thousandths, booked bytes) of each GPU.
    fn claim(uid: &str, shares: &[(String, u16, u64)]) -> PreparedClaim {
        PreparedClaim {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            pod_uid: format!("pod-{uid}"),
            pod_name: uid.into(),
            devices: shares
                .iter()
                .map(|(gpu, milli, mem)| ClaimDevice {
                    request: "gpu".into(),
                    pool: "nd-n".into(),
                    device: "gpu-0".into(),
                    share_id: None,
                    gpu_uuid: gpu.clone(),
                    gpu_index: 0,
                    request_milli: *milli,
                    limit_milli: *milli,
                    memory_cap: *mem,
                    um_resident: None,
                    priority: Some(0),
                })
                .collect(),
            client: String::new(),
            pods: vec![],
            whole: false,
        }
    }

    #[test]
    fn per_gpu_figures() {
        let gpu = |i: u32| format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd");
        let inventory = NodeInventory {
            gpus: (0..2)
                .map(|i| GpuInfo {
                    uuid: gpu(i),
                    index: i,
                    model: "M".into(),
                    memory: 1000,
                    numa_node: None,
                    nvlink_peers: vec![],
                    held_by: None,
                })
                .collect(),
        };
        let entry = |id: &str, r: u16, l: u16, m: u64| ResourceEntry {
            id: id.into(),
            request: Milli::new(r).unwrap(),
            limit: Milli::new(l).unwrap(),
            gpu_mem: m,
            class: ClientClass::Guaranteed,
        };
        let mut desired = Desired::default();
        desired.configs.insert(
            gpu(0),
            ResourceConfig {
                entries: vec![entry("a", 250, 500, 100), entry("b", 500, 1000, 300)],
            },
        );
        desired.configs.insert(gpu(1), ResourceConfig::default());
        desired.whole.insert(gpu(1), vec!["w".into()]);
        desired.placements = vec![
            Placement {
                pod_uid: "b".into(),
                pod_key: "ns1/train".into(),
                gpus: vec![gpu(0)],
                whole: false,
            },
            Placement {
                pod_uid: "w".into(),
                pod_key: "ns2/big".into(),
                gpus: vec![gpu(1)],
                whole: true,
            },
        ];
        let s = Snapshot {
            node: "nd-n".into(),
            synced: true,
            inventory,
            desired,
            counters: Counters {
                reconciles: 7,
                refused_peers: 2,
                ..Counters::default()
            },
            guard: GuardView {
                checking: true,
                untracked: vec![
                    crate::guard::Untracked {
                        gpu: gpu(0),
                        pid: 42,
                        pod_uid: Some("b".into()),
                        pod_key: Some("ns1/train".into()),
                    },
                    crate::guard::Untracked {
                        gpu: gpu(0),
                        pid: 43,
                        pod_uid: None,
                        pod_key: None,
                    },
                ],
            },
            claims: Some(BTreeMap::from([
                ("c1".to_string(), claim("c1", &[(gpu(0), 200, 500)])),
                (
                    "c2".to_string(),
                    claim("c2", &[(gpu(0), 100, 250), (gpu(1), 1000, 1000)]),
                ),
            ])),
        };
        let procs = BTreeMap::from([(
            gpu(0),
            ProcStat {
                running: true,
                pid: Some(1),
                restarts: 3,
            },
        )]);
        let usage = BTreeMap::from([(
            gpu(0),
            UsageReport {
                window_us: 10_000_000,
                at_us: 1,
                clients: vec![kubeshare_api::ClientUsage {
                    id: "b".into(),
                    used_us: 4_800_000,
                    mem_used: 123,
                    fill_milli: Some(312),
                    co_used_us: 2_500_000,
                    pids: vec![],
                }],
                refused: vec![],
            },
        )]);
        let text = render(&s, &procs, true, &usage);
        let l0 = format!("{{node=\"nd-n\",gpu=\"{}\",index=\"0\"}}", gpu(0));
        let l1 = format!("{{node=\"nd-n\",gpu=\"{}\",index=\"1\"}}", gpu(1));
        for want in [
            format!("kubeshare_node_gpu_pods{l0} 2"),
            format!("kubeshare_node_gpu_pods{l1} 1"),
            format!("kubeshare_node_gpu_requested_share{l0} 0.75"),
            format!("kubeshare_node_gpu_requested_share{l1} 1.0"),
            format!("kubeshare_node_gpu_limit_share{l0} 1.5"),
            format!(
                "kubeshare_pod_gpu_request_share{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 0.5",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_limit_share{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 1.0",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_memory_cap_bytes{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 300",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_request_share{{namespace=\"ns2\",pod=\"big\",gpu_uuid=\"{}\"}} 1.0",
                gpu(1)
            ),
            format!(
                "kubeshare_pod_gpu_delivered_share{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 0.48",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_co_run_share{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 0.25",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_fill{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 0.312",
                gpu(0)
            ),
            format!(
                "kubeshare_pod_gpu_memory_used_bytes{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 123",
                gpu(0)
            ),
            format!("kubeshare_node_gpu_allocated_memory_bytes{l0} 400"),
            format!("kubeshare_node_gpu_memory_bytes{l1} 1000"),
            format!("kubeshare_node_gem_schd_up{l0} 1"),
            format!("kubeshare_node_gem_schd_up{l1} 0"),
            format!("kubeshare_node_gem_schd_restarts_total{l0} 3"),
            "kubeshare_node_reconciles_total{node=\"nd-n\"} 7".to_string(),
            "kubeshare_node_synced{node=\"nd-n\"} 1".to_string(),
            "kubeshare_node_refused_socket_peers_total{node=\"nd-n\"} 2".to_string(),
            format!("kubeshare_node_gpu_claims{l0} 2"),
            format!("kubeshare_node_gpu_claims{l1} 1"),
            format!("kubeshare_node_gpu_claimed_share{l0} 0.3"),
            format!("kubeshare_node_gpu_claimed_share{l1} 1.0"),
            format!("kubeshare_node_gpu_memory_claimed_bytes{l0} 750"),
            format!("kubeshare_node_gpu_memory_claimed_bytes{l1} 1000"),
            format!("kubeshare_node_untracked_gpu_processes{l0} 2"),
            format!("kubeshare_node_untracked_gpu_processes{l1} 0"),
            format!(
                "kubeshare_pod_untracked_gpu_processes{{namespace=\"ns1\",pod=\"train\",gpu_uuid=\"{}\"}} 1",
                gpu(0)
            ),
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "missing {want:?} in\n{text}"
            );
        }
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(!render(&s, &procs, false, &usage).contains("gem_schd"));
        // The process check off: no untracked figures (never a made-up 0).
        let mut off = s.clone();
        off.guard.checking = false;
        assert!(!render(&off, &procs, true, &usage).contains("untracked"));
        // No kubelet plugin: no claim figures; a plugin with no claims: zeros.
        off.claims = None;
        let plain = render(&off, &procs, true, &usage);
        assert!(
            !plain.contains("_gpu_claim") && !plain.contains("_claimed"),
            "{plain}"
        );
        off.claims = Some(BTreeMap::new());
        let none = render(&off, &procs, true, &usage);
        assert!(
            none.lines()
                .any(|l| l == format!("kubeshare_node_gpu_claims{l1} 0")),
            "{none}"
        );
        // No report, no delivered share (never a made-up 0); no fill before one is known.
        let bare = render(&s, &procs, true, &BTreeMap::new());
        assert!(!bare.contains("delivered_share{"), "{bare}");
        assert!(!bare.contains("co_run_share{"), "{bare}");
        let mut unknown = usage.clone();
        if let Some(r) = unknown.get_mut(&gpu(0)) {
            r.clients[0].fill_milli = None;
        }
        assert!(!render(&s, &procs, true, &unknown).contains("gpu_fill{"));
    }
}
