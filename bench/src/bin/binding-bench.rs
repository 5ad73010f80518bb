//! What one Binding costs the apiserver, JSON against protobuf.
//!
//! Run under `hack/with-cluster.sh`. Per round: N pending pods (a scheduler name
//! nobody serves), then each is bound with the extender's identity, the way the
//! extender binds (the record's annotations on the Binding, `--concurrency` at
//! once), in one encoding; the apiserver's and etcd's CPU time over the round,
//! per Binding. Rounds alternate the encodings, so that drift in the machine hits
//! both alike; the medians are printed. `--compare record` alternates instead, in
//! JSON, the extender's Binding with its record, the same without the record, and
//! one without the record sent as kube-scheduler (the default scheduler's Binding,
//! but for the encoding): what the record and the identity cost on their own.
//!
//!   hack/with-cluster.sh target/release/binding-bench [--pods 1000] [--rounds 6] [--compare record]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Binding, Namespace, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use kubeshare_api::{Allocation, Granted, Milli};
use kubeshare_bench::binding_pb::{self, BindingSpec};
use kubeshare_bench::rig::{component_pid, cpu_snapshot, create_namespace};
use kubeshare_testkit::{Cluster, Identity};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "CPU the apiserver and etcd spend per pods/binding, JSON against protobuf")]
struct Args {
    /// Pods bound per round.
    #[arg(long, default_value_t = 1000)]
    pods: u32,
    /// Rounds (alternating JSON and protobuf).
    #[arg(long, default_value_t = 6)]
    rounds: u32,
    /// Bindings in flight at once (the extender's `--api-concurrency`).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// What the rounds alternate.
    #[arg(long, value_enum, default_value = "encoding")]
    compare: Compare,
}

#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
enum Compare {
    /// JSON and protobuf, both with the record, as the extender.
    Encoding,
    /// JSON: with the record as the extender, without it, without it as kube-scheduler.
    Record,
}

/// One round's kind of Binding.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    enc: Encoding,
    record: bool,
    as_scheduler: bool,
}

impl Variant {
    fn of(compare: Compare, round: u32) -> Variant {
        let v = |enc, record, as_scheduler| Variant {
            enc,
            record,
            as_scheduler,
        };
        match (compare, round % 3) {
            (Compare::Encoding, _) if round.is_multiple_of(2) => v(Encoding::Json, true, false),
            (Compare::Encoding, _) => v(Encoding::Protobuf, true, false),
            (Compare::Record, 0) => v(Encoding::Json, true, false),
            (Compare::Record, 1) => v(Encoding::Json, false, false),
            (Compare::Record, _) => v(Encoding::Json, false, true),
        }
    }

    fn name(self) -> &'static str {
        match (self.enc, self.record, self.as_scheduler) {
            (Encoding::Protobuf, _, _) => "protobuf, record, extender",
            (Encoding::Json, true, _) => "json, record, extender",
            (Encoding::Json, false, false) => "json, no record, extender",
            (Encoding::Json, false, true) => "json, no record, kube-scheduler",
        }
    }
}

const NS: &str = "binding-bench";
const NODE: &str = "binding-bench-node";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Encoding {
    Json,
    Protobuf,
}

/// The record the extender puts on a Binding, for a quarter of an H100.
fn record() -> BTreeMap<String, String> {
    Allocation {
        node: NODE.into(),
        gpu_uuids: vec!["GPU-0f5f1c1e-7b43-4c4e-9d8a-3b1a2c3d4e5f".into()],
        gpu_mem: 21_474_836_480,
        gpu_model: "NVIDIA H100 80GB HBM3".into(),
        granted: Granted::Fraction {
            request: Milli::new(250).unwrap_or(Milli::ONE),
            limit: Milli::new(250).unwrap_or(Milli::ONE),
        },
        gpu_mem_resident: None,
    }
    .to_annotations()
}

async fn bind(
    client: &Client,
    pods: &Api<Pod>,
    p: &Pod,
    ann: &BTreeMap<String, String>,
    enc: Encoding,
) -> anyhow::Result<()> {
    let name = p.metadata.name.clone().context("pod without a name")?;
    let uid = p.metadata.uid.clone().context("pod without a uid")?;
    match enc {
        Encoding::Json => {
            let b = Binding {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(NS.into()),
                    uid: Some(uid),
                    resource_version: p.metadata.resource_version.clone(),
                    annotations: Some(ann.clone()),
                    ..ObjectMeta::default()
                },
                target: ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(NODE.into()),
                    ..ObjectReference::default()
                },
            };
            pods.create_subresource::<Binding, serde_json::Value>(
                "binding",
                &name,
                &PostParams::default(),
                &b,
            )
            .await?;
        }
        Encoding::Protobuf => {
            let body = binding_pb::encode(&BindingSpec {
                name: &name,
                namespace: NS,
                uid: &uid,
                resource_version: p.metadata.resource_version.as_deref(),
                annotations: Some(ann),
                node: NODE,
            });
            let path = binding_pb::path(NS, &name).context("pod name")?;
            let req = http::Request::post(path)
                .header(http::header::CONTENT_TYPE, binding_pb::CONTENT_TYPE)
                .header(http::header::ACCEPT, "application/json")
                .body(body)?;
            client.request::<serde_json::Value>(req).await?;
        }
    }
    Ok(())
}

async fn create_pending(admin: &Api<Pod>, n: u32) -> anyhow::Result<Vec<Pod>> {
    stream::iter(0..n)
        .map(|i| {
            let admin = admin.clone();
            async move {
                let p: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("p-{i:05}")},
                    "spec": {"schedulerName": "binding-bench-nobody",
                             "containers": [{"name": "main", "image": "registry.invalid/x:1"}]}
                }))?;
                Ok::<_, anyhow::Error>(admin.create(&PostParams::default(), &p).await?)
            }
        })
        .buffer_unordered(16)
        .try_collect()
        .await
}

async fn delete_all(admin: &Api<Pod>) -> anyhow::Result<()> {
    admin
        .delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await?;
    let t = Instant::now();
    while !admin.list(&ListParams::default()).await?.items.is_empty() {
        if t.elapsed() > Duration::from_secs(120) {
            bail!("pods of {NS} still there after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cluster = Cluster::shared().context("no cluster: run under hack/with-cluster.sh")?;
    let admin = cluster.client(Identity::Admin).await?;
    let ext = cluster.client(Identity::Extender).await?;
    let sched = cluster.client(Identity::KubeScheduler).await?;
    let run_dir = cluster.run_dir().to_owned();
    let pids: BTreeMap<String, u32> = ["kube-apiserver", "etcd"]
        .into_iter()
        .map(|n| Ok((n.to_string(), component_pid(&run_dir, n)?)))
        .collect::<anyhow::Result<_>>()?;
    create_namespace(&admin, NS).await?;
    let admin_pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let ext_pods: Api<Pod> = Api::namespaced(ext.clone(), NS);
    let sched_pods: Api<Pod> = Api::namespaced(sched.clone(), NS);

    let mut results: BTreeMap<&str, Vec<(f64, f64, f64)>> = BTreeMap::new();
    for round in 0..args.rounds {
        let variant = Variant::of(args.compare, round);
        let enc = variant.enc;
        let ann = if variant.record {
            record()
        } else {
            BTreeMap::new()
        };
        let (client, pods) = if variant.as_scheduler {
            (&sched, &sched_pods)
        } else {
            (&ext, &ext_pods)
        };
        let pending = create_pending(&admin_pods, args.pods).await?;
        let cpu0 = cpu_snapshot(&pids)?;
        let t0 = Instant::now();
        stream::iter(pending.iter())
            .map(|p| bind(client, pods, p, &ann, enc))
            .buffer_unordered(args.concurrency)
            .try_collect::<Vec<_>>()
            .await
            .with_context(|| format!("binding, {enc:?}"))?;
        let wall = t0.elapsed();
        let cpu1 = cpu_snapshot(&pids)?;
        let per_binding = |d: Duration| d.as_secs_f64() * 1000.0 / f64::from(args.pods);
        let cpu = |n: &str| per_binding(cpu1[n].saturating_sub(cpu0[n]));
        let (api, etcd, wall) = (cpu("kube-apiserver"), cpu("etcd"), per_binding(wall));
        let bound = admin_pods
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE)
                    && (!variant.record
                        || p.metadata.annotations.as_ref().is_some_and(|a| {
                            Allocation::from_annotations(a).ok().flatten().is_some()
                        }))
            })
            .count();
        if bound != args.pods as usize {
            bail!(
                "{}: {bound} of {} pods bound (with their record if sent)",
                variant.name(),
                args.pods
            );
        }
        let line = json!({"round": round, "binding": variant.name(), "bindings": args.pods,
            "apiserver_cpu_ms_per_binding": api, "etcd_cpu_ms_per_binding": etcd,
            "wall_ms_per_binding": wall});
        println!("{line}");
        results
            .entry(variant.name())
            .or_default()
            .push((api, etcd, wall));
        delete_all(&admin_pods).await?;
    }
    Api::<Namespace>::all(admin.clone())
        .delete(NS, &DeleteParams::default())
        .await
        .ok();
    println!(
        "| binding | apiserver CPU ms/binding (median) | etcd CPU ms/binding | wall ms/binding |"
    );
    println!("|---|---|---|---|");
    for (name, v) in &results {
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} |",
            median(v.iter().map(|x| x.0).collect()),
            median(v.iter().map(|x| x.1).collect()),
            median(v.iter().map(|x| x.2).collect()),
        );
    }
    Ok(())
}
