//! What the admission decision is built from, shared by [`crate::admit`] and
//! [`crate::guard`]: a refusal ([`Denial`]), the patch being built ([`Plan`]) and
//! where a container sits in the pod ([`ContainerAt`]). Kept apart so that neither of
//! those modules depends on the other for its types.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation};
use kubeshare_api::LabelError;
use serde_json::Value;

/// A refusal: the HTTP-style code and reason the apiserver reports, and the message
/// the user reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
}

impl Denial {
    /// The pod breaks a rule: fix the manifest.
    pub fn invalid(message: impl Into<String>) -> Denial {
        Denial {
            code: 422,
            reason: "Invalid",
            message: message.into(),
        }
    }
    /// The change is not allowed in the pod's current state.
    pub fn forbidden(message: impl Into<String>) -> Denial {
        Denial {
            code: 403,
            reason: "Forbidden",
            message: message.into(),
        }
    }
    /// The request itself is malformed.
    pub fn bad_request(message: impl Into<String>) -> Denial {
        Denial {
            code: 400,
            reason: "BadRequest",
            message: message.into(),
        }
    }
}

impl From<LabelError> for Denial {
    fn from(e: LabelError) -> Self {
        Denial::invalid(e.to_string())
    }
}

/// Where a container sits in the pod, for patch paths and messages.
pub(crate) struct ContainerAt {
    pub(crate) field: &'static str,
    pub(crate) index: usize,
    pub(crate) label: String,
}

impl ContainerAt {
    pub(crate) fn path<'a>(&'a self, rest: &[&'a str]) -> Vec<String> {
        let mut p = vec![
            "spec".to_string(),
            self.field.to_string(),
            self.index.to_string(),
        ];
        p.extend(rest.iter().map(|s| s.to_string()));
        p
    }
}

/// The patch being built, plus warnings for the user.
#[derive(Default)]
pub(crate) struct Plan {
    pub(crate) ops: Vec<PatchOperation>,
    pub(crate) warnings: Vec<String>,
}

impl Plan {
    pub(crate) fn add<S: AsRef<str>>(&mut self, path: &[S], value: Value) {
        self.ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(path.iter().map(|s| s.as_ref())),
            value,
        }));
    }

    /// Appends `items` to the array at `path`, creating it when `exists` is false.
    pub(crate) fn append<S: AsRef<str>>(&mut self, path: &[S], exists: bool, items: Vec<Value>) {
        if items.is_empty() {
            return;
        }
        if exists {
            for item in items {
                let mut p: Vec<&str> = path.iter().map(|s| s.as_ref()).collect();
                p.push("-");
                self.add(&p, item);
            }
        } else {
            self.add(path, Value::Array(items));
        }
    }
}

pub(crate) fn to_value<T: serde::Serialize>(t: &T) -> Value {
    // Serializing k8s-openapi types to a Value cannot fail (string keys, no floats).
    serde_json::to_value(t).unwrap_or(Value::Null)
}
