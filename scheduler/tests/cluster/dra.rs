//! One set of books with DRA: a ResourceClaim that the stock kube-scheduler allocated
//! on a GPU of driver gpu.kubeshare.io counts in the extender's books, so a label pod
//! goes elsewhere or stays pending with a reason that names the claim.
//!
//! The node's ResourceSlice is written here as the node daemon writes it
//! (node-daemon/src/dra/slice.rs; kwok runs no daemon). Needs Kubernetes 1.36+
//! (consumable capacity); skipped on older control planes.

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::DeleteParams;
use kubeshare_api::dra::{DRIVER_NAME, device_name};

use crate::rig::*;

/// The node daemon's slice for `node`: GPU `index` 0..gpus with its UUID, whole.
fn slice(node: &str, gpus: u32, mem_gib: u64) -> Result<ResourceSlice> {
    let mem = (mem_gib * GIB).to_string();
    let devices: Vec<_> = (0..gpus)
        .map(|i| {
            json!({
                "name": device_name(i),
                "allowMultipleAllocations": true,
                "attributes": {"uuid": {"string": uuid(node, i)}, "index": {"int": i}},
                "capacity": {
                    "compute": {"value": "1000", "requestPolicy": {"default": "1000",
                        "validRange": {"min": "0", "max": "1000", "step": "1"}}},
                    "memory": {"value": mem, "requestPolicy": {"default": mem,
                        "validRange": {"min": "1Mi", "step": "1Mi"}}},
                },
            })
        })
        .collect();
    Ok(serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{DRIVER_NAME}")},
        "spec": {"driver": DRIVER_NAME, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": devices},
    }))?)
}

#[tokio::test]
async fn a_claim_on_a_gpu_keeps_label_pods_off_its_share() -> Result<()> {
    let _g = serial().await;
    let mut rig = Rig::new("dra").await?;
    let admin = rig.admin.clone();
    let v = admin.apiserver_version().await?;
    let minor: u32 = v
        .minor
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or(0);
    if minor < 36 {
        eprintln!("skipped: consumable capacity needs Kubernetes 1.36+ (minor {minor})");
        return rig.cleanup().await;
    }
    let dc: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": DRIVER_NAME},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == \"{DRIVER_NAME}\"")}}]},
    }))?;
    Api::<DeviceClass>::all(admin.clone())
        .patch(
            DRIVER_NAME,
            &PatchParams::apply("kubeshare-ext-dra-test").force(),
            &Patch::Apply(&dc),
        )
        .await?;
    let claimed = rig.node("claimed", 1, "A", 40).await?;
    let other = rig.node("other", 1, "A", 40).await?;
    let slices: Api<ResourceSlice> = Api::all(admin.clone());
    let pp = PostParams::default();
    slices.create(&pp, &slice(&claimed, 1, 40)?).await?;

    // A pod of the stock scheduler claims 0.7 of the claimed node's GPU.
    let ns = rig.ns.name().to_string();
    let templates: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(admin.clone(), &ns);
    templates
        .create(
            &pp,
            &serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "share-700"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": DRIVER_NAME,
                    "capacity": {"requests": {"compute": "700", "memory": "4Gi"}}}}]}}},
            }))?,
        )
        .await?;
    let claimer: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "claimer"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": claimed},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "registry.invalid/app:1",
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "share-700"}],
        },
    }))?;
    rig.pods().create(&pp, &claimer).await?;
    let p = wait_for(&rig.pods(), "claimer", WAIT, |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(claimed.as_str())
    })
    .await?;
    let claim_name = p
        .status
        .and_then(|s| s.resource_claim_statuses)
        .and_then(|v| v.into_iter().find_map(|s| s.resource_claim_name))
        .context("the claimer names no generated claim")?;
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), &ns);
    let c = wait_for(&claims, &claim_name, WAIT, |c: &ResourceClaim| {
        c.status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .is_some()
    })
    .await?;
    let results = kubeshare_testkit::dra::allocated_devices(c);
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(
        (results[0].pool.as_str(), results[0].device.as_str()),
        (claimed.as_str(), "gpu-0")
    );

    // 0.5 does not fit beside the claim's 0.7: the label pod goes to the other node.
    rig.create("first", &[("gpu_request", "0.5"), ("gpu_limit", "0.5")])
        .await?;
    let first = rig.bound("first").await?;
    assert_eq!(first.node, other, "the claimed GPU has 0.3 free");
    // 0.3 fits beside the claim: the books hold the claim's 0.7, not more.
    rig.create("small", &[("gpu_request", "0.3"), ("gpu_limit", "0.3")])
        .await?;
    let small = rig.bound("small").await?;
    assert_eq!(small.node, claimed);
    assert_eq!(small.gpu_uuids, vec![uuid(&claimed, 0)]);
    // 0.6 fits nowhere (the other node has 0.5 left); the claimed node's reason names
    // the claim.
    rig.create("second", &[("gpu_request", "0.6"), ("gpu_limit", "0.6")])
        .await?;
    let msg = rig
        .failed_with(
            "second",
            &format!("counting 0.7 held by ResourceClaims {ns}/{claim_name}"),
        )
        .await?;
    assert!(
        msg.contains(&format!(
            "{claimed}/gpu 0: 0.0 free < 0.6 requested, counting 0.7 held by ResourceClaims {ns}/{claim_name}"
        )),
        "{msg}"
    );
    eprintln!("second pending: {msg}");
    // The metrics count the claim beside the label pods, per GPU.
    let series = |name: &str, v: u64| {
        format!(
            "{name}{{node=\"{claimed}\",gpu=\"0\",uuid=\"{}\",model=\"A\"}} {v}",
            uuid(&claimed, 0)
        )
    };
    let port = rig.cluster.extender_port();
    let (_, m) = get(port, "/metrics").await?;
    for want in [
        series("kubeshare_gpu_claimed_share", 700),
        series("kubeshare_gpu_memory_claimed_bytes", 4 * GIB),
        series("kubeshare_gpu_claims", 1),
        series("kubeshare_gpu_allocated_share", 300),
        series("kubeshare_gpu_pods", 1),
    ] {
        assert!(m.contains(&want), "no {want} in:\n{m}");
    }

    // The claim's pod goes, and with it the claim (the resourceclaim controller deletes
    // a claim made from a template with its pod): the room it held is free. The
    // extender wakes the pod it refused for that room; kube-scheduler would not retry
    // it on the claim's events alone (the pod has no claims), so without the wake it
    // waits for its backoff or the 5-minute flush.
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    rig.pods().delete("claimer", &dp).await?;
    wait_until("the claimer's claim deleted", WAIT, || {
        let claims = claims.clone();
        let name = claim_name.clone();
        async move {
            match claims.get_opt(&name).await {
                Ok(None) => Ok(Some(())),
                Ok(Some(_)) => Err("still there".to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    })
    .await?;
    let freed = std::time::Instant::now();
    let p = wait_for(&rig.pods(), "second", Duration::from_secs(5), |p: &Pod| {
        p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some()
    })
    .await
    .context("second not bound within 5 s of the claim's deletion")?;
    eprintln!(
        "second bound {:?} after the claim was deleted",
        freed.elapsed()
    );
    assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some(&*claimed));
    let second = rig.bound("second").await?;
    assert_eq!(second.gpu_uuids, vec![uuid(&claimed, 0)]);
    let (_, m) = get(port, "/metrics").await?;
    for want in [
        series("kubeshare_gpu_claimed_share", 0),
        series("kubeshare_gpu_claims", 0),
        series("kubeshare_gpu_allocated_share", 900),
    ] {
        assert!(m.contains(&want), "no {want} in:\n{m}");
    }
    slices
        .delete(
            &format!("{claimed}-{DRIVER_NAME}"),
            &DeleteParams::default(),
        )
        .await?;
    rig.cleanup().await
}
