//! Bind: the decision, then the record and the node in ONE write: a `pods/binding`
//! POST whose `metadata.annotations` (the allocation record) the apiserver copies
//! onto the pod in the same update, with the pod's uid and the `resourceVersion`
//! the decision was made from as preconditions.
//!
//! The work runs as its own task: whatever happens to the HTTP caller (kube-scheduler
//! drops the request at its `httpTimeout`), the bind finishes or rolls back. A
//! retried bind of a pod whose bind is running waits for that one's answer (single
//! flight per pod UID); a retried bind of a pod already bound by us is answered from
//! the books, never booked twice. API calls are bounded (a semaphore) and retried
//! only until the bind's deadline, which is below the scheduler's `httpTimeout`.
//! When a Binding's outcome is unknown (timeout, connection lost), the booking is
//! kept and the timer checks it against the API later (`tasks.rs`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Binding, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use kubeshare_api::Allocation;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::api::call;
use crate::convert::WirePod;
use crate::error::{ApiError, BindFailed};
use crate::placement::{BindDecision, BindStep};
use crate::state::{BindAnswer, Shared};
use crate::wire::ExtenderBindingArgs;

/// Time kept for the Binding after a group member's wait at the gate.
const BINDING_BUDGET: Duration = Duration::from_secs(2);

/// The bind verb: answered by the bind task of this pod (started here unless one runs).
pub(crate) async fn bind(s: &Arc<Shared>, a: &ExtenderBindingArgs) -> Result<String, BindFailed> {
    if !s.synced() {
        return Err(BindFailed::NotSynced);
    }
    let mut rx = {
        let mut inflight = s.inflight.lock().unwrap_or_else(|p| p.into_inner());
        match inflight.get(&a.pod_uid) {
            Some(rx) => rx.clone(),
            None => {
                // Bound by an earlier call whose answer the caller did not get.
                if let Some(n) = s.lock().bound_node(&a.pod_uid) {
                    return if n == a.node {
                        Ok(format!("already bound to {n} by an earlier bind"))
                    } else {
                        Err(BindFailed::BoundElsewhere {
                            bound: n,
                            asked: a.node.clone(),
                        })
                    };
                }
                let (tx, rx) = watch::channel::<BindAnswer>(None);
                inflight.insert(a.pod_uid.clone(), rx.clone());
                let (s2, a2) = (s.clone(), a.clone());
                tokio::spawn(async move {
                    let (s3, a3) = (s2.clone(), a2.clone());
                    let work = tokio::spawn(async move { run_bind(&s3, &a3).await });
                    let r = match work.await {
                        Ok(r) => r,
                        Err(e) => {
                            // A panic may have struck after the Binding: keep the
                            // booking; the timer checks it against the API.
                            let now = s2.now_ms();
                            s2.lock().settle(&a2.pod_uid, now, false);
                            Err(BindFailed::TaskFailed(e.to_string()))
                        }
                    };
                    s2.inflight
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&a2.pod_uid);
                    let _ = tx.send(Some(r));
                });
                rx
            }
        }
    };
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().unwrap_or(Err(BindFailed::NoAnswer)),
        Err(_) => Err(BindFailed::NoAnswer),
    }
}

/// The bind's work: decide (waiting at the gate for a group), then the Binding.
async fn run_bind(s: &Shared, a: &ExtenderBindingArgs) -> Result<String, BindFailed> {
    let deadline = Instant::now() + s.timing.bind_timeout;
    let client = s.client.clone().ok_or(BindFailed::NoClient)?;
    let pods: Api<WirePod> = Api::namespaced(client, &a.pod_namespace);
    if !s.lock().knows_pod(&a.pod_uid) {
        // The watch has not delivered it yet: read it.
        let p = call(s, deadline, "reading the pod", || pods.get(&a.pod_name)).await?;
        let info = p.info();
        if info.uid != a.pod_uid {
            return Err(BindFailed::OtherUid {
                namespace: a.pod_namespace.clone(),
                name: a.pod_name.clone(),
                found: info.uid,
                asked: a.pod_uid.clone(),
            });
        }
        s.lock().note_pod(&info);
    }
    let now = s.now_ms();
    let step = {
        let mut c = s.lock();
        s.resume(&mut c);
        c.bind(&a.pod_uid, &a.node, now)
    };
    s.gate.notify_waiters();
    let decision = match step? {
        BindStep::Go(d) => *d,
        BindStep::Wait => wait_at_gate(s, a, deadline).await?,
    };
    let r = post_binding(s, &pods, a, &decision, deadline).await;
    let now = s.now_ms();
    match &r {
        Ok(_) => s.lock().settle(&a.pod_uid, now, true),
        // Maybe bound: keep the booking for the check.
        Err(BindFailed::OutcomeUnknown(_)) => s.lock().settle(&a.pod_uid, now, false),
        // Nothing was bound.
        Err(_) => s.lock().rollback(&a.pod_uid),
    }
    r.map(|()| decision.summary)
}

/// Waits until the member's group is released (its quorum reached bind), its
/// places are freed, or the wait ends (then the member leaves the gate).
async fn wait_at_gate(
    s: &Shared,
    a: &ExtenderBindingArgs,
    deadline: Instant,
) -> Result<BindDecision, BindFailed> {
    let until = (Instant::now() + s.timing.gang_wait).min(deadline - BINDING_BUDGET);
    info!(pod = %a.pod_name, ns = %a.pod_namespace, node = %a.node, "group member waits at bind for its group's quorum");
    loop {
        let notified = s.gate.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(d) = s.lock().poll_gate(&a.pod_uid, &a.node)? {
            return Ok(d);
        }
        if tokio::time::timeout_at(until, notified).await.is_err() {
            let mut c = s.lock();
            // Released at the last moment?
            if let Ok(Some(d)) = c.poll_gate(&a.pod_uid, &a.node) {
                return Ok(d);
            }
            return Err(c.leave_gate(&a.pod_uid).into());
        }
    }
}

/// POSTs the Binding with the record; on a conflict, reads the pod to learn why:
/// bound by an earlier attempt of ours (done), bound otherwise (refused), its
/// labels changed since the decision (refused), or only its status moved on
/// (retried with the newer `resourceVersion`).
async fn post_binding(
    s: &Shared,
    pods: &Api<WirePod>,
    a: &ExtenderBindingArgs,
    d: &BindDecision,
    deadline: Instant,
) -> Result<(), BindFailed> {
    // The resourceVersion and labels the decision was made from (not the newest
    // ones: a label change after the decision must fail the precondition).
    let demand = d.demand.clone();
    let mut rv = d.rv;
    for _ in 0..4 {
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(a.pod_name.clone()),
                namespace: Some(a.pod_namespace.clone()),
                uid: Some(a.pod_uid.clone()),
                resource_version: rv.map(|v| v.to_string()),
                annotations: d.allocation.as_ref().map(Allocation::to_annotations),
                ..ObjectMeta::default()
            },
            target: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(a.node.clone()),
                ..ObjectReference::default()
            },
        };
        let pp = PostParams::default();
        let r = call(s, deadline, "creating the Binding", || {
            pods.create_subresource::<Binding, serde_json::Value>(
                "binding",
                &a.pod_name,
                &pp,
                &binding,
            )
        })
        .await;
        match r {
            Ok(_) => return Ok(()),
            Err(ApiError::Refused { code: 409, message }) => {
                let conflict = message;
                // Why? Read the pod (a quorum read).
                let p = match call(s, deadline, "reading the pod", || pods.get(&a.pod_name)).await {
                    Err(ApiError::Refused { code: 404, .. }) => {
                        return Err(BindFailed::PodGone { conflict });
                    }
                    r => {
                        r.map_err(|e| BindFailed::OutcomeUnknown(format!("{conflict}; then {e}")))?
                    }
                };
                let info = p.info();
                if info.uid != a.pod_uid {
                    return Err(BindFailed::PodReplaced { conflict });
                }
                if let Some(n) = &info.node_name {
                    let ours = matches!(&info.allocation, Ok(al) if al.as_ref() == d.allocation.as_ref())
                        && *n == a.node;
                    // Rolled back (if not ours) by the caller; the watch brings the truth.
                    return if ours {
                        Ok(())
                    } else {
                        Err(BindFailed::BoundByOther {
                            conflict,
                            node: n.clone(),
                        })
                    };
                }
                if info.demand.as_ref().ok().and_then(|x| x.as_ref()) != demand.as_ref() {
                    s.lock().note_pod(&info);
                    return Err(BindFailed::LabelsChanged { conflict });
                }
                // Only something else (status, annotations) moved on: same decision.
                s.lock().note_pod(&info);
                rv = info.resource_version;
            }
            Err(ApiError::Unknown(msg)) => {
                warn!(pod = %a.pod_name, ns = %a.pod_namespace, error = %msg, "Binding outcome unknown");
                return Err(BindFailed::OutcomeUnknown(msg));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(BindFailed::KeptChanging)
}
