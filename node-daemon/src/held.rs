//! GPUs that the kubelet gave whole to pods through another device plugin (NVIDIA's
//! `nvidia.com/gpu`), from the kubelet's PodResources API: marked in the published
//! inventory (`GpuInfo::held_by`) so that the extender places no KubeShare pod on them.
//! Pure: the daemon lists the devices and publishes the result.

use std::collections::BTreeMap;

use kubeshare_api::NodeInventory;
use kubeshare_kubelet_rpc::podresources::HeldDevice;

use crate::reconcile::Placement;

/// The device-plugin resources whose devices are GPUs of this node, by default.
pub const DEFAULT_RESOURCES: &[&str] = &["nvidia.com/gpu"];

/// `inventory` with `held_by` set on every GPU that a device of one of `resources`
/// names, by UUID (NVIDIA's default device IDs) or by index (its `index` strategy).
/// Device IDs that name no GPU of the node (MIG devices, another node's UUIDs) are
/// left out; several holders of one GPU are listed together, sorted.
pub fn mark_held(
    inventory: &NodeInventory,
    devices: &[HeldDevice],
    resources: &[String],
) -> NodeInventory {
    let mut holders: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for d in devices.iter().filter(|d| resources.contains(&d.resource)) {
        let id = d.device_id.trim();
        let gpu = inventory.gpus.iter().position(|g| {
            g.uuid.eq_ignore_ascii_case(id)
                || id
                    .parse::<u32>()
                    .is_ok_and(|i| i == g.index && !id.starts_with('+'))
        });
        if let Some(i) = gpu {
            holders
                .entry(i)
                .or_default()
                .push(format!("{}/{}", d.namespace, d.pod));
        }
    }
    let mut out = inventory.clone();
    for (i, g) in out.gpus.iter_mut().enumerate() {
        g.held_by = holders.remove(&i).map(|mut h| {
            h.sort();
            h.dedup();
            h.join(",")
        });
    }
    out
}

/// KubeShare pods on a GPU that a device-plugin pod holds too (placed before the
/// kubelet gave the GPU away, or by a kubelet that ignores the mark): (pod UID, why).
/// Both see the GPU, and KubeShare's shares on it no longer hold.
pub fn conflicts(inventory: &NodeInventory, placements: &[Placement]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in placements {
        for g in inventory.gpus.iter().filter(|g| p.gpus.contains(&g.uuid)) {
            if let Some(holder) = &g.held_by {
                out.push((
                    p.pod_uid.clone(),
                    format!(
                        "GPU {} was also given whole to pod {holder} by the NVIDIA device plugin: both use it, and this pod's share on it does not hold",
                        g.uuid
                    ),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::GpuInfo;

    fn inv(n: u32) -> NodeInventory {
        NodeInventory {
            gpus: (0..n)
                .map(|i| GpuInfo {
                    uuid: format!("GPU-0000000{i}-0000-0000-0000-000000000000"),
                    index: i,
                    model: "A".into(),
                    memory: 1,
                    numa_node: None,
                    nvlink_peers: vec![],
                    held_by: None,
                })
                .collect(),
        }
    }

    fn dev(pod: &str, resource: &str, id: &str) -> HeldDevice {
        HeldDevice {
            namespace: "ns".into(),
            pod: pod.into(),
            resource: resource.into(),
            device_id: id.into(),
        }
    }

    fn held(inv: &NodeInventory) -> Vec<Option<&str>> {
        inv.gpus.iter().map(|g| g.held_by.as_deref()).collect()
    }

    #[test]
    fn uuids_and_indexes_of_the_named_resources_mark_their_gpus() {
        let base = inv(4);
        let r = vec!["nvidia.com/gpu".to_string()];
        let devices = [
            dev(
                "a",
                "nvidia.com/gpu",
                "gpu-00000001-0000-0000-0000-000000000000",
            ),
            dev("b", "nvidia.com/gpu", "3"),
            dev(
                "c",
                "example.com/nic",
                "GPU-00000000-0000-0000-0000-000000000000",
            ),
            dev(
                "d",
                "nvidia.com/gpu",
                "MIG-11111111-0000-0000-0000-000000000000",
            ),
            dev("e", "nvidia.com/gpu", "+2"),
            dev("f", "nvidia.com/gpu", "99"),
        ];
        let out = mark_held(&base, &devices, &r);
        assert_eq!(held(&out), [None, Some("ns/a"), None, Some("ns/b")]);
        // Everything else is the inventory as discovered.
        let mut cleared = out.clone();
        cleared.gpus.iter_mut().for_each(|g| g.held_by = None);
        assert_eq!(cleared, base);
    }

    #[test]
    fn freed_gpus_lose_the_mark_and_shared_ones_list_every_holder() {
        let r = vec!["nvidia.com/gpu".to_string()];
        let marked = mark_held(&inv(2), &[dev("a", "nvidia.com/gpu", "0")], &r);
        assert_eq!(held(&marked), [Some("ns/a"), None]);
        // The pod is gone: the next list has no device, and the mark goes.
        assert_eq!(held(&mark_held(&marked, &[], &r)), [None, None]);
        let two = [
            dev("z", "nvidia.com/gpu", "1"),
            dev("y", "nvidia.com/gpu", "1"),
            dev("y", "nvidia.com/gpu", "1"),
        ];
        assert_eq!(
            held(&mark_held(&marked, &two, &r)),
            [None, Some("ns/y,ns/z")]
        );
    }

    #[test]
    fn kubeshare_pods_on_a_held_gpu_are_conflicts() {
        let r = vec!["nvidia.com/gpu".to_string()];
        let marked = mark_held(&inv(2), &[dev("a", "nvidia.com/gpu", "1")], &r);
        let place = |uid: &str, gpu: u32| Placement {
            pod_uid: uid.into(),
            pod_key: format!("ns/{uid}"),
            gpus: vec![marked.gpus[gpu as usize].uuid.clone()],
            whole: false,
        };
        let c = conflicts(&marked, &[place("x", 0), place("y", 1)]);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].0, "y");
        assert!(c[0].1.contains("given whole to pod ns/a"), "{}", c[0].1);
    }
}
