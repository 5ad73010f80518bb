//! The name of the kube-scheduler profile that places KubeShare pods. Every part checks it
//! (the webhook sets it on KubeShare pods, the extender and the node daemon act only on pods
//! it placed, the CLI lists them), so all of them read it from here: the default
//! [`SCHEDULER_NAME`](crate::SCHEDULER_NAME), or the one a binary was started with
//! (`--scheduler-name`, env `KUBESHARE_SCHEDULER_NAME`; the chart's `schedulerName` value
//! sets it in every container). Set once, at start, before any pod is looked at.

use std::sync::OnceLock;

static CONFIGURED: OnceLock<String> = OnceLock::new();

/// The environment variable every binary reads the name from.
pub const SCHEDULER_NAME_ENV: &str = "KUBESHARE_SCHEDULER_NAME";

/// The scheduler name in force.
pub fn scheduler_name() -> &'static str {
    CONFIGURED
        .get()
        .map_or(crate::SCHEDULER_NAME, String::as_str)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerNameError {
    #[error(
        "scheduler name {0:?} is not a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', at most 253 characters, starting and ending with a letter or digit)"
    )]
    Invalid(String),
    #[error("scheduler name {0:?} cannot replace {1:?}: it is set once, at start")]
    AlreadySet(String, String),
}

/// Sets the name for this process; a second call with another name is refused.
pub fn set_scheduler_name(name: &str) -> Result<(), SchedulerNameError> {
    if !is_dns_subdomain(name) {
        return Err(SchedulerNameError::Invalid(name.to_string()));
    }
    let set = CONFIGURED.get_or_init(|| name.to_string());
    if set != name {
        return Err(SchedulerNameError::AlreadySet(
            name.to_string(),
            set.clone(),
        ));
    }
    Ok(())
}

/// What Kubernetes accepts as `spec.schedulerName`.
fn is_dns_subdomain(s: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.chars().all(|c| alnum(c) || c == '-' || c == '.')
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Setting the name is tested in tests/scheduler_name.rs, a process of its own: it
    // would change the name for every other test of this crate.
    #[test]
    fn names_are_checked() {
        assert!(is_dns_subdomain("kubeshare-scheduler"));
        assert!(is_dns_subdomain("gpu.share-2"));
        for bad in ["", "Kubeshare", "-a", "a-", "a_b", &"a".repeat(254)] {
            assert!(!is_dns_subdomain(bad), "{bad:?}");
        }
    }
}
