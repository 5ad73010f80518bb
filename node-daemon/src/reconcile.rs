//! The node daemon's decisions, free of I/O: from the pods bound to this node, the
//! ResourceClaims its DRA kubelet plugin prepared and the node's GPU inventory, what
//! every GPU's resource-config must say and which pod directories must exist; and from
//! what is on disk, the actions that get there. Pods placed by the extender and
//! prepared claims are entries of the same configs: one set of books per GPU.
//!
//! Everything here is recomputed from scratch on each pass (level-triggered), so a
//! missed watch event, a restart or a hand-edited file is repaired by the next pass.

use std::collections::{BTreeMap, BTreeSet};

use kubeshare_api::resource_config::is_valid_id;
use kubeshare_api::{
    Allocation, ClientClass, GpuDemand, Granted, Milli, NodeInventory, ResourceConfig,
    ResourceEntry,
};

/// What the daemon needs to know of a pod (taken from the API object by the caller).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodView {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
    pub scheduler_name: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// The names of the ResourceClaims (in its namespace) the pod uses.
    pub claims: BTreeSet<String>,
}

impl PodView {
    /// `namespace/name`, for logs and messages.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// A pod that has run to completion holds no GPU any more.
    pub fn is_finished(&self) -> bool {
        matches!(self.phase.as_deref(), Some("Succeeded" | "Failed"))
    }
}

/// A pod that carries an allocation for this node but cannot be configured.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub pod_uid: String,
    pub pod_key: String,
    pub message: String,
}

/// A pod that was configured on this node's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placement {
    pub pod_uid: String,
    pub pod_key: String,
    pub gpus: Vec<String>,
    /// Whole GPUs get no config line and no token scheduling.
    pub whole: bool,
}

/// What the node should look like.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Desired {
    /// One config per GPU of the inventory (empty ones included), entries sorted by pod UID.
    pub configs: BTreeMap<String, ResourceConfig>,
    /// Whole-GPU pods per GPU (they appear in no config, but hold the GPU).
    pub whole: BTreeMap<String, Vec<String>>,
    /// Pod UIDs (and the client IDs of claims that pods share) whose directory
    /// `pods/<uid>/` must exist.
    pub pod_dirs: BTreeSet<String>,
    /// The clients that several pods share (claims not tied to one pod), with the pod
    /// UIDs whose processes their sockets serve: gem-schd's peers files.
    pub peers: BTreeMap<String, BTreeSet<String>>,
    pub placements: Vec<Placement>,
    pub problems: Vec<Problem>,
    /// GPUs whose guaranteed shares add up to more than one GPU (the extender should
    /// never allow it; the configs are still written, gem-schd copes).
    pub overcommitted: Vec<(String, u32)>,
}

/// What a pod amounts to on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PodPlan {
    /// Not ours to configure: no GPU asked for or none allocated, or it has finished.
    Ignore,
    Shared {
        gpus: Vec<String>,
        request: Milli,
        limit: Milli,
        mem: u64,
        class: ClientClass,
    },
    Whole {
        gpus: Vec<String>,
    },
    Bad(String),
}

fn plan(node: &str, inventory: &NodeInventory, pod: &PodView) -> PodPlan {
    if pod.node_name.as_deref() != Some(node) || pod.is_finished() {
        return PodPlan::Ignore;
    }
    let alloc = match Allocation::from_annotations(&pod.annotations) {
        Ok(Some(a)) => a,
        Ok(None) => {
            // A KubeShare pod bound here without the extender (spec.nodeName set by hand,
            // or the default scheduler) got no GPU: say so rather than run it unshared.
            let asks = matches!(GpuDemand::from_labels(&pod.labels), Ok(Some(_)));
            return if asks {
                PodPlan::Bad(format!(
                    "bound to {node} without a GPU allocation (annotation {} missing): was it placed by kubeshare-scheduler?",
                    kubeshare_api::annotations::GPU_UUID
                ))
            } else {
                PodPlan::Ignore
            };
        }
        Err(e) => return PodPlan::Bad(format!("bad allocation: {e}")),
    };
    if alloc.node != node {
        return PodPlan::Bad(format!(
            "allocation is for node {:?} but the pod is bound to {node}",
            alloc.node
        ));
    }
    let ours = kubeshare_api::scheduler_name();
    if pod.scheduler_name.as_deref() != Some(ours) {
        // Only our scheduler's Bindings write a record: this one is forged.
        return PodPlan::Bad(format!(
            "has an allocation record but was not scheduled by {ours}: not configured"
        ));
    }
    if !is_valid_id(&pod.uid) {
        return PodPlan::Bad(format!("pod UID {:?} cannot be a client ID", pod.uid));
    }
    // The record alone says what the pod holds: its labels are not read for it (the record
    // is what was checked). The class is not in the record: it comes from
    // `sharedgpu/priority`, which admission keeps as it was at creation.
    for u in &alloc.gpu_uuids {
        if inventory.gpu(u).is_none() {
            return PodPlan::Bad(format!("GPU {u} is not a GPU of node {node}"));
        }
    }
    match alloc.granted {
        Granted::Whole => PodPlan::Whole {
            gpus: alloc.gpu_uuids,
        },
        Granted::Fraction { request, limit } => PodPlan::Shared {
            gpus: alloc.gpu_uuids,
            request,
            limit,
            mem: alloc.gpu_mem,
            class: class_of(pod),
        },
    }
}

/// The pod's class in gem-schd: priority 0 (the default) is opportunistic, 1–100 guaranteed.
/// Labels that do not parse (the extender places no such pod, and admission keeps a pod's
/// labels as they were) leave the label's default, 0.
fn class_of(pod: &PodView) -> ClientClass {
    let priority = match GpuDemand::from_labels(&pod.labels) {
        Ok(Some(d)) => d.priority,
        Ok(None) | Err(_) => 0,
    };
    ClientClass::of_priority(priority)
}

/// A ResourceClaim of driver `gpu.kubeshare.io` prepared on this node: one more
/// client of each GPU it holds a share of. A claim made for one pod (from its template)
/// has that pod's UID as its client ID, so its sockets live in the pod's directory, as a
/// labelled pod's do. A claim that pods may share has its own UID as client ID: one
/// client, one directory, one token and memory budget for all its pods, and a peers
/// file that tells gem-schd which pods' processes to serve there (it checks that a
/// process on a socket runs in the socket's pod): the pods it was reserved for when
/// prepared and the pods on this node that use it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimShare {
    /// `namespace/name` of the claim, for messages.
    pub claim_key: String,
    /// The claim's namespace and name, to find the pods that use it.
    pub namespace: String,
    pub name: String,
    /// gem-schd's client ID and the name of the claim's socket directory.
    pub client: String,
    /// The pods the claim was reserved for when prepared (UIDs).
    pub pods: Vec<String>,
    /// The first of them, and its `namespace/name`, for messages and events.
    pub pod_uid: String,
    pub pod_key: String,
    pub gpus: Vec<ClaimGpu>,
    /// Whole GPUs (all of each GPU's time and memory, no limit to enforce): booked as
    /// a whole-GPU labelled pod is, in no config line and with no token scheduling.
    pub whole: bool,
}

/// A claim's share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimGpu {
    pub uuid: String,
    pub request: Milli,
    pub limit: Milli,
    /// The memory cap gem-schd enforces, bytes.
    pub mem: u64,
    /// From the claim's `priority` as from a labelled pod's ([`ClientClass::of_priority`]).
    pub class: ClientClass,
}

/// The desired state of node `node` with GPUs `inventory`, given the pods bound to it.
pub fn desired(node: &str, inventory: &NodeInventory, pods: &[PodView]) -> Desired {
    desired_with_claims(node, inventory, pods, &[])
}

/// Why a prepared claim cannot be configured, if it cannot: its pod UID is no client
/// ID, a GPU is gone from the node, or its pod is already configured through labels.
fn claim_problem(
    node: &str,
    inventory: &NodeInventory,
    labelled: &BTreeSet<String>,
    claim: &ClaimShare,
) -> Option<String> {
    if !is_valid_id(&claim.client) {
        return Some(format!(
            "ResourceClaim {}: {:?} cannot be a client ID",
            claim.claim_key, claim.client
        ));
    }
    if labelled.contains(&claim.client) || claim.pods.iter().any(|p| labelled.contains(p)) {
        return Some(format!(
            "has sharedgpu labels and ResourceClaim {} of {}: one pod gets its share one way; the claim is not configured",
            claim.claim_key,
            kubeshare_api::dra::DRIVER_NAME
        ));
    }
    claim
        .gpus
        .iter()
        .find(|g| inventory.gpu(&g.uuid).is_none())
        .map(|g| {
            format!(
                "ResourceClaim {}: GPU {} is not a GPU of node {node}",
                claim.claim_key, g.uuid
            )
        })
}

/// The pods whose processes the sockets of shared claim `claim` serve: those it was
/// reserved for when prepared, and those on `node` that use it now (a pod that joins a
/// prepared claim is not prepared again: the kubelet calls the plugin once per claim).
fn claim_pods(node: &str, pods: &[PodView], claim: &ClaimShare) -> BTreeSet<String> {
    let using = pods.iter().filter(|p| {
        p.node_name.as_deref() == Some(node)
            && !p.is_finished()
            && p.namespace == claim.namespace
            && p.claims.contains(&claim.name)
    });
    claim
        .pods
        .iter()
        .cloned()
        .chain(using.map(|p| p.uid.clone()))
        .filter(|u| is_valid_id(u))
        .collect()
}

/// [`desired`] with the claims the DRA kubelet plugin prepared as more entries of the
/// same configs. A claim whose pod already holds an entry on the same GPU (another
/// claim of the pod) is reported, not configured twice.
pub fn desired_with_claims(
    node: &str,
    inventory: &NodeInventory,
    pods: &[PodView],
    claims: &[ClaimShare],
) -> Desired {
    let mut d = Desired {
        configs: inventory
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), ResourceConfig::default()))
            .collect(),
        ..Desired::default()
    };
    for pod in pods {
        let placed = |gpus: &Vec<String>, whole| Placement {
            pod_uid: pod.uid.clone(),
            pod_key: pod.key(),
            gpus: gpus.clone(),
            whole,
        };
        match plan(node, inventory, pod) {
            PodPlan::Ignore => {}
            PodPlan::Bad(message) => d.problems.push(Problem {
                pod_uid: pod.uid.clone(),
                pod_key: pod.key(),
                message,
            }),
            PodPlan::Whole { gpus } => {
                for g in &gpus {
                    d.whole.entry(g.clone()).or_default().push(pod.uid.clone());
                }
                d.pod_dirs.insert(pod.uid.clone());
                d.placements.push(placed(&gpus, true));
            }
            PodPlan::Shared {
                gpus,
                request,
                limit,
                mem,
                class,
            } => {
                for g in &gpus {
                    // Every GPU was checked against the inventory, so the config exists.
                    if let Some(c) = d.configs.get_mut(g) {
                        c.entries.push(ResourceEntry {
                            id: pod.uid.clone(),
                            request,
                            limit,
                            gpu_mem: mem,
                            class,
                        });
                    }
                }
                d.pod_dirs.insert(pod.uid.clone());
                d.placements.push(placed(&gpus, false));
            }
        }
    }
    let labelled = d.pod_dirs.clone();
    let mut claimed: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut claims: Vec<&ClaimShare> = claims.iter().collect();
    // The same claims in any order give the same books.
    claims.sort_by(|a, b| a.claim_key.cmp(&b.claim_key));
    for claim in claims {
        let problem = claim_problem(node, inventory, &labelled, claim).or_else(|| {
            claim
                .gpus
                .iter()
                .find(|g| claimed.contains(&(claim.client.as_str(), g.uuid.as_str())))
                .map(|g| {
                    format!(
                        "ResourceClaim {}: the pod already has a share of GPU {} through another claim; not configured",
                        claim.claim_key, g.uuid
                    )
                })
        });
        if let Some(message) = problem {
            d.problems.push(Problem {
                pod_uid: claim.pod_uid.clone(),
                pod_key: claim.pod_key.clone(),
                message,
            });
            continue;
        }
        if claim.whole {
            // As a whole-GPU labelled pod: it holds the GPUs, gem-schd does not know it,
            // and its containers get no hook, so no socket directory either.
            for g in &claim.gpus {
                claimed.insert((claim.client.as_str(), g.uuid.as_str()));
                d.whole
                    .entry(g.uuid.clone())
                    .or_default()
                    .push(claim.client.clone());
            }
            d.placements.push(Placement {
                pod_uid: claim.pod_uid.clone(),
                pod_key: claim.pod_key.clone(),
                gpus: claim.gpus.iter().map(|g| g.uuid.clone()).collect(),
                whole: true,
            });
            continue;
        }
        for g in &claim.gpus {
            claimed.insert((claim.client.as_str(), g.uuid.as_str()));
            if let Some(c) = d.configs.get_mut(&g.uuid) {
                c.entries.push(ResourceEntry {
                    id: claim.client.clone(),
                    request: g.request,
                    limit: g.limit,
                    gpu_mem: g.mem,
                    class: g.class,
                });
            }
        }
        d.pod_dirs.insert(claim.client.clone());
        if claim.client != claim.pod_uid {
            d.peers
                .insert(claim.client.clone(), claim_pods(node, pods, claim));
        }
        d.placements.push(Placement {
            pod_uid: claim.pod_uid.clone(),
            pod_key: claim.pod_key.clone(),
            gpus: claim.gpus.iter().map(|g| g.uuid.clone()).collect(),
            whole: false,
        });
    }
    for (gpu, c) in &mut d.configs {
        // Stable order: the file changes only when its pods change.
        c.entries.sort_by(|a, b| a.id.cmp(&b.id));
        // The same UID twice can only come from duplicate input; keep one line.
        c.entries.dedup_by(|a, b| a.id == b.id);
        let sum: u32 = c.entries.iter().map(|e| u32::from(e.request.get())).sum();
        if sum > 1000 {
            d.overcommitted.push((gpu.clone(), sum));
        }
    }
    for w in d.whole.values_mut() {
        w.sort();
        w.dedup();
    }
    d.placements.sort();
    d.placements.dedup();
    d.problems.sort();
    d.problems.dedup();
    d.pod_dirs = d.pod_dirs.into_iter().collect();
    d
}

/// What is on disk now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Actual {
    /// Current text of `gpus/<uuid>/resource-config.txt` for each GPU (None: no file).
    pub configs: BTreeMap<String, Option<String>>,
    /// Names of the entries of `pods/` that look like pod UIDs.
    pub pod_dirs: BTreeSet<String>,
    /// The peers files in `peers/`, by client ID, with their text.
    pub peers: BTreeMap<String, String>,
}

/// One change to make on disk.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Create `pods/<uid>/` before the config names the pod, so gem-schd can make its socket.
    CreatePodDir(String),
    WriteConfig {
        gpu: String,
        text: String,
    },
    /// Write gem-schd's peers file of a shared client (before the config names it, so
    /// its socket serves the pods from the start).
    WritePeers {
        client: String,
        text: String,
    },
    /// Remove `pods/<uid>/` and its sockets, after the configs stopped naming the pod.
    RemovePodDir(String),
    /// Remove the peers file of a client gone from the configs.
    RemovePeers(String),
}

/// The text of a peers file: the pod UIDs, one a line.
pub fn peers_text(pods: &BTreeSet<String>) -> String {
    pods.iter().map(|p| format!("{p}\n")).collect()
}

/// Whether a `pods/` entry is one of ours to manage: a pod UID (lowercase 8-4-4-4-12 hex).
/// Anything else there is left alone.
pub fn looks_like_pod_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups.iter().zip([8, 4, 4, 4, 12]).all(|(g, n)| {
            g.len() == n
                && g.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
}

/// The actions that turn `actual` into `desired`, in the order to apply them:
/// directories first, then configs, then removals (a pod leaves the config before its
/// socket directory disappears).
pub fn diff(desired: &Desired, actual: &Actual) -> Vec<Action> {
    let mut actions = Vec::new();
    for uid in desired.pod_dirs.difference(&actual.pod_dirs) {
        actions.push(Action::CreatePodDir(uid.clone()));
    }
    for (client, pods) in &desired.peers {
        let text = peers_text(pods);
        if actual.peers.get(client) != Some(&text) {
            actions.push(Action::WritePeers {
                client: client.clone(),
                text,
            });
        }
    }
    for (gpu, config) in &desired.configs {
        let text = config.render();
        let current = actual.configs.get(gpu).and_then(|t| t.as_deref());
        if current != Some(text.as_str()) {
            actions.push(Action::WriteConfig {
                gpu: gpu.clone(),
                text,
            });
        }
    }
    for uid in actual.pod_dirs.difference(&desired.pod_dirs) {
        if looks_like_pod_uid(uid) {
            actions.push(Action::RemovePodDir(uid.clone()));
        }
    }
    for client in actual.peers.keys() {
        if !desired.peers.contains_key(client) && looks_like_pod_uid(client) {
            actions.push(Action::RemovePeers(client.clone()));
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;

    const NODE: &str = "nd-node-a";

    fn gpu_uuid(i: u32) -> String {
        format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd")
    }

    fn uid(i: u32) -> String {
        format!("0000000{i}-1111-2222-3333-444444444444")
    }

    fn inventory(n: u32) -> NodeInventory {
        NodeInventory {
            gpus: (0..n)
                .map(|i| GpuInfo {
                    uuid: gpu_uuid(i),
                    index: i,
                    model: "NVIDIA-H100-80GB-HBM3".into(),
                    memory: 80 << 30,
                    numa_node: None,
                    nvlink_peers: vec![],
                    held_by: None,
                })
                .collect(),
        }
    }

    /// A pod with these labels and, for `gpus`, the record the extender would
    /// write from them (granted = what the labels asked for at bind).
    fn pod(i: u32, labels: &[(&str, &str)], gpus: &[u32], mem: u64) -> PodView {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
            .collect();
        let mut annotations = BTreeMap::new();
        if !gpus.is_empty() {
            let granted = match GpuDemand::from_labels(&labels) {
                Ok(Some(d)) if d.is_whole() => Granted::Whole,
                Ok(Some(d)) => Granted::Fraction {
                    request: d.request_per_gpu(),
                    limit: d.limit_per_gpu(),
                },
                _ => Granted::Fraction {
                    request: Milli::new(500).unwrap(),
                    limit: Milli::new(500).unwrap(),
                },
            };
            annotations = Allocation {
                node: NODE.into(),
                gpu_uuids: gpus.iter().map(|g| gpu_uuid(*g)).collect(),
                gpu_mem: mem,
                gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
                granted,
                gpu_mem_resident: None,
            }
            .to_annotations();
        }
        PodView {
            uid: uid(i),
            namespace: "nd-test".into(),
            name: format!("p{i}"),
            node_name: Some(NODE.into()),
            phase: Some("Running".into()),
            scheduler_name: Some("kubeshare-scheduler".into()),
            labels,
            annotations,
            claims: BTreeSet::new(),
        }
    }

    fn shared(i: u32, req: &str, lim: &str, gpu: u32) -> PodView {
        pod(
            i,
            &[("gpu_request", req), ("gpu_limit", lim)],
            &[gpu],
            1 << 30,
        )
    }

    #[test]
    fn request_before_limit_sorted_by_uid() {
        let inv = inventory(2);
        // Given out of order: the file is sorted by pod UID.
        let pods = vec![shared(3, "0.2", "0.9", 0), shared(1, "0.3", "0.5", 0)];
        let d = desired(NODE, &inv, &pods);
        assert_eq!(
            d.configs[&gpu_uuid(0)].render(),
            format!(
                "2\n{} 0.3 0.5 1073741824 opportunistic\n{} 0.2 0.9 1073741824 opportunistic\n",
                uid(1),
                uid(3)
            )
        );
        // The other GPU gets an empty config, not no config.
        assert_eq!(d.configs[&gpu_uuid(1)].render(), "0\n");
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(1), uid(3)]));
        assert!(d.problems.is_empty());
        // Same input in another order: the same result.
        let rev: Vec<PodView> = pods.into_iter().rev().collect();
        assert_eq!(desired(NODE, &inv, &rev), d);
    }

    #[test]
    fn priority_0_or_none_is_opportunistic_and_1_to_100_guaranteed() {
        let inv = inventory(1);
        let with_priority = |i, p| {
            pod(
                i,
                &[
                    ("gpu_request", "0.2"),
                    ("gpu_limit", "0.4"),
                    ("priority", p),
                ],
                &[0],
                1 << 30,
            )
        };
        let pods = vec![
            shared(1, "0.2", "0.4", 0),
            with_priority(2, "0"),
            with_priority(3, "1"),
            with_priority(4, "100"),
        ];
        let d = desired(NODE, &inv, &pods);
        let classes: Vec<ClientClass> = d.configs[&gpu_uuid(0)]
            .entries
            .iter()
            .map(|e| e.class)
            .collect();
        assert_eq!(
            classes,
            [
                ClientClass::Opportunistic,
                ClientClass::Opportunistic,
                ClientClass::Guaranteed,
                ClientClass::Guaranteed
            ]
        );
        // Guaranteed lines are Gemini's four columns; opportunistic ones say so.
        assert_eq!(
            d.configs[&gpu_uuid(0)].render(),
            format!(
                "4\n{} 0.2 0.4 1073741824 opportunistic\n{} 0.2 0.4 1073741824 opportunistic\n\
                 {} 0.2 0.4 1073741824\n{} 0.2 0.4 1073741824\n",
                uid(1),
                uid(2),
                uid(3),
                uid(4)
            )
        );
    }

    #[test]
    fn finished_and_deleted_pods_leave() {
        let inv = inventory(1);
        let mut done = shared(2, "0.5", "0.5", 0);
        done.phase = Some("Succeeded".into());
        let mut failed = shared(3, "0.1", "0.5", 0);
        failed.phase = Some("Failed".into());
        let pending = {
            let mut p = shared(4, "0.1", "0.2", 0);
            p.phase = Some("Pending".into());
            p
        };
        let d = desired(
            NODE,
            &inv,
            &[shared(1, "0.2", "0.4", 0), done, failed, pending],
        );
        let ids: Vec<&str> = d.configs[&gpu_uuid(0)]
            .entries
            .iter()
            .map(|e| e.id.as_str())
            .collect();
        // Pending pods are configured before they start (KubeShare only knew Running ones).
        assert_eq!(ids, [uid(1).as_str(), uid(4).as_str()]);
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(1), uid(4)]));

        // Pod 1 deleted: the GPU's config loses its line, and the disk loses the dir.
        let before = Actual {
            configs: BTreeMap::from([(gpu_uuid(0), Some(d.configs[&gpu_uuid(0)].render()))]),
            pod_dirs: d.pod_dirs.clone(),
            peers: BTreeMap::new(),
        };
        let after = desired(NODE, &inv, &[]);
        assert_eq!(
            diff(&after, &before),
            vec![
                Action::WriteConfig {
                    gpu: gpu_uuid(0),
                    text: "0\n".into()
                },
                Action::RemovePodDir(uid(1)),
                Action::RemovePodDir(uid(4)),
            ]
        );
    }

    /// The disk as `d` wants it, with these peers files.
    fn on_disk(d: &Desired, peers: BTreeMap<String, String>) -> Actual {
        Actual {
            configs: d
                .configs
                .iter()
                .map(|(g, c)| (g.clone(), Some(c.render())))
                .collect(),
            pod_dirs: d.pod_dirs.clone(),
            peers,
        }
    }

    #[test]
    fn diff_is_empty_when_disk_matches() {
        let inv = inventory(2);
        let d = desired(NODE, &inv, &[shared(1, "0.2", "0.4", 1)]);
        let actual = on_disk(&d, BTreeMap::new());
        assert!(diff(&d, &actual).is_empty());
        // Missing files and dirs are created, dirs before configs.
        let acts = diff(&d, &Actual::default());
        assert_eq!(acts[0], Action::CreatePodDir(uid(1)));
        assert_eq!(acts.len(), 3);
    }

    #[test]
    fn foreign_entries_in_pods_dir_are_left_alone() {
        let actual = Actual {
            configs: BTreeMap::new(),
            pod_dirs: BTreeSet::from([
                "lost+found".into(),
                uid(7),
                "ABCDEF00-1111-2222-3333-444444444444".into(),
            ]),
            peers: BTreeMap::new(),
        };
        assert_eq!(
            diff(&Desired::default(), &actual),
            vec![Action::RemovePodDir(uid(7))]
        );
    }

    #[test]
    fn whole_and_multi_gpu_pods() {
        let inv = inventory(4);
        let whole = pod(
            1,
            &[("gpu_request", "2"), ("gpu_limit", "2")],
            &[2, 3],
            80 << 30,
        );
        let halves = pod(
            2,
            &[
                ("gpu_request", "0.5"),
                ("gpu_limit", "1.0"),
                ("gpu_count", "2"),
            ],
            &[0, 1],
            1 << 30,
        );
        let d = desired(NODE, &inv, &[whole, halves]);
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        assert_eq!(d.configs[&gpu_uuid(2)].render(), "0\n");
        assert_eq!(d.whole[&gpu_uuid(3)], vec![uid(1)]);
        for g in [0, 1] {
            assert_eq!(
                d.configs[&gpu_uuid(g)].render(),
                format!("1\n{} 0.5 1.0 1073741824 opportunistic\n", uid(2))
            );
        }
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(1), uid(2)]));
        assert_eq!(d.placements.len(), 2);
        assert!(d.placements[0].whole);
    }

    #[test]
    fn bad_pods_are_reported_not_configured() {
        let inv = inventory(2);
        let mut wrong_node = shared(1, "0.5", "0.5", 0);
        wrong_node
            .annotations
            .insert("sharedgpu/node".into(), "elsewhere".into());
        let mut bad_mem = shared(2, "0.5", "0.5", 0);
        bad_mem
            .annotations
            .insert("sharedgpu/gpu_mem".into(), "lots".into());
        let mut bad_uuid = shared(3, "0.5", "0.5", 0);
        bad_uuid
            .annotations
            .insert("sharedgpu/gpu_uuid".into(), "GPU-nope".into());
        let foreign_gpu = {
            let mut p = shared(4, "0.5", "0.5", 0);
            p.annotations.insert(
                "sharedgpu/gpu_uuid".into(),
                "GPU-99999999-aaaa-bbbb-cccc-dddddddddddd".into(),
            );
            p
        };
        let mut swapped = pod(5, &[("gpu_request", "0.9"), ("gpu_limit", "1.0")], &[0], 1);
        swapped
            .annotations
            .insert("sharedgpu/granted_limit".into(), "0.5".into());
        let unallocated = pod(6, &[("gpu_request", "0.5"), ("gpu_limit", "0.5")], &[], 1);
        // Review finding (forged annotation): a record on a pod that the default
        // scheduler placed.
        let mut forged = pod(7, &[], &[0], 1);
        forged.scheduler_name = Some("default-scheduler".into());
        let mut count_mismatch = pod(
            8,
            &[("gpu_request", "0.5"), ("gpu_limit", "0.5")],
            &[0, 1],
            1,
        );
        count_mismatch
            .annotations
            .insert("sharedgpu/granted_request".into(), "3".into());
        let twice = {
            let mut p = pod(
                9,
                &[
                    ("gpu_request", "0.1"),
                    ("gpu_limit", "0.5"),
                    ("gpu_count", "2"),
                ],
                &[0, 1],
                1,
            );
            p.annotations.insert(
                "sharedgpu/gpu_uuid".into(),
                format!("{},{}", gpu_uuid(0), gpu_uuid(0)),
            );
            p
        };
        // A plain pod on the node is none of our business.
        let plain = pod(0, &[], &[], 0);
        let good = shared(1, "0.25", "0.5", 1);
        let good = PodView {
            uid: "00000001-aaaa-2222-3333-444444444444".into(),
            ..good
        };
        let pods = vec![
            wrong_node,
            bad_mem,
            bad_uuid,
            foreign_gpu,
            swapped,
            unallocated,
            forged,
            count_mismatch,
            twice,
            plain,
            good.clone(),
        ];
        let d = desired(NODE, &inv, &pods);
        let msgs: Vec<String> = d
            .problems
            .iter()
            .map(|p| format!("{} {}", p.pod_key, p.message))
            .collect();
        assert_eq!(msgs.len(), 9, "{msgs:#?}");
        let expect = [
            "nd-test/p1 allocation is for node \"elsewhere\" but the pod is bound to nd-node-a",
            "nd-test/p2 bad allocation: annotation sharedgpu/gpu_mem=\"lots\": not a byte count",
            "nd-test/p3 bad allocation: annotation sharedgpu/gpu_uuid=\"GPU-nope\": not a list of GPU UUIDs",
            "nd-test/p4 GPU GPU-99999999-aaaa-bbbb-cccc-dddddddddddd is not a GPU of node nd-node-a",
            "nd-test/p6 bound to nd-node-a without a GPU allocation (annotation sharedgpu/gpu_uuid missing): was it placed by kubeshare-scheduler?",
            "nd-test/p5 bad allocation: annotation sharedgpu/granted_limit=\"0.5\": below the granted request",
            "nd-test/p7 has an allocation record but was not scheduled by kubeshare-scheduler: not configured",
            "nd-test/p8 bad allocation: annotation sharedgpu/granted_request=\"3\": a whole-GPU grant must be the number of GPU UUIDs (2 or more)",
            "nd-test/p9 bad allocation: annotation sharedgpu/gpu_uuid=\"GPU-00000000-aaaa-bbbb-cccc-dddddddddddd,GPU-00000000-aaaa-bbbb-cccc-dddddddddddd\": a GPU is listed twice",
        ];
        for e in expect {
            assert!(msgs.iter().any(|m| m == e), "missing {e:?} in {msgs:#?}");
        }
        // Only the good pod is configured.
        assert_eq!(d.pod_dirs, BTreeSet::from([good.uid.clone()]));
        assert_eq!(d.configs[&gpu_uuid(0)].render(), "0\n");
        assert_eq!(
            d.configs[&gpu_uuid(1)].render(),
            format!("1\n{} 0.25 0.5 1073741824 opportunistic\n", good.uid)
        );
    }

    #[test]
    fn other_nodes_pods_and_overcommit() {
        let inv = inventory(1);
        let mut elsewhere = shared(1, "0.5", "0.5", 0);
        elsewhere.node_name = Some("nd-node-b".into());
        let d = desired(
            NODE,
            &inv,
            &[
                elsewhere,
                shared(2, "0.6", "0.6", 0),
                shared(3, "0.5", "1.0", 0),
            ],
        );
        assert!(d.problems.is_empty());
        assert_eq!(d.configs[&gpu_uuid(0)].entries.len(), 2);
        assert_eq!(d.overcommitted, vec![(gpu_uuid(0), 1100)]);
    }

    fn claim(key: &str, pod: u32, gpus: &[(u32, u16, u16, u64)]) -> ClaimShare {
        ClaimShare {
            claim_key: format!("nd-test/{key}"),
            namespace: "nd-test".into(),
            name: key.into(),
            client: uid(pod),
            pods: vec![uid(pod)],
            pod_uid: uid(pod),
            pod_key: format!("nd-test/p{pod}"),
            gpus: gpus
                .iter()
                .map(|&(g, request, limit, mem)| ClaimGpu {
                    uuid: gpu_uuid(g),
                    request: Milli::new(request).unwrap(),
                    limit: Milli::new(limit).unwrap(),
                    mem,
                    class: ClientClass::Guaranteed,
                })
                .collect(),
            whole: false,
        }
    }

    #[test]
    fn a_whole_gpu_claim_holds_its_gpu_without_a_config_line() {
        let inv = inventory(2);
        let mut whole = claim("w", 4, &[(1, 1000, 1000, 80 << 30)]);
        whole.whole = true;
        let shared = claim("s", 5, &[(0, 300, 600, 2 << 30)]);
        let d = desired_with_claims(NODE, &inv, &[], &[whole, shared]);
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        assert_eq!(d.configs[&gpu_uuid(1)].render(), "0\n");
        assert_eq!(d.whole[&gpu_uuid(1)], vec![uid(4)]);
        // No hook, so no socket directory; the shared claim's pod has one.
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(5)]));
        let w = d.placements.iter().find(|p| p.pod_uid == uid(4)).unwrap();
        assert!(w.whole);
        // The slice and the prepare check count it as all of the GPU.
        let used = crate::dra::slice::label_use(&d);
        assert_eq!(used[&gpu_uuid(1)].0, 1000);
    }

    #[test]
    fn a_claim_pods_share_is_one_client_whose_peers_are_its_pods() {
        let inv = inventory(1);
        // Claim "team" (client: its own UID, 9) was reserved for pods 1 and 2 when
        // prepared; pod 3 joined it later, pod 4 uses another claim, pod 5 has finished.
        let mut team = claim("team", 1, &[(0, 400, 800, 4 << 30)]);
        team.client = uid(9);
        team.pods = vec![uid(1), uid(2)];
        let using = |i: u32, claim: &str| PodView {
            claims: BTreeSet::from([claim.to_string()]),
            ..pod(i, &[], &[], 0)
        };
        let mut done = using(5, "team");
        done.phase = Some("Succeeded".into());
        let mut elsewhere = using(6, "team");
        elsewhere.namespace = "other".into();
        let pods = vec![using(3, "team"), using(4, "solo"), done, elsewhere];
        let d = desired_with_claims(NODE, &inv, &pods, std::slice::from_ref(&team));
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        // One line, one socket directory: one token and one memory budget.
        assert_eq!(
            d.configs[&gpu_uuid(0)].render(),
            format!("1\n{} 0.4 0.8 4294967296\n", uid(9))
        );
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(9)]));
        assert_eq!(
            d.peers,
            BTreeMap::from([(uid(9), BTreeSet::from([uid(1), uid(2), uid(3)]))])
        );
        // On disk: the peers file before the config, and it goes with the claim.
        let acts = diff(&d, &Actual::default());
        let text = format!("{}\n{}\n{}\n", uid(1), uid(2), uid(3));
        let peers_at = acts
            .iter()
            .position(|a| {
                *a == Action::WritePeers {
                    client: uid(9),
                    text: text.clone(),
                }
            })
            .expect("peers written");
        let config_at = acts
            .iter()
            .position(|a| matches!(a, Action::WriteConfig { .. }))
            .unwrap();
        assert!(peers_at < config_at, "{acts:?}");
        let actual = on_disk(&d, BTreeMap::from([(uid(9), text)]));
        assert!(diff(&d, &actual).is_empty());
        let gone = diff(&desired(NODE, &inv, &pods), &actual);
        assert!(gone.contains(&Action::RemovePeers(uid(9))), "{gone:?}");
        assert!(gone.contains(&Action::RemovePodDir(uid(9))), "{gone:?}");
        // A claim of one pod's own has no peers file: its socket is the pod's.
        let solo = claim("solo", 4, &[(0, 100, 100, 1 << 30)]);
        let d = desired_with_claims(NODE, &inv, &pods, &[solo]);
        assert!(d.peers.is_empty());
        // A pod of the shared claim that also has labels: the claim is not configured.
        let team_labelled = ClaimShare {
            pods: vec![uid(1), uid(7)],
            ..team
        };
        let d = desired_with_claims(NODE, &inv, &[shared(7, "0.1", "0.1", 0)], &[team_labelled]);
        assert_eq!(d.problems.len(), 1, "{:?}", d.problems);
    }

    #[test]
    fn prepared_claims_are_entries_beside_labelled_pods() {
        // The labelled pod has no priority (opportunistic); claims are guaranteed.
        let inv = inventory(2);
        let pods = vec![shared(1, "0.2", "0.4", 0)];
        let claims = vec![
            claim("c5", 5, &[(0, 300, 600, 2 << 30)]),
            claim("c3", 3, &[(0, 100, 1000, 1 << 30), (1, 100, 1000, 1 << 30)]),
        ];
        let d = desired_with_claims(NODE, &inv, &pods, &claims);
        assert!(d.problems.is_empty(), "{:?}", d.problems);
        assert_eq!(
            d.configs[&gpu_uuid(0)].render(),
            format!(
                "3\n{} 0.2 0.4 1073741824 opportunistic\n{} 0.1 1.0 1073741824\n{} 0.3 0.6 2147483648\n",
                uid(1),
                uid(3),
                uid(5)
            )
        );
        assert_eq!(
            d.configs[&gpu_uuid(1)].render(),
            format!("1\n{} 0.1 1.0 1073741824\n", uid(3))
        );
        assert_eq!(d.pod_dirs, BTreeSet::from([uid(1), uid(3), uid(5)]));
        assert_eq!(d.placements.len(), 3);
        // The claims in another order: the same books.
        let rev: Vec<ClaimShare> = claims.iter().rev().cloned().collect();
        assert_eq!(desired_with_claims(NODE, &inv, &pods, &rev), d);
        // Without the claims: the labelled pod alone, and the claims' dirs go.
        let without = desired(NODE, &inv, &pods);
        let actual = on_disk(&d, BTreeMap::new());
        let acts = diff(&without, &actual);
        assert!(acts.contains(&Action::RemovePodDir(uid(3))), "{acts:?}");
        assert!(acts.contains(&Action::RemovePodDir(uid(5))), "{acts:?}");
        assert!(!acts.contains(&Action::RemovePodDir(uid(1))), "{acts:?}");
    }

    #[test]
    fn claims_that_cannot_be_configured_are_reported() {
        let inv = inventory(1);
        let pods = vec![shared(1, "0.2", "0.4", 0)];
        let mut bad_uid = claim("c9", 9, &[(0, 100, 100, 1)]);
        bad_uid.client = "a b".into();
        let claims = vec![
            // The labelled pod also claims: the labels win.
            claim("c1", 1, &[(0, 100, 100, 1)]),
            // A GPU the node no longer has.
            claim("c2", 2, &[(7, 100, 100, 1)]),
            // Two claims of one pod on one GPU: the first (by name) is configured.
            claim("c3a", 3, &[(0, 100, 200, 1)]),
            claim("c3b", 3, &[(0, 300, 300, 1)]),
            bad_uid,
        ];
        let d = desired_with_claims(NODE, &inv, &pods, &claims);
        let msgs: Vec<String> = d.problems.iter().map(|p| p.message.clone()).collect();
        assert_eq!(msgs.len(), 4, "{msgs:#?}");
        for want in [
            "has sharedgpu labels and ResourceClaim nd-test/c1 of gpu.kubeshare.io: one pod gets its share one way; the claim is not configured",
            "ResourceClaim nd-test/c2: GPU GPU-00000007-aaaa-bbbb-cccc-dddddddddddd is not a GPU of node nd-node-a",
            "ResourceClaim nd-test/c3b: the pod already has a share of GPU GPU-00000000-aaaa-bbbb-cccc-dddddddddddd through another claim; not configured",
            "ResourceClaim nd-test/c9: \"a b\" cannot be a client ID",
        ] {
            assert!(
                msgs.iter().any(|m| m == want),
                "missing {want:?} in {msgs:#?}"
            );
        }
        assert_eq!(
            d.configs[&gpu_uuid(0)].render(),
            format!(
                "2\n{} 0.2 0.4 1073741824 opportunistic\n{} 0.1 0.2 1\n",
                uid(1),
                uid(3)
            )
        );
    }

    #[test]
    fn pod_uid_shape() {
        assert!(looks_like_pod_uid("8d9e5c3a-1b2c-4d5e-8f90-0123456789ab"));
        assert!(!looks_like_pod_uid("8d9e5c3a-1b2c-4d5e-8f90-0123456789a"));
        assert!(!looks_like_pod_uid("8D9E5C3A-1b2c-4d5e-8f90-0123456789ab"));
        assert!(!looks_like_pod_uid("../../etc"));
        assert!(!looks_like_pod_uid(""));
    }
}
