//! Properties of the pure reconcile step over random sets of pods: every config parses
//! back (Gemini's order, request ≤ limit), is sorted by pod UID, holds exactly the live
//! shared pods of its GPU, each of the class its priority label gives, and applying the diff to any disk state reaches a fixed point.

use std::collections::{BTreeMap, BTreeSet};

use kubeshare_api::{
    Allocation, ClientClass, GpuInfo, Granted, Milli, NodeInventory, ResourceConfig,
};
use kubeshare_node_daemon::reconcile::{Action, Actual, PodView, desired, diff};
use proptest::prelude::*;

const NODE: &str = "nd-prop";

fn gpu_uuid(i: usize) -> String {
    format!("GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd")
}

#[derive(Debug, Clone)]
struct PodSpec {
    uid: u32,
    request: u16,
    extra: u16,
    gpus: Vec<usize>,
    phase: u8,
    whole: bool,
    /// `sharedgpu/priority`, if the label is set.
    priority: Option<u8>,
}

fn pod_spec() -> impl Strategy<Value = PodSpec> {
    (
        0u32..40,
        0u16..=1000,
        0u16..=1000,
        proptest::sample::subsequence(vec![0usize, 1, 2, 3], 1..=2),
        0u8..4,
        proptest::bool::weighted(0.2),
        proptest::option::of(prop_oneof![Just(0u8), 1u8..=100]),
    )
        .prop_map(
            |(uid, request, extra, gpus, phase, whole, priority)| PodSpec {
                uid,
                request,
                extra,
                gpus,
                phase,
                whole,
                priority,
            },
        )
}

fn milli(m: u16) -> String {
    format!("{}.{:03}", m / 1000, m % 1000)
}

fn view(p: &PodSpec) -> PodView {
    let uid = format!("{:08x}-1111-2222-3333-444444444444", p.uid);
    let limit = (p.request + p.extra).clamp(1, 1000);
    let request = p.request.min(limit);
    let mut labels = BTreeMap::new();
    if p.whole && p.gpus.len() > 1 {
        labels.insert("sharedgpu/gpu_request".into(), p.gpus.len().to_string());
        labels.insert("sharedgpu/gpu_limit".into(), p.gpus.len().to_string());
    } else {
        labels.insert("sharedgpu/gpu_request".into(), milli(request));
        labels.insert("sharedgpu/gpu_limit".into(), milli(limit));
        labels.insert("sharedgpu/gpu_count".into(), p.gpus.len().to_string());
    }
    if let Some(pr) = p.priority {
        labels.insert("sharedgpu/priority".into(), pr.to_string());
    }
    PodView {
        uid,
        namespace: "ns".into(),
        name: format!("p{}", p.uid),
        node_name: Some(NODE.into()),
        phase: Some(["Pending", "Running", "Succeeded", "Failed"][p.phase as usize].into()),
        scheduler_name: Some("kubeshare-scheduler".into()),
        labels,
        annotations: Allocation {
            node: NODE.into(),
            gpu_uuids: p.gpus.iter().map(|g| gpu_uuid(*g)).collect(),
            gpu_mem: u64::from(p.uid) << 20,
            gpu_model: "M".into(),
            granted: if p.whole && p.gpus.len() > 1 {
                Granted::Whole
            } else {
                Granted::Fraction {
                    request: Milli::new(request).unwrap_or(Milli::ZERO),
                    limit: Milli::new(limit).unwrap_or(Milli::ONE),
                }
            },
            gpu_mem_resident: None,
        }
        .to_annotations(),
        claims: BTreeSet::new(),
    }
}

fn inventory() -> NodeInventory {
    NodeInventory {
        gpus: (0..4)
            .map(|i| GpuInfo {
                uuid: gpu_uuid(i),
                index: i as u32,
                model: "M".into(),
                memory: 1 << 34,
                numa_node: None,
                nvlink_peers: vec![],
                held_by: None,
            })
            .collect(),
    }
}

fn apply(actual: &mut Actual, actions: &[Action]) {
    for a in actions {
        match a {
            Action::CreatePodDir(u) => {
                actual.pod_dirs.insert(u.clone());
            }
            Action::RemovePodDir(u) => {
                actual.pod_dirs.remove(u);
            }
            Action::WriteConfig { gpu, text } => {
                actual.configs.insert(gpu.clone(), Some(text.clone()));
            }
            Action::WritePeers { client, text } => {
                actual.peers.insert(client.clone(), text.clone());
            }
            Action::RemovePeers(client) => {
                actual.peers.remove(client);
            }
        }
    }
}

proptest! {
    #[test]
    fn configs_are_exact_sorted_and_reach_a_fixed_point(
        specs in proptest::collection::vec(pod_spec(), 0..25),
        stale in proptest::collection::btree_set(0u32..60, 0..6),
    ) {
        // One pod per UID, as the API guarantees.
        let mut by_uid = BTreeMap::new();
        for s in specs {
            by_uid.insert(s.uid, s);
        }
        let pods: Vec<PodView> = by_uid.values().map(view).collect();
        let inv = inventory();
        let d = desired(NODE, &inv, &pods);
        prop_assert!(d.problems.is_empty(), "{:?}", d.problems);
        prop_assert_eq!(d.configs.len(), 4);

        for (i, g) in inv.gpus.iter().enumerate() {
            let text = d.configs[&g.uuid].render();
            let parsed = ResourceConfig::parse(&text).unwrap();
            let ids: Vec<&str> = parsed.entries.iter().map(|e| e.id.as_str()).collect();
            let mut sorted = ids.clone();
            sorted.sort();
            prop_assert_eq!(&ids, &sorted);
            let want: BTreeSet<String> = by_uid
                .values()
                .filter(|s| s.phase < 2 && !(s.whole && s.gpus.len() > 1) && s.gpus.contains(&i))
                .map(|s| view(s).uid)
                .collect();
            let got: BTreeSet<String> = ids.iter().map(|s| s.to_string()).collect();
            prop_assert_eq!(got, want);
            for e in &parsed.entries {
                prop_assert!(e.request <= e.limit);
                let s = by_uid.values().find(|s| view(s).uid == e.id).unwrap();
                let class = ClientClass::of_priority(s.priority.unwrap_or(0));
                prop_assert_eq!(e.class, class);
            }
        }
        let live: BTreeSet<String> = by_uid.values().filter(|s| s.phase < 2).map(|s| view(s).uid).collect();
        prop_assert_eq!(&d.pod_dirs, &live);

        // From any disk state (stale pod dirs, missing or stale configs) one diff reaches
        // the desired state, and then there is nothing left to do.
        let mut actual = Actual {
            configs: BTreeMap::from([(gpu_uuid(0), Some("1\nx 0.1 0.2 3\n".into()))]),
            pod_dirs: stale.iter().map(|u| format!("{u:08x}-1111-2222-3333-444444444444")).collect(),
            peers: BTreeMap::new(),
        };
        let actions = diff(&d, &actual);
        apply(&mut actual, &actions);
        prop_assert_eq!(&actual.pod_dirs, &d.pod_dirs);
        prop_assert!(diff(&d, &actual).is_empty());
    }
}
