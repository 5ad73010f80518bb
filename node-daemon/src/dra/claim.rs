//! From a ResourceClaim allocated on this node to the shares it holds (pure): for each
//! allocation result of driver `gpu.kubeshare.io`, which GPU of the inventory it is, what
//! the scheduler booked (`consumedCapacity`), and what the claim's opaque config adds
//! (the limit, unified memory), resolved by [`ShareConfig::resolve`] as the labels'
//! values are. The result, a [`PreparedClaim`], is what the kubelet plugin checkpoints
//! and what the daemon turns into gem-schd's config entries and the claim's CDI spec.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, ResourceClaim,
};
use kubeshare_api::dra::{COMPUTE, COMPUTE_UNITS, ConfigError, Consumed, DRIVER_NAME, MEMORY};
use kubeshare_api::{ClientClass, GpuDemand, Milli, NodeInventory, parse_bytes};
use serde::{Deserialize, Serialize};

use super::slice::{MEMORY_STEP, device_name};
use crate::reconcile::{ClaimGpu, ClaimShare};

/// A claim prepared on this node: what the kubelet plugin answered and what gem-schd
/// enforces for it. Serialized into the checkpoint, so fields only ever get added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedClaim {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The (first) pod the claim is reserved for.
    pub pod_uid: String,
    pub pod_name: String,
    pub devices: Vec<ClaimDevice>,
    /// gem-schd's client ID and the name of the claim's socket directory
    /// (`pods/<client>/`): [`client_of`]. Empty (a checkpoint from before shared claims):
    /// `pod_uid`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub client: String,
    /// Every pod the claim was reserved for when prepared, `pod_uid` first. Empty (a
    /// checkpoint from before shared claims): `pod_uid` alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<ClaimPod>,
    /// Every device is a whole GPU ([`is_whole`]): the claim gets the GPUs alone, no
    /// hook, no gem-schd client, as a whole-GPU labelled pod does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
}

/// A pod a claim is reserved for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimPod {
    pub uid: String,
    pub name: String,
}

/// One allocation result: a share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimDevice {
    /// The claim's request this device serves (a subrequest's parent: containers name
    /// requests, not subrequests).
    pub request: String,
    pub pool: String,
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    pub gpu_uuid: String,
    pub gpu_index: u32,
    /// Guaranteed share, thousandths (the booked `compute`).
    pub request_milli: u16,
    /// Ceiling, thousandths.
    pub limit_milli: u16,
    /// The memory cap gem-schd enforces, bytes: the booked `memory`, or in
    /// unified-memory mode the managed ceiling.
    pub memory_cap: u64,
    /// Unified-memory mode: the GPU-resident share (the booked `memory`), the hook's
    /// prefetch budget. `None`: device memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub um_resident: Option<u64>,
    /// The config's `priority` (0 when it has none). `None`: prepared before claims had
    /// a priority, when every claim was guaranteed; it stays so until unprepared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
}

impl PreparedClaim {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// gem-schd's client ID of the claim (see [`client_of`]).
    pub fn client(&self) -> &str {
        if self.client.is_empty() {
            &self.pod_uid
        } else {
            &self.client
        }
    }

    /// The UIDs of the pods the claim was reserved for when prepared.
    pub fn pod_uids(&self) -> Vec<String> {
        if self.pods.is_empty() {
            vec![self.pod_uid.clone()]
        } else {
            self.pods.iter().map(|p| p.uid.clone()).collect()
        }
    }

    /// What the daemon's books hold for this claim.
    pub fn share(&self) -> ClaimShare {
        ClaimShare {
            claim_key: self.key(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            client: self.client().to_string(),
            pods: self.pod_uids(),
            pod_uid: self.pod_uid.clone(),
            pod_key: format!("{}/{}", self.namespace, self.pod_name),
            gpus: self
                .devices
                .iter()
                .map(|d| ClaimGpu {
                    uuid: d.gpu_uuid.clone(),
                    // Both were checked when the claim was prepared; a checkpoint that
                    // says otherwise is caught by its checksum.
                    request: Milli::new(d.request_milli).unwrap_or(Milli::ZERO),
                    limit: Milli::new(d.limit_milli).unwrap_or(Milli::ONE),
                    mem: d.memory_cap,
                    class: d
                        .priority
                        .map_or(ClientClass::Guaranteed, ClientClass::of_priority),
                })
                .collect(),
            whole: self.whole,
        }
    }
}

/// Why a claim cannot be prepared here; the kubelet shows the message on the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("the ResourceClaim now has uid {found}, not {want}: it was deleted and made again")]
    Uid { want: String, found: String },
    #[error("the ResourceClaim is not allocated")]
    NotAllocated,
    #[error("the ResourceClaim is reserved for no pod")]
    NoPod,
    #[error("the ResourceClaim has no device of driver {DRIVER_NAME}")]
    NoDevice,
    #[error("request {request}: device {pool}/{device} is not a GPU of node {node}")]
    Foreign {
        request: String,
        pool: String,
        device: String,
        node: String,
    },
    #[error("request {request}: GPU {device} is allocated to the claim twice")]
    Twice { request: String, device: String },
    #[error("request {request}: consumedCapacity {capacity}={value}: {why}")]
    Capacity {
        request: String,
        capacity: &'static str,
        value: String,
        why: String,
    },
    #[error("request {request}: opaque config of {DRIVER_NAME}: {error}")]
    Config { request: String, error: ConfigError },
}

/// The request a result serves, as containers name it: `gpu` for `gpu` and for its
/// subrequest `gpu/h100`.
pub fn base_request(request: &str) -> &str {
    request.split('/').next().unwrap_or(request)
}

/// The last opaque config of this driver that applies to `request` (a config naming no
/// requests applies to all). The allocation lists the class's configs before the
/// claim's, so the claim's own config wins over its class's.
fn config_for<'a>(
    configs: &'a [DeviceAllocationConfiguration],
    request: &str,
) -> Option<&'a serde_json::Value> {
    configs
        .iter()
        .filter(|c| {
            c.requests.as_ref().is_none_or(|rs| {
                rs.is_empty()
                    || rs
                        .iter()
                        .any(|r| r == request || r == base_request(request))
            })
        })
        .filter_map(|c| c.opaque.as_ref())
        .filter(|o| o.driver == DRIVER_NAME)
        .map(|o| &o.parameters.0)
        .next_back()
}

/// What the scheduler booked for one result; the policy defaults (all of the GPU) for
/// a capacity not listed.
fn consumed(r: &DeviceRequestAllocationResult, gpu_memory: u64) -> Result<Consumed, ClaimError> {
    let caps = r.consumed_capacity.clone().unwrap_or_default();
    let bad = |capacity: &'static str, value: &str, why: &str| ClaimError::Capacity {
        request: r.request.clone(),
        capacity,
        value: value.to_string(),
        why: why.to_string(),
    };
    let compute = match caps.get(COMPUTE) {
        None => Milli::ONE,
        Some(q) => {
            let v = parse_bytes(&q.0).map_err(|e| bad(COMPUTE, &q.0, &e.to_string()))?;
            u16::try_from(v)
                .ok()
                .filter(|v| *v <= COMPUTE_UNITS)
                .and_then(Milli::new)
                .ok_or_else(|| bad(COMPUTE, &q.0, "not a whole number from 0 to 1000"))?
        }
    };
    let memory = match caps.get(MEMORY) {
        None => gpu_memory / MEMORY_STEP * MEMORY_STEP,
        Some(q) => parse_bytes(&q.0).map_err(|e| bad(MEMORY, &q.0, &e.to_string()))?,
    };
    Ok(Consumed { compute, memory })
}

/// The claim `claim` (asked for by the kubelet as `want_uid`) as prepared on `node`
/// with GPUs `inventory`.
pub fn prepare(
    claim: &ResourceClaim,
    want_uid: &str,
    node: &str,
    inventory: &NodeInventory,
) -> Result<PreparedClaim, ClaimError> {
    let found = claim.metadata.uid.clone().unwrap_or_default();
    if found != want_uid {
        return Err(ClaimError::Uid {
            want: want_uid.to_string(),
            found,
        });
    }
    let status = claim.status.as_ref();
    let alloc = status
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or(ClaimError::NotAllocated)?;
    let pods: Vec<_> = status
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .collect();
    let Some(pod) = pods.first().copied() else {
        return Err(ClaimError::NoPod);
    };
    let owners: Vec<(&str, &str, bool)> = claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| (o.kind.as_str(), o.uid.as_str(), o.controller == Some(true)))
        .collect();
    let pod_uids: Vec<&str> = pods.iter().map(|p| p.uid.as_str()).collect();
    let client = client_of(want_uid, &pod_uids, &owners);
    let configs = alloc.config.as_deref().unwrap_or_default();
    let by_name: BTreeMap<String, &kubeshare_api::GpuInfo> = inventory
        .gpus
        .iter()
        .map(|g| (device_name(g.index), g))
        .collect();
    let mut devices: Vec<ClaimDevice> = Vec::new();
    for r in alloc.results.iter().flatten() {
        if r.driver != DRIVER_NAME {
            continue;
        }
        let gpu = by_name
            .get(&r.device)
            .filter(|_| r.pool == node)
            .ok_or_else(|| ClaimError::Foreign {
                request: r.request.clone(),
                pool: r.pool.clone(),
                device: r.device.clone(),
                node: node.to_string(),
            })?;
        if devices.iter().any(|d| d.gpu_uuid == gpu.uuid) {
            return Err(ClaimError::Twice {
                request: r.request.clone(),
                device: r.device.clone(),
            });
        }
        let consumed = consumed(r, gpu.memory)?;
        let config = match config_for(configs, &r.request) {
            Some(v) => kubeshare_api::dra::ShareConfig::from_value(v),
            None => Ok(kubeshare_api::dra::ShareConfig::default()),
        };
        let demand: GpuDemand =
            config
                .and_then(|c| c.resolve(consumed))
                .map_err(|error| ClaimError::Config {
                    request: r.request.clone(),
                    error,
                })?;
        let (request, limit) = (demand.request_per_gpu(), demand.limit_per_gpu());
        let resident = consumed.memory;
        devices.push(ClaimDevice {
            request: base_request(&r.request).to_string(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            gpu_uuid: gpu.uuid.clone(),
            gpu_index: gpu.index,
            request_milli: request.get(),
            limit_milli: limit.get(),
            memory_cap: demand.um.map_or(resident, |u| u.ceiling(resident)),
            um_resident: demand.um.map(|_| resident),
            priority: Some(demand.priority),
        });
    }
    if devices.is_empty() {
        return Err(ClaimError::NoDevice);
    }
    let whole = devices.iter().all(|d| {
        inventory
            .gpu(&d.gpu_uuid)
            .is_some_and(|g| is_whole(d, g.memory))
    });
    Ok(PreparedClaim {
        whole,
        client,
        pods: pods
            .iter()
            .map(|p| ClaimPod {
                uid: p.uid.clone(),
                name: p.name.clone(),
            })
            .collect(),
        uid: want_uid.to_string(),
        namespace: claim.metadata.namespace.clone().unwrap_or_default(),
        name: claim.metadata.name.clone().unwrap_or_default(),
        pod_uid: pod.uid.clone(),
        pod_name: pod.name.clone(),
        devices,
    })
}

/// gem-schd's client ID of claim `claim_uid`, reserved for pods `pods`, owned by
/// `owners` (kind, UID, whether the controller): the pod's UID when the claim was made
/// for that pod alone (from a template: the pod controls it, and no other pod may use
/// it), else the claim's UID. The kubelet prepares a claim once per node, however many
/// pods use it, and hands every container the same CDI device, so a claim that pods
/// may share (by name) needs a client of its own, whose socket directory every such pod
/// mounts; gem-schd serves there the pods the daemon lists in its peers file.
pub fn client_of(claim_uid: &str, pods: &[&str], owners: &[(&str, &str, bool)]) -> String {
    match pods {
        [pod]
            if owners
                .iter()
                .any(|(kind, uid, controller)| *kind == "Pod" && uid == pod && *controller) =>
        {
            (*pod).to_string()
        }
        _ => claim_uid.to_string(),
    }
}

/// Whether `d`, a share of a GPU of `gpu_memory` bytes, is the whole GPU: all of its
/// `compute` with nothing to cap above it, all of its memory as published, in device
/// memory. Such a share has nothing for gem-schd and the hook to enforce: it runs as a
/// whole-GPU labelled pod does (`gpu_request` of whole GPUs), without either. A claim
/// that books all of `compute` but caps memory below the GPU's keeps the hook, which
/// enforces the cap.
pub fn is_whole(d: &ClaimDevice, gpu_memory: u64) -> bool {
    d.request_milli == COMPUTE_UNITS
        && d.limit_milli == COMPUTE_UNITS
        && d.um_resident.is_none()
        && d.memory_cap >= kubeshare_api::dra::device_memory(gpu_memory)
}

/// Why a claim does not fit beside what the node's books hold of its GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BookError {
    #[error(
        "request {request}: GPU {gpu} ({device}) would be booked past one GPU: label pods hold {labels}, other claims {claims}, this claim {this} thousandths \
         (a label pod was placed on it while the scheduler allocated this claim); delete the pod so that its claim is allocated again"
    )]
    Compute {
        request: String,
        gpu: String,
        device: String,
        labels: u32,
        claims: u32,
        this: u16,
    },
    #[error(
        "request {request}: GPU {gpu} ({device}) would be booked past its memory: label pods hold {labels}, other claims {claims}, this claim {this} of {total} bytes \
         (a label pod was placed on it while the scheduler allocated this claim); delete the pod so that its claim is allocated again"
    )]
    Memory {
        request: String,
        gpu: String,
        device: String,
        labels: u64,
        claims: u64,
        this: u64,
        total: u64,
    },
}

impl ClaimDevice {
    /// The GPU memory this share books: the booked `memory` (in unified-memory mode the
    /// resident share; the managed ceiling beyond it is not GPU memory).
    pub fn booked_memory(&self) -> u64 {
        self.um_resident.unwrap_or(self.memory_cap)
    }
}

/// Whether `claim` fits beside what label pods (`labels`, by GPU UUID) and the
/// `others` prepared claims hold of its GPUs (`inventory`): one set of books on the
/// node, in `compute` (at most one GPU) and in memory (at most the GPU's memory as the
/// slice publishes it, whole MiB). The stock scheduler and the extender decide apart,
/// each from what it last saw of the other, so at the same instant both may book the
/// last room of a GPU; the claim, prepared later than the label pod was bound, is
/// refused, with a message that says what holds the GPU. A GPU missing from the
/// inventory has no memory to book.
pub fn check_books<'a>(
    claim: &PreparedClaim,
    others: impl IntoIterator<Item = &'a PreparedClaim>,
    labels: &super::slice::LabelUse,
    inventory: &NodeInventory,
) -> Result<(), BookError> {
    let others: Vec<&PreparedClaim> = others.into_iter().filter(|o| o.uid != claim.uid).collect();
    for d in &claim.devices {
        let (label_milli, label_mem) = labels.get(&d.gpu_uuid).copied().unwrap_or((0, 0));
        let on_gpu = || {
            others
                .iter()
                .flat_map(|o| o.devices.iter())
                .filter(|o| o.gpu_uuid == d.gpu_uuid)
        };
        let claimed: u32 = on_gpu().map(|o| u32::from(o.request_milli)).sum();
        let total = label_milli
            .saturating_add(claimed)
            .saturating_add(u32::from(d.request_milli));
        if total > u32::from(COMPUTE_UNITS) {
            return Err(BookError::Compute {
                request: d.request.clone(),
                gpu: d.gpu_uuid.clone(),
                device: d.device.clone(),
                labels: label_milli,
                claims: claimed,
                this: d.request_milli,
            });
        }
        let gpu_mem = inventory
            .gpu(&d.gpu_uuid)
            .map_or(0, |g| kubeshare_api::dra::device_memory(g.memory));
        let claimed_mem = on_gpu().fold(0u64, |a, o| a.saturating_add(o.booked_memory()));
        let this = d.booked_memory();
        if label_mem.saturating_add(claimed_mem).saturating_add(this) > gpu_mem {
            return Err(BookError::Memory {
                request: d.request.clone(),
                gpu: d.gpu_uuid.clone(),
                device: d.device.clone(),
                labels: label_mem,
                claims: claimed_mem,
                this,
                total: gpu_mem,
            });
        }
    }
    Ok(())
}

/// What the prepared claims hold of one GPU, as `/metrics` shows it beside the label
/// pods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimedGpu {
    /// Claims with a share of the GPU.
    pub claims: u32,
    /// Their guaranteed shares (the booked `compute`), thousandths: 1000 for a whole GPU.
    pub milli: u32,
    /// The GPU memory they book ([`ClaimDevice::booked_memory`]), bytes.
    pub memory: u64,
}

/// Per GPU UUID, what `claims` hold of it, summed as [`check_books`] sums them. GPUs no
/// claim uses are absent.
pub fn claimed_per_gpu<'a>(
    claims: impl IntoIterator<Item = &'a PreparedClaim>,
) -> BTreeMap<String, ClaimedGpu> {
    let mut out: BTreeMap<String, ClaimedGpu> = BTreeMap::new();
    for d in claims.into_iter().flat_map(|c| c.devices.iter()) {
        let g = out.entry(d.gpu_uuid.clone()).or_default();
        // A claim has at most one device per GPU (prepare refuses a GPU twice).
        g.claims += 1;
        g.milli = g.milli.saturating_add(u32::from(d.request_milli));
        g.memory = g.memory.saturating_add(d.booked_memory());
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;
    use serde_json::{Value, json};

    pub const NODE: &str = "node-a";
    pub const U0: &str = "GPU-00000000-0000-4000-8000-000000000000";
    pub const U1: &str = "GPU-11111111-1111-4111-8111-111111111111";
    pub const POD: &str = "8d9e5c3a-1b2c-4d5e-8f90-0123456789ab";

    pub fn inventory() -> NodeInventory {
        let gpu = |index: u32, uuid: &str| GpuInfo {
            uuid: uuid.into(),
            index,
            model: "NVIDIA-H100-80GB-HBM3".into(),
            memory: (16 << 30) + 123,
            numa_node: None,
            nvlink_peers: vec![],
            held_by: None,
        };
        NodeInventory {
            gpus: vec![gpu(0, U0), gpu(1, U1)],
        }
    }

    /// A claim as the apiserver returns it once the scheduler allocated `results` with
    /// `config` and reserved it for `pods`.
    pub fn claim(results: Value, config: Value, pods: &[&str]) -> ResourceClaim {
        let reserved: Vec<Value> = pods
            .iter()
            .enumerate()
            .map(|(i, uid)| json!({"resource": "pods", "name": format!("p{i}"), "uid": uid}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "claim-uid-1",
                         "ownerReferences": pods.first().map(|uid| json!([{"apiVersion": "v1", "kind": "Pod",
                             "name": "p0", "uid": uid, "controller": true}]))},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME}}]}},
            "status": {
                "allocation": {"devices": {"results": results, "config": config}},
                "reservedFor": reserved,
            },
        }))
        .unwrap()
    }

    pub fn result(device: &str, compute: &str, memory: &str) -> Value {
        json!({"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": device,
               "shareID": "share-1",
               "consumedCapacity": {"compute": compute, "memory": memory}})
    }

    pub fn opaque(params: Value) -> Value {
        let mut p = json!({"apiVersion": "gpu.kubeshare.io/v1alpha1", "kind": "GpuShareConfig"});
        if let (Value::Object(o), Value::Object(e)) = (&mut p, params) {
            o.extend(e);
        }
        json!([{"source": "FromClaim", "requests": ["gpu"],
                "opaque": {"driver": DRIVER_NAME, "parameters": p}}])
    }

    #[test]
    fn a_claim_is_refused_past_one_gpu_counting_label_pods_and_other_claims() {
        let inv = inventory();
        let c = claim(json!([result("gpu-1", "500", "2Gi")]), json!([]), &[POD]);
        let p = prepare(&c, "claim-uid-1", NODE, &inv).unwrap();
        let mut other = p.clone();
        other.uid = "claim-uid-2".into();
        other.devices[0].request_milli = 300;
        let none = super::super::slice::LabelUse::new();
        assert_eq!(check_books(&p, [&other], &none, &inv), Ok(()));
        // Label pods hold 0.3 of gpu 1: 0.3 + 0.3 + 0.5 is past one GPU.
        let labels = super::super::slice::LabelUse::from([(U1.to_string(), (300, 0))]);
        let e = check_books(&p, [&other], &labels, &inv)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "request gpu: GPU {U1} (gpu-1) would be booked past one GPU: label pods hold 300, other claims 300, this claim 500 thousandths"
            )),
            "{e}"
        );
        // The claim itself (prepared again) is not counted twice; another GPU's label
        // pods do not count.
        assert_eq!(check_books(&p, [&p], &labels, &inv), Ok(()));
        let elsewhere = super::super::slice::LabelUse::from([(U0.to_string(), (1000, 0))]);
        assert_eq!(check_books(&p, [&other], &elsewhere, &inv), Ok(()));
    }

    #[test]
    fn claimed_per_gpu_sums_the_claims_of_each_gpu() {
        let inv = inventory();
        let prep = |uid: &str, results: Value, config: Value| {
            let mut c = claim(results, config, &[POD]);
            c.metadata.uid = Some(uid.into());
            prepare(&c, uid, NODE, &inv).unwrap()
        };
        // A whole GPU 0 (no capacity requests: 1000 and all of its memory as
        // published), a share of GPU 1, and a unified-memory share of GPU 1, which books
        // its resident 1 GiB, not its 3 GiB ceiling.
        let mut r = result("gpu-0", "1", "1");
        r.as_object_mut().unwrap().remove("consumedCapacity");
        let whole = prep("w", json!([r]), Value::Null);
        assert!(whole.whole);
        let share = prep("s", json!([result("gpu-1", "300", "2Gi")]), Value::Null);
        let um = prep(
            "u",
            json!([result("gpu-1", "250", "1Gi")]),
            opaque(json!({"memoryMode": "unified", "managedMemory": "3Gi"})),
        );
        assert_eq!(um.devices[0].memory_cap, 3 << 30);
        let gpu = |claims, milli, memory| ClaimedGpu {
            claims,
            milli,
            memory,
        };
        assert_eq!(
            claimed_per_gpu([&whole, &share, &um]),
            BTreeMap::from([
                (U0.to_string(), gpu(1, 1000, 16 << 30)),
                (U1.to_string(), gpu(2, 550, 3 << 30)),
            ])
        );
        // A claim of two GPUs counts on each; an unprepared claim counts nowhere.
        let pair = prep(
            "p",
            json!([result("gpu-0", "100", "1Gi"), result("gpu-1", "200", "4Gi")]),
            Value::Null,
        );
        assert_eq!(
            claimed_per_gpu([&pair, &um]),
            BTreeMap::from([
                (U0.to_string(), gpu(1, 100, 1 << 30)),
                (U1.to_string(), gpu(2, 450, 5 << 30)),
            ])
        );
        assert!(claimed_per_gpu([]).is_empty());
    }

    #[test]
    fn a_claim_is_refused_past_the_gpus_memory() {
        // 16 GiB (and a few bytes) of memory: 16 GiB bookable.
        let inv = inventory();
        let c = claim(json!([result("gpu-1", "100", "6Gi")]), json!([]), &[POD]);
        let p = prepare(&c, "claim-uid-1", NODE, &inv).unwrap();
        let mut other = p.clone();
        other.uid = "claim-uid-2".into();
        other.devices[0].memory_cap = 4 << 30;
        // 6 + 4 + 6 = 16 GiB: fits exactly.
        let labels = super::super::slice::LabelUse::from([(U1.to_string(), (100, 6 << 30))]);
        assert_eq!(check_books(&p, [&other], &labels, &inv), Ok(()));
        // One byte more held by label pods: refused, with the figures.
        let labels = super::super::slice::LabelUse::from([(U1.to_string(), (100, (6 << 30) + 1))]);
        let e = check_books(&p, [&other], &labels, &inv).unwrap_err();
        assert_eq!(
            e,
            BookError::Memory {
                request: "gpu".into(),
                gpu: U1.into(),
                device: "gpu-1".into(),
                labels: (6 << 30) + 1,
                claims: 4 << 30,
                this: 6 << 30,
                total: 16 << 30,
            }
        );
        assert!(
            e.to_string().starts_with(&format!(
                "request gpu: GPU {U1} (gpu-1) would be booked past its memory: label pods hold 6442450945, other claims 4294967296, this claim 6442450944 of 17179869184 bytes"
            )),
            "{e}"
        );
        // A whole-GPU label pod holds all of it.
        let whole = super::super::slice::LabelUse::from([(U1.to_string(), (0, u64::MAX))]);
        assert!(matches!(
            check_books(&p, [], &whole, &inv),
            Err(BookError::Memory { .. })
        ));
        // Unified memory books the resident share, not the managed ceiling.
        let mut um = other.clone();
        um.devices[0].memory_cap = 30 << 30;
        um.devices[0].um_resident = Some(4 << 30);
        let labels = super::super::slice::LabelUse::from([(U1.to_string(), (100, 6 << 30))]);
        assert_eq!(check_books(&p, [&um], &labels, &inv), Ok(()));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn device(gpu: u32, milli: u16, mem: u64) -> ClaimDevice {
            let uuid = if gpu == 0 { U0 } else { U1 };
            ClaimDevice {
                request: "gpu".into(),
                pool: NODE.into(),
                device: format!("gpu-{gpu}"),
                share_id: None,
                gpu_uuid: uuid.into(),
                gpu_index: gpu,
                request_milli: milli,
                limit_milli: milli.max(1),
                memory_cap: mem,
                um_resident: None,
                priority: None,
            }
        }

        fn prepared(uid: String, devices: Vec<ClaimDevice>) -> PreparedClaim {
            PreparedClaim {
                uid,
                namespace: "ns".into(),
                name: "c".into(),
                pod_uid: POD.into(),
                pod_name: "p".into(),
                devices,
                whole: false,
                client: String::new(),
                pods: vec![],
            }
        }

        fn share() -> impl Strategy<Value = (u32, u16, u64)> {
            (0u32..2, 0u16..=1000, 0u64..=(12 << 30))
        }

        proptest! {
            /// The check accepts exactly when, on each of the claim's GPUs, label pods,
            /// the other claims and this one together stay within one GPU's compute and
            /// its bookable memory; a refusal's figures are those sums' parts.
            #[test]
            fn refuses_exactly_what_overbooks(
                this in prop::collection::vec(share(), 1..3),
                others in prop::collection::vec(share(), 0..5),
                labels in prop::collection::btree_map(0u32..2, (0u32..=1000, 0u64..=(16 << 30)), 0..3),
            ) {
                let inv = inventory();
                let mut seen = std::collections::BTreeSet::new();
                let this: Vec<ClaimDevice> = this
                    .into_iter()
                    .filter(|(g, _, _)| seen.insert(*g))
                    .map(|(g, m, b)| device(g, m, b))
                    .collect();
                let claim = prepared("me".into(), this);
                let others: Vec<PreparedClaim> = others
                    .into_iter()
                    .enumerate()
                    .map(|(i, (g, m, b))| prepared(format!("o{i}"), vec![device(g, m, b)]))
                    .collect();
                let labels: super::super::super::slice::LabelUse = labels
                    .into_iter()
                    .map(|(g, u)| ((if g == 0 { U0 } else { U1 }).to_string(), u))
                    .collect();
                let fits = claim.devices.iter().all(|d| {
                    let (lm, lb) = labels.get(&d.gpu_uuid).copied().unwrap_or_default();
                    let on: Vec<&ClaimDevice> = others
                        .iter()
                        .flat_map(|o| &o.devices)
                        .filter(|o| o.gpu_uuid == d.gpu_uuid)
                        .collect();
                    let m: u32 = lm + on.iter().map(|o| u32::from(o.request_milli)).sum::<u32>()
                        + u32::from(d.request_milli);
                    let b: u64 = lb + on.iter().map(|o| o.memory_cap).sum::<u64>() + d.memory_cap;
                    m <= 1000 && b <= 16 << 30
                });
                let got = check_books(&claim, &others, &labels, &inv);
                prop_assert_eq!(got.is_ok(), fits, "{:?}", got);
                match got {
                    Err(BookError::Compute { labels, claims, this, .. }) => {
                        prop_assert!(labels + claims + u32::from(this) > 1000);
                    }
                    Err(BookError::Memory { labels, claims, this, total, .. }) => {
                        prop_assert_eq!(total, 16 << 30);
                        prop_assert!(labels + claims + this > total);
                    }
                    Ok(()) => {}
                }
                // Fewer other claims never turn a fit into a refusal.
                if fits {
                    prop_assert!(check_books(&claim, others.iter().skip(1), &labels, &inv).is_ok());
                }
            }
        }
    }

    #[test]
    fn a_claim_pods_share_is_a_client_of_its_own() {
        const POD2: &str = "9d9e5c3a-1b2c-4d5e-8f90-0123456789ab";
        // Made from a template for one pod: the pod's client, as before.
        let c = claim(json!([result("gpu-1", "300", "2Gi")]), json!([]), &[POD]);
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        assert_eq!((p.client(), p.pod_uids()), (POD, vec![POD.to_string()]));
        // Reserved for two pods: one client, the claim's, listing both pods.
        let c = claim(
            json!([result("gpu-1", "300", "2Gi")]),
            json!([]),
            &[POD, POD2],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        assert_eq!(p.client(), "claim-uid-1");
        assert_eq!(p.pod_uids(), vec![POD.to_string(), POD2.to_string()]);
        assert_eq!((p.pod_uid.as_str(), p.pod_name.as_str()), (POD, "p0"));
        let s = p.share();
        assert_eq!((s.client.as_str(), s.pods.len()), ("claim-uid-1", 2));
        // A claim by name, reserved for one pod so far: others may join it later.
        let mut lone = claim(json!([result("gpu-1", "300", "2Gi")]), json!([]), &[POD]);
        lone.metadata.owner_references = None;
        let p = prepare(&lone, "claim-uid-1", NODE, &inventory()).unwrap();
        assert_eq!(p.client(), "claim-uid-1");
        // The rule itself: only the controlling pod, alone, makes it the pod's client.
        assert_eq!(client_of("c", &["p"], &[("Pod", "p", true)]), "p");
        assert_eq!(client_of("c", &["p"], &[("Pod", "p", false)]), "c");
        assert_eq!(client_of("c", &["p"], &[("Pod", "q", true)]), "c");
        assert_eq!(client_of("c", &["p"], &[("Job", "p", true)]), "c");
        assert_eq!(client_of("c", &["p", "q"], &[("Pod", "p", true)]), "c");
        // A checkpoint from before shared claims: no client, no pods.
        let mut old = p.clone();
        old.client.clear();
        old.pods.clear();
        assert_eq!((old.client(), old.pod_uids()), (POD, vec![POD.to_string()]));
    }

    #[test]
    fn the_configs_priority_decides_the_class_as_the_label_does() {
        for (priority, class) in [
            (json!(0), ClientClass::Opportunistic),
            (json!("1"), ClientClass::Guaranteed),
            (json!(100), ClientClass::Guaranteed),
        ] {
            let c = claim(
                json!([result("gpu-1", "300", "2Gi")]),
                opaque(json!({"priority": priority})),
                &[POD],
            );
            let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
            assert_eq!(p.share().gpus[0].class, class, "{priority}");
        }
        // A claim checkpointed before claims had a priority stays guaranteed.
        let c = claim(json!([result("gpu-1", "300", "2Gi")]), json!([]), &[POD]);
        let mut p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        p.devices[0].priority = None;
        assert_eq!(p.share().gpus[0].class, ClientClass::Guaranteed);
        assert_eq!(
            err(
                json!([result("gpu-1", "300", "2Gi")]),
                opaque(json!({"priority": "high"})),
                &[POD]
            ),
            "request gpu: opaque config of gpu.kubeshare.io: priority=high: must be a whole number from 0 to 100, as a string such as \"50\" or a number such as 50 (0 = opportunistic, the default; 1-100 = guaranteed; as the sharedgpu/priority label)"
        );
    }

    #[test]
    fn a_share_with_a_limit() {
        let c = claim(
            json!([result("gpu-1", "300", "2Gi")]),
            opaque(json!({"limit": "0.6"})),
            &[POD],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        assert_eq!(p.key(), "ns/c");
        assert_eq!(p.pod_uid, POD);
        assert_eq!(p.pod_name, "p0");
        assert_eq!(
            p.devices,
            vec![ClaimDevice {
                request: "gpu".into(),
                pool: NODE.into(),
                device: "gpu-1".into(),
                share_id: Some("share-1".into()),
                gpu_uuid: U1.into(),
                gpu_index: 1,
                request_milli: 300,
                limit_milli: 600,
                memory_cap: 2 << 30,
                um_resident: None,
                priority: Some(0),
            }]
        );
        let s = p.share();
        assert_eq!(s.pod_key, "ns/p0");
        // No priority: opportunistic, as a labelled pod without sharedgpu/priority.
        assert_eq!(s.gpus[0].class, ClientClass::Opportunistic);
        assert_eq!(s.gpus[0].request.get(), 300);
        assert_eq!(s.gpus[0].limit.get(), 600);
        assert_eq!(s.gpus[0].mem, 2 << 30);
    }

    #[test]
    fn defaults_unified_memory_and_subrequests() {
        // No config, no consumed capacity: the whole GPU, as published (whole MiB).
        let mut r = result("gpu-0", "1", "1");
        r.as_object_mut().unwrap().remove("consumedCapacity");
        r["request"] = "gpu/h100".into();
        let c = claim(json!([r]), Value::Null, &[POD]);
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        let d = &p.devices[0];
        assert_eq!(
            (d.request.as_str(), d.request_milli, d.limit_milli),
            ("gpu", 1000, 1000)
        );
        assert_eq!(d.memory_cap, 16 << 30);
        assert!(p.whole, "all of the GPU: a whole GPU");
        // All of compute but a memory cap: a share the hook enforces.
        let c = claim(json!([result("gpu-0", "1000", "4Gi")]), Value::Null, &[POD]);
        assert!(
            !prepare(&c, "claim-uid-1", NODE, &inventory())
                .unwrap()
                .whole
        );
        // A whole GPU and a share in one claim: the hook is the container's, so both
        // run with it.
        let c = claim(
            json!([
                result("gpu-0", "1000", "16Gi"),
                result("gpu-1", "500", "4Gi")
            ]),
            Value::Null,
            &[POD],
        );
        let p = prepare(&c, "claim-uid-1", NODE, &inventory()).unwrap();
        assert!(!p.whole);
        assert!(is_whole(&p.devices[0], inventory().gpus[0].memory));

        // Unified memory: gem-schd caps the managed ceiling; the hook gets the resident share.
        let c = claim(
            json!([result("gpu-0", "250", "1Gi")]),
            opaque(json!({"memoryMode": "unified", "managedMemory": "3Gi"})),
            &[POD],
        );
        let d = prepare(&c, "claim-uid-1", NODE, &inventory())
            .unwrap()
            .devices[0]
            .clone();
        assert_eq!((d.request_milli, d.limit_milli), (250, 250));
        assert_eq!(d.memory_cap, 3 << 30);
        assert_eq!(d.um_resident, Some(1 << 30));

        // A config for another request, or another driver's, does not apply.
        let other = json!([
            {"source": "FromClaim", "requests": ["other"],
             "opaque": {"driver": DRIVER_NAME, "parameters": {"limit": "bad"}}},
            {"source": "FromClass",
             "opaque": {"driver": "gpu.example.com", "parameters": {"x": 1}}},
        ]);
        let c = claim(json!([result("gpu-0", "100", "1Gi")]), other, &[POD]);
        assert_eq!(
            prepare(&c, "claim-uid-1", NODE, &inventory())
                .unwrap()
                .devices[0]
                .limit_milli,
            100
        );
    }

    fn err(results: Value, config: Value, pods: &[&str]) -> String {
        prepare(
            &claim(results, config, pods),
            "claim-uid-1",
            NODE,
            &inventory(),
        )
        .unwrap_err()
        .to_string()
    }

    #[test]
    fn errors_name_the_request_and_the_field() {
        let r = || json!([result("gpu-0", "300", "2Gi")]);
        assert_eq!(
            err(r(), opaque(json!({"limit": "0.2"})), &[POD]),
            "request gpu: opaque config of gpu.kubeshare.io: limit=0.2: must be at least the claim's capacity request compute=300 (the share the scheduler booked)"
        );
        assert_eq!(
            err(r(), opaque(json!({"limt": "0.5"})), &[POD]),
            "request gpu: opaque config of gpu.kubeshare.io: limt=0.5: unknown field (a typo?); known fields are apiVersion, kind, request, limit, memory, memoryMode, managedMemory, priority"
        );
        assert_eq!(
            err(r(), opaque(json!({"memory": "1Gi"})), &[POD]),
            "request gpu: opaque config of gpu.kubeshare.io: memory=1073741824: must equal the claim's capacity request memory=2147483648 (the bytes the scheduler booked); leave memory out to take it from there"
        );
        assert_eq!(
            err(json!([result("gpu-0", "0", "2Gi")]), Value::Null, &[POD]),
            "request gpu: opaque config of gpu.kubeshare.io: limit=0.0: must be greater than 0"
        );
        assert_eq!(
            err(json!([result("gpu-0", "1500", "2Gi")]), Value::Null, &[POD]),
            "request gpu: consumedCapacity compute=1500: not a whole number from 0 to 1000"
        );
        assert_eq!(
            err(json!([result("gpu-7", "300", "2Gi")]), Value::Null, &[POD]),
            "request gpu: device node-a/gpu-7 is not a GPU of node node-a"
        );
        let mut elsewhere = result("gpu-0", "300", "2Gi");
        elsewhere["pool"] = "node-b".into();
        assert!(err(json!([elsewhere]), Value::Null, &[POD]).contains("node-b/gpu-0 is not a GPU"));
        assert_eq!(
            err(
                json!([result("gpu-0", "100", "1Gi"), result("gpu-0", "100", "1Gi")]),
                Value::Null,
                &[POD]
            ),
            "request gpu: GPU gpu-0 is allocated to the claim twice"
        );
        assert_eq!(
            err(r(), Value::Null, &[]),
            "the ResourceClaim is reserved for no pod"
        );
        let mut theirs = result("gpu-0", "300", "2Gi");
        theirs["driver"] = "gpu.example.com".into();
        assert_eq!(
            err(json!([theirs]), Value::Null, &[POD]),
            "the ResourceClaim has no device of driver gpu.kubeshare.io"
        );
        let c = claim(r(), Value::Null, &[POD]);
        assert_eq!(
            prepare(&c, "another-uid", NODE, &inventory()).unwrap_err(),
            ClaimError::Uid {
                want: "another-uid".into(),
                found: "claim-uid-1".into()
            }
        );
        let mut unallocated = c;
        unallocated.status.as_mut().unwrap().allocation = None;
        assert_eq!(
            prepare(&unallocated, "claim-uid-1", NODE, &inventory()).unwrap_err(),
            ClaimError::NotAllocated
        );
    }
}
