//! The delivered shares the node daemons export (`kubeshare_pod_gpu_delivered_share`:
//! gem-schd's token time per pod over its window), read from their `/metrics` so the
//! table can show what each pod got next to what it asked for. Parsing is pure.

use std::collections::BTreeMap;

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
