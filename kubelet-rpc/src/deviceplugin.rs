//! The kubelet's device-plugin API, v1beta1: a plugin serves [`DevicePlugin`] on a
//! socket in the kubelet's device-plugin directory and registers it through
//! `kubelet.sock` there ([`register`]).

use std::collections::HashMap;
use std::path::Path;

use crate::uds::{Error, connect};

mod registration {
    include!(concat!(env!("OUT_DIR"), "/v1beta1.Registration.rs"));
}
mod plugin {
    include!(concat!(env!("OUT_DIR"), "/v1beta1.DevicePlugin.rs"));
}
pub use plugin::device_plugin_server::{DevicePlugin, DevicePluginServer};
pub use registration::registration_client::RegistrationClient;

/// The API version a plugin registers with.
pub const VERSION: &str = "v1beta1";
/// The kubelet's registration socket, in its device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// `Device.health` of a usable device.
pub const HEALTHY: &str = "Healthy";

#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DevicePluginOptions {
    #[prost(bool, tag = "1")]
    pub pre_start_required: bool,
    #[prost(bool, tag = "2")]
    pub get_preferred_allocation_available: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterRequest {
    #[prost(string, tag = "1")]
    pub version: String,
    /// The plugin's socket name, relative to the device-plugin directory.
    #[prost(string, tag = "2")]
    pub endpoint: String,
    #[prost(string, tag = "3")]
    pub resource_name: String,
    #[prost(message, optional, tag = "4")]
    pub options: Option<DevicePluginOptions>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListAndWatchResponse {
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<Device>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Device {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub health: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PreStartContainerRequest {
    #[prost(string, repeated, tag = "1")]
    pub devices_ids: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PreStartContainerResponse {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PreferredAllocationRequest {
    #[prost(message, repeated, tag = "1")]
    pub container_requests: Vec<ContainerPreferredAllocationRequest>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerPreferredAllocationRequest {
    #[prost(string, repeated, tag = "1")]
    pub available_device_ids: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    pub must_include_device_ids: Vec<String>,
    #[prost(int32, tag = "3")]
    pub allocation_size: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PreferredAllocationResponse {
    #[prost(message, repeated, tag = "1")]
    pub container_responses: Vec<ContainerPreferredAllocationResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerPreferredAllocationResponse {
    #[prost(string, repeated, tag = "1")]
    pub device_ids: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocateRequest {
    #[prost(message, repeated, tag = "1")]
    pub container_requests: Vec<ContainerAllocateRequest>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAllocateRequest {
    #[prost(string, repeated, tag = "1")]
    pub devices_ids: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AllocateResponse {
    #[prost(message, repeated, tag = "1")]
    pub container_responses: Vec<ContainerAllocateResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAllocateResponse {
    /// Environment variables the kubelet sets in the container.
    #[prost(map = "string, string", tag = "1")]
    pub envs: HashMap<String, String>,
    /// Fully qualified CDI device names (`vendor/class=name`) the runtime injects
    /// (the kubelet passes them in the CRI `CDIDevices` field; GA in Kubernetes 1.31).
    #[prost(message, repeated, tag = "5")]
    pub cdi_devices: Vec<CdiDevice>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CdiDevice {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// Registers the plugin serving on `endpoint` (a socket name in `dir`) for `resource`.
pub async fn register(dir: &Path, endpoint: &str, resource: &str) -> Result<(), Error> {
    let socket = dir.join(KUBELET_SOCKET);
    let channel = connect(&socket).await?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.to_string(),
            endpoint: endpoint.to_string(),
            resource_name: resource.to_string(),
            options: Some(DevicePluginOptions::default()),
        })
        .await
        .map_err(|status| Error::Call {
            call: "Registration/Register",
            path: socket,
            status: Box::new(status),
        })?;
    Ok(())
}
