//! The allocation table, from Node and Pod objects as the API server returns them.

use k8s_openapi::api::core::v1::{Node, Pod};
use kubectl_sharedgpu::model::build;
use kubectl_sharedgpu::render::{bar, fmt_bytes, fmt_share};
use kubectl_sharedgpu::{RenderOptions, render_table};
use serde_json::json;

const GI: u64 = 1 << 30;

fn uuid(node: u32, gpu: u32) -> String {
    format!("GPU-{node:04}{gpu:04}-aaaa-bbbb-cccc-dddddddddddd")
}

fn node(name: &str, idx: u32, models: &[(&str, u64)]) -> Node {
    let gpus: Vec<_> = models
        .iter()
        .enumerate()
        .map(|(i, (m, mem))| json!({"uuid": uuid(idx, i as u32), "index": i, "model": m, "memory": mem}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {
            "sharedgpu/inventory": json!({"gpus": gpus}).to_string()
        }}
    }))
    .unwrap()
}

fn pod(
    ns: &str,
    name: &str,
    labels: serde_json::Value,
    alloc: Option<(&str, &[String], u64)>,
    phase: &str,
) -> Pod {
    let mut annotations = serde_json::Map::new();
    if let Some((node, uuids, mem)) = alloc {
        // The record as the extender writes it: the granted share is what the
        // labels asked for at bind.
        let labels: std::collections::BTreeMap<String, String> =
            serde_json::from_value(labels.clone()).unwrap_or_default();
        let granted = match kubeshare_api::GpuDemand::from_labels(&labels) {
            Ok(Some(d)) if d.is_whole() && uuids.len() >= 2 => kubeshare_api::Granted::Whole,
            Ok(Some(d)) => kubeshare_api::Granted::Fraction {
                request: d.request_per_gpu(),
                limit: d.limit_per_gpu(),
            },
            _ => kubeshare_api::Granted::Fraction {
                request: kubeshare_api::Milli::ONE,
                limit: kubeshare_api::Milli::ONE,
            },
        };
        let record = kubeshare_api::Allocation {
            node: node.into(),
            gpu_uuids: uuids.to_vec(),
            gpu_mem: mem,
            gpu_model: "NVIDIA-H100-80GB-HBM3".into(),
            granted,
            gpu_mem_resident: None,
        };
        for (k, v) in record.to_annotations() {
            annotations.insert(k, json!(v));
        }
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "labels": labels, "annotations": annotations},
        "spec": {"schedulerName": "kubeshare-scheduler", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": phase}
    }))
    .unwrap()
}

fn frac(req: &str, lim: &str) -> serde_json::Value {
    json!({"sharedgpu/gpu_request": req, "sharedgpu/gpu_limit": lim})
}

/// The lines of `out` that mention `needle`.
fn lines_with<'a>(out: &'a str, needle: &str) -> Vec<&'a str> {
    out.lines().filter(|l| l.contains(needle)).collect()
}

#[test]
fn bars_and_numbers() {
    assert_eq!(bar(500, 0, 1000), "[#####-----]");
    assert_eq!(bar(250, 250, 1000), "[###==-----]");
    assert_eq!(bar(0, 0, 1000), "[----------]");
    assert_eq!(bar(1000, 0, 1000), "[##########]");
    // Small shares stay visible, nearly-full GPUs do not look full.
    assert_eq!(bar(1, 0, 1000), "[#---------]");
    assert_eq!(bar(999, 0, 1000), "[#########-]");
    // Overcommitment is shown, not hidden.
    assert_eq!(bar(1250, 0, 1000), "[##########!");
    assert_eq!(fmt_share(500), "0.50");
    assert_eq!(fmt_share(125), "0.125");
    assert_eq!(fmt_share(3250), "3.25");
    assert_eq!(fmt_bytes(20 * GI), "20.0Gi");
    assert_eq!(fmt_bytes(512 << 20), "512.0Mi");
    assert_eq!(fmt_bytes(100), "100B");
}

#[test]
fn gpus_with_their_pods_and_bars() {
    let nodes = vec![
        node(
            "node-b",
            1,
            &[
                ("NVIDIA-A100-SXM4-40GB", 40 * GI),
                ("NVIDIA-A100-SXM4-40GB", 40 * GI),
            ],
        ),
        node(
            "node-a",
            0,
            &[
                ("NVIDIA-H100-80GB-HBM3", 80 * GI),
                ("NVIDIA-H100-80GB-HBM3", 80 * GI),
            ],
        ),
        // Not a GPU node: counted, not shown.
        serde_json::from_value(json!({"metadata": {"name": "cpu-only"}})).unwrap(),
    ];
    let g00 = [uuid(0, 0)];
    let g01 = [uuid(0, 1)];
    let whole = [uuid(1, 0), uuid(1, 1)];
    let mut affinity = frac("0.25", "0.5");
    affinity["sharedgpu/sched_affinity"] = json!("team-a");
    let pods = vec![
        pod(
            "default",
            "frac-b",
            frac("0.25", "0.5"),
            Some(("node-a", &g00, 20 * GI)),
            "Running",
        ),
        pod(
            "default",
            "frac-a",
            affinity,
            Some(("node-a", &g00, 20 * GI)),
            "Running",
        ),
        pod(
            "ml",
            "solo",
            frac("0.5", "1.0"),
            Some(("node-a", &g01, 40 * GI)),
            "Running",
        ),
        pod(
            "ml",
            "big",
            json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"}),
            Some(("node-b", &whole, 40 * GI)),
            "Running",
        ),
        // Finished pods hold nothing.
        pod(
            "ml",
            "done",
            frac("0.5", "0.5"),
            Some(("node-a", &g01, 40 * GI)),
            "Succeeded",
        ),
        // Not a KubeShare pod: ignored.
        serde_json::from_value(json!({"metadata": {"name": "web", "namespace": "default"}}))
            .unwrap(),
    ];
    let out = render_table(&nodes, &pods, RenderOptions::default());

    // Header, then node-a's GPUs before node-b's, each pod right under its GPU.
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("NODE"), "{out}");
    assert!(lines[0].contains("SHARE REQUESTED") && lines[0].contains("MEMORY ALLOCATED"));
    let pos = |s: &str| {
        lines
            .iter()
            .position(|l| l.contains(s))
            .unwrap_or_else(|| panic!("{s} missing:\n{out}"))
    };
    assert!(pos("node-a") < pos("default/frac-a"));
    assert!(
        pos("default/frac-a") < pos("default/frac-b"),
        "pods sorted by name"
    );
    assert!(
        pos("default/frac-b") < pos("ml/solo"),
        "GPU 0's pods before GPU 1"
    );
    assert!(pos("ml/solo") < pos("node-b"));
    assert!(pos("node-b") < pos("ml/big"));

    // GPU 0 of node-a: two quarter shares -> half the GPU, 40 of 80 GiB.
    let g0 = lines[pos("node-a")];
    assert!(g0.contains("GPU-00000000"), "{g0}");
    assert!(!g0.contains("aaaa-bbbb"), "short UUIDs by default: {g0}");
    assert!(g0.contains("[#####-----] 0.50"), "{g0}");
    assert!(g0.contains("[#####-----] 40.0Gi/80.0Gi"), "{g0}");
    assert!(g0.trim_end().ends_with('2'), "two pods: {g0}");

    // Each pod line: guaranteed as '#', burst to its limit as '='.
    let a = lines[pos("default/frac-a")];
    assert!(a.contains("├─") && a.contains("Running"), "{a}");
    assert!(a.contains("[###==-----] 0.25/0.50"), "{a}");
    assert!(a.contains("20.0Gi") && a.contains("affinity=team-a"), "{a}");
    assert!(lines[pos("default/frac-b")].contains("└─"));
    assert!(lines[pos("ml/solo")].contains("[#####=====] 0.50/1.00"));

    // The whole-GPU pod fills its GPU.
    assert!(lines[pos("node-b")].contains("[##########] 1.00"));
    assert!(lines[pos("ml/big")].contains("[##########] whole GPU"));

    // GPU 1 of node-a appears without repeating the node name, and lines up.
    let g1 = lines[pos("ml/solo") - 1];
    assert!(g1.starts_with("      "), "{g1}");
    assert_eq!(g1.find("NVIDIA-H100"), g0.find("NVIDIA-H100"));

    assert!(lines_with(&out, "ml/done").is_empty(), "{out}");
    assert!(lines_with(&out, "default/web").is_empty());
    let summary = lines_with(&out, "GPU nodes");
    assert_eq!(
        summary,
        vec![
            "2 GPU nodes, 4 GPUs: 3.00 of 4 GPUs requested, 160.0Gi of 240.0Gi memory allocated; 4 pods placed, 0 pending"
        ]
    );
    assert!(
        out.contains("(not shown: 1 nodes without a GPU inventory, 1 finished pods)"),
        "{out}"
    );

    // Wide output: full UUIDs.
    let wide = render_table(
        &nodes,
        &pods,
        RenderOptions {
            wide: true,
            ..Default::default()
        },
    );
    assert!(wide.contains(&uuid(0, 0)));
    // With the node daemons' delivered shares: "got" after the pod's share, and
    // nothing for a pod without a figure.
    let delivered = [(
        ("default".to_string(), "frac-a".to_string(), uuid(0, 0)),
        0.2481,
    )]
    .into_iter()
    .collect();
    let with = render_table(
        &nodes,
        &pods,
        RenderOptions {
            delivered,
            ..Default::default()
        },
    );
    assert!(
        lines_with(&with, "default/frac-a")[0].contains("0.25/0.50 got 0.25"),
        "{with}"
    );
    assert!(
        !lines_with(&with, "default/frac-b")[0].contains("got"),
        "{with}"
    );
    // The same input in another order gives the same text.
    let mut rev = pods.clone();
    rev.reverse();
    assert_eq!(render_table(&nodes, &rev, RenderOptions::default()), out);
}

#[test]
fn pending_stray_and_invalid_pods_are_listed() {
    let nodes = vec![node("node-a", 0, &[("NVIDIA-H100-80GB-HBM3", 80 * GI)])];
    let mut group = frac("0.5", "0.5");
    group["sharedgpu/group_name"] = json!("train");
    group["sharedgpu/group_headcount"] = json!("4");
    group["sharedgpu/group_threshold"] = json!("0.75");
    let mut waiting = pod("default", "train-3", group, None, "Pending");
    let cond: k8s_openapi::api::core::v1::PodCondition = serde_json::from_value(json!({
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/1 nodes are available: group train has 2 of 3 members placeable"
    }))
    .unwrap();
    waiting.status.as_mut().unwrap().conditions = Some(vec![cond]);
    let ghost = [uuid(9, 9)];
    let pods = vec![
        waiting,
        pod("default", "fresh", frac("0.1", "0.2"), None, "Pending"),
        pod(
            "default",
            "lost",
            frac("0.1", "0.2"),
            Some(("node-x", &ghost, GI)),
            "Running",
        ),
        pod(
            "default",
            "typo",
            json!({"sharedgpu/gpu_limt": "0.5"}),
            None,
            "Pending",
        ),
    ];
    let view = build(&nodes, &pods);
    assert_eq!(view.pending.len(), 2);
    assert_eq!(view.stray.len(), 1);
    assert_eq!(view.broken.len(), 1);
    assert_eq!(view.nodes[0].gpus[0].pods.len(), 0);

    let out = render_table(&nodes, &pods, RenderOptions::default());
    let pend = out.find("PENDING").expect(&out);
    let train = &out[pend..]
        .lines()
        .find(|l| l.contains("default/train-3"))
        .unwrap()
        .to_string();
    assert!(train.contains("0.50/0.50"), "{train}");
    assert!(train.contains("group=train (starts at 3/4)"), "{train}");
    assert!(
        train.contains("Unschedulable: 0/1 nodes are available"),
        "{train}"
    );
    let fresh = lines_with(&out, "default/fresh");
    assert!(fresh[0].contains("waiting for the scheduler"), "{fresh:?}");
    let lost = lines_with(&out, "default/lost");
    assert!(
        lost[0].contains("node-x") && lost[0].contains(&uuid(9, 9)),
        "{lost:?}"
    );
    assert!(out.contains("ALLOCATED ON A GPU THAT NO NODE INVENTORY LISTS"));
    let typo = lines_with(&out, "default/typo");
    assert!(
        typo[0].contains("sharedgpu/gpu_limt") && typo[0].contains("unknown"),
        "{typo:?}"
    );
    assert!(out.contains("0 pods placed, 2 pending"), "{out}");
}

#[test]
fn overcommitted_gpu_and_bad_inventory_are_visible() {
    let mut bad: Node = serde_json::from_value(json!({
        "metadata": {"name": "node-bad", "annotations": {"sharedgpu/inventory": "{not json"}}
    }))
    .unwrap();
    bad.metadata.labels = None;
    let nodes = vec![
        node("node-a", 0, &[("NVIDIA-H100-80GB-HBM3", 80 * GI)]),
        bad,
    ];
    let g = [uuid(0, 0)];
    let pods = vec![
        pod(
            "default",
            "p1",
            frac("0.75", "1.0"),
            Some(("node-a", &g, 60 * GI)),
            "Running",
        ),
        pod(
            "default",
            "p2",
            frac("0.5", "1.0"),
            Some(("node-a", &g, 40 * GI)),
            "Running",
        ),
    ];
    let out = render_table(&nodes, &pods, RenderOptions::default());
    let row = lines_with(&out, "node-a")[0];
    assert!(row.contains("[##########! 1.25"), "{row}");
    assert!(row.contains("[##########! 100.0Gi/80.0Gi"), "{row}");
    assert!(
        out.contains("node-bad: inventory unreadable: inventory is not valid JSON"),
        "{out}"
    );
}

#[test]
fn no_gpu_nodes_says_so() {
    let out = render_table(&[], &[], RenderOptions::default());
    assert!(
        out.starts_with("No node publishes a KubeShare GPU inventory"),
        "{out}"
    );
    assert!(out.contains("0 GPU nodes, 0 GPUs"));
}

#[test]
fn colliding_short_uuids_and_long_reasons() {
    // Two GPUs whose UUIDs share the first group: short forms would look alike.
    let inv = json!({"gpus": [
        {"uuid": "GPU-00000000-aaaa-bbbb-cccc-000000000001", "index": 0, "model": "M", "memory": GI},
        {"uuid": "GPU-00000000-aaaa-bbbb-cccc-000000000002", "index": 1, "model": "M", "memory": GI},
    ]});
    let n: Node = serde_json::from_value(json!({
        "metadata": {"name": "n", "annotations": {"sharedgpu/inventory": inv.to_string()}}
    }))
    .unwrap();
    let mut p = pod("default", "slow", frac("0.5", "0.5"), None, "Pending");
    let long = "x".repeat(500);
    let cond: k8s_openapi::api::core::v1::PodCondition =
        serde_json::from_value(json!({"type": "PodScheduled", "status": "False", "message": long}))
            .unwrap();
    p.status.as_mut().unwrap().conditions = Some(vec![cond]);
    let out = render_table(
        std::slice::from_ref(&n),
        std::slice::from_ref(&p),
        RenderOptions::default(),
    );
    assert!(
        out.contains("GPU-00000000-aaaa-bbbb-cccc-000000000001"),
        "{out}"
    );
    assert!(
        out.contains("GPU-00000000-aaaa-bbbb-cccc-000000000002"),
        "{out}"
    );
    let line = lines_with(&out, "default/slow")[0];
    assert!(line.ends_with("..."), "{line}");
    assert!(!line.contains(&long));
    let wide = render_table(
        &[n],
        &[p],
        RenderOptions {
            wide: true,
            ..Default::default()
        },
    );
    assert!(wide.contains(&long));
}
