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

use crate::convert::WirePod;
use crate::placement::{BindDecision, BindStep};
use crate::server::{BindAnswer, Shared};
use crate::wire::ExtenderBindingArgs;

/// Time kept for the Binding after a group member's wait at the gate.
const BINDING_BUDGET: Duration = Duration::from_secs(2);

/// How one API call ended.
#[derive(Debug)]
pub(crate) enum Call<T> {
    Ok(T),
    /// The apiserver answered no (4xx other than 429): nothing was written.
    Refused(u16, String),
    /// Not known whether it was applied (timeout, connection, 5xx).
    Unknown(String),
    /// The deadline came before any attempt could have been applied: none was sent
    /// (every API slot taken, as in a deep backlog) or each was turned away (429).
    /// Nothing was written, so a Binding's booking can be rolled back at once.
    NotApplied(String),
}

impl<T> Call<T> {
    /// The value, or what went wrong whichever way the call failed (for callers that
    /// treat every failure alike).
    pub(crate) fn into_result(self) -> Result<T, String> {
        match self {
            Call::Ok(v) => Ok(v),
            Call::Refused(_, e) | Call::Unknown(e) | Call::NotApplied(e) => Err(e),
        }
    }
}

/// Runs `f` (one API call) with a permit, retrying 429s and transient errors with
/// a short backoff until `deadline`.
pub(crate) async fn call<T, F, Fut>(s: &Shared, deadline: Instant, what: &str, f: F) -> Call<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut backoff = Duration::from_millis(50);
    let mut last = String::from("no attempt");
    // Whether an attempt may have been applied: only then is the outcome unknown
    // at the deadline.
    let mut maybe_applied = false;
    let at_deadline = |msg: String, maybe_applied: bool| {
        s.metrics
            .count("kubeshare_extender_api_calls_total", "deadline");
        if maybe_applied {
            Call::Unknown(msg)
        } else {
            Call::NotApplied(msg)
        }
    };
    loop {
        let now = Instant::now();
        if now >= deadline {
            return at_deadline(format!("{what}: deadline reached ({last})"), maybe_applied);
        }
        let in_queue = s.api_queue.start();
        let permit = tokio::time::timeout_at(deadline, s.api_permits.acquire()).await;
        drop(in_queue);
        let permit = match permit {
            Ok(Ok(p)) => p,
            _ => {
                return at_deadline(
                    format!("{what}: deadline reached waiting for an API slot ({last})"),
                    maybe_applied,
                );
            }
        };
        let r = tokio::time::timeout_at(deadline, f()).await;
        drop(permit);
        match r {
            Ok(Ok(v)) => {
                s.metrics.count("kubeshare_extender_api_calls_total", "ok");
                return Call::Ok(v);
            }
            Ok(Err(kube::Error::Api(st))) if st.code == 429 => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "throttled");
                last = format!("HTTP 429: {}", st.message);
            }
            Ok(Err(kube::Error::Api(st))) if (400..500).contains(&st.code) => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "refused");
                return Call::Refused(st.code, format!("{what}: {}", st.message));
            }
            Ok(Err(e)) => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "error");
                // A 5xx or a lost connection: the write may have happened; the
                // caller finds out (a retried Binding gets 409, then a GET).
                maybe_applied = true;
                last = e.to_string();
            }
            Err(_) => {
                return at_deadline(format!("{what}: no answer before the deadline"), true);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(Duration::from_millis(800));
    }
}

/// The bind verb: answered by the bind task of this pod (started here unless one runs).
pub(crate) async fn bind(s: &Arc<Shared>, a: &ExtenderBindingArgs) -> Result<String, String> {
    if !s.synced() {
        return Err(crate::server::NOT_SYNCED.into());
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
                        Err(format!("pod is already bound to {n}, not {}", a.node))
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
                            Err(format!("bind task failed: {e}"))
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
        Ok(v) => v
            .clone()
            .unwrap_or_else(|| Err("bind ended without an answer".into())),
        Err(_) => Err("bind ended without an answer".into()),
    }
}

/// The bind's work: decide (waiting at the gate for a group), then the Binding.
async fn run_bind(s: &Shared, a: &ExtenderBindingArgs) -> Result<String, String> {
    let deadline = Instant::now() + s.timing.bind_timeout;
    let client = s
        .client
        .clone()
        .ok_or_else(|| "extender has no Kubernetes client".to_string())?;
    let pods: Api<WirePod> = Api::namespaced(client, &a.pod_namespace);
    if !s.lock().knows_pod(&a.pod_uid) {
        // The watch has not delivered it yet: read it.
        let p = call(s, deadline, "reading the pod", || pods.get(&a.pod_name))
            .await
            .into_result()?;
        let info = p.info();
        if info.uid != a.pod_uid {
            return Err(format!(
                "pod {}/{} has uid {}, not {}",
                a.pod_namespace, a.pod_name, info.uid, a.pod_uid
            ));
        }
        s.lock().note_pod(&info);
    }
    let now = s.now_ms();
    let step = s.lock().bind(&a.pod_uid, &a.node, now);
    s.gate.notify_waiters();
    let decision = match step? {
        BindStep::Go(d) => *d,
        BindStep::Wait => wait_at_gate(s, a, deadline).await?,
    };
    let r = post_binding(s, &pods, a, &decision, deadline).await;
    let now = s.now_ms();
    match &r {
        Ok(_) => s.lock().settle(&a.pod_uid, now, true),
        Err(BindError::Refused(_)) => s.lock().rollback(&a.pod_uid),
        Err(BindError::Unknown(_)) => s.lock().settle(&a.pod_uid, now, false),
    }
    r.map(|()| decision.summary).map_err(|e| match e {
        BindError::Refused(m) => m,
        BindError::Unknown(m) => format!(
            "{m}; the Binding's outcome is unknown: the place stays booked until the pod is checked"
        ),
    })
}

/// Waits until the member's group is released (its quorum reached bind), its
/// places are freed, or the wait ends (then the member leaves the gate).
async fn wait_at_gate(
    s: &Shared,
    a: &ExtenderBindingArgs,
    deadline: Instant,
) -> Result<BindDecision, String> {
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
            return Err(c.leave_gate(&a.pod_uid));
        }
    }
}

enum BindError {
    /// Nothing was bound: roll the booking back.
    Refused(String),
    /// Maybe bound: keep the booking for the check.
    Unknown(String),
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
) -> Result<(), BindError> {
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
            Call::Ok(_) => return Ok(()),
            Call::Refused(409, msg) => {
                // Why? Read the pod (a quorum read).
                let p = match call(s, deadline, "reading the pod", || pods.get(&a.pod_name)).await {
                    Call::Refused(404, _) => {
                        return Err(BindError::Refused(format!("{msg}; the pod is gone")));
                    }
                    r => r
                        .into_result()
                        .map_err(|e| BindError::Unknown(format!("{msg}; then {e}")))?,
                };
                let info = p.info();
                if info.uid != a.pod_uid {
                    return Err(BindError::Refused(format!("{msg}; the pod was replaced")));
                }
                if let Some(n) = &info.node_name {
                    let ours = matches!(&info.allocation, Ok(al) if al.as_ref() == d.allocation.as_ref())
                        && *n == a.node;
                    // Rolled back (if not ours) by the caller; the watch brings the truth.
                    return if ours {
                        Ok(())
                    } else {
                        Err(BindError::Refused(format!(
                            "{msg}; the pod is bound to {n}"
                        )))
                    };
                }
                if info.demand.as_ref().ok().and_then(|x| x.as_ref()) != demand.as_ref() {
                    s.lock().note_pod(&info);
                    return Err(BindError::Refused(format!(
                        "the pod's sharedgpu labels changed after the decision ({msg}): rescheduling"
                    )));
                }
                // Only something else (status, annotations) moved on: same decision.
                s.lock().note_pod(&info);
                rv = info.resource_version;
            }
            Call::Refused(_, msg) | Call::NotApplied(msg) => return Err(BindError::Refused(msg)),
            Call::Unknown(msg) => {
                warn!(pod = %a.pod_name, ns = %a.pod_namespace, error = %msg, "Binding outcome unknown");
                return Err(BindError::Unknown(msg));
            }
        }
    }
    Err(BindError::Refused(
        "the pod kept changing under the Binding".into(),
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use kube::core::Status;

    use super::*;
    use crate::placement::Config;
    use crate::server::Extender;

    fn api_error(code: u16) -> kube::Error {
        let mut st = Status::failure("test", "Test");
        st.code = code;
        kube::Error::Api(st.boxed())
    }

    /// Every API slot taken until the deadline: nothing was sent, so the caller
    /// may roll back (a deep backlog's binds used to keep their bookings for the
    /// check, then a GET each).
    #[tokio::test]
    async fn a_call_that_never_got_a_slot_was_not_applied() {
        let ext = Extender::offline(Config::default());
        let s = ext.shared.clone();
        let n = u32::try_from(s.timing.api_concurrency).unwrap_or(u32::MAX);
        let _all = s.api_permits.acquire_many(n).await.expect("permits");
        let sent = AtomicU32::new(0);
        let deadline = Instant::now() + Duration::from_millis(50);
        let r = call(&s, deadline, "creating the Binding", || {
            sent.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), kube::Error>(()) }
        })
        .await;
        assert_eq!(sent.load(Ordering::SeqCst), 0);
        assert!(
            matches!(&r, Call::NotApplied(m) if m.contains("waiting for an API slot")),
            "{r:?}"
        );
    }

    /// Turned away (429) until the deadline: not applied either.
    #[tokio::test]
    async fn a_call_throttled_until_the_deadline_was_not_applied() {
        let ext = Extender::offline(Config::default());
        let deadline = Instant::now() + Duration::from_millis(120);
        let r = call(&ext.shared, deadline, "creating the Binding", || async {
            Err::<(), _>(api_error(429))
        })
        .await;
        assert!(
            matches!(&r, Call::NotApplied(m) if m.contains("429")),
            "{r:?}"
        );
    }

    /// A 5xx may have been applied: at the deadline the outcome is unknown, even
    /// if later attempts were throttled.
    #[tokio::test]
    async fn a_call_after_a_server_error_is_unknown_at_the_deadline() {
        let ext = Extender::offline(Config::default());
        let tries = AtomicU32::new(0);
        let deadline = Instant::now() + Duration::from_millis(200);
        let r = call(&ext.shared, deadline, "creating the Binding", || {
            let first = tries.fetch_add(1, Ordering::SeqCst) == 0;
            async move { Err::<(), _>(api_error(if first { 503 } else { 429 })) }
        })
        .await;
        assert!(tries.load(Ordering::SeqCst) >= 2);
        assert!(matches!(r, Call::Unknown(_)), "{r:?}");
    }
}
