//! `--gpu-resource kubeshare.io/gpu` (the CDI route, docs/node.md "CDI"): every container
//! that gets the allocation's GPUs in its env asks the kubelet for one
//! `kubeshare.io/gpu`, so that the node daemon's device plugin hands it the GPUs as CDI
//! devices; no other container may ask for it; without the flag nothing changes.

mod common;

use base64::Engine;
use common::{frac_labels, pod_with};
use kubeshare_webhook::admit::AdmitOptions;
use kubeshare_webhook::review::{Mode, answer_with, request_body};
use serde_json::{Value, json};

const R: &str = "kubeshare.io/gpu";

fn opts() -> AdmitOptions {
    AdmitOptions {
        gpu_resource: Some(R.into()),
    }
}

fn review(pod: &Value, opts: &AdmitOptions) -> Value {
    let body = request_body("u-1", "CREATE", "ns1", Some(pod), None);
    let a = answer_with(&body, Mode::Mutate, opts).expect("a well-formed review");
    let v: Value = serde_json::from_slice(&a.body).unwrap();
    v["response"].clone()
}

/// The pod as admitted with `opts`; a second pass over it must change nothing.
fn mutate(pod: &Value, opts: &AdmitOptions) -> Value {
    let r = review(pod, opts);
    assert_eq!(r["allowed"], true, "denied: {r}");
    let mut out = pod.clone();
    if let Some(p) = r["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap();
    }
    let again = review(&out, opts);
    assert_eq!(again["allowed"], true, "second pass denied: {again}");
    assert!(again.get("patch").is_none(), "second pass patched: {again}");
    out
}

fn denial(pod: &Value, opts: &AdmitOptions) -> String {
    let r = review(pod, opts);
    assert_eq!(r["allowed"], false, "allowed: {r}");
    r["status"]["message"].as_str().unwrap().to_string()
}

/// `(limits, requests)` of `spec.<list>[i]`.
fn resources(pod: &Value, list: &str, i: usize) -> (Value, Value) {
    let r = &pod["spec"][list][i]["resources"];
    (r["limits"].clone(), r["requests"].clone())
}

#[test]
fn every_container_of_a_gpu_pod_asks_for_one() {
    let pod = pod_with(
        frac_labels(),
        json!({"initContainers": [{"name": "init", "image": "x"}],
               "containers": [
                   {"name": "main", "image": "x", "resources": {"limits": {"cpu": "1"}}},
                   {"name": "side", "image": "x", "resources": {"limits": {"memory": "1Gi"}, "requests": {"memory": "1Gi"}}}]}),
    );
    let out = mutate(&pod, &opts());
    assert_eq!(
        resources(&out, "initContainers", 0),
        (json!({R: "1"}), json!({R: "1"}))
    );
    // The first app container also carries the scheduler's mark; its own limits stay.
    assert_eq!(
        resources(&out, "containers", 0),
        (
            json!({"cpu": "1", "kubeshare.io/gpu-pod": "0", R: "1"}),
            json!({"kubeshare.io/gpu-pod": "0", R: "1"})
        )
    );
    assert_eq!(
        resources(&out, "containers", 1),
        (
            json!({"memory": "1Gi", R: "1"}),
            json!({"memory": "1Gi", R: "1"})
        )
    );
    // The same containers get the allocation's GPUs in their env.
    for (list, i) in [("initContainers", 0), ("containers", 0), ("containers", 1)] {
        let env = out["spec"][list][i]["env"].as_array().unwrap();
        assert!(
            env.iter().any(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES"
                && e["valueFrom"]["fieldRef"]["fieldPath"]
                    == "metadata.annotations['sharedgpu/gpu_uuid']"),
            "{list}[{i}]: {env:?}"
        );
    }
}

#[test]
fn a_whole_gpu_pod_asks_for_one_slot_per_container_whatever_its_gpus() {
    let whole = json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"});
    let out = mutate(
        &pod_with(
            whole,
            json!({"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]}),
        ),
        &opts(),
    );
    assert_eq!(
        resources(&out, "containers", 1),
        (json!({R: "1"}), json!({R: "1"}))
    );
    assert_eq!(out["spec"]["containers"][0]["resources"]["limits"][R], "1");
}

#[test]
fn without_the_flag_nothing_is_asked_for() {
    let out = mutate(
        &pod_with(
            frac_labels(),
            json!({"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]}),
        ),
        &AdmitOptions::default(),
    );
    assert_eq!(
        resources(&out, "containers", 0),
        (
            json!({"kubeshare.io/gpu-pod": "0"}),
            json!({"kubeshare.io/gpu-pod": "0"})
        )
    );
    assert_eq!(out["spec"]["containers"][1].get("resources"), None);
}

#[test]
fn pods_without_sharedgpu_labels_get_none_and_may_not_ask() {
    let plain = pod_with(
        json!({"app": "web"}),
        json!({"containers": [{"name": "a", "image": "x"}]}),
    );
    let out = mutate(&plain, &opts());
    assert_eq!(out["spec"]["containers"][0].get("resources"), None);
    let asking = pod_with(
        json!({"app": "web"}),
        json!({"containers": [{"name": "a", "image": "x", "resources": {"limits": {R: "1"}}}]}),
    );
    assert_eq!(
        denial(&asking, &opts()),
        "container \"a\": resource kubeshare.io/gpu is given by KubeShare to the containers of pods with sharedgpu/gpu_* labels; leave it out (add the labels to ask for a GPU)"
    );
    // Nor a pod on KubeShare's scheduler without GPU labels.
    let on_ours = pod_with(
        json!({}),
        json!({"schedulerName": "kubeshare-scheduler", "initContainers": [{"name": "i", "image": "x", "resources": {"requests": {R: "1"}}}],
               "containers": [{"name": "a", "image": "x"}]}),
    );
    assert!(denial(&on_ours, &opts()).starts_with("container \"i\": resource kubeshare.io/gpu"));
    // Without the flag the name is not KubeShare's: left alone.
    assert_eq!(review(&asking, &AdmitOptions::default())["allowed"], true);
}

#[test]
fn a_gpu_pod_may_set_it_only_as_the_webhook_does() {
    let spec = |q: &str| json!({"containers": [{"name": "a", "image": "x", "resources": {"limits": {R: q}, "requests": {R: q}}}]});
    let out = mutate(&pod_with(frac_labels(), spec("1")), &opts());
    assert_eq!(resources(&out, "containers", 0).0[R], "1");
    assert_eq!(
        denial(&pod_with(frac_labels(), spec("2")), &opts()),
        "container \"a\": resource kubeshare.io/gpu is set by KubeShare to 1 on every container (the allocation decides which GPUs); leave it out"
    );
}
