//! A DRA kubelet plugin's two gRPC services (`k8s.io/kubelet` `pkg/apis`):
//! - `pluginregistration.Registration` on `<driver>-reg.sock` in the kubelet's
//!   `plugins_registry/`: the kubelet's plugin watcher finds the socket, asks
//!   [`Registration`]'s `GetInfo` where the plugin serves and which services it speaks,
//!   reports the outcome with `NotifyRegistrationStatus`, keeps asking `GetInfo` every
//!   10 s while the socket is there, and drops the plugin when the socket goes;
//! - `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` on `dra.sock` in
//!   `plugins/<driver>/`: `NodePrepareResources` before a pod's containers start
//!   (answering with the CDI device IDs of each claim's devices) and
//!   `NodeUnprepareResources` after they stop.
//!
//! Implement [`DraPlugin`] and serve it with [`PluginServer`], which binds both sockets
//! under the kubelet's root directory ([`PluginSockets`]) and, at shutdown, removes the
//! registration socket before it stops the service, so the kubelet never holds a
//! registration whose service is gone. The registration socket is served by a small
//! HTTP/2 server of this crate, not by tonic, which refuses the kubelet's requests
//! there (`registration_h2` says why); [`RegistrationServer`] serves other clients.
//!
//! The messages follow the upstream `.proto` files (field numbers are the contract).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::serve::{ServeError, UnixServer};
use crate::uds::{Error, connect};

mod registration {
    include!(concat!(
        env!("OUT_DIR"),
        "/pluginregistration.Registration.rs"
    ));
}
mod plugin {
    include!(concat!(
        env!("OUT_DIR"),
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.rs"
    ));
}
pub use plugin::d_r_a_plugin_client::DRAPluginClient as DraPluginClient;
pub use plugin::d_r_a_plugin_server::{DRAPlugin as DraPlugin, DRAPluginServer as DraPluginServer};
pub use registration::registration_client::RegistrationClient;
pub use registration::registration_server::{Registration as RegistrationApi, RegistrationServer};

/// The kubelet's default `--root-dir`.
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// Where the kubelet's plugin watcher looks for registration sockets.
pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// Where plugins keep their service sockets, one directory per driver.
pub const PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// [`REGISTRY_DIR`] and [`PLUGINS_DIR`] relative to the kubelet's root directory.
pub const REGISTRY_SUBDIR: &str = "plugins_registry";
pub const PLUGINS_SUBDIR: &str = "plugins";
/// The plugin type the kubelet routes to its DRA manager.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The service (and version) named in `supported_versions`: dra/v1, the first of the
/// services a 1.34+ kubelet knows (`v1.DRAPlugin`, then `v1beta1.DRAPlugin`). A plugin
/// lists services, not API versions; the kubelet picks the first it knows.
pub const SERVICE_V1: &str = "v1.DRAPlugin";
/// The service socket's file name.
pub const DRA_SOCKET: &str = "dra.sock";

/// The registration socket of `driver` in `registry_dir`: `<driver>-reg.sock`.
pub fn registration_socket(registry_dir: &Path, driver: &str) -> PathBuf {
    registry_dir.join(format!("{driver}-reg.sock"))
}

/// The service socket of `driver` under `plugins_dir`: `<driver>/dra.sock`.
pub fn dra_socket(plugins_dir: &Path, driver: &str) -> PathBuf {
    plugins_dir.join(driver).join(DRA_SOCKET)
}

/// A driver's two sockets under the kubelet's root directory (`--root-dir`). The
/// paths are the host's: the kubelet dials the service at the path `GetInfo` names,
/// so a plugin in a container mounts these directories at the same paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSockets {
    /// `<root>/plugins_registry/<driver>-reg.sock`.
    pub registration: PathBuf,
    /// `<root>/plugins/<driver>/dra.sock`.
    pub service: PathBuf,
}

impl PluginSockets {
    pub fn under(kubelet_root: &Path, driver: &str) -> PluginSockets {
        PluginSockets {
            registration: registration_socket(&kubelet_root.join(REGISTRY_SUBDIR), driver),
            service: dra_socket(&kubelet_root.join(PLUGINS_SUBDIR), driver),
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InfoRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginInfo {
    /// [`PLUGIN_TYPE`].
    #[prost(string, tag = "1")]
    pub r#type: String,
    /// The driver name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// The absolute path of the service socket.
    #[prost(string, tag = "3")]
    pub endpoint: String,
    #[prost(string, repeated, tag = "4")]
    pub supported_versions: Vec<String>,
}

#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct RegistrationStatus {
    #[prost(bool, tag = "1")]
    pub plugin_registered: bool,
    #[prost(string, tag = "2")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegistrationStatusResponse {}

#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Claim {
    #[prost(string, tag = "1")]
    pub namespace: String,
    #[prost(string, tag = "2")]
    pub uid: String,
    #[prost(string, tag = "3")]
    pub name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesRequest {
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesResponse {
    /// One entry per claim of the request, keyed by claim uid; a missing one is retried.
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodePrepareResourceResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourceResponse {
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<Device>,
    /// Non-empty: preparing the claim failed (the devices are ignored).
    #[prost(string, tag = "2")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Device {
    /// The claim's requests this device serves; empty: all of them.
    #[prost(string, repeated, tag = "1")]
    pub request_names: Vec<String>,
    #[prost(string, tag = "2")]
    pub pool_name: String,
    #[prost(string, tag = "3")]
    pub device_name: String,
    #[prost(string, repeated, tag = "4")]
    pub cdi_device_ids: Vec<String>,
    /// The allocation's `shareID`, for a device shared through consumable capacity.
    #[prost(string, optional, tag = "5")]
    pub share_id: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesRequest {
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesResponse {
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodeUnprepareResourceResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourceResponse {
    #[prost(string, tag = "1")]
    pub error: String,
}

/// The registration service of one driver: tells the kubelet where its DRA service
/// listens, and remembers what the kubelet answered. [`PluginServer`] serves it to the
/// kubelet; as [`RegistrationApi`] it is also a tonic service.
#[derive(Debug, Clone)]
pub struct Registration {
    driver: String,
    endpoint: PathBuf,
    status: Arc<Mutex<Option<RegistrationStatus>>>,
}

impl Registration {
    /// `endpoint`: the absolute path of the driver's service socket ([`dra_socket`]).
    pub fn new(driver: impl Into<String>, endpoint: impl Into<PathBuf>) -> Registration {
        Registration {
            driver: driver.into(),
            endpoint: endpoint.into(),
            status: Arc::default(),
        }
    }

    /// What the kubelet last reported (`None`: not yet).
    pub fn status(&self) -> Option<RegistrationStatus> {
        self.status.lock().ok().and_then(|s| s.clone())
    }

    /// Records the kubelet's verdict; a failed registration is an error carrying the
    /// kubelet's message (as upstream's helper answers: the kubelet then retries).
    pub(crate) fn notify(&self, status: RegistrationStatus) -> Result<(), String> {
        if let Ok(mut s) = self.status.lock() {
            *s = Some(status.clone());
        }
        if status.plugin_registered {
            Ok(())
        } else {
            Err(format!("registration failed: {}", status.error))
        }
    }

    /// The answer to `GetInfo`.
    pub fn info(&self) -> PluginInfo {
        PluginInfo {
            r#type: PLUGIN_TYPE.into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![SERVICE_V1.into()],
        }
    }
}

#[tonic::async_trait]
impl RegistrationApi for Registration {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        req: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        self.notify(req.into_inner())
            .map(|()| tonic::Response::new(RegistrationStatusResponse {}))
            .map_err(tonic::Status::internal)
    }
}

/// A DRA kubelet plugin with both sockets bound, ready to serve.
#[derive(Debug)]
pub struct PluginServer {
    service: UnixServer,
    registry: UnixServer,
    registration: Registration,
}

impl PluginServer {
    /// Binds the service socket, then the registration socket: once the kubelet can
    /// see the plugin, the service it names already listens.
    pub fn bind(driver: &str, sockets: &PluginSockets) -> Result<PluginServer, ServeError> {
        let service = UnixServer::bind(&sockets.service)?;
        let registry = UnixServer::bind(&sockets.registration)?;
        Ok(PluginServer {
            service,
            registry,
            registration: Registration::new(driver, &sockets.service),
        })
    }

    /// The registration service, to read what the kubelet reported.
    pub fn registration(&self) -> Registration {
        self.registration.clone()
    }

    /// Serves `plugin` until `shutdown` resolves; then removes the registration socket
    /// (the kubelet deregisters the plugin) before it stops the service and removes its
    /// socket. The service failing stops the registration. The registration socket is
    /// not served by tonic: the kubelet's plugin watcher sends an `:authority` that
    /// tonic's HTTP/2 refuses (see `registration_h2`).
    pub async fn serve<P: DraPlugin>(
        self,
        plugin: P,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        use tokio::sync::oneshot;
        let (reg_stop, reg_stopped) = oneshot::channel::<()>();
        let (svc_stop, svc_stopped) = oneshot::channel::<()>();
        let registration = self.registration.clone();
        let reg = self.registry.serve_with(|listener| {
            crate::registration_h2::serve(listener, registration, async {
                let _ = reg_stopped.await;
            })
        });
        let svc = self.service.serve(
            tonic::transport::Server::builder().add_service(DraPluginServer::new(plugin)),
            async {
                let _ = svc_stopped.await;
            },
        );
        let mut reg = std::pin::pin!(reg);
        let mut svc = std::pin::pin!(svc);
        tokio::select! {
            _ = shutdown => {}
            // Ends only at its shutdown: never first.
            () = &mut reg => {
                let _ = svc_stop.send(());
                return svc.await;
            }
            s = &mut svc => {
                let _ = reg_stop.send(());
                reg.await;
                return s;
            }
        }
        let _ = reg_stop.send(());
        reg.await;
        let _ = svc_stop.send(());
        svc.await
    }
}

/// Asks the registration service at `socket` for its [`PluginInfo`], as the kubelet's
/// plugin watcher does.
pub async fn get_info(socket: &Path) -> Result<PluginInfo, Error> {
    let channel = connect(socket).await?;
    RegistrationClient::new(channel)
        .get_info(InfoRequest {})
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| Error::Call {
            call: "Registration/GetInfo",
            path: socket.to_path_buf(),
            status: Box::new(status),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;
    use tokio_stream::wrappers::UnixListenerStream;

    /// A plugin that prepares every claim as one device of pool `node`, shared, and
    /// refuses a claim named `bad`: enough to see every field cross the socket.
    struct Echo;

    #[tonic::async_trait]
    impl DraPlugin for Echo {
        async fn node_prepare_resources(
            &self,
            req: tonic::Request<NodePrepareResourcesRequest>,
        ) -> Result<tonic::Response<NodePrepareResourcesResponse>, tonic::Status> {
            let claims = req
                .into_inner()
                .claims
                .into_iter()
                .map(|c| {
                    let r = if c.name == "bad" {
                        NodePrepareResourceResponse {
                            devices: vec![],
                            error: format!("{}/{}: refused", c.namespace, c.name),
                        }
                    } else {
                        NodePrepareResourceResponse {
                            devices: vec![Device {
                                request_names: vec!["gpu".into()],
                                pool_name: "node".into(),
                                device_name: "gpu-0".into(),
                                cdi_device_ids: vec![format!("gpu.kubeshare.io/share={}", c.uid)],
                                share_id: Some(format!("share-{}", c.uid)),
                            }],
                            error: String::new(),
                        }
                    };
                    (c.uid, r)
                })
                .collect();
            Ok(tonic::Response::new(NodePrepareResourcesResponse {
                claims,
            }))
        }

        async fn node_unprepare_resources(
            &self,
            req: tonic::Request<NodeUnprepareResourcesRequest>,
        ) -> Result<tonic::Response<NodeUnprepareResourcesResponse>, tonic::Status> {
            let claims = req
                .into_inner()
                .claims
                .into_iter()
                .map(|c| (c.uid, NodeUnprepareResourceResponse::default()))
                .collect();
            Ok(tonic::Response::new(NodeUnprepareResourcesResponse {
                claims,
            }))
        }
    }

    /// Serves `svc` on a new Unix socket at `socket`, until the task is aborted.
    macro_rules! serve {
        ($socket:expr, $svc:expr) => {{
            let listener = UnixListener::bind($socket).expect("bind");
            let svc = $svc;
            tokio::spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(UnixListenerStream::new(listener))
                    .await;
            })
        }};
    }

    #[tokio::test]
    async fn registration_over_a_unix_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg_socket = registration_socket(dir.path(), "gpu.kubeshare.io");
        let endpoint = dra_socket(Path::new(PLUGINS_DIR), "gpu.kubeshare.io");
        assert_eq!(
            endpoint,
            Path::new("/var/lib/kubelet/plugins/gpu.kubeshare.io/dra.sock")
        );
        let reg = Registration::new("gpu.kubeshare.io", &endpoint);
        let server = serve!(&reg_socket, RegistrationServer::new(reg.clone()));

        let info = get_info(&reg_socket).await.expect("GetInfo");
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.kubeshare.io");
        assert_eq!(info.endpoint, endpoint.display().to_string());
        assert_eq!(info.supported_versions, vec!["v1.DRAPlugin"]);

        assert_eq!(reg.status(), None);
        let mut client = RegistrationClient::new(connect(&reg_socket).await.expect("connect"));
        client
            .notify_registration_status(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .expect("a successful registration is acknowledged");
        assert_eq!(reg.status().map(|s| s.plugin_registered), Some(true));
        let refused = client
            .notify_registration_status(RegistrationStatus {
                plugin_registered: false,
                error: "unsupported versions".into(),
            })
            .await
            .expect_err("a failed registration is an error, so the kubelet retries");
        assert!(
            refused.message().contains("unsupported versions"),
            "{refused}"
        );
        assert_eq!(
            reg.status(),
            Some(RegistrationStatus {
                plugin_registered: false,
                error: "unsupported versions".into()
            })
        );
        server.abort();
    }

    #[tokio::test]
    async fn prepare_and_unprepare_over_a_unix_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join(DRA_SOCKET);
        let server = serve!(&socket, DraPluginServer::new(Echo));
        let mut client = DraPluginClient::new(connect(&socket).await.expect("connect"));
        let claim = |name: &str, uid: &str| Claim {
            namespace: "ns".into(),
            uid: uid.into(),
            name: name.into(),
        };
        let resp = client
            .node_prepare_resources(NodePrepareResourcesRequest {
                claims: vec![claim("a", "u1"), claim("bad", "u2")],
            })
            .await
            .expect("NodePrepareResources")
            .into_inner();
        assert_eq!(resp.claims.len(), 2);
        let a = &resp.claims["u1"];
        assert_eq!(a.error, "");
        assert_eq!(a.devices.len(), 1);
        assert_eq!(a.devices[0].pool_name, "node");
        assert_eq!(a.devices[0].device_name, "gpu-0");
        assert_eq!(a.devices[0].request_names, vec!["gpu"]);
        assert_eq!(
            a.devices[0].cdi_device_ids,
            vec!["gpu.kubeshare.io/share=u1"]
        );
        assert_eq!(a.devices[0].share_id.as_deref(), Some("share-u1"));
        assert_eq!(resp.claims["u2"].error, "ns/bad: refused");

        let resp = client
            .node_unprepare_resources(NodeUnprepareResourcesRequest {
                claims: vec![claim("a", "u1")],
            })
            .await
            .expect("NodeUnprepareResources")
            .into_inner();
        assert_eq!(resp.claims.keys().collect::<Vec<_>>(), vec!["u1"]);
        server.abort();
    }

    /// The plugin as the kubelet meets it: the registration socket under
    /// `plugins_registry/` names the service socket under `plugins/<driver>/`, which
    /// answers; at shutdown both sockets go.
    #[tokio::test]
    async fn plugin_server_binds_both_sockets_and_removes_them() {
        let root = tempfile::tempdir().expect("tempdir");
        let sockets = PluginSockets::under(root.path(), "gpu.kubeshare.io");
        assert_eq!(
            sockets.registration,
            root.path()
                .join("plugins_registry/gpu.kubeshare.io-reg.sock")
        );
        assert_eq!(
            sockets.service,
            root.path().join("plugins/gpu.kubeshare.io/dra.sock")
        );
        let server = PluginServer::bind("gpu.kubeshare.io", &sockets).expect("bind");
        let reg = server.registration();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(Echo, async {
            let _ = stopped.await;
        }));

        let info = get_info(&sockets.registration).await.expect("GetInfo");
        assert_eq!(info.endpoint, sockets.service.display().to_string());
        assert_eq!(info.supported_versions, vec![SERVICE_V1]);
        let mut kubelet =
            RegistrationClient::new(connect(&sockets.registration).await.expect("connect"));
        kubelet
            .notify_registration_status(RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .expect("NotifyRegistrationStatus");
        assert_eq!(reg.status().map(|s| s.plugin_registered), Some(true));

        let mut client =
            DraPluginClient::new(connect(Path::new(&info.endpoint)).await.expect("connect"));
        let resp = client
            .node_prepare_resources(NodePrepareResourcesRequest {
                claims: vec![Claim {
                    namespace: "ns".into(),
                    uid: "u1".into(),
                    name: "c".into(),
                }],
            })
            .await
            .expect("NodePrepareResources")
            .into_inner();
        assert_eq!(resp.claims["u1"].devices[0].device_name, "gpu-0");

        stop.send(()).expect("still serving");
        tokio::time::timeout(std::time::Duration::from_secs(10), task)
            .await
            .expect("stops within 10 s")
            .expect("join")
            .expect("serve");
        assert!(!sockets.registration.exists());
        assert!(!sockets.service.exists());
    }

    /// The optional `share_id` (field 5) is absent on the wire when unset, so an older
    /// kubelet reads the message as before, and present (even empty) when set.
    #[test]
    fn share_id_is_optional_on_the_wire() {
        use prost::Message;
        let mut d = Device {
            pool_name: "p".into(),
            device_name: "d".into(),
            ..Default::default()
        };
        let without = d.encode_to_vec();
        d.share_id = Some(String::new());
        let with = d.encode_to_vec();
        assert_eq!(with.len(), without.len() + 2, "tag 5, length 0");
        assert_eq!(
            Device::decode(with.as_slice()).expect("decode").share_id,
            Some(String::new())
        );
        assert_eq!(
            Device::decode(without.as_slice()).expect("decode").share_id,
            None
        );
    }
}
