//! Frames of protocol v1: the two message enums, their encoder and a decoder that
//! never panics (short input is "need more bytes", anything malformed a typed error).
//!
//! Layout: `u32 length` (LE, bytes that follow, at most [`MAX_FRAME_LEN`]) | `u8 version`
//! | `u8 kind` | payload (fixed little-endian fields; strings are `u16 len` + UTF-8).

use thiserror::Error;

/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Largest value of the length prefix (version + kind + payload).
pub const MAX_FRAME_LEN: usize = 4096;
/// Largest string (in bytes) a frame may carry.
pub const MAX_STRING_LEN: usize = 1024;
/// Bytes of the length prefix.
pub const LEN_PREFIX: usize = 4;

/// Error codes carried by [`Reply::Error`].
pub mod code {
    /// The client is not (or no longer) in the resource-config.
    pub const UNKNOWN_CLIENT: u16 = 1;
    /// The peer sent a frame that does not decode.
    pub const BAD_FRAME: u16 = 2;
    /// Hello named a GPU other than the one this gem-schd serves.
    pub const WRONG_GPU: u16 = 3;
    /// A frame out of order (e.g. anything before Hello, a second Hello).
    pub const PROTOCOL_MISUSE: u16 = 4;
    /// gem-schd is shutting down; reconnect later.
    pub const SHUTTING_DOWN: u16 = 5;
    /// The client already has as many connections as gem-schd allows one client
    /// (`--max-conns`); this one is closed.
    pub const TOO_MANY_CONNECTIONS: u16 = 6;
    /// The connecting process does not run in the pod the socket belongs to (gem-schd
    /// `--verify-pod-peers`: its cgroups name another pod, or none); this one is closed.
    pub const PEER_NOT_IN_POD: u16 = 7;
    /// gem-schd could not make the connection's gate page (WantGate); the connection stays.
    pub const GATE_UNAVAILABLE: u16 = 8;
}

/// Frame kinds, client -> server.
pub mod kind {
    pub const HELLO: u8 = 1;
    pub const TOKEN_REQUEST: u8 = 2;
    pub const RELEASE: u8 = 3;
    pub const MEM_ALLOC: u8 = 4;
    pub const MEM_FREE: u8 = 5;
    pub const MEM_QUERY: u8 = 6;
    pub const RENEW: u8 = 7;
    pub const BUSY: u8 = 8;
    pub const OPTIONS: u8 = 9;
    pub const DRAIN: u8 = 10;
    pub const WANT_SOON: u8 = 11;
    pub const WANT_GATE: u8 = 12;
    pub const PARKS: u8 = 13;
    /// Server -> client kinds.
    pub const HELLO_OK: u8 = 64;
    pub const GRANT: u8 = 65;
    pub const MEM_VERDICT: u8 = 66;
    pub const MEM_INFO: u8 = 67;
    pub const YIELD: u8 = 68;
    pub const OPTIONS_OK: u8 = 69;
    pub const SOON: u8 = 70;
    pub const GATE: u8 = 71;
    pub const ERROR: u8 = 127;
}

/// A frame sent by a client (the hook) to gem-schd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First frame on every connection.
    Hello { pid: u32, gpu_uuid: String },
    /// Ask for the token; `overuse_us` is time used beyond the last quota,
    /// `burst_us` the predicted length of the next kernel burst (0 = unknown).
    TokenRequest { overuse_us: u64, burst_us: u64 },
    /// The holder went idle: the token moves on. `used_us` = GPU time since the grant.
    Release { used_us: u64 },
    /// Reserve `bytes` of GPU memory before calling the driver.
    MemAlloc { bytes: u64 },
    /// Credit `bytes` of GPU memory.
    MemFree { bytes: u64 },
    /// Ask for the client's memory use and limit.
    MemQuery,
    /// The holder's quota ran out and it wants more, its last work still queued: the hold
    /// goes on (a Grant) if a TokenRequest now would give the token straight back to it,
    /// which spares the drain and the GPU's idle restart; otherwise Yield, and the holder
    /// drains and asks with a TokenRequest as usual. `burst_us` as in TokenRequest.
    Renew { burst_us: u64 },
    /// How busy this process kept the GPU since its last Busy: `busy_us` of GPU time measured
    /// by timing events around a sample of its launches (scaled to all of them) launched in
    /// its current grant, over `held_us` of holds (the wall time of its holds in that span),
    /// and `earlier_us` measured of launches in its grants before (their events passed only
    /// after the report that ended them). Sent before the frame that ends a hold; no reply.
    /// gem-schd keeps each client's fill (busy / held) per kind of hold. `earlier_us` is
    /// optional on the wire (a frame without it reads as 0), for hooks older than it.
    /// `engine_us`, also optional (`None`: not measured), is the time this process's contexts
    /// held the GPU's compute engine since its last report, from CUPTI's context-switch
    /// records: an upper bound on its GPU time, which gem-schd charges a capped client's
    /// co-holds by (gem-schd `core/engine.rs`).
    Busy {
        busy_us: u64,
        held_us: u64,
        earlier_us: u64,
        engine_us: Option<u64>,
    },
    /// What gem-schd wants of this client beyond the basics, asked once per token connection
    /// after Hello: answered with OptionsOk.
    Options,
    /// The holder stopped launching at its quota's end and now waits for the work it queued;
    /// its TokenRequest (with the overuse) or Release follows once that is done. gem-schd may
    /// hand the token on at once: the next holder's work queues behind the drain. Sent by a
    /// hook that does not renew (a Renew answered Yield is the same notice). No reply.
    Drain,
    /// This connection reads [`Reply::Soon`] while it waits for a Grant. Sent once, after
    /// Options; no reply.
    WantSoon,
    /// This connection queues work ahead of its Grants behind a gate word: answered with
    /// [`Reply::Gate`], which carries the word's page (a sealed memfd) as `SCM_RIGHTS`
    /// ancillary data. Sent once, after WantSoon.
    WantGate,
    /// At a hold's end this connection stops its queued work behind its gate word (the hook's
    /// parking) after its Renew is answered Yield, instead of draining it: gem-schd must not
    /// hand the token on at that notice (the next holder's context running beside the stop
    /// makes it unreadable), only tell the next client Soon. Sent once, after WantGate got a
    /// page; no reply.
    Parks,
}

/// A frame sent by gem-schd to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    HelloOk {
        request_milli: u16,
        limit_milli: u16,
        mem_limit: u64,
        mem_used: u64,
        window_ms: u32,
    },
    /// The client holds the token for `quota_us` from now.
    Grant {
        quota_us: u64,
    },
    /// Answer to MemAlloc; `used`/`limit` are client-wide, after the decision.
    MemVerdict {
        granted: bool,
        used: u64,
        limit: u64,
    },
    MemInfo {
        used: u64,
        limit: u64,
    },
    Error {
        code: u16,
        message: String,
    },
    /// Answer to Renew: not renewed. The holder drains and reports its hold's end; gem-schd
    /// may already have handed the token on (see [`Request::Drain`]).
    Yield,
    /// Answer to Options: time one launch in about `busy_every` and send Busy reports
    /// (0 = none: this gem-schd does not use them).
    OptionsOk {
        busy_every: u32,
    },
    /// To a connection that sent WantSoon and waits for a Grant: the holder has stopped
    /// launching and drains, and the token comes to this connection next unless its report
    /// changes that. The waiting thread can be running when the Grant arrives instead of
    /// being woken by it. Not an answer: the Grant (or an Error) still follows.
    Soon,
    /// Answer to WantGate; the gate page's file descriptor comes with it (`SCM_RIGHTS`).
    /// gem-schd stores 1 in the page's first word before each Grant it sends on this
    /// connection, so work the client queued behind that word starts without the client.
    Gate,
}

/// Why a frame could not be decoded (or encoded).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("frame length {0} out of range (2..={MAX_FRAME_LEN})")]
    BadLength(u32),
    #[error("unsupported protocol version {0} (this side speaks {VERSION})")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame kind {kind} payload truncated")]
    Truncated { kind: u8 },
    #[error("frame kind {kind} has {extra} trailing bytes")]
    TrailingBytes { kind: u8, extra: usize },
    #[error("string of {0} bytes exceeds {MAX_STRING_LEN}")]
    StringTooLong(usize),
    #[error("string is not valid UTF-8")]
    BadUtf8,
    #[error("MemVerdict granted byte must be 0 or 1, got {0}")]
    BadBool(u8),
}

/// Result of decoding from the front of a buffer.
pub type Decoded<T> = Result<Option<(T, usize)>, FrameError>;

impl Request {
    /// The frame kind byte of this message.
    pub fn kind(&self) -> u8 {
        match self {
            Request::Hello { .. } => kind::HELLO,
            Request::TokenRequest { .. } => kind::TOKEN_REQUEST,
            Request::Release { .. } => kind::RELEASE,
            Request::MemAlloc { .. } => kind::MEM_ALLOC,
            Request::MemFree { .. } => kind::MEM_FREE,
            Request::MemQuery => kind::MEM_QUERY,
            Request::Renew { .. } => kind::RENEW,
            Request::Busy { .. } => kind::BUSY,
            Request::Options => kind::OPTIONS,
            Request::Drain => kind::DRAIN,
            Request::WantSoon => kind::WANT_SOON,
            Request::WantGate => kind::WANT_GATE,
            Request::Parks => kind::PARKS,
        }
    }

    /// Whether gem-schd answers this request when it accepts it (Release, MemFree, Busy and
    /// Drain have no reply; a refusal of any request is answered with an Error).
    pub fn expects_reply(&self) -> bool {
        !matches!(
            self,
            Request::Release { .. }
                | Request::MemFree { .. }
                | Request::Busy { .. }
                | Request::Drain
                | Request::WantSoon
                | Request::Parks
        )
    }

    /// Append the encoded frame to `out`. Fails only for an over-long string.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let mut w = Writer::start(out, self.kind());
        match self {
            Request::Hello { pid, gpu_uuid } => {
                w.u32(*pid);
                w.string(gpu_uuid)?;
            }
            Request::TokenRequest {
                overuse_us,
                burst_us,
            } => {
                w.u64(*overuse_us);
                w.u64(*burst_us);
            }
            Request::Release { used_us } => w.u64(*used_us),
            Request::MemAlloc { bytes } | Request::MemFree { bytes } => w.u64(*bytes),
            Request::MemQuery => {}
            Request::Renew { burst_us } => w.u64(*burst_us),
            Request::Busy {
                busy_us,
                held_us,
                earlier_us,
                engine_us,
            } => {
                w.u64(*busy_us);
                w.u64(*held_us);
                w.u64(*earlier_us);
                if let Some(e) = engine_us {
                    w.u64(*e);
                }
            }
            Request::Options
            | Request::Drain
            | Request::WantSoon
            | Request::WantGate
            | Request::Parks => {}
        }
        w.finish();
        Ok(())
    }

    /// Encode into a fresh buffer.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut v = Vec::with_capacity(32);
        self.encode_into(&mut v)?;
        Ok(v)
    }

    /// Decode one frame from the front of `buf`: `Ok(None)` means more bytes are
    /// needed; `Ok(Some((msg, consumed)))` a whole frame.
    pub fn decode(buf: &[u8]) -> Decoded<Request> {
        let Some((kind, mut r, total)) = split_frame(buf)? else {
            return Ok(None);
        };
        let msg = match kind {
            kind::HELLO => Request::Hello {
                pid: r.u32()?,
                gpu_uuid: r.string()?,
            },
            kind::TOKEN_REQUEST => Request::TokenRequest {
                overuse_us: r.u64()?,
                burst_us: r.u64()?,
            },
            kind::RELEASE => Request::Release { used_us: r.u64()? },
            kind::MEM_ALLOC => Request::MemAlloc { bytes: r.u64()? },
            kind::MEM_FREE => Request::MemFree { bytes: r.u64()? },
            kind::MEM_QUERY => Request::MemQuery,
            kind::RENEW => Request::Renew { burst_us: r.u64()? },
            kind::BUSY => Request::Busy {
                busy_us: r.u64()?,
                held_us: r.u64()?,
                earlier_us: if r.rest.is_empty() { 0 } else { r.u64()? },
                engine_us: if r.rest.is_empty() {
                    None
                } else {
                    Some(r.u64()?)
                },
            },
            kind::OPTIONS => Request::Options,
            kind::DRAIN => Request::Drain,
            kind::WANT_SOON => Request::WantSoon,
            kind::WANT_GATE => Request::WantGate,
            kind::PARKS => Request::Parks,
            other => return Err(FrameError::UnknownKind(other)),
        };
        r.end()?;
        Ok(Some((msg, total)))
    }
}

impl Reply {
    /// The frame kind byte of this message.
    pub fn kind(&self) -> u8 {
        match self {
            Reply::HelloOk { .. } => kind::HELLO_OK,
            Reply::Grant { .. } => kind::GRANT,
            Reply::MemVerdict { .. } => kind::MEM_VERDICT,
            Reply::MemInfo { .. } => kind::MEM_INFO,
            Reply::Error { .. } => kind::ERROR,
            Reply::Yield => kind::YIELD,
            Reply::OptionsOk { .. } => kind::OPTIONS_OK,
            Reply::Soon => kind::SOON,
            Reply::Gate => kind::GATE,
        }
    }

    /// An Error reply whose message is cut (at a char boundary) to fit a frame.
    pub fn error(code: u16, message: impl Into<String>) -> Reply {
        let mut message = message.into();
        if message.len() > MAX_STRING_LEN {
            let mut cut = MAX_STRING_LEN;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Reply::Error { code, message }
    }

    /// Append the encoded frame to `out`. Fails only for an over-long string.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let mut w = Writer::start(out, self.kind());
        match self {
            Reply::HelloOk {
                request_milli,
                limit_milli,
                mem_limit,
                mem_used,
                window_ms,
            } => {
                w.u16(*request_milli);
                w.u16(*limit_milli);
                w.u64(*mem_limit);
                w.u64(*mem_used);
                w.u32(*window_ms);
            }
            Reply::Grant { quota_us } => w.u64(*quota_us),
            Reply::MemVerdict {
                granted,
                used,
                limit,
            } => {
                w.u8(u8::from(*granted));
                w.u64(*used);
                w.u64(*limit);
            }
            Reply::MemInfo { used, limit } => {
                w.u64(*used);
                w.u64(*limit);
            }
            Reply::Error { code, message } => {
                w.u16(*code);
                w.string(message)?;
            }
            Reply::Yield | Reply::Soon | Reply::Gate => {}
            Reply::OptionsOk { busy_every } => w.u32(*busy_every),
        }
        w.finish();
        Ok(())
    }

    /// Encode into a fresh buffer.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut v = Vec::with_capacity(32);
        self.encode_into(&mut v)?;
        Ok(v)
    }

    /// Decode one frame from the front of `buf` (see [`Request::decode`]).
    pub fn decode(buf: &[u8]) -> Decoded<Reply> {
        let Some((kind, mut r, total)) = split_frame(buf)? else {
            return Ok(None);
        };
        let msg = match kind {
            kind::HELLO_OK => Reply::HelloOk {
                request_milli: r.u16()?,
                limit_milli: r.u16()?,
                mem_limit: r.u64()?,
                mem_used: r.u64()?,
                window_ms: r.u32()?,
            },
            kind::GRANT => Reply::Grant { quota_us: r.u64()? },
            kind::MEM_VERDICT => {
                let granted = match r.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(FrameError::BadBool(b)),
                };
                Reply::MemVerdict {
                    granted,
                    used: r.u64()?,
                    limit: r.u64()?,
                }
            }
            kind::MEM_INFO => Reply::MemInfo {
                used: r.u64()?,
                limit: r.u64()?,
            },
            kind::ERROR => Reply::Error {
                code: r.u16()?,
                message: r.string()?,
            },
            kind::YIELD => Reply::Yield,
            kind::OPTIONS_OK => Reply::OptionsOk {
                busy_every: r.u32()?,
            },
            kind::SOON => Reply::Soon,
            kind::GATE => Reply::Gate,
            other => return Err(FrameError::UnknownKind(other)),
        };
        r.end()?;
        Ok(Some((msg, total)))
    }
}

/// Validate the header; returns the kind, a reader over the payload and the whole
/// frame's size, or `None` when the frame is not complete yet.
fn split_frame(buf: &[u8]) -> Result<Option<(u8, Reader<'_>, usize)>, FrameError> {
    let Some(prefix) = buf.get(..LEN_PREFIX) else {
        return Ok(None);
    };
    let len_u32 = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    let len = len_u32 as usize;
    if !(2..=MAX_FRAME_LEN).contains(&len) {
        return Err(FrameError::BadLength(len_u32));
    }
    // Check the version as soon as it arrives, so a peer speaking another
    // version is told at once rather than after a whole (maybe huge) frame.
    if let Some(&v) = buf.get(LEN_PREFIX)
        && v != VERSION
    {
        return Err(FrameError::BadVersion(v));
    }
    let total = LEN_PREFIX + len;
    let Some(body) = buf.get(LEN_PREFIX..total) else {
        return Ok(None);
    };
    let kind = body[1];
    Ok(Some((
        kind,
        Reader {
            kind,
            rest: &body[2..],
        },
        total,
    )))
}

/// Appends one frame to a buffer, patching the length prefix at the end.
struct Writer<'a> {
    out: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> Writer<'a> {
    fn start(out: &'a mut Vec<u8>, kind: u8) -> Self {
        let start = out.len();
        out.extend_from_slice(&[0, 0, 0, 0, VERSION, kind]);
        Writer { out, start }
    }
    fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn string(&mut self, s: &str) -> Result<(), FrameError> {
        if s.len() > MAX_STRING_LEN {
            // Leave `out` as it was: no half-written frame.
            self.out.truncate(self.start);
            return Err(FrameError::StringTooLong(s.len()));
        }
        self.u16(s.len() as u16);
        self.out.extend_from_slice(s.as_bytes());
        Ok(())
    }
    fn finish(self) {
        // Every payload is bounded well below MAX_FRAME_LEN (one string of at most
        // MAX_STRING_LEN plus a few fixed fields), so the cast cannot truncate.
        let len = (self.out.len() - self.start - LEN_PREFIX) as u32;
        self.out[self.start..self.start + LEN_PREFIX].copy_from_slice(&len.to_le_bytes());
    }
}

/// Reads fixed fields from a payload; every read is bounds-checked.
struct Reader<'a> {
    kind: u8,
    rest: &'a [u8],
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let Some((head, tail)) = self.rest.split_first_chunk::<N>() else {
            return Err(FrameError::Truncated { kind: self.kind });
        };
        self.rest = tail;
        Ok(*head)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let len = self.u16()? as usize;
        if len > MAX_STRING_LEN {
            return Err(FrameError::StringTooLong(len));
        }
        let Some((bytes, tail)) = self.rest.split_at_checked(len) else {
            return Err(FrameError::Truncated { kind: self.kind });
        };
        self.rest = tail;
        String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::BadUtf8)
    }
    fn end(self) -> Result<(), FrameError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(FrameError::TrailingBytes {
                kind: self.kind,
                extra: self.rest.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_layout_is_as_specified() {
        let b = Request::Hello {
            pid: 0x01020304,
            gpu_uuid: "GPU-ab".into(),
        }
        .encode()
        .unwrap();
        assert_eq!(
            b,
            vec![
                14, 0, 0, 0, 1, 1, 4, 3, 2, 1, 6, 0, b'G', b'P', b'U', b'-', b'a', b'b'
            ]
        );
    }

    #[test]
    fn renew_and_yield_layouts_are_as_specified() {
        let b = Request::Renew { burst_us: 5000 }.encode().unwrap();
        assert_eq!(b, vec![10, 0, 0, 0, 1, 7, 0x88, 0x13, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Reply::Yield.encode().unwrap(), vec![2, 0, 0, 0, 1, 68]);
        assert_eq!(
            Reply::decode(&[2, 0, 0, 0, 1, 68]),
            Ok(Some((Reply::Yield, 6)))
        );
        // A Yield with a payload is malformed, not a Yield.
        assert_eq!(
            Reply::decode(&[3, 0, 0, 0, 1, 68, 0]),
            Err(FrameError::TrailingBytes {
                kind: kind::YIELD,
                extra: 1
            })
        );
    }

    #[test]
    fn drain_layout_is_as_specified_and_has_no_reply() {
        let b = Request::Drain.encode().unwrap();
        assert_eq!(b, vec![2, 0, 0, 0, 1, 10]);
        assert_eq!(Request::decode(&b), Ok(Some((Request::Drain, 6))));
        assert!(!Request::Drain.expects_reply());
        // A Drain with a payload is malformed, not a Drain.
        assert_eq!(
            Request::decode(&[3, 0, 0, 0, 1, 10, 0]),
            Err(FrameError::TrailingBytes {
                kind: kind::DRAIN,
                extra: 1
            })
        );
    }

    #[test]
    fn an_unknown_kind_is_named_in_the_refusal_the_client_reads() {
        let e = Request::decode(&[2, 0, 0, 0, 1, 99]).unwrap_err();
        let refusal = crate::ClientError::Server {
            code: code::BAD_FRAME,
            message: e.to_string(),
        };
        assert_eq!(refusal.refused_kind(), Some(99));
        let other = crate::ClientError::Server {
            code: code::BAD_FRAME,
            message: FrameError::Truncated { kind: 8 }.to_string(),
        };
        assert_eq!(other.refused_kind(), None);
        // An older gem-schd refuses a Busy with a field it does not know as trailing bytes.
        let longer = crate::ClientError::Server {
            code: code::BAD_FRAME,
            message: FrameError::TrailingBytes { kind: 8, extra: 8 }.to_string(),
        };
        assert_eq!(longer.refused_kind(), Some(kind::BUSY));
        for odd in [
            "frame kind x has 8 trailing bytes",
            "frame kind 8 has",
            "frame kind 8",
        ] {
            let e = crate::ClientError::Server {
                code: code::BAD_FRAME,
                message: odd.into(),
            };
            assert_eq!(e.refused_kind(), None, "{odd}");
        }
    }

    #[test]
    fn busy_layout_is_as_specified() {
        let b = Request::Busy {
            busy_us: 258,
            held_us: 1000,
            earlier_us: 3,
            engine_us: None,
        }
        .encode()
        .unwrap();
        assert_eq!(
            b,
            vec![
                26, 0, 0, 0, 1, 8, 2, 1, 0, 0, 0, 0, 0, 0, 0xe8, 3, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0,
                0, 0, 0, 0
            ]
        );
        // A hook older than `earlier_us` sends two fields: read as none earlier.
        let old = [
            18, 0, 0, 0, 1, 8, 2, 1, 0, 0, 0, 0, 0, 0, 0xe8, 3, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(
            Request::decode(&old),
            Ok(Some((
                Request::Busy {
                    busy_us: 258,
                    held_us: 1000,
                    earlier_us: 0,
                    engine_us: None
                },
                old.len()
            )))
        );
        // Part of the third field is truncated.
        assert_eq!(
            Request::decode(&[
                22, 0, 0, 0, 1, 8, 2, 1, 0, 0, 0, 0, 0, 0, 0xe8, 3, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0
            ]),
            Err(FrameError::Truncated { kind: kind::BUSY })
        );
        // The engine time follows as a fourth field; part of it is truncated, a fifth refused.
        let with_engine = Request::Busy {
            busy_us: 258,
            held_us: 1000,
            earlier_us: 3,
            engine_us: Some(700),
        }
        .encode()
        .unwrap();
        assert_eq!(with_engine.len(), b.len() + 8);
        assert_eq!(&with_engine[b.len()..], &[0xbc, 2, 0, 0, 0, 0, 0, 0]);
        assert_eq!(with_engine[0], 34);
        let mut part = with_engine.clone();
        part.truncate(part.len() - 3);
        part[0] -= 3;
        assert_eq!(
            Request::decode(&part),
            Err(FrameError::Truncated { kind: kind::BUSY })
        );
        let mut long = with_engine.clone();
        long[0] += 1;
        long.push(0);
        assert_eq!(
            Request::decode(&long),
            Err(FrameError::TrailingBytes {
                kind: kind::BUSY,
                extra: 1
            })
        );
        // One field short is truncated, not a Busy of zero.
        assert_eq!(
            Request::decode(&[10, 0, 0, 0, 1, 8, 2, 1, 0, 0, 0, 0, 0, 0]),
            Err(FrameError::Truncated { kind: kind::BUSY })
        );
    }

    #[test]
    fn options_layouts_are_as_specified() {
        assert_eq!(Request::Options.encode().unwrap(), vec![2, 0, 0, 0, 1, 9]);
        let b = Reply::OptionsOk { busy_every: 32 }.encode().unwrap();
        assert_eq!(b, vec![6, 0, 0, 0, 1, 69, 32, 0, 0, 0]);
        assert_eq!(
            Reply::decode(&[5, 0, 0, 0, 1, 69, 32, 0, 0]),
            Err(FrameError::Truncated {
                kind: kind::OPTIONS_OK
            })
        );
    }

    #[test]
    fn soon_layouts_are_as_specified() {
        assert_eq!(Request::WantSoon.encode().unwrap(), vec![2, 0, 0, 0, 1, 11]);
        assert!(!Request::WantSoon.expects_reply());
        assert_eq!(Reply::Soon.encode().unwrap(), vec![2, 0, 0, 0, 1, 70]);
        assert_eq!(
            Reply::decode(&[3, 0, 0, 0, 1, 70, 0]),
            Err(FrameError::TrailingBytes {
                kind: kind::SOON,
                extra: 1
            })
        );
    }

    #[test]
    fn parks_layout_is_as_specified() {
        assert_eq!(Request::Parks.encode().unwrap(), vec![2, 0, 0, 0, 1, 13]);
        assert!(!Request::Parks.expects_reply());
        assert_eq!(
            Request::decode(&[2, 0, 0, 0, 1, 13]).unwrap(),
            Some((Request::Parks, 6))
        );
        assert_eq!(
            Request::decode(&[3, 0, 0, 0, 1, 13, 0]),
            Err(FrameError::TrailingBytes {
                kind: kind::PARKS,
                extra: 1
            })
        );
    }

    #[test]
    fn gate_layouts_are_as_specified() {
        assert_eq!(Request::WantGate.encode().unwrap(), vec![2, 0, 0, 0, 1, 12]);
        assert!(Request::WantGate.expects_reply());
        assert_eq!(Reply::Gate.encode().unwrap(), vec![2, 0, 0, 0, 1, 71]);
        assert_eq!(
            Request::decode(&[3, 0, 0, 0, 1, 12, 9]),
            Err(FrameError::TrailingBytes {
                kind: kind::WANT_GATE,
                extra: 1
            })
        );
    }

    #[test]
    fn grant_layout_is_as_specified() {
        let b = Reply::Grant { quota_us: 258 }.encode().unwrap();
        assert_eq!(b, vec![10, 0, 0, 0, 1, 65, 2, 1, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn short_input_needs_more() {
        let b = Request::TokenRequest {
            overuse_us: 5,
            burst_us: 7,
        }
        .encode()
        .unwrap();
        for cut in 0..b.len() {
            assert_eq!(Request::decode(&b[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(
            Request::decode(&b),
            Ok(Some((
                Request::TokenRequest {
                    overuse_us: 5,
                    burst_us: 7
                },
                b.len()
            )))
        );
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        assert_eq!(
            Request::decode(&[1, 0, 0, 0, 1]),
            Err(FrameError::BadLength(1))
        );
        assert_eq!(
            Request::decode(&[0, 0x20, 0, 0]),
            Err(FrameError::BadLength(0x2000))
        );
        assert_eq!(
            Request::decode(&[2, 0, 0, 0, 9]),
            Err(FrameError::BadVersion(9))
        );
        assert_eq!(
            Request::decode(&[2, 0, 0, 0, 1, 99]),
            Err(FrameError::UnknownKind(99))
        );
        // A reply kind is not a request.
        assert_eq!(
            Request::decode(&[2, 0, 0, 0, 1, kind::GRANT]),
            Err(FrameError::UnknownKind(kind::GRANT))
        );
        assert_eq!(
            Request::decode(&[3, 0, 0, 0, 1, kind::MEM_QUERY, 0]),
            Err(FrameError::TrailingBytes {
                kind: kind::MEM_QUERY,
                extra: 1
            })
        );
        assert_eq!(
            Request::decode(&[4, 0, 0, 0, 1, kind::RELEASE, 0, 0]),
            Err(FrameError::Truncated {
                kind: kind::RELEASE
            })
        );
        assert_eq!(
            Reply::decode(&[
                19,
                0,
                0,
                0,
                1,
                kind::MEM_VERDICT,
                2,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0
            ]),
            Err(FrameError::BadBool(2))
        );
    }

    #[test]
    fn bad_strings_are_typed_errors() {
        // Hello with a 2-byte string that is not UTF-8.
        let f = [10, 0, 0, 0, 1, 1, 0, 0, 0, 0, 2, 0, 0xff, 0xfe];
        assert_eq!(Request::decode(&f), Err(FrameError::BadUtf8));
        // String length beyond the payload.
        let f = [10, 0, 0, 0, 1, 1, 0, 0, 0, 0, 9, 0, b'a', b'b'];
        assert_eq!(
            Request::decode(&f),
            Err(FrameError::Truncated { kind: kind::HELLO })
        );
        let long = "x".repeat(MAX_STRING_LEN + 1);
        let mut out = vec![7];
        assert_eq!(
            Request::Hello {
                pid: 1,
                gpu_uuid: long
            }
            .encode_into(&mut out),
            Err(FrameError::StringTooLong(MAX_STRING_LEN + 1))
        );
        assert_eq!(out, vec![7], "a failed encode leaves the buffer as it was");
    }

    #[test]
    fn error_constructor_cuts_long_messages_on_char_boundary() {
        let msg = "é".repeat(MAX_STRING_LEN); // 2 bytes each
        let r = Reply::error(code::BAD_FRAME, msg);
        let Reply::Error { message, .. } = &r else {
            panic!()
        };
        assert_eq!(message.len(), MAX_STRING_LEN);
        let b = r.encode().unwrap();
        assert_eq!(Reply::decode(&b).unwrap().unwrap().0, r);
    }

    #[test]
    fn frames_decode_back_to_back() {
        let mut buf = Vec::new();
        Request::MemAlloc { bytes: 10 }
            .encode_into(&mut buf)
            .unwrap();
        Request::MemQuery.encode_into(&mut buf).unwrap();
        let (a, n) = Request::decode(&buf).unwrap().unwrap();
        assert_eq!(a, Request::MemAlloc { bytes: 10 });
        let (b, m) = Request::decode(&buf[n..]).unwrap().unwrap();
        assert_eq!(b, Request::MemQuery);
        assert_eq!(n + m, buf.len());
    }
}
