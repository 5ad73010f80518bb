//! The plugin registration service over a minimal HTTP/2 server of its own.
//!
//! The kubelet's plugin watcher dials a registration socket with grpc-go, target = the
//! socket's path and no scheme, so every request carries `:authority:
//! /var/lib/kubelet/plugins_registry/<driver>-reg.sock`. That is no valid authority, and
//! the `h2` crate under tonic refuses such a request with `PROTOCOL_ERROR` (before any
//! service sees it), so a tonic server cannot be registered at all. (The DRA service
//! itself is dialled as `unix:<path>`, which grpc-go sends as `localhost`: tonic serves it.)
//!
//! This server speaks just enough HTTP/2 (RFC 9113) for the two unary calls the kubelet
//! makes: it answers SETTINGS and PING, returns flow-control credit for what it reads,
//! collects each stream's request body and answers with the response headers, one gRPC
//! message and the trailers. It never decodes the request's header block (HPACK with its
//! dynamic table and Huffman strings): the two calls are told apart by their bodies.
//! `GetInfo`'s `InfoRequest` has no fields, so its body is empty; every
//! `RegistrationStatus` the kubelet sends has `plugin_registered = true` or an error
//! message, so its body is not. The responses' headers are HPACK literals without
//! indexing, which any decoder reads.

use std::collections::HashMap;
use std::future::Future;

use prost::Message as _;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::UnixListener;

use crate::dra::{Registration, RegistrationStatus, RegistrationStatusResponse};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
/// The largest frame a peer may send before SETTINGS say otherwise (we never raise it).
const MAX_FRAME: usize = 16_384;
/// A request body larger than this is no registration call: the connection is dropped.
const MAX_BODY: usize = 64 * 1024;

/// One frame: type, flags, stream, payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
}

pub(crate) fn encode_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

pub(crate) async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Frame> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "a frame of {len} bytes, above the {MAX_FRAME} allowed"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    })
}

/// An HPACK integer with an `n`-bit prefix whose other bits are `first` (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// A header as a literal without indexing, with a new name (RFC 7541 §6.2.2).
fn hpack_literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x00);
    hpack_int(out, 0, 7, name.len());
    out.extend_from_slice(name.as_bytes());
    hpack_int(out, 0, 7, value.len());
    out.extend_from_slice(value.as_bytes());
}

/// `grpc-message`'s percent-encoding: printable ASCII but `%` as is, the rest `%XX`.
fn grpc_message(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if (0x20..=0x7e).contains(&b) && b != b'%' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The frames that answer one call on `stream`: `Ok` a message, `Err` a gRPC status
/// code and message.
fn response(stream: u32, result: Result<Vec<u8>, (u8, String)>) -> Vec<u8> {
    let mut head = vec![0x88]; // :status: 200, static table entry 8
    hpack_literal(&mut head, "content-type", "application/grpc");
    let mut out = encode_frame(HEADERS, END_HEADERS, stream, &head);
    let mut trailers = Vec::new();
    match result {
        Ok(msg) => {
            let mut data = vec![0u8];
            data.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            data.extend_from_slice(&msg);
            out.extend(encode_frame(DATA, 0, stream, &data));
            hpack_literal(&mut trailers, "grpc-status", "0");
        }
        Err((code, message)) => {
            hpack_literal(&mut trailers, "grpc-status", &code.to_string());
            hpack_literal(&mut trailers, "grpc-message", &grpc_message(&message));
        }
    }
    out.extend(encode_frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        stream,
        &trailers,
    ));
    out
}

/// Answers one call whose request body (gRPC framing included) is `body`.
fn call(reg: &Registration, body: &[u8]) -> Result<Vec<u8>, (u8, String)> {
    const INTERNAL: u8 = 13;
    let msg = match body {
        [] => &[][..],
        [0, a, b, c, d, rest @ ..] => {
            let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
            rest.get(..len)
                .ok_or((INTERNAL, "a truncated gRPC message".to_string()))?
        }
        _ => return Err((INTERNAL, "a compressed or truncated gRPC message".into())),
    };
    if msg.is_empty() {
        return Ok(reg.info().encode_to_vec());
    }
    let status = RegistrationStatus::decode(msg)
        .map_err(|e| (INTERNAL, format!("not a RegistrationStatus: {e}")))?;
    reg.notify(status)
        .map(|()| RegistrationStatusResponse {}.encode_to_vec())
        .map_err(|m| (INTERNAL, m))
}

/// Serves one connection until the peer closes it or breaks the protocol.
pub(crate) async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    reg: Registration,
) -> std::io::Result<()> {
    let mut preface = [0u8; PREFACE.len()];
    s.read_exact(&mut preface).await?;
    if preface != PREFACE {
        return Err(std::io::Error::other("not an HTTP/2 connection preface"));
    }
    s.write_all(&encode_frame(SETTINGS, 0, 0, &[])).await?;
    let mut bodies: HashMap<u32, Vec<u8>> = HashMap::new();
    // The stream whose header block goes on in CONTINUATION frames.
    let mut continuing: Option<(u32, bool)> = None;
    loop {
        let f = read_frame(&mut s).await?;
        if let Some((stream, ends)) = continuing {
            if f.kind != CONTINUATION || f.stream != stream {
                return Err(std::io::Error::other("a header block left unfinished"));
            }
            if f.flags & END_HEADERS != 0 {
                continuing = None;
                if ends {
                    let body = bodies.remove(&stream).unwrap_or_default();
                    s.write_all(&response(stream, call(&reg, &body))).await?;
                }
            }
            continue;
        }
        match f.kind {
            SETTINGS if f.flags & ACK == 0 => {
                s.write_all(&encode_frame(SETTINGS, ACK, 0, &[])).await?;
            }
            PING if f.flags & ACK == 0 => {
                s.write_all(&encode_frame(PING, ACK, 0, &f.payload)).await?;
            }
            HEADERS => {
                let ends = f.flags & END_STREAM != 0;
                bodies.insert(f.stream, Vec::new());
                if f.flags & END_HEADERS == 0 {
                    continuing = Some((f.stream, ends));
                } else if ends {
                    bodies.remove(&f.stream);
                    s.write_all(&response(f.stream, call(&reg, &[]))).await?;
                }
            }
            DATA => {
                if !f.payload.is_empty() {
                    // Credit the connection for what was read (streams are short-lived
                    // and tiny; their own windows never run out).
                    let n = f.payload.len() as u32;
                    s.write_all(&encode_frame(WINDOW_UPDATE, 0, 0, &n.to_be_bytes()))
                        .await?;
                }
                let data = if f.flags & PADDED != 0 {
                    let pad = usize::from(*f.payload.first().unwrap_or(&0));
                    f.payload
                        .get(1..f.payload.len().saturating_sub(pad))
                        .unwrap_or_default()
                } else {
                    &f.payload[..]
                };
                let Some(body) = bodies.get_mut(&f.stream) else {
                    continue;
                };
                body.extend_from_slice(data);
                if body.len() > MAX_BODY {
                    return Err(std::io::Error::other("a request body too large"));
                }
                if f.flags & END_STREAM != 0 {
                    let body = bodies.remove(&f.stream).unwrap_or_default();
                    s.write_all(&response(f.stream, call(&reg, &body))).await?;
                }
            }
            RST_STREAM => {
                bodies.remove(&f.stream);
            }
            GOAWAY => return Ok(()),
            // SETTINGS and PING acknowledgements, WINDOW_UPDATE (our responses are far
            // below any window), PRIORITY, unknown types: nothing to do.
            _ => {}
        }
    }
}

/// Serves `reg` on `listener` until `shutdown`; open connections are dropped then.
pub(crate) async fn serve(
    listener: UnixListener,
    reg: Registration,
    shutdown: impl Future<Output = ()>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    conns.spawn(connection(stream, reg.clone()));
                }
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dra::PluginInfo;

    /// A header block as grpc-go's plugin watcher sends it, the socket's path as the
    /// authority (literals without Huffman coding; the server never reads them).
    fn request_headers(path: &str, authority: &str) -> Vec<u8> {
        let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
        hpack_literal(&mut b, ":path", path);
        hpack_literal(&mut b, ":authority", authority);
        hpack_literal(&mut b, "content-type", "application/grpc");
        hpack_literal(&mut b, "te", "trailers");
        b
    }

    fn grpc(msg: &[u8]) -> Vec<u8> {
        let mut d = vec![0u8];
        d.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        d.extend_from_slice(msg);
        d
    }

    /// Writes one frame to the server.
    async fn send<W: AsyncWrite + Unpin>(
        w: &mut W,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
    ) {
        w.write_all(&encode_frame(kind, flags, stream, payload))
            .await
            .expect("the server reads");
    }

    /// Reads frames until `stream` ends; its DATA payload and trailer block.
    async fn answer<R: AsyncRead + Unpin>(r: &mut R, stream: u32) -> (Vec<u8>, Vec<u8>) {
        let mut data = Vec::new();
        loop {
            let f = read_frame(r).await.expect("a frame");
            if f.stream != stream {
                continue;
            }
            match f.kind {
                DATA => data.extend_from_slice(&f.payload),
                HEADERS if f.flags & END_STREAM != 0 => return (data, f.payload),
                _ => {}
            }
        }
    }

    #[tokio::test]
    async fn answers_the_kubelets_calls_whatever_their_authority() {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let reg = Registration::new("gpu.kubeshare.io", "/x/plugins/gpu.kubeshare.io/dra.sock");
        let task = tokio::spawn(connection(server, reg.clone()));
        let socket = "/var/lib/kubelet/plugins_registry/gpu.kubeshare.io-reg.sock";
        client.write_all(PREFACE).await.unwrap();
        send(&mut client, SETTINGS, 0, 0, &[0, 4, 0, 0, 0xff, 0xff]).await;
        let first = read_frame(&mut client).await.unwrap();
        assert_eq!((first.kind, first.flags), (SETTINGS, 0), "settings first");

        // GetInfo: the header block split over a CONTINUATION frame, the empty message
        // padded.
        let h = request_headers("/pluginregistration.Registration/GetInfo", socket);
        let (a, b) = h.split_at(10);
        send(&mut client, HEADERS, 0, 1, a).await;
        send(&mut client, CONTINUATION, END_HEADERS, 1, b).await;
        let mut padded = vec![3];
        padded.extend(grpc(&[]));
        padded.extend([0, 0, 0]);
        send(&mut client, DATA, END_STREAM | PADDED, 1, &padded).await;
        let (data, trailers) = answer(&mut client, 1).await;
        let info = PluginInfo::decode(&data[5..]).expect("PluginInfo");
        assert_eq!(info, reg.info());
        assert!(trailers.windows(11).any(|w| w == b"grpc-status"));

        // A PING is answered in kind.
        send(&mut client, PING, 0, 0, &[7; 8]).await;
        // NotifyRegistrationStatus, on the same connection.
        let status = RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        };
        let h = request_headers(
            "/pluginregistration.Registration/NotifyRegistrationStatus",
            socket,
        );
        send(&mut client, HEADERS, END_HEADERS, 3, &h).await;
        let body = grpc(&status.encode_to_vec());
        send(&mut client, DATA, END_STREAM, 3, &body).await;
        let (data, _) = answer(&mut client, 3).await;
        assert_eq!(data, grpc(&[]));
        assert_eq!(reg.status(), Some(status));

        // A failed registration: an error status with the kubelet's message.
        let refused = RegistrationStatus {
            plugin_registered: false,
            error: "no handler 100%".into(),
        };
        send(&mut client, HEADERS, END_HEADERS, 5, &h).await;
        let body = grpc(&refused.encode_to_vec());
        send(&mut client, DATA, END_STREAM, 5, &body).await;
        let (data, trailers) = answer(&mut client, 5).await;
        assert!(data.is_empty());
        let t = String::from_utf8_lossy(&trailers);
        assert!(t.contains("grpc-status") && t.contains("13"), "{t}");
        assert!(t.contains("no handler 100%25"), "{t}");

        send(&mut client, GOAWAY, 0, 0, &[0; 8]).await;
        task.await.unwrap().expect("a clean end");
    }

    #[test]
    fn hpack_integers() {
        let enc = |n, v| {
            let mut o = Vec::new();
            hpack_int(&mut o, 0, n, v);
            o
        };
        // RFC 7541 C.1.1 and C.1.2.
        assert_eq!(enc(5, 10), [10]);
        assert_eq!(enc(5, 1337), [31, 154, 10]);
        assert_eq!(enc(7, 127), [127, 0]);
        assert_eq!(grpc_message("a é%"), "a %C3%A9%25");
    }
}
