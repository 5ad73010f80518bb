//! A small blocking client over a Unix stream socket, for the hook (and tests).
//!
//! One [`Client`] is one connection. Replies arrive in the order of requests on a
//! connection and a TokenRequest may wait a long time for its Grant, so a process
//! that wants to ask for memory while another thread waits for the token opens a
//! second connection. Writes use `MSG_NOSIGNAL`: the hook lives inside programs
//! that do not ignore SIGPIPE, and a dead gem-schd must not kill them.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::frame::{FrameError, Reply, Request};
use crate::gate::{GatePage, recv_with_fd};

/// Environment variable naming the directory that holds this client's sockets.
pub const SOCKET_DIR_ENV: &str = "KUBESHARE_SOCKET_DIR";
/// Where the sockets are inside a pod when [`SOCKET_DIR_ENV`] is unset.
pub const DEFAULT_SOCKET_DIR: &str = kubeshare_api::layout::POD_SOCKET_DIR;

/// The socket of GPU `gpu_uuid` inside a client's socket directory.
pub fn socket_path(dir: &Path, gpu_uuid: &str) -> PathBuf {
    dir.join(kubeshare_api::layout::gpu_socket_name(gpu_uuid))
}

/// The client's limits, as told by HelloOk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloInfo {
    pub request_milli: u16,
    pub limit_milli: u16,
    pub mem_limit: u64,
    pub mem_used: u64,
    pub window_ms: u32,
}

/// Answer to a MemAlloc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemVerdict {
    pub granted: bool,
    /// Client-wide bytes in use after the decision.
    pub used: u64,
    pub limit: u64,
}

/// How [`FrameError::UnknownKind`] reads, up to the kind.
const UNKNOWN_KIND_PREFIX: &str = "unknown frame kind ";
/// How [`FrameError::TrailingBytes`] reads, up to the kind, and after it.
const TRAILING_PREFIX: &str = "frame kind ";
const TRAILING_INFIX: &str = " has ";

/// What can go wrong talking to gem-schd.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("socket I/O: {0}")]
    Io(#[from] io::Error),
    #[error("bad frame from gem-schd: {0}")]
    Frame(#[from] FrameError),
    #[error("gem-schd refused (code {code}): {message}")]
    Server { code: u16, message: String },
    #[error("unexpected reply from gem-schd: {0:?}")]
    Unexpected(Reply),
    #[error("gem-schd closed the connection")]
    Closed,
}

impl ClientError {
    /// True when a read timed out (see [`Client::set_read_timeout`]): gem-schd did not answer
    /// in time. The connection stays usable: a partial frame read so far is kept.
    pub fn is_timeout(&self) -> bool {
        matches!(self, ClientError::Io(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
    }

    /// The frame kind gem-schd could not read, when it refused one as unknown (Error{2}
    /// "unknown frame kind N", [`FrameError::UnknownKind`]) or as longer than it knows it
    /// ("frame kind N has M trailing bytes": a Busy with `earlier_us` sent to a gem-schd that
    /// reads two fields): a gem-schd older than the frame.
    pub fn refused_kind(&self) -> Option<u8> {
        match self {
            ClientError::Server { code, message } if *code == crate::code::BAD_FRAME => {
                if let Some(k) = message.strip_prefix(UNKNOWN_KIND_PREFIX) {
                    return k.trim().parse().ok();
                }
                let rest = message.strip_prefix(TRAILING_PREFIX)?;
                let (k, tail) = rest.split_once(TRAILING_INFIX)?;
                tail.ends_with("trailing bytes")
                    .then(|| k.trim().parse().ok())
                    .flatten()
            }
            _ => None,
        }
    }

    /// True when reconnecting may help (gem-schd went away or is restarting).
    pub fn is_disconnect(&self) -> bool {
        match self {
            ClientError::Io(_) | ClientError::Closed => true,
            ClientError::Server { code, .. } => *code == crate::code::SHUTTING_DOWN,
            _ => false,
        }
    }
}

/// What a wait for the token ended with ([`Client::wait_grant_or_soon`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Granted for this many µs.
    Grant(u64),
    /// The token comes to this connection next; its Grant follows.
    Soon,
}

/// One connection to gem-schd, past its Hello.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    buf: Vec<u8>,
    out: Vec<u8>,
    hello: HelloInfo,
    gate: Option<GatePage>,
    /// It sent [`Request::Parks`].
    parks: bool,
}

impl Drop for Client {
    /// A client's gate page is opened and left mapped: the driver may still have work queued
    /// behind it ([`GatePage::release`]).
    fn drop(&mut self) {
        if let Some(p) = self.gate.take() {
            p.release();
        }
    }
}

impl Client {
    /// Connect to `path` and say Hello.
    pub fn connect(path: impl AsRef<Path>, pid: u32, gpu_uuid: &str) -> Result<Self, ClientError> {
        Self::connect_timeout(path, pid, gpu_uuid, None)
    }

    /// [`Client::connect`] with a read timeout set before the Hello (a gem-schd that accepts
    /// but never answers cannot block the caller longer than `read_timeout`); the timeout
    /// stays set on the connection.
    pub fn connect_timeout(
        path: impl AsRef<Path>,
        pid: u32,
        gpu_uuid: &str,
        read_timeout: Option<Duration>,
    ) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(read_timeout)?;
        let mut c = Client {
            stream,
            buf: Vec::with_capacity(64),
            out: Vec::with_capacity(64),
            hello: HelloInfo {
                request_milli: 0,
                limit_milli: 0,
                mem_limit: 0,
                mem_used: 0,
                window_ms: 0,
            },
            gate: None,
            parks: false,
        };
        c.send(&Request::Hello {
            pid,
            gpu_uuid: gpu_uuid.to_owned(),
        })?;
        match c.recv()? {
            Reply::HelloOk {
                request_milli,
                limit_milli,
                mem_limit,
                mem_used,
                window_ms,
            } => {
                c.hello = HelloInfo {
                    request_milli,
                    limit_milli,
                    mem_limit,
                    mem_used,
                    window_ms,
                };
                Ok(c)
            }
            other => Err(unexpected(other)),
        }
    }

    /// [`Client::connect`], retrying every `every` while the error is a
    /// disconnect (no socket yet, gem-schd restarting) until `timeout` has passed.
    pub fn connect_with_retry(
        path: impl AsRef<Path>,
        pid: u32,
        gpu_uuid: &str,
        timeout: Duration,
        every: Duration,
    ) -> Result<Self, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            match Client::connect(path.as_ref(), pid, gpu_uuid) {
                Ok(c) => return Ok(c),
                Err(e) if e.is_disconnect() && Instant::now() + every < deadline => {
                    std::thread::sleep(every);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The limits gem-schd announced in HelloOk.
    pub fn hello(&self) -> &HelloInfo {
        &self.hello
    }

    /// Set (or clear) the timeout of every blocking read, token waits included.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(t)
    }

    /// The connection's file descriptor (to poll it for a hang-up; a forked child closes
    /// its inherited copy). It stays owned by the client.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    /// Ask for the token and block until it is granted; returns the quota in µs.
    pub fn request_token(&mut self, overuse_us: u64, burst_us: u64) -> Result<u64, ClientError> {
        self.send_token_request(overuse_us, burst_us)?;
        self.wait_grant()
    }

    /// Send a TokenRequest without waiting for the Grant (see [`Client::wait_grant`]).
    pub fn send_token_request(
        &mut self,
        overuse_us: u64,
        burst_us: u64,
    ) -> Result<(), ClientError> {
        self.send(&Request::TokenRequest {
            overuse_us,
            burst_us,
        })
    }

    /// Wait for the Grant of the TokenRequest sent before. After a timeout
    /// ([`ClientError::is_timeout`]) it may be called again to go on waiting.
    pub fn wait_grant(&mut self) -> Result<u64, ClientError> {
        self.wait_grant_spinning(Duration::ZERO)
    }

    /// [`Client::wait_grant`], and after a [`Reply::Soon`] (sent only after
    /// [`Client::want_soon`]) it polls the socket without blocking for up to `spin` before it
    /// blocks again: a thread blocked in a read is woken by the Grant's arrival, which on an
    /// idle CPU (a halted virtual CPU, a deep idle state) took ~0.05 ms more than on a
    /// running one.
    pub fn wait_grant_spinning(&mut self, spin: Duration) -> Result<u64, ClientError> {
        loop {
            match token_wait(self.recv()?)? {
                Wait::Grant(quota_us) => return Ok(quota_us),
                Wait::Soon => {
                    if let Some(quota_us) = self.spin_for_grant(spin)? {
                        return Ok(quota_us);
                    }
                }
            }
        }
    }

    /// Polls for a whole frame for up to `spin`: `Some(quota)` when it is a Grant, `None`
    /// when none came or another Soon did (the caller blocks); another frame is an error as
    /// in `wait_grant`.
    fn spin_for_grant(&mut self, spin: Duration) -> Result<Option<u64>, ClientError> {
        let start = Instant::now();
        while start.elapsed() < spin {
            match self.arrived_wait()? {
                Some(Wait::Grant(quota_us)) => return Ok(Some(quota_us)),
                Some(Wait::Soon) => return Ok(None),
                None => std::hint::spin_loop(),
            }
        }
        Ok(None)
    }

    /// Tell gem-schd this connection reads [`Reply::Soon`] while it waits for a Grant
    /// ([`Request::WantSoon`]). No reply; a gem-schd older than it refuses it with an Error
    /// that arrives as the answer to the next request.
    pub fn want_soon(&mut self) -> Result<(), ClientError> {
        self.send(&Request::WantSoon)
    }

    /// Tell gem-schd this connection parks its queued work at a hold's end
    /// ([`Request::Parks`]). No reply; a gem-schd older than it refuses it with an Error that
    /// arrives as the answer to the next request.
    pub fn parks(&mut self) -> Result<(), ClientError> {
        self.send(&Request::Parks)?;
        self.parks = true;
        Ok(())
    }

    /// Whether this connection told gem-schd it parks ([`Client::parks`]).
    pub fn sent_parks(&self) -> bool {
        self.parks
    }

    /// Ask for the connection's gate page ([`Request::WantGate`]): gem-schd answers Gate with
    /// the page's descriptor attached, and the client keeps the page ([`Client::gate`]). Asked
    /// right after Hello/Options/WantSoon, when nothing else is on its way to this connection
    /// (a descriptor read by a plain read is lost). A gem-schd older than it refuses it with an
    /// Error (here, or with the next request's reply).
    pub fn want_gate(&mut self) -> Result<(), ClientError> {
        self.send(&Request::WantGate)?;
        let mut fd = None;
        let mut chunk = [0u8; 512];
        loop {
            if let Some(reply) = self.buffered_reply()? {
                return match reply {
                    Reply::Gate => {
                        let fd = fd.ok_or_else(|| {
                            io::Error::new(
                                io::ErrorKind::InvalidData,
                                "the Gate reply came without a descriptor",
                            )
                        })?;
                        self.gate = Some(GatePage::from_fd(fd)?);
                        Ok(())
                    }
                    other => Err(unexpected(other)),
                };
            }
            let (n, got) = match recv_with_fd(self.stream.as_raw_fd(), &mut chunk) {
                Ok((0, _)) => return Err(ClientError::Closed),
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            if got.is_some() {
                fd = got;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// The connection's gate page, once [`Client::want_gate`] got it.
    pub fn gate(&self) -> Option<&GatePage> {
        self.gate.as_ref()
    }

    /// [`Client::wait_grant`], but a [`Reply::Soon`] returns too ([`Wait::Soon`]; the Grant
    /// still follows): a client with a gate page queues work ahead then.
    pub fn wait_grant_or_soon(&mut self) -> Result<Wait, ClientError> {
        token_wait(self.recv()?)
    }

    /// The Grant of the TokenRequest sent before, if it has arrived (without waiting; a Soon
    /// is passed over).
    pub fn poll_grant(&mut self) -> Result<Option<u64>, ClientError> {
        loop {
            match self.arrived_wait()? {
                Some(Wait::Grant(quota_us)) => return Ok(Some(quota_us)),
                Some(Wait::Soon) => continue,
                None => return Ok(None),
            }
        }
    }

    /// The next Grant or Soon if it has arrived, without waiting: `None` when no whole frame
    /// is there yet; another frame is an error as in `wait_grant`.
    fn arrived_wait(&mut self) -> Result<Option<Wait>, ClientError> {
        loop {
            if let Some(reply) = self.buffered_reply()? {
                return token_wait(reply).map(Some);
            }
            match self.read_arrived() {
                Ok(0) => return Err(ClientError::Closed),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Ask to go on holding past the quota, the last work still queued (see
    /// [`Request::Renew`]): `Some(quota_us)` if the hold goes on, `None` if the holder must
    /// drain and ask with a TokenRequest.
    pub fn renew(&mut self, burst_us: u64) -> Result<Option<u64>, ClientError> {
        self.send(&Request::Renew { burst_us })?;
        match self.recv()? {
            Reply::Grant { quota_us } => Ok(Some(quota_us)),
            Reply::Yield => Ok(None),
            other => Err(unexpected(other)),
        }
    }

    /// Ask what gem-schd wants of this client ([`Request::Options`]): how often to time a
    /// launch for Busy reports (0 = no reports).
    pub fn options(&mut self) -> Result<u32, ClientError> {
        self.send(&Request::Options)?;
        match self.recv()? {
            Reply::OptionsOk { busy_every } => Ok(busy_every),
            other => Err(unexpected(other)),
        }
    }

    /// Report how busy this process kept the GPU ([`Request::Busy`]). No reply.
    pub fn busy(
        &mut self,
        busy_us: u64,
        held_us: u64,
        earlier_us: u64,
        engine_us: Option<u64>,
    ) -> Result<(), ClientError> {
        self.send(&Request::Busy {
            busy_us,
            held_us,
            earlier_us,
            engine_us,
        })
    }

    /// Tell gem-schd that this holder stopped launching and drains ([`Request::Drain`]): the
    /// token may go on at once. No reply.
    pub fn drain(&mut self) -> Result<(), ClientError> {
        self.send(&Request::Drain)
    }

    /// Give the token back (the holder went idle). No reply.
    pub fn release(&mut self, used_us: u64) -> Result<(), ClientError> {
        self.send(&Request::Release { used_us })
    }

    /// Reserve `bytes` of GPU memory.
    pub fn mem_alloc(&mut self, bytes: u64) -> Result<MemVerdict, ClientError> {
        self.send(&Request::MemAlloc { bytes })?;
        match self.recv()? {
            Reply::MemVerdict {
                granted,
                used,
                limit,
            } => Ok(MemVerdict {
                granted,
                used,
                limit,
            }),
            other => Err(unexpected(other)),
        }
    }

    /// Credit `bytes` of GPU memory. No reply.
    pub fn mem_free(&mut self, bytes: u64) -> Result<(), ClientError> {
        self.send(&Request::MemFree { bytes })
    }

    /// The client's (used, limit) bytes.
    pub fn mem_query(&mut self) -> Result<(u64, u64), ClientError> {
        self.send(&Request::MemQuery)?;
        match self.recv()? {
            Reply::MemInfo { used, limit } => Ok((used, limit)),
            other => Err(unexpected(other)),
        }
    }

    fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        self.out.clear();
        req.encode_into(&mut self.out)?;
        if let Err(e) = send_all(&self.stream, &self.out) {
            // gem-schd answers a frame it cannot read with an Error and hangs up. After a frame
            // with no reply (Busy) the next write finds the connection closed while that Error
            // still waits to be read: without it, an older gem-schd's refusal of a Busy read as
            // a lost connection, and the hook sent Busy again after reconnecting.
            return Err(self.received_error().unwrap_or(e.into()));
        }
        Ok(())
    }

    /// An Error reply that has already arrived, read without waiting (after a failed write).
    fn received_error(&mut self) -> Option<ClientError> {
        // A refusal is one short frame: a few reads at most.
        for _ in 0..16 {
            match self.read_arrived() {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        while let Ok(Some(reply)) = self.buffered_reply() {
            if let Reply::Error { code, message } = reply {
                return Some(ClientError::Server { code, message });
            }
        }
        None
    }

    /// The next whole reply already in the buffer, taken out of it.
    fn buffered_reply(&mut self) -> Result<Option<Reply>, FrameError> {
        let Some((reply, n)) = Reply::decode(&self.buf)? else {
            return Ok(None);
        };
        self.buf.drain(..n);
        Ok(Some(reply))
    }

    /// Appends to the buffer what has arrived, without waiting: `Ok(0)` when the peer has
    /// closed, `WouldBlock` when nothing has arrived.
    fn read_arrived(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 512];
        // SAFETY: the fd is owned by `self.stream` and open; the pointer/len pair describes
        // the live buffer `chunk`.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                chunk.as_mut_ptr().cast(),
                chunk.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    fn recv(&mut self) -> Result<Reply, ClientError> {
        let mut chunk = [0u8; 512];
        loop {
            if let Some(reply) = self.buffered_reply()? {
                return Ok(reply);
            }
            let n = match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ClientError::Closed),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// What a reply to a TokenRequest says: a Grant or a Soon; any other reply is an error.
fn token_wait(reply: Reply) -> Result<Wait, ClientError> {
    match reply {
        Reply::Grant { quota_us } => Ok(Wait::Grant(quota_us)),
        Reply::Soon => Ok(Wait::Soon),
        other => Err(unexpected(other)),
    }
}

fn unexpected(r: Reply) -> ClientError {
    match r {
        Reply::Error { code, message } => ClientError::Server { code, message },
        other => ClientError::Unexpected(other),
    }
}

/// Write all of `data` with MSG_NOSIGNAL (a closed peer is EPIPE, not SIGPIPE).
fn send_all(stream: &UnixStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        // SAFETY: the fd is owned by `stream` and open; the pointer/len pair
        // describes the live slice `data`.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        data = &data[n as usize..];
    }
    Ok(())
}

#[cfg(test)]
mod refusal_tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixListener;

    /// A listening socket in a fresh directory named after `test` (removed on drop).
    struct Server {
        dir: PathBuf,
        path: PathBuf,
    }

    impl Server {
        fn listen(test: &str) -> (Server, UnixListener) {
            let dir = std::env::temp_dir().join(format!("gem-proto-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("gem.sock");
            let listener = UnixListener::bind(&path).unwrap();
            (Server { dir, path }, listener)
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Accepts a connection, reads its Hello and answers HelloOk; `buf` keeps what arrived
    /// after the Hello.
    fn accept_hello(listener: &UnixListener, buf: &mut Vec<u8>) -> UnixStream {
        let (mut s, _) = listener.accept().unwrap();
        let hello = read_request(&mut s, buf);
        assert!(matches!(hello, Request::Hello { .. }));
        let ok = Reply::HelloOk {
            request_milli: 500,
            limit_milli: 500,
            mem_limit: 1,
            mem_used: 0,
            window_ms: 10_000,
        };
        s.write_all(&ok.encode().unwrap()).unwrap();
        s
    }

    /// Reads one whole request frame from `s`, keeping in `buf` what arrived after it (a
    /// client may send two frames before it reads).
    fn read_request(s: &mut UnixStream, buf: &mut Vec<u8>) -> Request {
        let mut chunk = [0u8; 256];
        loop {
            if let Ok(Some((req, n))) = Request::decode(buf) {
                buf.drain(..n);
                return req;
            }
            let n = s.read(&mut chunk).expect("read a request");
            assert!(n > 0, "the client hung up");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    #[test]
    fn a_refusal_of_a_frame_without_reply_is_read_when_the_next_write_fails() {
        // gem-schd refuses a Busy it cannot read with an Error and hangs up. Busy has no
        // reply, so the client learns of it at its next frame: that write fails, and the
        // Error waiting in the socket must come out as the refusal (naming Busy), not as a
        // lost connection.
        let (server, listener) = Server::listen("refusal");
        let gem_schd = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut s = accept_hello(&listener, &mut buf);
            assert!(matches!(
                read_request(&mut s, &mut buf),
                Request::Busy { .. }
            ));
            let refusal = Reply::error(
                crate::code::BAD_FRAME,
                FrameError::TrailingBytes {
                    kind: crate::kind::BUSY,
                    extra: 8,
                }
                .to_string(),
            );
            s.write_all(&refusal.encode().unwrap()).unwrap();
            // Dropped here: the hang-up.
        });
        let mut c = Client::connect(&server.path, 1, "GPU-x").unwrap();
        c.busy(1, 2, 3, None).unwrap();
        gem_schd.join().unwrap();
        let e = c.send_token_request(0, 0).unwrap_err();
        assert_eq!(e.refused_kind(), Some(crate::kind::BUSY), "{e}");
    }

    #[test]
    fn a_grant_after_soon_is_read_spinning_or_blocking() {
        // gem-schd sends Soon, then the Grant (here after `pause`). Whether the Grant comes
        // within the spin or after it (the client then blocks), or the client does not spin,
        // the one answer is the Grant, and the connection stays in step: the next request's
        // answer is its own.
        let (server, listener) = Server::listen("soon");
        let cases = [(2, 50), (30, 1), (2, 0)];
        let gem_schd = std::thread::spawn(move || {
            for (i, (pause_ms, _)) in cases.iter().enumerate() {
                let mut buf = Vec::new();
                let mut s = accept_hello(&listener, &mut buf);
                assert_eq!(read_request(&mut s, &mut buf), Request::WantSoon);
                let request = read_request(&mut s, &mut buf);
                assert!(matches!(request, Request::TokenRequest { .. }));
                s.write_all(&Reply::Soon.encode().unwrap()).unwrap();
                std::thread::sleep(Duration::from_millis(*pause_ms));
                let grant = Reply::Grant {
                    quota_us: 1000 + i as u64,
                };
                s.write_all(&grant.encode().unwrap()).unwrap();
                let query = read_request(&mut s, &mut buf);
                assert!(matches!(query, Request::MemQuery));
                let info = Reply::MemInfo { used: 7, limit: 9 };
                s.write_all(&info.encode().unwrap()).unwrap();
            }
        });
        for (i, (_, spin_ms)) in cases.iter().enumerate() {
            let mut c = Client::connect(&server.path, 1, "GPU-x").unwrap();
            c.want_soon().unwrap();
            c.send_token_request(0, 0).unwrap();
            let q = c
                .wait_grant_spinning(Duration::from_millis(*spin_ms))
                .unwrap();
            assert_eq!(q, 1000 + i as u64, "case {i}");
            assert_eq!(c.mem_query().unwrap(), (7, 9), "case {i}");
        }
        gem_schd.join().unwrap();
    }

    #[test]
    fn a_gate_comes_with_its_descriptor_and_a_grant_is_polled_past_soon() {
        // A Gate frame whose descriptor is missing is refused without a panic; one with a
        // sealed page gives the client the page. poll_grant answers None while nothing has
        // come, passes a Soon over, and returns the Grant; a hang-up is Closed.
        let (server, listener) = Server::listen("gate");
        let gem_schd = std::thread::spawn(move || {
            let mut buf = Vec::new();
            let mut s = accept_hello(&listener, &mut buf);
            assert_eq!(read_request(&mut s, &mut buf), Request::WantGate);
            s.write_all(&Reply::Gate.encode().unwrap()).unwrap();
            drop(s);
            let mut buf = Vec::new();
            let mut s = accept_hello(&listener, &mut buf);
            assert_eq!(read_request(&mut s, &mut buf), Request::WantGate);
            let page = GatePage::create().unwrap();
            let frame = Reply::Gate.encode().unwrap();
            let sent = crate::gate::send_with_fd(s.as_raw_fd(), &frame, page.fd()).unwrap();
            s.write_all(&frame[sent..]).unwrap();
            assert!(matches!(
                read_request(&mut s, &mut buf),
                Request::TokenRequest { .. }
            ));
            // The client polls once before anything is sent; wait for its next frame.
            assert_eq!(read_request(&mut s, &mut buf), Request::MemQuery);
            page.open();
            s.write_all(&Reply::Soon.encode().unwrap()).unwrap();
            s.write_all(&Reply::Grant { quota_us: 77 }.encode().unwrap())
                .unwrap();
            // Dropped: the hang-up.
        });
        let mut c = Client::connect(&server.path, 1, "GPU-x").unwrap();
        let e = c.want_gate().unwrap_err();
        assert!(e.to_string().contains("without a descriptor"), "{e}");
        assert!(c.gate().is_none());
        let mut c = Client::connect(&server.path, 1, "GPU-x").unwrap();
        c.want_gate().unwrap();
        assert!(!c.gate().unwrap().is_open());
        c.send_token_request(0, 0).unwrap();
        assert_eq!(c.poll_grant().unwrap(), None);
        c.send(&Request::MemQuery).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let q = loop {
            if let Some(q) = c.poll_grant().unwrap() {
                break q;
            }
            assert!(Instant::now() < deadline, "no Grant polled");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(q, 77);
        assert!(
            c.gate().unwrap().is_open(),
            "the page is shared with gem-schd"
        );
        gem_schd.join().unwrap();
        let closed = loop {
            match c.poll_grant() {
                Ok(None) => std::thread::sleep(Duration::from_millis(1)),
                other => break other,
            }
        };
        assert!(matches!(closed, Err(ClientError::Closed)), "{closed:?}");
    }
}
