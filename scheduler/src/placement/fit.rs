//! Whether and how one pod fits on one node: the GPUs it would get, the memory
//! cap, and the node's raw score; or the reason it does not fit. Pure: reads the
//! books, changes nothing.
//!
//! [`Cluster::evaluate`] runs the checks in order, each a function of its own:
//! the node is a GPU node, it has the model asked for, the affinity tag may live
//! here; then per GPU the tags, the share, and the memory (device or unified);
//! then the choice among the GPUs that fit (for whole GPUs, by NVLink).

use std::collections::BTreeMap;

use kubeshare_api::{GpuDemand, GpuShare, Milli};
use smallvec::SmallVec;

use super::error::{Factor, FitError, Gib, GpuMisfit, GpuWhy, milli};
use super::{Booking, Choice, Cluster, Gpu, GpuFail, Node, Req};
use crate::um_fit;

/// The score bonus of a node holding other members of the pod's group: above
/// any score a node earns otherwise.
const GROUP_BONUS: u64 = 10_000_000;

/// The GPU indexes (into the node's list) of the model the pod asks for.
/// Inline up to 16 GPUs: no allocation per node evaluated (filter is hot).
type Eligible = SmallVec<[usize; 16]>;

/// A GPU that fits a fraction: (index, share used, memory room, memory needed).
type Fit = (usize, u32, u64, u64);

/// Usage of one GPU with the pod's own booking left out.
#[derive(Debug, Clone, Copy)]
struct Usage {
    share: u32,
    /// Caps of device-mode pods.
    dev_mem: u64,
    /// Resident shares of unified-memory pods.
    um_mem: u64,
    holders: u32,
}

impl Cluster {
    /// Whether and how the pod fits on `node`.
    pub(super) fn evaluate(&self, req: &Req, node_name: &str) -> Result<Choice, FitError> {
        self.evaluate_on(req, node_name, self.gpu_node(node_name)?)
    }

    /// Whether and how the pod fits on `node_name` with the books `node` (the
    /// node's own, or a what-if copy: preemption's, with victims taken out).
    pub(super) fn evaluate_on(
        &self,
        req: &Req,
        node_name: &str,
        node: &Node,
    ) -> Result<Choice, FitError> {
        let eligible = model_check(req.demand, node_name, node)?;
        self.tag_place_check(req, node_name)?;
        let on = OnNode::new(req, node_name, node, self.cfg.um_overcommit_milli);
        let choice = match req.demand.share {
            GpuShare::Fraction { request, count, .. } => {
                on.fraction_choice(&eligible, request, usize::from(count))?
            }
            GpuShare::Whole { gpus } => on.whole_choice(&eligible, usize::from(gpus))?,
        };
        let bonus = if req.group_nodes.contains(node_name) {
            GROUP_BONUS
        } else {
            0
        };
        Ok(Choice {
            raw: bonus + choice.raw,
            ..choice
        })
    }

    /// The node, when it is a KubeShare GPU node.
    fn gpu_node(&self, node_name: &str) -> Result<&Node, FitError> {
        self.nodes
            .get(node_name)
            .ok_or_else(|| match self.node_problems.get(node_name) {
                Some(p) => FitError::Node(p.clone()),
                None => FitError::NotGpuNode {
                    node: node_name.to_string(),
                },
            })
    }

    /// An affinity tag that already lives somewhere keeps its pods there.
    fn tag_place_check(&self, req: &Req, node_name: &str) -> Result<(), FitError> {
        let Some(l) = &req.tag_locs else {
            return Ok(());
        };
        if l.iter().any(|(n, _)| n == node_name) {
            return Ok(());
        }
        let (n, u) = l.iter().next().cloned().unwrap_or_default();
        let place = self
            .nodes
            .get(&n)
            .and_then(|nn| nn.by_uuid.get(&u).map(|&i| nn.gpus[i].info.index))
            .map_or(n.clone(), |i| format!("{n}/gpu {i}"));
        // Unresolvable: no eviction on this node can bring the tag here.
        Err(FitError::TagElsewhere {
            node: node_name.to_string(),
            tag: tag_name(req.demand),
            place,
        })
    }
}

fn tag_name(d: &GpuDemand) -> String {
    d.affinity.as_deref().unwrap_or("").to_string()
}

/// The node's GPUs of the model the pod asks for (every GPU when it names none).
fn model_check(d: &GpuDemand, node_name: &str, node: &Node) -> Result<Eligible, FitError> {
    let eligible: Eligible = (0..node.gpus.len())
        .filter(|&i| {
            d.model
                .as_ref()
                .is_none_or(|m| node.gpus[i].info.model == *m)
        })
        .collect();
    if eligible.is_empty() {
        let mut models: Vec<&str> = node.gpus.iter().map(|g| g.info.model.as_str()).collect();
        models.dedup();
        return Err(FitError::NoModel {
            node: node_name.to_string(),
            want: d.model.as_deref().unwrap_or("?").to_string(),
            has: models.join(", "),
        });
    }
    Ok(eligible)
}

/// One pod on one node: what the per-GPU checks and the choice read.
struct OnNode<'a> {
    req: &'a Req<'a>,
    d: &'a GpuDemand,
    node_name: &'a str,
    node: &'a Node,
    /// The pod's own stale booking (an interrupted bind) does not count against it.
    own: Option<&'a Booking>,
    /// How far unified-memory pods may overcommit, in thousandths.
    factor: u32,
    /// The first pod of an affinity tag (and a pod with priority) takes the GPU
    /// with the most headroom, so that the tag's later pods find room next to it.
    spread: bool,
}

impl<'a> OnNode<'a> {
    fn new(req: &'a Req<'a>, node_name: &'a str, node: &'a Node, factor: u32) -> OnNode<'a> {
        let d = req.demand;
        OnNode {
            req,
            d,
            node_name,
            node,
            own: req.own,
            factor,
            spread: d.priority > 0 || (d.affinity.is_some() && req.tag_locs.is_none()),
        }
    }

    fn gpu(&self, i: usize) -> &'a Gpu {
        &self.node.gpus[i]
    }

    fn mine(&self, uuid: &str) -> bool {
        self.own.is_some_and(|b| b.on(self.node_name, uuid))
    }

    /// Usage of GPU i, leaving out the pod's own booking; what ResourceClaims hold
    /// counts as device-mode use (a claim's memory is a cap, never overcommitted).
    fn usage(&self, i: usize) -> Usage {
        let g = self.gpu(i);
        let u = match self.own.filter(|b| b.on(self.node_name, &g.info.uuid)) {
            Some(b) => {
                let (dev_mem, um_mem) = match b.managed {
                    None => (g.mem_used.saturating_sub(b.mem), g.um_used),
                    Some(_) => (g.mem_used, g.um_used.saturating_sub(b.mem)),
                };
                Usage {
                    share: g.used.saturating_sub(b.milli),
                    dev_mem,
                    um_mem,
                    holders: g.holders.saturating_sub(1),
                }
            }
            None => Usage {
                share: g.used,
                dev_mem: g.mem_used,
                um_mem: g.um_used,
                holders: g.holders,
            },
        };
        let c = &g.claimed;
        let (pm, pmem) = self.promised(i);
        Usage {
            share: u.share.saturating_add(c.milli).saturating_add(pm),
            dev_mem: u.dev_mem.saturating_add(c.mem).saturating_add(pmem),
            um_mem: u.um_mem,
            holders: u.holders.saturating_add(c.count),
        }
    }

    /// Room promised on GPU i to preemptors other than this pod: (share, memory).
    fn promised(&self, i: usize) -> (u32, u64) {
        self.gpu(i)
            .promised
            .iter()
            .filter(|p| p.uid != self.req.uid)
            .fold((0u32, 0u64), |(m, b), p| {
                (m.saturating_add(p.milli), b.saturating_add(p.mem))
            })
    }

    /// `why` a GPU does not fit, naming the claims on it when claims hold part of it
    /// and the preemptors room on it is promised to.
    fn with_claims(&self, i: usize, why: GpuWhy) -> GpuWhy {
        let g = self.gpu(i);
        let c = &g.claimed;
        let why = if c.count == 0 {
            why
        } else {
            GpuWhy::Claimed {
                why: Box::new(why),
                share: milli(c.milli.min(1000)),
                claims: c.names.clone(),
            }
        };
        let (pm, _) = self.promised(i);
        let pods: Vec<&str> = g
            .promised
            .iter()
            .filter(|p| p.uid != self.req.uid)
            .map(|p| p.pod.as_str())
            .collect();
        if pods.is_empty() {
            return why;
        }
        GpuWhy::Promised {
            why: Box::new(why),
            share: milli(pm.min(1000)),
            pods: pods.join(", "),
        }
    }

    /// Whether GPU i is one where the pod's affinity tag lives (every GPU when
    /// the tag lives nowhere yet).
    fn in_tag(&self, i: usize) -> bool {
        self.req.tag_locs.as_ref().is_none_or(|l| {
            l.contains(&(self.node_name.to_string(), self.gpu(i).info.uuid.clone()))
        })
    }

    /// Holders of tag `k` on GPU i, the pod's own booking left out when it has
    /// the tag (`own_has`).
    fn count_tag(&self, m: &BTreeMap<String, u32>, k: &str, i: usize, own_has: bool) -> u32 {
        let c = m.get(k).copied().unwrap_or(0);
        if own_has && self.mine(&self.gpu(i).info.uuid) {
            c.saturating_sub(1)
        } else {
            c
        }
    }

    /// Exclusion and anti-affinity: GPU i holds a pod the pod may not share it with.
    fn tags_check(&self, i: usize) -> Option<GpuWhy> {
        let g = self.gpu(i);
        let own_tags = self.own.map(|b| &b.tags);
        if let Some(x) = &self.d.exclusion {
            for (other, _) in g.exclusion.iter().filter(|(t, _)| *t != x) {
                let own_has = own_tags.is_some_and(|t| t.exclusion.as_ref() == Some(other));
                if self.count_tag(&g.exclusion, other, i, own_has) > 0 {
                    return Some(GpuWhy::Exclusion {
                        held: other.clone(),
                        has: x.clone(),
                    });
                }
            }
        }
        if let (Some(t), Some(k)) = (&self.d.anti_affinity, &self.req.tags.anti) {
            let own_has = own_tags.is_some_and(|t| t.anti.as_ref() == Some(k));
            if self.count_tag(&g.anti, k, i, own_has) > 0 {
                return Some(GpuWhy::AntiAffinity(t.clone()));
            }
        }
        None
    }

    /// Whether taking GPU i (at share `used`) would eat the room pending pods
    /// of another affinity tag need there.
    fn protected(&self, i: usize, used: u32) -> bool {
        self.req
            .protect
            .get(&(self.node_name.to_string(), self.gpu(i).info.uuid.clone()))
            .is_some_and(|&need| {
                1000u32
                    .saturating_sub(used)
                    .saturating_sub(u32::from(self.d.request_per_gpu().get()))
                    < need
            })
    }

    /// Whether GPU i takes a fraction `r` (thousandths): the device plugin, the
    /// tags, the share, then the memory (device mode or unified memory).
    /// `need_cache` keeps the memory need of the last GPU size seen.
    fn fraction_check(
        &self,
        i: usize,
        r: u32,
        request: Milli,
        need_cache: &mut Option<(u64, u64)>,
    ) -> Result<Fit, GpuFail> {
        let g = self.gpu(i);
        let idx = g.info.index;
        if let Some(holder) = &g.info.held_by {
            // Ranked above a full GPU: it says why a GPU with room is not used.
            return Err(GpuFail {
                rank: (1, 1000),
                idx,
                why: GpuWhy::HeldByPlugin(holder.clone()),
            });
        }
        if let Some(why) = self.tags_check(i) {
            return Err(GpuFail {
                rank: (0, 0),
                idx,
                why,
            });
        }
        let u = self.usage(i);
        let free = 1000u32.saturating_sub(u.share);
        if free < r {
            return Err(GpuFail {
                rank: (1, free),
                idx,
                why: self.with_claims(
                    i,
                    GpuWhy::Share {
                        free: milli(free),
                        request,
                    },
                ),
            });
        }
        let (mem_free, need) = self.memory_check(g, u, need_cache).map_err(|why| GpuFail {
            rank: (2, free),
            idx,
            why: self.with_claims(i, why),
        })?;
        Ok((i, u.share, mem_free, need))
    }

    /// The memory the pod needs on GPU `g` and the room its kind may still
    /// take there: device-mode pods never overcommit, unified-memory pods share
    /// what they leave, factor-fold. Returns (room, need).
    fn memory_check(
        &self,
        g: &Gpu,
        u: Usage,
        need_cache: &mut Option<(u64, u64)>,
    ) -> Result<(u64, u64), GpuWhy> {
        // mem_on divides in u128; GPUs of a node mostly share one size.
        let need = match *need_cache {
            Some((m, n)) if m == g.info.memory => n,
            _ => {
                let n = self.d.mem_on(g.info.memory);
                *need_cache = Some((g.info.memory, n));
                n
            }
        };
        if need == 0 {
            // A 0-byte cap makes every allocation of the pod fail.
            return Err(GpuWhy::ZeroCap);
        }
        let unified = self.d.um.is_some();
        let room = um_fit::room(g.info.memory, u.dev_mem, u.um_mem, unified, self.factor);
        if room < need {
            let (free, need) = (Gib(room), Gib(need));
            return Err(if unified {
                GpuWhy::UnifiedMemory {
                    free,
                    need,
                    factor: Factor(self.factor),
                }
            } else {
                GpuWhy::Memory { free, need }
            });
        }
        Ok((room, need))
    }

    /// A fraction of `want` GPUs: the GPUs that fit, ordered, and the best `want`.
    fn fraction_choice(
        &self,
        eligible: &[usize],
        request: Milli,
        want: usize,
    ) -> Result<Choice, FitError> {
        let r = u32::from(request.get());
        let mut fits: SmallVec<[Fit; 16]> = SmallVec::new();
        let mut best_fail: Option<GpuFail> = None;
        let mut need_cache: Option<(u64, u64)> = None;
        for &i in eligible {
            match self.fraction_check(i, r, request, &mut need_cache) {
                Ok(f) => fits.push(f),
                Err(f) => {
                    if best_fail.as_ref().is_none_or(|b| f.rank > b.rank) {
                        best_fail = Some(f);
                    }
                }
            }
        }
        // Affinity: a GPU that holds the tag comes first and must be among the chosen.
        let tagged = fits.iter().any(|f| self.in_tag(f.0));
        if fits.len() < want || !tagged {
            return Err(self.fraction_misfit(fits.len(), want, tagged, best_fail));
        }
        self.order_fits(&mut fits);
        Ok(self.fraction_score(&fits[..want]))
    }

    /// Why too few GPUs take the fraction: the one closest to fitting says why.
    fn fraction_misfit(
        &self,
        fit: usize,
        want: usize,
        tagged: bool,
        best_fail: Option<GpuFail>,
    ) -> FitError {
        let node = self.node_name.to_string();
        if !tagged && fit >= want {
            return FitError::TagNoRoom {
                node,
                tag: tag_name(self.d),
            };
        }
        let why = match best_fail {
            None => GpuMisfit::NoneFails { node: node.clone() },
            Some(f) => GpuMisfit::Gpu {
                node: node.clone(),
                idx: f.idx,
                why: f.why,
            },
        };
        if want > 1 {
            FitError::TooFewGpus {
                node,
                fit,
                want,
                why,
            }
        } else {
            FitError::Gpu(why)
        }
    }

    /// Best first: the tag's GPUs, then GPUs no pending tag needs, then by load
    /// (best fit, or most headroom when spreading), then by index.
    fn order_fits(&self, fits: &mut [Fit]) {
        // Mostly no pending tag anywhere: then no lookups and no allocation.
        // (Looked up once per fitting GPU before sorting, not per comparison:
        // the key is two Strings.)
        let prot: Option<Vec<bool>> = (!self.req.protect.is_empty()).then(|| {
            (0..self.node.gpus.len())
                .map(|i| {
                    fits.iter()
                        .find(|f| f.0 == i)
                        .is_some_and(|f| self.protected(f.0, f.1))
                })
                .collect()
        });
        let is_prot = |i: usize| prot.as_ref().is_some_and(|p| p[i]);
        fits.sort_by(|a, b| {
            let tag = self
                .in_tag(b.0)
                .cmp(&self.in_tag(a.0))
                .then(is_prot(a.0).cmp(&is_prot(b.0)));
            let load = if self.spread {
                a.1.cmp(&b.1).then(a.2.cmp(&b.2).reverse())
            } else {
                // Best fit: fullest GPU, then least memory left.
                b.1.cmp(&a.1).then(a.2.cmp(&b.2))
            };
            tag.then(load).then(a.0.cmp(&b.0))
        });
    }

    /// The choice of the `chosen` GPUs and the node's raw score for it.
    fn fraction_score(&self, chosen: &[Fit]) -> Choice {
        let want = chosen.len();
        let n_gpus = self.node.gpus.len() as u64;
        let mem = chosen.iter().map(|c| c.3).min().unwrap_or(0);
        let managed = self.d.um.map(|u| u.ceiling(mem));
        let avg_used = chosen.iter().map(|c| u64::from(c.1)).sum::<u64>() / want as u64;
        let (mut node_busy, mut node_used) = (0u64, 0u64);
        for i in 0..self.node.gpus.len() {
            let u = self.usage(i);
            node_busy += u64::from(u.holders > 0);
            node_used += u64::from(u.share);
        }
        let raw = if self.spread {
            (1000 - avg_used.min(1000)) * 1001
                + (1000 * n_gpus - node_used.min(1000 * n_gpus)) / n_gpus
        } else {
            avg_used.min(1000) * 1001 + node_busy * 1000 / n_gpus
        };
        let mut gpus: SmallVec<[usize; 8]> = chosen.iter().map(|c| c.0).collect();
        gpus.sort_unstable();
        Choice {
            gpus,
            mem,
            managed,
            raw,
        }
    }

    /// `want` whole GPUs: free ones (nothing booked, not held by the device
    /// plugin), with the most NVLink pairs among them.
    fn whole_choice(&self, eligible: &[usize], want: usize) -> Result<Choice, FitError> {
        if let Some(l) = &self.req.tag_locs
            && !l.is_empty()
        {
            return Err(FitError::TagNotFree {
                node: self.node_name.to_string(),
                tag: tag_name(self.d),
            });
        }
        let free: Vec<usize> = eligible
            .iter()
            .copied()
            .filter(|&i| {
                let u = self.usage(i);
                u.share == 0
                    && u.dev_mem == 0
                    && u.um_mem == 0
                    && u.holders == 0
                    && self.gpu(i).info.held_by.is_none()
            })
            .collect();
        if free.len() < want {
            let held = eligible
                .iter()
                .filter(|&&i| self.gpu(i).info.held_by.is_some())
                .count();
            return Err(FitError::WholeNotFree {
                node: self.node_name.to_string(),
                free: free.len(),
                want,
                held,
            });
        }
        let (chosen, linked) = nvlink_pick(&self.node.gpus, &free, want);
        let n_gpus = self.node.gpus.len() as u64;
        let pairs = (want * want.saturating_sub(1) / 2) as u64;
        let nvq = (linked * 1000).checked_div(pairs).unwrap_or(1000);
        let free_after = (free.len() - want) as u64 * 1000 / n_gpus;
        let pack = if self.spread {
            free_after
        } else {
            1000 - free_after
        };
        let mem = chosen
            .iter()
            .map(|&i| self.gpu(i).info.memory)
            .min()
            .unwrap_or(0);
        Ok(Choice {
            gpus: SmallVec::from_vec(chosen),
            mem,
            managed: None,
            raw: nvq * 1001 + pack,
        })
    }
}
/// Picks `want` of the `free` GPUs with the most NVLink pairs among them:
/// greedy from each seed, ties to the lowest indexes. Returns (chosen, linked pairs).
fn nvlink_pick(gpus: &[Gpu], free: &[usize], want: usize) -> (Vec<usize>, u64) {
    let linked = |a: usize, b: usize| {
        gpus[a].info.nvlink_peers.contains(&gpus[b].info.uuid)
            || gpus[b].info.nvlink_peers.contains(&gpus[a].info.uuid)
    };
    let any_links = free.iter().any(|&i| !gpus[i].info.nvlink_peers.is_empty());
    if want == 0 || free.len() == want || !any_links {
        let chosen: Vec<usize> = free.iter().copied().take(want).collect();
        let mut n = 0;
        for (x, &a) in chosen.iter().enumerate() {
            n += chosen[x + 1..].iter().filter(|&&b| linked(a, b)).count() as u64;
        }
        return (chosen, n);
    }
    let mut best: Option<(u64, Vec<usize>)> = None;
    for &seed in free {
        let mut set = vec![seed];
        let mut pairs = 0u64;
        while set.len() < want {
            let next = free
                .iter()
                .copied()
                .filter(|i| !set.contains(i))
                .map(|i| (set.iter().filter(|&&s| linked(s, i)).count() as u64, i))
                .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let Some((l, i)) = next else { break };
            pairs += l;
            set.push(i);
        }
        set.sort_unstable();
        if best
            .as_ref()
            .is_none_or(|(p, s)| pairs > *p || (pairs == *p && set < *s))
        {
            best = Some((pairs, set));
        }
    }
    best.map(|(p, s)| (s, p)).unwrap_or_default()
}
