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
//! - [`state`]: the state the routes, bind and the background tasks share.
//! - [`server`]: the axum routes and serving.
//! - `binding`: bind's task: the record and the node in one Binding, single flight.
//! - [`claims`]: what ResourceClaims of the DRA driver hold of each GPU (pure).
//! - `api`: one API call, with a permit and retries until a deadline.
//! - [`error`]: what an API call or a bind answers when it fails.
//! - `backpressure`: the filter holds new pods while API calls queue too long.
//! - `preemption`: a guaranteed pod's preemption carried out (evictions, events).
//! - [`tasks`]: the watches that feed the books and the timer, supervised.

mod api;
mod backpressure;
mod binding;
pub mod claims;
pub mod convert;
pub mod error;
pub mod metrics;
pub mod placement;
mod preemption;
pub mod ratelimit;
pub mod server;
pub mod state;
pub mod tasks;
pub mod um_fit;
pub mod wire;

pub use placement::{BindStep, Cluster, Config, PodInfo};
pub use server::{Extender, ExtenderOptions, TlsFiles, serve};
pub use state::Timing;
