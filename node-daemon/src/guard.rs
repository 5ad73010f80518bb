//! GPU use that gem-schd does not gate, found and named by pod (the decisions; pure, no I/O).
//!
//! Two sources, both checked every `--gpu-process-check-secs`:
//! - gem-schd's refusals at a pod's socket (its usage report's `refused` lines, counted since
//!   it started): each new refusal is reported once, on the socket's pod and on the peer's.
//! - the driver's processes with a compute context on each GPU (NVML) against the processes
//!   connected to that GPU's gem-schd (the report's `pids`): one the driver lists and gem-schd
//!   does not know (it dropped LD_PRELOAD, links CUDA statically, loads a second copy of the
//!   driver) runs with no gate and no cap. It is reported once it is seen in two checks in a
//!   row (a process creates its context a moment before its hook connects), named by the pod
//!   its cgroups put it in. Whole-GPU pods' processes on their GPUs are not strangers, nor is
//!   anything on a GPU another device plugin gave away, nor on a GPU whose gem-schd has no
//!   fresh report (nothing to compare with).

use std::collections::{BTreeMap, BTreeSet};

use kubeshare_api::UsageReport;

/// A process on a GPU that gem-schd does not know.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Untracked {
    pub gpu: String,
    pub pid: u32,
    /// The pod its cgroups put it in, if any.
    pub pod_uid: Option<String>,
    /// `namespace/name` of that pod, when it is one of this node's pods.
    pub pod_key: Option<String>,
}

/// New refusals at one socket from one peer pod since the last check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusalNews {
    pub gpu: String,
    /// The socket's pod (its client ID).
    pub socket_pod: String,
    /// The refused process's pod; `None`: in no pod.
    pub peer_pod: Option<String>,
    /// The last refused process.
    pub pid: u32,
    /// Refusals since the last check.
    pub new: u64,
}

/// Remembers gem-schd's refusal counts, to report each refusal once.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Per GPU: gem-schd's clock at its last report (it starts at 0 with each gem-schd,
    /// so a smaller one means a new gem-schd, whose counts start over).
    at_us: BTreeMap<String, u64>,
    counts: BTreeMap<(String, String, Option<String>), u64>,
}

impl Refusals {
    /// The refusals the reports show beyond what the previous ones did (`reports`: the
    /// fresh reports, by GPU).
    pub fn update(&mut self, reports: &BTreeMap<String, UsageReport>) -> Vec<RefusalNews> {
        let mut news = vec![];
        for (gpu, r) in reports {
            let restarted = self.at_us.get(gpu).is_some_and(|at| r.at_us < *at);
            self.at_us.insert(gpu.clone(), r.at_us);
            if restarted {
                self.counts.retain(|(g, _, _), _| g != gpu);
            }
            for f in &r.refused {
                let key = (gpu.clone(), f.socket.clone(), f.peer_pod.clone());
                let before = self.counts.insert(key, f.count).unwrap_or(0);
                if f.count > before {
                    news.push(RefusalNews {
                        gpu: gpu.clone(),
                        socket_pod: f.socket.clone(),
                        peer_pod: f.peer_pod.clone(),
                        pid: f.pid,
                        new: f.count - before,
                    });
                }
            }
        }
        news
    }
}

/// What one check is given about a GPU.
#[derive(Debug, Clone, Default)]
pub struct GpuView {
    /// The processes the driver lists on it.
    pub driver: Vec<u32>,
    /// The processes connected to its gem-schd; `None`: no fresh report (not checked).
    pub known: Option<BTreeSet<u32>>,
    /// Another device plugin gave it whole to a pod (not checked).
    pub held: bool,
    /// Pods that hold it whole (their processes are not strangers).
    pub whole_pods: BTreeSet<String>,
}

/// The untracked-process check across checks: a stranger counts from its second sighting.
#[derive(Debug, Default)]
pub struct Strangers {
    /// Seen untracked in the last check: (gpu, pid).
    seen: BTreeSet<(String, u32)>,
    /// Already reported: (gpu, pid).
    reported: BTreeSet<(String, u32)>,
}

/// A check's outcome.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CheckResult {
    /// Every untracked process now (seen twice in a row).
    pub untracked: Vec<Untracked>,
    /// The ones not reported before.
    pub new: Vec<Untracked>,
}

impl Strangers {
    /// One check. `pod_of`: the pod UID of a process (from its cgroups); `pod_key`: a pod
    /// UID's `namespace/name` among this node's pods.
    pub fn check(
        &mut self,
        gpus: &BTreeMap<String, GpuView>,
        pod_of: impl Fn(u32) -> Option<String>,
        pod_key: impl Fn(&str) -> Option<String>,
    ) -> CheckResult {
        let mut now = BTreeSet::new();
        let mut out = CheckResult::default();
        for (gpu, v) in gpus {
            let Some(known) = &v.known else { continue };
            if v.held {
                continue;
            }
            for &pid in v.driver.iter().filter(|p| !known.contains(p)) {
                let pod_uid = pod_of(pid);
                if pod_uid.as_ref().is_some_and(|u| v.whole_pods.contains(u)) {
                    continue;
                }
                let key = (gpu.clone(), pid);
                now.insert(key.clone());
                if !self.seen.contains(&key) {
                    continue;
                }
                let u = Untracked {
                    gpu: gpu.clone(),
                    pid,
                    pod_key: pod_uid.as_deref().and_then(&pod_key),
                    pod_uid,
                };
                if self.reported.insert(key) {
                    out.new.push(u.clone());
                }
                out.untracked.push(u);
            }
        }
        // A process that left (or joined gem-schd) may be reported again if it comes back.
        self.reported.retain(|k| now.contains(k));
        self.seen = now;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::Refusal;

    fn report(at_us: u64, refused: &[(&str, Option<&str>, u32, u64)]) -> UsageReport {
        UsageReport {
            window_us: 1,
            at_us,
            clients: vec![],
            refused: refused
                .iter()
                .map(|(s, p, pid, count)| Refusal {
                    socket: s.to_string(),
                    peer_pod: p.map(str::to_string),
                    pid: *pid,
                    count: *count,
                })
                .collect(),
        }
    }

    #[test]
    fn refusals_are_reported_once_and_again_after_a_restart() {
        let mut r = Refusals::default();
        let g = |rep| BTreeMap::from([("G".to_string(), rep)]);
        let n = r.update(&g(report(10, &[("a", Some("b"), 7, 2)])));
        assert_eq!(n.len(), 1);
        assert_eq!(
            (n[0].new, n[0].pid, n[0].peer_pod.as_deref()),
            (2, 7, Some("b"))
        );
        assert!(
            r.update(&g(report(20, &[("a", Some("b"), 7, 2)])))
                .is_empty()
        );
        let n = r.update(&g(report(30, &[("a", Some("b"), 8, 5), ("a", None, 9, 1)])));
        assert_eq!(
            n.iter()
                .map(|n| (n.new, n.peer_pod.clone()))
                .collect::<Vec<_>>(),
            vec![(3, Some("b".into())), (1, None)]
        );
        // No report (gem-schd down): nothing new, nothing forgotten.
        assert!(r.update(&BTreeMap::new()).is_empty());
        assert!(
            r.update(&g(report(40, &[("a", Some("b"), 8, 5)])))
                .is_empty()
        );
        // A new gem-schd (its clock went back) counts from 0 again.
        let n = r.update(&g(report(5, &[("a", Some("b"), 3, 1)])));
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].new, 1);
    }

    fn view(driver: &[u32], known: Option<&[u32]>) -> GpuView {
        GpuView {
            driver: driver.to_vec(),
            known: known.map(|k| k.iter().copied().collect()),
            ..GpuView::default()
        }
    }

    #[test]
    fn strangers_count_from_their_second_sighting_and_are_reported_once() {
        let mut s = Strangers::default();
        let pod_of = |pid: u32| (pid >= 100).then(|| format!("uid-{pid}"));
        let key = |uid: &str| (uid == "uid-100").then(|| "ns/p".to_string());
        let gpus = BTreeMap::from([
            ("G0".to_string(), view(&[1, 100, 200], Some(&[1]))),
            // No fresh report: not checked.
            ("G1".to_string(), view(&[300], None)),
        ]);
        assert_eq!(s.check(&gpus, pod_of, key), CheckResult::default());
        let r = s.check(&gpus, pod_of, key);
        assert_eq!(r.untracked.len(), 2);
        assert_eq!(r.new, r.untracked);
        assert_eq!(
            r.new[0],
            Untracked {
                gpu: "G0".into(),
                pid: 100,
                pod_uid: Some("uid-100".into()),
                pod_key: Some("ns/p".into()),
            }
        );
        assert_eq!((r.new[1].pid, r.new[1].pod_key.as_deref()), (200, None));
        let r = s.check(&gpus, pod_of, key);
        assert_eq!(r.untracked.len(), 2);
        assert!(r.new.is_empty(), "reported once");
        // 100 connects to gem-schd; 200 leaves.
        let gpus = BTreeMap::from([("G0".to_string(), view(&[1, 100], Some(&[1, 100])))]);
        assert_eq!(s.check(&gpus, pod_of, key), CheckResult::default());
        // A process that was seen once and then joined gem-schd is never reported.
        let gpus = BTreeMap::from([("G0".to_string(), view(&[1, 500], Some(&[1])))]);
        s.check(&gpus, pod_of, key);
        let gpus = BTreeMap::from([("G0".to_string(), view(&[1, 500], Some(&[1, 500])))]);
        assert_eq!(s.check(&gpus, pod_of, key), CheckResult::default());
    }

    #[test]
    fn whole_gpu_pods_and_held_gpus_are_not_checked() {
        let mut s = Strangers::default();
        let pod_of = |pid: u32| Some(format!("uid-{pid}"));
        let mut whole = view(&[100, 101], Some(&[]));
        whole.whole_pods.insert("uid-100".into());
        let mut held = view(&[102], Some(&[]));
        held.held = true;
        let gpus = BTreeMap::from([("G0".to_string(), whole), ("G1".to_string(), held)]);
        s.check(&gpus, pod_of, |_| None);
        let r = s.check(&gpus, pod_of, |_| None);
        assert_eq!(
            r.untracked.iter().map(|u| u.pid).collect::<Vec<_>>(),
            vec![101]
        );
    }
}
