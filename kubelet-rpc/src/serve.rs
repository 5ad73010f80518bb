//! The server side of the kubelet's local APIs: a gRPC server on a Unix socket that the
//! kubelet dials. [`UnixServer::bind`] makes the socket (replacing a stale one left by a
//! process that died), so that the caller knows it listens before it tells anyone;
//! [`UnixServer::serve`] serves a tonic router on it until a shutdown signal and then
//! removes the socket file, which is how the kubelet's plugin watcher learns a plugin
//! has gone.

use std::future::Future;
use std::io;
use std::os::unix::fs::FileTypeExt as _;
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::server::Router;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot create the directory of {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },
    #[error("{path} exists and is not a socket: not replacing it")]
    NotASocket { path: PathBuf },
    #[error("cannot remove the stale socket {path}: {source}")]
    Stale { path: PathBuf, source: io::Error },
    #[error("cannot listen on {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("serving on {path}: {source}")]
    Serve {
        path: PathBuf,
        source: tonic::transport::Error,
    },
}

/// A listening Unix socket, removed when the server stops or when this is dropped
/// unserved.
#[derive(Debug)]
pub struct UnixServer {
    path: PathBuf,
    listener: Option<UnixListener>,
}

/// Removes `path` if it is a socket (never another kind of file).
fn remove_socket(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path),
        _ => Ok(()),
    }
}

impl UnixServer {
    /// Listens on `path`, creating its directory. A socket already there is taken to be
    /// a dead server's and replaced; any other file there is an error (a wrong path must
    /// not delete someone's file).
    pub fn bind(path: &Path) -> Result<UnixServer, ServeError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| ServeError::Dir {
                path: path.to_path_buf(),
                source,
            })?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                std::fs::remove_file(path).map_err(|source| ServeError::Stale {
                    path: path.to_path_buf(),
                    source,
                })?;
            }
            Ok(_) => {
                return Err(ServeError::NotASocket {
                    path: path.to_path_buf(),
                });
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(path).map_err(|source| ServeError::Bind {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(UnixServer {
            path: path.to_path_buf(),
            listener: Some(listener),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves `router` until `shutdown` resolves (then lets calls in flight finish), and
    /// removes the socket file.
    pub async fn serve(
        mut self,
        router: Router,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let Some(listener) = self.listener.take() else {
            return Ok(());
        };
        let result = router
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
            .await;
        // Gone before the function returns, so a caller may tell the kubelet right away.
        let _ = remove_socket(&self.path);
        result.map_err(|source| ServeError::Serve {
            path: self.path.clone(),
            source,
        })
    }

    /// Runs `serve` on the listener (a server other than tonic's) and removes the
    /// socket file when it returns.
    pub(crate) async fn serve_with<F, Fut>(mut self, serve: F)
    where
        F: FnOnce(UnixListener) -> Fut,
        Fut: Future<Output = ()>,
    {
        if let Some(listener) = self.listener.take() {
            serve(listener).await;
            let _ = remove_socket(&self.path);
        }
    }
}

impl Drop for UnixServer {
    fn drop(&mut self) {
        if self.listener.is_some() {
            let _ = remove_socket(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::{InfoRequest, Registration, RegistrationClient, RegistrationServer, get_info};

    fn router(reg: Registration) -> Router {
        tonic::transport::Server::builder().add_service(RegistrationServer::new(reg))
    }

    #[tokio::test]
    async fn serves_replaces_a_stale_socket_and_removes_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/dir/x.sock");
        // A socket left by a server that died: bound, then its listener dropped
        // without removing the file.
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());

        let server = UnixServer::bind(&path).expect("a stale socket is replaced");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let reg = Registration::new("d.example.com", "/x/dra.sock");
        let task = tokio::spawn(server.serve(router(reg), async {
            let _ = stopped.await;
        }));
        let info = get_info(&path).await.expect("GetInfo");
        assert_eq!(info.name, "d.example.com");

        // A client still connected does not keep the server from stopping.
        let mut held = RegistrationClient::new(crate::connect(&path).await.expect("connect"));
        held.get_info(InfoRequest {}).await.expect("GetInfo");
        stop.send(()).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(10), task)
            .await
            .expect("stops within 10 s")
            .expect("join")
            .expect("serve");
        assert!(
            !path.exists(),
            "the socket is removed when the server stops"
        );
        assert!(get_info(&path).await.is_err());
    }

    #[tokio::test]
    async fn refuses_to_replace_a_file_and_cleans_up_unserved() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, "keep me").unwrap();
        let err = UnixServer::bind(&file).expect_err("a regular file is in the way");
        assert!(matches!(err, ServeError::NotASocket { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");

        let path = dir.path().join("y.sock");
        let server = UnixServer::bind(&path).expect("bind");
        assert_eq!(server.path(), path);
        assert!(path.exists());
        drop(server);
        assert!(!path.exists(), "dropped unserved: removed");
    }
}
