//! The checks a scale run ends with, read from the API's truth (the pods'
//! allocation records), not from the extender's own books: no GPU booked above
//! 1.0, and every bound KubeShare pod carries a record that names its node.
//!
//! Pure functions over `Pod` objects, so the check itself is unit-tested.
//! `rig` holds what the bench binaries share (processes, nodes, lists).

pub mod binding_pb;
pub mod dra;
pub mod measure;
pub mod rig;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kubeshare_api::{Allocation, GpuDemand};

/// Per-GPU bookings and the pods that break the record's rules.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BookCheck {
    /// Pods with `spec.nodeName` set.
    pub bound: usize,
    /// Pods not bound yet.
    pub pending: usize,
    /// GPU UUID → sum of granted requests, milli-units.
    pub booked_milli: BTreeMap<String, u32>,
    /// `namespace/name: why` for bound pods without a valid record.
    pub bad_records: Vec<String>,
}

impl BookCheck {
    /// GPUs booked above 1.0, with their sums.
    pub fn overcommitted(&self) -> Vec<(&str, u32)> {
        self.booked_milli
            .iter()
            .filter(|(_, m)| **m > 1000)
            .map(|(u, m)| (u.as_str(), *m))
            .collect()
    }

    /// The largest booking of any GPU, milli-units.
    pub fn max_milli(&self) -> u32 {
        self.booked_milli.values().copied().max().unwrap_or(0)
    }

    /// Whether the run ended as it must: everything bound, records whole, no GPU above 1.0.
    pub fn ok(&self) -> bool {
        self.pending == 0 && self.bad_records.is_empty() && self.overcommitted().is_empty()
    }
}

/// The share a bound pod holds on each of its GPUs: the request its record
/// grants, which must also be what its labels ask for (labels never change).
fn request_milli(pod: &Pod, alloc: &Allocation) -> Result<u32, String> {
    let granted = alloc.granted.request_per_gpu();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    match GpuDemand::from_labels(&labels) {
        Ok(Some(d)) if d.request_per_gpu() == granted => Ok(u32::from(granted.get())),
        Ok(Some(d)) => Err(format!(
            "record grants {granted} but the labels ask for {}",
            d.request_per_gpu()
        )),
        Ok(None) => Err("record but no sharedgpu labels".into()),
        Err(e) => Err(format!("labels do not parse: {e}")),
    }
}

/// Checks the records of `pods` (all KubeShare pods of the run).
pub fn check_books(pods: &[Pod]) -> BookCheck {
    let mut c = BookCheck::default();
    for pod in pods {
        let name = format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or(""),
            pod.metadata.name.as_deref().unwrap_or("")
        );
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            c.pending += 1;
            continue;
        };
        c.bound += 1;
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let alloc = match Allocation::from_annotations(&annotations) {
            Ok(Some(a)) => a,
            Ok(None) => {
                c.bad_records
                    .push(format!("{name}: bound to {node} with no record"));
                continue;
            }
            Err(e) => {
                c.bad_records
                    .push(format!("{name}: record does not parse: {e}"));
                continue;
            }
        };
        if alloc.node != node {
            c.bad_records.push(format!(
                "{name}: bound to {node} but its record names {}",
                alloc.node
            ));
        }
        match request_milli(pod, &alloc) {
            Ok(m) => {
                for uuid in &alloc.gpu_uuids {
                    *c.booked_milli.entry(uuid.clone()).or_default() += m;
                }
            }
            Err(why) => c.bad_records.push(format!("{name}: {why}")),
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, node: Option<&str>, uuid: Option<&str>, rec_node: &str) -> Pod {
        let mut ann = serde_json::Map::new();
        if let Some(u) = uuid {
            ann.insert("sharedgpu/gpu_uuid".into(), json!(u));
            ann.insert("sharedgpu/node".into(), json!(rec_node));
            ann.insert("sharedgpu/gpu_mem".into(), json!("1000"));
            ann.insert("sharedgpu/gpu_model".into(), json!("M"));
            ann.insert("sharedgpu/granted_request".into(), json!("0.25"));
            ann.insert("sharedgpu/granted_limit".into(), json!("0.25"));
            ann.insert("sharedgpu/record_version".into(), json!("1"));
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "annotations": ann,
                "labels": {"sharedgpu/gpu_request": "0.25", "sharedgpu/gpu_limit": "0.25"}},
            "spec": {"nodeName": node, "containers": []}
        }))
        .expect("test pod")
    }

    const U0: &str = "GPU-00000000-0000-0000-0000-000000000000";
    const U1: &str = "GPU-00000000-0000-0000-0000-000000000001";

    #[test]
    fn four_quarters_fit_five_do_not() {
        let mut pods: Vec<Pod> = (0..4)
            .map(|i| pod(&format!("p{i}"), Some("n"), Some(U0), "n"))
            .collect();
        let c = check_books(&pods);
        assert!(c.ok(), "{c:?}");
        assert_eq!(c.max_milli(), 1000);
        pods.push(pod("p5", Some("n"), Some(U0), "n"));
        let c = check_books(&pods);
        assert!(!c.ok());
        assert_eq!(c.overcommitted(), vec![(U0, 1250)]);
    }

    #[test]
    fn missing_or_wrong_records_and_pending_pods_fail_the_check() {
        let c = check_books(&[pod("a", Some("n"), None, "n")]);
        assert_eq!(c.bad_records.len(), 1, "{c:?}");
        let c = check_books(&[pod("b", Some("n"), Some(U1), "other")]);
        assert!(c.bad_records[0].contains("its record names other"), "{c:?}");
        let c = check_books(&[pod("c", None, None, "n")]);
        assert_eq!((c.pending, c.bound), (1, 0));
        assert!(!c.ok());
    }
}
