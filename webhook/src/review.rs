//! AdmissionReview v1 on the wire: parse the apiserver's request, answer with the
//! verdict (a base64 JSON Patch, `patchType: JSONPatch`, or a denial status).
//!
//! Our own structs rather than kube-rs's: kube serializes `patch` as an array of
//! numbers (kube-rs issue #1781), and a malformed envelope must become an HTTP 400,
//! not a panic or an answer with a made-up uid.

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::admit::{AdmitOptions, Operation, Verdict, admit_pod_with};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

/// Why a body could not be answered (the server replies HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("body is not an AdmissionReview: {0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported AdmissionReview {api_version}/{kind}: only {API_VERSION} {KIND}")]
    Version { api_version: String, kind: String },
    #[error("AdmissionReview has no request")]
    NoRequest,
    #[error("AdmissionReview request has an empty uid")]
    NoUid,
    #[error("unknown operation {0:?}")]
    Operation(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewIn {
    api_version: String,
    kind: String,
    request: Option<RequestIn>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Gvk {
    #[serde(default)]
    pub group: String,
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub kind: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RequestIn {
    uid: String,
    #[serde(default)]
    kind: Gvk,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    name: Option<String>,
    operation: String,
    /// `ephemeralcontainers` for a debug container added to a running pod.
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    object: Option<Value>,
    #[serde(default)]
    old_object: Option<Value>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ReviewOut<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: ResponseOut<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResponseOut<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<StatusOut<'a>>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

#[derive(Serialize)]
struct StatusOut<'a> {
    code: u16,
    reason: &'static str,
    message: &'a str,
}

/// Which endpoint answers: `/mutate` returns the patch, `/validate` only the verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Mutate,
    Validate,
}

/// A request answered, with what a log line needs.
#[derive(Debug)]
pub struct Answer {
    /// The AdmissionReview JSON to send back.
    pub body: Vec<u8>,
    pub uid: String,
    pub operation: String,
    pub namespace: String,
    pub name: String,
    pub kind: String,
    pub verdict: Verdict,
}

/// Answers one AdmissionReview body with the default [`AdmitOptions`].
pub fn answer(body: &[u8], mode: Mode) -> Result<Answer, ReviewError> {
    answer_with(body, mode, &AdmitOptions::default())
}

/// Answers one AdmissionReview body, admission configured by `opts`.
pub fn answer_with(body: &[u8], mode: Mode, opts: &AdmitOptions) -> Result<Answer, ReviewError> {
    let review: ReviewIn = serde_json::from_slice(body)?;
    if review.api_version != API_VERSION || review.kind != KIND {
        return Err(ReviewError::Version {
            api_version: review.api_version,
            kind: review.kind,
        });
    }
    let req = review.request.ok_or(ReviewError::NoRequest)?;
    if req.uid.is_empty() {
        return Err(ReviewError::NoUid);
    }
    let op = Operation::parse(&req.operation)
        .ok_or_else(|| ReviewError::Operation(req.operation.clone()))?;
    let is_pod = req.kind.group.is_empty() && req.kind.kind == "Pod";
    let mut verdict = if is_pod {
        admit_pod_with(
            opts,
            op,
            req.sub_resource.as_deref(),
            req.object.as_ref(),
            req.old_object.as_ref(),
        )
    } else {
        // Only Pods are registered; anything else is let through unchanged.
        Verdict::Allow {
            patch: Vec::new(),
            warnings: Vec::new(),
        }
    };
    if mode == Mode::Validate
        && let Verdict::Allow { patch, .. } = &mut verdict
    {
        patch.clear();
    }
    let body = render(&req.uid, &verdict);
    Ok(Answer {
        body,
        uid: req.uid,
        operation: req.operation,
        namespace: req.namespace.unwrap_or_default(),
        name: req.name.unwrap_or_default(),
        kind: req.kind.kind,
        verdict,
    })
}

/// The AdmissionReview response for `verdict`.
pub fn render(uid: &str, verdict: &Verdict) -> Vec<u8> {
    let response = match verdict {
        Verdict::Allow { patch, warnings } => {
            let patch = (!patch.is_empty()).then(|| {
                // A Vec of patch operations always serializes.
                let json = serde_json::to_vec(patch).unwrap_or_default();
                base64::engine::general_purpose::STANDARD.encode(json)
            });
            ResponseOut {
                uid,
                allowed: true,
                patch_type: patch.as_ref().map(|_| "JSONPatch"),
                patch,
                status: None,
                warnings,
            }
        }
        Verdict::Deny(d) => ResponseOut {
            uid,
            allowed: false,
            patch_type: None,
            patch: None,
            status: Some(StatusOut {
                code: d.code,
                reason: d.reason,
                message: &d.message,
            }),
            warnings: &[],
        },
    };
    let out = ReviewOut {
        api_version: API_VERSION,
        kind: KIND,
        response,
    };
    // Strings, bools and integers only: serialization cannot fail.
    serde_json::to_vec(&out).unwrap_or_default()
}

/// Builds an AdmissionReview request body (tests and the benchmark).
pub fn request_body(
    uid: &str,
    operation: &str,
    namespace: &str,
    object: Option<&Value>,
    old_object: Option<&Value>,
) -> Vec<u8> {
    request_body_sub(uid, operation, None, namespace, object, old_object)
}

/// [`request_body`] for a subresource (`ephemeralcontainers`).
pub fn request_body_sub(
    uid: &str,
    operation: &str,
    sub_resource: Option<&str>,
    namespace: &str,
    object: Option<&Value>,
    old_object: Option<&Value>,
) -> Vec<u8> {
    let mut v = serde_json::json!({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": object.and_then(|o| o.pointer("/metadata/name")).cloned().unwrap_or(Value::from("")),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "kubeshare-test"},
            "object": object,
            "oldObject": old_object,
            "dryRun": false,
        }
    });
    if let Some(sub) = sub_resource {
        v["request"]["subResource"] = Value::from(sub);
        v["request"]["requestSubResource"] = Value::from(sub);
    }
    serde_json::to_vec(&v).unwrap_or_default()
}
