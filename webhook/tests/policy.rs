//! manifests/admission-policy.yaml against the real kube-apiserver, with the rig's
//! per-identity credentials: only the scheduler extender's identity writes the
//! allocation record (`sharedgpu/*` annotations), on the pod or through a Binding;
//! `sharedgpu/*` labels never change after creation; the namespace opt-out of the
//! webhook needs its own RBAC verb.
//!
//! The policies are created as the manifest writes them, renamed for this test and
//! bound with a selector that matches only this test's objects, so other tests sharing
//! the cluster never meet them. "A user with `patch pods`" is the rig's `webhook`
//! identity (kubeshare:webhook, no rights of its own) given a Role that allows
//! get/create/patch/update on pods and pods/status and create on pods/binding and
//! bindings here.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kubeshare_testkit::{Cluster, Identity, TestNamespace, wait_until};
use serde_json::{Value, json};

mod cluster_rig;
use cluster_rig::{Cleanup, manifest};

const WAIT: Duration = Duration::from_secs(60);
const MALLORY: Identity = Identity::Webhook;

/// The policies and bindings of manifests/admission-policy.yaml, renamed with `token`;
/// the record policy bound to namespace `ns`, the opt-out policy to namespaces labelled
/// `kubeshare-policy-test=token`.
fn policies(ns: &str, token: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for mut doc in manifest("admission-policy.yaml")? {
        let name = doc["metadata"]["name"]
            .as_str()
            .context("metadata.name")?
            .to_string();
        doc["metadata"]["name"] = json!(format!("{name}-{token}"));
        match doc["kind"].as_str() {
            Some("ValidatingAdmissionPolicy") => {}
            Some("ValidatingAdmissionPolicyBinding") => {
                let policy = doc["spec"]["policyName"]
                    .as_str()
                    .context("policyName")?
                    .to_string();
                doc["spec"]["policyName"] = json!(format!("{policy}-{token}"));
                doc["spec"]["matchResources"] = if policy == "kubeshare-record" {
                    json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}})
                } else {
                    json!({"objectSelector": {"matchLabels": {"kubeshare-policy-test": token}}})
                };
            }
            other => bail!("unexpected kind {other:?} in admission-policy.yaml"),
        }
        out.push(doc);
    }
    Ok(out)
}

fn api_error(r: std::result::Result<impl std::fmt::Debug, kube::Error>) -> Result<(u16, String)> {
    match r {
        Err(kube::Error::Api(s)) => Ok((s.code, s.message)),
        Err(other) => bail!("expected an API error, got {other}"),
        Ok(v) => bail!("expected a refusal, got {v:?}"),
    }
}

fn annotate(pairs: Value) -> Patch<Value> {
    Patch::Merge(json!({"metadata": {"annotations": pairs}}))
}

fn binding(pod: &str, annotations: Value, labels: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": pod, "annotations": annotations, "labels": labels},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "policy-test-ghost"}
    })
}

/// A pod no scheduler takes (its scheduler does not exist): it stays unbound until
/// the test binds it.
fn pod(name: &str, annotations: Value) -> Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations,
                     "labels": {"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "1.0", "app": "a"}},
        "spec": {"schedulerName": "no-such-scheduler",
                 "containers": [{"name": "c", "image": "x"}]},
    }))?)
}

fn ann(p: &Pod, k: &str) -> Option<String> {
    p.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(k).cloned())
}

const RECORD: &str = "sharedgpu/* annotations are the GPU allocation record, written only by the KubeShare scheduler extender at bind; kubeshare:webhook may not";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_extender_writes_the_record_and_labels_never_change() -> Result<()> {
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let ns = TestNamespace::create(cluster, "policy").await?;
    let token = ns.name().to_string();
    let pp = PostParams::default();

    // "A user with patch pods": the rig's webhook identity, given pod rights here.
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "pod-editor"},
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "patch", "update"]},
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch", "update"]},
            {"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]},
        ]
    }))?;
    Api::<Role>::namespaced(admin.clone(), ns.name())
        .create(&pp, &role)
        .await?;
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "pod-editor"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-editor"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": MALLORY.user()}]
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), ns.name())
        .create(&pp, &rb)
        .await?;
    // And the right to label this test's namespace (for the opt-out check).
    let ns_role = format!("policy-test-ns-{token}");
    let mut cleanup = Cleanup {
        cluster,
        objects: vec![
            ("clusterrole", ns_role.clone()),
            ("clusterrolebinding", ns_role.clone()),
        ],
    };
    let cr: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": ns_role},
        "rules": [{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [ns.name()],
                   "verbs": ["get", "patch", "update"]}]
    }))?;
    Api::<ClusterRole>::all(admin.clone())
        .create(&pp, &cr)
        .await?;
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": ns_role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ns_role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": MALLORY.user()}]
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&pp, &crb)
        .await?;

    for doc in policies(ns.name(), &token)? {
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match doc["kind"].as_str() {
            Some("ValidatingAdmissionPolicy") => {
                cleanup
                    .objects
                    .push(("validatingadmissionpolicy", name.clone()));
                Api::<ValidatingAdmissionPolicy>::all(admin.clone())
                    .create(&pp, &serde_json::from_value(doc)?)
                    .await
                    .with_context(|| format!("the apiserver refused policy {name}"))?;
            }
            _ => {
                cleanup
                    .objects
                    .push(("validatingadmissionpolicybinding", name.clone()));
                Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
                    .create(&pp, &serde_json::from_value(doc)?)
                    .await
                    .with_context(|| format!("the apiserver refused binding {name}"))?;
            }
        }
    }
    let mallory = cluster.client(MALLORY).await?;
    let extender = cluster.client(Identity::Extender).await?;
    let as_mallory: Api<Pod> = Api::namespaced(mallory.clone(), ns.name());
    let as_extender: Api<Pod> = Api::namespaced(extender.clone(), ns.name());
    let as_admin: Api<Pod> = Api::namespaced(admin.clone(), ns.name());
    let params = PatchParams::default();

    // The policy is live once a forged pod is refused (policies load asynchronously).
    let forged = pod("forged", json!({"sharedgpu/gpu_uuid": "GPU-forged"}))?;
    let (code, message) = wait_until("the record policy to refuse a forged pod", WAIT, || {
        let (api, forged) = (as_mallory.clone(), forged.clone());
        async move {
            let dry = PostParams {
                dry_run: true,
                ..Default::default()
            };
            match api.create(&dry, &forged).await {
                Ok(_) => Ok(None),
                Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("record") => {
                    Ok(Some((s.code, s.message)))
                }
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    assert_eq!(code, 403);
    assert!(
        message.contains(&format!(
            "{RECORD} create a pod with them (sharedgpu/gpu_uuid=GPU-forged); RBAC verb update on allocations.kubeshare.io is required"
        )),
        "{message}"
    );

    // 1. Pods without a record are created as usual.
    for name in ["p1", "p2", "p3"] {
        as_mallory
            .create(&pp, &pod(name, json!({"note": "x"}))?)
            .await?;
    }

    // 2. A user with patch pods cannot add a record to a pod, on the pod or its status.
    let (code, message) = api_error(
        as_mallory
            .patch(
                "p1",
                &params,
                &annotate(json!({"sharedgpu/gpu_uuid": "GPU-stolen"})),
            )
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "{RECORD} set, change or remove them (sharedgpu/gpu_uuid=GPU-stolen)"
        )),
        "{message}"
    );
    let (code, message) = api_error(
        as_mallory
            .patch_status("p1", &params, &annotate(json!({"sharedgpu/node": "n1"})))
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(message.contains("(sharedgpu/node=n1)"), "{message}");

    // 3. Nor through a Binding: the apiserver copies a Binding's annotations onto the
    //    pod in its own write, so the Binding is what is checked.
    let (code, message) = api_error(
        as_mallory
            .create_subresource::<Value, Value>(
                "binding",
                "p1",
                &pp,
                &binding("p1", json!({"sharedgpu/gpu_uuid": "GPU-stolen"}), json!({})),
            )
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "{RECORD} bind with them (sharedgpu/gpu_uuid=GPU-stolen)"
        )),
        "{message}"
    );
    // The older namespaced bindings endpoint copies annotations the same way.
    let legacy: Api<k8s_openapi::api::core::v1::Binding> =
        Api::namespaced(mallory.clone(), ns.name());
    let (code, message) = api_error(
        legacy
            .create(
                &pp,
                &serde_json::from_value(binding(
                    "p1",
                    json!({"sharedgpu/gpu_uuid": "GPU-stolen"}),
                    json!({}),
                ))?,
            )
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("bind with them (sharedgpu/gpu_uuid=GPU-stolen)"),
        "{message}"
    );
    assert_eq!(
        as_admin.get("p1").await?.spec.and_then(|s| s.node_name),
        None
    );
    // A Binding may not bring sharedgpu/ labels either (copied with
    // PodTopologyLabelsAdmission), whoever sends it.
    let (code, message) = api_error(
        as_extender
            .create_subresource::<Value, Value>(
                "binding",
                "p1",
                &pp,
                &binding("p1", json!({}), json!({"sharedgpu/gpu_request": "1.0"})),
            )
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(
            "sharedgpu/* labels cannot change after the pod is created (sharedgpu/gpu_request=1.0)"
        ),
        "{message}"
    );

    // 4. The extender's identity binds with the record, which lands on the pod.
    as_extender
        .create_subresource::<Value, Value>(
            "binding",
            "p1",
            &pp,
            &binding(
                "p1",
                json!({"sharedgpu/gpu_uuid": "GPU-real", "sharedgpu/node": "policy-test-ghost"}),
                json!({}),
            ),
        )
        .await?;
    let bound = as_admin.get("p1").await?;
    assert_eq!(
        ann(&bound, "sharedgpu/gpu_uuid").as_deref(),
        Some("GPU-real")
    );
    assert_eq!(
        bound.spec.and_then(|s| s.node_name).as_deref(),
        Some("policy-test-ghost")
    );
    // ... and may patch the record on the pod too (the two-call path).
    as_extender
        .patch(
            "p2",
            &params,
            &annotate(json!({"sharedgpu/gpu_uuid": "GPU-two"})),
        )
        .await?;

    // 5. Changing or removing an existing record is refused to the user; other
    //    annotations of a pod that carries a record still may change.
    let (code, message) = api_error(
        as_mallory
            .patch(
                "p1",
                &params,
                &annotate(json!({"sharedgpu/gpu_uuid": "GPU-other"})),
            )
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("(sharedgpu/gpu_uuid=GPU-other)"),
        "{message}"
    );
    let (_, message) = api_error(
        as_mallory
            .patch(
                "p1",
                &params,
                &annotate(json!({"sharedgpu/gpu_uuid": null})),
            )
            .await,
    )?;
    assert!(
        message.contains("(sharedgpu/gpu_uuid removed)"),
        "{message}"
    );
    // A full update (PUT) that drops the record is a removal too.
    let mut p2 = as_mallory.get("p2").await?;
    if let Some(a) = p2.metadata.annotations.as_mut() {
        a.remove("sharedgpu/gpu_uuid");
    }
    let (_, message) = api_error(as_mallory.replace("p2", &pp, &p2).await)?;
    assert!(
        message.contains("(sharedgpu/gpu_uuid removed)"),
        "{message}"
    );
    as_mallory
        .patch("p1", &params, &annotate(json!({"note": "y"})))
        .await?;
    assert_eq!(
        ann(&as_admin.get("p1").await?, "sharedgpu/gpu_uuid").as_deref(),
        Some("GPU-real")
    );

    // 6. sharedgpu/* labels do not change after creation, for anyone (bound or not);
    //    other labels do.
    let relabel =
        |v: &str| Patch::Merge(json!({"metadata": {"labels": {"sharedgpu/gpu_request": v}}}));
    for (who, api) in [
        ("user", &as_mallory),
        ("extender", &as_extender),
        ("admin", &as_admin),
    ] {
        for name in ["p1", "p3"] {
            let (code, message) = api_error(api.patch(name, &params, &relabel("0.25")).await)
                .with_context(|| format!("{who} relabelling {name}"))?;
            assert_eq!(code, 403, "{who}: {message}");
            assert!(
                message.contains("sharedgpu/* labels cannot change after the pod is created (sharedgpu/gpu_request=0.25): the GPU share they ask for was checked and set up when the pod was created; delete and re-create the pod"),
                "{who}: {message}"
            );
        }
    }
    let (_, message) = api_error(
        as_mallory
            .patch(
                "p3",
                &params,
                &Patch::Merge(json!({"metadata": {"labels": {"sharedgpu/gpu_mem": "1Gi"}}})),
            )
            .await,
    )?;
    assert!(message.contains("(sharedgpu/gpu_mem=1Gi)"), "{message}");
    let (_, message) = api_error(
        as_mallory
            .patch(
                "p3",
                &params,
                &Patch::Merge(json!({"metadata": {"labels": {"sharedgpu/gpu_limit": null}}})),
            )
            .await,
    )?;
    assert!(
        message.contains("(sharedgpu/gpu_limit removed)"),
        "{message}"
    );
    as_mallory
        .patch(
            "p3",
            &params,
            &Patch::Merge(json!({"metadata": {"labels": {"app": "b"}}})),
        )
        .await?;

    // 7. Cluster admins pass every RBAC check: the break-glass path to repair a record.
    as_admin
        .patch(
            "p3",
            &params,
            &annotate(json!({"sharedgpu/gpu_uuid": "GPU-repaired"})),
        )
        .await?;

    // 8. Opting a namespace out of the webhook needs verb update on optouts.kubeshare.io.
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    namespaces
        .patch(
            ns.name(),
            &params,
            &Patch::Merge(json!({"metadata": {"labels": {"kubeshare-policy-test": token}}})),
        )
        .await?;
    let opt_out = Patch::Merge(json!({"metadata": {"labels": {"sharedgpu/webhook": "disabled"}}}));
    // Each policy and binding loads on its own: that the record policy refused a pod says
    // nothing of the opt-out one (CI once saw this patch pass, the namespace opted out, a
    // second after the bindings were made). Dry runs until it refuses, then the real patch.
    wait_until("the opt-out policy to refuse mallory", WAIT, || {
        let (api, name, patch) = (
            Api::<Namespace>::all(mallory.clone()),
            ns.name().to_string(),
            opt_out.clone(),
        );
        async move {
            let dry = PatchParams {
                dry_run: true,
                ..Default::default()
            };
            match api.patch(&name, &dry, &patch).await {
                Ok(_) => Ok(None),
                Err(kube::Error::Api(s)) if s.code == 403 => Ok(Some(())),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    let (code, message) = api_error(
        Api::<Namespace>::all(mallory.clone())
            .patch(ns.name(), &params, &opt_out)
            .await,
    )?;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains("label sharedgpu/webhook (<unset> -> disabled): opting a namespace out of KubeShare admission"),
        "{message}"
    );
    assert!(
        message.contains("kubeshare:webhook needs RBAC verb update on optouts.kubeshare.io"),
        "{message}"
    );
    // Other labels of the namespace are still the user's to change.
    Api::<Namespace>::all(mallory.clone())
        .patch(
            ns.name(),
            &params,
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await?;
    namespaces.patch(ns.name(), &params, &opt_out).await?;

    drop(cleanup);
    ns.delete().await?;
    Ok(())
}
