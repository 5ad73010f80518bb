//! Views of the books for metrics, the API and tests: per-GPU usage, booking counts, one
//! pod's GPUs, and the invariant check that every scale run and property test ends with.

use std::collections::{HashMap, HashSet};

use super::{BooksInconsistent, Cluster, GpuUsage, Kind, Node};

impl Cluster {
    /// Every GPU with what label pods and ResourceClaims hold of it, in node and
    /// index order.
    pub fn usage(&self) -> Vec<GpuUsage> {
        let mut nodes: Vec<(&String, &Node)> = self.nodes.iter().collect();
        nodes.sort_unstable_by_key(|(n, _)| *n);
        nodes
            .into_iter()
            .flat_map(|(n, node)| {
                node.gpus.iter().map(move |g| GpuUsage {
                    node: n.clone(),
                    index: g.info.index,
                    uuid: g.info.uuid.clone(),
                    model: g.info.model.clone(),
                    used_milli: g.used,
                    mem_used: g.mem_used,
                    um_resident: g.um_used,
                    mem_total: g.info.memory,
                    holders: g.holders,
                    claimed_milli: g.claimed.milli,
                    claimed_mem: g.claimed.mem,
                    claims: g.claimed.count,
                })
            })
            .collect()
    }

    /// Number of bookings by kind: (observed, assumed, reserved).
    pub fn booking_counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for b in self.bookings.values() {
            match b.kind {
                Kind::Observed => c.0 += 1,
                Kind::Assumed { .. } => c.1 += 1,
                Kind::Reserved { .. } => c.2 += 1,
            }
        }
        c
    }

    /// The GPUs (node, uuids) booked for a pod, whatever the kind.
    pub fn booked(&self, uid: &str) -> Option<(String, Vec<String>)> {
        self.bookings
            .get(uid)
            .map(|b| (b.node.clone(), b.gpus.clone()))
    }

    /// Checks the books: they equal a recount from the bookings, and no GPU is
    /// over its share or memory. For tests and debugging.
    pub fn check_invariants(&self) -> Result<(), BooksInconsistent> {
        let mut fresh: HashMap<(String, String), (u64, u128, u128, u64)> = HashMap::new();
        for b in self.bookings.values() {
            let Some(node) = self.nodes.get(&b.node) else {
                continue;
            };
            for u in &b.gpus {
                if node.by_uuid.contains_key(u) {
                    let e = fresh.entry((b.node.clone(), u.clone())).or_default();
                    e.0 += u64::from(b.milli);
                    match b.managed {
                        None => e.1 += u128::from(b.mem),
                        Some(_) => e.2 += u128::from(b.mem),
                    }
                    e.3 += 1;
                }
            }
        }
        let mut ids = HashSet::new();
        for (n, node) in &self.nodes {
            if node.id >= self.next_id || self.free_ids.contains(&node.id) || !ids.insert(node.id) {
                return Err(BooksInconsistent(format!(
                    "{n}: node id {} reused or out of range",
                    node.id
                )));
            }
            for g in &node.gpus {
                let want = fresh
                    .get(&(n.clone(), g.info.uuid.clone()))
                    .copied()
                    .unwrap_or_default();
                let have = (
                    u64::from(g.used),
                    u128::from(g.mem_used),
                    u128::from(g.um_used),
                    u64::from(g.holders),
                );
                if have != want {
                    return Err(BooksInconsistent(format!(
                        "{n}/gpu {}: books {have:?} != recount {want:?}",
                        g.info.index
                    )));
                }
                if g.used > 1000 {
                    return Err(BooksInconsistent(format!(
                        "{n}/gpu {}: {} milli booked",
                        g.info.index, g.used
                    )));
                }
                if g.mem_used > g.info.memory {
                    return Err(BooksInconsistent(format!(
                        "{n}/gpu {}: {} of {} bytes booked",
                        g.info.index, g.mem_used, g.info.memory
                    )));
                }
                // Unified-memory pods share, factor-fold, what device-mode pods leave.
                let um_budget = u128::from(g.info.memory - g.mem_used)
                    * u128::from(self.cfg.um_overcommit_milli.max(1000))
                    / 1000;
                if u128::from(g.um_used) > um_budget {
                    return Err(BooksInconsistent(format!(
                        "{n}/gpu {}: {} bytes of unified-memory shares booked beside {} of device caps on {} (factor {})",
                        g.info.index,
                        g.um_used,
                        g.mem_used,
                        g.info.memory,
                        self.cfg.um_overcommit_milli
                    )));
                }
            }
        }
        Ok(())
    }
}
