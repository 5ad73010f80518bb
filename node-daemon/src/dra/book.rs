//! The claims prepared on this node, shared by the kubelet plugin, which changes them,
//! and the daemon's loop, which writes gem-schd's configs from them together with the
//! pods the extender placed ([`crate::reconcile::desired_with_claims`]). After a change
//! the plugin asks the loop to apply it and waits for the answer, so that a claim's
//! config line is written before the kubelet starts its containers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::claim::PreparedClaim;

/// The loop's answer to a change: sent once the configs say the claims as they are.
pub type Applied = oneshot::Sender<()>;

/// The prepared claims, by claim UID.
#[derive(Debug, Clone)]
pub struct Book {
    claims: Arc<Mutex<BTreeMap<String, PreparedClaim>>>,
    changed: mpsc::UnboundedSender<Applied>,
}

/// The daemon loop's end: a request to apply the claims as they are now.
#[derive(Debug)]
pub struct Changes(mpsc::UnboundedReceiver<Applied>);

impl Changes {
    /// The next change; `None` once every [`Book`] is gone.
    pub async fn next(&mut self) -> Option<Applied> {
        self.0.recv().await
    }
}

impl Book {
    /// A book holding `claims` (from the checkpoint), and its loop end.
    pub fn new(claims: BTreeMap<String, PreparedClaim>) -> (Book, Changes) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Book {
                claims: Arc::new(Mutex::new(claims)),
                changed: tx,
            },
            Changes(rx),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, PreparedClaim>> {
        // A panic while holding the lock cannot leave the map half-changed: every
        // change is one insert or one remove.
        self.claims.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn snapshot(&self) -> BTreeMap<String, PreparedClaim> {
        self.lock().clone()
    }

    pub fn get(&self, uid: &str) -> Option<PreparedClaim> {
        self.lock().get(uid).cloned()
    }

    pub fn insert(&self, claim: PreparedClaim) {
        self.lock().insert(claim.uid.clone(), claim);
    }

    pub fn remove(&self, uid: &str) -> Option<PreparedClaim> {
        self.lock().remove(uid)
    }

    /// Asks the daemon's loop to apply the claims as they are and waits for it, at most
    /// `within`; whether it did.
    pub async fn applied(&self, within: Duration) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.changed.send(tx).is_err() {
            return false;
        }
        matches!(tokio::time::timeout(within, rx).await, Ok(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_loop_answers_a_change() {
        let (book, mut changes) = Book::new(BTreeMap::new());
        let b = book.clone();
        let waiter = tokio::spawn(async move { b.applied(Duration::from_secs(10)).await });
        let ack = changes.next().await.expect("a change");
        ack.send(()).expect("the plugin waits");
        assert!(waiter.await.unwrap());
        // Nobody answers: a timeout, not a hang.
        assert!(!book.applied(Duration::from_millis(20)).await);
        drop(changes);
        assert!(!book.applied(Duration::from_secs(10)).await, "loop gone");
    }
}
