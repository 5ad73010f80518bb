//! What the AdmissionReview tests share: a review through the wire path, the patched pod,
//! a denial's message, and pods to feed them.
// Each test crate uses a part of it.
#![allow(dead_code)]

use base64::Engine;
use kubeshare_webhook::review::{Mode, answer, request_body};
use serde_json::{Value, json};

/// The decoded response of the webhook to a CREATE of `pod`.
pub fn review(op: &str, pod: &Value, old: Option<&Value>, mode: Mode) -> Value {
    let body = request_body(
        "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e01",
        op,
        "ns1",
        Some(pod),
        old,
    );
    let a = answer(&body, mode).expect("a well-formed review");
    let v: Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(v["kind"], "AdmissionReview");
    assert_eq!(v["response"]["uid"], "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e01");
    v["response"].clone()
}

/// Applies the webhook's patch to `pod`; panics when it denies.
pub fn mutate(pod: &Value) -> Value {
    let r = review("CREATE", pod, None, Mode::Mutate);
    assert_eq!(r["allowed"], true, "denied: {r}");
    let mut out = pod.clone();
    if let Some(p) = r["patch"].as_str() {
        assert_eq!(r["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap_or_else(|e| panic!("{e}: {patch:?}"));
    } else {
        assert!(r.get("patchType").is_none());
    }
    out
}

pub fn denial(pod: &Value) -> String {
    let r = review("CREATE", pod, None, Mode::Mutate);
    assert_eq!(r["allowed"], false, "allowed: {r}");
    assert!(r.get("patch").is_none());
    r["status"]["message"].as_str().unwrap().to_string()
}

pub fn pod_with(labels: Value, spec: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "job-", "namespace": "ns1", "labels": labels},
        "spec": spec,
    })
}

pub fn frac_labels() -> Value {
    json!({"app": "x", "sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"})
}
