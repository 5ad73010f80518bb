//! Smoke tests of the rig itself, against the real control plane: kwok runs Job
//! pods to completion, the RBAC of manifests/rbac.yaml holds per identity, and
//! the second kube-scheduler sends `kubeshare-scheduler` pods to the extender port.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Json;
use axum::extract::State;
use axum::routing::post;
use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use kubeshare_testkit::{
    Cluster, Identity, KwokNode, RUN_DURATION_ANNOTATION, TestNamespace, create_kwok_node,
    delete_node, node_is_ready, wait_for, wait_until,
};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

async fn ready_kwok_node(client: &kube::Client, ns: &TestNamespace) -> Result<String> {
    let name = ns.unique_name("node");
    create_kwok_node(
        client,
        &KwokNode::new(&name).cpu("4").memory("8Gi").pods("10"),
    )
    .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let node = wait_for(&nodes, &name, WAIT, node_is_ready).await?;
    // kwok keeps the capacity the test asked for.
    let cap = node
        .status
        .and_then(|s| s.capacity)
        .context("node has no capacity")?;
    assert_eq!(cap["cpu"].0, "4");
    assert_eq!(cap["memory"].0, "8Gi");
    Ok(name)
}

#[tokio::test]
async fn job_of_two_pods_runs_to_completion_on_a_kwok_node() -> Result<()> {
    let cluster = Cluster::shared()?;
    let client = cluster.client(Identity::Admin).await?;
    let ns = TestNamespace::create(cluster, "smoke-job").await?;
    let node = ready_kwok_node(&client, &ns).await?;

    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "two"},
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {RUN_DURATION_ANNOTATION: "4s"}},
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [{
                        "name": "main",
                        "image": "registry.invalid/never-pulled:1",
                        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}
                    }]
                }
            }
        }
    }))?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns.name());
    jobs.create(&PostParams::default(), &job).await?;

    // Both pods are bound to our node by the default scheduler and run (kwok).
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns.name());
    let running = wait_until("two running pods of job `two`", WAIT, || {
        let pods = pods.clone();
        let node = node.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels("job-name=two"))
                .await
                .map_err(|e| e.to_string())?;
            let summary: Vec<(String, Option<String>, Option<String>)> = list
                .items
                .iter()
                .map(|p| {
                    (
                        p.metadata.name.clone().unwrap_or_default(),
                        p.spec.as_ref().and_then(|s| s.node_name.clone()),
                        p.status.as_ref().and_then(|s| s.phase.clone()),
                    )
                })
                .collect();
            let ok = summary.len() == 2
                && summary.iter().all(|(_, n, ph)| {
                    n.as_deref() == Some(node.as_str()) && ph.as_deref() == Some("Running")
                });
            if ok {
                Ok(Some(summary))
            } else {
                Err(format!("{summary:?}"))
            }
        }
    })
    .await?;
    let names: BTreeSet<_> = running.iter().map(|(n, _, _)| n.clone()).collect();
    assert_eq!(names.len(), 2);

    // kwok's job-pod-done stage completes them; the Job controller (KCM) sees it.
    let done = wait_for(&jobs, "two", WAIT, |j: &Job| {
        j.status.as_ref().is_some_and(|s| {
            s.succeeded == Some(2)
                && s.conditions.as_ref().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Complete" && c.status == "True")
                })
        })
    })
    .await?;
    assert_eq!(done.status.and_then(|s| s.failed).unwrap_or(0), 0);
    for name in names {
        let p = pods.get(&name).await?;
        assert_eq!(p.status.and_then(|s| s.phase).as_deref(), Some("Succeeded"));
    }

    delete_node(&client, &node).await?;
    ns.delete().await?;
    Ok(())
}

/// (identity, verb, group, resource, subresource, namespace, allowed)
type Access = (
    Identity,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    bool,
);

#[tokio::test]
async fn each_identity_has_exactly_the_rights_of_rbac_yaml() -> Result<()> {
    let cluster = Cluster::shared()?;
    let table: &[Access] = &[
        (Identity::Admin, "delete", "", "nodes", "", "", true),
        (Identity::Extender, "list", "", "pods", "", "", true),
        (Identity::Extender, "watch", "", "nodes", "", "", true),
        (Identity::Extender, "patch", "", "pods", "", "default", true),
        (
            Identity::Extender,
            "create",
            "",
            "pods",
            "binding",
            "default",
            true,
        ),
        (
            Identity::Extender,
            "create",
            "events.k8s.io",
            "events",
            "",
            "default",
            true,
        ),
        (
            Identity::Extender,
            "create",
            "",
            "events",
            "",
            "default",
            true,
        ),
        (
            Identity::Extender,
            "delete",
            "",
            "pods",
            "",
            "default",
            false,
        ),
        (Identity::Extender, "patch", "", "nodes", "", "", false),
        (
            Identity::Extender,
            "get",
            "",
            "secrets",
            "",
            "default",
            false,
        ),
        (Identity::Webhook, "get", "", "pods", "", "default", false),
        (Identity::Webhook, "list", "", "nodes", "", "", false),
        (Identity::NodeDaemon, "patch", "", "nodes", "", "", true),
        (
            Identity::NodeDaemon,
            "patch",
            "",
            "nodes",
            "status",
            "",
            true,
        ),
        (Identity::NodeDaemon, "watch", "", "pods", "", "", true),
        (
            Identity::NodeDaemon,
            "patch",
            "events.k8s.io",
            "events",
            "",
            "default",
            true,
        ),
        (
            Identity::NodeDaemon,
            "patch",
            "",
            "pods",
            "",
            "default",
            false,
        ),
        (
            Identity::NodeDaemon,
            "create",
            "",
            "pods",
            "binding",
            "default",
            false,
        ),
        (Identity::NodeDaemon, "delete", "", "nodes", "", "", false),
        (
            Identity::KubeScheduler,
            "create",
            "",
            "pods",
            "binding",
            "default",
            true,
        ),
        (
            Identity::KubeControllerManager,
            "list",
            "",
            "nodes",
            "",
            "",
            true,
        ),
    ];
    let mut wrong = Vec::new();
    for &(id, verb, group, resource, sub, ns, want) in table {
        let client = cluster.client(id).await?;
        let review: SelfSubjectAccessReview = serde_json::from_value(json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {
                "verb": verb, "group": group, "resource": resource,
                "subresource": sub, "namespace": ns
            }}
        }))?;
        let got = Api::<SelfSubjectAccessReview>::all(client)
            .create(&PostParams::default(), &review)
            .await?
            .status
            .map(|s| s.allowed)
            .unwrap_or(false);
        if got != want {
            wrong.push(format!(
                "{} {verb} {group}/{resource}/{sub} in '{ns}': got {got}",
                id.user()
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");

    // And a real request is refused for the webhook identity.
    let webhook = cluster.client(Identity::Webhook).await?;
    let err = Api::<Pod>::all(webhook)
        .list(&ListParams::default())
        .await
        .expect_err("webhook identity must not list pods");
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 403),
        "{err}"
    );
    Ok(())
}

#[derive(Default)]
struct Calls {
    filter: Vec<Value>,
    prioritize: Vec<Value>,
    bind: Vec<Value>,
}

/// A tiny extender on the rig's extender port: passes every node, scores 0 and
/// binds with the extender identity, recording what kube-scheduler sent.
#[tokio::test]
async fn kubeshare_scheduler_sends_its_pods_to_the_extender_port() -> Result<()> {
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let extender_client = cluster.client(Identity::Extender).await?;
    let ns = TestNamespace::create(cluster, "smoke-extender").await?;
    let node = ready_kwok_node(&admin, &ns).await?;

    let calls = Arc::new(Mutex::new(Calls::default()));
    type St = (Arc<Mutex<Calls>>, kube::Client, String);
    let app = axum::Router::new()
        .route(
            "/filter",
            post(
                |State((calls, _, ns)): State<St>, Json(args): Json<Value>| async move {
                    // Only our own pod passes: the cluster is shared with other tests.
                    if args["Pod"]["metadata"]["namespace"] != ns.as_str() {
                        return Json(json!({"NodeNames": [], "FailedNodes": {}, "Error": ""}));
                    }
                    let names = args["NodeNames"].clone();
                    calls.lock().unwrap().filter.push(args);
                    Json(json!({"NodeNames": names, "FailedNodes": {}, "Error": ""}))
                },
            ),
        )
        .route(
            "/prioritize",
            post(
                |State((calls, _, _)): State<St>, Json(args): Json<Value>| async move {
                    let scores: Vec<Value> = args["NodeNames"]
                        .as_array()
                        .map(|ns| ns.iter().map(|n| json!({"Host": n, "Score": 0})).collect())
                        .unwrap_or_default();
                    calls.lock().unwrap().prioritize.push(args);
                    Json(Value::Array(scores))
                },
            ),
        )
        .route(
            "/bind",
            post(
                |State((calls, client, _)): State<St>, Json(args): Json<Value>| async move {
                    calls.lock().unwrap().bind.push(args.clone());
                    let ns = args["PodNamespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    let name = args["PodName"].as_str().unwrap_or_default().to_string();
                    let binding = json!({
                        "apiVersion": "v1", "kind": "Binding",
                        "metadata": {"name": name, "namespace": ns},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": args["Node"]}
                    });
                    let pods: Api<Pod> = Api::namespaced(client, &ns);
                    let res: Result<Value, _> = pods
                        .create_subresource("binding", &name, &PostParams::default(), &binding)
                        .await;
                    Json(json!({"Error": res.err().map(|e| e.to_string()).unwrap_or_default()}))
                },
            ),
        )
        .with_state((calls.clone(), extender_client, ns.name().to_string()));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", cluster.extender_port())).await?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "via-extender"},
        "spec": {
            "schedulerName": cluster.scheduler_name(),
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [{"name": "main", "image": "registry.invalid/never-pulled:1"}]
        }
    }))?;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns.name());
    pods.create(&PostParams::default(), &pod).await?;
    let running = wait_for(&pods, "via-extender", WAIT, |p: &Pod| {
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
    })
    .await?;
    assert_eq!(
        running.spec.and_then(|s| s.node_name).as_deref(),
        Some(node.as_str())
    );
    server.abort();

    let (filter, bind) = {
        let calls = calls.lock().unwrap();
        (calls.filter.first().cloned(), calls.bind.first().cloned())
    };
    let filter = filter.context("extender got no filter call")?;
    // nodeCacheCapable: names only, and only nodes that passed the in-tree filters.
    assert_eq!(filter["NodeNames"], json!([node]));
    assert!(filter["Nodes"].is_null());
    assert_eq!(filter["Pod"]["metadata"]["name"], "via-extender");
    let bind = bind.context("extender got no bind call")?;
    assert_eq!(bind["PodName"], "via-extender");
    assert_eq!(bind["PodNamespace"], ns.name());
    assert_eq!(bind["Node"], node);

    // Delete the pod while its kwok node still exists (kwok finishes the
    // deletion), then the node.
    pods.delete("via-extender", &Default::default()).await?;
    wait_until("pod via-extender gone", WAIT, || {
        let pods = pods.clone();
        async move {
            match pods.get_opt("via-extender").await {
                Ok(None) => Ok(Some(())),
                Ok(Some(_)) => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    delete_node(&admin, &node).await?;
    ns.delete().await?;
    Ok(())
}

/// The apiserver reaches a webhook on `webhook_port()` over TLS, with the rig's
/// ready-made serving cert and the CA as `caBundle`: admission webhooks are on.
#[tokio::test]
async fn apiserver_calls_a_tls_webhook_on_the_webhook_port() -> Result<()> {
    use base64::Engine as _;
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use k8s_openapi::api::core::v1::ConfigMap;

    let _ = rustls::crypto::ring::default_provider().install_default();
    let cluster = Cluster::shared()?;
    let admin = cluster.client(Identity::Admin).await?;
    let ns = TestNamespace::create(cluster, "smoke-webhook").await?;

    let seen = Arc::new(Mutex::new(Vec::<Value>::new()));
    let app = axum::Router::new()
        .route(
            "/validate",
            post(|State(seen): State<Arc<Mutex<Vec<Value>>>>, Json(review): Json<Value>| async move {
                let uid = review["request"]["uid"].clone();
                seen.lock().unwrap().push(review);
                Json(json!({
                    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                    "response": {"uid": uid, "allowed": false,
                                 "status": {"code": 403, "message": "denied by the testkit smoke webhook"}}
                }))
            }),
        )
        .with_state(seen.clone());
    let (cert, key) = cluster.webhook_serving_cert_paths();
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key).await?;
    let handle = axum_server::Handle::new();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], cluster.webhook_port()));
    let server = tokio::spawn(
        axum_server::bind_rustls(addr, tls)
            .handle(handle.clone())
            .serve(app.into_make_service()),
    );

    let ca = std::fs::read(cluster.ca_cert_path())?;
    let name = ns.unique_name("deny-configmaps");
    let config: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "deny.smoke.kubeshare.io",
            "clientConfig": {
                "url": format!("https://127.0.0.1:{}/validate", cluster.webhook_port()),
                "caBundle": base64::engine::general_purpose::STANDARD.encode(ca)
            },
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["configmaps"]}],
            // Only this test's namespace: the cluster is shared.
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name()}},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 5
        }]
    }))?;
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    configs.create(&PostParams::default(), &config).await?;

    // The apiserver picks up new webhook configurations asynchronously: retry
    // until the webhook's denial (not a plain success) comes back.
    let cms: Api<ConfigMap> = Api::namespaced(admin.clone(), ns.name());
    let denial = wait_until("configmap creation denied by the webhook", WAIT, || {
        let cms = cms.clone();
        async move {
            let cm: ConfigMap = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "probe-"}
            }))
            .map_err(|e| e.to_string())?;
            match cms.create(&PostParams::default(), &cm).await {
                Err(kube::Error::Api(s)) if s.message.contains("testkit smoke webhook") => {
                    Ok(Some(s))
                }
                Err(e) => Err(e.to_string()),
                Ok(_) => Err("created (webhook not active yet)".into()),
            }
        }
    })
    .await?;
    assert_eq!(denial.code, 403);
    let first = seen
        .lock()
        .unwrap()
        .first()
        .cloned()
        .context("webhook saw no review")?;
    assert_eq!(first["request"]["namespace"], ns.name());
    assert_eq!(first["request"]["operation"], "CREATE");

    configs.delete(&name, &Default::default()).await?;
    handle.shutdown();
    let _ = server.await;
    ns.delete().await?;
    Ok(())
}
