//! Placeholder: this crate arrives with its own issue.
