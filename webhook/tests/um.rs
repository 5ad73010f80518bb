//! Unified-memory pods (docs/um.md): besides what every fractional pod gets, the hook's switch
//! and its prefetch budget from the record's resident share; nothing for device-mode pods;
//! a user's own value for either is refused; the patch is idempotent.

use base64::Engine;
use kubeshare_webhook::review::{Mode, answer, request_body};
use serde_json::{Value, json};

fn review(pod: &Value) -> Value {
    let body = request_body(
        "0df0d5d2-1111-4c3e-9c43-5a1f3c1d9e02",
        "CREATE",
        "ns1",
        Some(pod),
        None,
    );
    let a = answer(&body, Mode::Mutate).expect("a well-formed review");
    let v: Value = serde_json::from_slice(&a.body).unwrap();
    v["response"].clone()
}

fn mutate(pod: &Value) -> Value {
    let r = review(pod);
    assert_eq!(r["allowed"], true, "denied: {r}");
    let mut out = pod.clone();
    if let Some(p) = r["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap();
    }
    out
}

fn pod(extra: Value, env: Value) -> Value {
    let mut labels = json!({"sharedgpu/gpu_request": "0.3", "sharedgpu/gpu_limit": "1.0", "sharedgpu/gpu_mem": "8Gi"});
    for (k, v) in extra.as_object().unwrap() {
        labels[k] = v.clone();
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns1", "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "cuda", "env": env}]},
    })
}

fn env_of(p: &Value) -> Vec<Value> {
    p["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn unified_pods_get_the_switch_and_the_resident_share() {
    let p = mutate(&pod(
        json!({"sharedgpu/gpu_mem_mode": "unified"}),
        json!([]),
    ));
    let env = env_of(&p);
    assert!(
        env.contains(&json!({"name": "KUBESHARE_HOOK_UM", "value": "1"})),
        "{env:?}"
    );
    assert!(
        env.contains(&json!({"name": "KUBESHARE_UM_RESIDENT_BYTES", "valueFrom": {"fieldRef": {
            "apiVersion": "v1", "fieldPath": "metadata.annotations['sharedgpu/gpu_mem_resident']"}}})),
        "{env:?}"
    );
    // A second pass changes nothing.
    assert!(review(&p).get("patch").is_none(), "patched again");
    // Device mode: none of it.
    for labels in [json!({}), json!({"sharedgpu/gpu_mem_mode": "device"})] {
        let env = env_of(&mutate(&pod(labels, json!([]))));
        assert!(
            !env.iter()
                .any(|e| e["name"].as_str().unwrap().starts_with("KUBESHARE_UM")
                    || e["name"] == "KUBESHARE_HOOK_UM"),
            "{env:?}"
        );
    }
}

#[test]
fn a_users_own_um_switch_is_refused() {
    let r = review(&pod(
        json!({"sharedgpu/gpu_mem_mode": "unified"}),
        json!([{"name": "KUBESHARE_HOOK_UM", "value": "0"}]),
    ));
    assert_eq!(r["allowed"], false, "{r}");
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("KUBESHARE_HOOK_UM") && msg.contains("unified-memory"),
        "{msg}"
    );
    // A bad managed ceiling is denied with the label's rule.
    let r = review(&pod(
        json!({"sharedgpu/gpu_mem_mode": "unified", "sharedgpu/gpu_mem_managed": "4Gi"}),
        json!([]),
    ));
    assert_eq!(r["allowed"], false, "{r}");
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("sharedgpu/gpu_mem_managed=4Gi: must be at least sharedgpu/gpu_mem=8Gi"),
        "{r}"
    );
}
