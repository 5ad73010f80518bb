//! Unified-memory mode (docs/um.md) against real gem-schd processes and the fake driver:
//! every allocation path becomes managed (so a pod holds more than the GPU has), the
//! virtual-memory path is refused naming itself, the managed ceiling (gem-schd's cap) holds
//! with CUDA_ERROR_OUT_OF_MEMORY, frees are credited exactly (a double free credits nothing),
//! a grant prefetches the newest allocations within the resident share, and the time a
//! prefetch takes after a grant is charged to the client that gets the token.

mod common;

use common::*;
use std::time::Duration;

const CUDA_ERROR_OUT_OF_MEMORY: i64 = 2;
const CUDA_ERROR_NOT_SUPPORTED: i64 = 801;

fn um(cmd: &mut std::process::Command, resident: u64) -> &mut std::process::Command {
    cmd.env("KUBESHARE_HOOK_UM", "1")
        .env("KUBESHARE_UM_RESIDENT_BYTES", resident.to_string())
}

fn run(cmd: &mut std::process::Command) -> Vec<serde_json::Value> {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "workload failed: {:?}", out.status);
    parse_lines(&out.stdout)
}

#[test]
fn every_path_is_managed_the_ceiling_holds_and_frees_are_exact() {
    let _s = serial();
    let env = Env::new();
    // The pod's managed ceiling is gem-schd's cap: 1 GiB, on a GPU of 256 MiB.
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let b = 150 * MIB;
    for lookup in LOOKUPS {
        let args = [
            "um-paths",
            "--bytes",
            &b.to_string(),
            "--extra",
            &(300 * MIB).to_string(),
        ];
        // Device mode first: five allocations of 150 MiB do not fit a 256 MiB GPU.
        let dev = run(env
            .workload("a", lookup, &args)
            .env("FAKE_CUDA_MEM_BYTES", (256 * MIB).to_string()));
        let codes: Vec<i64> = dev[0]["codes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_i64().unwrap())
            .collect();
        assert!(
            codes.iter().filter(|c| **c == 0).count() < 5,
            "{lookup}: device mode held 750 MiB on a 256 MiB GPU: {codes:?}"
        );

        // Unified mode, resident share 400 MiB.
        let v = run(um(
            env.workload("a", lookup, &args)
                .env("FAKE_CUDA_MEM_BYTES", (256 * MIB).to_string()),
            400 * MIB,
        ));
        let (alloc, refusals, launched, freed) = (&v[0], &v[1], &v[2], &v[3]);
        assert_eq!(
            alloc["codes"],
            serde_json::json!([0, 0, 0, 0, 0]),
            "{lookup}: {alloc}"
        );
        assert_eq!(
            alloc["pitch"], 1024,
            "{lookup}: the hook's pitch for 1000-byte rows"
        );
        // All of it managed: nothing taken from the device's own memory.
        let managed = 4 * b + 1024 * (b / 1024);
        assert_eq!(alloc["fake"]["managed_used"], managed, "{lookup}: {alloc}");
        assert_eq!(alloc["fake"]["device_used"], 0, "{lookup}: {alloc}");
        // VMM cannot be managed: refused, not silently device memory. The ceiling holds.
        assert_eq!(refusals["create"], CUDA_ERROR_NOT_SUPPORTED, "{lookup}");
        assert_eq!(refusals["beyond"], CUDA_ERROR_OUT_OF_MEMORY, "{lookup}");
        // The grant prefetched the newest allocations within 400 MiB: pool and async
        // (150 + 150); the next one (managed, 150) would exceed it.
        let pf = launched["fake"]["prefetches"].as_u64().unwrap();
        let pb = launched["fake"]["prefetched_bytes"].as_u64().unwrap();
        assert!(pf >= 2 && pf % 2 == 0, "{lookup}: {launched}");
        assert_eq!(pb, pf / 2 * 2 * b, "{lookup}: {launched}");
        // Frees: all succeed, the managed memory is gone, a second free is an error.
        assert_eq!(
            freed["codes"],
            serde_json::json!([0, 0, 0, 0, 0]),
            "{lookup}: {freed}"
        );
        assert_eq!(freed["fake"]["managed_used"], 0, "{lookup}: {freed}");
        assert_ne!(freed["again"], 0, "{lookup}: {freed}");
    }
    // Exact credit (no leak, no underflow from the double frees): the whole ceiling fits
    // again, and one byte more does not.
    let full = run(um(
        &mut env.workload(
            "a",
            "symbol",
            &["alloc", "--bytes", &GIB.to_string(), "--count", "1"],
        ),
        GIB,
    ));
    assert_eq!(full[0]["codes"], serde_json::json!([0]), "{full:?}");
    let over = run(um(
        &mut env.workload(
            "a",
            "symbol",
            &["alloc", "--bytes", &(GIB + 1).to_string(), "--count", "1"],
        ),
        GIB,
    ));
    assert_eq!(
        over[0]["codes"],
        serde_json::json!([CUDA_ERROR_OUT_OF_MEMORY]),
        "{over:?}"
    );
}

#[test]
fn no_prefetch_without_memory_pressure() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    // A 16 GiB GPU with 750 MiB allocated: plenty free, nothing can have been evicted.
    let v = run(um(
        env.workload(
            "a",
            "symbol",
            &[
                "um-paths",
                "--bytes",
                &(150 * MIB).to_string(),
                "--extra",
                &(300 * MIB).to_string(),
            ],
        )
        .env("FAKE_CUDA_MEM_BYTES", (16 * GIB).to_string()),
        400 * MIB,
    ));
    assert_eq!(v[0]["codes"], serde_json::json!([0, 0, 0, 0, 0]), "{v:?}");
    assert_eq!(v[2]["fake"]["prefetches"], 0, "{:?}", v[2]);
}

#[test]
fn prefetch_time_after_a_grant_is_charged_to_the_incoming_holder() {
    const MIGRATE_BYTES_PER_US: u64 = 50 * 1024;
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("u", 0.5, 0.5, 4 * GIB), ("d", 0.5, 0.5, GIB)]);
    let _schd = env.start_schd(&["u", "d"]);
    // u holds 512 MiB managed; each grant migrates it at 50 KiB/µs: about 10 ms of device
    // time per grant, queued before u's kernels (at 100 KiB/µs a loaded 2-core CI machine,
    // with fewer hand-overs, saw migrations at only 7.7% of u's time). It is device time of u's hold, so u's share
    // of device time, migrations included, must still be its half.
    let args = |hold: u64| {
        vec![
            "um-launch".to_string(),
            "--hold-bytes".into(),
            hold.to_string(),
            "--kernel-us".into(),
            "2000".into(),
            "--seconds".into(),
            "6".into(),
            "--sample-ms".into(),
            "200".into(),
        ]
    };
    let ua = args(512 * MIB);
    let da = args(MIB);
    let ua: Vec<&str> = ua.iter().map(String::as_str).collect();
    let da: Vec<&str> = da.iter().map(String::as_str).collect();
    let mut uc = env.workload("u", "proc", &ua);
    // A 1 GiB GPU: under memory pressure (less than 2 GiB free), where the hook prefetches.
    uc.env("FAKE_CUDA_MEM_BYTES", GIB.to_string());
    um(&mut uc, 4 * GIB).env(
        "FAKE_CUDA_MIGRATE_BYTES_PER_US",
        MIGRATE_BYTES_PER_US.to_string(),
    );
    let u = Proc(uc.spawn().unwrap());
    let d = Proc(env.workload("d", "symbol", &da).spawn().unwrap());
    let t = Duration::from_secs(30);
    let (u, d) = (u.finish(t), d.finish(t));
    let (fu, fd, share_u) = pair_busy(&u[0], &d[0], 1500);
    // The migrations were a material part of u's device time (not a test of nothing).
    let migrated_us = u[1]["prefetched_bytes"].as_u64().unwrap() / MIGRATE_BYTES_PER_US;
    let total_u = u[0]["busy_us"].as_u64().unwrap();
    eprintln!("u: {migrated_us} µs of {total_u} µs migrating");
    assert!(
        migrated_us * 10 >= total_u,
        "prefetch time {migrated_us} µs is under 10% of u's {total_u} µs"
    );
    eprintln!("device time (kernels + prefetches): u {fu:.3}, d {fd:.3}; u's share {share_u:.3}");
    assert!(
        (share_u - 0.5).abs() <= 0.03,
        "u's share of device time, prefetches included, is {share_u:.3}, not 0.5 ± 0.03"
    );
    assert!(fu + fd >= 0.85, "device mostly idle: {:.3}", fu + fd);
}
