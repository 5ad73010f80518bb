//! KubeShare's scheduler extender.
//!
//! A second kube-scheduler (profile `kubeshare-scheduler`) calls this HTTP
//! extender with `filter`, `prioritize` and `bind`; it decides which node and
//! which GPU(s) each KubeShare pod gets and writes that choice on the pod as the
//! `sharedgpu/*` allocation annotations before it creates the Binding.
//!
//! - [`placement`]: the pure decision logic and the books (no I/O).
//! - [`convert`]: Kubernetes objects to what placement needs (pure).
//! - [`wire`]: the upstream extender JSON shapes.
//! - [`metrics`]: Prometheus text exposition.
//! - [`server`]: the axum routes and the shared state.
//! - `bind`: bind's task: the record and the node in one Binding, single flight.
//! - `backpressure`: the filter holds new pods while API calls queue too long.
//! - [`tasks`]: the watches that feed the books and the timer, supervised.

mod backpressure;
mod bind;
pub mod convert;
pub mod metrics;
pub mod placement;
pub mod ratelimit;
pub mod server;
pub mod tasks;
pub mod um_fit;
pub mod wire;

pub use placement::{BindStep, Cluster, Config, PodInfo};
pub use server::{Extender, ExtenderOptions, Timing, TlsFiles, serve};
