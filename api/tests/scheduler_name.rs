//! The scheduler name is process-wide: set once, at start (a process of its own here).

use std::collections::BTreeMap;

use kubeshare_api::scheduler_name::SchedulerNameError;
use kubeshare_api::{SCHEDULER_NAME, is_kubeshare_pod, scheduler_name, set_scheduler_name};

#[test]
fn the_name_is_checked_set_once_and_used_to_recognise_kubeshare_pods() {
    let none = BTreeMap::new();
    assert_eq!(scheduler_name(), SCHEDULER_NAME);
    assert!(is_kubeshare_pod(Some(SCHEDULER_NAME), &none));
    assert_eq!(
        set_scheduler_name("Gpu_Share"),
        Err(SchedulerNameError::Invalid("Gpu_Share".into()))
    );
    set_scheduler_name("gpu-share").unwrap();
    assert_eq!(scheduler_name(), "gpu-share");
    assert!(is_kubeshare_pod(Some("gpu-share"), &none));
    assert!(!is_kubeshare_pod(Some(SCHEDULER_NAME), &none));
    // The same name again is fine; another is refused.
    set_scheduler_name("gpu-share").unwrap();
    assert!(matches!(
        set_scheduler_name("other"),
        Err(SchedulerNameError::AlreadySet(..))
    ));
}
