//! One set of books with DRA: what ResourceClaims hold of a GPU counts against label
//! pods, with a reason that names the claims; and, for any mix of label pods and
//! claims, the extender's books and the capacity the node daemon publishes for the
//! stock scheduler never let a GPU's shares add up to more than one GPU.

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kubeshare_api::dra::{DRIVER_NAME, capacity_left, device_name};
use serde_json::json;

use super::*;
use crate::claims::claimed;

/// The node daemon's slice of node `n` (its GPUs from `inv`, UUIDs as attributes).
fn slice(node: &str, inv: &NodeInventory) -> ResourceSlice {
    let devices: Vec<_> = inv
        .gpus
        .iter()
        .map(|g| json!({"name": device_name(g.index), "attributes": {"uuid": {"string": g.uuid}}}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{DRIVER_NAME}")},
        "spec": {"driver": DRIVER_NAME, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}
    }))
    .unwrap()
}

/// Claim `name` allocated `compute` thousandths and `mem` bytes of `node`'s GPU `index`.
fn claim(name: &str, node: &str, index: u32, compute: u32, mem: u64) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"devices": {}},
        "status": {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": DRIVER_NAME, "pool": node,
            "device": device_name(index),
            "consumedCapacity": {"compute": compute.to_string(), "memory": mem.to_string()}
        }]}}}
    }))
    .unwrap()
}

#[test]
fn a_claim_sends_a_label_pod_elsewhere_or_leaves_it_pending_with_the_claims_named() {
    let (i1, i2) = (inv(1, 1, "A", 40, &[]), inv(2, 1, "A", 40, &[]));
    let mut c = cluster(&[("n1", i1.clone()), ("n2", i2.clone())]);
    let slices = [slice("n1", &i1), slice("n2", &i2)];
    // The stock scheduler gave two claims half of n1's GPU.
    let claims = [
        claim("c1", "n1", 0, 300, 4 * GIB),
        claim("c2", "n1", 0, 200, 4 * GIB),
    ];
    c.set_claims(claimed(&claims, &slices));
    assert_eq!(
        c.claim_holds(),
        vec![(
            "n1".to_string(),
            0,
            500,
            8 * GIB,
            "team/c1, team/c2".to_string()
        )]
    );
    // The metrics' view: the claims beside the label pods (none yet), per GPU.
    let u = c.usage();
    assert_eq!(
        u.iter()
            .map(|g| (
                g.node.as_str(),
                g.used_milli,
                g.claimed_milli,
                g.claimed_mem,
                g.claims
            ))
            .collect::<Vec<_>>(),
        [("n1", 0, 500, 8 * GIB, 2), ("n2", 0, 0, 0, 0)]
    );
    // 0.7 fits only beside no claim: n2.
    let a = schedule(&mut c, &mut frac("a", "0.7"), 0).unwrap();
    assert_eq!(gpu_of(&a), ("n2".to_string(), vec![uuid(2, 0)]));
    // Another 0.7 fits nowhere; n1's reason names the claims.
    let f = schedule(&mut c, &mut frac("b", "0.7"), 0).unwrap_err();
    assert_eq!(
        f.failed["n1"],
        "n1/gpu 0: 0.5 free < 0.7 requested, counting 0.5 held by ResourceClaims team/c1, team/c2"
    );
    assert_eq!(f.failed["n2"], "n2/gpu 0: 0.3 free < 0.7 requested");
    // 0.5 still fits beside the claims: the claims hold 0.5, not more.
    let mut half = frac("h", "0.5");
    let h = schedule(&mut c, &mut half, 0).unwrap();
    assert_eq!(h.node, "n1");
    let n1 = &c.usage()[0];
    assert_eq!(
        (n1.used_milli, n1.claimed_milli, n1.holders, n1.claims),
        (500, 500, 1, 2)
    );
    // The claims go (deallocated): b fits where they were... once h is gone too.
    c.delete_pod("h");
    c.set_claims(claimed([], &slices));
    assert_eq!(c.claim_holds(), vec![]);
    let b = schedule(&mut c, &mut frac("b", "0.7"), 0).unwrap();
    assert_eq!(b.node, "n1");
}

#[test]
fn a_pod_refused_for_room_a_claim_holds_is_woken_when_the_claim_goes() {
    let (i1, i2) = (inv(1, 1, "A", 40, &[]), inv(2, 1, "A", 40, &[]));
    let mut c = cluster(&[("n1", i1.clone()), ("n2", i2.clone())]);
    let slices = [slice("n1", &i1), slice("n2", &i2)];
    let c1 = claim("c1", "n1", 0, 700, 4 * GIB);
    let c2 = claim("c2", "n2", 0, 700, 4 * GIB);
    c.set_claims(claimed([&c1, &c2], &slices));
    // Refused for room on n1 only (the names kube-scheduler sent).
    let pending = frac("pending", "0.6");
    let n1 = ["n1".to_string()];
    assert!(c.filter(&pending, &n1, 0).passed.is_empty());
    // A claim that grows, or a claim elsewhere that goes, frees nothing here.
    let bigger = claim("c1", "n1", 0, 800, 4 * GIB);
    c.set_claims(claimed([&bigger, &c2], &slices));
    c.set_claims(claimed([&bigger], &slices));
    assert!(c.take_wake().is_empty(), "no room freed on n1");
    // The claim on n1 is deallocated: the pod is woken, once, and now fits.
    c.set_claims(claimed([], &slices));
    assert_eq!(
        c.take_wake(),
        [("ns".to_string(), "pod-pending".to_string())]
    );
    assert!(c.take_wake().is_empty(), "woken once per refusal");
    assert_eq!(c.filter(&pending, &n1, 0).passed, n1);
    // Memory given back alone wakes too: refused for memory, then the claim's
    // memory shrinks.
    let mut c = cluster(&[("n1", i1.clone())]);
    c.set_claims(claimed([&claim("m", "n1", 0, 100, 30 * GIB)], &slices));
    let p = pod(
        "p",
        &[
            ("gpu_request", "0.1"),
            ("gpu_limit", "0.1"),
            ("gpu_mem", "20Gi"),
        ],
    );
    assert!(c.filter(&p, &n1, 0).passed.is_empty());
    c.set_claims(claimed([&claim("m", "n1", 0, 100, 10 * GIB)], &slices));
    assert_eq!(c.take_wake().len(), 1);
    assert_eq!(c.filter(&p, &n1, 0).passed, n1);
    c.check_invariants().unwrap();
}

#[test]
fn claimed_memory_and_whole_gpus() {
    let i1 = inv(1, 2, "A", 40, &[]);
    let mut c = cluster(&[("n1", i1.clone())]);
    // No slice read yet: the device name gives the GPU (index 1).
    c.set_claims(claimed(&[claim("m", "n1", 1, 100, 30 * GIB)], []));
    assert_eq!(c.claim_holds()[0].1, 1);
    // Memory: 30 GiB of gpu 1 is claimed, so 20 GiB goes to gpu 0 only.
    let mut p = pod(
        "p",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "0.5"),
            ("gpu_mem", "20Gi"),
        ],
    );
    let a = schedule(&mut c, &mut p, 0).unwrap();
    assert_eq!(a.gpu_uuids, vec![uuid(1, 0)]);
    let mut q = pod(
        "q",
        &[
            ("gpu_request", "0.1"),
            ("gpu_limit", "0.1"),
            ("gpu_mem", "25Gi"),
        ],
    );
    // Neither GPU has 25 GiB; gpu 1 (more share free) says why, naming the claim.
    let f = schedule(&mut c, &mut q, 0).unwrap_err();
    assert_eq!(
        f.failed["n1"],
        "n1/gpu 1: 10.0 GiB memory free < 25.0 GiB requested, counting 0.1 held by ResourceClaims team/m"
    );
    // A whole GPU's share: gpu 0 holds p, gpu 1 a claim, so neither is all free.
    let f = schedule(
        &mut c,
        &mut pod("w", &[("gpu_request", "1"), ("gpu_limit", "1")]),
        0,
    )
    .unwrap_err();
    assert_eq!(
        f.failed["n1"],
        "n1/gpu 1: 0.9 free < 1.0 requested, counting 0.1 held by ResourceClaims team/m"
    );
}

/// One step of a mixed workload on one node of two GPUs.
#[derive(Debug, Clone)]
enum Step {
    /// A label pod asks the extender for this share (thousandths).
    Label(u16),
    /// A claim asks the stock scheduler for this share of the GPU at this index.
    Claim(u32, u16),
    /// The n-th label pod (modulo those placed) ends.
    EndLabel(usize),
    /// The n-th claim (modulo those allocated) is deallocated.
    EndClaim(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1u16..=1000).prop_map(Step::Label),
        (0u32..2, 1u16..=1000).prop_map(|(g, m)| Step::Claim(g, m)),
        any::<usize>().prop_map(Step::EndLabel),
        any::<usize>().prop_map(Step::EndClaim),
    ]
}

proptest! {
    #[test]
    fn labels_and_claims_never_overbook_a_gpu(steps in prop::collection::vec(step(), 1..40)) {
        let i1 = inv(1, 2, "A", 40, &[]);
        let mut c = cluster(&[("n1", i1.clone())]);
        let slices = [slice("n1", &i1)];
        let mut labels: Vec<(String, Allocation)> = Vec::new();
        let mut claims: Vec<(u32, u16, u64)> = Vec::new();
        let mut next = 0u32;
        // What label pods hold of GPU g: (thousandths, bytes), as the node daemon
        // counts them for the slice.
        let label_use = |labels: &[(String, Allocation)], g: u32| {
            labels
                .iter()
                .filter(|(_, a)| a.gpu_uuids.contains(&uuid(1, g)))
                .fold((0u32, 0u64), |(m, b), (_, a)| {
                    (m + u32::from(a.granted.request_per_gpu().get()), b + a.gpu_mem)
                })
        };
        for s in steps {
            next += 1;
            match s {
                Step::Label(m) => {
                    let r = format!("{}", f64::from(m) / 1000.0);
                    let mut p = pod(
                        &format!("p{next}"),
                        &[("gpu_request", &r), ("gpu_limit", &r), ("gpu_mem", "4Gi")],
                    );
                    if let Ok(a) = schedule(&mut c, &mut p, 0) {
                        labels.push((p.uid.clone(), a));
                    }
                }
                Step::Claim(g, m) => {
                    // The stock scheduler: the device's capacity is what label pods
                    // leave, less what claims already booked.
                    let (lm, lb) = label_use(&labels, g);
                    let (cap, cap_mem) = capacity_left(40 * GIB, lm, lb);
                    let (cm, cb) = claims
                        .iter()
                        .filter(|x| x.0 == g)
                        .fold((0u32, 0u64), |(m, b), x| (m + u32::from(x.1), b + x.2));
                    if cm + u32::from(m) <= u32::from(cap) && cb + 4 * GIB <= cap_mem {
                        claims.push((g, m, 4 * GIB));
                    }
                }
                Step::EndLabel(n) if !labels.is_empty() => {
                    let (uid, _) = labels.remove(n % labels.len());
                    c.delete_pod(&uid);
                }
                Step::EndClaim(n) if !claims.is_empty() => {
                    claims.remove(n % claims.len());
                }
                Step::EndLabel(_) | Step::EndClaim(_) => {}
            }
            let objs: Vec<ResourceClaim> = claims
                .iter()
                .enumerate()
                .map(|(k, &(g, m, b))| claim(&format!("c{k}"), "n1", g, u32::from(m), b))
                .collect();
            c.set_claims(claimed(&objs, &slices));
            c.check_invariants().unwrap();
            for g in 0..2 {
                let (lm, lb) = label_use(&labels, g);
                let (cm, cb) = claims
                    .iter()
                    .filter(|x| x.0 == g)
                    .fold((0u32, 0u64), |(m, b), x| (m + u32::from(x.1), b + x.2));
                prop_assert!(lm + cm <= 1000, "gpu {g}: labels {lm} + claims {cm}");
                prop_assert!(lb + cb <= 40 * GIB, "gpu {g}: memory {lb} + {cb}");
            }
        }
    }
}
