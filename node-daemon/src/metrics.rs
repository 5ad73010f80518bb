//! `/metrics` in the Prometheus text format, rendered from the last reconcile and the
//! supervisor's process table (a pure function, so it is unit-tested as text).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kubeshare_api::NodeInventory;

use crate::reconcile::Desired;
use crate::supervisor::ProcStat;

/// Counters kept by the daemon's main loop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub reconciles: u64,
    pub config_writes: u64,
    pub errors: u64,
    pub inventory_patches: u64,
}

/// Everything `/metrics` and `/healthz` show.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub node: String,
    pub synced: bool,
    pub inventory: NodeInventory,
    pub desired: Desired,
    pub counters: Counters,
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The exposition text.
pub fn render(s: &Snapshot, procs: &BTreeMap<String, ProcStat>, supervised: bool) -> String {
    let mut o = String::new();
    let mut family = |name: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
        let _ = writeln!(o, "# HELP {name} {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
        for (labels, value) in rows {
            let _ = writeln!(o, "{name}{labels} {value}");
        }
    };
    let per_gpu = |f: &dyn Fn(&str) -> String| -> Vec<(String, String)> {
        s.inventory
            .gpus
            .iter()
            .map(|g| {
                (
                    format!(
                        "{{node=\"{}\",gpu=\"{}\",index=\"{}\"}}",
                        esc(&s.node),
                        esc(&g.uuid),
                        g.index
                    ),
                    f(&g.uuid),
                )
            })
            .collect()
    };
    let entries = |gpu: &str| {
        s.desired
            .configs
            .get(gpu)
            .map(|c| c.entries.as_slice())
            .unwrap_or(&[])
    };
    let whole = |gpu: &str| s.desired.whole.get(gpu).map_or(0, Vec::len);

    family(
        "kubeshare_node_gpu_pods",
        "gauge",
        "Pods placed on the GPU (time-shared ones in its resource-config, plus whole-GPU ones).",
        per_gpu(&|g| (entries(g).len() + whole(g)).to_string()),
    );
    family(
        "kubeshare_node_gpu_requested_share",
        "gauge",
        "Sum of the guaranteed shares (gpu_request) of the GPU's pods, in GPUs.",
        per_gpu(&|g| {
            let milli: u64 = entries(g)
                .iter()
                .map(|e| u64::from(e.request.get()))
                .sum::<u64>()
                + 1000 * whole(g) as u64;
            format!("{}", milli as f64 / 1000.0)
        }),
    );
    family(
        "kubeshare_node_gpu_limit_share",
        "gauge",
        "Sum of the share ceilings (gpu_limit) of the GPU's time-shared pods, in GPUs.",
        per_gpu(&|g| {
            let milli: u64 = entries(g).iter().map(|e| u64::from(e.limit.get())).sum();
            format!("{}", milli as f64 / 1000.0)
        }),
    );
    family(
        "kubeshare_node_gpu_memory_bytes",
        "gauge",
        "Total memory of the GPU.",
        per_gpu(&|g| s.inventory.gpu(g).map_or(0, |i| i.memory).to_string()),
    );
    family(
        "kubeshare_node_gpu_allocated_memory_bytes",
        "gauge",
        "Sum of the memory caps of the GPU's time-shared pods.",
        per_gpu(&|g| {
            entries(g)
                .iter()
                .map(|e| e.gpu_mem)
                .sum::<u64>()
                .to_string()
        }),
    );
    if supervised {
        family(
            "kubeshare_node_gem_schd_up",
            "gauge",
            "1 when the GPU's gem-schd is running.",
            per_gpu(&|g| u8::from(procs.get(g).is_some_and(|p| p.running)).to_string()),
        );
        family(
            "kubeshare_node_gem_schd_restarts_total",
            "counter",
            "Times the GPU's gem-schd was started again after it died.",
            per_gpu(&|g| procs.get(g).map_or(0, |p| p.restarts).to_string()),
        );
    }
    let node = format!("{{node=\"{}\"}}", esc(&s.node));
    let c = &s.counters;
    for (name, kind, help, v) in [
        (
            "kubeshare_node_synced",
            "gauge",
            "1 once the first list of the node's pods is in.",
            u64::from(s.synced),
        ),
        (
            "kubeshare_node_rejected_pods",
            "gauge",
            "Pods with an allocation on this node that could not be configured.",
            s.desired.problems.len() as u64,
        ),
        (
            "kubeshare_node_reconciles_total",
            "counter",
            "Reconcile passes.",
            c.reconciles,
        ),
        (
            "kubeshare_node_config_writes_total",
            "counter",
            "resource-config files written.",
            c.config_writes,
        ),
        (
            "kubeshare_node_errors_total",
            "counter",
            "Failed reconcile or publish steps.",
            c.errors,
        ),
        (
            "kubeshare_node_inventory_patches_total",
            "counter",
            "Patches of the Node's inventory labels and annotation.",
            c.inventory_patches,
        ),
    ] {
        family(name, kind, help, vec![(node.clone(), v.to_string())]);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubeshare_api::{GpuInfo, Milli, ResourceConfig, ResourceEntry};

    #[test]
    fn per_gpu_figures() {
        let gpu = |i: u32| format!("GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd");
        let inventory = NodeInventory {
            gpus: (0..2)
                .map(|i| GpuInfo {
                    uuid: gpu(i),
                    index: i,
                    model: "M".into(),
                    memory: 1000,
                    numa_node: None,
                    nvlink_peers: vec![],
                })
                .collect(),
        };
        let entry = |id: &str, r: u16, l: u16, m: u64| ResourceEntry {
            id: id.into(),
            request: Milli::new(r).unwrap(),
            limit: Milli::new(l).unwrap(),
            gpu_mem: m,
        };
        let mut desired = Desired::default();
        desired.configs.insert(
            gpu(0),
            ResourceConfig {
                entries: vec![entry("a", 250, 500, 100), entry("b", 500, 1000, 300)],
            },
        );
        desired.configs.insert(gpu(1), ResourceConfig::default());
        desired.whole.insert(gpu(1), vec!["w".into()]);
        let s = Snapshot {
            node: "nd-n".into(),
            synced: true,
            inventory,
            desired,
            counters: Counters {
                reconciles: 7,
                ..Counters::default()
            },
        };
        let procs = BTreeMap::from([(
            gpu(0),
            ProcStat {
                running: true,
                pid: Some(1),
                restarts: 3,
            },
        )]);
        let text = render(&s, &procs, true);
        let l0 = format!("{{node=\"nd-n\",gpu=\"{}\",index=\"0\"}}", gpu(0));
        let l1 = format!("{{node=\"nd-n\",gpu=\"{}\",index=\"1\"}}", gpu(1));
        for want in [
            format!("kubeshare_node_gpu_pods{l0} 2"),
            format!("kubeshare_node_gpu_pods{l1} 1"),
            format!("kubeshare_node_gpu_requested_share{l0} 0.75"),
            format!("kubeshare_node_gpu_requested_share{l1} 1"),
            format!("kubeshare_node_gpu_limit_share{l0} 1.5"),
            format!("kubeshare_node_gpu_allocated_memory_bytes{l0} 400"),
            format!("kubeshare_node_gpu_memory_bytes{l1} 1000"),
            format!("kubeshare_node_gem_schd_up{l0} 1"),
            format!("kubeshare_node_gem_schd_up{l1} 0"),
            format!("kubeshare_node_gem_schd_restarts_total{l0} 3"),
            "kubeshare_node_reconciles_total{node=\"nd-n\"} 7".to_string(),
            "kubeshare_node_synced{node=\"nd-n\"} 1".to_string(),
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "missing {want:?} in\n{text}"
            );
        }
        assert!(!render(&s, &procs, false).contains("gem_schd"));
    }
}
