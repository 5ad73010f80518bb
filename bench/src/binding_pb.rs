//! A `pods/binding` body in Kubernetes' protobuf encoding, the one kube-scheduler
//! itself sends, for `binding-bench`: does the apiserver spend less on a Binding
//! in protobuf than on the extender's JSON one? (Measured: no, docs/extender.md, "At scale";
//! so the extender sends JSON through kube-rs.) Pure bytes, no I/O.
//!
//! The wire: the 4-byte magic `k8s\0`, then a `runtime.Unknown` whose `typeMeta`
//! is `v1`/`Binding` and whose `raw` is the `Binding` message. Field numbers are
//! those of `k8s.io/api/core/v1/generated.proto` and
//! `k8s.io/apimachinery/pkg/{apis/meta/v1,runtime}/generated.proto`.

use std::collections::BTreeMap;

/// The content type to send the body with.
pub const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

const MAGIC: &[u8; 4] = b"k8s\0";

/// What a Binding says: this pod (by name, namespace, uid and, when known, the
/// resourceVersion the decision was made from) goes to `node`, with these
/// annotations copied onto the pod.
#[derive(Debug, Clone, Copy)]
pub struct BindingSpec<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub uid: &'a str,
    pub resource_version: Option<&'a str>,
    pub annotations: Option<&'a BTreeMap<String, String>>,
    pub node: &'a str,
}

/// The path to POST the Binding to; `None` unless the namespace and the name are
/// Kubernetes names (lowercase letters, digits, `-` and `.`), so that nothing a
/// caller of the extender sends can steer the request to another path.
pub fn path(namespace: &str, name: &str) -> Option<String> {
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && s != "."
            && s != ".."
    };
    (valid(namespace) && valid(name))
        .then(|| format!("/api/v1/namespaces/{namespace}/pods/{name}/binding"))
}

/// The request body for `POST /api/v1/namespaces/{ns}/pods/{name}/binding`.
pub fn encode(b: &BindingSpec<'_>) -> Vec<u8> {
    let mut meta = Vec::with_capacity(128);
    put_str(&mut meta, 1, b.name);
    put_str(&mut meta, 3, b.namespace);
    put_str(&mut meta, 5, b.uid);
    if let Some(rv) = b.resource_version {
        put_str(&mut meta, 6, rv);
    }
    for (k, v) in b.annotations.into_iter().flatten() {
        let mut entry = Vec::with_capacity(k.len() + v.len() + 4);
        put_str(&mut entry, 1, k);
        put_str(&mut entry, 2, v);
        put_bytes(&mut meta, 12, &entry);
    }
    let mut target = Vec::with_capacity(b.node.len() + 16);
    put_str(&mut target, 1, "Node");
    put_str(&mut target, 3, b.node);
    put_str(&mut target, 5, "v1");

    let mut binding = Vec::with_capacity(meta.len() + target.len() + 8);
    put_bytes(&mut binding, 1, &meta);
    put_bytes(&mut binding, 2, &target);

    let mut type_meta = Vec::with_capacity(16);
    put_str(&mut type_meta, 1, "v1");
    put_str(&mut type_meta, 2, "Binding");

    let mut out = Vec::with_capacity(binding.len() + type_meta.len() + 16);
    out.extend_from_slice(MAGIC);
    put_bytes(&mut out, 1, &type_meta);
    put_bytes(&mut out, 2, &binding);
    out
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2): strings, bytes, messages, map entries.
fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, u64::from(field) << 3 | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_str(out: &mut Vec<u8>, field: u32, s: &str) {
    put_bytes(out, field, s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal reader of length-delimited fields, for the tests only.
    fn fields(mut b: &[u8]) -> Vec<(u32, &[u8])> {
        let varint = |b: &mut &[u8]| {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let (&x, rest) = b.split_first().expect("truncated varint");
                *b = rest;
                v |= u64::from(x & 0x7f) << shift;
                if x < 0x80 {
                    return v;
                }
                shift += 7;
            }
        };
        let mut out = Vec::new();
        while !b.is_empty() {
            let key = varint(&mut b);
            assert_eq!(key & 7, 2, "only length-delimited fields are written");
            let len = varint(&mut b) as usize;
            out.push(((key >> 3) as u32, &b[..len]));
            b = &b[len..];
        }
        out
    }

    fn one<'a>(f: &[(u32, &'a [u8])], n: u32) -> &'a [u8] {
        let all: Vec<_> = f.iter().filter(|(k, _)| *k == n).collect();
        assert_eq!(all.len(), 1, "field {n}");
        all[0].1
    }

    #[test]
    fn a_binding_reads_back_field_by_field() {
        let ann: BTreeMap<String, String> = [
            ("sharedgpu/allocation".to_string(), "{\"v\":1}".to_string()),
            ("b".to_string(), "x".repeat(300)),
        ]
        .into();
        let body = encode(&BindingSpec {
            name: "p",
            namespace: "ns",
            uid: "u-1",
            resource_version: Some("42"),
            annotations: Some(&ann),
            node: "node-7",
        });
        assert_eq!(&body[..4], b"k8s\0");
        let unknown = fields(&body[4..]);
        let tm = fields(one(&unknown, 1));
        assert_eq!((one(&tm, 1), one(&tm, 2)), (&b"v1"[..], &b"Binding"[..]));
        let binding = fields(one(&unknown, 2));
        let meta = fields(one(&binding, 1));
        assert_eq!(one(&meta, 1), b"p");
        assert_eq!(one(&meta, 3), b"ns");
        assert_eq!(one(&meta, 5), b"u-1");
        assert_eq!(one(&meta, 6), b"42");
        let entries: BTreeMap<String, String> = meta
            .iter()
            .filter(|(k, _)| *k == 12)
            .map(|(_, e)| {
                let e = fields(e);
                let s = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
                (s(one(&e, 1)), s(one(&e, 2)))
            })
            .collect();
        assert_eq!(entries, ann, "a 300-byte value needs a two-byte length");
        let target = fields(one(&binding, 2));
        assert_eq!(one(&target, 1), b"Node");
        assert_eq!(one(&target, 3), b"node-7");
        assert_eq!(one(&target, 5), b"v1");
    }

    #[test]
    fn only_kubernetes_names_make_a_path() {
        assert_eq!(
            path("ns-1", "web-0.a").as_deref(),
            Some("/api/v1/namespaces/ns-1/pods/web-0.a/binding")
        );
        for (ns, name) in [
            ("ns", "../../secrets"),
            ("ns", "a/b"),
            ("ns", "a?dryRun=All"),
            ("ns", ".."),
            ("", "p"),
            ("NS", "p"),
            ("ns", "p%2f"),
        ] {
            assert_eq!(path(ns, name), None, "{ns}/{name}");
        }
    }

    #[test]
    fn no_resource_version_and_no_annotations_leave_their_fields_out() {
        let body = encode(&BindingSpec {
            name: "p",
            namespace: "ns",
            uid: "u",
            resource_version: None,
            annotations: None,
            node: "n",
        });
        let binding = fields(one(&fields(&body[4..]), 2));
        let meta = fields(one(&binding, 1));
        assert!(meta.iter().all(|(k, _)| ![6, 12].contains(k)));
    }
}
