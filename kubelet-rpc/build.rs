//! Generates the tonic clients and servers of the kubelet's services from the
//! method lists below (tonic-build's manual builder: no .proto files, no protoc).
//! The message types are written by hand in src/ from the kubelet's API contracts.

use tonic_build::manual::{Builder, Method, Service};

const CODEC: &str = "tonic_prost::ProstCodec";

fn method(
    name: &str,
    route: &str,
    input: &str,
    output: &str,
) -> tonic_build::manual::MethodBuilder {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(input)
        .output_type(output)
        .codec_path(CODEC)
}

fn main() {
    let pod_resources = Service::builder()
        .name("PodResourcesLister")
        .package("v1")
        .method(
            method(
                "list",
                "List",
                "crate::podresources::ListPodResourcesRequest",
                "crate::podresources::ListPodResourcesResponse",
            )
            .build(),
        )
        .build();
    let dp = "crate::deviceplugin";
    let registration = Service::builder()
        .name("Registration")
        .package("v1beta1")
        .method(
            method(
                "register",
                "Register",
                &format!("{dp}::RegisterRequest"),
                &format!("{dp}::Empty"),
            )
            .build(),
        )
        .build();
    let device_plugin = Service::builder()
        .name("DevicePlugin")
        .package("v1beta1")
        .method(
            method(
                "get_device_plugin_options",
                "GetDevicePluginOptions",
                &format!("{dp}::Empty"),
                &format!("{dp}::DevicePluginOptions"),
            )
            .build(),
        )
        .method(
            method(
                "list_and_watch",
                "ListAndWatch",
                &format!("{dp}::Empty"),
                &format!("{dp}::ListAndWatchResponse"),
            )
            .server_streaming()
            .build(),
        )
        .method(
            method(
                "get_preferred_allocation",
                "GetPreferredAllocation",
                &format!("{dp}::PreferredAllocationRequest"),
                &format!("{dp}::PreferredAllocationResponse"),
            )
            .build(),
        )
        .method(
            method(
                "allocate",
                "Allocate",
                &format!("{dp}::AllocateRequest"),
                &format!("{dp}::AllocateResponse"),
            )
            .build(),
        )
        .method(
            method(
                "pre_start_container",
                "PreStartContainer",
                &format!("{dp}::PreStartContainerRequest"),
                &format!("{dp}::PreStartContainerResponse"),
            )
            .build(),
        )
        .build();
    // Kubelet plugin registration (plugins_registry/) and the DRA kubelet plugin, v1.
    let dra = "crate::dra";
    let plugin_registration = Service::builder()
        .name("Registration")
        .package("pluginregistration")
        .method(
            method(
                "get_info",
                "GetInfo",
                &format!("{dra}::InfoRequest"),
                &format!("{dra}::PluginInfo"),
            )
            .build(),
        )
        .method(
            method(
                "notify_registration_status",
                "NotifyRegistrationStatus",
                &format!("{dra}::RegistrationStatus"),
                &format!("{dra}::RegistrationStatusResponse"),
            )
            .build(),
        )
        .build();
    let dra_plugin = Service::builder()
        .name("DRAPlugin")
        .package("k8s.io.kubelet.pkg.apis.dra.v1")
        .method(
            method(
                "node_prepare_resources",
                "NodePrepareResources",
                &format!("{dra}::NodePrepareResourcesRequest"),
                &format!("{dra}::NodePrepareResourcesResponse"),
            )
            .build(),
        )
        .method(
            method(
                "node_unprepare_resources",
                "NodeUnprepareResources",
                &format!("{dra}::NodeUnprepareResourcesRequest"),
                &format!("{dra}::NodeUnprepareResourcesResponse"),
            )
            .build(),
        )
        .build();
    Builder::new().compile(&[
        pod_resources,
        registration,
        device_plugin,
        plugin_registration,
        dra_plugin,
    ]);
}
