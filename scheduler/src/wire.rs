//! The kube-scheduler extender wire format (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs carry no json tags, so the scheduler sends PascalCase keys;
//! serde matches case exactly, hence the renames. Lower/camel-case aliases are
//! accepted because pre-1.17 extenders and hand-written requests use them.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::convert::WirePod;

/// Filter and prioritize request. With `nodeCacheCapable: true` only
/// `NodeNames` is set; otherwise `Nodes` holds full Node objects.
#[derive(Debug, Clone, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod", alias = "pod")]
    pub pod: Option<WirePod>,
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default
    )]
    pub node_names: Option<Vec<String>>,
}

/// A v1.NodeList, items kept verbatim so a filter reply can echo them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<serde_json::Value>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

impl NodeList {
    fn name_of(item: &serde_json::Value) -> Option<&str> {
        item.get("metadata")?.get("name")?.as_str()
    }
}

impl ExtenderArgs {
    /// The candidate node names, whichever form the scheduler used (borrowed
    /// when they came as names: a large cluster sends 10,000 per call).
    pub fn candidate_names(&self) -> Cow<'_, [String]> {
        if let Some(n) = &self.node_names {
            return Cow::Borrowed(n);
        }
        Cow::Owned(
            self.nodes
                .as_ref()
                .map(|l| {
                    l.items
                        .iter()
                        .filter_map(NodeList::name_of)
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
        )
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", alias = "nodenames", default)]
    pub node_names: Option<Vec<String>>,
    #[serde(rename = "FailedNodes", alias = "failedNodes", default)]
    pub failed_nodes: BTreeMap<String, String>,
    #[serde(
        rename = "FailedAndUnresolvableNodes",
        alias = "failedAndUnresolvableNodes",
        default
    )]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error", alias = "error", default)]
    pub error: String,
}

impl PartialEq for NodeList {
    fn eq(&self, o: &Self) -> bool {
        self.items == o.items && self.rest == o.rest
    }
}

impl ExtenderFilterResult {
    /// Answers in the form the request used: names for names, Nodes for Nodes.
    pub fn passing(args: &ExtenderArgs, passed: Vec<String>) -> ExtenderFilterResult {
        let mut r = ExtenderFilterResult::default();
        if args.node_names.is_some() || args.nodes.is_none() {
            r.node_names = Some(passed);
        } else if let Some(l) = &args.nodes {
            let keep: std::collections::HashSet<&str> = passed.iter().map(String::as_str).collect();
            r.nodes = Some(NodeList {
                items: l
                    .items
                    .iter()
                    .filter(|i| NodeList::name_of(i).is_some_and(|n| keep.contains(n)))
                    .cloned()
                    .collect(),
                rest: l.rest.clone(),
            });
        }
        r
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostPriority {
    #[serde(rename = "Host", alias = "host")]
    pub host: String,
    #[serde(rename = "Score", alias = "score")]
    pub score: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName", alias = "podName")]
    pub pod_name: String,
    #[serde(rename = "PodNamespace", alias = "podNamespace")]
    pub pod_namespace: String,
    #[serde(rename = "PodUID", alias = "podUID", alias = "podUid")]
    pub pod_uid: String,
    #[serde(rename = "Node", alias = "node")]
    pub node: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", alias = "error", default)]
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_the_scheduler_request_with_node_names() {
        let j = r#"{"Pod":{"metadata":{"name":"p","namespace":"d","uid":"u"}},"Nodes":null,"NodeNames":["a","b"]}"#;
        let a: ExtenderArgs = serde_json::from_str(j).unwrap();
        assert_eq!(a.candidate_names().as_ref(), ["a", "b"]);
        let r = ExtenderFilterResult::passing(&a, vec!["b".to_string()]);
        let out = serde_json::to_value(&r).unwrap();
        assert_eq!(out["NodeNames"], serde_json::json!(["b"]));
        assert_eq!(out["Nodes"], serde_json::Value::Null);
        assert!(out.get("FailedNodes").is_some() && out.get("Error").is_some());
    }

    #[test]
    fn echoes_full_nodes_when_sent_full_nodes() {
        let j = r#"{"Pod":{},"Nodes":{"items":[{"metadata":{"name":"a"}},{"metadata":{"name":"b"}}]},"NodeNames":null}"#;
        let a: ExtenderArgs = serde_json::from_str(j).unwrap();
        assert_eq!(a.candidate_names().as_ref(), ["a", "b"]);
        let r = ExtenderFilterResult::passing(&a, vec!["a".to_string()]);
        assert!(r.node_names.is_none());
        assert_eq!(r.nodes.unwrap().items.len(), 1);
    }

    #[test]
    fn binding_args_and_priorities_use_pascal_case() {
        let b: ExtenderBindingArgs =
            serde_json::from_str(r#"{"PodName":"p","PodNamespace":"d","PodUID":"u","Node":"n"}"#)
                .unwrap();
        assert_eq!(b.node, "n");
        let h = serde_json::to_string(&HostPriority {
            host: "n".into(),
            score: 7,
        })
        .unwrap();
        assert_eq!(h, r#"{"Host":"n","Score":7}"#);
        assert!(serde_json::from_str::<ExtenderBindingArgs>(r#"{"PodName":1}"#).is_err());
    }
}
