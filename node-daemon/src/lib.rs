//! KubeShare's node daemon: discovers the node's GPUs (NVML, or a fake inventory file),
//! publishes them on its Node, turns the pods bound to the node into one Gemini
//! resource-config per GPU plus a directory per pod, and supervises one gem-schd per GPU.
//!
//! The API server is the only source of truth (no Prometheus bus, no port pool): the
//! allocation annotations the extender writes at bind say which pod holds which GPU.
//! Decisions are pure ([`reconcile`], [`node`], [`metrics`]); the rest is I/O.

pub mod cdi;
pub mod daemon;
pub mod disk;
pub mod dra;
pub mod guard;
pub mod held;
pub mod http;
pub mod metrics;
pub mod node;
pub mod nvml;
pub mod pods;
pub mod reconcile;
pub mod source;
pub mod supervisor;
