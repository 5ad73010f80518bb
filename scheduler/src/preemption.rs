//! A preemption the books decided (`placement/preempt.rs`), carried out: each
//! victim is evicted through the Eviction API, which honours
//! PodDisruptionBudgets, with the victim's uid as precondition (a pod of the
//! same name created since is never touched).
//!
//! Every victim's eviction is first tried as a dry run: when a budget forbids
//! any of them, nothing is evicted (a group's members go together or not at
//! all), the preemption is given up in the books and the pod searches again,
//! leaving that node out for a while. Then the evictions themselves; one that
//! fails gives the preemption up the same way (those already evicted leave).
//!
//! Events: on the preemptor, one that names its victims; on each victim, one
//! that names the preemptor (and each names the other as its related object).
//!
//! Before any eviction, each preemptor gets its preemption record
//! ([`PREEMPTION_ANNOTATION`]): a restarted extender reads it back and carries the
//! preemption on ([`crate::placement::Cluster::resume_preemptions`]) rather than
//! evicting for the pod again. A preemption given up clears it.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, EvictParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::api::call;
use crate::error::EvictFailed;
use crate::placement::{PREEMPTION_ANNOTATION, PodRef, PreemptOrder, PreemptRecord};
use crate::state::Shared;

/// Starts carrying out the preemptions the filter decided since the last call.
pub(crate) fn carry_out_orders(s: &Arc<Shared>) {
    let orders = std::mem::take(&mut *s.preempt_orders.lock().unwrap_or_else(|p| p.into_inner()));
    for o in orders {
        let s = s.clone();
        tokio::spawn(async move { carry_out(&s, o).await });
    }
}

async fn carry_out(s: &Shared, o: PreemptOrder) {
    let Some(client) = s.client.clone() else {
        return;
    };
    let deadline = Instant::now() + s.timing.bind_timeout;
    let places: Vec<String> = o
        .pods
        .iter()
        .map(|p| format!("{}/gpu {}", p.node, join(&p.gpus)))
        .collect();
    let places = places.join(", ");
    let victims: Vec<String> = o.victims.iter().map(PodRef::to_string).collect();
    let victims = victims.join(", ");
    let preemptors: Vec<String> = o.pods.iter().map(|p| p.pod.to_string()).collect();
    let preemptors = match &o.group {
        None => preemptors.join(", "),
        Some(g) => format!("group {g} ({})", preemptors.join(", ")),
    };
    if !o.resumed {
        for (p, r) in PreemptRecord::of_order(&o, s.wall_ms()) {
            record(s, &client, &p, Some(r.to_annotation()), deadline).await;
        }
    }
    for dry_run in [true, false] {
        for v in &o.victims {
            if let Err(e) = evict(s, &client, v, dry_run, deadline).await {
                warn!(pods = %preemptors, victim = %v, %places, dry_run, error = %e, "preemption given up");
                s.metrics
                    .count("kubeshare_extender_preemptions_total", e.kind());
                s.lock().preemption_refused(&o, s.now_ms());
                for p in &o.pods {
                    record(s, &client, &p.pod, None, deadline).await;
                }
                for p in &o.pods {
                    s.pod_event_about(
                        (&p.pod.namespace, &p.pod.name, &p.pod.uid),
                        Some(v),
                        true,
                        "PreemptionBlocked",
                        "Preempt",
                        format!(
                            "{e}; preemption on {} given up: searching elsewhere",
                            p.node
                        ),
                    );
                }
                return;
            }
            if !dry_run {
                s.pod_event_about(
                    (&v.namespace, &v.name, &v.uid),
                    o.pods.first().map(|p| &p.pod),
                    false,
                    "Preempted",
                    "Preempt",
                    format!(
                        "evicted (opportunistic, sharedgpu/priority 0) to make room on {places} for {preemptors} (sharedgpu/priority {})",
                        o.priority
                    ),
                );
            }
        }
        if dry_run && o.resumed {
            info!(pods = %preemptors, %places, %victims, "evicting again after a restart");
        } else if dry_run {
            info!(pods = %preemptors, %places, %victims, "preempting");
            for p in &o.pods {
                s.pod_event_about(
                    (&p.pod.namespace, &p.pod.name, &p.pod.uid),
                    o.victims.first(),
                    false,
                    "Preempting",
                    "Preempt",
                    format!(
                        "evicting {} opportunistic pod(s) to make room on {places} for {preemptors}: {victims}",
                        o.victims.len(),
                    ),
                );
            }
        }
    }
    s.metrics
        .count("kubeshare_extender_preemptions_total", "evicted");
}

/// Writes (`Some`) or clears (`None`) the preemption record on preemptor `p`.
/// A failure is logged, not fatal: the preemption goes on, only a restart in
/// the middle of it would not carry it on.
async fn record(s: &Shared, client: &Client, p: &PodRef, value: Option<String>, deadline: Instant) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &p.namespace);
    let patch = serde_json::json!({"metadata": {
        "uid": p.uid,
        "annotations": {PREEMPTION_ANNOTATION: value},
    }});
    let merge = Patch::Merge(&patch);
    let pp = PatchParams::default();
    if let Err(e) = call(s, deadline, "recording a preemption", || {
        pods.patch(&p.name, &pp, &merge)
    })
    .await
    {
        warn!(pod = %p, error = %e, "could not write the preemption record");
    }
}

fn join(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// One eviction (or its dry run). A victim already gone, or replaced by
/// another pod of its name, counts as evicted. No retries: a 429 is a budget
/// that forbids it (or the apiserver shedding load); either way, elsewhere.
async fn evict(
    s: &Shared,
    client: &Client,
    v: &PodRef,
    dry_run: bool,
    deadline: Instant,
) -> Result<(), EvictFailed> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &v.namespace);
    let ep = EvictParams {
        delete_options: Some(DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(v.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        }),
        post_options: PostParams {
            dry_run,
            ..PostParams::default()
        },
    };
    let unknown = |message: String| EvictFailed::Unknown {
        pod: v.to_string(),
        message,
    };
    let permit = tokio::time::timeout_at(deadline, s.api_permits.acquire()).await;
    let Ok(Ok(_permit)) = permit else {
        return Err(unknown("no API slot before the deadline".into()));
    };
    match tokio::time::timeout_at(deadline, pods.evict(&v.name, &ep)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(kube::Error::Api(st))) if st.code == 404 || st.code == 409 => Ok(()),
        Ok(Err(kube::Error::Api(st))) if st.code == 429 => Err(EvictFailed::Blocked {
            pod: v.to_string(),
            message: st.message.clone(),
        }),
        Ok(Err(kube::Error::Api(st))) => Err(EvictFailed::Refused {
            pod: v.to_string(),
            code: st.code,
            message: st.message.clone(),
        }),
        Ok(Err(e)) => Err(unknown(e.to_string())),
        Err(_) => Err(unknown("no answer before the deadline".into())),
    }
}
