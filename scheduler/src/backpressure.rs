//! Back-pressure from the extender's API queue to kube-scheduler's cycle.
//!
//! kube-scheduler assumes a pod and starts its bind at once, then moves on to the
//! next pod: from a backlog its cycle (~4 ms a pod with the extender's single best
//! node) runs ahead of the Bindings the apiserver takes, so bind calls pile up
//! behind the extender's API slots (`--api-concurrency`). Their wait grew with the
//! backlog (5 s on average for 2,000 pods on the 2-core rig); past the bind deadline
//! they fail, kube-scheduler retries the pods, and the retries' events and status
//! updates slow the apiserver further (one such run: 5.4 failed attempts per pod,
//! 22 pods/s instead of 128). So the filter verb, the only call inside the cycle,
//! holds a new pod while the oldest call waiting for an API slot has waited longer
//! than a limit: the backlog then waits in kube-scheduler's queue, as pending pods,
//! not as bind calls with a timeout. A slow apiserver alone (long Bindings, no
//! queue) holds nothing.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// API calls waiting for a slot, oldest first (the slots are handed out in order).
#[derive(Debug, Default)]
pub(crate) struct ApiQueue {
    started: Mutex<BTreeMap<u64, Instant>>,
    next: AtomicU64,
    /// Woken when one leaves.
    ended: Notify,
}

/// One call in the queue; it leaves when dropped (it got its slot, or gave up, or
/// its task was cancelled).
pub(crate) struct InQueue<'a> {
    all: &'a ApiQueue,
    id: u64,
}

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.all
            .started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.all.ended.notify_waiters();
    }
}

impl ApiQueue {
    /// Registers a call that starts waiting now.
    pub(crate) fn start(&self) -> InQueue<'_> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.started
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Instant::now());
        InQueue { all: self, id }
    }

    /// How long the oldest call in the queue has waited.
    pub(crate) fn oldest_age(&self, now: Instant) -> Option<Duration> {
        let started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        started
            .first_key_value()
            .map(|(_, t)| now.saturating_duration_since(*t))
    }

    /// Waits while [`hold`] says so, waking when a call leaves the queue (or every
    /// 100 ms).
    /// Returns how long it held (zero when it did not).
    pub(crate) async fn wait_for_room(&self, after: Duration, max: Duration) -> Duration {
        if after.is_zero() {
            // The hold is off: no wake-up to register, no look at the queue.
            return Duration::ZERO;
        }
        let t0 = Instant::now();
        let mut held = Duration::ZERO;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let now = Instant::now();
            if !hold(self.oldest_age(now), held, after, max) {
                return held;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), ended).await;
            held = t0.elapsed();
        }
    }
}

/// Whether a filter call, held for `held` so far, waits longer: while the oldest
/// call in the API queue has waited longer than `after`, for at most `max` (then it
/// goes on: a stuck apiserver must not turn into filter timeouts as well). `after`
/// at zero turns the hold off.
pub(crate) fn hold(
    oldest: Option<Duration>,
    held: Duration,
    after: Duration,
    max: Duration,
) -> bool {
    !after.is_zero() && held < max && oldest.is_some_and(|age| age > after)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn holds_only_while_the_oldest_call_waited_past_the_limit_and_not_past_the_most() {
        let (after, max) = (2 * S, 3 * S);
        assert!(!hold(None, Duration::ZERO, after, max));
        assert!(!hold(Some(2 * S), Duration::ZERO, after, max));
        assert!(hold(
            Some(2 * S + Duration::from_millis(1)),
            Duration::ZERO,
            after,
            max
        ));
        assert!(hold(
            Some(10 * S),
            3 * S - Duration::from_millis(1),
            after,
            max
        ));
        assert!(!hold(Some(10 * S), 3 * S, after, max));
        assert!(!hold(Some(10 * S), Duration::ZERO, Duration::ZERO, max));
        assert!(!hold(
            Some(Duration::MAX),
            Duration::MAX,
            after,
            Duration::MAX
        ));
    }

    const MS: Duration = Duration::from_millis(1);

    #[tokio::test]
    async fn a_filter_waits_until_the_old_call_leaves_the_queue() {
        let b = std::sync::Arc::new(ApiQueue::default());
        let old = b.start();
        tokio::time::sleep(60 * MS).await;
        let young = b.start();
        let b2 = b.clone();
        let t0 = Instant::now();
        let waiter = tokio::spawn(async move { b2.wait_for_room(40 * MS, 10 * S).await });
        tokio::time::sleep(50 * MS).await;
        // The old one gets its slot; the young one (~50 ms, above the limit) soon after.
        drop(old);
        tokio::time::sleep(20 * MS).await;
        let released = t0.elapsed();
        drop(young);
        let held = waiter.await.expect("waiter");
        assert!(
            held >= 60 * MS && held <= released + 500 * MS,
            "{held:?}, released {released:?}"
        );
        assert_eq!(b.oldest_age(Instant::now()), None);
    }

    #[tokio::test]
    async fn a_filter_goes_on_after_the_most_it_may_hold() {
        let b = ApiQueue::default();
        let _stuck = b.start();
        tokio::time::sleep(20 * MS).await;
        let held = b.wait_for_room(10 * MS, 150 * MS).await;
        assert!(held >= 150 * MS && held < S, "{held:?}");
    }

    #[tokio::test]
    async fn a_filter_is_not_held_by_a_young_queue() {
        let b = ApiQueue::default();
        let _young = b.start();
        assert_eq!(b.wait_for_room(10 * S, 20 * S).await, Duration::ZERO);
    }
}
