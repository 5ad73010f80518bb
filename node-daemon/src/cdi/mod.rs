//! CDI (Container Device Interface) support: the node daemon writes a spec of kind
//! `kubeshare.io/gpu` so that a CDI-enabled runtime (containerd 1.7+ with `enable_cdi`,
//! CRI-O) can give a container a GPU, its control nodes, the driver's libraries and
//! KubeShare's hook directory, and runs the device plugin for the resource
//! `kubeshare.io/gpu` through which the kubelet asks for `kubeshare.io/gpu=<UUID>` on
//! behalf of each container of a KubeShare pod (docs/node.md, "CDI").
//!
//! [`spec`] is the file format, [`generate`] the pure spec of a node, [`host`] its I/O;
//! [`select`] is the device plugin's pure decision, [`plugin`] its gRPC server.

pub mod generate;
pub mod host;
pub mod plugin;
pub mod select;
pub mod spec;
