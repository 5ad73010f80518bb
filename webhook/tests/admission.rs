//! The webhook's decisions through the AdmissionReview wire path: the JSON Patch it
//! answers, applied to the pod with json-patch, gives the expected pod; a second pass
//! over its own output changes nothing; pods it cannot inject are denied with the exact message
//! (label validation and malformed bodies: tests/validation.rs).

mod common;

use base64::Engine;
use common::{denial, frac_labels, mutate, pod_with, review};
use kubeshare_webhook::review::{Mode, answer, request_body, request_body_sub};
use serde_json::{Value, json};

const HOOK: &str = "/kubeshare/lib/libgemhook.so.1";

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
