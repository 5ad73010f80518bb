//! The webhook's validation through the AdmissionReview wire path: sharedgpu/* labels that
//! change on an update, label sets and pod shapes it denies (each with its exact message), and
//! malformed bodies rejected as errors, never panics.

mod common;

use common::{denial, frac_labels, pod_with, review};
use kubeshare_webhook::review::{Mode, ReviewError, answer, request_body};
use serde_json::{Value, json};

fn pod_update(old_labels: Value, new_labels: Value, node: Option<&str>) -> Value {
    let mut old = pod_with(
        old_labels,
        json!({"schedulerName": "kubeshare-scheduler", "containers": [{"name": "a", "image": "x"}]}),
    );
    old["metadata"]["name"] = json!("p");
    if let Some(n) = node {
        old["spec"]["nodeName"] = json!(n);
    }
    let mut new = old.clone();
    new["metadata"]["labels"] = new_labels;
    review("UPDATE", &new, Some(&old), Mode::Validate)
}

const NO_CHANGE: &str = "sharedgpu/* labels cannot change after the pod is created (the GPU share they ask for was checked and set up when it was created); delete and re-create the pod";

#[test]
fn sharedgpu_labels_never_change() {
    let half = json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"});
    for node in [Some("node-1"), None] {
        let r = pod_update(
            half.clone(),
            json!({"sharedgpu/gpu_request": "0.7", "sharedgpu/gpu_limit": "1.0"}),
            node,
        );
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 403);
        assert_eq!(
            r["status"]["message"],
            format!("sharedgpu/gpu_request=0.5 -> sharedgpu/gpu_request=0.7: {NO_CHANGE}")
        );
    }
    // Removing one, or several changes at once: all are named.
    let r = pod_update(
        json!({"sharedgpu/gpu_limit": "1.0", "sharedgpu/priority": "3"}),
        json!({"sharedgpu/gpu_limit": "0.5"}),
        Some("n"),
    );
    assert_eq!(
        r["status"]["message"],
        format!(
            "sharedgpu/gpu_limit=1.0 -> sharedgpu/gpu_limit=0.5, sharedgpu/priority=3 -> no sharedgpu/priority: {NO_CHANGE}"
        )
    );
    // Other labels may change.
    let mut other = half.clone();
    other["team"] = json!("b");
    assert_eq!(pod_update(half.clone(), other, Some("n"))["allowed"], true);
    assert_eq!(pod_update(half, json!({}), None)["allowed"], false);
}

#[test]
fn gpu_labels_cannot_be_added_to_an_existing_pod() {
    let old = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "a"}},
                     "spec": {"schedulerName": "default-scheduler", "containers": [{"name": "a", "image": "x"}]}});
    let mut new = old.clone();
    new["metadata"]["labels"]["sharedgpu/gpu_limit"] = json!("0.5");
    let r = review("UPDATE", &new, Some(&old), Mode::Validate);
    assert_eq!(r["allowed"], false);
    assert_eq!(
        r["status"]["message"],
        format!("no sharedgpu/gpu_limit -> sharedgpu/gpu_limit=0.5: {NO_CHANGE}")
    );
}

const FRAC: &str =
    "a fractional request must be at most 1.0; whole GPUs are written as an integer such as 2";
const SHARE_FORM: &str = "written with digits on both sides of any decimal point and no sign or spaces, such as 0.5 (not .5, +0.5, 1. or ' 0.5', which are not valid label values either)";
const REQ_NAN: &str = "must be a decimal between 0.0 and 1.0, or a whole number of GPUs such as 2, written with digits on both sides of any decimal point and no sign or spaces, such as 0.5 (not .5, +0.5, 1. or ' 0.5', which are not valid label values either)";
const FORMS: &str = "accepted: a whole number of bytes written as a Kubernetes quantity: digits with an optional decimal point, then nothing (bytes), a binary suffix Ki, Mi, Gi, Ti, Pi or Ei (powers of 1024), a decimal suffix k, M, G, T, P or E (powers of 1000), or an exponent e<N>; for example 1073741824, 8Gi, 1.5Gi, 500M, 1e9, 1Ei";
const ZERO_MEM: &str = "with a gpu_request of 0 and no sharedgpu/gpu_mem, the pod's GPU memory cap would be 0 bytes (the default cap is gpu_request × the GPU's memory), so every GPU allocation it makes would fail; set sharedgpu/gpu_mem (such as 4Gi) or a gpu_request above 0";
const NEED_LIMIT: &str = "sharedgpu/gpu_limit is required as well (the most of a GPU the pod may use; use the same value as gpu_request for a fixed share)";
const LIM_ABOVE: &str = "must be at most 1.0 for a fractional request; for whole GPUs set gpu_request and gpu_limit to the same integer";
const PRECISE: &str =
    "at most 3 decimal places are allowed (shares are counted in thousandths of a GPU)";
const PRIO: &str = "must be a whole number from 0 to 100 (0 = opportunistic, 1-100 = guaranteed)";
const LABEL_VALUE: &str = "must be 1-63 characters of letters, digits, '-', '_' or '.', starting and ending with a letter or digit";
const GROUP_WHY: &str =
    "(coscheduling needs group_name, group_headcount and group_threshold together)";
const KNOWN: &str = "unknown KubeShare label (a typo?); known labels are gpu_request, gpu_limit, gpu_mem, gpu_mem_mode, gpu_mem_managed, gpu_count, gpu_model, priority, group_name, group_headcount, group_threshold, sched_affinity, sched_anti-affinity, sched_exclusion";
const THRESH: &str = "must be a decimal greater than 0 and at most 1.0 (the fraction of the group that must start together)";

#[test]
fn bad_label_sets_are_denied_with_the_exact_message() {
    let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        (vec![("gpu_request", "1.5"), ("gpu_limit", "1.0")], format!("sharedgpu/gpu_request=1.5: {FRAC}")),
        (vec![("gpu_request", "3.25"), ("gpu_limit", "4")], format!("sharedgpu/gpu_request=3.25: {FRAC}")),
        (vec![("gpu_request", "x"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=x: {REQ_NAN}")),
        (vec![("gpu_request", " "), ("gpu_limit", "1")], format!("sharedgpu/gpu_request= : {REQ_NAN}")),
        (vec![("gpu_request", "+inf"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=+inf: {REQ_NAN}")),
        (vec![("gpu_request", "0x1"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=0x1: {REQ_NAN}")),
        (vec![("gpu_request", "-0.1"), ("gpu_limit", "1")], "sharedgpu/gpu_request=-0.1: must not be negative".into()),
        (vec![("gpu_request", "0.0005"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=0.0005: {PRECISE}")),
        (vec![("gpu_request", "65"), ("gpu_limit", "65")], "sharedgpu/gpu_request=65: at most 64 whole GPUs may be requested by one pod".into()),
        (vec![("gpu_request", "0.8"), ("gpu_limit", "0.4")], "sharedgpu/gpu_request=0.8: must not exceed sharedgpu/gpu_limit=0.4".into()),
        (vec![("gpu_request", "0.5")], format!("sharedgpu/gpu_request=0.5: {NEED_LIMIT}")),
        (vec![("gpu_model", "NVIDIA-A100")], format!("sharedgpu/gpu_model=NVIDIA-A100: {NEED_LIMIT}")),
        (vec![("priority", "10")], format!("sharedgpu/priority=10: {NEED_LIMIT}")),
        (vec![("gpu_limit", "0")], "sharedgpu/gpu_limit=0: must be greater than 0".into()),
        (vec![("gpu_limit", "1.01")], format!("sharedgpu/gpu_limit=1.01: {LIM_ABOVE}")),
        (vec![("gpu_limit", "full")], format!("sharedgpu/gpu_limit=full: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_request", ".5"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=.5: {REQ_NAN}")),
        (vec![("gpu_request", "0.5"), ("gpu_limit", "1.")], format!("sharedgpu/gpu_limit=1.: must be a decimal between 0.0 and 1.0, {SHARE_FORM}")),
        (vec![("gpu_request", "+0.5"), ("gpu_limit", "1")], format!("sharedgpu/gpu_request=+0.5: {REQ_NAN}")),
        (vec![("gpu_limit", "0.5")], format!("sharedgpu/gpu_limit=0.5: {ZERO_MEM}")),
        (vec![("gpu_request", "0"), ("gpu_limit", "0.5")], format!("sharedgpu/gpu_request=0: {ZERO_MEM}")),
        (vec![("gpu_limit", "-0.5")], "sharedgpu/gpu_limit=-0.5: must not be negative".into()),
        (vec![("gpu_request", "4"), ("gpu_limit", "1")], "sharedgpu/gpu_limit=1: must equal sharedgpu/gpu_request=4: whole GPUs are not time-shared, so their limit is their request".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_count", "0")], "sharedgpu/gpu_count=0: must be a whole number from 1 to 16".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_count", "two")], "sharedgpu/gpu_count=two: must be a whole number from 1 to 16".into()),
        (vec![("gpu_request", "3"), ("gpu_limit", "3"), ("gpu_count", "2")], "sharedgpu/gpu_count=2: only applies to a fractional gpu_request (at most 1.0); for whole GPUs set gpu_request to the number of GPUs".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "4GB")], format!("sharedgpu/gpu_mem=4GB: unknown suffix \"GB\"; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "17Ei")], "sharedgpu/gpu_mem=17Ei: is too large: at most 18446744073709551615 bytes (16Ei minus one byte)".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "0Gi")], "sharedgpu/gpu_mem=0Gi: must be greater than 0 (leave it out to get the request's share of the GPU's memory)".into()),
        (vec![("gpu_limit", "0.5"), ("gpu_mem", "lots")], format!("sharedgpu/gpu_mem=lots: not a Kubernetes quantity; {FORMS}")),
        (vec![("gpu_limit", "0.5"), ("gpu_model", "-H100")], "sharedgpu/gpu_model=-H100: must be a GPU model as NVML names it, spaces written as '-', such as NVIDIA-H100-80GB-HBM3".into()),
        (vec![("gpu_limit", "0.5"), ("priority", "1000")], format!("sharedgpu/priority=1000: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("priority", "low")], format!("sharedgpu/priority=low: {PRIO}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g")], format!("sharedgpu/group_name=g: sharedgpu/group_headcount is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "2")], format!("sharedgpu/group_name=g: sharedgpu/group_threshold is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_headcount", "2"), ("group_threshold", "1")], format!("sharedgpu/group_headcount=2: sharedgpu/group_name is required as well {GROUP_WHY}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "10001"), ("group_threshold", "1")], "sharedgpu/group_headcount=10001: must be a whole number from 1 to 10000".into()),
        (vec![("gpu_limit", "0.5"), ("group_name", "g"), ("group_headcount", "4"), ("group_threshold", "2")], format!("sharedgpu/group_threshold=2: {THRESH}")),
        (vec![("gpu_limit", "0.5"), ("group_name", "a"), ("pod_group_name", "b"), ("group_headcount", "2"), ("group_threshold", "1")], "sharedgpu/pod_group_name=b: conflicts with sharedgpu/group_name=a; set only one of them".into()),
        (vec![("gpu_limit", "0.5"), ("sched_affinity", "a.b.")], format!("sharedgpu/sched_affinity=a.b.: {LABEL_VALUE}")),
        (vec![("gpu_limit", "0.5"), ("sched_exclusion", "")], format!("sharedgpu/sched_exclusion=: {LABEL_VALUE}")),
        (vec![("gpu_limit", "0.5"), ("gpu_limt", "0.5")], format!("sharedgpu/gpu_limt=0.5: {KNOWN}")),
        (vec![("gpu_limit", "0.5"), ("min_available", "1")], "sharedgpu/min_available=1: is obsolete; use sharedgpu/group_headcount and sharedgpu/group_threshold".into()),
    ];
    assert!(cases.len() >= 30);
    for (pairs, want) in &cases {
        let labels: serde_json::Map<String, Value> = pairs
            .iter()
            .map(|(k, v)| (format!("sharedgpu/{k}"), json!(v)))
            .collect();
        let pod = pod_with(
            Value::Object(labels),
            json!({"containers": [{"name": "a", "image": "x"}]}),
        );
        let r = review("CREATE", &pod, None, Mode::Mutate);
        assert_eq!(r["allowed"], false, "{pairs:?} allowed");
        assert_eq!(r["status"]["code"], 422, "{pairs:?}");
        assert_eq!(r["status"]["reason"], "Invalid");
        assert_eq!(r["status"]["message"].as_str().unwrap(), want, "{pairs:?}");
    }
}

#[test]
fn pod_shapes_the_webhook_refuses() {
    let spec = |extra: Value| {
        let mut s = json!({"containers": [{"name": "main", "image": "x"}]});
        for (k, v) in extra.as_object().unwrap() {
            s[k] = v.clone();
        }
        s
    };
    let cases = [
        (
            spec(json!({"schedulerName": "volcano"})),
            "spec.schedulerName=volcano: a pod with sharedgpu/gpu_* labels is placed by kubeshare-scheduler; leave schedulerName unset or set it to kubeshare-scheduler",
        ),
        (
            spec(json!({"nodeName": "n1"})),
            "spec.nodeName=n1: a KubeShare pod must be placed by kubeshare-scheduler, which picks its GPU; leave nodeName unset (use a nodeSelector or affinity instead)",
        ),
        (
            spec(json!({"volumes": [{"name": "kubeshare-lib", "emptyDir": {}}]})),
            "volume kubeshare-lib: the name is reserved by KubeShare, which mounts the GPU hook library under it; rename the pod's volume",
        ),
        (
            spec(json!({"volumes": [{"name": "kubeshare-run", "hostPath": {"path": "/tmp"}}]})),
            "volume kubeshare-run: the name is reserved by KubeShare, which mounts the pod's scheduler sockets under it; rename the pod's volume",
        ),
        (
            json!({"containers": [{"name": "main", "image": "x", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}),
            "container \"main\": env NVIDIA_VISIBLE_DEVICES is set by KubeShare (from the GPU allocation at bind); remove it from the pod",
        ),
        (
            json!({"initContainers": [{"name": "init", "image": "x", "env": [{"name": "KUBESHARE_POD_UID", "value": "abc"}]}], "containers": [{"name": "main", "image": "x"}]}),
            "init container \"init\": env KUBESHARE_POD_UID is set by KubeShare (from the pod's UID); remove it from the pod",
        ),
        (
            json!({"containers": [{"name": "main", "image": "x", "env": [{"name": "LD_PRELOAD", "value": "/a.so"}, {"name": "LD_PRELOAD", "value": "/b.so"}]}]}),
            "container \"main\": env LD_PRELOAD is defined more than once; define it once (KubeShare appends its hook to it)",
        ),
        (
            json!({"containers": [{"name": "main", "image": "x", "volumeMounts": [{"name": "cache", "mountPath": "/kubeshare/run"}]}], "volumes": [{"name": "cache", "emptyDir": {}}]}),
            "container \"main\": mount path /kubeshare/run (volume cache) is reserved by KubeShare for volume kubeshare-run; mount it elsewhere",
        ),
    ];
    for (spec, want) in cases {
        let pod = pod_with(frac_labels(), spec);
        assert_eq!(denial(&pod), want);
    }
}

#[test]
fn malformed_bodies_are_errors_not_panics() {
    let cases: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"not json".to_vec(),
        b"[]".to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u","operation":"CREATE"}}"#.to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"","operation":"CREATE"}}"#.to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"u","operation":"EXPLODE"}}"#.to_vec(),
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":7}}"#.to_vec(),
        vec![0xff, 0xfe, 0x00],
    ];
    for body in cases {
        assert!(
            answer(&body, Mode::Mutate).is_err(),
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
    assert!(matches!(
        answer(b"{}", Mode::Mutate),
        Err(ReviewError::Json(_))
    ));
    // A well-formed review whose object is not a Pod is a denial (400), not a crash.
    let body = request_body("u", "CREATE", "ns", Some(&json!({"spec": 5})), None);
    let v: Value = serde_json::from_slice(&answer(&body, Mode::Mutate).unwrap().body).unwrap();
    assert_eq!(v["response"]["allowed"], false);
    assert_eq!(v["response"]["status"]["code"], 400);
    let body = request_body("u", "CREATE", "ns", None, None);
    let v: Value = serde_json::from_slice(&answer(&body, Mode::Mutate).unwrap().body).unwrap();
    assert_eq!(
        v["response"]["status"]["message"],
        "CREATE request without an object"
    );
}
