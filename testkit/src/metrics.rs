//! Prometheus metrics of the rig's control plane: `GET /metrics` from the apiserver or from a
//! kube-scheduler's secure port, and the few parsers the tests and benchmarks read them with.

use std::path::Path;

use crate::error::{Error, Result};

/// `GET /metrics` through `client` (the apiserver, or a kube-scheduler's secure port,
/// [`scheduler_client`]); `what` names it in the error.
pub async fn metrics_text(client: &kube::Client, what: &str) -> Result<String> {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .map_err(|e| Error::Other(format!("building the metrics request: {e}")))?;
    client
        .request_text(req)
        .await
        .map_err(|e| Error::Other(format!("reading {what}'s /metrics: {e}")))
}

/// A client of the kube-scheduler serving on `127.0.0.1:port`, as the user of `kubeconfig`
/// (the scheduler authenticates it and asks the apiserver whether it may read /metrics). The
/// scheduler's serving certificate is self-signed, so it is not verified.
pub async fn scheduler_client(kubeconfig: &Path, port: u16) -> Result<kube::Client> {
    let mut cfg = crate::cluster::config_from_kubeconfig(kubeconfig).await?;
    cfg.cluster_url = format!("https://127.0.0.1:{port}")
        .parse()
        .map_err(|e| Error::Other(format!("the scheduler's URL: {e}")))?;
    cfg.root_cert = None;
    cfg.accept_invalid_certs = true;
    Ok(kube::Client::try_from(cfg)?)
}

/// A Prometheus text line of the series `name`: its labels (`k="v",...`, empty when it has
/// none) and its value; `None` for other series, comments and malformed lines.
pub fn sample<'a>(line: &'a str, name: &str) -> Option<(&'a str, f64)> {
    let rest = line.strip_prefix(name)?;
    let (labels, value) = match rest.strip_prefix('{') {
        Some(r) => r.rsplit_once("} ")?,
        None => ("", rest.strip_prefix(' ')?),
    };
    Some((labels, value.trim().parse().ok()?))
}

/// The value of label `k` in a sample's label text (`a="x",b="y"`), or "".
pub fn label<'a>(labels: &'a str, k: &str) -> &'a str {
    labels
        .split(',')
        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix("=\""))
        .map(|v| v.trim_end_matches('"'))
        .unwrap_or("")
}

/// The sum of the series `name`'s samples whose label text (`a="x",b="y"`) `keep` accepts; 0
/// when none is (a counter not incremented yet is not exposed).
pub fn sum_where(text: &str, name: &str, keep: impl Fn(&str) -> bool) -> f64 {
    text.lines()
        .filter_map(|line| sample(line, name))
        .filter(|(labels, _)| keep(labels))
        .fold(0.0, |sum, (_, v)| sum + v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_summed_by_their_labels() {
        let text = "\
# HELP scheduler_queue_incoming_pods_total Number of pods added to scheduling queues.
# TYPE scheduler_queue_incoming_pods_total counter
scheduler_queue_incoming_pods_total{event=\"PodAdd\",queue=\"active\"} 12
scheduler_queue_incoming_pods_total{event=\"ResourceSliceUpdate\",queue=\"active\"} 2
scheduler_queue_incoming_pods_total{event=\"resource.k8s.io/ResourceSliceUpdate\",queue=\"backoff\"} 3
scheduler_queue_incoming_pods_total_other{event=\"ResourceSliceUpdate\"} 100
scheduler_pending_pods 7
scheduler_queue_incoming_pods_total{event=\"ResourceSliceUpdate\",queue=\"active\"} not-a-number
";
        let name = "scheduler_queue_incoming_pods_total";
        let slices = |l: &str| label(l, "event").ends_with("ResourceSliceUpdate");
        assert_eq!(sum_where(text, name, slices), 5.0);
        assert_eq!(sum_where(text, name, |_| true), 17.0);
        assert_eq!(
            sum_where(text, name, |l| label(l, "queue") == "backoff"),
            3.0
        );
        assert_eq!(
            sum_where(text, name, |l| label(l, "event") == "NodeAdd"),
            0.0
        );
        assert_eq!(sum_where(text, "scheduler_pending_pods", |_| true), 7.0);
        assert_eq!(
            label("event=\"PodAdd\",queue=\"active\"", "queue"),
            "active"
        );
        assert_eq!(label("event=\"PodAdd\"", "queue"), "");
    }
}
