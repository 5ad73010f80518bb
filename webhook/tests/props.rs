//! Property tests over random pod shapes: the patch always applies, a second pass is
//! empty, every container ends up with the injected env and mounts exactly once, and
//! what the user wrote is kept (LD_PRELOAD extended, never dropped).

use base64::Engine;
use kubeshare_webhook::review::{Mode, answer, request_body};
use proptest::prelude::*;
use serde_json::{Value, json};

const HOOK: &str = "/kubeshare/lib/libgemhook.so.1";

#[derive(Debug, Clone)]
enum Preload {
    None,
    Literal(String),
    FromConfigMap,
}

#[derive(Debug, Clone)]
struct ContainerShape {
    env: Option<Vec<String>>,
    preload: Preload,
    mounts: Option<Vec<String>>,
}

fn container_shape() -> impl Strategy<Value = ContainerShape> {
    (
        proptest::option::of(proptest::collection::vec("[A-Z]{1,6}", 0..4)),
        prop_oneof![
            Just(Preload::None),
            "(/[a-z]{1,8}\\.so){1,3}".prop_map(|s| Preload::Literal(s.replace(".so/", ".so:/"))),
            Just(Preload::FromConfigMap),
        ],
        proptest::option::of(proptest::collection::vec("[a-z]{1,6}", 0..3)),
    )
        .prop_map(|(env, preload, mounts)| ContainerShape {
            env,
            preload,
            mounts,
        })
}

fn container(name: String, s: &ContainerShape) -> Value {
    let mut c = json!({"name": name, "image": "x"});
    let mut env: Vec<Value> = Vec::new();
    let mut has_env = s.env.is_some();
    for (i, n) in s.env.iter().flatten().enumerate() {
        // Upper-case names never collide with ours (all contain '_').
        env.push(json!({"name": format!("{n}{i}"), "value": "v"}));
    }
    match &s.preload {
        Preload::None => {}
        Preload::Literal(v) => {
            has_env = true;
            env.insert(env.len() / 2, json!({"name": "LD_PRELOAD", "value": v}));
        }
        Preload::FromConfigMap => {
            has_env = true;
            env.push(json!({"name": "LD_PRELOAD", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}));
        }
    }
    if has_env {
        c["env"] = Value::Array(env);
    }
    if let Some(m) = &s.mounts {
        c["volumeMounts"] = m
            .iter()
            .enumerate()
            .map(|(i, n)| json!({"name": format!("{n}{i}"), "mountPath": format!("/data/{n}{i}")}))
            .collect();
    }
    c
}

fn pod_strategy() -> impl Strategy<Value = (Value, bool)> {
    (
        prop_oneof![
            Just((json!({"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0"}), false)),
            Just((json!({"sharedgpu/gpu_limit": "0.3", "sharedgpu/gpu_count": "2", "sharedgpu/gpu_mem": "4Gi"}), false)),
            Just((json!({"sharedgpu/gpu_request": "4", "sharedgpu/gpu_limit": "4"}), true)),
        ],
        prop_oneof![Just(None), Just(Some("default-scheduler")), Just(Some("kubeshare-scheduler"))],
        proptest::collection::vec(container_shape(), 0..3),
        proptest::collection::vec(container_shape(), 1..4),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|((labels, whole), sched, inits, mains, user_volumes, our_lib)| {
            let mut spec = json!({
                "containers": mains.iter().enumerate().map(|(i, s)| container(format!("c{i}"), s)).collect::<Vec<_>>(),
            });
            if !inits.is_empty() {
                spec["initContainers"] = inits
                    .iter()
                    .enumerate()
                    .map(|(i, s)| container(format!("i{i}"), s))
                    .collect();
            }
            if let Some(s) = sched {
                spec["schedulerName"] = json!(s);
            }
            if user_volumes || our_lib {
                let mut v = vec![json!({"name": "data", "emptyDir": {}})];
                if our_lib {
                    v.push(json!({"name": "kubeshare-lib", "hostPath": {"path": "/var/lib/kubeshare/lib"}}));
                }
                spec["volumes"] = Value::Array(v);
            }
            let pod = json!({"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"generateName": "p-", "labels": labels},
                             "spec": spec});
            (pod, whole)
        })
}

fn admit(pod: &Value) -> Value {
    let body = request_body("u", "CREATE", "ns", Some(pod), None);
    let a = answer(&body, Mode::Mutate).unwrap();
    let v: Value = serde_json::from_slice(&a.body).unwrap();
    v["response"].clone()
}

fn apply(pod: &Value, r: &Value) -> Value {
    let mut out = pod.clone();
    if let Some(p) = r["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap();
    }
    out
}

fn count(list: &Value, name: &str) -> usize {
    list.as_array()
        .map(|l| l.iter().filter(|e| e["name"] == name).count())
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn patch_applies_is_complete_and_idempotent((pod, whole) in pod_strategy()) {
        let r = admit(&pod);
        prop_assert_eq!(&r["allowed"], &json!(true), "{}", r);
        let out = apply(&pod, &r);
        let again = admit(&out);
        prop_assert_eq!(&again["allowed"], &json!(true));
        prop_assert!(again.get("patch").is_none(), "second pass patched: {}", again);

        prop_assert_eq!(&out["spec"]["schedulerName"], &json!("kubeshare-scheduler"));
        let tols = out["spec"]["tolerations"].as_array().cloned().unwrap_or_default();
        prop_assert_eq!(tols.iter().filter(|t| t["key"] == "kubeshare.io/gpu").count(), 1);
        prop_assert_eq!(&out["metadata"], &pod["metadata"]);
        let vols = &out["spec"]["volumes"];
        let want_vols = usize::from(!whole);
        prop_assert_eq!(count(vols, "kubeshare-run"), want_vols);
        if pod["spec"]["volumes"].as_array().is_some_and(|v| v.iter().any(|x| x["name"] == "kubeshare-lib")) {
            prop_assert_eq!(count(vols, "kubeshare-lib"), 1);
        } else {
            prop_assert_eq!(count(vols, "kubeshare-lib"), want_vols);
        }
        for list in ["initContainers", "containers"] {
            let before = pod["spec"][list].as_array().cloned().unwrap_or_default();
            let after = out["spec"][list].as_array().cloned().unwrap_or_default();
            prop_assert_eq!(before.len(), after.len());
            for (b, a) in before.iter().zip(&after) {
                prop_assert_eq!(&a["name"], &b["name"]);
                let env = &a["env"];
                prop_assert_eq!(count(env, "NVIDIA_VISIBLE_DEVICES"), 1);
                let old_preload = b["env"].as_array().and_then(|e| e.iter().find(|x| x["name"] == "LD_PRELOAD")).cloned();
                let new_preload = env.as_array().and_then(|e| e.iter().find(|x| x["name"] == "LD_PRELOAD")).cloned();
                if whole {
                    prop_assert_eq!(old_preload, new_preload);
                    prop_assert_eq!(count(env, "KUBESHARE_POD_UID"), 0);
                    prop_assert!(a.get("volumeMounts") == b.get("volumeMounts"));
                    continue;
                }
                prop_assert_eq!(count(env, "KUBESHARE_POD_UID"), 1);
                prop_assert_eq!(count(env, "LD_PRELOAD"), 1);
                let value = new_preload.as_ref().and_then(|p| p["value"].as_str()).unwrap_or_default().to_string();
                prop_assert!(value.ends_with(HOOK), "{}", value);
                match old_preload {
                    Some(p) if p.get("valueFrom").is_some() => {
                        prop_assert_eq!(value, format!("$(KUBESHARE_USER_LD_PRELOAD):{HOOK}"));
                        prop_assert_eq!(count(env, "KUBESHARE_USER_LD_PRELOAD"), 1);
                    }
                    Some(p) => {
                        let old = p["value"].as_str().unwrap_or_default();
                        prop_assert_eq!(value, format!("{old}:{HOOK}"));
                    }
                    None => prop_assert_eq!(value, HOOK),
                }
                // The user's other env vars are kept, in order, ahead of ours.
                let user: Vec<&Value> = b["env"].as_array().map(|e| e.iter().filter(|x| x["name"] != "LD_PRELOAD").collect()).unwrap_or_default();
                let kept: Vec<&Value> = env.as_array().unwrap().iter().filter(|x| user.contains(x)).collect();
                prop_assert_eq!(kept, user);
                prop_assert_eq!(count(&a["volumeMounts"], "kubeshare-lib"), 1);
                prop_assert_eq!(count(&a["volumeMounts"], "kubeshare-run"), 1);
                let user_mounts = b["volumeMounts"].as_array().cloned().unwrap_or_default();
                let n = user_mounts.len();
                prop_assert_eq!(&a["volumeMounts"].as_array().unwrap()[..n], &user_mounts[..]);
            }
        }
    }

    #[test]
    fn pods_without_a_gpu_get_void_in_every_container(
        inits in proptest::collection::vec(container_shape(), 0..3),
        mains in proptest::collection::vec(container_shape(), 1..4),
        preset in proptest::option::of(prop_oneof![Just("all"), Just("void"), Just("0,1")]),
    ) {
        let mut spec = json!({
            "containers": mains.iter().enumerate().map(|(i, s)| container(format!("c{i}"), s)).collect::<Vec<_>>(),
        });
        if !inits.is_empty() {
            spec["initContainers"] = inits.iter().enumerate().map(|(i, s)| container(format!("i{i}"), s)).collect();
        }
        if let Some(v) = preset {
            let c = &mut spec["containers"][0];
            if c.get("env").is_none() {
                c["env"] = json!([]);
            }
            c["env"].as_array_mut().unwrap().push(json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": v}));
        }
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"generateName": "p-", "labels": {"app": "x"}},
                         "spec": spec});
        let r = admit(&pod);
        prop_assert_eq!(&r["allowed"], &json!(true), "{}", r);
        let out = apply(&pod, &r);
        let again = admit(&out);
        prop_assert!(again.get("patch").is_none(), "second pass patched: {}", again);
        prop_assert_eq!(&out["metadata"], &pod["metadata"]);
        prop_assert!(out["spec"].get("tolerations").is_none());
        for list in ["initContainers", "containers"] {
            let before = pod["spec"][list].as_array().cloned().unwrap_or_default();
            let after = out["spec"][list].as_array().cloned().unwrap_or_default();
            prop_assert_eq!(before.len(), after.len());
            for (b, a) in before.iter().zip(&after) {
                let env = a["env"].as_array().cloned().unwrap_or_default();
                let gpu: Vec<&Value> = env.iter().filter(|e| e["name"] == "NVIDIA_VISIBLE_DEVICES").collect();
                prop_assert_eq!(gpu.len(), 1);
                prop_assert_eq!(gpu[0], &json!({"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}));
                // Everything else the user wrote is kept, in order.
                let user: Vec<&Value> = b["env"].as_array().map(|e| e.iter().filter(|x| x["name"] != "NVIDIA_VISIBLE_DEVICES").collect()).unwrap_or_default();
                let kept: Vec<&Value> = env.iter().filter(|x| x["name"] != "NVIDIA_VISIBLE_DEVICES").collect();
                prop_assert_eq!(kept, user);
                prop_assert!(a.get("volumeMounts") == b.get("volumeMounts"));
            }
        }
    }
}
