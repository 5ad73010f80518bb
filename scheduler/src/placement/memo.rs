//! Filter's memo: a node's verdict for a demand, reused until the node changes.
//!
//! Between two decisions one node's books change (the pod just bound), yet the
//! filter is asked about every node again, and a backlog or a Job asks the same
//! demand many times. So the verdicts of the last few demands are kept by node
//! id, stamped with the node's `stamp` (the books' version when the node last
//! changed): a stamp that still matches means the node is as it was, and the
//! verdict stands. Only demands whose verdict depends on nothing but the node
//! and the demand are memoised (no own booking, group, affinity tag or pending
//! tag to protect); bind always evaluates afresh.

use kubeshare_api::GpuDemand;

use super::{Cluster, Req};

/// How many distinct demands keep their verdicts (a backlog mostly holds a
/// few). At 10,000 nodes one demand's verdicts take ~0.4 MB plus the reasons.
const DEMANDS: usize = 16;

/// One node's verdict: its raw score, or why it does not fit (formatted once,
/// as the filter answers it).
#[derive(Debug, Clone)]
pub(super) enum Verdict {
    Fits(u64),
    /// (reason, unresolvable)
    Fails(String, bool),
}

#[derive(Debug, Clone)]
struct Verdicts {
    ns: String,
    demand: GpuDemand,
    /// By node id: the node's stamp when judged, and the verdict.
    by_node: Vec<Option<(u64, Verdict)>>,
}

/// The verdicts of the last `DEMANDS` demands, most recent first.
#[derive(Debug, Clone, Default)]
pub(super) struct Memo {
    demands: Vec<Verdicts>,
}

impl Memo {
    /// Whether verdicts for this request may be memoised at all.
    fn applies(req: &Req) -> bool {
        req.own.is_none()
            && req.group.is_none()
            && req.tag_locs.is_none()
            && req.protect.is_empty()
            && req.demand.affinity.is_none()
    }
}

impl Memo {
    /// The entry for this request, made the most recent (created, evicting the
    /// oldest, when new); `None` when its verdicts must not be memoised.
    pub(super) fn slot(&mut self, req: &Req) -> Option<usize> {
        if !Memo::applies(req) {
            return None;
        }
        let m = &mut self.demands;
        match m
            .iter()
            .position(|v| v.ns == req.ns && v.demand == *req.demand)
        {
            Some(i) => m[..=i].rotate_right(1),
            None => {
                if m.len() == DEMANDS {
                    m.pop();
                }
                m.insert(
                    0,
                    Verdicts {
                        ns: req.ns.to_string(),
                        demand: req.demand.clone(),
                        by_node: Vec::new(),
                    },
                );
            }
        }
        Some(0)
    }

    /// `c.evaluate` through the memo: the verdict of `node_name` for the
    /// request, `slot` being what [`Memo::slot`] gave for it, and the node's id
    /// (`None` for a node with no GPUs known).
    pub(super) fn judge(
        &mut self,
        c: &Cluster,
        req: &Req,
        node_name: &str,
        slot: Option<usize>,
    ) -> (Verdict, Option<usize>) {
        let fresh = || match c.evaluate(req, node_name) {
            Ok(c) => Verdict::Fits(c.raw),
            Err(e) => Verdict::Fails(e.to_string(), e.unresolvable()),
        };
        let Some(node) = c.nodes.get(node_name) else {
            return (fresh(), None);
        };
        let (id, stamp) = (node.id as usize, node.stamp);
        let Some(slot) = slot else {
            return (fresh(), Some(id));
        };
        let by_node = &mut self.demands[slot].by_node;
        if let Some(Some((s, v))) = by_node.get(id)
            && *s == stamp
        {
            return (v.clone(), Some(id));
        }
        let v = fresh();
        if by_node.len() <= id {
            by_node.resize(id + 1, None);
        }
        by_node[id] = Some((stamp, v.clone()));
        (v, Some(id))
    }
}
