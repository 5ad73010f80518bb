//! The nodes: a Node's published GPU inventory becomes (or stops being) a place to book,
//! and the bookings made while it was unknown are added when it appears.

use std::collections::{BTreeMap, HashSet};

use kubeshare_api::inventory::InventoryError;
use kubeshare_api::{GpuInfo, NodeInventory};

use super::{Cluster, Gpu, Node, NodeProblem, RecordProblem};

/// Whether `gpus` (a node's, in index order) are exactly `published` (any order).
fn same_gpus(gpus: &[Gpu], published: &[GpuInfo]) -> bool {
    gpus.len() == published.len()
        && published.iter().all(|p| {
            gpus.binary_search_by_key(&p.index, |g| g.info.index)
                .is_ok_and(|i| gpus[i].info == *p)
        })
}

impl Cluster {
    /// A Node was added or changed. `Ok(None)`: it publishes no inventory.
    pub fn apply_node(
        &mut self,
        name: &str,
        inventory: Result<Option<NodeInventory>, InventoryError>,
    ) {
        if let (Ok(Some(inv)), Some(node)) = (&inventory, self.nodes.get(name))
            && same_gpus(&node.gpus, &inv.gpus)
        {
            // A heartbeat or a label change: the books and the memoised verdicts
            // stay valid. (Heartbeats made the node watch a tenth of the
            // extender's CPU in a 1,000-node backlog.)
            return;
        }
        self.detach_node(name);
        match inventory {
            Ok(Some(inv)) if !inv.gpus.is_empty() => {
                let mut gpus: Vec<Gpu> = inv
                    .gpus
                    .into_iter()
                    .map(|info| Gpu {
                        info,
                        claimed: Default::default(),
                        promised: Vec::new(),
                        used: 0,
                        mem_used: 0,
                        um_used: 0,
                        holders: 0,
                        affinity: BTreeMap::new(),
                        anti: BTreeMap::new(),
                        exclusion: BTreeMap::new(),
                    })
                    .collect();
                gpus.sort_by_key(|g| g.info.index);
                let by_uuid = gpus
                    .iter()
                    .enumerate()
                    .map(|(i, g)| (g.info.uuid.clone(), i))
                    .collect();
                let id = self.free_ids.pop().unwrap_or_else(|| {
                    self.next_id += 1;
                    self.next_id - 1
                });
                let mut node = Node {
                    id,
                    stamp: self.version,
                    gpus,
                    by_uuid,
                };
                self.attach_claims(name, &mut node);
                self.attach_promises(name, &mut node);
                self.nodes.insert(name.to_string(), node);
                let uids: Vec<String> = self
                    .by_node
                    .get(name)
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default();
                for uid in uids {
                    if let Some(b) = self.bookings.get(&uid).cloned()
                        && let Err(e) = self.account(&b, true)
                    {
                        // Booked while the node was unknown, and cannot be added now.
                        self.bookings.remove(&uid);
                        if let Some(s) = self.by_node.get_mut(name) {
                            s.remove(&uid);
                        }
                        if let Some(d) = b.deadline() {
                            self.timed.remove(&(d, uid.clone()));
                        }
                        let (namespace, pname) = self
                            .pods
                            .get(&uid)
                            .map(|e| (e.namespace.clone(), e.name.clone()))
                            .unwrap_or_default();
                        self.problems.push(RecordProblem {
                            uid,
                            namespace,
                            name: pname,
                            error: e,
                        });
                    }
                }
            }
            Ok(_) => {
                let node = name.to_string();
                self.node_problems
                    .insert(node.clone(), NodeProblem::NoInventory { node });
            }
            Err(error) => {
                let node = name.to_string();
                self.node_problems
                    .insert(node.clone(), NodeProblem::BadInventory { node, error });
            }
        }
    }

    pub fn delete_node(&mut self, name: &str) {
        self.detach_node(name);
    }

    /// The names of every node we know, GPU or not.
    pub fn node_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .nodes
            .keys()
            .chain(self.node_problems.keys())
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Keeps only these nodes (after a relist).
    pub fn retain_nodes(&mut self, keep: &HashSet<String>) {
        for n in self.node_names() {
            if !keep.contains(&n) {
                self.detach_node(&n);
            }
        }
    }

    fn detach_node(&mut self, name: &str) {
        self.version += 1;
        self.node_problems.remove(name);
        if let Some(node) = self.nodes.remove(name) {
            self.free_ids.push(node.id);
            for locs in self.affinity.values_mut() {
                locs.retain(|(n, _), _| n != name);
            }
            self.affinity.retain(|_, l| !l.is_empty());
        }
    }
}
