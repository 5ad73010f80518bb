//! KubeShare's mutating admission webhook.
//!
//! [`admit`] decides (validation through the API crate, and the JSON Patch that gives a
//! KubeShare pod its GPU env, hook and volumes), [`review`] speaks AdmissionReview v1,
//! [`server`] serves it over rustls with certificate reload, and [`certs`] makes the
//! CA and serving certificate. What is injected is listed in [`inject`]; what keeps
//! GPUs away from containers KubeShare gives none to is in [`guard`]; what keeps pods
//! out of KubeShare's host directory is in [`hostdir`].

pub mod admit;
pub mod certs;
pub mod guard;
pub mod hostdir;
pub mod inject;
pub mod metrics;
mod plan;
pub mod review;
pub mod server;

pub use admit::{Denial, Operation, Verdict, admit_pod};
