//! The usage report gem-schd writes for the node daemon (`--usage-file`): per
//! configured client, the GPU time charged over the accounting window (its turns less what
//! co-runners took of them, plus its co-holds with what they were charged, also on their
//! own), its fill and the memory counted for it (format: `kubeshare_api::usage`). Built from
//! the core (pure), written atomically (a temporary file, then `rename`) so a reader never
//! sees half of it.

use std::io::Write as _;
use std::path::Path;

use kubeshare_api::{ClientUsage, UsageReport};

use crate::core::{Core, Micros};

/// The report at `now`, clients sorted by ID (the core keeps them in a hash map).
pub fn report(core: &Core, now: Micros) -> UsageReport {
    let mut clients: Vec<ClientUsage> = core
        .client_ids()
        .map(|id| ClientUsage {
            id: id.to_string(),
            // GPU time: its turns less what co-runners took of them, plus its co-holds.
            used_us: core.usage_us(now, id).unwrap_or(0),
            mem_used: core.mem_used(id).unwrap_or(0),
            fill_milli: core
                .fill(id)
                .map(|f| (f.clamp(0.0, 1.0) * 1000.0).round() as u16),
            co_used_us: core.co_usage_us(now, id).unwrap_or(0),
            // Filled in by the daemon, which knows the connections.
            pids: Vec::new(),
        })
        .collect();
    clients.sort_by(|a, b| a.id.cmp(&b.id));
    UsageReport {
        window_us: core.params().window_us,
        at_us: now,
        clients,
        refused: Vec::new(),
    }
}

/// Replaces `path` with `report`.
pub fn write(path: &Path, report: &UsageReport) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(report.render().as_bytes())?;
    }
    std::fs::rename(&tmp, path)
}
