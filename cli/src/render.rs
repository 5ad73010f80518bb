//! Draws a [`ClusterView`] as text: one row per GPU, its pods below it, bars for
//! shares and memory. Pure: the same view always gives the same text.

use std::fmt::Write as _;

use kubeshare_api::Milli;

use crate::delivered::Delivered;
use crate::model::{ClusterView, GpuView, PendingPod, PodShare};

/// Cells in a bar.
pub const BAR_WIDTH: usize = 10;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// Full GPU UUIDs instead of their first group (also used when first groups
    /// collide), and whole scheduler messages instead of their first 160 characters.
    pub wide: bool,
    /// Delivered shares from the node daemons' metrics (empty: not shown).
    pub delivered: Delivered,
}

/// How many of `BAR_WIDTH` cells `part` of `whole` fills. A non-zero part shows at
/// least one cell and a part short of the whole never fills the bar, so the
/// picture never rounds a small share away or a nearly full GPU up to full.
fn cells(part: u128, whole: u128) -> usize {
    if whole == 0 || part == 0 {
        return 0;
    }
    if part >= whole {
        return BAR_WIDTH;
    }
    let w = BAR_WIDTH as u128;
    let n = (part * w * 2 + whole) / (whole * 2);
    (n as usize).clamp(1, BAR_WIDTH - 1)
}

/// `[###==-----]`: `#` for `solid` of `whole`, `=` up to `solid + burst`, `-` free.
/// Past the whole, the bar is full and ends in `!` instead of `]`.
pub fn bar(solid: u128, burst: u128, whole: u128) -> String {
    let s = cells(solid, whole);
    let total = cells(solid + burst, whole).max(s);
    let over = solid + burst > whole;
    let mut out = String::with_capacity(BAR_WIDTH + 2);
    out.push('[');
    out.extend(std::iter::repeat_n('#', s));
    out.extend(std::iter::repeat_n('=', total - s));
    out.extend(std::iter::repeat_n('-', BAR_WIDTH - total));
    out.push(if over { '!' } else { ']' });
    out
}

/// Thousandths as a decimal: two places, three when needed (`0.50`, `0.125`, `3.25`).
pub fn fmt_share(milli: u32) -> String {
    let (whole, frac) = (milli / 1000, milli % 1000);
    if frac % 10 == 0 {
        format!("{whole}.{:02}", frac / 10)
    } else {
        format!("{whole}.{frac:03}")
    }
}

/// Bytes in binary units with one decimal (`20.0Gi`, `512.0Mi`, `1.5Ti`).
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["Ki", "Mi", "Gi", "Ti", "Pi"];
    if b < 1024 {
        return format!("{b}B");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1}{}", UNITS[unit])
}

fn short_uuid(uuid: &str, wide: bool) -> String {
    if wide {
        return uuid.to_string();
    }
    // `GPU-8d9e5c3a-...` -> `GPU-8d9e5c3a`: the first group tells GPUs apart.
    let mut parts = uuid.splitn(3, '-');
    match (parts.next(), parts.next()) {
        (Some(p), Some(g)) => format!("{p}-{g}"),
        _ => uuid.to_string(),
    }
}

/// Left-aligned columns separated by two spaces; trailing blanks trimmed.
fn table(rows: &[Vec<String>]) -> Vec<String> {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0; cols];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    rows.iter()
        .map(|r| {
            let mut line = String::new();
            for (i, c) in r.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(c);
                let pad = widths[i].saturating_sub(c.chars().count());
                line.extend(std::iter::repeat_n(' ', pad));
            }
            line.trim_end().to_string()
        })
        .collect()
}

fn share_cells(request: Milli, limit: Milli, whole: bool) -> (String, String) {
    let r = u128::from(request.get());
    let l = u128::from(limit.get());
    let b = bar(r, l.saturating_sub(r), 1000);
    let text = if whole {
        "whole GPU".to_string()
    } else {
        format!(
            "{}/{}",
            fmt_share(u32::from(request.get())),
            fmt_share(u32::from(limit.get()))
        )
    };
    (b, text)
}

fn gpu_row(node: &str, g: &GpuView, wide: bool) -> Vec<String> {
    let req = g.requested();
    let mem = g.mem_allocated();
    vec![
        node.to_string(),
        g.index.to_string(),
        g.model.clone(),
        short_uuid(&g.uuid, wide),
        format!("{} {}", bar(u128::from(req), 0, 1000), fmt_share(req)),
        format!(
            "{} {}/{}",
            bar(u128::from(mem), 0, u128::from(g.memory)),
            fmt_bytes(mem),
            fmt_bytes(g.memory)
        ),
        g.pods.len().to_string(),
    ]
}

fn pod_row(glyph: &str, p: &PodShare, delivered: &Delivered) -> Vec<String> {
    let (b, text) = share_cells(p.request, p.limit, p.whole);
    // What gem-schd delivered over its window, where a node daemon reported it.
    let got = delivered
        .get(&(p.namespace.clone(), p.name.clone(), p.gpu_uuid.clone()))
        .map(|v| format!(" got {v:.2}"))
        .unwrap_or_default();
    vec![
        format!("{glyph} {}/{}", p.namespace, p.name),
        p.phase.clone(),
        format!("{b} {text}{got}"),
        match p.resident {
            // Both figures of a unified-memory pod: what it keeps on the GPU, what it may hold.
            Some(r) => format!("{} resident, {} managed", fmt_bytes(r), fmt_bytes(p.mem)),
            None => fmt_bytes(p.mem),
        },
        p.tags.join(" "),
    ]
}

/// Longest scheduler message shown without `--wide`.
pub const REASON_WIDTH: usize = 160;

fn pending_row(p: &PendingPod, wide: bool) -> Vec<String> {
    let (_, text) = share_cells(p.request, p.limit, p.whole);
    let ask = if p.whole {
        format!("{} whole GPUs", p.gpus)
    } else if p.gpus > 1 {
        format!("{text} x{}", p.gpus)
    } else {
        text
    };
    vec![
        format!("{}/{}", p.namespace, p.name),
        ask,
        p.tags.join(" "),
        if wide || p.reason.chars().count() <= REASON_WIDTH {
            p.reason.clone()
        } else {
            let cut: String = p.reason.chars().take(REASON_WIDTH - 3).collect();
            format!("{cut}...")
        },
    ]
}

/// The table `kubectl sharedgpu` prints.
pub fn render(view: &ClusterView, opts: RenderOptions) -> String {
    let mut out = String::new();
    let gpus: Vec<&GpuView> = view.nodes.iter().flat_map(|n| &n.gpus).collect();
    // Short UUIDs only while they still tell every GPU apart.
    let short: std::collections::BTreeSet<String> =
        gpus.iter().map(|g| short_uuid(&g.uuid, false)).collect();
    let full_uuids = opts.wide || short.len() < gpus.len();
    if view.nodes.is_empty() {
        out.push_str(
            "No node publishes a KubeShare GPU inventory (annotation sharedgpu/inventory).\n",
        );
        out.push_str("Is the node daemon running?\n");
    } else {
        // Pods are laid out as one table of their own, so their columns line up
        // across GPUs without widening the GPU rows.
        let mut gpu_rows = vec![vec![
            "NODE".to_string(),
            "GPU".into(),
            "MODEL".into(),
            "UUID".into(),
            "SHARE REQUESTED".into(),
            "MEMORY ALLOCATED".into(),
            "PODS".into(),
        ]];
        let mut pod_rows: Vec<Vec<String>> = Vec::new();
        // Which pod rows follow GPU row i.
        // The header row has no pods.
        let mut pods_after: Vec<std::ops::Range<usize>> = std::iter::once(0..0).collect();
        let mut errors: Vec<(usize, String)> = Vec::new();
        for n in &view.nodes {
            if let Some(e) = &n.inventory_error {
                errors.push((
                    gpu_rows.len(),
                    format!("{}: inventory unreadable: {e}", n.name),
                ));
            }
            for (i, g) in n.gpus.iter().enumerate() {
                let shown_name = if i == 0 { n.name.as_str() } else { "" };
                gpu_rows.push(gpu_row(shown_name, g, full_uuids));
                let start = pod_rows.len();
                for (j, p) in g.pods.iter().enumerate() {
                    let glyph = if j + 1 == g.pods.len() {
                        "└─"
                    } else {
                        "├─"
                    };
                    pod_rows.push(pod_row(glyph, p, &opts.delivered));
                }
                pods_after.push(start..pod_rows.len());
            }
        }
        let gpu_lines = table(&gpu_rows);
        let pod_lines = table(&pod_rows);
        // Pods hang under the GPU column, below their GPU.
        let indent = " ".repeat(gpu_lines[0].find("GPU").unwrap_or(4));
        for (i, line) in gpu_lines.iter().enumerate() {
            for (at, e) in &errors {
                if *at == i {
                    let _ = writeln!(out, "{e}");
                }
            }
            let _ = writeln!(out, "{line}");
            if let Some(r) = pods_after.get(i) {
                for l in &pod_lines[r.clone()] {
                    let _ = writeln!(out, "{indent}{l}");
                }
            }
        }
        for (at, e) in &errors {
            if *at >= gpu_lines.len() {
                let _ = writeln!(out, "{e}");
            }
        }
        out.push_str("\nshare bars: # guaranteed (gpu_request)  = burst up to gpu_limit  - free  ! over 1.0\n");
    }

    let requested: u32 = gpus.iter().map(|g| g.requested()).sum();
    let mem: u64 = gpus
        .iter()
        .fold(0u64, |m, g| m.saturating_add(g.mem_allocated()));
    let mem_total: u64 = gpus.iter().fold(0u64, |m, g| m.saturating_add(g.memory));
    let placed: std::collections::BTreeSet<(&str, &str)> = gpus
        .iter()
        .flat_map(|g| &g.pods)
        .map(|p| (p.namespace.as_str(), p.name.as_str()))
        .collect();
    let _ = writeln!(
        out,
        "\n{} GPU nodes, {} GPUs: {} of {} GPUs requested, {} of {} memory allocated; {} pods placed, {} pending",
        view.nodes.len(),
        gpus.len(),
        fmt_share(requested),
        gpus.len(),
        fmt_bytes(mem),
        fmt_bytes(mem_total),
        placed.len(),
        view.pending.len(),
    );

    if !view.pending.is_empty() {
        out.push_str("\nPENDING (KubeShare pods without a GPU yet)\n");
        let mut rows = vec![vec![
            "POD".to_string(),
            "ASKS".into(),
            "TAGS".into(),
            "WHY".into(),
        ]];
        rows.extend(view.pending.iter().map(|p| pending_row(p, opts.wide)));
        for l in table(&rows) {
            let _ = writeln!(out, "  {l}");
        }
    }
    if !view.stray.is_empty() {
        out.push_str("\nALLOCATED ON A GPU THAT NO NODE INVENTORY LISTS\n");
        let rows: Vec<Vec<String>> = view
            .stray
            .iter()
            .map(|p| {
                let mut r = pod_row("-", p, &opts.delivered);
                r.insert(1, format!("{} {}", p.node, p.gpu_uuid));
                r
            })
            .collect();
        for l in table(&rows) {
            let _ = writeln!(out, "  {l}");
        }
    }
    if !view.broken.is_empty() {
        out.push_str("\nINVALID (KubeShare pods whose labels or annotations do not parse)\n");
        for b in &view.broken {
            let _ = writeln!(out, "  {}/{}: {}", b.namespace, b.name, b.error);
        }
    }
    let mut notes = Vec::new();
    if view.nodes_without_gpus > 0 {
        notes.push(format!(
            "{} nodes without a GPU inventory",
            view.nodes_without_gpus
        ));
    }
    if view.finished > 0 {
        notes.push(format!("{} finished pods", view.finished));
    }
    if !notes.is_empty() {
        let _ = writeln!(out, "(not shown: {})", notes.join(", "));
    }
    out
}
