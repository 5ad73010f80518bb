//! A gRPC channel to a Unix socket, the only transport the kubelet's local APIs use.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("{call} on {path}: {status}")]
    Call {
        call: &'static str,
        path: PathBuf,
        status: Box<tonic::Status>,
    },
}

/// A channel to the gRPC server at `path`. The URI is a placeholder that tonic needs;
/// every connection goes to the socket.
pub async fn connect(path: &Path) -> Result<Channel, Error> {
    let socket = path.to_path_buf();
    let endpoint = Endpoint::from_static("http://kubelet.local")
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(10));
    endpoint
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|source| Error::Connect {
            path: path.to_path_buf(),
            source,
        })
}
