//! Whether and how one pod fits on one node: the GPUs it would get, the memory
//! cap, and the node's raw score; or the reason it does not fit. Pure: reads the
//! books, changes nothing.

use std::collections::BTreeMap;

use kubeshare_api::GpuShare;
use smallvec::SmallVec;

use super::{Choice, Cluster, Gpu, GpuFail, Req, Why, gib, milli};
use crate::um_fit;

impl Cluster {
    /// Whether and how the pod fits on `node`. `Err((reason, unresolvable))`.
    pub(super) fn evaluate(&self, req: &Req, node_name: &str) -> Result<Choice, (String, bool)> {
        let Some(node) = self.nodes.get(node_name) else {
            let msg = self
                .node_problems
                .get(node_name)
                .cloned()
                .unwrap_or_else(|| format!("{node_name}: not a KubeShare GPU node"));
            return Err((msg, true));
        };
        let d = req.demand;
        let own = req.own;
        // The pod's own stale booking (an interrupted bind) does not count against it.
        let mine = |uuid: &str| own.is_some_and(|b| b.on(node_name, uuid));
        // Inline up to 16 GPUs: no allocation per node evaluated (issue 17).
        let eligible: SmallVec<[usize; 16]> = (0..node.gpus.len())
            .filter(|&i| {
                d.model
                    .as_ref()
                    .is_none_or(|m| node.gpus[i].info.model == *m)
            })
            .collect();
        if eligible.is_empty() {
            let mut models: Vec<&str> = node.gpus.iter().map(|g| g.info.model.as_str()).collect();
            models.dedup();
            return Err((
                format!(
                    "{node_name}: no {} GPU (has {})",
                    d.model.as_deref().unwrap_or("?"),
                    models.join(", ")
                ),
                true,
            ));
        }
        let group_bonus: u64 = if req.group_nodes.contains(node_name) {
            10_000_000
        } else {
            0
        };
        let tag_gpus = req.tag_locs.as_ref();
        let in_tag = |i: usize| {
            tag_gpus.is_none_or(|l| {
                l.contains(&(node_name.to_string(), node.gpus[i].info.uuid.clone()))
            })
        };
        if let Some(l) = tag_gpus
            && !l.iter().any(|(n, _)| n == node_name)
        {
            let (n, u) = l.iter().next().cloned().unwrap_or_default();
            let where_ = self
                .nodes
                .get(&n)
                .and_then(|nn| nn.by_uuid.get(&u).map(|&i| nn.gpus[i].info.index))
                .map_or(n.clone(), |i| format!("{n}/gpu {i}"));
            return Err((
                format!(
                    "{node_name}: affinity tag {} lives on {where_}",
                    d.affinity.as_deref().unwrap_or("")
                ),
                // Unresolvable: no eviction on this node can bring the tag here.
                true,
            ));
        }
        // Usage of GPU i, leaving out the pod's own booking: (share, device-mode
        // caps, unified-memory resident shares, holders).
        let usage = |i: usize| -> (u32, u64, u64, u32) {
            let g = &node.gpus[i];
            match own.filter(|b| b.on(node_name, &g.info.uuid)) {
                Some(b) => {
                    let (dev, um) = match b.managed {
                        None => (g.mem_used.saturating_sub(b.mem), g.um_used),
                        Some(_) => (g.mem_used, g.um_used.saturating_sub(b.mem)),
                    };
                    (
                        g.used.saturating_sub(b.milli),
                        dev,
                        um,
                        g.holders.saturating_sub(1),
                    )
                }
                None => (g.used, g.mem_used, g.um_used, g.holders),
            }
        };
        let unified = d.um.is_some();
        let factor = self.cfg.um_overcommit_milli;
        let count_tag = |m: &BTreeMap<String, u32>, k: &str, i: usize, own_has: bool| -> u32 {
            let c = m.get(k).copied().unwrap_or(0);
            if own_has && mine(&node.gpus[i].info.uuid) {
                c.saturating_sub(1)
            } else {
                c
            }
        };
        let own_tags = own.map(|b| b.tags.clone()).unwrap_or_default();
        let tag_fail = |i: usize| -> Option<String> {
            let g = &node.gpus[i];
            let idx = g.info.index;
            if let Some(x) = &d.exclusion {
                for (other, _) in g.exclusion.iter().filter(|(t, _)| *t != x) {
                    let own_has = own_tags.exclusion.as_ref() == Some(other);
                    if count_tag(&g.exclusion, other, i, own_has) > 0 {
                        return Some(format!(
                            "{node_name}/gpu {idx}: holds exclusion tag {other}, pod has {x}"
                        ));
                    }
                }
            }
            if let (Some(t), Some(k)) = (&d.anti_affinity, &req.tags.anti) {
                let own_has = own_tags.anti.as_ref() == Some(k);
                if count_tag(&g.anti, k, i, own_has) > 0 {
                    return Some(format!(
                        "{node_name}/gpu {idx}: already holds a pod with anti-affinity tag {t}"
                    ));
                }
            }
            None
        };
        let n_gpus = node.gpus.len() as u64;
        // The first pod of an affinity tag takes the GPU with the most headroom,
        // so that the tag's later pods find room next to it.
        let spread = d.priority > 0 || (d.affinity.is_some() && tag_gpus.is_none());
        // Taking this GPU would eat the room pending pods of another tag need.
        // (Looked up once per fitting GPU before sorting, not per comparison: the key
        // is two Strings.)
        let protected = |i: usize, used: u32| -> bool {
            req.protect
                .get(&(node_name.to_string(), node.gpus[i].info.uuid.clone()))
                .is_some_and(|&need| {
                    1000u32
                        .saturating_sub(used)
                        .saturating_sub(u32::from(d.request_per_gpu().get()))
                        < need
                })
        };
        match d.share {
            GpuShare::Fraction { request, count, .. } => {
                let r = u32::from(request.get());
                let mut fits: SmallVec<[(usize, u32, u64, u64); 16]> = SmallVec::new(); // (i, used, mem_free, need)
                let mut best_fail: Option<GpuFail> = None;
                let mut note = |f: GpuFail| {
                    if best_fail.as_ref().is_none_or(|b| f.rank > b.rank) {
                        best_fail = Some(f);
                    }
                };
                let mut need_cache: Option<(u64, u64)> = None;
                for &i in &eligible {
                    let g = &node.gpus[i];
                    let idx = g.info.index;
                    if let Some(holder) = &g.info.held_by {
                        // Ranked above a full GPU: it says why a GPU with room is not used.
                        note(GpuFail {
                            rank: (1, 1000),
                            why: Why::Text(format!(
                                "{node_name}/gpu {idx}: given whole to pod {holder} by the NVIDIA device plugin"
                            )),
                        });
                        continue;
                    }
                    if let Some(m) = tag_fail(i) {
                        note(GpuFail {
                            rank: (0, 0),
                            why: Why::Text(m),
                        });
                        continue;
                    }
                    let (used, dev_mem, um_mem, _) = usage(i);
                    let free = 1000u32.saturating_sub(used);
                    if free < r {
                        note(GpuFail {
                            rank: (1, free),
                            why: Why::Share { idx, free },
                        });
                        continue;
                    }
                    // mem_on divides in u128; GPUs of a node mostly share one size.
                    let need = match need_cache {
                        Some((m, n)) if m == g.info.memory => n,
                        _ => {
                            let n = d.mem_on(g.info.memory);
                            need_cache = Some((g.info.memory, n));
                            n
                        }
                    };
                    if need == 0 {
                        // A 0-byte cap makes every allocation of the pod fail.
                        note(GpuFail {
                            rank: (2, free),
                            why: Why::Text(format!(
                                "{node_name}/gpu {idx}: the memory cap would be 0 bytes (gpu_request 0 and no gpu_mem): set sharedgpu/gpu_mem"
                            )),
                        });
                        continue;
                    }
                    // What this pod's kind may still take: device-mode pods never
                    // overcommit, unified-memory pods share what they leave, factor-fold.
                    let mem_free = um_fit::room(g.info.memory, dev_mem, um_mem, unified, factor);
                    if mem_free < need {
                        note(GpuFail {
                            rank: (2, free),
                            why: Why::Mem {
                                idx,
                                free: mem_free,
                                need,
                            },
                        });
                        continue;
                    }
                    fits.push((i, used, mem_free, need));
                }
                let want = usize::from(count);
                // Affinity: a GPU that holds the tag comes first and must be among the chosen.
                let tagged = fits.iter().any(|f| in_tag(f.0));
                if fits.len() < want || !tagged {
                    let why = match best_fail.map(|f| f.why) {
                        None => format!("{node_name}: no GPU fits"),
                        Some(Why::Text(m)) => m,
                        Some(Why::Share { idx, free }) => format!(
                            "{node_name}/gpu {idx}: {} free < {request} requested",
                            milli(free)
                        ),
                        Some(Why::Mem { idx, free, need }) if unified => format!(
                            "{node_name}/gpu {idx}: {} of unified-memory room ({} × what device-mode pods leave) < {} resident requested",
                            gib(free),
                            um_fit::factor_str(factor),
                            gib(need)
                        ),
                        Some(Why::Mem { idx, free, need }) => format!(
                            "{node_name}/gpu {idx}: {} memory free < {} requested",
                            gib(free),
                            gib(need)
                        ),
                    };
                    let msg = if !tagged && fits.len() >= want {
                        format!(
                            "{node_name}: the GPUs holding affinity tag {} have no room",
                            d.affinity.as_deref().unwrap_or("")
                        )
                    } else if want > 1 {
                        format!("{node_name}: {} of {want} GPUs fit; {why}", fits.len())
                    } else {
                        why
                    };
                    return Err((msg, false));
                }
                // Mostly no pending tag anywhere: then no lookups and no allocation.
                let prot: Option<Vec<bool>> = (!req.protect.is_empty()).then(|| {
                    (0..node.gpus.len())
                        .map(|i| {
                            fits.iter()
                                .find(|f| f.0 == i)
                                .is_some_and(|f| protected(f.0, f.1))
                        })
                        .collect()
                });
                let is_prot = |i: usize| prot.as_ref().is_some_and(|p| p[i]);
                fits.sort_by(|a, b| {
                    let tag = in_tag(b.0)
                        .cmp(&in_tag(a.0))
                        .then(is_prot(a.0).cmp(&is_prot(b.0)));
                    let load = if spread {
                        a.1.cmp(&b.1).then(a.2.cmp(&b.2).reverse())
                    } else {
                        // Best fit: fullest GPU, then least memory left.
                        b.1.cmp(&a.1).then(a.2.cmp(&b.2))
                    };
                    tag.then(load).then(a.0.cmp(&b.0))
                });
                let chosen = &fits[..want];
                let mem = chosen.iter().map(|c| c.3).min().unwrap_or(0);
                let managed = d.um.map(|u| u.ceiling(mem));
                let avg_used = chosen.iter().map(|c| u64::from(c.1)).sum::<u64>() / want as u64;
                let (mut node_busy, mut node_used) = (0u64, 0u64);
                for i in 0..node.gpus.len() {
                    let (u, _, _, h) = usage(i);
                    node_busy += u64::from(h > 0);
                    node_used += u64::from(u);
                }
                let raw = if spread {
                    (1000 - avg_used.min(1000)) * 1001
                        + (1000 * n_gpus - node_used.min(1000 * n_gpus)) / n_gpus
                } else {
                    avg_used.min(1000) * 1001 + node_busy * 1000 / n_gpus
                };
                let mut gpus: SmallVec<[usize; 8]> = chosen.iter().map(|c| c.0).collect();
                gpus.sort_unstable();
                Ok(Choice {
                    gpus,
                    mem,
                    managed,
                    raw: group_bonus + raw,
                })
            }
            GpuShare::Whole { gpus: want } => {
                let want = usize::from(want);
                if let Some(l) = tag_gpus
                    && !l.is_empty()
                {
                    return Err((
                        format!(
                            "{node_name}: affinity tag {} is held by GPUs that are not free",
                            d.affinity.as_deref().unwrap_or("")
                        ),
                        false,
                    ));
                }
                let free: Vec<usize> = eligible
                    .iter()
                    .copied()
                    .filter(|&i| {
                        let (u, m, um, h) = usage(i);
                        u == 0 && m == 0 && um == 0 && h == 0 && node.gpus[i].info.held_by.is_none()
                    })
                    .collect();
                if free.len() < want {
                    let held = eligible
                        .iter()
                        .filter(|&&i| node.gpus[i].info.held_by.is_some())
                        .count();
                    let by_plugin = if held > 0 {
                        format!(" ({held} given whole to pods by the NVIDIA device plugin)")
                    } else {
                        String::new()
                    };
                    return Err((
                        format!(
                            "{node_name}: {} of {want} whole GPUs free{by_plugin}",
                            free.len()
                        ),
                        false,
                    ));
                }
                let (chosen, linked) = nvlink_pick(&node.gpus, &free, want);
                let pairs = (want * want.saturating_sub(1) / 2) as u64;
                let nvq = (linked * 1000).checked_div(pairs).unwrap_or(1000);
                let free_after = (free.len() - want) as u64 * 1000 / n_gpus;
                let pack = if spread {
                    free_after
                } else {
                    1000 - free_after
                };
                let mem = chosen
                    .iter()
                    .map(|&i| node.gpus[i].info.memory)
                    .min()
                    .unwrap_or(0);
                Ok(Choice {
                    gpus: SmallVec::from_vec(chosen),
                    mem,
                    managed: None,
                    raw: group_bonus + nvq * 1001 + pack,
                })
            }
        }
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
