//! One namespace per test, with a unique name, deleted when the test ends
//! (also when it panics: the guard's `Drop` deletes it).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, PostParams};

use crate::cluster::{Cluster, Identity, client_from_kubeconfig};
use crate::error::Result;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A namespace that exists for the life of this guard.
#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    admin_kubeconfig: PathBuf,
    deleted: bool,
}

impl TestNamespace {
    /// Creates `<prefix>-<unique suffix>` (prefix sanitized to a DNS label).
    pub async fn create(cluster: &Cluster, prefix: &str) -> Result<TestNamespace> {
        let admin_kubeconfig = cluster.kubeconfig(Identity::Admin)?.to_path_buf();
        let client = cluster.client(Identity::Admin).await?;
        let name = unique_dns_name(prefix);
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {"kubeshare.io/test": "true"}},
        }))
        .unwrap_or_default();
        Api::<Namespace>::all(client)
            .create(&PostParams::default(), &ns)
            .await?;
        Ok(TestNamespace {
            name,
            admin_kubeconfig,
            deleted: false,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A cluster-wide unique name derived from this namespace's, for objects
    /// that are not namespaced (Nodes): the cluster is shared by every test.
    pub fn unique_name(&self, what: &str) -> String {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        dns_label(&format!("{}-{what}-{n}", self.name))
    }

    /// Deletes the namespace now (without waiting for it to be gone).
    pub async fn delete(mut self) -> Result<()> {
        self.deleted = true;
        delete_ns(&self.admin_kubeconfig, &self.name).await
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        // Drop may run inside the test's (single-threaded) runtime, which must
        // not be blocked on; delete from a helper thread with its own runtime
        // and its own client.
        let kubeconfig = self.admin_kubeconfig.clone();
        let name = self.name.clone();
        let joined = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            match rt {
                Ok(rt) => rt.block_on(delete_ns(&kubeconfig, &name)),
                Err(e) => Err(crate::Error::Other(e.to_string())),
            }
        })
        .join();
        if let Ok(Err(e)) = joined {
            tracing::warn!(namespace = %self.name, error = %e, "could not delete test namespace");
        }
    }
}

async fn delete_ns(kubeconfig: &std::path::Path, name: &str) -> Result<()> {
    let client = client_from_kubeconfig(kubeconfig).await?;
    match Api::<Namespace>::all(client)
        .delete(name, &DeleteParams::background())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `prefix-<pid base36>-<counter>-<random>`, a valid DNS-1123 label.
fn unique_dns_name(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(n);
    let rand = h.finish() & 0xff_ffff;
    let prefix: String = dns_label(prefix).chars().take(36).collect();
    let prefix = prefix.trim_end_matches('-');
    let prefix = if prefix.is_empty() { "t" } else { prefix };
    dns_label(&format!("{prefix}-{}-{n}-{rand:06x}", std::process::id()))
}

/// Lowercases, maps anything outside [a-z0-9-] to '-', trims to 63 chars and
/// strips leading/trailing '-'.
fn dns_label(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let trimmed: String = mapped.trim_matches('-').chars().take(63).collect();
    let trimmed = trimmed.trim_end_matches('-').to_string();
    if trimmed.is_empty() {
        "x".into()
    } else {
        trimmed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    #[test]
    fn names_are_dns_labels_and_unique() {
        let long = "My_Test::with.Weird/chars".repeat(5);
        let mut seen = std::collections::BTreeSet::new();
        for p in ["smoke", "", "---", long.as_str(), "ÄÖÜ"] {
            for _ in 0..20 {
                let n = unique_dns_name(p);
                assert!(is_dns_label(&n), "{n}");
                assert!(seen.insert(n));
            }
        }
    }

    #[test]
    fn dns_label_trims() {
        assert_eq!(dns_label("-A.b-"), "a-b");
        assert_eq!(dns_label(&"a".repeat(80)).len(), 63);
        assert_eq!(dns_label("__"), "x");
    }
}
