//! Waiting for the cluster to reach a state, with a deadline and a useful
//! message when it does not. Polls (every 200 ms): simple, and a timeout error
//! can show the last state seen.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use kube::Api;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

const POLL: Duration = Duration::from_millis(200);

/// Waits until the object `name` exists and `cond` holds for it; returns it.
/// Transient API errors are retried until the deadline.
pub async fn wait_for<K, F>(api: &Api<K>, name: &str, timeout: Duration, cond: F) -> Result<K>
where
    K: Clone + DeserializeOwned + Serialize + Debug,
    F: Fn(&K) -> bool,
{
    let start = Instant::now();
    loop {
        let last = match api.get_opt(name).await {
            Ok(Some(obj)) if cond(&obj) => return Ok(obj),
            Ok(Some(obj)) => summarize(&obj),
            Ok(None) => format!("{name} does not exist"),
            Err(e) => format!("error: {e}"),
        };
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                what: format!("{} {name}", std::any::type_name::<K>()),
                waited: timeout,
                last,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until `probe` returns `Ok(Some(v))`; `Ok(None)` means "not yet", and
/// `Err(msg)` is remembered as the last state. `what` names the wait in errors.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<Option<T>, String>>,
{
    let start = Instant::now();
    loop {
        let last = match probe().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => String::from("(not yet)"),
            Err(e) => e,
        };
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                what: what.to_string(),
                waited: timeout,
                last,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// An object for an error message: its status first (what a wait is about), then its spec
/// and metadata without `managedFields` (which filled the whole message before: a pod's
/// timeout showed none of its status), cut to a readable size.
fn summarize<K: Serialize + Debug>(obj: &K) -> String {
    let s = match serde_json::to_value(obj) {
        Ok(mut v) => {
            if let Some(m) = v.get_mut("metadata").and_then(|m| m.as_object_mut()) {
                m.remove("managedFields");
            }
            let part = |k: &str| v.get(k).map(|x| format!("{k}: {x} ")).unwrap_or_default();
            let s = format!("{}{}{}", part("status"), part("spec"), part("metadata"));
            if s.is_empty() { format!("{obj:?}") } else { s }
        }
        Err(_) => format!("{obj:?}"),
    };
    cut(s, 2000)
}

/// `s` cut to at most `max` bytes (on a char boundary), marked with "..." when cut.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn wait_until_returns_the_value_once_ready() {
        let mut n = 0;
        let v = wait_until("counter", Duration::from_secs(5), || {
            n += 1;
            let now = n;
            async move { Ok(if now >= 3 { Some(now) } else { None }) }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn wait_until_times_out_with_the_last_error() {
        let err = wait_until::<(), _, _>("never", Duration::from_millis(300), || async {
            Err("still broken".to_string())
        })
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("never") && msg.contains("still broken"),
            "{msg}"
        );
    }

    #[test]
    fn summarize_cuts_long_output_on_a_char_boundary() {
        let long = "é".repeat(3000);
        let s = summarize(&long);
        assert!(s.len() <= 2003 + 4);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn summarize_puts_the_status_first_and_leaves_managed_fields_out() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p70", "managedFields": [{"manager": "x".repeat(5000)}]},
            "spec": {"containers": [{"name": "main"}]},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                                       "reason": "Unschedulable", "message": "no room"}]}
        }))
        .unwrap();
        let s = summarize(&pod);
        assert!(s.starts_with("status: "), "{s}");
        assert!(s.contains("no room") && s.contains("p70"), "{s}");
        assert!(!s.contains("managedFields") && !s.contains("xxxx"), "{s}");
    }
}
