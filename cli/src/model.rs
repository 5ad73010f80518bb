//! Who holds which GPU, computed from Node and Pod objects alone (no I/O).
//!
//! The Node annotation `sharedgpu/inventory` lists a node's GPUs; the allocation
//! annotations the extender writes on a pod at bind say which of them the pod got;
//! the pod's labels (parsed by `kubeshare-api`) say what share it asked for. That is
//! all the state there is, so this view agrees with the extender by construction.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use kubeshare_api::inventory::INVENTORY_ANNOTATION;
use kubeshare_api::{Allocation, GpuDemand, Milli, NodeInventory, is_kubeshare_pod};

/// The whole picture: GPU nodes, pods not on a known GPU, pods not placed yet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterView {
    pub nodes: Vec<NodeView>,
    /// Allocated pods whose node or GPU is not in any published inventory.
    pub stray: Vec<PodShare>,
    /// KubeShare pods that are not placed yet (no allocation), with the reason.
    pub pending: Vec<PendingPod>,
    /// KubeShare pods whose labels or annotations do not parse (the webhook should
    /// have refused them; they were made before it ran, or edited since).
    pub broken: Vec<BrokenPod>,
    /// Nodes that publish no GPU inventory (not shown).
    pub nodes_without_gpus: usize,
    /// Allocated pods that have finished (they hold nothing; not shown).
    pub finished: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    pub gpus: Vec<GpuView>,
    /// Set when the inventory annotation does not parse.
    pub inventory_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory: u64,
    pub pods: Vec<PodShare>,
}

impl GpuView {
    /// Guaranteed shares handed out on this GPU, in thousandths (may exceed 1000
    /// only if something overcommitted it; the view shows that instead of hiding it).
    pub fn requested(&self) -> u32 {
        self.pods.iter().map(|p| u32::from(p.request.get())).sum()
    }

    pub fn mem_allocated(&self) -> u64 {
        // Records are checked one by one, not their sum: never overflow.
        // A unified-memory pod books its resident share, not its ceiling.
        self.pods
            .iter()
            .fold(0u64, |m, p| m.saturating_add(p.resident.unwrap_or(p.mem)))
    }
}

/// One pod's share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodShare {
    pub namespace: String,
    pub name: String,
    pub phase: String,
    pub request: Milli,
    pub limit: Milli,
    /// Memory cap on this GPU, bytes (in unified-memory mode: the managed ceiling).
    pub mem: u64,
    /// Unified-memory mode: the GPU-resident share booked on this GPU (docs/um.md).
    pub resident: Option<u64>,
    /// Part of a whole-GPU (exclusive) request.
    pub whole: bool,
    /// The GPU's UUID (kept for stray pods, whose GPU is not listed).
    pub gpu_uuid: String,
    pub node: String,
    /// Scheduling tags worth showing: group, affinity, anti-affinity, exclusion.
    pub tags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingPod {
    pub namespace: String,
    pub name: String,
    pub request: Milli,
    pub limit: Milli,
    pub gpus: u16,
    pub whole: bool,
    pub tags: Vec<String>,
    /// The scheduler's message from the PodScheduled condition, if any.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenPod {
    pub namespace: String,
    pub name: String,
    pub error: String,
}

fn is_finished(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed")) || pod.metadata.deletion_timestamp.is_some()
}

fn tags_of(d: &GpuDemand) -> Vec<String> {
    let mut t = Vec::new();
    if let Some(g) = &d.group {
        t.push(format!(
            "group={} (starts at {}/{})",
            g.name,
            g.min_members(),
            g.headcount
        ));
    }
    if let Some(a) = &d.affinity {
        t.push(format!("affinity={a}"));
    }
    if let Some(a) = &d.anti_affinity {
        t.push(format!("anti-affinity={a}"));
    }
    if let Some(e) = &d.exclusion {
        t.push(format!("exclusion={e}"));
    }
    if d.priority > 0 {
        t.push(format!("priority={}", d.priority));
    }
    t
}

fn scheduling_message(pod: &Pod) -> String {
    let cond = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "PodScheduled"));
    match cond {
        Some(c) if c.status == "False" => {
            let reason = c.reason.clone().unwrap_or_default();
            let msg = c.message.clone().unwrap_or_default();
            match (reason.is_empty(), msg.is_empty()) {
                (false, false) => format!("{reason}: {msg}"),
                (false, true) => reason,
                (true, false) => msg,
                (true, true) => "not scheduled yet".into(),
            }
        }
        Some(c) if c.status == "True" => "bound, allocation annotations missing".into(),
        _ => "waiting for the scheduler".into(),
    }
}

/// Builds the view. `nodes` and `pods` may come in any order; the result is sorted
/// (nodes by name, GPUs by index, pods by namespace/name), so equal inputs give
/// equal output.
pub fn build(nodes: &[Node], pods: &[Pod]) -> ClusterView {
    let mut view = ClusterView::default();
    let mut node_views: BTreeMap<String, NodeView> = BTreeMap::new();
    for node in nodes {
        let name = node.metadata.name.clone().unwrap_or_default();
        let Some(raw) = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(INVENTORY_ANNOTATION))
        else {
            view.nodes_without_gpus += 1;
            continue;
        };
        let nv = match NodeInventory::parse(raw) {
            Ok(inv) => {
                let mut gpus: Vec<GpuView> = inv
                    .gpus
                    .into_iter()
                    .map(|g| GpuView {
                        index: g.index,
                        uuid: g.uuid,
                        model: g.model,
                        memory: g.memory,
                        pods: Vec::new(),
                    })
                    .collect();
                gpus.sort_by_key(|g| g.index);
                NodeView {
                    name: name.clone(),
                    gpus,
                    inventory_error: None,
                }
            }
            Err(e) => NodeView {
                name: name.clone(),
                gpus: Vec::new(),
                inventory_error: Some(e.to_string()),
            },
        };
        node_views.insert(name, nv);
    }

    for pod in pods {
        let empty = BTreeMap::new();
        let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
        let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let scheduler = pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref());
        if !is_kubeshare_pod(scheduler, labels) {
            continue;
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let broken = |error: String| BrokenPod {
            namespace: namespace.clone(),
            name: name.clone(),
            error,
        };
        // A bound pod is shown from its allocation record alone (the granted share);
        // the labels say what a pending pod asks for, and its tags.
        let alloc = match Allocation::from_annotations(annotations) {
            Ok(a) => a,
            Err(e) => {
                if !is_finished(pod) {
                    view.broken.push(broken(format!("annotations: {e}")));
                }
                continue;
            }
        };
        let demand = match GpuDemand::from_labels(labels) {
            Ok(d) => d,
            Err(e) => {
                if alloc.is_none() && !is_finished(pod) {
                    view.broken.push(broken(format!("labels: {e}")));
                }
                None
            }
        };
        let tags = demand.as_ref().map(tags_of).unwrap_or_default();
        let resident = alloc.as_ref().and_then(|a| a.gpu_mem_resident);
        let Some(alloc) = alloc else {
            // Names our scheduler but asks for no GPU: nothing to show.
            let Some(demand) = demand else {
                continue;
            };
            if !is_finished(pod) {
                view.pending.push(PendingPod {
                    namespace,
                    name,
                    request: demand.request_per_gpu(),
                    limit: demand.limit_per_gpu(),
                    gpus: demand.gpu_count(),
                    whole: demand.is_whole(),
                    tags,
                    reason: scheduling_message(pod),
                });
            }
            continue;
        };
        if is_finished(pod) {
            view.finished += 1;
            continue;
        }
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_else(|| "Pending".into());
        for uuid in &alloc.gpu_uuids {
            let share = PodShare {
                namespace: namespace.clone(),
                name: name.clone(),
                phase: phase.clone(),
                request: alloc.granted.request_per_gpu(),
                limit: alloc.granted.limit_per_gpu(),
                mem: alloc.gpu_mem,
                resident,
                whole: alloc.granted.is_whole(),
                gpu_uuid: uuid.clone(),
                node: alloc.node.clone(),
                tags: tags.clone(),
            };
            let gpu = node_views
                .get_mut(&alloc.node)
                .and_then(|n| n.gpus.iter_mut().find(|g| &g.uuid == uuid));
            match gpu {
                Some(g) => g.pods.push(share),
                None => view.stray.push(share),
            }
        }
    }

    let key = |ns: &str, n: &str| (ns.to_string(), n.to_string());
    for n in node_views.values_mut() {
        for g in &mut n.gpus {
            g.pods.sort_by_key(|p| key(&p.namespace, &p.name));
        }
    }
    view.nodes = node_views.into_values().collect();
    view.stray
        .sort_by_key(|p| (key(&p.namespace, &p.name), p.gpu_uuid.clone()));
    view.pending.sort_by_key(|p| key(&p.namespace, &p.name));
    view.broken.sort_by_key(|p| key(&p.namespace, &p.name));
    view
}
