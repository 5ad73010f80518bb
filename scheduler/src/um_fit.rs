//! The memory-fit rule of unified-memory mode (docs/um.md), pure: a GPU's memory may be
//! overcommitted by unified-memory (UM) pods, whose managed pages the driver can evict to
//! the host, up to a factor; never by device-mode pods, whose allocations cannot move.
//!
//! A GPU's books hold two figures: `device` (the caps of its device-mode pods) and `um` (the
//! resident shares of its UM pods). Then:
//! - a device-mode pod needing `need` fits when `device + um + need ≤ memory`: it takes
//!   memory nobody else is promised, so device-mode pods never overcommit;
//! - a UM pod with resident share `need` fits when `um + need ≤ factor × (memory − device)`:
//!   UM pods share, `factor`-fold, what device-mode pods leave.
//!
//! So at all times `device ≤ memory` and `um ≤ factor × (memory − device) ≤ factor × memory`.
//! `factor` is in thousandths (1000 = no overcommit), configured per extender (default
//! [`DEFAULT_UM_OVERCOMMIT_MILLI`], conservative, flag `--um-overcommit`); `placement/fit.rs`
//! decides every fraction with [`room`].

/// Default overcommit of a GPU's memory by UM pods: 1.5 ×.
pub const DEFAULT_UM_OVERCOMMIT_MILLI: u32 = 1500;
/// Largest accepted factor: 8 × (the largest managed ceiling is 8 × the resident share).
pub const MAX_UM_OVERCOMMIT_MILLI: u32 = 8000;

/// Why a pod does not fit: the memory its kind may still take, and what it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemShort {
    pub free: u64,
    pub need: u64,
}

/// Memory a pod of the given kind may still take on a GPU of `memory` bytes whose books hold
/// `device` bytes of device-mode caps and `um` bytes of UM resident shares.
pub fn room(memory: u64, device: u64, um: u64, unified: bool, factor_milli: u32) -> u64 {
    if unified {
        let base = memory.saturating_sub(device);
        let budget = (u128::from(base) * u128::from(factor_milli.max(1000)) / 1000)
            .min(u128::from(u64::MAX)) as u64;
        budget.saturating_sub(um)
    } else {
        memory.saturating_sub(device).saturating_sub(um)
    }
}

/// Whether a pod needing `need` bytes fits (its resident share when `unified`).
pub fn fits(
    memory: u64,
    device: u64,
    um: u64,
    need: u64,
    unified: bool,
    factor_milli: u32,
) -> Result<(), MemShort> {
    let free = room(memory, device, um, unified, factor_milli);
    if need <= free {
        Ok(())
    } else {
        Err(MemShort { free, need })
    }
}

/// A factor in thousandths as the flag writes it: `1500` → `1.5`.
pub fn factor_str(milli: u32) -> String {
    let frac = format!("{:03}", milli % 1000);
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() {
        format!("{}.0", milli / 1000)
    } else {
        format!("{}.{frac}", milli / 1000)
    }
}

/// A `--um-overcommit` value that is not an accepted factor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "--um-overcommit={value:?}: must be a factor from 1.0 (no overcommit) to {}.0, at most 3 decimals, such as 1.5",
    MAX_UM_OVERCOMMIT_MILLI / 1000
)]
pub struct BadFactor {
    pub value: String,
}

/// Parses the extender's `--um-overcommit` value (a factor such as `1.5`) into thousandths.
pub fn parse_factor(s: &str) -> Result<u32, BadFactor> {
    let bad = || BadFactor {
        value: s.to_string(),
    };
    let (w, f) = s.split_once('.').unwrap_or((s, ""));
    if w.is_empty()
        || (s.contains('.') && f.is_empty())
        || f.len() > 3
        || !w.bytes().chain(f.bytes()).all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let w: u32 = w.parse().map_err(|_| bad())?;
    let f: u32 = format!("{f:0<3}").parse().map_err(|_| bad())?;
    let m = w
        .checked_mul(1000)
        .and_then(|x| x.checked_add(f))
        .ok_or_else(bad)?;
    if (1000..=MAX_UM_OVERCOMMIT_MILLI).contains(&m) {
        Ok(m)
    } else {
        Err(bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn examples() {
        // 80 GiB GPU, 20 GiB device-mode, factor 1.5: UM may book 1.5 × 60 = 90 GiB.
        assert_eq!(room(80 * GIB, 20 * GIB, 0, true, 1500), 90 * GIB);
        assert_eq!(
            fits(80 * GIB, 20 * GIB, 60 * GIB, 30 * GIB, true, 1500),
            Ok(())
        );
        assert_eq!(
            fits(80 * GIB, 20 * GIB, 60 * GIB, 31 * GIB, true, 1500),
            Err(MemShort {
                free: 30 * GIB,
                need: 31 * GIB
            })
        );
        // A device-mode pod beside 60 GiB of UM shares: only what nobody is promised.
        assert_eq!(room(80 * GIB, 0, 60 * GIB, false, 1500), 20 * GIB);
        // Once UM pods overcommit, no device-mode pod gets in.
        assert_eq!(room(80 * GIB, 0, 100 * GIB, false, 1500), 0);
        // Factor 1.0 (or below, treated as 1.0) is plain sharing.
        assert_eq!(room(80 * GIB, 0, 0, true, 1000), 80 * GIB);
        assert_eq!(room(80 * GIB, 0, 0, true, 0), 80 * GIB);
        // At the type's limit.
        assert_eq!(room(u64::MAX, 0, 0, true, 8000), u64::MAX);
    }

    #[test]
    fn factor_flag() {
        assert_eq!(parse_factor("1.5"), Ok(1500));
        assert_eq!(parse_factor("1"), Ok(1000));
        assert_eq!(parse_factor("8.000"), Ok(8000));
        for m in [1000, 1500, 1250, 1001, 8000] {
            assert_eq!(parse_factor(&factor_str(m)), Ok(m));
        }
        assert_eq!(factor_str(1500), "1.5");
        for bad in [
            "0.9",
            "8.001",
            "",
            ".5",
            "1.",
            "1.2345",
            "-1",
            "x",
            "99999999999",
        ] {
            assert!(parse_factor(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        /// Any sequence of admissions and departures decided by `fits`: device-mode pods
        /// never overcommit (after a device-mode admission, device + um ≤ memory), device
        /// ≤ memory always, and UM pods' total stays within factor × memory.
        #[test]
        fn non_um_never_overcommit_and_um_stays_within_the_factor(
            memory in 1u64..=1u64 << 40,
            factor in 1000u32..=8000,
            ops in proptest::collection::vec((any::<bool>(), any::<bool>(), 1u64..=1u64 << 39), 1..60),
        ) {
            let (mut device, mut um) = (Vec::<u64>::new(), Vec::<u64>::new());
            for (unified, leave, need) in ops {
                let (d, u): (u64, u64) = (device.iter().sum(), um.iter().sum());
                if leave {
                    // Someone leaves: any pod of that kind, if there is one.
                    if unified { um.pop(); } else { device.pop(); }
                    continue;
                }
                if fits(memory, d, u, need, unified, factor).is_ok() {
                    if unified { um.push(need) } else { device.push(need) }
                    let (d, u): (u64, u64) = (device.iter().sum(), um.iter().sum());
                    if !unified {
                        prop_assert!(d as u128 + u as u128 <= memory as u128);
                    }
                }
                let (d, u): (u64, u64) = (device.iter().sum(), um.iter().sum());
                prop_assert!(d <= memory);
                prop_assert!(u as u128 * 1000 <= factor as u128 * (memory - d) as u128 + 999);
                prop_assert!(u as u128 * 1000 <= factor as u128 * memory as u128 + 999);
            }
        }
    }
}
