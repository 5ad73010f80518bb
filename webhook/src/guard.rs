//! GPUs only through KubeShare (docs/design.md, "GPU-node taint" and "Non-KubeShare pods get
//! no GPU"): what admission adds or refuses so that no container sees a GPU KubeShare
//! manages unless KubeShare's record gives it that GPU.
//!
//! - A KubeShare pod tolerates the GPU-node taint `kubeshare.io/gpu=shared:NoSchedule`
//!   (the node daemon puts it on the Node), and may not also ask the NVIDIA device
//!   plugin for `nvidia.com/*` resources.
//! - Every container of any other pod gets `NVIDIA_VISIBLE_DEVICES=void`, overriding what
//!   its image sets (every CUDA base image sets `all`), so that even a pod that tolerates
//!   every taint sees no GPU on a KubeShare node. Pods that request `nvidia.com/*`
//!   resources are left alone: they get their GPUs from the device plugin, on nodes that
//!   KubeShare does not manage (docs/webhook.md says why that holds).

use json_patch::jsonptr::PointerBuf;
use json_patch::{PatchOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::{
    Container, EphemeralContainer, PodSpec, ResourceRequirements, Toleration,
};
use kubeshare_api::{GPU_TAINT_EFFECT, GPU_TAINT_KEY, GPU_TAINT_VALUE};

use crate::inject::{self, ENV_VISIBLE_DEVICES};
use crate::plan::{ContainerAt, Denial, Plan, to_value};

/// The value the NVIDIA container runtime reads as "no GPU, no driver files".
pub const VOID: &str = "void";

/// Extended resources of the NVIDIA device plugin (`nvidia.com/gpu`, MIG slices ...).
pub const DEVICE_PLUGIN_PREFIX: &str = "nvidia.com/";

/// The toleration a KubeShare pod gets.
pub fn toleration() -> Toleration {
    Toleration {
        key: Some(GPU_TAINT_KEY.to_string()),
        operator: Some("Equal".to_string()),
        value: Some(GPU_TAINT_VALUE.to_string()),
        effect: Some(GPU_TAINT_EFFECT.to_string()),
        toleration_seconds: None,
    }
}

/// Adds [`toleration`] unless the pod already has it.
pub(crate) fn plan_toleration(spec: &PodSpec, plan: &mut Plan) {
    let want = toleration();
    let existing = spec.tolerations.as_deref().unwrap_or_default();
    if existing.contains(&want) {
        return;
    }
    plan.append(
        &["spec", "tolerations"],
        spec.tolerations.is_some(),
        vec![to_value(&want)],
    );
}

/// The containers of a pod with their place, init containers first.
fn containers(spec: &PodSpec) -> Vec<(ContainerAt, Container)> {
    let mut out = Vec::new();
    for (field, what, list) in [
        (
            "initContainers",
            "init container",
            spec.init_containers.as_deref().unwrap_or_default(),
        ),
        ("containers", "container", spec.containers.as_slice()),
    ] {
        for (i, c) in list.iter().enumerate() {
            out.push((
                ContainerAt {
                    field,
                    index: i,
                    label: format!("{what} {:?}", c.name),
                },
                c.clone(),
            ));
        }
    }
    for (i, c) in spec
        .ephemeral_containers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        out.push((
            ContainerAt {
                field: "ephemeralContainers",
                index: i,
                label: format!("ephemeral container {:?}", c.name),
            },
            as_container(c),
        ));
    }
    out
}

/// The fields of a debug container that admission looks at, as a `Container`.
pub(crate) fn as_container(ec: &EphemeralContainer) -> Container {
    Container {
        name: ec.name.clone(),
        env: ec.env.clone(),
        env_from: ec.env_from.clone(),
        volume_mounts: ec.volume_mounts.clone(),
        ..Default::default()
    }
}

/// `(kind, name, quantity)` of every device-plugin resource the container asks for.
fn device_plugin_resources(
    r: Option<&ResourceRequirements>,
) -> Vec<(&'static str, String, String)> {
    let Some(r) = r else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (kind, map) in [("limits", &r.limits), ("requests", &r.requests)] {
        for (k, q) in map.iter().flatten() {
            if k.starts_with(DEVICE_PLUGIN_PREFIX) {
                out.push((kind, k.clone(), q.0.clone()));
            }
        }
    }
    out
}

/// Whether any container asks the NVIDIA device plugin for a GPU.
pub fn uses_device_plugin(spec: &PodSpec) -> bool {
    spec.init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .any(|c| !device_plugin_resources(c.resources.as_ref()).is_empty())
}

/// A KubeShare pod that also asks the device plugin for GPUs would get a second GPU
/// that no one counts: refused, naming the container and the resource.
pub(crate) fn refuse_device_plugin_gpus(spec: &PodSpec) -> Result<(), Denial> {
    for (at, c) in containers(spec) {
        if let Some((kind, name, qty)) = device_plugin_resources(c.resources.as_ref())
            .into_iter()
            .next()
        {
            return Err(Denial::invalid(format!(
                "{}: resources.{kind}[{name}]={qty}: a pod with sharedgpu/* labels gets its GPU from KubeShare, not from the NVIDIA device plugin (which would give it a second GPU that KubeShare does not count); remove {name} from its requests and limits",
                at.label
            )));
        }
    }
    Ok(())
}

/// Every container of a pod that KubeShare gives no GPU gets
/// `NVIDIA_VISIBLE_DEVICES=void`, unless the pod gets its GPUs from the device plugin.
pub(crate) fn plan_no_gpu(spec: &PodSpec, plan: &mut Plan) {
    if uses_device_plugin(spec) {
        return;
    }
    for (at, c) in containers(spec) {
        plan_void(&c, &at, plan);
    }
}

/// `NVIDIA_VISIBLE_DEVICES=void` in one container: appended, or replacing every entry
/// of that name that says anything else (with a warning, since the pod asked for it).
pub(crate) fn plan_void(c: &Container, at: &ContainerAt, plan: &mut Plan) {
    let env = c.env.as_deref().unwrap_or_default();
    let ours = |e: &k8s_openapi::api::core::v1::EnvVar| {
        e.value_from.is_none() && e.value.as_deref() == Some(VOID)
    };
    let same: Vec<(usize, &k8s_openapi::api::core::v1::EnvVar)> = env
        .iter()
        .enumerate()
        .filter(|(_, e)| e.name == ENV_VISIBLE_DEVICES)
        .collect();
    if same.is_empty() {
        plan.append(
            &at.path(&["env"]),
            c.env.is_some(),
            vec![to_value(&inject::value_env(ENV_VISIBLE_DEVICES, VOID))],
        );
        return;
    }
    for (j, e) in same {
        if ours(e) {
            continue;
        }
        let was = match (&e.value, &e.value_from) {
            (_, Some(_)) => "a valueFrom".to_string(),
            (Some(v), None) => format!("{v:?}"),
            (None, None) => "\"\"".to_string(),
        };
        plan.warnings.push(format!(
            "{}: env {ENV_VISIBLE_DEVICES} ({was}) replaced by {VOID:?}: this pod gets no GPU from KubeShare; give it sharedgpu/* labels to get one",
            at.label
        ));
        let j = j.to_string();
        plan.ops.push(PatchOperation::Replace(ReplaceOperation {
            path: PointerBuf::from_tokens(at.path(&["env", &j])),
            value: to_value(&inject::value_env(ENV_VISIBLE_DEVICES, VOID)),
        }));
    }
}

/// Whether the pod tolerates the GPU-node taint, so that a scheduler may place it on a
/// KubeShare node (used by tests and docs; the webhook configuration's CEL says the same).
pub fn tolerates_gpu_taint(spec: &PodSpec) -> bool {
    spec.tolerations.iter().flatten().any(|t| {
        let key_ok = match t.key.as_deref() {
            None | Some("") => t.operator.as_deref() == Some("Exists"),
            Some(k) => k == GPU_TAINT_KEY,
        };
        let value_ok = t.operator.as_deref() == Some("Exists")
            || t.value.as_deref().unwrap_or_default() == GPU_TAINT_VALUE;
        let effect_ok = matches!(
            t.effect.as_deref(),
            None | Some("") | Some(GPU_TAINT_EFFECT)
        );
        key_ok && value_ok && effect_ok
    })
}
