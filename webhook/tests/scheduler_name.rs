//! A webhook started with another scheduler name (`--scheduler-name`, the chart's
//! `schedulerName`) puts that name on KubeShare pods and refuses the default one. A process
//! of its own: the name is set once per process.

use kubeshare_webhook::admit::{Operation, Verdict, admit_pod};
use serde_json::json;

#[test]
fn kubeshare_pods_get_the_configured_scheduler_name() {
    kubeshare_api::set_scheduler_name("gpu-share").unwrap();
    let pod = |scheduler: Option<&str>| {
        let mut spec = json!({"containers": [{"name": "main", "image": "x"}]});
        if let Some(s) = scheduler {
            spec["schedulerName"] = json!(s);
        }
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "labels": {"sharedgpu/gpu_request": "0.5", "sharedgpu/gpu_limit": "0.5"}},
               "spec": spec})
    };
    let op = Operation::Create;
    match admit_pod(op, None, Some(&pod(None)), None) {
        Verdict::Allow { patch, .. } => {
            let set = serde_json::to_value(&patch).unwrap();
            assert!(
                set.as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["path"] == "/spec/schedulerName" && p["value"] == "gpu-share"),
                "{set}"
            );
        }
        Verdict::Deny(d) => panic!("denied: {d:?}"),
    }
    assert!(matches!(
        admit_pod(op, None, Some(&pod(Some("gpu-share"))), None),
        Verdict::Allow { .. }
    ));
    match admit_pod(op, None, Some(&pod(Some("kubeshare-scheduler"))), None) {
        Verdict::Deny(d) => assert!(
            d.message.contains("spec.schedulerName=kubeshare-scheduler: a pod with sharedgpu/gpu_* labels is placed by gpu-share"),
            "{d:?}"
        ),
        Verdict::Allow { .. } => panic!("the default scheduler name was accepted"),
    }
}
