//! gem-schd wire protocol v1, shared by gem-schd and libgemhook.
//!
//! The full specification is `PROTOCOL.md` in this crate (included below). This crate
//! holds the frames ([`Request`], [`Reply`]), their encoder, a decoder that never panics,
//! and a small blocking [`Client`] over `std::os::unix::net::UnixStream`. It has no
//! heavy dependencies because the hook, a cdylib inside CUDA programs, links it.
//!
#![doc = include_str!("../PROTOCOL.md")]

pub mod client;
pub mod frame;
pub mod gate;

pub use client::{
    Client, ClientError, DEFAULT_SOCKET_DIR, HelloInfo, MemVerdict, SOCKET_DIR_ENV, Wait,
    socket_path,
};
pub use frame::{
    Decoded, FrameError, LEN_PREFIX, MAX_FRAME_LEN, MAX_STRING_LEN, Reply, Request, VERSION, code,
    kind,
};
pub use gate::GatePage;
