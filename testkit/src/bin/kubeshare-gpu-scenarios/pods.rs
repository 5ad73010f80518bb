//! The scenarios' pods. Every pod runs in the node's network namespace (the GPU node has
//! no pod network). Two workloads:
//! - `torch`: the host's PyTorch (`--python`, its tree mounted read-only with the host's
//!   /usr) runs hack/gpu-node/gpu_share.py from a ConfigMap, in the `gpu-host` image
//!   (only merged-/usr links and empty dirs, built by hack/gpu-node.sh);
//! - `fake`: cuda-workload on the fake libcuda in the workload image, the simulated GPUs
//!   shared through a hostPath, as the CI node's tests run it.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::ValueEnum;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// The image of the `torch` pods (hack/gpu-node.sh builds it at `up`).
pub const GPU_HOST_IMAGE: &str = "docker.io/kubeshare/gpu-host:latest";
/// The ConfigMap holding gpu_share.py.
pub const SCRIPT_CONFIGMAP: &str = "gpu-node-scripts";
/// The node's test directory (hack/node.sh's /var/lib/kubeshare-test; the host's
/// STATE/node/test): barriers, and the fake GPUs' shared state.
pub const TEST_HOST_DIR: &str = "/var/lib/kubeshare-test";

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
pub enum Workload {
    Torch,
    Fake,
}

/// How a KubeShare pod reaches the GPU's device nodes.
#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
pub enum DeviceAccess {
    /// Privileged containers (every host device): no runtime hands out GPUs here.
    Privileged,
    /// Nothing in the pod: the runtime adds the devices (CDI, through KubeShare's kubelet
    /// plugin and the webhook).
    Cdi,
}

/// What a pod's container does.
#[derive(Clone, Debug)]
pub enum Work {
    /// Matmuls (or fake kernels) for `seconds`, after `barrier` (a file name in the test
    /// directory) appears, if any; prints `ready` first and a result line with `kernels`.
    Share {
        seconds: f64,
        barrier: Option<String>,
    },
    /// The memory the pod sees, then allocations until one is refused.
    Mem { cap_bytes: u64 },
    /// Lists /dev/nvidia* and NVIDIA_VISIBLE_DEVICES (and, with PyTorch, whether CUDA works).
    Probe,
}

/// How the scenarios' pods are made.
#[derive(Clone, Debug)]
pub struct PodEnv {
    pub workload: Workload,
    pub access: DeviceAccess,
    /// The host's python, e.g. /opt/torch/.venv/bin/python.
    pub python: String,
    /// Host directories mounted read-only at the same path (PyTorch's tree, the base
    /// interpreter's prefix if outside /usr).
    pub host_dirs: Vec<String>,
    /// LD_LIBRARY_PATH of the `torch` pods (the driver's library dir).
    pub lib_path: String,
    /// Mount the host's /etc/ld.so.cache (where it exists).
    pub ld_cache: bool,
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The sh command of the fake workload for `work`.
fn fake_script(work: &Work) -> String {
    match work {
        Work::Share { seconds, barrier } => {
            let wait = barrier
                .as_ref()
                .map(|b| format!("while [ ! -e /barrier/{b} ]; do sleep 0.02; done; "))
                .unwrap_or_default();
            format!(
                "echo '{{\"phase\":\"ready\"}}'; {wait}\
                 cuda-workload launch --kernel-us 2000 --seconds {seconds} --sample-ms 250"
            )
        }
        Work::Mem { cap_bytes } => format!(
            // Two blocks of 3/8 of the cap fit, the third does not.
            "cuda-workload meminfo; cuda-workload alloc --bytes {} --count 3",
            cap_bytes / 8 * 3
        ),
        Work::Probe => PROBE_SH.to_string(),
    }
}

const PROBE_SH: &str = "echo NVD=$NVIDIA_VISIBLE_DEVICES; \
    echo DEV=$(ls /dev | grep '^nvidia' | tr '\\n' ' ')";

/// The command of the PyTorch workload for `work`.
fn torch_command(env: &PodEnv, work: &Work) -> Vec<String> {
    let script = "/scripts/gpu_share.py";
    match work {
        Work::Share { seconds, barrier } => {
            let mut c = vec![
                env.python.clone(),
                script.into(),
                "share".into(),
                "--seconds".into(),
                seconds.to_string(),
            ];
            if let Some(b) = barrier {
                c.extend(["--barrier".into(), format!("/barrier/{b}")]);
            }
            c
        }
        Work::Mem { .. } => vec![env.python.clone(), script.into(), "mem".into()],
        Work::Probe => vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("{PROBE_SH}; {} {script} probe", env.python),
        ],
    }
}

/// A pod with one container `main` doing `work`. With sharedgpu labels it is a KubeShare
/// pod and may reach the GPU's device nodes; without, it tolerates every taint.
pub fn pod(env: &PodEnv, name: &str, labels: BTreeMap<String, String>, work: &Work) -> Result<Pod> {
    Ok(serde_json::from_value(pod_json(env, name, labels, work))?)
}

/// [`pod`] as JSON (a Job's template).
pub fn pod_json(env: &PodEnv, name: &str, labels: BTreeMap<String, String>, work: &Work) -> Value {
    let gpu = labels.keys().any(|k| k.starts_with("sharedgpu/"));
    let mut volumes = vec![json!({"name": "barrier", "hostPath":
        {"path": TEST_HOST_DIR, "type": "DirectoryOrCreate"}})];
    let mut mounts = vec![json!({"name": "barrier", "mountPath": "/barrier"})];
    let mut container = match env.workload {
        Workload::Fake => {
            volumes.push(json!({"name": "fake-gpu", "hostPath":
                {"path": format!("{TEST_HOST_DIR}/fake-gpu"), "type": "DirectoryOrCreate"}}));
            mounts.push(json!({"name": "fake-gpu", "mountPath": "/fake-gpu"}));
            json!({
                "image": kubeshare_testkit::WORKLOAD_IMAGE,
                "command": ["/bin/sh", "-c", fake_script(work)],
                "env": [
                    {"name": "FAKE_CUDA_DEVICES", "valueFrom": {"fieldRef":
                        {"fieldPath": "metadata.annotations['sharedgpu/gpu_uuid']"}}},
                    {"name": "FAKE_CUDA_SHARED_DIR", "value": "/fake-gpu"},
                    {"name": "FAKE_CUDA_MEM_BYTES", "value": (80u64 << 30).to_string()},
                ],
            })
        }
        Workload::Torch => {
            let mut dirs = vec!["/usr".to_string()];
            dirs.extend(env.host_dirs.iter().cloned());
            for (i, d) in dirs.iter().enumerate() {
                volumes.push(json!({"name": format!("host-{i}"), "hostPath":
                    {"path": d, "type": "Directory"}}));
                mounts.push(json!({"name": format!("host-{i}"), "mountPath": d, "readOnly": true}));
            }
            if env.ld_cache {
                volumes.push(json!({"name": "ld-cache", "hostPath":
                    {"path": "/etc/ld.so.cache", "type": "File"}}));
                mounts.push(
                    json!({"name": "ld-cache", "mountPath": "/etc/ld.so.cache", "readOnly": true}),
                );
            }
            volumes.push(json!({"name": "scripts", "configMap": {"name": SCRIPT_CONFIGMAP}}));
            mounts.push(json!({"name": "scripts", "mountPath": "/scripts", "readOnly": true}));
            let mut c = json!({
                "image": GPU_HOST_IMAGE,
                "command": torch_command(env, work),
                "env": [
                    {"name": "LD_LIBRARY_PATH", "value": env.lib_path},
                    {"name": "HOME", "value": "/tmp"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                    {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
                ],
            });
            if gpu && env.access == DeviceAccess::Privileged {
                c["securityContext"] = json!({"privileged": true});
            }
            c
        }
    };
    container["name"] = json!("main");
    container["imagePullPolicy"] = json!("IfNotPresent");
    container["volumeMounts"] = Value::Array(mounts);
    let mut spec = json!({
        "hostNetwork": true,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        "volumes": volumes,
    });
    if !gpu {
        // Not a KubeShare pod: it may land on the GPU node only by tolerating its taint
        // (here: every taint), and the webhook then hands it no GPU.
        spec["tolerations"] = json!([{"operator": "Exists"}]);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    })
}

/// A pod whose container gets its share of the GPU `gpu` (a UUID) through the
/// ResourceClaim made from `template` (DRA, docs/dra.md): no sharedgpu labels, so the
/// webhook leaves it alone and the stock scheduler places it; the claim's CDI spec gives
/// the device nodes, the hook and its socket. It tolerates the GPU node's taint itself.
pub fn claim_pod_json(env: &PodEnv, name: &str, template: &str, gpu: &str, work: &Work) -> Value {
    let mut p = pod_json(env, name, BTreeMap::new(), work);
    let spec = &mut p["spec"];
    spec["tolerations"] = json!([{"key": "kubeshare.io/gpu", "operator": "Exists"}]);
    spec["resourceClaims"] = json!([{"name": "gpu", "resourceClaimTemplateName": template}]);
    let c = &mut spec["containers"][0];
    c["resources"] = json!({"claims": [{"name": "gpu"}]});
    if env.workload == Workload::Fake
        && let Some(vars) = c["env"].as_array_mut()
    {
        // No allocation record to read the GPU from: the claim's selector names it.
        for v in vars.iter_mut().filter(|v| v["name"] == "FAKE_CUDA_DEVICES") {
            *v = json!({"name": "FAKE_CUDA_DEVICES", "value": gpu});
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(workload: Workload, access: DeviceAccess) -> PodEnv {
        PodEnv {
            workload,
            access,
            python: "/opt/torch/.venv/bin/python".into(),
            host_dirs: vec!["/opt/torch".into()],
            lib_path: "/usr/local/nvidia/lib64".into(),
            ld_cache: true,
        }
    }

    fn share() -> Work {
        Work::Share {
            seconds: 5.0,
            barrier: Some("go".into()),
        }
    }

    #[test]
    fn torch_pods_run_the_hosts_python_from_read_only_mounts() {
        let p = pod_json(
            &env(Workload::Torch, DeviceAccess::Privileged),
            "p",
            labels(&[("sharedgpu/gpu_request", "0.3")]),
            &share(),
        );
        let c = &p["spec"]["containers"][0];
        assert_eq!(c["image"], GPU_HOST_IMAGE);
        assert_eq!(c["command"][0], "/opt/torch/.venv/bin/python");
        assert_eq!(c["command"][6], "/barrier/go");
        let ro: Vec<&str> = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["readOnly"] == true)
            .map(|m| m["mountPath"].as_str().unwrap())
            .collect();
        assert_eq!(ro, ["/usr", "/opt/torch", "/etc/ld.so.cache", "/scripts"]);
        assert_eq!(c["securityContext"]["privileged"], true);
        assert_eq!(p["spec"]["hostNetwork"], true);
        assert!(p["spec"]["tolerations"].is_null());
    }

    #[test]
    fn only_kubeshare_pods_are_privileged_and_only_with_that_access() {
        let plain = pod_json(
            &env(Workload::Torch, DeviceAccess::Privileged),
            "n",
            labels(&[]),
            &Work::Probe,
        );
        assert!(plain["spec"]["containers"][0]["securityContext"].is_null());
        assert_eq!(plain["spec"]["tolerations"][0]["operator"], "Exists");
        let cdi = pod_json(
            &env(Workload::Torch, DeviceAccess::Cdi),
            "c",
            labels(&[("sharedgpu/gpu_request", "0.3")]),
            &share(),
        );
        assert!(cdi["spec"]["containers"][0]["securityContext"].is_null());
    }

    #[test]
    fn fake_pods_wait_for_the_barrier_and_use_the_shared_fake_gpu() {
        let p = pod_json(
            &env(Workload::Fake, DeviceAccess::Privileged),
            "f",
            labels(&[("sharedgpu/gpu_request", "0.3")]),
            &share(),
        );
        let c = &p["spec"]["containers"][0];
        let sh = c["command"][2].as_str().unwrap();
        assert!(
            sh.contains("/barrier/go") && sh.contains("--seconds 5"),
            "{sh}"
        );
        assert!(c["securityContext"].is_null());
        let mem = fake_script(&Work::Mem { cap_bytes: 4 << 30 });
        assert!(
            mem.ends_with(&format!("--bytes {} --count 3", (4u64 << 30) / 8 * 3)),
            "{mem}"
        );
    }

    #[test]
    fn claim_pods_name_their_claim_and_carry_no_labels() {
        let p = claim_pod_json(
            &env(Workload::Fake, DeviceAccess::Cdi),
            "c30",
            "c30",
            "GPU-1",
            &share(),
        );
        assert!(p["metadata"]["labels"].as_object().unwrap().is_empty());
        assert_eq!(
            p["spec"]["resourceClaims"][0],
            json!({"name": "gpu", "resourceClaimTemplateName": "c30"})
        );
        let c = &p["spec"]["containers"][0];
        assert_eq!(c["resources"]["claims"][0]["name"], "gpu");
        assert!(c["securityContext"].is_null());
        let fake_devices: Vec<&Value> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["name"] == "FAKE_CUDA_DEVICES")
            .collect();
        assert_eq!(
            fake_devices,
            [&json!({"name": "FAKE_CUDA_DEVICES", "value": "GPU-1"})]
        );
        assert_eq!(p["spec"]["tolerations"][0]["key"], "kubeshare.io/gpu");
    }
}
