//! KubeShare's DRA driver on the node (`gpu.kubeshare.io`, `resource.k8s.io/v1`), on
//! behind `--dra`:
//! - the node's GPUs published as one ResourceSlice, each GPU a device that many claims
//!   share through consumable capacity (`compute` in thousandths, `memory` in bytes), so
//!   that the stock kube-scheduler places ResourceClaims on GPU shares, each device's
//!   capacities being what the label pods on the GPU leave: [`slice`] builds it and
//!   decides what to send (pure), [`publish`] reads and writes the API;
//! - the kubelet plugin that hands a claimed share to a container: [`claim`] works out a
//!   claim's shares and [`cdi`] its CDI spec (both pure), [`checkpoint`] keeps the
//!   prepared claims across restarts, [`book`] shares them with the daemon's loop, which
//!   writes them into gem-schd's configs, and [`plugin`] serves the kubelet.
//!
//! See docs/dra.md.

pub mod book;
pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod plugin;
pub mod publish;
pub mod slice;

pub use publish::{PublishError, Published, publish, run};
