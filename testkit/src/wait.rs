//! Waiting for the cluster to reach a state, with a deadline and a useful
//! message when it does not. Polls (every 200 ms): simple, and a timeout error
//! can show the last state seen.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use kube::Api;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

const POLL: Duration = Duration::from_millis(200);

/// Waits until the object `name` exists and `cond` holds for it; returns it.
/// Transient API errors are retried until the deadline.
pub async fn wait_for<K, F>(api: &Api<K>, name: &str, timeout: Duration, cond: F) -> Result<K>
where
    K: Clone + DeserializeOwned + Debug,
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

/// The debug form, cut to a readable size for error messages.
fn summarize<K: Debug>(obj: &K) -> String {
    let mut s = format!("{obj:?}");
    if s.len() > 2000 {
        let mut cut = 2000;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
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
}
