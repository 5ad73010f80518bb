//! Property tests: parsers round-trip what the writers produce and never panic.

use std::collections::BTreeMap;

use kubeshare_api::resource_config::is_valid_id;
use kubeshare_api::{
    ClientClass, GpuDemand, GpuShare, GroupSpec, Milli, NodeInventory, ResourceConfig,
    ResourceEntry, UmSpec, parse_bytes,
};
use proptest::prelude::*;

fn milli(lo: u16, hi: u16) -> impl Strategy<Value = Milli> {
    (lo..=hi).prop_map(|v| Milli::new(v).unwrap())
}

fn tag() -> impl Strategy<Value = String> {
    "[a-z0-9]([a-z0-9._-]{0,20}[a-z0-9])?"
}

fn demand() -> impl Strategy<Value = GpuDemand> {
    let fraction = (milli(1, 1000), 0u16..=1000, 1u8..=16).prop_map(|(limit, r, count)| {
        let request = Milli::new(r.min(limit.get())).unwrap();
        GpuShare::Fraction {
            request,
            limit,
            count,
        }
    });
    let whole = (2u16..=64).prop_map(|gpus| GpuShare::Whole { gpus });
    let group =
        (tag(), 1u32..=10_000, milli(1, 1000)).prop_map(|(name, headcount, threshold)| GroupSpec {
            name,
            headcount,
            threshold,
        });
    (
        prop_oneof![fraction, whole],
        proptest::option::of(1u64..=u64::MAX),
        proptest::option::of("[A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?"),
        0u8..=100,
        proptest::option::of(group),
        proptest::option::of(tag()),
        proptest::option::of(tag()),
        proptest::option::of(tag()),
        proptest::option::of(proptest::option::of(1u64..=u64::MAX)),
    )
        .prop_map(
            |(share, mem, model, priority, group, affinity, anti_affinity, exclusion, um)| {
                let whole = matches!(share, GpuShare::Whole { .. });
                // Unified mode is for fractional pods; a written ceiling lies in
                // [gpu_mem, 8 × gpu_mem] when gpu_mem is written.
                let um = um.filter(|_| !whole).map(|m| UmSpec {
                    managed: m.map(|m| match mem {
                        Some(r) => m.clamp(r, r.saturating_mul(8)),
                        None => m,
                    }),
                });
                GpuDemand {
                    share,
                    mem,
                    model,
                    priority,
                    group,
                    affinity,
                    anti_affinity,
                    exclusion,
                    um,
                }
            },
        )
}

fn entry() -> impl Strategy<Value = ResourceEntry> {
    (
        "[A-Za-z0-9_.:-]{1,40}",
        milli(0, 1000),
        milli(0, 1000),
        any::<u64>(),
        prop_oneof![
            Just(ClientClass::Guaranteed),
            Just(ClientClass::Opportunistic)
        ],
    )
        .prop_map(|(id, a, b, gpu_mem, class)| ResourceEntry {
            id,
            request: a.min(b),
            limit: a.max(b),
            gpu_mem,
            class,
        })
        .prop_filter("a valid client ID", |e| is_valid_id(&e.id))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn demand_round_trips(d in demand()) {
        let back = GpuDemand::from_labels(&d.to_labels()).unwrap().unwrap();
        prop_assert_eq!(back, d);
    }

    #[test]
    fn config_round_trips(entries in proptest::collection::vec(entry(), 0..20)) {
        let mut seen = std::collections::HashSet::new();
        let entries: Vec<_> = entries.into_iter().filter(|e| seen.insert(e.id.clone())).collect();
        let c = ResourceConfig { entries };
        prop_assert_eq!(ResourceConfig::parse(&c.render()).unwrap(), c);
    }

    /// A file of guaranteed clients is Gemini's four-column format, and a four-column file
    /// reads as guaranteed clients.
    #[test]
    fn guaranteed_configs_are_four_columns(entries in proptest::collection::vec(entry(), 0..20)) {
        let mut seen = std::collections::HashSet::new();
        let entries: Vec<_> = entries
            .into_iter()
            .filter(|e| seen.insert(e.id.clone()))
            .map(|e| ResourceEntry { class: ClientClass::Guaranteed, ..e })
            .collect();
        let text = ResourceConfig { entries }.render();
        prop_assert!(text.lines().skip(1).all(|l| l.split_whitespace().count() == 4), "{}", text);
        let back = ResourceConfig::parse(&text).unwrap();
        prop_assert!(back.entries.iter().all(|e| e.class == ClientClass::Guaranteed));
        prop_assert_eq!(back.render(), text);
    }

    #[test]
    fn milli_round_trips(v in 0u16..=1000) {
        let m = Milli::new(v).unwrap();
        prop_assert_eq!(Milli::parse(&m.to_string()).unwrap(), m);
    }

    #[test]
    fn label_parser_never_panics(
        pairs in proptest::collection::btree_map(
            prop_oneof![
                Just("sharedgpu/gpu_request".to_string()),
                Just("sharedgpu/gpu_limit".to_string()),
                Just("sharedgpu/gpu_mem".to_string()),
                Just("sharedgpu/gpu_count".to_string()),
                Just("sharedgpu/priority".to_string()),
                Just("sharedgpu/group_name".to_string()),
                Just("sharedgpu/group_headcount".to_string()),
                Just("sharedgpu/group_threshold".to_string()),
                "sharedgpu/\\PC{0,12}",
                "\\PC{0,12}",
            ],
            prop_oneof!["\\PC{0,24}", "[0-9.eE+-]{0,12}", "[0-9]{1,30}(Ki|Mi|Gi|k|M|G|e9)?"],
            0..8,
        )
    ) {
        let _ = GpuDemand::from_labels(&pairs);
    }

    #[test]
    fn other_parsers_never_panic(s in "\\PC{0,200}") {
        let _ = ResourceConfig::parse(&s);
        let _ = NodeInventory::parse(&s);
        let _ = parse_bytes(&s);
        let _ = Milli::parse(&s);
        let mut a = BTreeMap::new();
        a.insert("sharedgpu/gpu_uuid".to_string(), s.clone());
        let _ = kubeshare_api::Allocation::from_annotations(&a);
    }

    #[test]
    fn config_lines_never_panic(lines in proptest::collection::vec("[ -~]{0,40}", 0..6)) {
        let _ = ResourceConfig::parse(&lines.join("\n"));
    }

    #[test]
    fn every_u64_reads_back(v in any::<u64>()) {
        prop_assert_eq!(parse_bytes(&v.to_string()), Ok(v));
    }

    #[test]
    fn quantities_match_exact_arithmetic(
        n in 0u64..1_000_000,
        frac in proptest::option::of(0u32..1000),
        suffix in 0usize..14,
    ) {
        // (suffix, multiplier as numerator, as a power of ten exponent or of two)
        const S: [(&str, u32, bool); 14] = [
            ("", 0, false), ("k", 3, false), ("M", 6, false), ("G", 9, false),
            ("T", 12, false), ("P", 15, false), ("E", 18, false),
            ("Ki", 10, true), ("Mi", 20, true), ("Gi", 30, true), ("Ti", 40, true),
            ("Pi", 50, true), ("Ei", 60, true), ("e9", 9, false),
        ];
        let (sfx, k, binary) = S[suffix];
        // value = (n + f/1000) * mult, exactly, in u128.
        let (num, den): (u128, u128) = match frac {
            None => (u128::from(n), 1),
            Some(f) => (u128::from(n) * 1000 + u128::from(f), 1000),
        };
        let mult: u128 = if binary { 1u128 << k } else { 10u128.pow(k) };
        let text = match frac {
            None => format!("{n}{sfx}"),
            Some(f) => format!("{n}.{f:03}{sfx}"),
        };
        let want = if !(num * mult).is_multiple_of(den) {
            Err(kubeshare_api::QuantityError::Fractional)
        } else {
            u64::try_from(num * mult / den).map_err(|_| kubeshare_api::QuantityError::Overflow)
        };
        prop_assert_eq!(parse_bytes(&text), want, "{}", text);
    }
}
