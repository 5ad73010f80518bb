//! The kubelet's PodResources API, v1 (`<kubelet root>/pod-resources/kubelet.sock`):
//! the devices each running pod's containers hold.

use std::path::Path;

use crate::uds::{Error, connect};

mod generated {
    include!(concat!(env!("OUT_DIR"), "/v1.PodResourcesLister.rs"));
}
pub use generated::pod_resources_lister_client::PodResourcesListerClient;
pub use generated::pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer};

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<ContainerDevices>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerDevices {
    #[prost(string, tag = "1")]
    pub resource_name: String,
    #[prost(string, repeated, tag = "2")]
    pub device_ids: Vec<String>,
}

/// One device a pod holds: (namespace, pod, resource name, device ID).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeldDevice {
    pub namespace: String,
    pub pod: String,
    pub resource: String,
    pub device_id: String,
}

impl ListPodResourcesResponse {
    /// Every device of every container, flattened.
    pub fn held_devices(&self) -> Vec<HeldDevice> {
        let mut out = Vec::new();
        for p in &self.pod_resources {
            for c in &p.containers {
                for d in &c.devices {
                    for id in &d.device_ids {
                        out.push(HeldDevice {
                            namespace: p.namespace.clone(),
                            pod: p.name.clone(),
                            resource: d.resource_name.clone(),
                            device_id: id.clone(),
                        });
                    }
                }
            }
        }
        out
    }
}

/// Asks the kubelet at `socket` which devices its pods hold.
pub async fn list(socket: &Path) -> Result<Vec<HeldDevice>, Error> {
    let channel = connect(socket).await?;
    let resp = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await
        .map_err(|status| Error::Call {
            call: "PodResourcesLister/List",
            path: socket.to_path_buf(),
            status: Box::new(status),
        })?;
    Ok(resp.into_inner().held_devices())
}
