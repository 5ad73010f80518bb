//! `kubectl sharedgpu`: a read-only view of KubeShare's GPU allocations.
//!
//! [`model::build`] turns Node and Pod objects into a [`model::ClusterView`];
//! [`render::render`] draws it. Both are pure, so the table is tested without a
//! cluster; `main.rs` only lists the objects (and reads the node daemons' metrics
//! for [`delivered`] shares).

pub mod delivered;
pub mod model;
pub mod render;

use k8s_openapi::api::core::v1::{Node, Pod};

pub use render::RenderOptions;

/// The table for these nodes and pods.
pub fn render_table(nodes: &[Node], pods: &[Pod], opts: RenderOptions) -> String {
    render::render(&model::build(nodes, pods), opts)
}
