//! ResourceClaims in the books: what the stock scheduler allocated on the DRA driver's
//! devices ([`crate::claims::claimed`]) is held on each GPU beside the label pods'
//! bookings, so that the extender never gives a label pod a share a claim holds. The
//! claims are not bookings of pods: nothing here evicts, moves or frees them.

use kubeshare_api::dra::device_index;

use super::{ClaimHold, Cluster, Gpu, Node};
use crate::claims::Claimed;

impl Cluster {
    /// The claims now allocated (all of them, as the claim and slice watches show
    /// them): replaces what was held before. A node whose GPUs' holds change gets a new
    /// stamp, so that no verdict judged without them is reused.
    pub fn set_claims(&mut self, claimed: Claimed) {
        if claimed == self.claimed {
            return;
        }
        let mut touched: Vec<String> = self
            .claimed
            .keys()
            .chain(claimed.keys())
            .map(|(n, _)| n.clone())
            .collect();
        touched.sort_unstable();
        touched.dedup();
        self.claimed = claimed;
        for name in touched {
            // A claim deallocated or deleted frees room as a label pod's deletion does:
            // pods refused for room there are woken (kube-scheduler does not retry a label
            // pod on a claim's events).
            self.refresh_gpus(&name, |g| g.claimed.clone(), Self::attach_claims, frees);
        }
    }

    /// Recomputes one part of each GPU of node `name`: `part` reads it, `attach` sets it.
    /// A change gives the node a new stamp, so that no verdict judged without it is reused,
    /// and one that `frees` room on a GPU (before, after) wakes the pods refused there.
    pub(super) fn refresh_gpus<T: PartialEq>(
        &mut self,
        name: &str,
        part: impl Fn(&Gpu) -> T,
        attach: impl Fn(&Self, &str, &mut Node),
        frees: impl Fn(&T, &T) -> bool,
    ) {
        let Some(mut node) = self.nodes.remove(name) else {
            return;
        };
        let before: Vec<T> = node.gpus.iter().map(&part).collect();
        attach(self, name, &mut node);
        let after: Vec<T> = node.gpus.iter().map(&part).collect();
        if after != before {
            self.version += 1;
            node.stamp = self.version;
            self.scores = None;
            if before.iter().zip(&after).any(|(b, a)| frees(b, a)) {
                self.refused.freed(name, self.version);
            }
        }
        self.nodes.insert(name.to_string(), node);
    }

    /// Sets each GPU of `node` (named `name`) to what the claims hold of it: a device
    /// whose slice gave its UUID is that GPU; otherwise the device name's index.
    pub(super) fn attach_claims(&self, name: &str, node: &mut Node) {
        for g in &mut node.gpus {
            g.claimed = ClaimHold::default();
        }
        let lo = (name.to_string(), String::new());
        for ((n, device), c) in self.claimed.range(lo..) {
            if n != name {
                break;
            }
            let i = match &c.uuid {
                Some(u) => node.by_uuid.get(u).copied(),
                None => device_index(device)
                    .and_then(|x| node.gpus.iter().position(|g| g.info.index == x)),
            };
            let Some(i) = i else { continue };
            let g = &mut node.gpus[i];
            let h = &mut g.claimed;
            h.milli = h.milli.saturating_add(c.milli);
            h.mem = h
                .mem
                .saturating_add(c.mem.unwrap_or(g.info.memory).min(g.info.memory));
            h.count = h.count.saturating_add(c.claims.len() as u32);
            for claim in &c.claims {
                if !h.names.is_empty() {
                    h.names.push_str(", ");
                }
                h.names.push_str(claim);
            }
        }
    }

    /// What claims hold of each GPU that they hold anything of: (node, index, share in
    /// thousandths, memory, the claims). For tests and the books' views.
    pub fn claim_holds(&self) -> Vec<(String, u32, u32, u64, String)> {
        let mut v: Vec<_> = self
            .nodes
            .iter()
            .flat_map(|(n, node)| {
                node.gpus
                    .iter()
                    .filter(|g| g.claimed.count > 0)
                    .map(move |g| {
                        let c = &g.claimed;
                        (n.clone(), g.info.index, c.milli, c.mem, c.names.clone())
                    })
            })
            .collect();
        v.sort();
        v
    }
}

/// Whether going from what claims held of a GPU (`before`) to what they hold now
/// (`after`) gives back share or memory: a pod refused for room there may fit now.
fn frees(before: &ClaimHold, after: &ClaimHold) -> bool {
    after.milli < before.milli || after.mem < before.mem
}
