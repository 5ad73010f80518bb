//! The admission decision for a Pod, free of I/O: validate the `sharedgpu/*` labels
//! (through the API crate, the one label parser) and compute the JSON Patch that
//! makes a KubeShare pod ready for its GPU.
//!
//! CREATE: bad labels are denied with the API crate's message; a KubeShare pod gets
//! `schedulerName`, the GPU env, the hook and its volumes, and the toleration of the
//! GPU-node taint; every other container gets `NVIDIA_VISIBLE_DEVICES=void` (see
//! [`crate::guard`]). UPDATE of `pods/ephemeralcontainers`: a new debug container is
//! handled like a container of its pod. UPDATE of the pod: `sharedgpu/*` labels may not
//! change. The patch is idempotent: admitting the patched pod again yields an empty
//! patch. On CREATE and debug containers, the pod with the patch applied may not mount
//! KubeShare's host directory (see [`crate::hostdir`]).

use std::collections::BTreeMap;

use json_patch::PatchOperation;
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec, Volume, VolumeMount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kubeshare_api::{
    GPU_POD_MARK, GPU_POD_RESOURCE, GpuDemand, PREFIX, is_kubeshare_pod, scheduler_name,
};
use serde::Deserialize;
use serde_json::Value;

use crate::inject::{self, HOOK_PATH};
pub use crate::plan::Denial;
use crate::plan::{ContainerAt, Plan, to_value};
use crate::{guard, hostdir};

/// The scheduler the apiserver writes into a pod that names none. Admission runs after
/// defaulting, so "unset" reaches us as this name.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";

/// What admission does with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Allowed; `patch` may be empty (nothing to change).
    Allow {
        patch: Vec<PatchOperation>,
        warnings: Vec<String>,
    },
    Deny(Denial),
}

impl From<Plan> for Verdict {
    fn from(plan: Plan) -> Verdict {
        Verdict::Allow {
            patch: plan.ops,
            warnings: plan.warnings,
        }
    }
}

impl Verdict {
    fn allow() -> Verdict {
        Verdict::Allow {
            patch: Vec::new(),
            warnings: Vec::new(),
        }
    }
    /// The patch, when allowed.
    pub fn patch(&self) -> Option<&[PatchOperation]> {
        match self {
            Verdict::Allow { patch, .. } => Some(patch),
            Verdict::Deny(_) => None,
        }
    }
    /// The denial message, when denied.
    pub fn denial(&self) -> Option<&Denial> {
        match self {
            Verdict::Deny(d) => Some(d),
            Verdict::Allow { .. } => None,
        }
    }
}

/// The admission operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
    Delete,
    Connect,
}

impl Operation {
    pub fn parse(s: &str) -> Option<Operation> {
        match s {
            "CREATE" => Some(Operation::Create),
            "UPDATE" => Some(Operation::Update),
            "DELETE" => Some(Operation::Delete),
            "CONNECT" => Some(Operation::Connect),
            _ => None,
        }
    }
}

/// The subresource whose UPDATE adds debug containers to a running pod.
pub const EPHEMERAL_CONTAINERS: &str = "ephemeralcontainers";

/// How admission is configured (the server's flags).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdmitOptions {
    /// `--gpu-resource`: the device-plugin resource through which the kubelet hands a
    /// container its GPU as CDI devices (`kubeshare.io/gpu`, the node daemon's device
    /// plugin). Each container that gets the allocation's GPUs asks for one; no other
    /// container may. `None`: not asked for (the NVIDIA runtime reads the env instead).
    pub gpu_resource: Option<String>,
}

/// How many of [`AdmitOptions::gpu_resource`] a container that gets the GPUs asks for:
/// one slot, whatever the number of GPUs (the plugin answers with all of the record's).
pub const GPU_RESOURCE_QUANTITY: &str = "1";

/// Decides on a Pod admission request with the default [`AdmitOptions`]. `object` and
/// `old_object` are the raw JSON the apiserver sent; `subresource` is the request's
/// `subResource` (empty or absent for the pod itself).
pub fn admit_pod(
    op: Operation,
    subresource: Option<&str>,
    object: Option<&Value>,
    old_object: Option<&Value>,
) -> Verdict {
    admit_pod_with(
        &AdmitOptions::default(),
        op,
        subresource,
        object,
        old_object,
    )
}

/// [`admit_pod`] configured by `opts`.
pub fn admit_pod_with(
    opts: &AdmitOptions,
    op: Operation,
    subresource: Option<&str>,
    object: Option<&Value>,
    old_object: Option<&Value>,
) -> Verdict {
    let both = |what: &str| match (object, old_object) {
        (Some(new), Some(old)) => {
            parse_pod(new, "object").and_then(|n| parse_pod(old, "oldObject").map(|o| (n, o)))
        }
        _ => Err(Denial::bad_request(format!(
            "{what} request without object and oldObject"
        ))),
    };
    let result = match (op, subresource.unwrap_or_default()) {
        (Operation::Create, "") => match object {
            Some(obj) => parse_pod(obj, "object")
                .and_then(|p| admit_create(opts, &p))
                .and_then(|v| check_host_dir(obj, v)),
            None => Err(Denial::bad_request("CREATE request without an object")),
        },
        (Operation::Update, "") => both("UPDATE").and_then(|(n, o)| admit_update(&n, &o)),
        (Operation::Update, EPHEMERAL_CONTAINERS) => both("UPDATE")
            .and_then(|(n, o)| admit_ephemeral(&n, &o))
            .and_then(|v| check_host_dir(object.unwrap_or(&Value::Null), v)),
        // Other subresources (status, binding, resize) cannot add a container or change
        // its env; the record on pods/binding is guarded by the admission policy.
        _ => Ok(Verdict::allow()),
    };
    result.unwrap_or_else(Verdict::Deny)
}

/// The pod as it will be admitted (the patch applied) may not reach KubeShare's host
/// directory ([`hostdir`]). Checked on the result, so that what the webhook adds and
/// what the pod brings are judged together.
fn check_host_dir(object: &Value, verdict: Verdict) -> Result<Verdict, Denial> {
    let Verdict::Allow { patch, .. } = &verdict else {
        return Ok(verdict);
    };
    if patch.is_empty() {
        return hostdir::check(&object["spec"]).map(|()| verdict);
    }
    // What the patch adds passes by construction: copy and patch only the pods that
    // bring something of their own.
    if !hostdir::needs_check(&object["spec"])? {
        return Ok(verdict);
    }
    let mut pod = object.clone();
    json_patch::patch(&mut pod, patch)
        .map_err(|e| Denial::bad_request(format!("the webhook's patch does not apply: {e}")))?;
    hostdir::check(&pod["spec"])?;
    Ok(verdict)
}

fn parse_pod(v: &Value, what: &str) -> Result<Pod, Denial> {
    Pod::deserialize(v).map_err(|e| Denial::bad_request(format!("{what} is not a Pod: {e}")))
}

fn labels_of(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.labels.clone().unwrap_or_default()
}

fn admit_create(opts: &AdmitOptions, pod: &Pod) -> Result<Verdict, Denial> {
    let labels = labels_of(pod);
    // Every sharedgpu/ label is checked, also on pods that would not be ours (a lone
    // `sharedgpu/priority` is a forgotten gpu_limit, not a pod without a GPU).
    let demand = GpuDemand::from_labels_at_admission(&labels)?;
    let Some(spec) = pod.spec.as_ref() else {
        return Err(Denial::bad_request("the pod has no spec"));
    };
    let mut plan = Plan::default();
    let gpu_resource = opts.gpu_resource.as_deref();
    if !is_kubeshare_pod(spec.scheduler_name.as_deref(), &labels) {
        refuse_gpu_resource(spec, gpu_resource)?;
        // Not ours: none of its containers may see a GPU KubeShare manages, unless the
        // kubelet gives it GPUs through NVIDIA's device plugin. Such a pod may also run
        // on KubeShare nodes: their daemon publishes the GPUs it holds, and the extender
        // keeps off them (docs/device-plugin.md).
        if guard::uses_device_plugin(spec) {
            guard::plan_toleration(spec, &mut plan);
        }
        guard::plan_no_gpu(spec, &mut plan);
        return Ok(Verdict::from(plan));
    }
    let ours = scheduler_name();
    match spec.scheduler_name.as_deref() {
        Some(name) if name == ours => {}
        None | Some("") | Some(DEFAULT_SCHEDULER) => {
            plan.add(&["spec", "schedulerName"], Value::from(ours));
        }
        Some(other) => {
            return Err(Denial::invalid(format!(
                "spec.schedulerName={other}: a pod with sharedgpu/gpu_* labels is placed by {ours}; leave schedulerName unset or set it to {ours}"
            )));
        }
    }
    if let Some(node) = spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        return Err(Denial::invalid(format!(
            "spec.nodeName={node}: a KubeShare pod must be placed by {ours}, which picks its GPU; leave nodeName unset (use a nodeSelector or affinity instead)"
        )));
    }
    // A pod on kubeshare-scheduler without GPU labels asks for no GPU: it gets none.
    let Some(demand) = demand else {
        refuse_gpu_resource(spec, gpu_resource)?;
        guard::plan_no_gpu(spec, &mut plan);
        return Ok(Verdict::from(plan));
    };
    guard::refuse_device_plugin_gpus(spec)?;
    guard::plan_toleration(spec, &mut plan);
    check_gpu_pod_marker(spec)?;
    if let Some(r) = gpu_resource {
        check_gpu_resource(spec, r)?;
    }
    let hook = !demand.is_whole();
    if hook {
        plan_volumes(spec, &mut plan)?;
    }
    let groups: [(&str, &str, &[Container]); 2] = [
        (
            "initContainers",
            "init container",
            spec.init_containers.as_deref().unwrap_or_default(),
        ),
        ("containers", "container", spec.containers.as_slice()),
    ];
    for (field, what, containers) in groups {
        for (i, c) in containers.iter().enumerate() {
            let at = ContainerAt {
                field,
                index: i,
                label: format!("{what} {:?}", c.name),
            };
            plan_env(c, &at, hook, demand.um.is_some(), &mut plan)?;
            if hook {
                plan_mounts(c, &at, &mut plan)?;
            }
            // The containers that get the allocation's GPUs in their env ask the kubelet
            // for them too, so that the device plugin hands them the GPUs' device nodes
            // as CDI devices (docs/node.md, "CDI"). The first app container also
            // carries the scheduler's mark.
            let mut wants = Vec::new();
            if field == "containers" && i == 0 {
                wants.push((GPU_POD_RESOURCE, GPU_POD_MARK));
            }
            if let Some(r) = gpu_resource {
                wants.push((r, GPU_RESOURCE_QUANTITY));
            }
            plan_resources(c, &at, &wants, &mut plan);
        }
    }
    Ok(Verdict::from(plan))
}

/// The quantity of `resource` a container asks for, in its limits and its requests.
fn asked<'a>(c: &'a Container, resource: &str) -> [Option<&'a Quantity>; 2] {
    let r = c.resources.as_ref();
    [
        r.and_then(|r| r.limits.as_ref())
            .and_then(|m| m.get(resource)),
        r.and_then(|r| r.requests.as_ref())
            .and_then(|m| m.get(resource)),
    ]
}

fn all_containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.init_containers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .chain(&spec.containers)
}

/// A pod that gets no GPU from KubeShare may not ask for the GPU resource: the device
/// plugin would refuse it at the kubelet anyway (no allocation record), later and
/// less clearly.
fn refuse_gpu_resource(spec: &PodSpec, resource: Option<&str>) -> Result<(), Denial> {
    let Some(resource) = resource else {
        return Ok(());
    };
    match all_containers(spec).find(|c| asked(c, resource).iter().any(Option::is_some)) {
        Some(c) => Err(Denial::invalid(format!(
            "container {:?}: resource {resource} is given by KubeShare to the containers of pods with sharedgpu/gpu_* labels; leave it out (add the labels to ask for a GPU)",
            c.name
        ))),
        None => Ok(()),
    }
}

/// A KubeShare pod that sets the GPU resource itself must set it as the webhook does.
fn check_gpu_resource(spec: &PodSpec, resource: &str) -> Result<(), Denial> {
    let want = Quantity(GPU_RESOURCE_QUANTITY.into());
    for c in all_containers(spec) {
        if asked(c, resource).iter().flatten().any(|q| **q != want) {
            return Err(Denial::invalid(format!(
                "container {:?}: resource {resource} is set by KubeShare to {GPU_RESOURCE_QUANTITY} on every container (the allocation decides which GPUs); leave it out",
                c.name
            )));
        }
    }
    Ok(())
}

/// Adds each of `wants` (resource, quantity) to the container's limits and requests
/// where it is missing (extended resources need both, equal).
fn plan_resources(c: &Container, at: &ContainerAt, wants: &[(&str, &str)], plan: &mut Plan) {
    if wants.is_empty() {
        return;
    }
    let all = || {
        Value::Object(
            wants
                .iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect(),
        )
    };
    let Some(r) = c.resources.as_ref() else {
        plan.add(
            &at.path(&["resources"]),
            serde_json::json!({"limits": all(), "requests": all()}),
        );
        return;
    };
    for (key, map) in [("limits", &r.limits), ("requests", &r.requests)] {
        match map {
            None => plan.add(&at.path(&["resources", key]), all()),
            Some(m) => {
                for (name, q) in wants {
                    if !m.contains_key(*name) {
                        plan.add(&at.path(&["resources", key, name]), Value::from(*q));
                    }
                }
            }
        }
    }
}

/// `kubeshare.io/gpu-pod: 0` goes in the first container's limits and requests
/// ([`plan_resources`]): the mark by which kube-scheduler sends the pod to the
/// extender (its `managedResources`; see [`GPU_POD_RESOURCE`] and [`GPU_POD_MARK`]).
/// A pod that sets it itself must set it to 0 there, and nowhere else.
fn check_gpu_pod_marker(spec: &PodSpec) -> Result<(), Denial> {
    let mark_quantity = Quantity(GPU_POD_MARK.into());
    let init = spec.init_containers.as_deref().unwrap_or_default();
    for (i, c) in init.iter().chain(&spec.containers).enumerate() {
        let r = c.resources.as_ref();
        let maps = [
            r.and_then(|r| r.limits.as_ref()),
            r.and_then(|r| r.requests.as_ref()),
        ];
        let first = i == init.len();
        for q in maps
            .into_iter()
            .flatten()
            .filter_map(|m| m.get(GPU_POD_RESOURCE))
        {
            if !first || *q != mark_quantity {
                return Err(Denial::invalid(format!(
                    "container {:?}: resource {GPU_POD_RESOURCE} is KubeShare's mark for its scheduler; leave it out (the webhook sets it to {GPU_POD_MARK} on the first container)",
                    c.name
                )));
            }
        }
    }
    Ok(())
}

fn plan_volumes(spec: &PodSpec, plan: &mut Plan) -> Result<(), Denial> {
    let existing = spec.volumes.as_deref().unwrap_or_default();
    let mut new = Vec::new();
    for want in [inject::lib_volume(), inject::run_volume()] {
        match existing.iter().find(|v| v.name == want.name) {
            None => new.push(to_value(&want)),
            Some(v) if is_our_volume(v, &want) => {}
            Some(_) => {
                return Err(Denial::invalid(format!(
                    "volume {name}: the name is reserved by KubeShare, which mounts {what} under it; rename the pod's volume",
                    name = want.name,
                    what = if want.name == inject::LIB_VOLUME {
                        "the GPU hook library"
                    } else {
                        "the pod's scheduler sockets"
                    },
                )));
            }
        }
    }
    plan.append(&["spec", "volumes"], spec.volumes.is_some(), new);
    Ok(())
}

fn is_our_volume(v: &Volume, want: &Volume) -> bool {
    match (&v.host_path, &want.host_path) {
        (Some(have), Some(want)) => have.path == want.path,
        _ => false,
    }
}

/// What an injected env var must be.
enum EnvWant {
    Field(String),
    Value(&'static str),
}

impl EnvWant {
    fn matches(&self, e: &EnvVar) -> bool {
        match self {
            EnvWant::Field(fp) => {
                e.value.as_deref().unwrap_or_default().is_empty()
                    && e.value_from
                        .as_ref()
                        .and_then(|s| s.field_ref.as_ref())
                        .is_some_and(|f| &f.field_path == fp)
            }
            EnvWant::Value(v) => e.value_from.is_none() && e.value.as_deref() == Some(v),
        }
    }
    fn to_env(&self, name: &str) -> EnvVar {
        match self {
            EnvWant::Field(fp) => inject::field_env(name, fp),
            EnvWant::Value(v) => inject::value_env(name, v),
        }
    }
}

pub(crate) fn plan_env(
    c: &Container,
    at: &ContainerAt,
    hook: bool,
    unified: bool,
    plan: &mut Plan,
) -> Result<(), Denial> {
    let env = c.env.as_deref().unwrap_or_default();
    let mut wants = vec![(
        inject::ENV_VISIBLE_DEVICES,
        EnvWant::Field(inject::visible_devices_field_path()),
    )];
    if hook {
        wants.push((
            inject::ENV_POD_UID,
            EnvWant::Field(inject::POD_UID_FIELD_PATH.to_string()),
        ));
        wants.push((
            inject::ENV_SOCKET_DIR,
            EnvWant::Value(inject::RUN_MOUNT_PATH),
        ));
    }
    if hook && unified {
        // Unified-memory mode (docs/um.md): the hook's switch, and its prefetch budget from
        // the record's resident share.
        wants.push((kubeshare_api::um::HOOK_UM_ENV, EnvWant::Value("1")));
        wants.push((
            kubeshare_api::um::HOOK_UM_RESIDENT_ENV,
            EnvWant::Field(inject::um_resident_field_path()),
        ));
    }
    let mut new = Vec::new();
    for (name, want) in &wants {
        let mut same = env.iter().filter(|e| e.name == *name);
        match (same.next(), same.next()) {
            (None, _) => new.push(to_value(&want.to_env(name))),
            (Some(e), None) if want.matches(e) => {}
            _ => {
                return Err(Denial::invalid(format!(
                    "{}: env {name} is set by KubeShare ({}); remove it from the pod",
                    at.label,
                    match *name {
                        inject::ENV_VISIBLE_DEVICES => "from the GPU allocation at bind",
                        inject::ENV_POD_UID => "from the pod's UID",
                        kubeshare_api::um::HOOK_UM_ENV
                        | kubeshare_api::um::HOOK_UM_RESIDENT_ENV => {
                            "for unified-memory mode, from sharedgpu/gpu_mem_mode and the GPU allocation"
                        }
                        _ => "to the mount of the pod's scheduler sockets",
                    }
                )));
            }
        }
    }
    if hook {
        plan_ld_preload(c, env, at, plan, &mut new)?;
    }
    let env_path = at.path(&["env"]);
    plan.append(&env_path, c.env.is_some(), new);
    Ok(())
}

/// `LD_PRELOAD` gets the hook appended, never replacing what the user preloads.
/// A literal value is extended in place; a value from `valueFrom` (ConfigMap, Secret,
/// field) is moved to `KUBESHARE_USER_LD_PRELOAD` and our `LD_PRELOAD` refers to it.
fn plan_ld_preload(
    c: &Container,
    env: &[EnvVar],
    at: &ContainerAt,
    plan: &mut Plan,
    new: &mut Vec<Value>,
) -> Result<(), Denial> {
    let mut found = env
        .iter()
        .enumerate()
        .filter(|(_, e)| e.name == inject::ENV_LD_PRELOAD);
    let existing = match (found.next(), found.next()) {
        (_, Some(_)) => {
            return Err(Denial::invalid(format!(
                "{}: env {} is defined more than once; define it once (KubeShare appends its hook to it)",
                at.label,
                inject::ENV_LD_PRELOAD
            )));
        }
        (e, None) => e,
    };
    let user_var_taken = env.iter().any(|e| e.name == inject::ENV_USER_LD_PRELOAD);
    let idx_s;
    match existing {
        None => {
            if user_var_taken {
                return Err(reserved_user_var(at));
            }
            new.push(to_value(&inject::value_env(
                inject::ENV_LD_PRELOAD,
                HOOK_PATH,
            )));
            if !c.env_from.as_deref().unwrap_or_default().is_empty() {
                plan.warnings.push(format!(
                    "{}: an LD_PRELOAD from envFrom is overridden by KubeShare's; set LD_PRELOAD under env to keep it",
                    at.label
                ));
            }
        }
        Some((j, e)) if e.value_from.is_none() => {
            let v = e.value.as_deref().unwrap_or_default();
            if !inject::preloads_hook(v) {
                let value = if v.trim().is_empty() {
                    HOOK_PATH.to_string()
                } else {
                    format!("{}:{HOOK_PATH}", v.trim_end_matches([':', ' ']))
                };
                idx_s = j.to_string();
                plan.add(&at.path(&["env", &idx_s, "value"]), Value::from(value));
            }
        }
        Some((j, _)) => {
            if user_var_taken {
                return Err(reserved_user_var(at));
            }
            idx_s = j.to_string();
            plan.add(
                &at.path(&["env", &idx_s, "name"]),
                Value::from(inject::ENV_USER_LD_PRELOAD),
            );
            new.push(to_value(&inject::value_env(
                inject::ENV_LD_PRELOAD,
                &format!("$({}):{HOOK_PATH}", inject::ENV_USER_LD_PRELOAD),
            )));
        }
    }
    Ok(())
}

fn reserved_user_var(at: &ContainerAt) -> Denial {
    Denial::invalid(format!(
        "{}: env {} is reserved by KubeShare (it carries an LD_PRELOAD given with valueFrom); rename it",
        at.label,
        inject::ENV_USER_LD_PRELOAD
    ))
}

fn plan_mounts(c: &Container, at: &ContainerAt, plan: &mut Plan) -> Result<(), Denial> {
    let mounts = c.volume_mounts.as_deref().unwrap_or_default();
    let mut new = Vec::new();
    for want in [inject::lib_mount(), inject::run_mount()] {
        if let Some(m) = mounts.iter().find(|m| m.name == want.name) {
            if is_our_mount(m, &want) {
                continue;
            }
            return Err(Denial::invalid(format!(
                "{}: volume {} is mounted at {}; KubeShare mounts it at {} itself, remove the mount",
                at.label, m.name, m.mount_path, want.mount_path
            )));
        }
        if let Some(m) = mounts
            .iter()
            .find(|m| m.mount_path.trim_end_matches('/') == want.mount_path)
        {
            return Err(Denial::invalid(format!(
                "{}: mount path {} (volume {}) is reserved by KubeShare for volume {}; mount it elsewhere",
                at.label, want.mount_path, m.name, want.name
            )));
        }
        new.push(to_value(&want));
    }
    let path = at.path(&["volumeMounts"]);
    plan.append(&path, c.volume_mounts.is_some(), new);
    Ok(())
}

fn is_our_mount(m: &VolumeMount, want: &VolumeMount) -> bool {
    m.mount_path == want.mount_path
        && m.sub_path_expr == want.sub_path_expr
        && m.sub_path.as_deref().unwrap_or_default().is_empty()
        && m.read_only.unwrap_or(false) == want.read_only.unwrap_or(false)
}

fn sharedgpu_labels(labels: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    labels
        .iter()
        .filter(|(k, _)| k.starts_with(PREFIX))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn admit_update(new: &Pod, old: &Pod) -> Result<Verdict, Denial> {
    let new_labels = labels_of(new);
    let old_labels = labels_of(old);
    let (n, o) = (sharedgpu_labels(&new_labels), sharedgpu_labels(&old_labels));
    if n == o {
        return Ok(Verdict::allow());
    }
    // Every label that differs, for the message.
    let mut keys: Vec<&str> = n.keys().chain(o.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let describe = |m: &BTreeMap<&str, &str>, k: &str| {
        m.get(k)
            .map(|v| format!("{k}={v}"))
            .unwrap_or_else(|| format!("no {k}"))
    };
    let changes: Vec<String> = keys
        .into_iter()
        .filter(|k| n.get(k) != o.get(k))
        .map(|k| format!("{} -> {}", describe(&o, k), describe(&n, k)))
        .collect();
    // The same rule as the ValidatingAdmissionPolicy kubeshare-record (which also holds
    // while this webhook is down): the share was checked at admission, and it is what
    // the extender books and the pod's env and hook were built for.
    Err(Denial::forbidden(format!(
        "{}: sharedgpu/* labels cannot change after the pod is created (the GPU share they ask for was checked and set up when it was created); delete and re-create the pod",
        changes.join(", ")
    )))
}

/// UPDATE of `pods/ephemeralcontainers`: the debug containers that are new get what a
/// container of this pod gets. A whole-GPU pod's debug container sees the pod's GPUs;
/// any other gets `NVIDIA_VISIBLE_DEVICES=void`: a fractional pod's hook needs the
/// per-pod socket mount (`subPathExpr`), which ephemeral containers may not have, and a
/// debug container without the hook would use the GPU unthrottled.
fn admit_ephemeral(new: &Pod, old: &Pod) -> Result<Verdict, Denial> {
    let Some(spec) = new.spec.as_ref() else {
        return Err(Denial::bad_request("the pod has no spec"));
    };
    let existing: Vec<&str> = old
        .spec
        .as_ref()
        .and_then(|s| s.ephemeral_containers.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    let labels = labels_of(new);
    let whole = is_kubeshare_pod(spec.scheduler_name.as_deref(), &labels)
        && GpuDemand::from_labels(&labels)
            .ok()
            .flatten()
            .is_some_and(|d| d.is_whole());
    let mut plan = Plan::default();
    for (i, ec) in spec
        .ephemeral_containers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        if existing.contains(&ec.name.as_str()) {
            // Already admitted (and immutable now).
            continue;
        }
        let c = guard::as_container(ec);
        let at = ContainerAt {
            field: "ephemeralContainers",
            index: i,
            label: format!("ephemeral container {:?}", ec.name),
        };
        if whole {
            plan_env(&c, &at, false, false, &mut plan)?;
        } else {
            guard::plan_void(&c, &at, &mut plan);
        }
    }
    Ok(Verdict::from(plan))
}
