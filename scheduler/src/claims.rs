//! What ResourceClaims hold of the GPUs: the shares the stock kube-scheduler allocated
//! on devices of KubeShare's DRA driver (`gpu.kubeshare.io`), per GPU, for the extender
//! to add to its books (one set of books: docs/extender.md, docs/dra.md). Pure: a
//! function of the claims and the ResourceSlices as the watches show them.
//!
//! A claim's allocation names a device by pool (the node) and device name; the device's
//! `uuid` attribute in the node's slice says which GPU it is. Without the slice (deleted
//! with a restarting kubelet, not yet read) the naming rule that both sides share
//! ([`kubeshare_api::dra::device_index`]) gives the GPU's NVML index instead.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kubeshare_api::dra::{ATTR_UUID, COMPUTE, COMPUTE_UNITS, DRIVER_NAME, MEMORY};
use kubeshare_api::parse_bytes;

/// The shares claims hold of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimedGpu {
    /// The GPU's UUID, from the device's attribute in the slice; `None` when no slice
    /// names the device (then the device name gives the index).
    pub uuid: Option<String>,
    /// Sum of the claims' `compute`, thousandths (a claim that books none: 1000).
    pub milli: u32,
    /// Sum of the claims' `memory`, bytes; `None`: a claim books all of it (none named).
    pub mem: Option<u64>,
    /// The claims, as `namespace/name`, sorted.
    pub claims: BTreeSet<String>,
}

/// Claimed GPUs by (node, device name).
pub type Claimed = BTreeMap<(String, String), ClaimedGpu>;

/// What every allocated claim of [`DRIVER_NAME`] in `claims` holds, per GPU, with the
/// devices resolved through `slices`. A claim holds its share from allocation until it
/// is deallocated, whether or not its pod runs, as the stock scheduler counts it. An
/// amount that does not parse counts as the whole capacity: never less than booked.
pub fn claimed<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    slices: impl IntoIterator<Item = &'a ResourceSlice>,
) -> Claimed {
    // (pool, device) → (node, uuid)
    let mut devices: BTreeMap<(&str, &str), (&str, Option<&str>)> = BTreeMap::new();
    for s in slices.into_iter().filter(|s| s.spec.driver == DRIVER_NAME) {
        let pool = s.spec.pool.name.as_str();
        let node = s.spec.node_name.as_deref().unwrap_or(pool);
        for d in s.spec.devices.iter().flatten() {
            let uuid = d
                .attributes
                .as_ref()
                .and_then(|a| a.get(ATTR_UUID))
                .and_then(|a| a.string.as_deref());
            devices.insert((pool, d.name.as_str()), (node, uuid));
        }
    }
    let mut out = Claimed::new();
    for c in claims {
        let results = c
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        let name = format!(
            "{}/{}",
            c.metadata.namespace.as_deref().unwrap_or_default(),
            c.metadata.name.as_deref().unwrap_or_default()
        );
        for r in results.into_iter().flatten() {
            if r.driver != DRIVER_NAME {
                continue;
            }
            // The pool is named after the node (node-daemon/src/dra/slice.rs).
            let (node, uuid) = devices
                .get(&(r.pool.as_str(), r.device.as_str()))
                .copied()
                .unwrap_or((r.pool.as_str(), None));
            let caps = r.consumed_capacity.as_ref();
            let amount = |k: &str| caps.and_then(|c| c.get(k)).map(|q| parse_bytes(&q.0));
            let milli = match amount(COMPUTE) {
                Some(Ok(v)) => v.min(u64::from(COMPUTE_UNITS)) as u32,
                _ => u32::from(COMPUTE_UNITS),
            };
            let mem = match amount(MEMORY) {
                Some(Ok(v)) => Some(v),
                _ => None,
            };
            let g = out
                .entry((node.to_string(), r.device.clone()))
                .or_insert_with(|| ClaimedGpu {
                    mem: Some(0),
                    ..ClaimedGpu::default()
                });
            g.uuid = g.uuid.take().or(uuid.map(str::to_string));
            g.milli = g.milli.saturating_add(milli);
            g.mem = match (g.mem, mem) {
                (Some(a), Some(b)) => Some(a.saturating_add(b)),
                _ => None,
            };
            g.claims.insert(name.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(node: &str, devices: &[(&str, &str)]) -> ResourceSlice {
        let devices: Vec<_> = devices
            .iter()
            .map(|(n, u)| json!({"name": n, "attributes": {"uuid": {"string": u}}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{node}-gpu.kubeshare.io")},
            "spec": {"driver": DRIVER_NAME, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}
        }))
        .unwrap()
    }

    fn claim(name: &str, results: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"devices": {}},
            "status": {"allocation": {"devices": {"results": results}}}
        }))
        .unwrap()
    }

    fn result(pool: &str, device: &str, caps: serde_json::Value) -> serde_json::Value {
        json!({"request": "gpu", "driver": DRIVER_NAME, "pool": pool, "device": device,
               "consumedCapacity": caps})
    }

    #[test]
    fn claims_add_up_per_gpu() {
        let slices = [slice("n1", &[("gpu-0", "GPU-a"), ("gpu-1", "GPU-b")])];
        let claims = [
            claim(
                "a",
                json!([result(
                    "n1",
                    "gpu-0",
                    json!({"compute": "300", "memory": "4Gi"})
                )]),
            ),
            claim(
                "b",
                json!([result(
                    "n1",
                    "gpu-0",
                    json!({"compute": "200", "memory": "2Gi"})
                )]),
            ),
            // No amounts: the whole GPU, as the policy's defaults book it.
            claim("c", json!([result("n1", "gpu-1", json!({}))])),
            // Another driver's device, and a claim not allocated: nothing.
            claim(
                "d",
                json!([{"request": "x", "driver": "other.example.com", "pool": "n1", "device": "gpu-0"}]),
            ),
        ];
        let mut unallocated = claim("e", json!([]));
        unallocated.status = None;
        let mut all = claims.to_vec();
        all.push(unallocated);
        let got = claimed(&all, &slices);
        assert_eq!(got.len(), 2);
        let g0 = &got[&("n1".to_string(), "gpu-0".to_string())];
        assert_eq!(g0.uuid.as_deref(), Some("GPU-a"));
        assert_eq!(g0.milli, 500);
        assert_eq!(g0.mem, Some(6 << 30));
        assert_eq!(g0.claims.iter().collect::<Vec<_>>(), vec!["ns/a", "ns/b"]);
        let g1 = &got[&("n1".to_string(), "gpu-1".to_string())];
        assert_eq!(
            (g1.uuid.as_deref(), g1.milli, g1.mem),
            (Some("GPU-b"), 1000, None)
        );
    }

    #[test]
    fn without_a_slice_the_device_name_is_kept() {
        let claims = [claim(
            "a",
            json!([result(
                "n2",
                "gpu-3",
                json!({"compute": "1k", "memory": "1Gi"})
            )]),
        )];
        let got = claimed(&claims, []);
        let g = &got[&("n2".to_string(), "gpu-3".to_string())];
        assert_eq!(
            (g.uuid.clone(), g.milli, g.mem),
            (None, 1000, Some(1 << 30))
        );
    }
}
