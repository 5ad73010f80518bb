//! libgemhook.so.1: loaded with LD_PRELOAD into a KubeShare pod's processes, it makes the pod's
//! GPU share real. Kernel launches are gated on gem-schd's token, device memory is capped at the
//! pod's budget, and the memory queries (CUDA's and NVML's) report that budget. See
//! `docs/hook.md`.
//!
//! Outside a KubeShare pod (no socket directory) it is inert: every call passes through.

// `real!` forwards a wrapper's own arguments to the driver inside `unsafe`: that is its job.
#![allow(clippy::macro_metavars_in_unsafe)]

pub mod ahead;
pub mod busy;
pub mod clock;
pub mod config;
pub mod connect;
pub mod cupti;
pub mod device;
pub mod engine;
pub mod exports;
pub mod gate;
pub mod idle;
pub mod log;
pub mod memory;
pub mod nvml;
pub mod pace;
pub mod park;
pub mod procaddr;
pub mod real;
pub mod state;
pub mod timing;
pub mod um;
