//! Unified-memory pods (docs/um.md) in the table: both figures on the pod's line, the resident
//! share (not the ceiling) in the GPU's memory bar, and a record whose resident share is not
//! the extender's (above the ceiling) listed as broken.

use k8s_openapi::api::core::v1::{Node, Pod};
use kubectl_sharedgpu::{RenderOptions, render_table};
use serde_json::json;

const GI: u64 = 1 << 30;
const UUID: &str = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd";

fn node() -> Node {
    let gpus =
        json!([{"uuid": UUID, "index": 0, "model": "NVIDIA-H100-80GB-HBM3", "memory": 80 * GI}]);
    serde_json::from_value(json!({"metadata": {"name": "node-a", "annotations": {
        "sharedgpu/inventory": json!({"gpus": gpus}).to_string()}}}))
    .unwrap()
}

fn pod(name: &str, ceiling: u64, resident: Option<&str>) -> Pod {
    let mut labels = json!({"sharedgpu/gpu_request": "0.3", "sharedgpu/gpu_limit": "1.0"});
    let record = kubeshare_api::Allocation {
        node: "node-a".into(),
        gpu_uuids: vec![UUID.into()],
        gpu_mem: ceiling,
        gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
        granted: kubeshare_api::Granted::Fraction {
            request: kubeshare_api::Milli::new(300).unwrap(),
            limit: kubeshare_api::Milli::ONE,
        },
        gpu_mem_resident: None,
    };
    let mut annotations = serde_json::Map::new();
    for (k, v) in record.to_annotations() {
        annotations.insert(k, json!(v));
    }
    if let Some(r) = resident {
        labels["sharedgpu/gpu_mem_mode"] = json!("unified");
        annotations.insert(kubeshare_api::um::GPU_MEM_RESIDENT.into(), json!(r));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "ml", "labels": labels, "annotations": annotations},
        "spec": {"schedulerName": "kubeshare-scheduler", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"}
    }))
    .unwrap()
}

#[test]
fn both_figures_and_the_resident_share_in_the_bar() {
    let pods = vec![
        pod("um-a", 52 * GI, Some(&(26 * GI).to_string())),
        pod("dev-b", 20 * GI, None),
    ];
    let out = render_table(&[node()], &pods, RenderOptions::default());
    let um = out
        .lines()
        .find(|l| l.contains("ml/um-a"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        um.contains("26.0Gi resident, 52.0Gi managed"),
        "{um}\n{out}"
    );
    let dev = out.lines().find(|l| l.contains("ml/dev-b")).unwrap();
    assert!(dev.contains("20.0Gi") && !dev.contains("resident"), "{dev}");
    // The GPU's bar books 26 + 20 GiB, not 52 + 20.
    assert!(out.contains("46.0Gi/80.0Gi"), "{out}");
}

#[test]
fn a_resident_share_above_the_ceiling_is_a_broken_record() {
    let pods = vec![pod("um-bad", 8 * GI, Some(&(9 * GI).to_string()))];
    let out = render_table(&[node()], &pods, RenderOptions::default());
    assert!(out.contains("sharedgpu/gpu_mem_resident"), "{out}");
    assert!(!out.contains("resident, "), "{out}");
}
