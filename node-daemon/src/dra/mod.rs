//! KubeShare's DRA driver on the node (`gpu.kubeshare.io`, `resource.k8s.io/v1`): the
//! node's GPUs published as one ResourceSlice, each GPU a device that many claims share
//! through consumable capacity (`compute` in thousandths, `memory` in bytes), so that the
//! stock kube-scheduler places ResourceClaims on GPU shares. On behind `--dra`.
//!
//! [`slice`] builds the slice from the inventory and decides what to send (pure);
//! [`publish`] reads and writes the API. The kubelet plugin (NodePrepareResources with
//! CDI) is not built yet: see docs/dra.md.

pub mod publish;
pub mod slice;

pub use publish::{PublishError, Published, publish, run};
