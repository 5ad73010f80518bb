//! DRA objects the real-node tests and the GPU node's scenarios both make.

use k8s_openapi::api::resource::v1::{
    DeviceRequestAllocationResult, ResourceClaim, ResourceClaimTemplate,
};
use kubeshare_api::dra::DRIVER_NAME;
use serde_json::json;

/// A ResourceClaimTemplate `name` booking `compute` thousandths and `memory` of the GPU whose
/// UUID is `gpu`, with no config: a fixed share, limit = request (docs/dra.md).
pub fn share_claim_template(
    name: &str,
    gpu: &str,
    compute: &str,
    memory: &str,
) -> serde_json::Result<ResourceClaimTemplate> {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER_NAME,
                "selectors": [{"cel": {"expression":
                    format!("device.attributes[\"{DRIVER_NAME}\"].uuid == \"{gpu}\"")}}],
                "capacity": {"requests": {"compute": compute, "memory": memory}},
            }}],
        }}},
    }))
}

/// The devices a claim was allocated (none while it is not allocated).
pub fn allocated_devices(claim: ResourceClaim) -> Vec<DeviceRequestAllocationResult> {
    claim
        .status
        .and_then(|s| s.allocation)
        .and_then(|a| a.devices)
        .and_then(|d| d.results)
        .unwrap_or_default()
}
