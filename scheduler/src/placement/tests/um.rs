//! Unified-memory pods: overcommit up to the factor, never for device pods; the books rebuilt.

use super::*;

fn um(uid: &str, req: &str, mem: &str) -> PodInfo {
    pod(
        uid,
        &[
            ("gpu_request", req),
            ("gpu_limit", "1.0"),
            ("gpu_mem", mem),
            ("gpu_mem_mode", "unified"),
        ],
    )
}

/// Unified-memory pods overcommit a GPU's memory up to the factor (default 1.5) with
/// their resident shares; the record carries the ceiling as `gpu_mem` and the resident
/// share beside it; once they overcommit, no device-mode pod gets in.
#[test]
fn unified_pods_overcommit_up_to_the_factor_and_device_pods_never_do() {
    let mut c = cluster(&[("n1", inv(1, 1, "A", 80, &[]))]);
    let mut got = Vec::new();
    for uid in ["u1", "u2", "u3"] {
        got.push(schedule(&mut c, &mut um(uid, "0.3", "40Gi"), 0).unwrap());
    }
    for a in &got {
        assert_eq!(a.gpu_mem_resident, Some(40 * GIB));
        // Default ceiling: 2 × the resident share.
        assert_eq!(a.gpu_mem, 80 * GIB);
    }
    let u = c.usage();
    assert_eq!((u[0].mem_used, u[0].um_resident), (0, 120 * GIB));
    // 1.5 × 80 GiB is booked: a fourth resident share does not fit, and says why.
    let f = schedule(&mut c, &mut um("u4", "0.05", "1Gi"), 0).unwrap_err();
    assert!(
        f.failed["n1"].contains("unified-memory room (1.5 × what device-mode pods leave)"),
        "{:?}",
        f.failed
    );
    // The share is free (0.1 left) but no memory is: a device-mode pod is refused.
    let mut dev = pod(
        "d1",
        &[
            ("gpu_request", "0.05"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", "1Mi"),
        ],
    );
    let f = schedule(&mut c, &mut dev, 0).unwrap_err();
    assert!(f.failed["n1"].contains("memory free < "), "{:?}", f.failed);
    c.check_invariants().unwrap();
}

/// Device-mode pods take memory first; unified-memory pods share what they leave,
/// factor-fold; a record read back books each figure where it belongs.
#[test]
fn unified_pods_share_what_device_pods_leave_and_records_rebuild_the_books() {
    let cfg = Config {
        um_overcommit_milli: 2000,
        ..Config::default()
    };
    let mut c = Cluster::new(cfg.clone());
    c.apply_node("n1", Ok(Some(inv(1, 1, "A", 80, &[]))));
    let mut dev = pod(
        "d1",
        &[
            ("gpu_request", "0.5"),
            ("gpu_limit", "1.0"),
            ("gpu_mem", "60Gi"),
        ],
    );
    let d = schedule(&mut c, &mut dev, 0).unwrap();
    assert_eq!((d.gpu_mem, d.gpu_mem_resident), (60 * GIB, None));
    // 2 × (80 − 60) = 40 GiB of unified-memory room.
    let mut a = um("u1", "0.2", "25Gi");
    let a_rec = schedule(&mut c, &mut a, 0).unwrap();
    let f = schedule(&mut c, &mut um("u2", "0.2", "16Gi"), 0).unwrap_err();
    assert!(
        f.failed["n1"].contains("15.0 GiB of unified-memory room (2.0 ×"),
        "{:?}",
        f.failed
    );
    let mut b = um("u3", "0.2", "15Gi");
    schedule(&mut c, &mut b, 0).unwrap();
    // A fresh extender (the restart case) rebuilds the same books from the records.
    let mut fresh = Cluster::new(cfg);
    fresh.apply_node("n1", Ok(Some(inv(1, 1, "A", 80, &[]))));
    for p in [&dev, &a, &b] {
        fresh.apply_pod(p);
    }
    fresh.check_invariants().unwrap();
    assert_eq!(fresh.usage(), c.usage());
    assert_eq!(fresh.usage()[0].um_resident, 40 * GIB);
    assert_eq!(fresh.usage()[0].mem_used, 60 * GIB);
    assert_eq!(a_rec.gpu_mem_resident, Some(25 * GIB));
}
