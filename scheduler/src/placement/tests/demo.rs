//! The `make demo` cluster: every pod placed in any order, the same table for the same order.

use super::groups::schedule_group;
use super::*;

// ---------------------------------------------------------------- the demo

/// The `make demo` cluster (hack/demo.sh): 2 H100 nodes and 2 A100 nodes, 4 GPUs each.
fn demo_cluster() -> Cluster {
    let mut c = Cluster::new(Config::default());
    for n in 0..4u32 {
        let (model, mem) = if n < 2 {
            ("NVIDIA-H100-80GB-HBM3", 80)
        } else {
            ("NVIDIA-A100-SXM4-40GB", 40)
        };
        c.apply_node(
            &format!("kwok-gpu-{n}"),
            Ok(Some(inv(n, 4, model, mem, &[]))),
        );
    }
    c
}

/// The demo's workloads (examples/*.yaml), one pod each.
fn demo_pods() -> Vec<PodInfo> {
    let a100 = ("gpu_model", "NVIDIA-A100-SXM4-40GB");
    let mut v = vec![
        pod(
            "notebook",
            &[
                ("gpu_request", "0.25"),
                ("gpu_limit", "0.5"),
                ("gpu_mem", "10Gi"),
            ],
        ),
        pod(
            "stage-1",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.4"),
                ("sched_affinity", "pipeline"),
            ],
        ),
        pod(
            "stage-2",
            &[
                ("gpu_request", "0.2"),
                ("gpu_limit", "0.4"),
                ("sched_affinity", "pipeline"),
            ],
        ),
        pod(
            "replica-a",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.3"),
                ("sched_anti-affinity", "replicas"),
            ],
        ),
        pod(
            "replica-b",
            &[
                ("gpu_request", "0.1"),
                ("gpu_limit", "0.3"),
                ("sched_anti-affinity", "replicas"),
            ],
        ),
        pod(
            "tenant-a",
            &[
                ("gpu_request", "0.4"),
                ("gpu_limit", "0.4"),
                a100,
                ("sched_exclusion", "tenant-a"),
            ],
        ),
        pod(
            "tenant-b",
            &[
                ("gpu_request", "0.4"),
                ("gpu_limit", "0.4"),
                a100,
                ("sched_exclusion", "tenant-b"),
            ],
        ),
        pod(
            "trainer",
            &[
                ("gpu_request", "2"),
                ("gpu_limit", "2"),
                ("gpu_model", "NVIDIA-H100-80GB-HBM3"),
            ],
        ),
    ];
    for i in 0..3 {
        v.push(pod(
            &format!("inference-{i}"),
            &[
                ("gpu_request", "0.3"),
                ("gpu_limit", "0.6"),
                ("priority", "50"),
            ],
        ));
        v.push(pod(
            &format!("allreduce-{i}"),
            &[
                ("gpu_request", "0.5"),
                ("gpu_limit", "0.5"),
                a100,
                ("group_name", "allreduce"),
                ("group_headcount", "3"),
                ("group_threshold", "1.0"),
            ],
        ));
    }
    v
}

/// Review finding (demo order): every pod of the demo is placed whatever order
/// the scheduler takes them in, with the tags honoured. (Without "the first pod
/// of an affinity tag takes the GPU with the most headroom" and "others leave
/// the room a tag's pending pods need", the reverse order strands stage-1.)
#[test]
fn the_demo_places_every_pod_in_any_order() {
    let base = demo_pods();
    let n = base.len();
    let mut orders: Vec<Vec<usize>> = vec![(0..n).collect(), (0..n).rev().collect()];
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..40 {
        let mut o: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            o.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        orders.push(o);
    }
    for order in orders {
        let mut c = demo_cluster();
        let mut m: Vec<PodInfo> = order.iter().map(|&i| base[i].clone()).collect();
        // All exist before the scheduler starts (kubectl apply -f examples/).
        for p in &m {
            c.note_pod(p);
        }
        let got = schedule_group(&mut c, &mut m, 0);
        let names: Vec<&str> = m.iter().map(|p| p.uid.as_str()).collect();
        let at = |u: &str| {
            let i = names.iter().position(|n| *n == u).unwrap();
            got[i]
                .clone()
                .unwrap_or_else(|| panic!("{u} not placed in order {names:?}"))
        };
        for u in &names {
            at(u);
        }
        assert_eq!(gpu_of(&at("stage-1")), gpu_of(&at("stage-2")), "{names:?}");
        assert_ne!(gpu_of(&at("replica-a")), gpu_of(&at("replica-b")));
        assert_ne!(gpu_of(&at("tenant-a")), gpu_of(&at("tenant-b")));
        assert_eq!(at("trainer").gpu_uuids.len(), 2);
        c.check_invariants().unwrap();
    }
}

/// The same sequence of arrivals gives the same placement, run after run
/// (what `make demo` relies on when it applies its workloads one file at a time).
#[test]
fn the_demo_gives_the_same_table_for_the_same_order() {
    let run = || {
        let mut c = demo_cluster();
        let mut m = demo_pods();
        for p in &m {
            c.note_pod(p);
        }
        schedule_group(&mut c, &mut m, 0)
    };
    assert_eq!(run(), run());
}
