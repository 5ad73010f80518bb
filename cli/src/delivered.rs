//! The delivered shares the node daemons export (`kubeshare_pod_gpu_delivered_share`:
//! gem-schd's token time per pod over its window), read from their `/metrics` so the
//! table can show what each pod got next to what it asked for ([`read`], through the
//! apiserver's pod proxy; the real-node tests read them the same way). Parsing is pure.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};

/// (namespace, pod, GPU UUID) → share of the GPU's time delivered, in [0, 1].
pub type Delivered = BTreeMap<(String, String, String), f64>;

const METRIC: &str = "kubeshare_pod_gpu_delivered_share{";

/// The delivered shares in one `/metrics` text; other lines are ignored, and so is a
/// line that does not read as this metric with its three labels.
pub fn parse(text: &str) -> Delivered {
    let mut out = Delivered::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(METRIC) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let (mut ns, mut pod, mut gpu) = (None, None, None);
        for pair in split_labels(labels) {
            match pair {
                ("namespace", v) => ns = Some(v),
                ("pod", v) => pod = Some(v),
                ("gpu_uuid", v) => gpu = Some(v),
                _ => {}
            }
        }
        if let (Some(ns), Some(pod), Some(gpu)) = (ns, pod, gpu) {
            out.insert((ns, pod, gpu), v.clamp(0.0, 1.0));
        }
    }
    out
}

/// `k="v",k2="v2"` → pairs (values unescaped). Kubernetes names hold no quotes, but
/// escapes are honoured so a strange value cannot shift the others.
fn split_labels(s: &str) -> Vec<(&str, String)> {
    let mut out = vec![];
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, e)) = chars.next() {
                        value.push(if e == 'n' { '\n' } else { e });
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let Some(end) = end else { break };
        out.push((key.trim_start_matches(','), value));
        rest = &after[end + 1..];
    }
    out
}

/// Where the node daemons run, and the port of their /metrics.
pub const KUBESHARE_NS: &str = "kubeshare-system";
pub const NODE_DAEMON_SELECTOR: &str = "app.kubernetes.io/name=kubeshare-node-daemon";
pub const METRICS_PORT: u16 = 9477;

/// Delivered shares from every node daemon that answers within a few seconds. Best
/// effort: without the rights (pods/proxy in kubeshare-system) or with a daemon down,
/// the table is shown without them.
pub async fn read(client: &Client) -> Delivered {
    let daemons: Api<Pod> = Api::namespaced(client.clone(), KUBESHARE_NS);
    let list = match daemons
        .list(&ListParams::default().labels(NODE_DAEMON_SELECTOR))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            tracing::debug!(error = %e, "cannot list the node daemons; no delivered shares");
            return Default::default();
        }
    };
    let fetches = list
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .map(|name| {
            let client = client.clone();
            async move {
                let req = http::Request::get(format!(
                    "/api/v1/namespaces/{KUBESHARE_NS}/pods/{name}:{METRICS_PORT}/proxy/metrics"
                ))
                .body(Vec::new())
                .ok()?;
                match tokio::time::timeout(Duration::from_secs(3), client.request_text(req)).await {
                    Ok(Ok(text)) => Some(parse(&text)),
                    Ok(Err(e)) => {
                        tracing::debug!(daemon = %name, error = %e, "metrics unreadable");
                        None
                    }
                    Err(_) => {
                        tracing::debug!(daemon = %name, "metrics timed out");
                        None
                    }
                }
            }
        });
    futures::future::join_all(fetches)
        .await
        .into_iter()
        .flatten()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_metric_and_nothing_else() {
        let text = "# TYPE kubeshare_pod_gpu_delivered_share gauge\n\
            kubeshare_pod_gpu_delivered_share{namespace=\"ml\",pod=\"train\",gpu_uuid=\"GPU-1\"} 0.482\n\
            kubeshare_pod_gpu_request_share{namespace=\"ml\",pod=\"train\",gpu_uuid=\"GPU-1\"} 0.5\n\
            kubeshare_pod_gpu_delivered_share{namespace=\"ml\",pod=\"x\"} 0.3\n\
            kubeshare_pod_gpu_delivered_share{namespace=\"a\\\"b\",pod=\"p\",gpu_uuid=\"G\"} 1.5\n\
            kubeshare_pod_gpu_delivered_share{namespace=\"ml\",pod=\"nan\",gpu_uuid=\"G\"} NaN\n\
            kubeshare_pod_gpu_delivered_share{garbage\n# EOF\n";
        let d = parse(text);
        assert_eq!(d.len(), 2, "{d:?}");
        assert_eq!(d[&("ml".into(), "train".into(), "GPU-1".into())], 0.482);
        // Escapes read, values clamped to a share.
        assert_eq!(d[&("a\"b".into(), "p".into(), "G".into())], 1.0);
    }
}
