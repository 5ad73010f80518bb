//! The extender's background tasks: the node and pod watches that keep the books,
//! the ResourceClaim and ResourceSlice watches that add what DRA claims hold of the
//! GPUs, and the timer that expires group reservations, checks assumed bookings against
//! the API, wakes group members whose places were freed and pending pods refused
//! for room where room has freed (nominating a pod tied to one node to that node),
//! and reports record problems (events, metrics).
//!
//! Never blind: each task runs under a supervisor. If it ends or panics, the
//! extender is not ready (`/readyz` 503, filter and bind refuse) until the task has
//! been restarted and, for a watch, has listed again. A panic that left the books
//! inconsistent ends the process instead (its restart rebuilds them from the API).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use kube::api::{Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::api::call;
use crate::convert::{WireNode, WirePod, node_inventory};
use crate::error::ApiError;
use crate::placement::Nomination;
use crate::state::Shared;

/// The annotation the extender bumps on a pending pod to make the scheduler
/// retry it now (an update of an unschedulable pod puts it back in the queue).
pub const WAKE_ANNOTATION: &str = "sharedgpu/wake";

/// Starts every background task under its supervisor.
pub(crate) fn start(client: Client, s: Arc<Shared>) -> Vec<JoinHandle<()>> {
    let (c1, c2, c3) = (client.clone(), client.clone(), client);
    vec![
        supervise("claims", s.clone(), move |s| {
            watch_claims(c3.clone(), s).boxed()
        }),
        supervise("nodes", s.clone(), move |s| {
            watch_nodes(c1.clone(), s).boxed()
        }),
        supervise("pods", s.clone(), move |s| {
            watch_pods(c2.clone(), s).boxed()
        }),
        supervise("timer", s, |s| timer(s).boxed()),
    ]
}

/// Runs `make(s)` until it ends; then marks the extender not ready, restarts it.
fn supervise<F>(name: &'static str, s: Arc<Shared>, make: F) -> JoinHandle<()>
where
    F: Fn(Arc<Shared>) -> futures::future::BoxFuture<'static, ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let r = tokio::spawn(make(s.clone())).await;
            s.tasks_down.fetch_add(1, Ordering::AcqRel);
            s.metrics
                .count("kubeshare_extender_task_restarts_total", name);
            match r {
                Err(e) if e.is_panic() => {
                    error!(task = name, "background task panicked; restarting it");
                    if let Err(broken) = s.with_cluster(|c| c.check_invariants()) {
                        error!(task = name, %broken, "the books are inconsistent after a panic: exiting so that a restart rebuilds them");
                        std::process::exit(70);
                    }
                }
                Err(_) => return, // aborted: shutting down
                Ok(()) => warn!(task = name, "background task ended; restarting it"),
            }
            if name == "pods" {
                s.pods_synced.store(false, Ordering::Release);
            } else if name == "nodes" {
                s.nodes_synced.store(false, Ordering::Release);
            } else if name == "claims" {
                s.claims_synced.store(false, Ordering::Release);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            s.tasks_down.fetch_sub(1, Ordering::AcqRel);
        }
    })
}

async fn watch_nodes(client: Client, s: Arc<Shared>) {
    let api: Api<WireNode> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(n)) | Ok(Event::Apply(n)) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                let inv = node_inventory(&n.metadata);
                if let Err(e) = &inv {
                    warn!(node = %name, error = %e, "bad GPU inventory");
                }
                s.with_cluster(|c| c.apply_node(&name, inv));
                listed.insert(name);
            }
            Ok(Event::Delete(n)) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                s.with_cluster(|c| c.delete_node(&name));
            }
            Ok(Event::InitDone) => {
                s.with_cluster(|c| c.retain_nodes(&listed));
                if !s.nodes_synced.swap(true, Ordering::AcqRel) {
                    info!(nodes = listed.len(), "nodes synced");
                }
            }
            Err(e) => warn!(error = %e, "node watch error"),
        }
    }
}

async fn watch_pods(client: Client, s: Arc<Shared>) {
    let api: Api<WirePod> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut listed: HashSet<String> = HashSet::new();
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(Event::Init) => listed.clear(),
            Ok(Event::InitApply(p)) | Ok(Event::Apply(p)) => {
                let info = p.info();
                listed.insert(info.uid.clone());
                s.with_cluster(|c| c.apply_pod(&info));
            }
            Ok(Event::Delete(p)) => {
                let uid = p.metadata.uid.clone().unwrap_or_default();
                s.with_cluster(|c| c.delete_pod(&uid));
            }
            Ok(Event::InitDone) => {
                s.with_cluster(|c| c.retain_pods(&listed));
                if !s.pods_synced.swap(true, Ordering::AcqRel) {
                    let (o, a, r) = s.with_cluster(|c| c.booking_counts());
                    info!(
                        pods = listed.len(),
                        observed = o,
                        assumed = a,
                        reserved = r,
                        "pods synced; allocations rebuilt from the records"
                    );
                }
            }
            Err(e) => warn!(error = %e, "pod watch error"),
        }
    }
}

/// How often a cluster without `resource.k8s.io/v1` is asked again whether it serves it.
const DRA_API_RECHECK: Duration = Duration::from_secs(300);

/// Whether the API serves ResourceClaims of `resource.k8s.io/v1`.
async fn serves_claims(client: &Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources("resource.k8s.io/v1").await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "resourceclaims")),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// ResourceClaims and the DRA driver's ResourceSlices: after every change, what the
/// claims hold of each GPU ([`crate::claims::claimed`]) replaces what the books held.
/// Synced once both have listed; on a cluster without `resource.k8s.io/v1` there is
/// nothing to hold, and it asks again now and then.
async fn watch_claims(client: Client, s: Arc<Shared>) {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use kube::runtime::reflector;
    loop {
        match serves_claims(&client).await {
            Ok(true) => break,
            Ok(false) => {
                s.with_cluster(|c| c.set_claims(Default::default()));
                if !s.claims_synced.swap(true, Ordering::AcqRel) {
                    info!(
                        "the API serves no resource.k8s.io/v1 ResourceClaims: no DRA claims to count"
                    );
                }
                tokio::time::sleep(DRA_API_RECHECK).await;
            }
            Err(e) => {
                warn!(error = %e, "cannot ask the API for resource.k8s.io/v1; retrying");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let slices: Api<ResourceSlice> = Api::all(client);
    let sc = watcher::Config::default()
        .fields(&format!("spec.driver={}", kubeshare_api::dra::DRIVER_NAME));
    let (cstore, mut cw) = reflector::store::<ResourceClaim>();
    let (sstore, mut sw) = reflector::store::<ResourceSlice>();
    let mut cs = watcher::watcher(claims, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut ss = watcher::watcher(slices, sc).default_backoff().boxed();
    let (mut claims_listed, mut slices_listed) = (false, false);
    loop {
        let mut changed = false;
        let mut claim_ev = |e: watcher::Result<Event<ResourceClaim>>, changed: &mut bool| match e {
            Ok(e) => {
                claims_listed |= matches!(e, Event::InitDone);
                *changed |= !matches!(e, Event::Init | Event::InitApply(_));
                cw.apply_watcher_event(&e);
            }
            Err(e) => warn!(error = %e, "ResourceClaim watch error"),
        };
        let mut slice_ev = |e: watcher::Result<Event<ResourceSlice>>, changed: &mut bool| match e {
            Ok(e) => {
                slices_listed |= matches!(e, Event::InitDone);
                *changed |= !matches!(e, Event::Init | Event::InitApply(_));
                sw.apply_watcher_event(&e);
            }
            Err(e) => warn!(error = %e, "ResourceSlice watch error"),
        };
        tokio::select! {
            ev = cs.next() => match ev {
                Some(e) => claim_ev(e, &mut changed),
                None => return,
            },
            ev = ss.next() => match ev {
                Some(e) => slice_ev(e, &mut changed),
                None => return,
            },
        }
        // Take every event already waiting, then recount once: a burst of claims
        // (a job's pods) costs one recount, not one each.
        while let Some(Some(e)) = cs.next().now_or_never() {
            claim_ev(e, &mut changed);
        }
        while let Some(Some(e)) = ss.next().now_or_never() {
            slice_ev(e, &mut changed);
        }
        if !(changed && claims_listed && slices_listed) {
            continue;
        }
        let (cl, sl) = (cstore.state(), sstore.state());
        let claimed = crate::claims::claimed(cl.iter().map(|c| &**c), sl.iter().map(|c| &**c));
        s.with_cluster(|c| c.set_claims(claimed));
        if !s.claims_synced.swap(true, Ordering::AcqRel) {
            info!(
                claims = cl.len(),
                slices = sl.len(),
                "ResourceClaims synced; their GPU shares are in the books"
            );
        }
    }
}

/// Every tick: expire reservations (a group's go together), check assumed bookings
/// that the watch has not confirmed, wake freed group members and pods refused
/// for room that has freed since, report problems.
async fn timer(s: Arc<Shared>) {
    let mut tick = tokio::time::interval(s.timing.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut trimmed = Instant::now();
    loop {
        tick.tick().await;
        if trimmed.elapsed() >= TRIM_EVERY {
            s.with_cluster(|c| c.compact());
            release_free_memory();
            trimmed = Instant::now();
        }
        let now = s.now_ms();
        let after = s.timing.assume_check.as_millis() as u64;
        let (wake, due, problems) = s.with_cluster(|c| {
            let mut wake = c.expire(now);
            wake.extend(c.take_wake());
            (
                wake_list(wake, c.take_nominations()),
                c.due_checks(now, after),
                c.take_problems(),
            )
        });
        s.gate.notify_waiters();
        for p in problems {
            warn!(pod = %p.name, ns = %p.namespace, problem = %p.error, "allocation record problem");
            s.metrics
                .count("kubeshare_extender_record_problems_total", p.error.kind());
            s.pod_event(
                (&p.namespace, &p.name, &p.uid),
                true,
                "GpuRecordProblem",
                "Check",
                p.error.to_string(),
            );
        }
        let Some(client) = s.client.clone() else {
            continue;
        };
        // Evictions queued outside a filter call (a restart's, taken up at a bind).
        crate::preemption::carry_out_orders(&s);
        for (uid, ns, name) in due {
            let (s, client) = (s.clone(), client.clone());
            tokio::spawn(async move { check_assumed(&s, client, &uid, &ns, &name).await });
        }
        for ((ns, name), node) in wake {
            let (s, client) = (s.clone(), client.clone());
            tokio::spawn(
                async move { wake_member(&s, client, &ns, &name, node.as_deref(), now).await },
            );
        }
    }
}

/// How often freed heap memory is given back to the system.
const TRIM_EVERY: Duration = Duration::from_secs(30);

/// Gives the heap's free pages back to the system. glibc keeps what a burst
/// freed in its per-thread arenas: after a 2,000-pod backlog, with every pod
/// gone, the extender's RSS stayed at 2.7x what it was before.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Asks the API about a pod whose assumed booking the watch has not confirmed.
async fn check_assumed(s: &Shared, client: Client, uid: &str, ns: &str, name: &str) {
    let pods: Api<WirePod> = Api::namespaced(client, ns);
    let deadline = Instant::now() + s.timing.bind_timeout;
    match call(s, deadline, "checking an assumed booking", || {
        pods.get(name)
    })
    .await
    {
        Ok(p) => {
            let info = p.info();
            let fresh = (info.uid == uid).then_some(&info);
            s.with_cluster(|c| c.confirm(uid, fresh));
        }
        Err(ApiError::Refused { code: 404, .. }) => s.with_cluster(|c| c.confirm(uid, None)),
        // Unknown: kept; asked again next period.
        Err(e) => {
            warn!(pod = %name, %ns, error = %e, "could not check an assumed booking")
        }
    }
}

/// One entry per pod to wake, with the node to nominate it to, if any: a
/// nomination always comes with a wake, since a change of the pod's status alone
/// does not move it out of kube-scheduler's unschedulable queue.
fn wake_list(
    wake: Vec<(String, String)>,
    nominations: Vec<Nomination>,
) -> BTreeMap<(String, String), Option<String>> {
    let mut out: BTreeMap<_, _> = wake.into_iter().map(|k| (k, None)).collect();
    for n in nominations {
        out.insert((n.namespace, n.name), Some(n.node));
    }
    out
}

/// Makes the scheduler retry a pod now rather than after its backoff; first,
/// when `node` is given, sets the pod's `status.nominatedNodeName` to it, so
/// that the retry evaluates that node before any other (the status patch is
/// sent first: the wake's event then reaches kube-scheduler after it).
async fn wake_member(
    s: &Shared,
    client: Client,
    ns: &str,
    name: &str,
    node: Option<&str>,
    now: u64,
) {
    let pods: Api<WirePod> = Api::namespaced(client, ns);
    let deadline = Instant::now() + s.timing.bind_timeout;
    let pp = PatchParams::default();
    if let Some(node) = node {
        let status = serde_json::json!({"status": {"nominatedNodeName": node}});
        let merge = Patch::Merge(&status);
        match call(s, deadline, "nominating a pod's node", || {
            pods.patch_status(name, &pp, &merge)
        })
        .await
        {
            Ok(_) => debug!(pod = %name, %ns, %node, "nominated"),
            Err(e) => {
                warn!(pod = %name, %ns, %node, error = %e, "could not nominate a pod's node")
            }
        }
    }
    let patch =
        serde_json::json!({"metadata": {"annotations": {WAKE_ANNOTATION: now.to_string()}}});
    let merge = Patch::Merge(&patch);
    let r = call(s, deadline, "waking a pod", || {
        pods.patch(name, &pp, &merge)
    })
    .await;
    if let Err(e) = r {
        warn!(pod = %name, %ns, error = %e, "could not wake a pod");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;
    use crate::placement::Config;
    use crate::server::Extender;

    /// A task that panics is restarted; meanwhile the extender is not ready.
    #[tokio::test]
    async fn a_panicking_task_is_restarted_and_not_ready_meanwhile() {
        let ext = Extender::offline(Config::default());
        let s = ext.shared.clone();
        s.mark_synced();
        assert!(s.synced());
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let h = supervise("timer", s.clone(), move |_| {
            let r = r.clone();
            async move {
                if r.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("boom");
                }
                std::future::pending::<()>().await;
            }
            .boxed()
        });
        // Not ready while it is down...
        let t0 = Instant::now();
        while s.synced() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "never went not-ready"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // ...and ready again once it runs again.
        while !s.synced() {
            assert!(t0.elapsed() < Duration::from_secs(10), "never came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let m = s.metrics.render(&[], (0, 0, 0), true);
        assert!(
            m.contains("kubeshare_extender_task_restarts_total{task=\"timer\"} 1"),
            "{m}"
        );
        h.abort();
    }

    /// A restarted pod watch is not ready until it has listed again.
    #[tokio::test]
    async fn a_restarted_watch_is_not_ready_until_it_lists() {
        let ext = Extender::offline(Config::default());
        let s = ext.shared.clone();
        s.mark_synced();
        let h = supervise("pods", s.clone(), |_| async {}.boxed());
        let t0 = Instant::now();
        while s.pods_synced.load(Ordering::Acquire) {
            assert!(t0.elapsed() < Duration::from_secs(5));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!s.synced(), "no list yet: still not ready");
        h.abort();
    }
}
