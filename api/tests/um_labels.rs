//! The unified-memory labels (`gpu_mem_mode`, `gpu_mem_managed`): valid sets, the two
//! figures they give, and the exact denial for each broken rule.

use std::collections::BTreeMap;

use kubeshare_api::um::{DEFAULT_MANAGED_FACTOR, MAX_MANAGED_FACTOR};
use kubeshare_api::{GpuDemand, UmSpec};

const GIB: u64 = 1 << 30;

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
        .collect()
}

fn parse(pairs: &[(&str, &str)]) -> Result<GpuDemand, String> {
    GpuDemand::from_labels(&labels(pairs))
        .map(|d| d.expect("a GPU demand"))
        .map_err(|e| e.to_string())
}

#[test]
fn device_mode_is_the_default_and_can_be_written() {
    let d = parse(&[("gpu_limit", "0.5"), ("gpu_mem", "4Gi")]).unwrap();
    assert_eq!(d.um, None);
    assert_eq!(d.managed_on(80 * GIB), None);
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("gpu_mem", "4Gi"),
        ("gpu_mem_mode", "device"),
    ])
    .unwrap();
    assert_eq!(d.um, None);
}

#[test]
fn unified_mode_gives_a_resident_share_and_a_bounded_ceiling() {
    // Default ceiling: a documented multiple of the resident share.
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("gpu_mem", "4Gi"),
        ("gpu_mem_mode", "unified"),
    ])
    .unwrap();
    assert_eq!(d.um, Some(UmSpec { managed: None }));
    assert_eq!(d.mem_on(80 * GIB), 4 * GIB);
    assert_eq!(
        d.managed_on(80 * GIB),
        Some(DEFAULT_MANAGED_FACTOR * 4 * GIB)
    );
    // Without gpu_mem, the resident share is request × the GPU's memory.
    let d = parse(&[
        ("gpu_request", "0.25"),
        ("gpu_limit", "1.0"),
        ("gpu_mem_mode", "unified"),
    ])
    .unwrap();
    assert_eq!(d.managed_on(80 * GIB), Some(40 * GIB));
    // An explicit ceiling.
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("gpu_mem", "4Gi"),
        ("gpu_mem_mode", "unified"),
        ("gpu_mem_managed", "10Gi"),
    ])
    .unwrap();
    assert_eq!(d.managed_on(80 * GIB), Some(10 * GIB));
    // Exactly the largest factor is accepted.
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("gpu_mem", "1Gi"),
        ("gpu_mem_mode", "unified"),
        ("gpu_mem_managed", "8Gi"),
    ])
    .unwrap();
    assert_eq!(d.managed_on(80 * GIB), Some(MAX_MANAGED_FACTOR * GIB));
    // Written without gpu_mem: bounded at bind by the resident share the GPU gives.
    let d = parse(&[
        ("gpu_request", "0.1"),
        ("gpu_limit", "1.0"),
        ("gpu_mem_mode", "unified"),
        ("gpu_mem_managed", "15Ei"),
    ])
    .unwrap();
    assert_eq!(d.managed_on(10_000), Some(8 * 1000));
    // Round trip through the canonical labels.
    assert_eq!(GpuDemand::from_labels(&d.to_labels()), Ok(Some(d)));
}

#[test]
fn the_resident_share_at_the_limit_of_u64_does_not_overflow_the_ceiling() {
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("gpu_mem", "18446744073709551615"),
        ("gpu_mem_mode", "unified"),
    ])
    .unwrap();
    assert_eq!(d.managed_on(80 * GIB), Some(u64::MAX));
}

#[test]
fn broken_rules_are_denied_with_the_label_value_and_rule() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "managed"),
            ],
            "sharedgpu/gpu_mem_mode=managed: must be `device` (ordinary GPU memory, the default) or `unified`",
        ),
        (
            &[
                ("gpu_request", "2"),
                ("gpu_limit", "2"),
                ("gpu_mem_mode", "unified"),
            ],
            "sharedgpu/gpu_mem_mode=unified: applies to a fractional gpu_request (at most 1.0) only",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_managed", "8Gi"),
            ],
            "sharedgpu/gpu_mem_managed=8Gi: is the managed-memory ceiling of unified-memory mode; set sharedgpu/gpu_mem_mode=unified",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "unified"),
                ("gpu_mem_managed", "2Gi"),
            ],
            "sharedgpu/gpu_mem_managed=2Gi: must be at least sharedgpu/gpu_mem=4Gi",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "unified"),
                ("gpu_mem_managed", "33Gi"),
            ],
            "sharedgpu/gpu_mem_managed=33Gi: must be at most 8 × sharedgpu/gpu_mem=4Gi",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "unified"),
                ("gpu_mem_managed", "0"),
            ],
            "sharedgpu/gpu_mem_managed=0: must be greater than 0",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "unified"),
                ("gpu_mem_managed", "16Ei"),
            ],
            "sharedgpu/gpu_mem_managed=16Ei: ",
        ),
        (
            &[
                ("gpu_limit", "0.5"),
                ("gpu_mem", "4Gi"),
                ("gpu_mem_mode", "unified"),
                ("gpu_mem_managed", "lots"),
            ],
            "sharedgpu/gpu_mem_managed=lots: ",
        ),
    ];
    for (pairs, want) in cases {
        let got = parse(pairs).expect_err("must be denied");
        assert!(
            got.starts_with(want),
            "{pairs:?}:\n got {got}\nwant {want}…"
        );
    }
}
