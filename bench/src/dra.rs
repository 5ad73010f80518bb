//! The DRA side of a scale run: the nodes' ResourceSlices as the node daemon builds them
//! (`kubeshare_node_daemon::dra::slice`, published here because kwok runs no daemon), the
//! DeviceClass as the chart installs it, the claims' template, and the check a DRA run
//! ends with, read from the claims' allocation results: no device's allocated `compute`
//! above its 1000, and every bound pod's claim allocated on its node's pool.
//!
//! The check is pure, over `ResourceClaim` and `Pod` objects, so it is unit-tested.

use std::collections::BTreeMap;

use anyhow::Context;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use kubeshare_api::dra::{COMPUTE, COMPUTE_UNITS, DEVICE_CLASS, DRIVER_NAME, MEMORY};
use kubeshare_node_daemon::dra::slice;
use serde_json::json;

use crate::rig::{BENCH_LABEL, inventory};

/// The name of the ResourceClaimTemplate (and claim name in the pods) of a DRA run.
pub const TEMPLATE: &str = "gpu-share";

/// Creates the DeviceClass `gpu.kubeshare.io` as `charts/kubeshare/templates/dra.yaml`
/// does (an existing one is kept).
pub async fn create_device_class(admin: &Client) -> anyhow::Result<()> {
    let api: Api<DeviceClass> = Api::all(admin.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER_NAME}\"")}}]}
    }))?;
    match api.create(&PostParams::default(), &class).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e).context("creating the DeviceClass"),
    }
}

/// Publishes the slice of every node labelled `BENCH_LABEL=bench`, built by the node
/// daemon's own [`slice::plan`] from the same simulated inventory the node carries
/// (`bench-NNNNN` is node NNNNN of [`inventory`]). Returns how many it created.
pub async fn publish_slices(
    admin: &Client,
    bench: &str,
    gpus: u32,
    concurrency: usize,
) -> anyhow::Result<usize> {
    let nodes: Api<Node> = Api::all(admin.clone());
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let listed = nodes
        .list(&ListParams::default().labels(&format!("{BENCH_LABEL}={bench}")))
        .await
        .context("listing the bench's nodes")?
        .items;
    let existing: BTreeMap<String, ResourceSlice> = slices
        .list(&ListParams::default().fields(&format!("spec.driver={DRIVER_NAME}")))
        .await
        .context("listing slices")?
        .items
        .into_iter()
        .filter_map(|s| Some((s.spec.node_name.clone()?, s)))
        .collect();
    let created = stream::iter(listed)
        .map(|n| {
            let slices = slices.clone();
            let name = n.metadata.name.clone().unwrap_or_default();
            let uid = n.metadata.uid.clone().unwrap_or_default();
            let index = name
                .strip_prefix("bench-")
                .and_then(|i| i.parse::<u32>().ok());
            let cur = existing.get(&name).cloned();
            async move {
                let index = index.with_context(|| format!("node {name} is not bench-NNNNN"))?;
                let inv = inventory(index, gpus);
                // No label pods on these nodes: every GPU's whole capacity is DRA's.
                let used = slice::LabelUse::new();
                match slice::plan(&name, &uid, &inv, &used, cur.as_ref()) {
                    slice::Step::Create(s) => {
                        slices.create(&PostParams::default(), &s).await?;
                        anyhow::Ok(1)
                    }
                    slice::Step::Replace(s) => {
                        let n = s.metadata.name.clone().unwrap_or_default();
                        slices.replace(&n, &PostParams::default(), &s).await?;
                        Ok(0)
                    }
                    slice::Step::Unchanged => Ok(0),
                }
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<usize>>()
        .await
        .context("publishing slices")?;
    Ok(created.into_iter().sum())
}

/// The claim every DRA pod gets: `compute` thousandths and `memory` of one GPU of the
/// DeviceClass, its limit (the same share) in the opaque config, as in examples/dra/.
pub fn claim_spec(compute: u16, memory: &str) -> serde_json::Value {
    let share = format!("{}", f64::from(compute) / f64::from(COMPUTE_UNITS));
    json!({"devices": {
        "requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DEVICE_CLASS,
            "capacity": {"requests": {COMPUTE: compute.to_string(), MEMORY: memory}}}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER_NAME, "parameters": {
            "apiVersion": kubeshare_api::dra::CONFIG_API_VERSION,
            "kind": kubeshare_api::dra::CONFIG_KIND,
            "request": share, "limit": share}}}]
    }})
}

/// Every claim of `api`, in pages.
pub async fn list_claims(api: &Api<ResourceClaim>) -> anyhow::Result<Vec<ResourceClaim>> {
    let mut all = Vec::new();
    let mut lp = ListParams::default().limit(500);
    loop {
        let page = api.list(&lp).await.context("listing claims")?;
        all.extend(page.items);
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(all),
        }
    }
}

/// Per-device `compute` allocated and the claims or pods that break the rules.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ClaimCheck {
    /// Pods with `spec.nodeName` set.
    pub bound: usize,
    /// Pods not bound yet.
    pub pending: usize,
    /// Claims with an allocation.
    pub allocated: usize,
    /// `pool/device` → the sum of the `compute` its claims consumed, thousandths.
    pub compute: BTreeMap<String, u64>,
    /// `what: why` for claims and bound pods that are wrong.
    pub bad: Vec<String>,
}

impl ClaimCheck {
    /// Devices whose allocated compute is above the whole GPU, with their sums.
    pub fn overcommitted(&self) -> Vec<(&str, u64)> {
        self.compute
            .iter()
            .filter(|(_, c)| **c > u64::from(COMPUTE_UNITS))
            .map(|(d, c)| (d.as_str(), *c))
            .collect()
    }

    /// The largest allocated compute of any device, thousandths.
    pub fn max(&self) -> u64 {
        self.compute.values().copied().max().unwrap_or(0)
    }

    /// Whether the run ended as it must: every pod bound with its claim allocated on its
    /// node, no device above 1000.
    pub fn ok(&self) -> bool {
        self.pending == 0 && self.bad.is_empty() && self.overcommitted().is_empty()
    }
}

/// Checks the claims of a run against its pods (all in one namespace).
pub fn check_claims(pods: &[Pod], claims: &[ResourceClaim]) -> ClaimCheck {
    let mut c = ClaimCheck::default();
    // Pod name → its node, for the bound pods.
    let mut node_of = BTreeMap::new();
    for p in pods {
        let name = p.metadata.name.clone().unwrap_or_default();
        match p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            Some(n) => {
                c.bound += 1;
                node_of.insert(name, n);
            }
            None => c.pending += 1,
        }
    }
    // Bound pods whose claim was seen allocated on their node.
    let mut placed = BTreeMap::new();
    for claim in claims {
        let name = claim.metadata.name.clone().unwrap_or_default();
        let status = claim.status.as_ref();
        let Some(alloc) = status.and_then(|s| s.allocation.as_ref()) else {
            continue;
        };
        c.allocated += 1;
        let results = alloc
            .devices
            .as_ref()
            .and_then(|d| d.results.as_ref())
            .cloned()
            .unwrap_or_default();
        let users: Vec<String> = status
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| r.resource == "pods")
            .map(|r| r.name.clone())
            .collect();
        for r in &results {
            if r.driver != DRIVER_NAME {
                continue;
            }
            let consumed = r
                .consumed_capacity
                .as_ref()
                .and_then(|m| m.get(COMPUTE))
                .map(|q| kubeshare_api::parse_bytes(&q.0));
            match consumed {
                Some(Ok(v)) => {
                    *c.compute
                        .entry(format!("{}/{}", r.pool, r.device))
                        .or_default() += v
                }
                Some(Err(e)) => c
                    .bad
                    .push(format!("claim {name}: compute does not parse: {e}")),
                None => c.bad.push(format!("claim {name}: no consumed compute")),
            }
            for u in &users {
                match node_of.get(u) {
                    // The node daemon names the pool after its node.
                    Some(n) if *n == r.pool => {
                        placed.insert(u.clone(), ());
                    }
                    Some(n) => c.bad.push(format!(
                        "pod {u}: bound to {n} but claim {name} is on pool {}",
                        r.pool
                    )),
                    None => {}
                }
            }
        }
    }
    for p in node_of.keys() {
        if !placed.contains_key(p) {
            c.bad
                .push(format!("pod {p}: bound with no claim allocated for it"));
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node, "containers": []}
        }))
        .expect("test pod")
    }

    fn claim(name: &str, pod: &str, pool: &str, device: &str, compute: &str) -> ResourceClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": DRIVER_NAME, "pool": pool, "device": device,
                    "consumedCapacity": {"compute": compute, "memory": "1Gi"}}]}},
                "reservedFor": [{"resource": "pods", "name": pod, "uid": "u"}]
            }
        }))
        .expect("test claim")
    }

    #[test]
    fn three_shares_of_300_fit_a_fourth_does_not() {
        let mut pods: Vec<Pod> = (0..3).map(|i| pod(&format!("p{i}"), Some("n"))).collect();
        let mut claims: Vec<ResourceClaim> = (0..3)
            .map(|i| claim(&format!("c{i}"), &format!("p{i}"), "n", "gpu-0", "300"))
            .collect();
        let c = check_claims(&pods, &claims);
        assert!(c.ok(), "{c:?}");
        assert_eq!((c.bound, c.allocated, c.max()), (3, 3, 900));
        pods.push(pod("p3", Some("n")));
        // The apiserver may write quantities in canonical form.
        claims.push(claim("c3", "p3", "n", "gpu-0", "0.3k"));
        let c = check_claims(&pods, &claims);
        assert!(!c.ok());
        assert_eq!(c.overcommitted(), vec![("n/gpu-0", 1200)]);
    }

    #[test]
    fn a_claim_on_another_node_or_none_at_all_fails_the_check() {
        let c = check_claims(
            &[pod("p", Some("a"))],
            &[claim("c", "p", "b", "gpu-0", "300")],
        );
        assert!(
            c.bad[0].contains("bound to a but claim c is on pool b"),
            "{c:?}"
        );
        let c = check_claims(&[pod("p", Some("a"))], &[]);
        assert!(c.bad[0].contains("no claim allocated"), "{c:?}");
        let c = check_claims(&[pod("p", None)], &[]);
        assert_eq!((c.pending, c.bound), (1, 0));
        assert!(!c.ok());
    }

    #[test]
    fn the_claim_books_compute_and_memory_with_its_limit() {
        let v = claim_spec(300, "4Gi");
        let r = &v["devices"]["requests"][0]["exactly"];
        assert_eq!(r["deviceClassName"], "gpu.kubeshare.io");
        assert_eq!(r["capacity"]["requests"]["compute"], "300");
        assert_eq!(r["capacity"]["requests"]["memory"], "4Gi");
        let p = &v["devices"]["config"][0]["opaque"]["parameters"];
        assert_eq!((&p["request"], &p["limit"]), (&json!("0.3"), &json!("0.3")));
        // What the node daemon's kubelet plugin would accept for the claim.
        use kubeshare_api::dra::{Consumed, ShareConfig};
        let cfg = ShareConfig::from_value(p).expect("the config parses");
        let booked = Consumed {
            compute: kubeshare_api::Milli::new(300).expect("300 thousandths"),
            memory: 4 << 30,
        };
        assert!(cfg.resolve(booked).is_ok(), "{cfg:?}");
    }
}
