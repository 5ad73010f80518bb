//! Preemption on the real control plane: guaranteed pods (`sharedgpu/priority` > 0) that
//! find the GPUs full of opportunistic pods have some evicted (Eviction API) and bind in
//! their room; the victims' controllers re-create them and they wait with a reason; a
//! PodDisruptionBudget that forbids the eviction is respected; a preemption carries on
//! across an extender restart.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::watcher;
use kubeshare_scheduler::placement::{PREEMPTION_ANNOTATION, PreemptRecord};
use tokio::time::Instant;

use crate::rig::*;

/// A guaranteed pod binds within this of its creation, victims' eviction included
/// (the extender nominates it and wakes it when its victims have left).
const BIND_BOUND: Duration = Duration::from_secs(10);

const OPPORTUNISTIC: [(&str, &str); 2] = [("gpu_request", "0.5"), ("gpu_limit", "1.0")];
const GUARANTEED: [(&str, &str); 3] = [
    ("gpu_request", "0.5"),
    ("gpu_limit", "1.0"),
    ("priority", "50"),
];

/// Watches every pod of the namespace from before the test acts and checks, at each
/// version the API serves, that no GPU holds more than 1.0 of requests among the pods
/// that exist (terminating ones included: they still run). Returns the most seen.
fn watch_overcommit(rig: &Rig) -> (tokio::task::JoinHandle<Result<()>>, Arc<AtomicU32>) {
    let most = Arc::new(AtomicU32::new(0));
    let m = most.clone();
    let pods = rig.pods();
    let h = tokio::spawn(async move {
        let mut held: HashMap<String, (Vec<String>, u32)> = HashMap::new();
        let mut s = watcher(pods, watcher::Config::default()).boxed();
        while let Some(ev) = s.next().await {
            match ev? {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                    let uid = p.metadata.uid.clone().unwrap_or_default();
                    let a = Allocation::from_annotations(
                        &p.metadata.annotations.clone().unwrap_or_default(),
                    )?;
                    if let Some(a) = a {
                        let milli = u32::from(a.granted.request_per_gpu().get());
                        held.insert(uid, (a.gpu_uuids, milli));
                    }
                }
                watcher::Event::Delete(p) => {
                    held.remove(&p.metadata.uid.unwrap_or_default());
                }
                watcher::Event::Init | watcher::Event::InitDone => {}
            }
            let mut per_gpu: HashMap<&str, u32> = HashMap::new();
            for (gpus, milli) in held.values() {
                for g in gpus {
                    *per_gpu.entry(g).or_default() += milli;
                }
            }
            let top = per_gpu.values().copied().max().unwrap_or(0);
            m.fetch_max(top, Ordering::SeqCst);
            if top > 1000 {
                bail!("a GPU held {top} milli: {per_gpu:?}");
            }
        }
        Ok(())
    });
    (h, most)
}

/// Waits for an event of `reason` on pod `name`; returns its message.
async fn event(rig: &Rig, name: &str, reason: &str) -> Result<String> {
    let events: Api<Event> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    let lp = ListParams::default().fields(&format!("involvedObject.name={name}"));
    wait_until(&format!("{reason} event on {name}"), WAIT, || {
        let (events, lp) = (events.clone(), lp.clone());
        async move {
            let l = events.list(&lp).await.map_err(|e| e.to_string())?;
            Ok(l.items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
                .map(|e| e.message.unwrap_or_default()))
        }
    })
    .await
    .map_err(Into::into)
}

/// Creates a guaranteed pod and waits (at most [`BIND_BOUND`]) until it is bound.
async fn guaranteed_binds(rig: &Rig, name: &str) -> Result<(Allocation, Duration)> {
    let t = Instant::now();
    rig.create(name, &GUARANTEED).await?;
    wait_for(&rig.pods(), name, BIND_BOUND, |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
    })
    .await
    .with_context(|| format!("{name} not bound within {BIND_BOUND:?}"))?;
    let took = t.elapsed();
    Ok((rig.bound(name).await?, took))
}

fn names_of(pods: &[Pod]) -> Vec<String> {
    pods.iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

#[tokio::test]
async fn guaranteed_pods_preempt_opportunistic_replicas() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("preempt").await?;
    rig.node("a", 1, "A", 40).await?;
    rig.node("b", 1, "A", 40).await?;
    let (watch, most) = watch_overcommit(&rig);
    // Four opportunistic halves of a Deployment fill both GPUs.
    let tmpl = rig.pod_json("unused", &OPPORTUNISTIC);
    let mut labels = tmpl["metadata"]["labels"].clone();
    labels["app"] = json!("filler");
    let dep: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "filler"},
        "spec": {"replicas": 4, "selector": {"matchLabels": {"app": "filler"}},
                 "template": {"metadata": {"labels": labels}, "spec": tmpl["spec"]}}
    }))?;
    let deps: Api<Deployment> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    deps.create(&PostParams::default(), &dep).await?;
    let filler = wait_until("4 filler pods bound", WAIT, || async {
        let l = rig
            .pods()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let bound: Vec<Pod> = l
            .items
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .collect();
        Ok((bound.len() == 4).then_some(bound))
    })
    .await?;
    let before = names_of(&filler);

    // Two guaranteed pods arrive: each evicts one filler pod and binds in its room.
    let mut took = vec![];
    for g in ["g1", "g2"] {
        let (a, t) = guaranteed_binds(&rig, g).await?;
        took.push(t);
        let msg = event(&rig, g, "Preempting").await?;
        assert!(msg.contains(&a.node), "{msg}");
        let victim = before
            .iter()
            .find(|v| msg.contains(&format!("{}/{v}", rig.ns.name())))
            .with_context(|| format!("the Preempting event names no filler pod: {msg}"))?;
        let pmsg = event(&rig, victim, "Preempted").await?;
        assert!(pmsg.contains(&format!("/{g}")), "{pmsg}");
    }
    eprintln!("guaranteed pods bound after {took:?}");

    // The victims are gone; their ReplicaSet re-created them; they wait, with a reason.
    let pending = wait_until("the victims re-created and pending", WAIT, || async {
        let l = rig
            .pods()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let unbound: Vec<String> = l
            .items
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none())
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        Ok((l.items.len() == 6 && unbound.len() == 2).then_some(unbound))
    })
    .await?;
    for p in &pending {
        assert!(!before.contains(p), "{p} is a re-created pod");
        rig.failed_with(p, "free < 0.5 requested").await?;
    }
    // Nothing preempted a guaranteed pod, and no GPU held more than 1.0 meanwhile.
    for g in ["g1", "g2"] {
        rig.bound(g).await?;
    }
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 4);
    assert!(!watch.is_finished(), "{:?}", watch.await);
    watch.abort();
    assert_eq!(most.load(Ordering::SeqCst), 1000);
    rig.cleanup().await
}

#[tokio::test]
async fn a_disruption_budget_that_forbids_eviction_is_respected() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("pdb").await?;
    let a = rig.node("a", 1, "A", 40).await?;
    let (watch, _) = watch_overcommit(&rig);
    // Two opportunistic pods on a's GPU, under a budget that allows no disruption.
    for p in ["p1", "p2"] {
        let mut j = rig.pod_json(p, &OPPORTUNISTIC);
        j["metadata"]["labels"]["app"] = json!("protected");
        let pod: Pod = serde_json::from_value(j)?;
        rig.pods().create(&PostParams::default(), &pod).await?;
        assert_eq!(rig.bound(p).await?.node, a);
    }
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "protected"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "protected"}}}
    }))?;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    pdbs.create(&PostParams::default(), &pdb).await?;

    // The guaranteed pod's preemption is refused: it waits, saying why.
    rig.create("g", &GUARANTEED).await?;
    let msg = event(&rig, "g", "PreemptionBlocked").await?;
    assert!(msg.contains("PodDisruptionBudget"), "{msg}");
    rig.failed_with("g", "free < 0.5 requested").await?;
    for p in ["p1", "p2"] {
        rig.bound(p).await?;
    }
    assert_eq!(rig.unbound_names().await?, ["g"]);

    // Elsewhere, unprotected opportunistic pods. A new guaranteed pod tries a first
    // (the same cost; a's name sorts first), is refused, and preempts on b instead.
    rig.pods().delete("g", &Default::default()).await?;
    let b = rig.node("b", 1, "A", 40).await?;
    for u in ["u1", "u2"] {
        rig.create(u, &OPPORTUNISTIC).await?;
        assert_eq!(rig.bound(u).await?.node, b);
    }
    let (g2, took) = guaranteed_binds(&rig, "g2").await?;
    eprintln!("g2 bound after {took:?}");
    assert_eq!(g2.node, b);
    let msg = event(&rig, "g2", "PreemptionBlocked").await?;
    assert!(msg.contains(&a), "{msg}");
    let msg = event(&rig, "g2", "Preempting").await?;
    assert!(msg.contains("/u1") || msg.contains("/u2"), "{msg}");
    for p in ["p1", "p2"] {
        assert_eq!(rig.bound(p).await?.node, a, "{p} is protected");
    }
    rig.check_no_overcommit(40 * GIB).await?;
    assert!(!watch.is_finished(), "{:?}", watch.await);
    watch.abort();
    rig.cleanup().await
}

/// A guaranteed group (a Job of two, threshold 1.0) finds the GPUs full of opportunistic
/// pods: it preempts for both members at once, and both bind within the bound.
#[tokio::test]
async fn a_guaranteed_group_preempts_for_all_its_members_at_once() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("gpreempt").await?;
    rig.node("n", 2, "A", 40).await?;
    let (watch, _) = watch_overcommit(&rig);
    for f in ["f1", "f2", "f3", "f4"] {
        rig.create(f, &OPPORTUNISTIC).await?;
        rig.bound(f).await?;
    }
    let t = Instant::now();
    let mut tmpl = rig.pod_json("unused", &[]);
    let labels: BTreeMap<String, String> = [
        ("gpu_request", "0.5"),
        ("gpu_limit", "1.0"),
        ("priority", "50"),
        ("group_name", "train"),
        ("group_headcount", "2"),
        ("group_threshold", "1.0"),
    ]
    .into_iter()
    .map(|(k, v)| (format!("sharedgpu/{k}"), v.to_string()))
    .collect();
    tmpl["metadata"] = json!({"labels": labels});
    tmpl["spec"]["restartPolicy"] = json!("Never");
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train"},
        "spec": {"parallelism": 2, "completions": 2, "backoffLimit": 0,
                 "template": {"metadata": tmpl["metadata"], "spec": tmpl["spec"]}}
    }))?;
    let jobs: Api<Job> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    jobs.create(&PostParams::default(), &job).await?;
    let members = wait_until("both members bound", BIND_BOUND, || async {
        let l = rig
            .pods()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let bound: Vec<String> = l
            .items
            .iter()
            .filter(|p| {
                p.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.starts_with("train-"))
            })
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some())
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        Ok((bound.len() == 2).then_some(bound))
    })
    .await?;
    eprintln!("group bound after {:?}", t.elapsed());
    // Two opportunistic pods were evicted; the others were not.
    let left: Vec<String> = rig
        .pods()
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .filter(|n| n.starts_with('f'))
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    // Neither member fitted as the books were: both preempted, in one order.
    for m in &members {
        let msg = event(&rig, m, "Preempting").await?;
        assert!(msg.contains("group train"), "{msg}");
        for other in &members {
            assert!(msg.contains(other.as_str()), "{msg}");
        }
    }
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 4);
    assert!(!watch.is_finished(), "{:?}", watch.await);
    watch.abort();
    rig.cleanup().await
}

/// A finalizer the test puts on pods so that an evicted one stays (terminating, still
/// on its GPU) until the test lets it go: a long graceful termination, made exact.
const HOLD: &str = "kubeshare.io/test-hold";

/// Lets pod `name` go: removes its finalizers.
async fn release(rig: &Rig, name: &str) -> Result<()> {
    let p = json!({"metadata": {"finalizers": null}});
    rig.pods()
        .patch(name, &PatchParams::default(), &Patch::Merge(&p))
        .await?;
    Ok(())
}

/// How many events of `reason` the namespace holds about pod `name` (a repeated event
/// counts as often as it was sent).
async fn count_events(rig: &Rig, name: &str, reason: &str) -> Result<i32> {
    let events: Api<Event> = Api::namespaced(rig.admin.clone(), rig.ns.name());
    let lp = ListParams::default().fields(&format!("involvedObject.name={name}"));
    Ok(events
        .list(&lp)
        .await?
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| e.count.unwrap_or(1).max(1))
        .sum())
}

/// The value of a `/metrics` series of the extender (0 when absent).
async fn metric(rig: &Rig, series: &str) -> Result<f64> {
    let (_, m) = get(rig.cluster.extender_port(), "/metrics").await?;
    Ok(m.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0))
}

/// The extender is killed (SIGKILL) after it evicted a guaranteed pod's victim and
/// before the pod could bind: the victim is still leaving (held by a finalizer, as by
/// a long graceful termination). The next extender carries the preemption on from the
/// pod's record: the guaranteed pod, retried, waits for its victim instead of
/// preempting again; an opportunistic pod that asks meanwhile does not get the room;
/// once the victim is gone the guaranteed pod binds there. One eviction in all, and
/// no GPU above 1.0 at any version of the pods.
#[tokio::test]
async fn a_preemption_carries_on_across_an_extender_restart() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("preempt-restart").await?;
    let node = rig.node("n", 1, "A", 40).await?;
    let (watch, most) = watch_overcommit(&rig);
    for f in ["f1", "f2"] {
        let mut j = rig.pod_json(f, &OPPORTUNISTIC);
        j["metadata"]["finalizers"] = json!([HOLD]);
        let pod: Pod = serde_json::from_value(j)?;
        rig.pods().create(&PostParams::default(), &pod).await?;
        assert_eq!(rig.bound(f).await?.node, node);
    }
    rig.create("g", &GUARANTEED).await?;
    // The eviction is posted: one filler pod is terminating, and held there.
    let (victim, victim_uid) = wait_until("a filler pod evicted", WAIT, || async {
        let l = rig
            .pods()
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        Ok(l.items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_some())
            .map(|p| {
                (
                    p.metadata.name.unwrap_or_default(),
                    p.metadata.uid.unwrap_or_default(),
                )
            }))
    })
    .await?;
    // Its events are out (they are sent apart from the evictions), then the kill.
    event(&rig, "g", "Preempting").await?;
    event(&rig, &victim, "Preempted").await?;
    rig.kill_extender();
    let other = if victim == "f1" { "f2" } else { "f1" };
    assert!(rig.unbound_names().await?.contains(&"g".to_string()));
    // The record the new extender will read: g's node and its one victim.
    let g = rig.pods().get("g").await?;
    let rec = g
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PREEMPTION_ANNOTATION))
        .and_then(|v| PreemptRecord::from_annotation(v))
        .context("g carries no preemption record")?;
    assert_eq!(
        (rec.node.as_str(), rec.victims.as_slice()),
        (node.as_str(), &[victim_uid][..])
    );

    // While no extender runs, an opportunistic pod comes for the same room.
    rig.create("rival", &OPPORTUNISTIC).await?;
    rig.start_extender("preempt-restart").await?;
    // g, retried now (an update moves it out of kube-scheduler's unschedulable queue),
    // is told to wait for its victim; it preempts nobody else. Its filter is the new
    // extender's first decision: the records are taken up then.
    let poke = json!({"metadata": {"annotations": {"kubeshare.io/test-poke": "1"}}});
    rig.pods()
        .patch("g", &PatchParams::default(), &Patch::Merge(&poke))
        .await?;
    wait_until("the preemption taken up", WAIT, || async {
        let v = metric(
            &rig,
            "kubeshare_extender_preemptions_total{outcome=\"resumed\"}",
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok((v == 1.0).then_some(()))
    })
    .await?;
    wait_until("g filtered by the new extender", WAIT, || async {
        let v = metric(
            &rig,
            "kubeshare_extender_decisions_total{verb=\"filter\",outcome=\"preempting\"}",
        )
        .await
        .map_err(|e| e.to_string())?;
        Ok((v >= 1.0).then_some(()))
    })
    .await?;
    rig.failed_with(
        "g",
        &format!(
            "waiting for 1 of the 1 opportunistic pod(s) evicted for this pod to leave {node}"
        ),
    )
    .await?;
    rig.failed_with("rival", "free < 0.5 requested").await?;

    // The victim goes: g binds in its room; the rival does not get it.
    let t = Instant::now();
    release(&rig, &victim).await?;
    let p = wait_for(&rig.pods(), "g", BIND_BOUND, |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
    })
    .await
    .context("g not bound after its victim left")?;
    eprintln!("g bound {:?} after its victim left", t.elapsed());
    assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some(&*node));
    rig.failed_with("rival", "free < 0.5 requested").await?;
    assert_eq!(rig.unbound_names().await?, ["rival"]);
    // One eviction, one Preempting event: the restart started no second preemption.
    let o = rig.pods().get(other).await?;
    assert!(
        o.metadata.deletion_timestamp.is_none(),
        "{other} was evicted too"
    );
    assert_eq!(count_events(&rig, "g", "Preempting").await?, 1);
    assert_eq!(count_events(&rig, &victim, "Preempted").await?, 1);
    assert_eq!(count_events(&rig, other, "Preempted").await?, 0);
    assert_eq!(count_events(&rig, "rival", "Preempted").await?, 0);
    // The books agree: the GPU is full, not over.
    let share = metric(
        &rig,
        &format!(
            "kubeshare_gpu_allocated_share{{node=\"{node}\",gpu=\"0\",uuid=\"{}\",model=\"A\"}}",
            uuid(&node, 0)
        ),
    )
    .await?;
    assert_eq!(share, 1000.0);
    assert_eq!(rig.check_no_overcommit(40 * GIB).await?, 2);
    assert!(!watch.is_finished(), "{:?}", watch.await);
    watch.abort();
    assert_eq!(most.load(Ordering::SeqCst), 1000);
    release(&rig, other).await?;
    rig.cleanup().await
}
