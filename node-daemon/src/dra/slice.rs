//! The node's ResourceSlice for driver [`DRIVER_NAME`], built from its GPU inventory.
//!
//! One pool per node (named after the node), one slice per pool. Each GPU is a device
//! with `allowMultipleAllocations: true` and two consumable capacities: `compute`,
//! 1000 thousandths of its time (a claim asks for its share, 0 to 1000, in steps of
//! one), and `memory`, its bytes rounded down to whole MiB (claims book MiB steps). A
//! claim that names neither gets the defaults, the whole capacity: the whole GPU. The
//! pool's generation goes up whenever the devices change, as the scheduler requires to
//! tell a stale slice from a current one.
//!
//! One set of books with the extender: a device's capacities are what the label pods on
//! the GPU leave ([`kubeshare_api::dra::capacity_left`]), so the stock scheduler never
//! books a claim into a share the extender gave a label pod. The apiserver wants a
//! request policy's default and maximum within the capacity, so they are what is left
//! too; a GPU the label pods leave no compute or no MiB of is left out of the slice.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kubeshare_api::NodeInventory;
use kubeshare_api::dra::{ATTR_UUID, COMPUTE, COMPUTE_UNITS, DRIVER_NAME, MEMORY, capacity_left};

use crate::reconcile::Desired;

/// What label pods hold of each GPU, by UUID: (sum of requests in thousandths, sum of
/// memory caps in bytes).
pub type LabelUse = BTreeMap<String, (u32, u64)>;

/// What the label pods in `desired` (the daemon's configs, built without claims) hold of
/// each GPU: a shared pod its request and memory cap, a whole-GPU pod all of it.
pub fn label_use(desired: &Desired) -> LabelUse {
    let mut used = LabelUse::new();
    for (gpu, config) in &desired.configs {
        let u = used.entry(gpu.clone()).or_default();
        for e in &config.entries {
            u.0 = u.0.saturating_add(u32::from(e.request.get()));
            u.1 = u.1.saturating_add(e.gpu_mem);
        }
    }
    for (gpu, pods) in &desired.whole {
        if !pods.is_empty() {
            used.insert(gpu.clone(), (u32::from(COMPUTE_UNITS), u64::MAX));
        }
    }
    used
}

pub use kubeshare_api::dra::{MEMORY_STEP, device_name};
/// Longest string attribute the apiserver accepts.
const MAX_STRING_ATTRIBUTE: usize = 64;
/// Longest object name.
const MAX_NAME: usize = 253;

/// The name of the node's slice: `<node>-gpu.kubeshare.io` (a node name too long for
/// the suffix is cut; the slice's `spec.nodeName` still says whose it is).
pub fn slice_name(node: &str) -> String {
    let suffix = format!("-{DRIVER_NAME}");
    // Node names are ASCII (DNS subdomains); counting chars keeps any other input safe.
    let mut head: String = node.chars().take(MAX_NAME - suffix.len()).collect();
    while head.ends_with(['-', '.']) {
        head.pop();
    }
    format!("{head}{suffix}")
}

fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}

fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

fn q(v: u64) -> Quantity {
    Quantity(v.to_string())
}

/// The devices of `inv`: every GPU that no other device plugin holds and that has at
/// least two MiB of memory (one step above the minimum; anything less is no real GPU
/// and the apiserver would refuse its policy).
/// Each device's capacities are what `used` (label pods) leaves of the GPU.
pub fn devices(inv: &NodeInventory, used: &LabelUse) -> Vec<Device> {
    let by_uuid: BTreeMap<&str, u32> = inv
        .gpus
        .iter()
        .map(|g| (g.uuid.as_str(), g.index))
        .collect();
    inv.gpus
        .iter()
        .filter(|g| g.held_by.is_none())
        .filter_map(|g| {
            let memory = kubeshare_api::dra::device_memory(g.memory);
            if memory < 2 * MEMORY_STEP {
                return None;
            }
            let mut attributes = BTreeMap::from([
                (ATTR_UUID.to_string(), string(&g.uuid)),
                ("index".to_string(), int(i64::from(g.index))),
                ("memory".to_string(), int(memory as i64)),
            ]);
            if g.model.len() <= MAX_STRING_ATTRIBUTE {
                attributes.insert("model".into(), string(&g.model));
            }
            if let Some(n) = g.numa_node {
                attributes.insert("numaNode".into(), int(i64::from(n)));
            }
            // NVLink neighbours as their indexes ("1,3"): list attributes are still alpha
            // and a string holds at most 64 bytes, which UUIDs would overflow.
            let mut peers: Vec<u32> = g
                .nvlink_peers
                .iter()
                .filter_map(|u| by_uuid.get(u.as_str()).copied())
                .collect();
            peers.sort_unstable();
            if !peers.is_empty() {
                let text = peers
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",");
                if text.len() <= MAX_STRING_ATTRIBUTE {
                    attributes.insert("nvlinkPeers".into(), string(text));
                }
                attributes.insert("nvlinkPeerCount".into(), int(peers.len() as i64));
            }
            let (label_milli, label_mem) = used.get(&g.uuid).copied().unwrap_or_default();
            let (compute_left, memory_left) = capacity_left(g.memory, label_milli, label_mem);
            if compute_left == 0 || memory_left < MEMORY_STEP {
                // Label pods hold all of it: no claim fits, and a policy of nothing
                // is invalid. Claims allocated on it before stay prepared.
                return None;
            }
            let compute = u64::from(compute_left);
            let capacity = BTreeMap::from([
                (
                    COMPUTE.to_string(),
                    DeviceCapacity {
                        value: q(compute),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(q(compute)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: q(0),
                                max: Some(q(compute)),
                                step: Some(q(1)),
                            }),
                            valid_values: None,
                        }),
                    },
                ),
                (
                    MEMORY.to_string(),
                    DeviceCapacity {
                        value: q(memory_left),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(q(memory_left)),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: q(MEMORY_STEP),
                                max: None,
                                step: Some(q(MEMORY_STEP)),
                            }),
                            valid_values: None,
                        }),
                    },
                ),
            ]);
            Some(Device {
                name: device_name(g.index),
                allow_multiple_allocations: Some(true),
                attributes: Some(attributes),
                capacity: Some(capacity),
                ..Default::default()
            })
        })
        .collect()
}

/// The slice that publishes `inv`, less what label pods hold (`used`), for Node `node`
/// (uid `node_uid`, its owner: the slice goes when the Node does) at pool generation
/// `generation`.
pub fn desired(
    node: &str,
    node_uid: &str,
    inv: &NodeInventory,
    used: &LabelUse,
    generation: i64,
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node)),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.into(),
                uid: node_uid.into(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices(inv, used)),
            ..Default::default()
        },
    }
}

/// What to send so that the API holds the slice for `inv`.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// No slice yet.
    Create(ResourceSlice),
    /// The slice differs: replace it (guarded by its resourceVersion) with the next
    /// generation.
    Replace(ResourceSlice),
    /// The slice already says it.
    Unchanged,
}

/// Compares `existing` (the node's slice as read, if any) with what `inv`, less what
/// label pods hold (`used`), should publish.
pub fn plan(
    node: &str,
    node_uid: &str,
    inv: &NodeInventory,
    used: &LabelUse,
    existing: Option<&ResourceSlice>,
) -> Step {
    let Some(cur) = existing else {
        return Step::Create(desired(node, node_uid, inv, used, 1));
    };
    let mut want = desired(node, node_uid, inv, used, cur.spec.pool.generation);
    if same(cur, &want) {
        return Step::Unchanged;
    }
    want.spec.pool.generation = cur.spec.pool.generation.saturating_add(1);
    want.metadata.resource_version = cur.metadata.resource_version.clone();
    Step::Replace(want)
}

/// Whether `cur` publishes what `want` does. Quantities are compared by value: the
/// apiserver writes them back in canonical form (`1000` as `1k`).
fn same(cur: &ResourceSlice, want: &ResourceSlice) -> bool {
    let owner = |s: &ResourceSlice| {
        s.metadata
            .owner_references
            .iter()
            .flatten()
            .map(|o| (o.kind.clone(), o.name.clone(), o.uid.clone()))
            .collect::<Vec<_>>()
    };
    let mut a = cur.spec.clone();
    let mut b = want.spec.clone();
    normalize(&mut a);
    normalize(&mut b);
    a == b && owner(cur) == owner(want)
}

fn normalize(spec: &mut ResourceSliceSpec) {
    let norm = |q: &mut Quantity| {
        if let Ok(v) = kubeshare_api::parse_bytes(&q.0) {
            q.0 = v.to_string();
        }
    };
    for d in spec.devices.iter_mut().flatten() {
        for c in d.capacity.iter_mut().flat_map(|m| m.values_mut()) {
            norm(&mut c.value);
            if let Some(p) = &mut c.request_policy {
                p.default.iter_mut().for_each(norm);
                p.valid_values.iter_mut().flatten().for_each(norm);
                if let Some(r) = &mut p.valid_range {
                    norm(&mut r.min);
                    r.max.iter_mut().for_each(norm);
                    r.step.iter_mut().for_each(norm);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;
    use serde_json::json;

    fn gpu(i: u32, memory: u64) -> GpuInfo {
        GpuInfo {
            uuid: format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"),
            index: i,
            model: "NVIDIA-H100-80GB-HBM3".into(),
            memory,
            numa_node: None,
            nvlink_peers: vec![],
            held_by: None,
        }
    }

    #[test]
    fn a_gpu_is_a_shared_device_with_compute_and_memory() {
        let mut g0 = gpu(0, (80 << 30) + 12345);
        g0.numa_node = Some(1);
        g0.nvlink_peers = vec![gpu(1, 0).uuid];
        let inv = NodeInventory {
            gpus: vec![g0, gpu(1, 16 << 30)],
        };
        let s = desired("node-a", "uid-1", &inv, &LabelUse::new(), 1);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(v["kind"], "ResourceSlice");
        assert_eq!(v["metadata"]["name"], "node-a-gpu.kubeshare.io");
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        assert_eq!(v["spec"]["driver"], "gpu.kubeshare.io");
        assert_eq!(v["spec"]["nodeName"], "node-a");
        assert_eq!(
            v["spec"]["pool"],
            json!({"name": "node-a", "generation": 1, "resourceSliceCount": 1})
        );
        let d0 = &v["spec"]["devices"][0];
        assert_eq!(
            d0,
            &json!({
                "name": "gpu-0",
                "allowMultipleAllocations": true,
                "attributes": {
                    "uuid": {"string": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"},
                    "index": {"int": 0},
                    "model": {"string": "NVIDIA-H100-80GB-HBM3"},
                    "memory": {"int": 80i64 << 30},
                    "numaNode": {"int": 1},
                    "nvlinkPeers": {"string": "1"},
                    "nvlinkPeerCount": {"int": 1},
                },
                "capacity": {
                    "compute": {"value": "1000", "requestPolicy": {
                        "default": "1000",
                        "validRange": {"min": "0", "max": "1000", "step": "1"}}},
                    // Rounded down to whole MiB, so that the default is a whole step.
                    "memory": {"value": (80u64 << 30).to_string(), "requestPolicy": {
                        "default": (80u64 << 30).to_string(),
                        "validRange": {"min": "1048576", "step": "1048576"}}},
                },
            })
        );
        assert_eq!(v["spec"]["devices"][1]["name"], "gpu-1");
        assert!(
            v["spec"]["devices"][1]["attributes"]
                .get("nvlinkPeers")
                .is_none()
        );
    }

    #[test]
    fn label_pods_shrink_the_capacity() {
        let inv = NodeInventory {
            gpus: vec![gpu(0, 16 << 30), gpu(1, 16 << 30)],
        };
        let used = LabelUse::from([(gpu(0, 0).uuid, (700, 4 << 30))]);
        let v = serde_json::to_value(devices(&inv, &used)).unwrap();
        let cap = |d: usize, c: &str| v[d]["capacity"][c]["value"].clone();
        assert_eq!(cap(0, "compute"), "300");
        assert_eq!(cap(0, "memory"), (12u64 << 30).to_string());
        assert_eq!(cap(1, "compute"), "1000");
        // The policy's default and maximum are what is left (the apiserver wants them
        // within the capacity).
        let policy = &v[0]["capacity"]["compute"]["requestPolicy"];
        assert_eq!(policy["default"], "300");
        assert_eq!(policy["validRange"]["max"], "300");
        assert_eq!(
            v[0]["capacity"]["memory"]["requestPolicy"]["default"],
            (12u64 << 30).to_string()
        );
        // A GPU the label pods fill is left out.
        let full = LabelUse::from([(gpu(1, 0).uuid, (1000, 0))]);
        let names: Vec<String> = devices(&inv, &full).into_iter().map(|d| d.name).collect();
        assert_eq!(names, vec!["gpu-0"]);
        // A label pod coming changes the slice: the next generation.
        let Step::Create(mut cur) = plan("n", "u", &inv, &LabelUse::new(), None) else {
            panic!("no slice yet: create");
        };
        cur.metadata.resource_version = Some("3".into());
        let Step::Replace(next) = plan("n", "u", &inv, &used, Some(&cur)) else {
            panic!("label pods came: replace");
        };
        assert_eq!(next.spec.pool.generation, 2);
    }

    #[test]
    fn label_use_sums_the_configs() {
        use kubeshare_api::{ClientClass, Milli, ResourceConfig, ResourceEntry};
        let entry = |id: &str, r: u16, mem: u64| ResourceEntry {
            id: id.into(),
            request: Milli::new(r).unwrap(),
            limit: Milli::ONE,
            gpu_mem: mem,
            class: ClientClass::Guaranteed,
        };
        let mut d = Desired::default();
        d.configs.insert(
            "A".into(),
            ResourceConfig {
                entries: vec![entry("p1", 300, 1 << 30), entry("p2", 400, 2 << 30)],
            },
        );
        d.configs.insert("B".into(), ResourceConfig::default());
        d.whole.insert("C".into(), vec!["p3".into()]);
        let u = label_use(&d);
        assert_eq!(u["A"], (700, 3 << 30));
        assert_eq!(u["B"], (0, 0));
        assert_eq!(u["C"], (1000, u64::MAX));
    }

    #[test]
    fn held_and_tiny_gpus_are_left_out() {
        let mut held = gpu(0, 16 << 30);
        held.held_by = Some("ns/pod".into());
        let inv = NodeInventory {
            gpus: vec![held, gpu(1, MEMORY_STEP + 1), gpu(2, 2 * MEMORY_STEP)],
        };
        let names: Vec<String> = devices(&inv, &LabelUse::new())
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, vec!["gpu-2"]);
    }

    #[test]
    fn the_generation_moves_only_on_change() {
        let inv = NodeInventory {
            gpus: vec![gpu(0, 16 << 30)],
        };
        let Step::Create(mut cur) = plan("n", "u", &inv, &LabelUse::new(), None) else {
            panic!("no slice yet: create");
        };
        assert_eq!(cur.spec.pool.generation, 1);
        cur.metadata.resource_version = Some("7".into());
        // Read back in the apiserver's canonical quantities: still unchanged.
        for d in cur.spec.devices.iter_mut().flatten() {
            let c = d.capacity.as_mut().unwrap().get_mut("compute").unwrap();
            c.value = Quantity("1k".into());
            let m = d.capacity.as_mut().unwrap().get_mut("memory").unwrap();
            m.request_policy
                .as_mut()
                .unwrap()
                .valid_range
                .as_mut()
                .unwrap()
                .min = Quantity("1Mi".into());
        }
        assert_eq!(
            plan("n", "u", &inv, &LabelUse::new(), Some(&cur)),
            Step::Unchanged
        );
        // A GPU more: the next generation, guarded by the resourceVersion read.
        let more = NodeInventory {
            gpus: vec![gpu(0, 16 << 30), gpu(1, 16 << 30)],
        };
        let Step::Replace(next) = plan("n", "u", &more, &LabelUse::new(), Some(&cur)) else {
            panic!("changed: replace");
        };
        assert_eq!(next.spec.pool.generation, 2);
        assert_eq!(next.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(next.spec.devices.as_ref().unwrap().len(), 2);
        // A new Node object of the same name (new uid): the owner is corrected.
        assert!(matches!(
            plan("n", "other-uid", &inv, &LabelUse::new(), Some(&cur)),
            Step::Replace(_)
        ));
    }

    #[test]
    fn slice_names_fit() {
        assert_eq!(slice_name("n1"), "n1-gpu.kubeshare.io");
        let long = "a".repeat(253);
        let n = slice_name(&long);
        assert_eq!(n.len(), 253);
        assert!(n.ends_with("-gpu.kubeshare.io"));
    }
}
