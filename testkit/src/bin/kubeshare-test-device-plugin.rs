//! A device plugin for the real-node tests: registers a resource (`nvidia.com/gpu`)
//! with the kubelet for the simulated GPUs it is given, as NVIDIA's device plugin does
//! for real ones (device IDs are GPU UUIDs), and hands each container its GPUs in
//! `NVIDIA_VISIBLE_DEVICES` (and `FAKE_CUDA_DEVICES`, which the fake libcuda reads).
//! With `--cdi-kind`, each device also goes to the runtime as the CDI device
//! `<kind>=<id>` (the route NVIDIA's device plugin takes in CDI mode).
//! It runs inside the node's namespaces (`hack/node.sh exec RUN_DIR kubeshare-test-device-plugin ...`).

use std::path::PathBuf;
use std::pin::Pin;

use anyhow::Context as _;
use clap::Parser;
use kubeshare_kubelet_rpc::deviceplugin::{
    self as dp, AllocateRequest, AllocateResponse, CdiDevice, ContainerAllocateResponse,
    ContainerPreferredAllocationResponse, Device, DevicePlugin, DevicePluginOptions,
    DevicePluginServer, Empty, ListAndWatchResponse, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

#[derive(Parser, Debug)]
#[command(
    about = "Test device plugin: registers simulated GPUs with the kubelet as a device-plugin resource"
)]
struct Args {
    /// The kubelet's device-plugin directory (its kubelet.sock is there).
    #[arg(long, default_value = kubeshare_api::layout::KUBELET_DEVICE_PLUGIN_DIR)]
    dir: PathBuf,
    /// The resource to register.
    #[arg(long, default_value = "nvidia.com/gpu")]
    resource: String,
    /// Device IDs (GPU UUIDs), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    devices: Vec<String>,
    /// This plugin's socket name in --dir.
    #[arg(long, default_value = "kubeshare-test-gpu.sock")]
    endpoint: String,
    /// Also hand each device to the runtime as the CDI device `<kind>=<id>`.
    #[arg(long, value_name = "VENDOR/CLASS")]
    cdi_kind: Option<String>,
}

struct Plugin {
    devices: Vec<String>,
    cdi_kind: Option<String>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: false,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    /// One list of healthy devices, then the stream stays open (the kubelet reads an
    /// end of stream as the plugin going away).
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let list = ListAndWatchResponse {
            devices: self
                .devices
                .iter()
                .map(|id| Device {
                    id: id.clone(),
                    health: dp::HEALTHY.into(),
                })
                .collect(),
        };
        let stream =
            tokio_stream::StreamExt::chain(tokio_stream::once(Ok(list)), tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let container_responses = req
            .into_inner()
            .container_requests
            .into_iter()
            .map(|c| {
                let n = usize::try_from(c.allocation_size).unwrap_or(0);
                let mut ids = c.must_include_device_ids.clone();
                ids.extend(
                    c.available_device_ids
                        .into_iter()
                        .filter(|d| !c.must_include_device_ids.contains(d)),
                );
                ids.truncate(n);
                ContainerPreferredAllocationResponse { device_ids: ids }
            })
            .collect();
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let mut container_responses = Vec::new();
        for c in req.into_inner().container_requests {
            if let Some(bad) = c.devices_ids.iter().find(|d| !self.devices.contains(d)) {
                return Err(Status::invalid_argument(format!("unknown device {bad}")));
            }
            let cdi_devices = match &self.cdi_kind {
                Some(kind) => c
                    .devices_ids
                    .iter()
                    .map(|id| CdiDevice {
                        name: format!("{kind}={id}"),
                    })
                    .collect(),
                None => Vec::new(),
            };
            let ids = c.devices_ids.join(",");
            tracing::info!(devices = %ids, "allocate");
            let envs = [
                ("NVIDIA_VISIBLE_DEVICES".to_string(), ids.clone()),
                ("FAKE_CUDA_DEVICES".to_string(), ids),
            ]
            .into_iter()
            .collect();
            container_responses.push(ContainerAllocateResponse { envs, cdi_devices });
        }
        Ok(Response::new(AllocateResponse {
            container_responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // Colour only on a terminal: logs piped to a file or a container log stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let socket = args.dir.join(&args.endpoint);
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove {}", socket.display())),
    }
    let listener = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    let server = tonic::transport::Server::builder()
        .add_service(DevicePluginServer::new(Plugin {
            devices: args.devices.clone(),
            cdi_kind: args.cdi_kind.clone(),
        }))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        );
    let server = tokio::spawn(server);
    dp::register(&args.dir, &args.endpoint, &args.resource)
        .await
        .context("registering with the kubelet")?;
    tracing::info!(resource = %args.resource, devices = ?args.devices, socket = %socket.display(), "registered");
    server.await?.context("device plugin server")?;
    Ok(())
}
