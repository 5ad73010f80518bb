//! One API call of the extender: with one of the shared permits, retrying 429s
//! and transient errors with a short backoff until a deadline, and telling a
//! call that may have been applied from one that surely was not.

use std::time::Duration;

use tokio::time::Instant;

use crate::error::ApiError;
use crate::state::Shared;

/// Runs `f` (one API call) with a permit, retrying 429s and transient errors with
/// a short backoff until `deadline`.
pub(crate) async fn call<T, F, Fut>(
    s: &Shared,
    deadline: Instant,
    what: &str,
    f: F,
) -> Result<T, ApiError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut backoff = Duration::from_millis(50);
    let mut last = String::from("no attempt");
    // Whether an attempt may have been applied: only then is the outcome unknown
    // at the deadline.
    let mut maybe_applied = false;
    let at_deadline = |msg: String, maybe_applied: bool| {
        s.metrics
            .count("kubeshare_extender_api_calls_total", "deadline");
        Err(if maybe_applied {
            ApiError::Unknown(msg)
        } else {
            ApiError::NotApplied(msg)
        })
    };
    loop {
        let now = Instant::now();
        if now >= deadline {
            return at_deadline(format!("{what}: deadline reached ({last})"), maybe_applied);
        }
        let in_queue = s.api_queue.start();
        let permit = tokio::time::timeout_at(deadline, s.api_permits.acquire()).await;
        drop(in_queue);
        let permit = match permit {
            Ok(Ok(p)) => p,
            _ => {
                return at_deadline(
                    format!("{what}: deadline reached waiting for an API slot ({last})"),
                    maybe_applied,
                );
            }
        };
        let r = tokio::time::timeout_at(deadline, f()).await;
        drop(permit);
        match r {
            Ok(Ok(v)) => {
                s.metrics.count("kubeshare_extender_api_calls_total", "ok");
                return Ok(v);
            }
            Ok(Err(kube::Error::Api(st))) if st.code == 429 => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "throttled");
                last = format!("HTTP 429: {}", st.message);
            }
            Ok(Err(kube::Error::Api(st))) if (400..500).contains(&st.code) => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "refused");
                return Err(ApiError::Refused {
                    code: st.code,
                    message: format!("{what}: {}", st.message),
                });
            }
            Ok(Err(e)) => {
                s.metrics
                    .count("kubeshare_extender_api_calls_total", "error");
                // A 5xx or a lost connection: the write may have happened; the
                // caller finds out (a retried Binding gets 409, then a GET).
                maybe_applied = true;
                last = e.to_string();
            }
            Err(_) => {
                return at_deadline(format!("{what}: no answer before the deadline"), true);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(Duration::from_millis(800));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use kube::core::Status;

    use super::*;
    use crate::placement::Config;
    use crate::server::Extender;

    fn api_error(code: u16) -> kube::Error {
        let mut st = Status::failure("test", "Test");
        st.code = code;
        kube::Error::Api(st.boxed())
    }

    /// Every API slot taken until the deadline: nothing was sent, so the caller
    /// may roll back (a deep backlog's binds used to keep their bookings for the
    /// check, then a GET each).
    #[tokio::test]
    async fn a_call_that_never_got_a_slot_was_not_applied() {
        let ext = Extender::offline(Config::default());
        let s = ext.shared.clone();
        let n = u32::try_from(s.timing.api_concurrency).unwrap_or(u32::MAX);
        let _all = s.api_permits.acquire_many(n).await.expect("permits");
        let sent = AtomicU32::new(0);
        let deadline = Instant::now() + Duration::from_millis(50);
        let r = call(&s, deadline, "creating the Binding", || {
            sent.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), kube::Error>(()) }
        })
        .await;
        assert_eq!(sent.load(Ordering::SeqCst), 0);
        assert!(
            matches!(&r, Err(ApiError::NotApplied(m)) if m.contains("waiting for an API slot")),
            "{r:?}"
        );
    }

    /// Turned away (429) until the deadline: not applied either.
    #[tokio::test]
    async fn a_call_throttled_until_the_deadline_was_not_applied() {
        let ext = Extender::offline(Config::default());
        let deadline = Instant::now() + Duration::from_millis(120);
        let r = call(&ext.shared, deadline, "creating the Binding", || async {
            Err::<(), _>(api_error(429))
        })
        .await;
        assert!(
            matches!(&r, Err(ApiError::NotApplied(m)) if m.contains("429")),
            "{r:?}"
        );
    }

    /// A 5xx may have been applied: at the deadline the outcome is unknown, even
    /// if later attempts were throttled.
    #[tokio::test]
    async fn a_call_after_a_server_error_is_unknown_at_the_deadline() {
        let ext = Extender::offline(Config::default());
        let tries = AtomicU32::new(0);
        let deadline = Instant::now() + Duration::from_millis(200);
        let r = call(&ext.shared, deadline, "creating the Binding", || {
            let first = tries.fetch_add(1, Ordering::SeqCst) == 0;
            async move { Err::<(), _>(api_error(if first { 503 } else { 429 })) }
        })
        .await;
        assert!(tries.load(Ordering::SeqCst) >= 2);
        assert!(matches!(r, Err(ApiError::Unknown(_))), "{r:?}");
    }
}
