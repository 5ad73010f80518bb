//! CDI (Container Device Interface) support: the node daemon writes a spec of kind
//! `kubeshare.io/gpu` so that a CDI-enabled runtime (containerd 1.7+ with `enable_cdi`,
//! CRI-O) can give a container a GPU, its control nodes, the driver's libraries and
//! KubeShare's hook when the container asks for `kubeshare.io/gpu=<index or UUID>`
//! (docs/node.md, "CDI").
//!
//! [`spec`] is the file format, [`generate`] the pure spec of a node, [`host`] the I/O.

pub mod generate;
pub mod host;
pub mod spec;
