//! The webhook's decisions through the AdmissionReview wire path: the JSON Patch it
//! answers, applied to the pod with json-patch, gives the expected pod; a second pass
//! over its own output changes nothing; bad pods are denied with the exact message.

use base64::Engine;
use kubeshare_webhook::review::{Mode, ReviewError, answer, request_body, request_body_sub};
use serde_json::{Value, json};

const HOOK: &str = "/kubeshare/lib/libgemhook.so.1";

/// The decoded response of the webhook to a CREATE of `pod`.
fn review(op: &str, pod: &Value, old: Option<&Value>, mode: Mode) -> Value {
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
fn mutate(pod: &Value) -> Value {
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

/// Mutates and checks that a second pass yields no patch at all.
fn mutate_idempotent(pod: &Value) -> Value {
    let once = mutate(pod);
    let r = review("CREATE", &once, None, Mode::Mutate);
    assert_eq!(r["allowed"], true, "second pass denied: {r}");
    assert!(
        r.get("patch").is_none(),
        "second pass patched again: {}",
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(r["patch"].as_str().unwrap())
                .unwrap()
        )
        .unwrap()
    );
    once
}

fn denial(pod: &Value) -> String {
    let r = review("CREATE", pod, None, Mode::Mutate);
    assert_eq!(r["allowed"], false, "allowed: {r}");
    assert!(r.get("patch").is_none());
    r["status"]["message"].as_str().unwrap().to_string()
}

fn pod_with(labels: Value, spec: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "job-", "namespace": "ns1", "labels": labels},
        "spec": spec,
    })
}

fn frac_labels() -> Value {
    json!({"app": "x", "sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"})
}

fn gpu_env() -> Value {
    json!({"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.annotations['sharedgpu/gpu_uuid']"}}})
}
fn uid_env() -> Value {
    json!({"name": "KUBESHARE_POD_UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}})
}
fn sock_env() -> Value {
    json!({"name": "KUBESHARE_SOCKET_DIR", "value": "/kubeshare/run"})
}
fn preload_env(v: &str) -> Value {
    json!({"name": "LD_PRELOAD", "value": v})
}
fn lib_mount() -> Value {
    json!({"name": "kubeshare-lib", "mountPath": "/kubeshare/lib", "readOnly": true})
}
fn run_mount() -> Value {
    json!({"name": "kubeshare-run", "mountPath": "/kubeshare/run", "subPathExpr": "$(KUBESHARE_POD_UID)"})
}
fn toleration() -> Value {
    json!({"key": "kubeshare.io/gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"})
}
fn void_env() -> Value {
    json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"})
}
fn lib_volume() -> Value {
    json!({"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib", "type": "Directory"}})
}
fn run_volume() -> Value {
    json!({"name": "kubeshare-run", "hostPath": {"path": "/var/lib/kubeshare/pods", "type": "Directory"}})
}

#[test]
fn fractional_pod_with_generate_name_gets_everything() {
    let pod = pod_with(
        frac_labels(),
        json!({"schedulerName": "default-scheduler",
               "containers": [{"name": "main", "image": "cuda"}]}),
    );
    let got = mutate_idempotent(&pod);
    let want = pod_with(
        frac_labels(),
        json!({"schedulerName": "kubeshare-scheduler",
               "containers": [{"name": "main", "image": "cuda",
                   "resources": marked(),
                   "env": [gpu_env(), uid_env(), sock_env(), preload_env(HOOK)],
                   "volumeMounts": [lib_mount(), run_mount()]}],
               "tolerations": [toleration()],
               "volumes": [lib_volume(), run_volume()]}),
    );
    assert_eq!(got, want);
    // The name stays unset: the apiserver generates it after admission.
    assert!(got["metadata"].get("name").is_none());
}

#[test]
fn unset_scheduler_name_is_set() {
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "c", "image": "i"}]}),
    );
    assert_eq!(
        mutate_idempotent(&pod)["spec"]["schedulerName"],
        "kubeshare-scheduler"
    );
}

#[test]
fn every_container_and_init_container_is_injected() {
    let pod = pod_with(
        frac_labels(),
        json!({"schedulerName": "kubeshare-scheduler",
               "initContainers": [
                   {"name": "fetch", "image": "busybox", "env": [{"name": "A", "value": "1"}]},
                   {"name": "warm", "image": "cuda"}],
               "containers": [
                   {"name": "main", "image": "cuda",
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]},
                   {"name": "side", "image": "cuda", "env": [], "volumeMounts": []}],
               "volumes": [{"name": "data", "emptyDir": {}}]}),
    );
    let got = mutate_idempotent(&pod);
    let spec = &got["spec"];
    assert_eq!(
        spec["initContainers"][0]["env"],
        json!([{"name": "A", "value": "1"}, gpu_env(), uid_env(), sock_env(), preload_env(HOOK)])
    );
    assert_eq!(
        spec["initContainers"][1]["env"],
        json!([gpu_env(), uid_env(), sock_env(), preload_env(HOOK)])
    );
    assert_eq!(
        spec["containers"][0]["volumeMounts"],
        json!([{"name": "data", "mountPath": "/data"}, lib_mount(), run_mount()])
    );
    assert_eq!(
        spec["containers"][1]["volumeMounts"],
        json!([lib_mount(), run_mount()])
    );
    assert_eq!(
        spec["containers"][1]["env"],
        json!([gpu_env(), uid_env(), sock_env(), preload_env(HOOK)])
    );
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array().unwrap() {
            assert!(c["volumeMounts"].as_array().unwrap().len() >= 2);
        }
    }
    assert_eq!(
        spec["volumes"],
        json!([{"name": "data", "emptyDir": {}}, lib_volume(), run_volume()])
    );
    // Everything else is left as it was.
    assert_eq!(spec["containers"][0]["image"], "cuda");
    assert_eq!(got["metadata"], pod["metadata"]);
}

#[test]
fn existing_ld_preload_is_extended_not_clobbered() {
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [
            {"name": "a", "image": "i", "env": [{"name": "LD_PRELOAD", "value": "/usr/lib/libjemalloc.so.2"}, {"name": "B", "value": "2"}]},
            {"name": "b", "image": "i", "env": [{"name": "LD_PRELOAD", "value": "/x.so /y.so"}]},
            {"name": "c", "image": "i", "env": [{"name": "LD_PRELOAD", "value": ""}]},
            {"name": "d", "image": "i", "env": [{"name": "LD_PRELOAD", "value": format!("{HOOK}:/z.so")}]}]}),
    );
    let got = mutate_idempotent(&pod);
    let c = &got["spec"]["containers"];
    assert_eq!(
        c[0]["env"],
        json!([preload_env(&format!("/usr/lib/libjemalloc.so.2:{HOOK}")), {"name": "B", "value": "2"}, gpu_env(), uid_env(), sock_env()])
    );
    assert_eq!(c[1]["env"][0], preload_env(&format!("/x.so /y.so:{HOOK}")));
    assert_eq!(c[2]["env"][0], preload_env(HOOK));
    // Already preloading the hook: left alone, not added twice.
    assert_eq!(c[3]["env"][0], preload_env(&format!("{HOOK}:/z.so")));
    assert_eq!(c[3]["env"].as_array().unwrap().len(), 4);
}

#[test]
fn ld_preload_from_value_from_is_kept_under_another_name() {
    let from = json!({"configMapKeyRef": {"name": "preload", "key": "libs"}});
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "a", "image": "i", "env": [{"name": "LD_PRELOAD", "valueFrom": from}]}]}),
    );
    let got = mutate_idempotent(&pod);
    assert_eq!(
        got["spec"]["containers"][0]["env"],
        json!([
            {"name": "KUBESHARE_USER_LD_PRELOAD", "valueFrom": from},
            gpu_env(), uid_env(), sock_env(),
            preload_env(&format!("$(KUBESHARE_USER_LD_PRELOAD):{HOOK}")),
        ])
    );
}

#[test]
fn env_from_gets_a_warning() {
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "a", "image": "i", "envFrom": [{"configMapRef": {"name": "cm"}}]}]}),
    );
    let r = review("CREATE", &pod, None, Mode::Mutate);
    assert_eq!(r["allowed"], true);
    assert_eq!(
        r["warnings"],
        json!([
            "container \"a\": an LD_PRELOAD from envFrom is overridden by KubeShare's; set LD_PRELOAD under env to keep it"
        ])
    );
}

#[test]
fn our_own_volume_already_present_is_not_duplicated() {
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "a", "image": "i"}],
               "volumes": [{"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib", "type": ""}}]}),
    );
    let got = mutate_idempotent(&pod);
    assert_eq!(
        got["spec"]["volumes"],
        json!([{"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib", "type": ""}}, run_volume()])
    );
}

#[test]
fn whole_gpu_pod_gets_gpu_env_but_no_hook() {
    let labels = json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"});
    let pod = pod_with(
        labels.clone(),
        json!({"schedulerName": "default-scheduler",
               "initContainers": [{"name": "i", "image": "x"}],
               "containers": [{"name": "a", "image": "x", "env": [{"name": "LD_PRELOAD", "value": "/keep.so"}]}]}),
    );
    let got = mutate_idempotent(&pod);
    let want = pod_with(
        labels,
        json!({"schedulerName": "kubeshare-scheduler",
               "initContainers": [{"name": "i", "image": "x", "env": [gpu_env()]}],
               "containers": [{"name": "a", "image": "x", "resources": marked(),
                   "env": [{"name": "LD_PRELOAD", "value": "/keep.so"}, gpu_env()]}],
               "tolerations": [toleration()]}),
    );
    assert_eq!(got, want);
}

/// What the webhook adds for kube-scheduler's `managedResources`.
fn marked() -> Value {
    json!({"limits": {"kubeshare.io/gpu-pod": "0"}, "requests": {"kubeshare.io/gpu-pod": "0"}})
}

#[test]
fn gpu_pods_get_the_schedulers_mark_beside_their_own_resources() {
    let main = |resources: Value| {
        json!({"containers": [{"name": "main", "image": "x", "resources": resources},
                              {"name": "side", "image": "x"}]})
    };
    for (have, want) in [
        (json!({}), marked()),
        (
            json!({"limits": {"cpu": "2"}}),
            json!({"limits": {"cpu": "2", "kubeshare.io/gpu-pod": "0"},
                   "requests": {"kubeshare.io/gpu-pod": "0"}}),
        ),
        (
            json!({"limits": {"cpu": "2"}, "requests": {"cpu": "1", "memory": "1Gi"}}),
            json!({"limits": {"cpu": "2", "kubeshare.io/gpu-pod": "0"},
                   "requests": {"cpu": "1", "memory": "1Gi", "kubeshare.io/gpu-pod": "0"}}),
        ),
        // Already marked (the apiserver defaulted requests from limits): kept.
        (marked(), marked()),
    ] {
        let got = mutate_idempotent(&pod_with(frac_labels(), main(have.clone())));
        assert_eq!(
            got["spec"]["containers"][0]["resources"], want,
            "from {have}"
        );
        assert!(got["spec"]["containers"][1].get("resources").is_none());
    }
    // Pods without a GPU demand are not marked: kube-scheduler places them alone.
    for labels in [json!({"app": "x"}), json!({})] {
        let spec = json!({"schedulerName": "kubeshare-scheduler",
                          "containers": [{"name": "main", "image": "x"}]});
        let got = mutate(&pod_with(labels, spec));
        assert!(
            got["spec"]["containers"][0].get("resources").is_none(),
            "{got}"
        );
    }
    // The mark is KubeShare's: another value, or on another container, is refused.
    let msg = "resource kubeshare.io/gpu-pod is KubeShare's mark for its scheduler; leave it out (the webhook sets it to 0 on the first container)";
    // 1 was the mark's quantity before it became 0 (kube-scheduler's fit checks then
    // cost ~0.7 ms per pod at 1,000 nodes): refused like any other value.
    for other in ["1", "2"] {
        let r = json!({"limits": {"kubeshare.io/gpu-pod": other}});
        assert_eq!(
            denial(&pod_with(frac_labels(), main(r))),
            format!("container \"main\": {msg}")
        );
    }
    let side = json!({"containers": [{"name": "main", "image": "x"},
        {"name": "side", "image": "x", "resources": {"requests": {"kubeshare.io/gpu-pod": "0"}}}]});
    assert_eq!(
        denial(&pod_with(frac_labels(), side)),
        format!("container \"side\": {msg}")
    );
}

#[test]
fn pods_kubeshare_gives_no_gpu_get_void_in_every_container() {
    for pod in [
        pod_with(
            json!({"app": "web"}),
            json!({"initContainers": [{"name": "i", "image": "x"}],
                   "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}]}),
        ),
        // Any other scheduler, and a pod on ours without GPU labels: no GPU either.
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
               "spec": {"schedulerName": "my-scheduler",
                        "initContainers": [{"name": "i", "image": "x"}],
                        "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}]}}),
        pod_with(
            json!({}),
            json!({"schedulerName": "kubeshare-scheduler",
                   "initContainers": [{"name": "i", "image": "x"}],
                   "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}]}),
        ),
    ] {
        let got = mutate_idempotent(&pod);
        assert_eq!(got["spec"]["initContainers"][0]["env"], json!([void_env()]));
        assert_eq!(
            got["spec"]["containers"][0]["env"],
            json!([{"name": "A", "value": "1"}, void_env()])
        );
        // No toleration, no hook, nothing else.
        assert!(got["spec"].get("tolerations").is_none());
        assert!(got["spec"].get("volumes").is_none());
        assert_eq!(got["metadata"], pod["metadata"]);
    }
    // Whatever the pod itself says is replaced (with a warning), every occurrence.
    let pod = pod_with(
        json!({"app": "smi"}),
        json!({"tolerations": [{"operator": "Exists"}],
               "containers": [{"name": "a", "image": "x", "env": [
                   {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                   {"name": "B", "value": "2"},
                   {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['x']"}}}]}]}),
    );
    let r = review("CREATE", &pod, None, Mode::Mutate);
    assert_eq!(
        r["warnings"],
        json!([
            "container \"a\": env NVIDIA_VISIBLE_DEVICES (\"all\") replaced by \"void\": this pod gets no GPU from KubeShare; give it sharedgpu/* labels to get one",
            "container \"a\": env NVIDIA_VISIBLE_DEVICES (a valueFrom) replaced by \"void\": this pod gets no GPU from KubeShare; give it sharedgpu/* labels to get one"
        ])
    );
    let got = mutate_idempotent(&pod);
    assert_eq!(
        got["spec"]["containers"][0]["env"],
        json!([void_env(), {"name": "B", "value": "2"}, void_env()])
    );
    // A pod that gets its GPUs from the NVIDIA device plugin keeps its env (the device
    // plugin's NVIDIA_VISIBLE_DEVICES must not be overridden) and may run on KubeShare
    // nodes beside their shared GPUs (device-plugin mode): it gets the toleration.
    let plugin = pod_with(
        json!({"app": "legacy"}),
        json!({"containers": [{"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
    );
    let got = mutate_idempotent(&plugin);
    assert_eq!(got["spec"]["tolerations"], json!([toleration()]));
    assert!(got["spec"]["containers"][0].get("env").is_none(), "{got}");
}

#[test]
fn a_kubeshare_pod_may_not_also_use_the_device_plugin() {
    for (spec, want) in [
        (
            json!({"containers": [{"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
            "container \"main\": resources.limits[nvidia.com/gpu]=1: a pod with sharedgpu/* labels gets its GPU from KubeShare, not from the NVIDIA device plugin (which would give it a second GPU that KubeShare does not count); remove nvidia.com/gpu from its requests and limits",
        ),
        (
            json!({"initContainers": [{"name": "prep", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "2"}}}],
                   "containers": [{"name": "main", "image": "x"}]}),
            "init container \"prep\": resources.requests[nvidia.com/gpu]=2: a pod with sharedgpu/* labels gets its GPU from KubeShare, not from the NVIDIA device plugin (which would give it a second GPU that KubeShare does not count); remove nvidia.com/gpu from its requests and limits",
        ),
        (
            json!({"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "x", "resources": {"limits": {"cpu": "1", "nvidia.com/mig-1g.10gb": "1"}}}]}),
            "container \"b\": resources.limits[nvidia.com/mig-1g.10gb]=1: a pod with sharedgpu/* labels gets its GPU from KubeShare, not from the NVIDIA device plugin (which would give it a second GPU that KubeShare does not count); remove nvidia.com/mig-1g.10gb from its requests and limits",
        ),
    ] {
        assert_eq!(denial(&pod_with(frac_labels(), spec.clone())), want);
        let whole = json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"});
        assert_eq!(denial(&pod_with(whole, spec)), want);
    }
    // Other extended resources are fine.
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "a", "image": "x", "resources": {"limits": {"example.com/fpga": "1"}}}]}),
    );
    mutate_idempotent(&pod);
}

#[test]
fn the_toleration_is_added_once() {
    let pod = pod_with(
        frac_labels(),
        json!({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "containers": [{"name": "a", "image": "x"}]}),
    );
    let got = mutate_idempotent(&pod);
    assert_eq!(
        got["spec"]["tolerations"],
        json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, toleration()])
    );
}

/// An UPDATE of pods/ephemeralcontainers adding `debug` to a running pod.
fn debug_review(labels: Value, debug_env: Option<Value>) -> (Value, Value) {
    let mut old = pod_with(
        labels,
        json!({"schedulerName": "kubeshare-scheduler", "nodeName": "n1",
               "containers": [{"name": "a", "image": "x"}],
               "ephemeralContainers": [{"name": "old", "image": "busybox"}]}),
    );
    old["metadata"]["name"] = json!("p");
    let mut new = old.clone();
    let mut debug = json!({"name": "debug", "image": "cuda", "targetContainerName": "a"});
    if let Some(e) = debug_env {
        debug["env"] = e;
    }
    new["spec"]["ephemeralContainers"]
        .as_array_mut()
        .unwrap()
        .push(debug);
    let body = request_body_sub(
        "u2",
        "UPDATE",
        Some("ephemeralcontainers"),
        "ns1",
        Some(&new),
        Some(&old),
    );
    let v: Value = serde_json::from_slice(&answer(&body, Mode::Mutate).unwrap().body).unwrap();
    let r = v["response"].clone();
    assert_eq!(r["allowed"], true, "{r}");
    let mut out = new.clone();
    if let Some(p) = r["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap();
    }
    (out, r)
}

#[test]
fn debug_containers_are_handled_like_the_pods_containers() {
    // A fractional pod's debug container gets no GPU: the hook's per-pod socket mount
    // needs subPathExpr, which ephemeral containers may not use.
    let (out, _) = debug_review(
        frac_labels(),
        Some(json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])),
    );
    assert_eq!(
        out["spec"]["ephemeralContainers"][1]["env"],
        json!([void_env()])
    );
    // The container that was already there is not touched (it is immutable).
    assert!(out["spec"]["ephemeralContainers"][0].get("env").is_none());
    // A whole-GPU pod's debug container sees the pod's GPUs, from the record.
    let whole = json!({"sharedgpu/gpu_request": "2", "sharedgpu/gpu_limit": "2"});
    let (out, _) = debug_review(whole, None);
    assert_eq!(
        out["spec"]["ephemeralContainers"][1]["env"],
        json!([gpu_env()])
    );
    assert!(
        out["spec"]["ephemeralContainers"][1]
            .get("volumeMounts")
            .is_none()
    );
    // Any other pod's debug container gets void.
    let (out, _) = debug_review(
        json!({"app": "web"}),
        Some(json!([{"name": "X", "value": "1"}])),
    );
    assert_eq!(
        out["spec"]["ephemeralContainers"][1]["env"],
        json!([{"name": "X", "value": "1"}, void_env()])
    );
}

#[test]
fn validate_endpoint_never_patches() {
    let pod = pod_with(
        frac_labels(),
        json!({"containers": [{"name": "a", "image": "x"}]}),
    );
    let r = review("CREATE", &pod, None, Mode::Validate);
    assert_eq!(r["allowed"], true);
    assert!(r.get("patch").is_none());
}

#[test]
fn delete_and_other_kinds_are_allowed() {
    let pod = pod_with(
        json!({"sharedgpu/gpu_request": "9.5"}),
        json!({"containers": []}),
    );
    let body = request_body("u1", "DELETE", "ns1", None, Some(&pod));
    let a = answer(&body, Mode::Mutate).unwrap();
    let v: Value = serde_json::from_slice(&a.body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
}

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

#[test]
fn which_tolerations_reach_a_gpu_node() {
    use k8s_openapi::api::core::v1::PodSpec;
    use kubeshare_webhook::guard::tolerates_gpu_taint;
    let spec = |t: Value| -> PodSpec {
        serde_json::from_value(json!({"containers": [], "tolerations": t})).unwrap()
    };
    for (t, want) in [
        (json!([{"operator": "Exists"}]), true),
        (
            json!([{"operator": "Exists", "effect": "NoSchedule"}]),
            true,
        ),
        (
            json!([{"key": "kubeshare.io/gpu", "operator": "Exists"}]),
            true,
        ),
        (json!([toleration()]), true),
        (
            json!([{"key": "kubeshare.io/gpu", "operator": "Equal", "value": "other"}]),
            false,
        ),
        (
            json!([{"operator": "Exists", "effect": "NoExecute"}]),
            false,
        ),
        (
            json!([{"key": "nvidia.com/gpu", "operator": "Exists"}]),
            false,
        ),
        (
            json!([{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]),
            false,
        ),
        (json!([]), false),
    ] {
        assert_eq!(tolerates_gpu_taint(&spec(t.clone())), want, "{t}");
    }
}
