//! gem-schd: the per-GPU token scheduler of KubeShare (Gemini's algorithm, improved).
//!
//! [`core`] is the pure scheduling state machine (no I/O, time passed in); [`config`]
//! turns the resource-config file into client specs and socket paths. The tokio server
//! around the core (sockets, reload, signals) lives in the `gem-schd` binary; the
//! `gem-share` binary runs gem-schd and commands without Kubernetes.

pub mod config;
pub mod core;
pub mod launch;
pub mod usage;
