//! Properties of the DRA claim configuration: it never panics on any input, its
//! canonical JSON reads back to the same value, and it accepts exactly what the
//! `sharedgpu/*` labels accept for the same share of one GPU (whole GPUs are a claim's
//! device count, which the config refuses).

use kubeshare_api::dra::{CONFIG_API_VERSION, CONFIG_KIND, ConfigError, Consumed, ShareConfig};
use kubeshare_api::{GpuDemand, GpuShare, Milli, UmSpec};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
        share_text().prop_map(Value::String),
        bytes_text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "apiVersion",
            "kind",
            "request",
            "limit",
            "memory",
            "memoryMode",
            "managedMemory",
            "priority",
        ])
        .prop_map(String::from),
        "[a-zA-Z]{1,8}",
    ]
}

/// Shares as people write them, valid or not.
fn share_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..1300).prop_map(|v| format!("{}.{:03}", v / 1000, v % 1000)),
        (0u32..1300).prop_map(|v| Milli::new(v.min(1000) as u16).unwrap().to_string()),
        prop::sample::select(vec![
            "0", "1", "2", "0.5", ".5", "1.", "-0.5", "0.1234", "1.0001", "abc", "", "0.0",
        ])
        .prop_map(String::from),
    ]
}

/// Byte counts as people write them, valid or not.
fn bytes_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (1u64..64).prop_map(|g| format!("{g}Gi")),
        (0u64..1 << 36).prop_map(|b| b.to_string()),
        prop::sample::select(vec![
            "0", "-1", "1.5Gi", "0.5", "4GB", "1e9", "512Mi", "16Ei", "1Ei", "",
        ])
        .prop_map(String::from),
    ]
}

fn config_value(fields: &[(&str, Option<String>)]) -> Value {
    let mut o = Map::new();
    o.insert("apiVersion".into(), CONFIG_API_VERSION.into());
    o.insert("kind".into(), CONFIG_KIND.into());
    for (k, v) in fields {
        if let Some(v) = v {
            o.insert((*k).into(), v.clone().into());
        }
    }
    Value::Object(o)
}

fn valid_config() -> impl Strategy<Value = ShareConfig> {
    (
        0u16..=1000,
        0u16..=1000,
        prop::option::of(1u64..1 << 40),
        prop::option::of(prop::option::of(1u64..=8)),
        any::<(bool, bool)>(),
        prop::option::of(0u8..=100),
    )
        .prop_map(|(a, b, memory, um, (has_req, has_lim), priority)| {
            let (lo, hi) = (a.min(b), a.max(b).max(1));
            let um = um.map(|factor| UmSpec {
                managed: factor.map(|f| memory.map_or(f << 30, |m| m * f)),
            });
            ShareConfig {
                request: has_req.then(|| Milli::new(lo).unwrap()),
                limit: has_lim.then(|| Milli::new(hi).unwrap()),
                memory,
                um,
                priority,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn never_panics_on_any_json(v in any_json()) {
        let _ = ShareConfig::from_value(&v);
        let _ = ShareConfig::parse(v.to_string().as_bytes());
        if let Value::Object(mut o) = v {
            o.insert("apiVersion".into(), CONFIG_API_VERSION.into());
            o.insert("kind".into(), CONFIG_KIND.into());
            let _ = ShareConfig::from_value(&Value::Object(o));
        }
    }

    #[test]
    fn never_panics_on_any_bytes(b in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = ShareConfig::parse(&b);
    }

    #[test]
    fn canonical_json_round_trips(c in valid_config()) {
        let v = c.to_value();
        prop_assert_eq!(ShareConfig::from_value(&v), Ok(c));
        prop_assert_eq!(ShareConfig::parse(v.to_string().as_bytes()), Ok(c));
    }

    /// A config and the labels of the same share are accepted or refused together, and
    /// what they accept resolves to the same demand.
    #[test]
    fn same_rules_as_the_labels(
        req in share_text(),
        lim in share_text(),
        mem in prop::option::of(bytes_text()),
        mode in prop::option::of(prop::sample::select(vec!["device", "unified", "managed"])),
        managed in prop::option::of(bytes_text()),
        priority in prop::option::of(prop_oneof![
            (0u32..130).prop_map(|p| p.to_string()),
            prop::sample::select(vec!["-1", "1.5", "", "abc", "007", "1e2"]).prop_map(String::from),
        ]),
    ) {
        let v = config_value(&[
            ("request", Some(req.clone())),
            ("limit", Some(lim.clone())),
            ("memory", mem.clone()),
            ("memoryMode", mode.map(String::from)),
            ("managedMemory", managed.clone()),
            ("priority", priority.clone()),
        ]);
        let mut labels = std::collections::BTreeMap::new();
        let mut put = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                labels.insert(format!("sharedgpu/{k}"), v);
            }
        };
        put("gpu_request", Some(req));
        put("gpu_limit", Some(lim));
        put("gpu_mem", mem);
        put("gpu_mem_mode", mode.map(String::from));
        put("gpu_mem_managed", managed);
        put("priority", priority);
        let from_config = ShareConfig::from_value(&v);
        let from_labels = GpuDemand::from_labels(&labels);
        // Whole GPUs are a claim's device count, not a share of one device: a request above
        // one GPU, which the labels read as whole GPUs, is refused by the config, naming it.
        if let Ok(Some(d)) = &from_labels
            && matches!(d.share, GpuShare::Whole { .. })
        {
            prop_assert!(
                matches!(&from_config, Err(ConfigError::Invalid { field, .. }) if field == "request"),
                "config {:?} for whole GPUs",
                from_config
            );
            return Ok(());
        }
        prop_assert_eq!(
            from_config.is_ok(),
            from_labels.is_ok(),
            "config {:?} vs labels {:?}",
            from_config,
            from_labels
        );
        if let (Ok(c), Ok(Some(d))) = (from_config, from_labels) {
            prop_assert_eq!(c.to_labels(), d.to_labels());
            let booked = Consumed {
                compute: d.request_per_gpu(),
                memory: d.mem.unwrap_or(1 << 30),
            };
            if d.limit_per_gpu() > Milli::ZERO {
                let r = c.resolve(booked).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(&r.share, &d.share);
                prop_assert_eq!(r.um, d.um);
                prop_assert_eq!(r.priority, d.priority);
                prop_assert_eq!(r.mem_on(80 << 30), d.mem.unwrap_or(1 << 30));
            }
        }
    }
}
