//! Table-driven tests of every label rule: valid label sets and the exact denial
//! message for malformed ones.

use std::collections::BTreeMap;

use kubeshare_api::{GpuDemand, GpuShare, GroupSpec, Milli, is_kubeshare_pod};

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
        .collect()
}

fn m(v: u16) -> Milli {
    Milli::new(v).unwrap()
}

fn parse(pairs: &[(&str, &str)]) -> GpuDemand {
    GpuDemand::from_labels(&labels(pairs))
        .unwrap_or_else(|e| panic!("{pairs:?}: {e}"))
        .expect("a GPU demand")
}

#[test]
fn no_sharedgpu_labels_is_no_demand() {
    let mut l = BTreeMap::new();
    l.insert("app".to_string(), "web".to_string());
    assert_eq!(GpuDemand::from_labels(&l), Ok(None));
    assert!(!is_kubeshare_pod(None, &l));
    assert!(is_kubeshare_pod(Some("kubeshare-scheduler"), &l));
    assert!(!is_kubeshare_pod(Some("default-scheduler"), &l));
    assert!(is_kubeshare_pod(None, &labels(&[("gpu_limit", "0.5")])));
    // Only gpu_* labels mark a pod as ours.
    assert!(!is_kubeshare_pod(None, &labels(&[("priority", "3")])));
}

#[test]
fn valid_label_sets() {
    let d = parse(&[("gpu_request", "0.5"), ("gpu_limit", "1.0")]);
    assert_eq!(
        d.share,
        GpuShare::Fraction {
            request: m(500),
            limit: m(1000),
            count: 1
        }
    );
    assert_eq!(d.priority, 0);
    assert_eq!(d.mem, None);

    // request defaults to 0 when only the limit is set.
    let d = parse(&[("gpu_limit", "0.3")]);
    assert_eq!(
        d.share,
        GpuShare::Fraction {
            request: m(0),
            limit: m(300),
            count: 1
        }
    );

    // Whole GPUs: integer or integer-valued decimal, limit = request.
    assert_eq!(
        parse(&[("gpu_request", "2"), ("gpu_limit", "2")]).share,
        GpuShare::Whole { gpus: 2 }
    );
    assert_eq!(
        parse(&[("gpu_request", "4.0"), ("gpu_limit", "4")]).share,
        GpuShare::Whole { gpus: 4 }
    );
    // Exactly one GPU stays on the fractional path (it can still be time-shared up to its limit).
    assert_eq!(
        parse(&[("gpu_request", "1"), ("gpu_limit", "1.0")]).share,
        GpuShare::Fraction {
            request: m(1000),
            limit: m(1000),
            count: 1
        }
    );

    let d = parse(&[
        ("gpu_request", "0.25"),
        ("gpu_limit", "0.5"),
        ("gpu_count", "2"),
        ("gpu_mem", "8Gi"),
        ("gpu_model", "NVIDIA-H100-80GB-HBM3"),
        ("priority", "100"),
        ("group_name", "train-a"),
        ("group_headcount", "5"),
        ("group_threshold", "0.6"),
        ("sched_affinity", "red"),
        ("sched_anti-affinity", "blue"),
        ("sched_exclusion", "tenant-1"),
    ]);
    assert_eq!(
        d.share,
        GpuShare::Fraction {
            request: m(250),
            limit: m(500),
            count: 2
        }
    );
    assert_eq!(d.mem, Some(8 << 30));
    assert_eq!(d.model.as_deref(), Some("NVIDIA-H100-80GB-HBM3"));
    assert_eq!(d.priority, 100);
    let g = d.group.clone().unwrap();
    assert_eq!(
        g,
        GroupSpec {
            name: "train-a".into(),
            headcount: 5,
            threshold: m(600)
        }
    );
    assert_eq!(g.min_members(), 3);
    assert_eq!(d.affinity.as_deref(), Some("red"));
    assert_eq!(d.anti_affinity.as_deref(), Some("blue"));
    assert_eq!(d.exclusion.as_deref(), Some("tenant-1"));
    assert_eq!(d.gpu_count(), 2);

    // The KubeShare 2.0 README's spelling of the group label.
    let d = parse(&[
        ("gpu_limit", "0.5"),
        ("pod_group_name", "g"),
        ("group_headcount", "3"),
        ("group_threshold", "1"),
    ]);
    assert_eq!(d.group.unwrap().min_members(), 3);
    // Both spellings with the same value are fine.
    parse(&[
        ("gpu_limit", "0.5"),
        ("group_name", "g"),
        ("pod_group_name", "g"),
        ("group_headcount", "3"),
        ("group_threshold", "0.5"),
    ]);
    // Memory as plain bytes.
    assert_eq!(
        parse(&[("gpu_limit", "0.5"), ("gpu_mem", "1073741824")]).mem,
        Some(1 << 30)
    );
}

#[test]
fn min_members_rounds_up() {
    for (h, t, want) in [
        (5, 600, 3),
        (3, 1000, 3),
        (4, 500, 2),
        (7, 1, 1),
        (10, 333, 4),
        (1, 100, 1),
    ] {
        let g = GroupSpec {
            name: "g".into(),
            headcount: h,
            threshold: m(t),
        };
        assert_eq!(g.min_members(), want, "{h} x {t}");
    }
}

#[test]
fn default_memory_is_request_share() {
    let d = parse(&[("gpu_request", "0.5"), ("gpu_limit", "1.0")]);
    assert_eq!(d.mem_on(80 << 30), 40 << 30);
    let d = parse(&[("gpu_request", "0.333"), ("gpu_limit", "1.0")]);
    assert_eq!(d.mem_on(1000), 333);
    let d = parse(&[("gpu_request", "2"), ("gpu_limit", "2")]);
    assert_eq!(d.mem_on(80 << 30), 80 << 30);
    let d = parse(&[
        ("gpu_request", "0.5"),
        ("gpu_limit", "1"),
        ("gpu_mem", "1Gi"),
    ]);
    assert_eq!(d.mem_on(80 << 30), 1 << 30);
}

const KNOWN: &str = "unknown KubeShare label (a typo?); known labels are gpu_request, gpu_limit, gpu_mem, gpu_mem_mode, gpu_mem_managed, gpu_count, gpu_model, priority, group_name, group_headcount, group_threshold, sched_affinity, sched_anti-affinity, sched_exclusion";
const NEED_LIMIT: &str = "sharedgpu/gpu_limit is required as well (the most of a GPU the pod may use; use the same value as gpu_request for a fixed share)";
const GROUP_WHY: &str =
    "(coscheduling needs group_name, group_headcount and group_threshold together)";
const SHARE_FORM: &str = "written with digits on both sides of any decimal point and no sign or spaces, such as 0.5 (not .5, +0.5, 1. or ' 0.5', which are not valid label values either)";
const REQ_NAN: &str = "must be a decimal between 0.0 and 1.0, or a whole number of GPUs such as 2, written with digits on both sides of any decimal point and no sign or spaces, such as 0.5 (not .5, +0.5, 1. or ' 0.5', which are not valid label values either)";
const FORMS: &str = "accepted: a whole number of bytes written as a Kubernetes quantity: digits with an optional decimal point, then nothing (bytes), a binary suffix Ki, Mi, Gi, Ti, Pi or Ei (powers of 1024), a decimal suffix k, M, G, T, P or E (powers of 1000), or an exponent e<N>; for example 1073741824, 8Gi, 1.5Gi, 500M, 1e9, 1Ei";
const NOT_LABEL: &str = "is not a valid Kubernetes label value (at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit), so the apiserver would refuse it";
const FRAC: &str =
    "a fractional request must be at most 1.0; whole GPUs are written as an integer such as 2";
const LIM_ABOVE: &str = "must be at most 1.0 for a fractional request; for whole GPUs set gpu_request and gpu_limit to the same integer";
const PRECISE: &str =
    "at most 3 decimal places are allowed (shares are counted in thousandths of a GPU)";
const PRIO: &str = "must be a whole number from 0 to 100 (0 = opportunistic, 1-100 = guaranteed)";
const LABEL_VALUE: &str = "must be 1-63 characters of letters, digits, '-', '_' or '.', starting and ending with a letter or digit";
const MODEL: &str =
    "must be a GPU model as NVML names it, spaces written as '-', such as NVIDIA-H100-80GB-HBM3";
const THRESH: &str = "must be a decimal greater than 0 and at most 1.0 (the fraction of the group that must start together)";

#[test]
fn malformed_label_sets_are_denied_with_exact_messages() {
    let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        // gpu_request
        (vec![("gpu_request", "1.5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=1.5: {FRAC}")),
        (vec![("gpu_request", "2.5"), ("gpu_limit", "2.5")], format!("sharedgpu/gpu_request=2.5: {FRAC}")),
        (vec![("gpu_request", "abc"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=abc: {REQ_NAN}")),
        (vec![("gpu_request", ""), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=: {REQ_NAN}")),
        (vec![("gpu_request", "-0.5"), ("gpu_limit", "1.0")], "sharedgpu/gpu_request=-0.5: must not be negative".into()),
        (vec![("gpu_request", "0.1234"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=0.1234: {PRECISE}")),
        (vec![("gpu_request", "1e-1"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=1e-1: {REQ_NAN}")),
        (vec![("gpu_request", "NaN"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=NaN: {REQ_NAN}")),
        (vec![("gpu_request", "0,5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=0,5: {REQ_NAN}")),
        (vec![("gpu_request", "half"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=half: {REQ_NAN}")),
        (vec![("gpu_request", "100"), ("gpu_limit", "100")], "sharedgpu/gpu_request=100: at most 64 whole GPUs may be requested by one pod".into()),
        (vec![("gpu_request", "0.6"), ("gpu_limit", "0.5")], "sharedgpu/gpu_request=0.6: must not exceed sharedgpu/gpu_limit=0.5".into()),
        (vec![("gpu_request", "1.0"), ("gpu_limit", "0.9")], "sharedgpu/gpu_request=1.0: must not exceed sharedgpu/gpu_limit=0.9".into()),
        // gpu_limit
        (vec![("gpu_request", "0.5")], format!("sharedgpu/gpu_request=0.5: {NEED_LIMIT}")),
        (vec![("gpu_mem", "1Gi")], format!("sharedgpu/gpu_mem=1Gi: {NEED_LIMIT}")),
        (vec![("priority", "5")], format!("sharedgpu/priority=5: {NEED_LIMIT}")),
        (vec![("gpu_limit", "0")], "sharedgpu/gpu_limit=0: must be greater than 0".into()),
        (vec![("gpu_request", "0"), ("gpu_limit", "0.0")], "sharedgpu/gpu_limit=0.0: must be greater than 0".into()),
        (vec![("gpu_limit", "1.5")], format!("sharedgpu/gpu_limit=1.5: {LIM_ABOVE}")),
        (vec![("gpu_request", "0.5"), ("gpu_limit", "2")], format!("sharedgpu/gpu_limit=2: {LIM_ABOVE}")),
        (vec![("gpu_limit", "lots")], format!("sharedgpu/gpu_limit=lots: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        // Values the apiserver would refuse as label values are refused first, naming the label.
        (vec![("gpu_request", " 0.5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request= 0.5: {REQ_NAN}")),
        (vec![("gpu_request", ".5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=.5: {REQ_NAN}")),
        (vec![("gpu_request", "+0.5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=+0.5: {REQ_NAN}")),
        (vec![("gpu_request", "1."), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=1.: {REQ_NAN}")),
        (vec![("gpu_limit", " 0.5")], format!("sharedgpu/gpu_limit= 0.5: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_limit", ".5")], format!("sharedgpu/gpu_limit=.5: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_limit", "+0.5")], format!("sharedgpu/gpu_limit=+0.5: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_limit", "1.")], format!("sharedgpu/gpu_limit=1.: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_limit", "0.5"), ("gpu_count", " 2")], "sharedgpu/gpu_count= 2: must be a whole number from 1 to 16".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_count", "+2")], "sharedgpu/gpu_count=+2: must be a whole number from 1 to 16".into()),
        (vec![("gpu_limit", "0.5"), ("priority", " 5")], format!("sharedgpu/priority= 5: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "3"), ("group_threshold", ".5")], format!("sharedgpu/group_threshold=.5: {THRESH}")),
        (vec![("gpu_limit", "-1")], "sharedgpu/gpu_limit=-1: must not be negative".into()),
        (vec![("gpu_limit", "0.00001")], format!("sharedgpu/gpu_limit=0.00001: {PRECISE}")),
        (vec![("gpu_request", "2"), ("gpu_limit", "1.0")], "sharedgpu/gpu_limit=1.0: must equal sharedgpu/gpu_request=2: whole GPUs are not time-shared, so their limit is their request".into()),
        (vec![("gpu_request", "2"), ("gpu_limit", "3")], "sharedgpu/gpu_limit=3: must equal sharedgpu/gpu_request=2: whole GPUs are not time-shared, so their limit is their request".into()),
        // gpu_count
        (vec![("gpu_limit", "0.5"), ("gpu_count", "0")], "sharedgpu/gpu_count=0: must be a whole number from 1 to 16".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_count", "17")], "sharedgpu/gpu_count=17: must be a whole number from 1 to 16".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_count", "1.5")], "sharedgpu/gpu_count=1.5: must be a whole number from 1 to 16".into()),
        (vec![("gpu_request", "2"), ("gpu_limit", "2"), ("gpu_count", "2")], "sharedgpu/gpu_count=2: only applies to a fractional gpu_request (at most 1.0); for whole GPUs set gpu_request to the number of GPUs".into()),
        // gpu_mem
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "8GB")], format!("sharedgpu/gpu_mem=8GB: unknown suffix \"GB\"; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "lots")], format!("sharedgpu/gpu_mem=lots: not a Kubernetes quantity; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "")], format!("sharedgpu/gpu_mem=: not a Kubernetes quantity; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", ".5Gi")], format!("sharedgpu/gpu_mem=.5Gi: {NOT_LABEL}; write a quantity without sign or spaces and with digits on both sides of any decimal point, such as 0.5Gi or 512Mi")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "+1Gi")], format!("sharedgpu/gpu_mem=+1Gi: {NOT_LABEL}; write a quantity without sign or spaces and with digits on both sides of any decimal point, such as 0.5Gi or 512Mi")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", " 1Gi")], format!("sharedgpu/gpu_mem= 1Gi: {NOT_LABEL}; write a quantity without sign or spaces and with digits on both sides of any decimal point, such as 0.5Gi or 512Mi")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "16Ei")], "sharedgpu/gpu_mem=16Ei: is too large: at most 18446744073709551615 bytes (16Ei minus one byte)".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "18446744073709551616")], "sharedgpu/gpu_mem=18446744073709551616: is too large: at most 18446744073709551615 bytes (16Ei minus one byte)".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "0")], "sharedgpu/gpu_mem=0: must be greater than 0 (leave it out to get the request's share of the GPU's memory)".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "-5")], format!("sharedgpu/gpu_mem=-5: {NOT_LABEL}; write a quantity without sign or spaces and with digits on both sides of any decimal point, such as 0.5Gi or 512Mi")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "0.5")], format!("sharedgpu/gpu_mem=0.5: is not a whole number of bytes; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "1e-3")], format!("sharedgpu/gpu_mem=1e-3: is not a whole number of bytes; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "99999999999Pi")], "sharedgpu/gpu_mem=99999999999Pi: is too large: at most 18446744073709551615 bytes (16Ei minus one byte)".into()),
        // gpu_model
        (vec![("gpu_limit", "0.5"), ("gpu_model", "NVIDIA H100")], format!("sharedgpu/gpu_model=NVIDIA H100: {MODEL}")),
        (vec![("gpu_limit", "0.5"), ("gpu_model", "")], format!("sharedgpu/gpu_model=: {MODEL}")),
        // priority
        (vec![("gpu_limit", "0.5"), ("priority", "101")], format!("sharedgpu/priority=101: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("priority", "-1")], format!("sharedgpu/priority=-1: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("priority", "high")], format!("sharedgpu/priority=high: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("priority", "1.5")], format!("sharedgpu/priority=1.5: {PRIO}")),
        // coscheduling
        (vec![("gpu_limit", "0.5"), ("group_name", "g")], format!("sharedgpu/group_name=g: sharedgpu/group_headcount is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "3")], format!("sharedgpu/group_name=g: sharedgpu/group_threshold is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_headcount", "3"), ("group_threshold", "0.5")], format!("sharedgpu/group_headcount=3: sharedgpu/group_name is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_threshold", "0.5")], format!("sharedgpu/group_threshold=0.5: sharedgpu/group_name is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "0"), ("group_threshold", "0.5")], "sharedgpu/group_headcount=0: must be a whole number from 1 to 10000".into()),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "many"), ("group_threshold", "0.5")], "sharedgpu/group_headcount=many: must be a whole number from 1 to 10000".into()),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "3"), ("group_threshold", "1.5")], format!("sharedgpu/group_threshold=1.5: {THRESH}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "3"), ("group_threshold", "0")], format!("sharedgpu/group_threshold=0: {THRESH}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "3"), ("group_threshold", "0.12345")], format!("sharedgpu/group_threshold=0.12345: {PRECISE}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "a"), ("pod_group_name", "b"), ("group_headcount", "3"), ("group_threshold", "0.5")], "sharedgpu/pod_group_name=b: conflicts with sharedgpu/group_name=a; set only one of them".into()),
        (vec![("gpu_limit", "0.5"), ("group_name", "-bad-"), ("group_headcount", "3"), ("group_threshold", "0.5")], format!("sharedgpu/group_name=-bad-: {LABEL_VALUE}")),
        // locality tags
        (vec![("gpu_limit", "0.5"), ("sched_affinity", "")], format!("sharedgpu/sched_affinity=: {LABEL_VALUE}")),
        (vec![("gpu_limit", "0.5"), ("sched_anti-affinity", "a b")], format!("sharedgpu/sched_anti-affinity=a b: {LABEL_VALUE}")),
        (vec![("gpu_limit", "0.5"), ("sched_exclusion", "x/y")], format!("sharedgpu/sched_exclusion=x/y: {LABEL_VALUE}")),
        // unknown and obsolete labels
        (vec![("gpu_limit", "0.5"), ("gpu_requets", "0.5")], format!("sharedgpu/gpu_requets=0.5: {KNOWN}")),
        (vec![("gpu_limit", "0.5"), ("gpu_memory", "1Gi")], format!("sharedgpu/gpu_memory=1Gi: {KNOWN}")),
        (vec![("gpu_limit", "0.5"), ("min_available", "2")], "sharedgpu/min_available=2: is obsolete; use sharedgpu/group_headcount and sharedgpu/group_threshold".into()),
    ];
    assert!(cases.len() >= 40, "only {} cases", cases.len());
    for (pairs, want) in &cases {
        let got = GpuDemand::from_labels(&labels(pairs));
        match got {
            Err(e) => assert_eq!(&e.to_string(), want, "labels {pairs:?}"),
            Ok(d) => panic!("labels {pairs:?} were accepted as {d:?}; wanted: {want}"),
        }
    }
}

#[test]
fn every_kubernetes_quantity_is_accepted_for_gpu_mem() {
    for (v, bytes) in [
        ("1Ei", 1u64 << 60),
        ("15Ei", 15 << 60),
        ("1e9", 1_000_000_000),
        ("1E9", 1_000_000_000),
        ("1E", 1_000_000_000_000_000_000),
        ("1.5Gi", 3 << 29),
        ("500M", 500_000_000),
        ("8Gi", 8 << 30),
        ("512Mi", 512 << 20),
        ("4k", 4000),
        ("1Pi", 1 << 50),
        ("2P", 2_000_000_000_000_000),
        ("1T", 1_000_000_000_000),
        ("1Ti", 1 << 40),
        ("1000m", 1),
        ("18446744073709551615", u64::MAX),
        ("1073741824", 1 << 30),
    ] {
        let d = parse(&[("gpu_request", "0.5"), ("gpu_limit", "0.5"), ("gpu_mem", v)]);
        assert_eq!(d.mem, Some(bytes), "{v}");
    }
}

#[test]
fn admission_refuses_a_zero_memory_cap() {
    const ZERO: &str = "with a gpu_request of 0 and no sharedgpu/gpu_mem, the pod's GPU memory cap would be 0 bytes (the default cap is gpu_request × the GPU's memory), so every GPU allocation it makes would fail; set sharedgpu/gpu_mem (such as 4Gi) or a gpu_request above 0";
    let at = |pairs: &[(&str, &str)]| GpuDemand::from_labels_at_admission(&labels(pairs));
    assert_eq!(
        at(&[("gpu_limit", "0.5")]).unwrap_err().to_string(),
        format!("sharedgpu/gpu_limit=0.5: {ZERO}")
    );
    assert_eq!(
        at(&[("gpu_request", "0"), ("gpu_limit", "1.0")])
            .unwrap_err()
            .to_string(),
        format!("sharedgpu/gpu_request=0: {ZERO}")
    );
    assert_eq!(
        at(&[
            ("gpu_request", "0.000"),
            ("gpu_limit", "0.5"),
            ("gpu_count", "2")
        ])
        .unwrap_err()
        .to_string(),
        format!("sharedgpu/gpu_request=0.000: {ZERO}")
    );
    // With gpu_mem, or any non-zero request, or whole GPUs, the pod is admitted.
    assert!(
        at(&[("gpu_limit", "0.5"), ("gpu_mem", "4Gi")])
            .unwrap()
            .is_some()
    );
    assert!(
        at(&[("gpu_request", "0.001"), ("gpu_limit", "0.5")])
            .unwrap()
            .is_some()
    );
    assert!(
        at(&[("gpu_request", "2"), ("gpu_limit", "2")])
            .unwrap()
            .is_some()
    );
    assert_eq!(at(&[]), Ok(None));
    // Outside admission the labels still parse (pods admitted before this rule).
    assert_eq!(parse(&[("gpu_limit", "0.5")]).mem_on(80 << 30), 0);
}
