//! libgemhook end to end, without a GPU: real gem-schd processes, the workload program
//! (`cuda-workload`) with the hook preloaded, and the fake libcuda as `libcuda.so.1`, reached
//! by each of the three lookup paths (linked symbols, `dlsym`, `cuGetProcAddress_v2`).
//!
//! Needs `make hook-prereqs` (builds gemhook, fake-libcuda and gem-schd into target/debug).

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn launches_wait_for_the_token_on_every_lookup_path_and_kind() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, 4 * GIB)]);
    // The pod's socket directory exists but gem-schd is not running yet: no token.
    std::fs::create_dir_all(env.client_dir("a")).unwrap();
    // Each process reports gem-schd unreachable and waits (the event waited for); each one's
    // first launch returns only after gem-schd has started (on the wall clock).
    let mut procs = vec![];
    for lookup in LOOKUPS {
        for kind in ["launch", "ex", "coop", "graph"] {
            let mut p = env
                .workload(
                    "a",
                    lookup,
                    &[
                        "launch",
                        "--kernel-us",
                        "1000",
                        "--count",
                        "5",
                        "--kind",
                        kind,
                    ],
                )
                .env("KUBESHARE_HOOK_LOG", "info")
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let said_wait = said_on_stderr(&mut p, "waiting (KUBESHARE_ON_UNREACHABLE=wait)");
            procs.push((lookup, kind, said_wait, Proc(p)));
        }
    }
    for (lookup, kind, said_wait, p) in procs.iter_mut() {
        said_wait
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("{lookup}/{kind}: no report of gem-schd unreachable"));
        assert!(p.running(), "{lookup}/{kind}: launched without a token");
    }
    // The same program outside a pod (no socket directory) runs at once: the hook is inert.
    let inert = env
        .workload(
            "a",
            "proc",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_SOCKET_DIR", env.path().join("no-such-dir"))
        .output()
        .unwrap();
    assert!(inert.status.success(), "{inert:?}");
    assert_eq!(parse_lines(&inert.stdout)[0]["kernels"], 5);

    let schd_at = unix_us();
    let _schd = env.start_schd(&["a"]);
    for (lookup, kind, _, p) in procs {
        let out = p.finish(Duration::from_secs(20));
        assert_eq!(out[0]["kernels"], 5, "{lookup}/{kind}");
        let first = out[0]["first_launch_unix_us"].as_u64().unwrap_or(0);
        assert!(
            first >= schd_at,
            "{lookup}/{kind}: the first launch returned {} µs before gem-schd started",
            schd_at - first
        );
        let busy = out[0]["busy_us"].as_u64().unwrap();
        assert!(busy >= 5000, "{lookup}/{kind}: the kernels ran ({busy} µs)");
    }
}

#[test]
fn unreachable_policy_run_passes_through() {
    let _s = serial();
    let env = Env::new();
    std::fs::create_dir_all(env.client_dir("a")).unwrap();
    let out = env
        .workload(
            "a",
            "dlsym",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_ON_UNREACHABLE", "run")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(parse_lines(&out.stdout)[0]["kernels"], 5);
}

#[test]
fn memory_cap_and_faked_meminfo_on_every_lookup_path_and_allocator() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    for lookup in LOOKUPS {
        for kind in [
            "alloc", "pitch", "managed", "async", "pool", "create", "array", "array3d",
        ] {
            let what = format!("{lookup}/{kind}");
            let bytes = (400 * MIB).to_string();
            let out = env.run(
                "a",
                lookup,
                &["alloc", "--kind", kind, "--bytes", &bytes, "--count", "3"],
            );
            let (alloc, freed) = (&out[0], &out[1]);
            // Two fit under the 1 GiB cap, the third is refused with CUDA_ERROR_OUT_OF_MEMORY
            // although the (fake) device has 16 GiB.
            assert_eq!(alloc["codes"], serde_json::json!([0, 0, 2]), "{what}");
            assert_eq!(alloc["mem"]["total"], GIB, "{what}");
            assert_eq!(alloc["mem"]["device_total"], GIB, "{what}");
            assert_eq!(alloc["mem"]["free"], GIB - 800 * MIB, "{what}");
            assert_eq!(freed["codes"], serde_json::json!([0, 0]), "{what}");
            assert_eq!(freed["mem"]["free"], GIB, "{what}: frees are credited");
        }
    }
    // Outside a pod the real (fake) device is reported.
    let out = env
        .workload("a", "proc", &["meminfo"])
        .env("KUBESHARE_SOCKET_DIR", env.path().join("no-such-dir"))
        .output()
        .unwrap();
    assert_eq!(parse_lines(&out.stdout)[0]["total"], 16 * GIB);
}

#[test]
fn processes_of_one_client_share_its_memory_budget() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let bytes = (600 * MIB).to_string();
    let mut first = Proc(
        env.workload(
            "a",
            "symbol",
            &["alloc", "--bytes", &bytes, "--hold-ms", "4000"],
        )
        .spawn()
        .unwrap(),
    );
    let held = first.next_line();
    assert_eq!(held["codes"], serde_json::json!([0]));
    // A second process of the same pod sees the first one's use and cannot exceed the cap.
    let second = env.run("a", "proc", &["alloc", "--bytes", &bytes]);
    assert_eq!(second[0]["codes"], serde_json::json!([2]));
    assert_eq!(second[0]["mem"]["free"], GIB - 600 * MIB);
    let small = env.run(
        "a",
        "dlsym",
        &["alloc", "--bytes", &(300 * MIB).to_string()],
    );
    assert_eq!(small[0]["codes"], serde_json::json!([0]));
    // Killed without freeing: gem-schd reclaims its memory when its connections close.
    drop(first);
    let mut ok = false;
    for _ in 0..50 {
        let again = env.run("a", "proc", &["alloc", "--bytes", &bytes]);
        if again[0]["codes"] == serde_json::json!([0]) {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ok, "memory of a killed process was not reclaimed");
}

#[test]
fn two_clients_get_their_shares_and_one_clients_processes_share_a_token() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.3, 0.3, GIB), ("b", 0.7, 0.7, GIB)]);
    let usage = env.path().join("usage.txt");
    let usage_arg = usage.to_string_lossy().into_owned();
    let _schd = env.start_schd_with(&["a", "b"], &["--usage-file", &usage_arg]);
    let args = [
        "launch",
        "--kernel-us",
        "2000",
        "--seconds",
        "8",
        "--sample-ms",
        "200",
    ];
    // Client a: two processes (dlsym and cuGetProcAddress paths); client b: one (symbols).
    let a1 = Proc(env.workload("a", "dlsym", &args).spawn().unwrap());
    let a2 = Proc(env.workload("a", "proc", &args).spawn().unwrap());
    let b = Proc(env.workload("b", "symbol", &args).spawn().unwrap());
    let t = Duration::from_secs(30);
    let (a1, a2, b) = (a1.finish(t), a2.finish(t), b.finish(t));
    let skip = 1500;
    let (fa1, ba1, _) = busy_fraction(&a1[0], skip);
    let (fa2, ba2, _) = busy_fraction(&a2[0], skip);
    let (fb, bb, _) = busy_fraction(&b[0], skip);
    let total = (ba1 + ba2 + bb) as f64;
    let share_a = (ba1 + ba2) as f64 / total;
    let share_b = bb as f64 / total;
    let used = fa1 + fa2 + fb;
    // gem-schd's charged token time over its window (which covers the whole run).
    wait_until(
        Duration::from_secs(3),
        || usage.exists(),
        "the usage report",
    );
    let report = std::fs::read_to_string(&usage).unwrap_or_default();
    let charged = |id: &str| -> f64 {
        report
            .lines()
            .skip(1)
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(id)).then(|| f.next().and_then(|v| v.parse().ok()))?
            })
            .unwrap_or(0.0)
    };
    let (ca, cb) = (charged("a"), charged("b"));
    let charged_a = ca / (ca + cb).max(1.0);
    eprintln!(
        "GPU time: a = {fa1:.3} + {fa2:.3}, b = {fb:.3} of wall time; shares a {share_a:.3}, b {share_b:.3}; charged a {charged_a:.3}"
    );
    // The three processes share one simulated GPU (FAKE_CUDA_SHARED_DIR): without gating
    // each would get about a third. The GPU must not idle much while both clients are busy.
    assert!(used <= 1.02, "more GPU time than wall time: {used:.3}");
    assert!(used >= 0.85, "GPU mostly idle: {used:.3}");
    // The scheduler's promise: token time in proportion to the shares.
    assert!(
        (charged_a - 0.3).abs() <= 0.02,
        "client a was charged {charged_a:.3} of the token time, not 0.3 ± 0.02"
    );
    // GPU time follows it, less what a process holding the token loses while the CPU runs
    // something else (this 2-core machine runs four busy processes here), so the GPU-time
    // bound is looser than the token-time one. It once caught gem-schd handing the token
    // over while a's second process still drained its last batch, which charged a for b's
    // kernels: 0.25–0.29 of the GPU time for 0.30–0.31 of the token time (0.254 in CI); a
    // hold now ends with its last process, and a gets 0.29–0.31, 0.29–0.33 beside CPU hogs.
    // On a real GPU the pair is within 1–2 pp (docs/benchmarks.md, "one client, two
    // processes").
    assert!(
        (share_a - 0.3).abs() <= 0.045,
        "client a got {share_a:.3} of the GPU time, not 0.3 ± 0.045"
    );
    assert!(
        (share_b - 0.7).abs() <= 0.045,
        "client b got {share_b:.3} of the GPU time, not 0.7 ± 0.045"
    );
}

#[test]
fn a_tenant_waiting_on_its_own_burst_is_not_idle() {
    // Bursts of 10 × 3 ms kernels, each followed by a sync: the process launches nothing for
    // 30 ms while its GPU work runs. Releasing the token then (as if idle) would make the two
    // clients alternate burst by burst, 0.5/0.5, instead of their requests 0.3/0.7.
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.3, 1.0, GIB), ("f", 0.7, 1.0, GIB)]);
    let _schd = env.start_schd(&["e", "f"]);
    let args = [
        "launch",
        "--kernel-us",
        "3000",
        "--batch",
        "10",
        "--seconds",
        "8",
        "--sample-ms",
        "200",
    ];
    let e = Proc(env.workload("e", "proc", &args).spawn().unwrap());
    let f = Proc(env.workload("f", "dlsym", &args).spawn().unwrap());
    let t = Duration::from_secs(30);
    let (e, f) = (e.finish(t), f.finish(t));
    let (fe, ff, share_e) = pair_busy(&e[0], &f[0], 1500);
    eprintln!("GPU time: e = {fe:.3}, f = {ff:.3} of wall time; share of e {share_e:.3}");
    assert!(
        (share_e - 0.3).abs() <= 0.03,
        "client e got {share_e:.3}, not 0.3 ± 0.03"
    );
    assert!(fe + ff >= 0.85, "GPU mostly idle: {:.3}", fe + ff);
}

/// Client e running `cuda-workload e_args` with its hook's debug log captured, beside client f
/// launching 1 ms kernels for 4 s, both at (0.5, 0.5): e's output (stderr: the log) and f's
/// samples. The caller holds `serial()`.
fn beside_a_busy_neighbour(e_args: &[&str]) -> (std::process::Output, Vec<serde_json::Value>) {
    beside_a_busy_neighbour_with(e_args, &[])
}

/// [`beside_a_busy_neighbour`] with more environment for e's hook.
fn beside_a_busy_neighbour_with(
    e_args: &[&str],
    e_vars: &[(&str, &str)],
) -> (std::process::Output, Vec<serde_json::Value>) {
    beside_a_busy_neighbour_in(e_args, e_vars, 0.5, &[])
}

/// [`beside_a_busy_neighbour_with`], e's limit `e_limit` and gem-schd given `schd_args`.
fn beside_a_busy_neighbour_in(
    e_args: &[&str],
    e_vars: &[(&str, &str)],
    e_limit: f64,
    schd_args: &[&str],
) -> (std::process::Output, Vec<serde_json::Value>) {
    let env = Env::new();
    env.write_config(&[("e", 0.5, e_limit, GIB), ("f", 0.5, 0.5, GIB)]);
    let _schd = env.start_schd_with(&["e", "f"], schd_args);
    let busy = ["launch", "--kernel-us", "1000", "--seconds", "4"];
    let e = env
        .workload("e", "proc", e_args)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .envs(e_vars.iter().copied())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let f = Proc(env.workload("f", "dlsym", &busy).spawn().unwrap());
    let e = e.wait_with_output().unwrap();
    let f = f.finish(Duration::from_secs(30));
    assert!(e.status.success(), "{e:?}");
    (e, f)
}

/// The number right after `marker` in a hook log line.
fn number_after<T: std::str::FromStr>(line: &str, marker: &str) -> Option<T> {
    line.split(marker).nth(1)?.split(' ').next()?.parse().ok()
}

#[test]
fn a_hold_that_expires_while_the_process_thinks_is_given_back_at_its_quota() {
    // e launches 2 ms of work, waits for it, then computes 8 ms on the CPU: its quota under
    // contention ends during that pause, with no launch to end the hold. The idle thread ends it
    // at the quota (plus its grace) instead of at e's next launch, 8 ms later, with f waiting
    // and the GPU idle meanwhile.
    let _s = serial();
    let think = [
        "launch",
        "--kernel-us",
        "1000",
        "--batch",
        "2",
        "--think-us",
        "8000",
        "--seconds",
        "4",
    ];
    let (e, f) = beside_a_busy_neighbour(&think);
    let log = String::from_utf8_lossy(&e.stderr);
    // (used, quota) of each hold ended by expiry and, for each, the overuse the next request
    // reported: each expired hold's overrun, as for a hold a launch ended (gem-schd learns the
    // drain from it; a zero there lengthened the next grants).
    let mut expired = Vec::new();
    let mut owed = None;
    let mut reported = Vec::new();
    for l in log.lines() {
        if l.contains("hold expired") {
            let used: Option<u64> = number_after(l, "released after ");
            let quota = number_after(l, "of a ");
            expired.extend(used.zip(quota));
            owed = used.zip(quota).map(|(u, q)| u.saturating_sub(q));
        } else if l.contains("(reported overuse ")
            && let Some(want) = owed.take()
        {
            reported.push((Some(want), number_after(l, "(reported overuse ")));
        }
    }
    assert!(expired.len() >= 5, "holds ended by expiry: {expired:?}");
    // Ended at the quota: typically 0.15–0.25 ms past it (e's last kernels, the idle thread's
    // wake), while an idle thread that did not end holds at their quota would leave most of
    // them to e's next launch, 8 ms on. The median, against that 8 ms: on a loaded 2-core
    // machine threads are descheduled for ticks at a time (beside two CPU hogs 3.7 and 4.5 ms
    // once in ~40 holds; a make test under other builds' load had p50 2.5 ms, p90 10 ms).
    let mut over: Vec<u64> = expired.iter().map(|(u, q)| u.saturating_sub(*q)).collect();
    over.sort_unstable();
    let p50 = over[over.len() / 2];
    assert!(
        p50 <= 3000,
        "expired holds ran past their quota by p50 {p50} µs: {expired:?}"
    );
    assert!(reported.len() >= 5, "grants after an expiry: {reported:?}");
    assert!(
        reported.iter().all(|(want, got)| want == got),
        "(overrun, reported overuse) after each expiry: {reported:?}"
    );
    // f keeps its half of the GPU.
    let (ff, _, _) = busy_fraction(&f[0], 1000);
    assert!(ff >= 0.4, "f had the GPU {ff:.3} of the time");
}

/// 100 kernels of 100 µs (10 ms of GPU work) launched at 10 µs of CPU each, then a wait for
/// them, for 4 s: a CPU ten times ahead of the GPU, as ResNet-50 training's was on an H100.
const CPU_AHEAD: [&str; 9] = [
    "launch",
    "--kernel-us",
    "100",
    "--launch-cpu-us",
    "10",
    "--batch",
    "100",
    "--seconds",
    "4",
];

#[test]
fn a_tenant_far_ahead_of_the_gpu_drains_little_past_its_hold() {
    // e queues 100 kernels of 100 µs (10 ms of GPU work), 10 µs of CPU each, then waits for
    // them: its CPU runs ten times ahead of the GPU, as ResNet-50 training's did on an H100.
    // Under contention every hold ends with the queued work drained, and the next request
    // reports that drain as overuse. The queue-ahead bound (200 µs) measures the GPU's pace and
    // keeps about that much GPU work queued: by the CPU's clock alone (two probes of 100 µs of
    // launching, one per 8 launches) the drain here was p50 / p90 4.2–4.5 / 7.4 ms; with the
    // pace but no probe in a hold's first coarse tick, p50 / p75 0.4–1.7 / 8.5–11 ms on an
    // idle machine; now p50 / p75 0.47 / 0.56 ms on an idle machine.
    //
    // Under CPU load the idle thread, which ends the holds that no launch ends, wakes late, and
    // an expiry it ends late counts as drain: with one CPU hog on this 2-core machine p75 was
    // 1.4–1.5 ms (steps of the scheduler's 1 ms tick above 0.5 ms), and in a CI run 4.7 ms. So
    // the drains are judged against the control's in the same conditions, e with no bound
    // (`KUBESHARE_HOOK_MAX_AHEAD_US=0`: p50 / p75 5.2 / 5.2–6.4 ms idle and under load): the
    // bound cuts the median drain to a quarter at most and the 75th percentile to half.
    let _s = serial();
    let drains = |vars: &[(&str, &str)]| {
        let (e, f) = beside_a_busy_neighbour_with(&CPU_AHEAD, vars);
        let log = String::from_utf8_lossy(&e.stderr).into_owned();
        let mut overuse: Vec<u64> = log
            .lines()
            .filter_map(|l| number_after(l, "(reported overuse "))
            .collect();
        assert!(overuse.len() >= 20, "grants: {}", overuse.len());
        overuse.sort_unstable();
        (e, f, log, overuse)
    };
    let (.., control) = drains(&[("KUBESHARE_HOOK_MAX_AHEAD_US", "0")]);
    let (e, f, log, overuse) = drains(&[]);
    let at = |d: &[u64], q: usize| d[d.len() * q / 4];
    let (p50, p75) = (at(&overuse, 2), at(&overuse, 3));
    let (c50, c75) = (at(&control, 2), at(&control, 3));
    eprintln!(
        "e's drain past its holds: p50 {p50} µs, p75 {p75} µs; with no bound p50 {c50} µs, p75 {c75} µs"
    );
    assert!(
        4 * p50 <= c50 && 2 * p75 <= c75,
        "e's drain past its holds: p50 / p75 {p50} / {p75} µs of {overuse:?}; with no bound \
         {c50} / {c75} µs of {control:?}"
    );
    let (ff, _, _) = busy_fraction(&f[0], 1000);
    assert!(ff >= 0.4, "f had the GPU {ff:.3} of the time");
    // Held to a short queue, e still keeps the GPU busy through its turns (0.46 here, 0.48
    // before; 0.39 with two CPU hogs on a 2-core machine).
    let out = parse_lines(&e.stdout);
    let (fe, _, _) = busy_fraction(&out[0], 1000);
    assert!(fe >= 0.35, "e had the GPU {fe:.3} of the time");
    // At each quota's end a launch notices, the hook's debug log says what the bound thought
    // was queued: the pace it measured (the GPU well behind the CPU here: 10, the fake GPU's
    // kernels taking their 100 µs) and the GPU work behind its pending probes, about the 200 µs
    // bound (100–200 µs, 200 at the median). (The holds the idle thread ends while e waits in
    // its own synchronisation log the probes pending since the last launch, which the GPU may
    // have passed since: not counted here.)
    let ends: Vec<(f64, u64)> = log
        .lines()
        .filter(|l| l.contains("quota over") && l.contains("; queue bound: "))
        .filter_map(|l| Some((number_after(l, "at a pace of ")?, number_after(l, "~")?)))
        .collect();
    eprintln!("quota ends (pace, queued µs): {ends:?}");
    // Enough for a median: of about 200 holds, 26 ended at a launch on an idle machine and 7–15
    // with a CPU hog beside the test, the idle thread ending the rest.
    let count = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    assert!(
        ends.len() >= 5,
        "quota ends logged at a launch: {} ({} holds expired, {} renewed, {} released idle); \
         e's log:\n{log}",
        ends.len(),
        count("hold expired without a launch"),
        count("hold renewed"),
        count("idle, released")
    );
    let mut paces: Vec<f64> = ends.iter().map(|e| e.0).collect();
    paces.sort_by(f64::total_cmp);
    let pace = paces[paces.len() / 2];
    assert!(pace >= 4.0, "median pace {pace} of {paces:?}");
    let mut queued: Vec<u64> = ends.iter().map(|e| e.1).collect();
    queued.sort_unstable();
    let q = queued[queued.len() / 2];
    assert!(
        q <= 1_000,
        "median GPU work queued at a quota's end {q} µs of {queued:?}"
    );
}

#[test]
fn a_tenant_far_ahead_of_the_gpu_parks_its_queue_at_its_holds_ends() {
    // The same tenant with parking on (docs/hook.md, "Parking"): at a quota's end a deep queue
    // stops at the next probe's wait on the gate word and stays queued until its next Grant,
    // so what runs past the quota is one probe interval's work, not the queue. The bound is
    // raised to 1.6 ms, so that most quota ends find the queue deep enough to park: held to
    // the default 200 µs, this tenant's queue is rarely three probes deep.
    let _s = serial();
    let (e, f) = beside_a_busy_neighbour_with(
        &CPU_AHEAD,
        &[
            ("KUBESHARE_HOOK_PARK", "1"),
            ("KUBESHARE_HOOK_MAX_AHEAD_US", "1600"),
        ],
    );
    let log = String::from_utf8_lossy(&e.stderr);
    let ended = log
        .lines()
        .filter(|l| l.contains("; queue bound: "))
        .count();
    let parked = log
        .lines()
        .filter(|l| l.contains("parked behind the gate") || l.contains("parked its queue"))
        .count();
    let waiting = |what: &str| {
        log.lines()
            .filter(|l| l.contains("hold expired without a launch") && l.contains(what))
            .count()
    };
    let (parked_waiting, drained_waiting) = (waiting("parked its queue"), waiting("released"));
    eprintln!(
        "{parked} parked: {parked_waiting} of the holds that ended while e waited for its batch \
         ({drained_waiting} drained), the rest of {ended} ended at a launch"
    );
    assert!(ended >= 20, "quota ends: {ended}");
    // Only a queue at least three probes deep is parked: most holds here end at a launch with
    // the bound's 200 µs queued, which drains.
    assert!(
        parked >= 20,
        "{parked} of {ended} quota ends parked the queue"
    );
    let mut overuse: Vec<u64> = log
        .lines()
        .filter_map(|l| number_after(l, "(reported overuse "))
        .collect();
    overuse.sort_unstable();
    let p50 = overuse[overuse.len() / 2];
    eprintln!("parked {parked} of {ended}; reported overuse p50 {p50} µs: {overuse:?}");
    // 0.3–0.5 ms at the median on an idle machine (the run to the next probe's wait), but the
    // hook polls for that probe, and under CPU load (a 2-core runner with a cluster up) the
    // polls came late: 4.5 ms once. What parking buys is measured on a GPU (docs/benchmarks.md);
    // here, that it happens and loses nothing: every kernel e queued ran, and both keep their
    // halves.
    let out = parse_lines(&e.stdout);
    let (fe, _, _) = busy_fraction(&out[0], 1000);
    assert!(fe >= 0.35, "e had the GPU {fe:.3} of the time");
    let (ff, _, _) = busy_fraction(&f[0], 1000);
    assert!(ff >= 0.4, "f had the GPU {ff:.3} of the time");
}

#[test]
fn a_hold_that_others_may_run_beside_drains_instead_of_parking() {
    // With co-running on, gem-schd tells an uncapped client that co-holds may run beside its
    // turns (gem-proto `GatePage::shared`). Beside another context the hook could not tell
    // where the GPU stopped from that context's time slices, so the same tenant as above,
    // uncapped, drains every hold's end: with the check left out it parked as above.
    let _s = serial();
    let (e, _) = beside_a_busy_neighbour_in(
        &CPU_AHEAD,
        &[("KUBESHARE_HOOK_PARK", "1")],
        1.0,
        &["--co-run-below", "0.6"],
    );
    let log = String::from_utf8_lossy(&e.stderr);
    let count = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    let ended = count("; queue bound: ");
    let parked = count("parked behind the gate") + count("parked its queue");
    assert!(ended >= 20, "quota ends: {ended}");
    assert_eq!(parked, 0, "{parked} of {ended} quota ends parked the queue");
}

/// Client e alone at (`share`, `share`) running `cuda-workload args` with the hook's debug log
/// and one more variable `var` set: its log, and the fraction of the time its GPU was busy
/// after the first second. The caller holds `serial()`.
fn alone_logged(share: f64, args: &[&str], vars: &[(&str, &str)]) -> (String, f64) {
    let env = Env::new();
    env.write_config(&[("e", share, share, GIB)]);
    let _schd = env.start_schd(&["e"]);
    let out = env
        .workload("e", "proc", args)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .envs(vars.iter().copied())
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (busy, _, _) = busy_fraction(&parse_lines(&out.stdout)[0], 1000);
    (String::from_utf8_lossy(&out.stderr).into_owned(), busy)
}

/// What a lone tenant capped at 0.5 did in one [`CPU_AHEAD`] run: from its hook's debug log,
/// its holds renewed and its quota ends that drained and asked again (and the longest drain past
/// a quota, µs); from the fake driver, its GPU time; from gem-schd's usage report, the token time
/// charged to it; and the run's length (µs).
#[derive(Debug)]
struct CappedRun {
    renewed: usize,
    drained: usize,
    longest_drain_us: u64,
    /// Hang-ups its hook noticed during a hold: gem-schd ran all along, so each one is a reply
    /// the hook took for one.
    hangups: usize,
    busy_us: u64,
    charged_us: u64,
    wall_us: u64,
}

/// The token time gem-schd charged `client` in its usage report (`--usage-file`), µs, from the
/// first report written after the caller's run ended: gem-schd writes one every second, and
/// its window, 10 s, is longer than the runs here, so that report covers the whole run.
fn charged_after_the_run(usage: &std::path::Path, client: &str) -> u64 {
    let report = || std::fs::read_to_string(usage).unwrap_or_default();
    let at = |r: &str| -> u64 {
        r.split_whitespace()
            .find_map(|w| w.strip_prefix("at_us=")?.parse().ok())
            .unwrap_or(0)
    };
    let before = at(&report());
    wait_until(
        Duration::from_secs(5),
        || at(&report()) > before,
        "a usage report written after the run",
    );
    report()
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(client)).then(|| f.next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("{client} in the usage report"))
}

/// e alone at (0.5, 0.5) running [`CPU_AHEAD`] with `KUBESHARE_HOOK_RENEW=renew`, its holds
/// min-quota ones from the first: gem-schd's base quota (the quota before any report) is its
/// min quota, 5 ms. With the default base quota, 50 ms, a run could keep 50 ms holds for its
/// whole length, each ending at its pacing allowance (50 ms of each 100 ms) and none renewable;
/// a shorter hold (cut by its allowance after an overrun) brings the quota down for good, which
/// happened early in most runs, in some not at all on a quiet machine. The caller holds
/// `serial()`.
fn capped_alone(renew: &str) -> CappedRun {
    let env = Env::new();
    env.write_config(&[("e", 0.5, 0.5, GIB)]);
    let usage = env.path().join("usage.txt");
    let usage_arg = usage.to_string_lossy().into_owned();
    let _schd = env.start_schd_with(
        &["e"],
        &["--usage-file", &usage_arg, "--base-quota-ms", "5"],
    );
    let out = env
        .workload("e", "proc", &CPU_AHEAD)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .env("KUBESHARE_HOOK_RENEW", renew)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let charged_us = charged_after_the_run(&usage, "e");
    let log = String::from_utf8_lossy(&out.stderr);
    let drains: Vec<u64> = log
        .lines()
        .filter_map(|l| number_after(l, "(reported overuse "))
        .collect();
    let v = &parse_lines(&out.stdout)[0];
    CappedRun {
        renewed: log.lines().filter(|l| l.contains("hold renewed")).count(),
        drained: drains.len(),
        longest_drain_us: drains.iter().copied().max().unwrap_or(0),
        hangups: log
            .lines()
            .filter(|l| l.contains("hung up during a hold"))
            .count(),
        busy_us: v["busy_us"].as_u64().unwrap(),
        charged_us,
        wall_us: v["wall_us"].as_u64().unwrap(),
    }
}

#[test]
fn a_lone_capped_tenant_renews_its_holds_and_stays_within_its_limit() {
    // A tenant capped at 0.5 alone gets min-quota holds back to back (its pacing room is never
    // larger), each of which ended with a drain and a new request, the GPU idle from the drain's
    // end to the next launch (renewed, batch-1 inference alone served 5–9 % more on an H100).
    // With Renew the hook asks to go on before draining, and gem-schd renews the hold while
    // the same rules would grant it straight back: most quota ends now renew, and the limit
    // holds as before. With `KUBESHARE_HOOK_RENEW=0` every quota end drains, as before.
    //
    // Judged on what does not depend on how fast this machine runs the fake driver: the counts
    // as proportions (a loaded 2-core host runs fewer holds in the 4 s), the limit on the token
    // time gem-schd charged (its GPU time follows the CPU's load: drains past a quota reached
    // 260 ms beside other builds), and the GPU time against that charge (no GPU time escapes
    // it).
    let _s = serial();
    let check = |renew: &str| {
        let r = capped_alone(renew);
        eprintln!(
            "renew={renew}: {} renewed, {} drained and asked again (longest drain {} µs); \
             busy {:.3}, charged {:.3} of {} µs",
            r.renewed,
            r.drained,
            r.longest_drain_us,
            r.busy_us as f64 / r.wall_us as f64,
            r.charged_us as f64 / r.wall_us as f64,
            r.wall_us
        );
        // Every GPU microsecond ran in a hold gem-schd charged (renewed holds included), but
        // for the last hold's drain: the process exits as its last sync returns, maybe before
        // its hook reports that drain, and gem-schd, past its grace, charges that hold to its
        // quota's end (21 ms short once, beside a build and two CPU hogs). Uncharged renewed
        // holds would leave ~1.5 s out.
        assert!(
            r.busy_us <= r.charged_us + r.longest_drain_us + 5_000,
            "{renew}: GPU time beyond the charge: {r:?}"
        );
        // Within the limit over the run (which includes the start-up: the first grant comes
        // 200 ms after gem-schd starts), with the slack of one grant and the longest drain past
        // a quota (charged after the fact, then paced): 0.47–0.48 of the run here, loaded or
        // not. Renewals that skipped pacing would give it the whole GPU.
        assert!(
            r.charged_us <= r.wall_us / 2 + 50_000 + r.longest_drain_us,
            "{renew}: charged beyond the limit: {r:?}"
        );
        // And most of its limit's worth: alone, it always has work queued, but with renewals
        // off each quota end waits for its drain and a new request, on a CPU that a loaded
        // 2-core host may not give it at once (0.45–0.48 quiet, 0.36 once beside a CI run's
        // builds); a scheduler that paced it below its limit would leave it far less.
        assert!(
            r.charged_us * 3 >= r.wall_us,
            "{renew}: charged less than a third of the run: {r:?}"
        );
        // gem-schd was never gone: the hook took none of its replies for a hang-up.
        assert_eq!(r.hangups, 0, "{renew}: hang-ups noticed: {r:?}");
        // Its holds were used: 0.87–0.95 of the charged time busy here, 0.71 at the least in a
        // debug build beside another build (its CPU, launching, is starved then).
        assert!(
            r.busy_us * 2 >= r.charged_us,
            "{renew}: the GPU was idle in its holds: {r:?}"
        );
        r
    };
    let r = check("1");
    // Pacing still stops it (gem-schd's short window: ~50 ms of each 100 ms, in runs of
    // holds): those quota ends yield, drain and wait; the others renew (~6 in 7 here: ~300
    // renewed, ~50 drained; with renewals off ~350 drain).
    assert!(
        r.renewed >= r.drained && r.renewed >= 20,
        "{} holds renewed, {} drained and asked again",
        r.renewed,
        r.drained
    );
    let r = check("0");
    assert_eq!(r.renewed, 0, "renewed with KUBESHARE_HOOK_RENEW=0");
    assert!(r.drained >= 20, "{} quota ends drained", r.drained);
}

/// Kernels of 20 ms (an fp32 8192² matrix product's on an H200), 32 launched at 60 µs of CPU
/// each and then waited for, for 4 s: enough launches in a hold for the queue-ahead bound to
/// measure the GPU's pace and then wait a whole kernel at each probe.
const LONG_KERNELS: [&str; 9] = [
    "launch",
    "--kernel-us",
    "20000",
    "--launch-cpu-us",
    "60",
    "--batch",
    "32",
    "--seconds",
    "4",
];

/// One run of e, capped at 0.5, launching [`LONG_KERNELS`] beside f (0.5, 1.0) launching 1 ms
/// kernels for 4 s, e's holds min-quota ones (5 ms) from the first.
struct LongRun {
    busy_us: u64,
    wall_us: u64,
    /// gem-schd's charge to e over the run.
    charged_us: u64,
    /// What e's hook reported running past its quotas (µs, from its log), in order.
    drains_us: Vec<u64>,
}

/// [`LongRun`]. The caller holds `serial()`.
fn long_kernels_beside_a_busy_neighbour() -> LongRun {
    let env = Env::new();
    env.write_config(&[("e", 0.5, 0.5, GIB), ("f", 0.5, 1.0, GIB)]);
    let usage = env.path().join("usage.txt");
    let usage_arg = usage.to_string_lossy().into_owned();
    let _schd = env.start_schd_with(
        &["e", "f"],
        &["--usage-file", &usage_arg, "--base-quota-ms", "5"],
    );
    let e = env
        .workload("e", "proc", &LONG_KERNELS)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let busy = ["launch", "--kernel-us", "1000", "--seconds", "4"];
    let f = Proc(env.workload("f", "dlsym", &busy).spawn().unwrap());
    let e = e.wait_with_output().unwrap();
    let _f = f.finish(Duration::from_secs(30));
    assert!(e.status.success(), "{e:?}");
    let v = &parse_lines(&e.stdout)[0];
    LongRun {
        busy_us: v["busy_us"].as_u64().unwrap(),
        wall_us: v["wall_us"].as_u64().unwrap(),
        charged_us: charged_after_the_run(&usage, "e"),
        drains_us: String::from_utf8_lossy(&e.stderr)
            .lines()
            .filter_map(|l| number_after(l, "(reported overuse "))
            .collect(),
    }
}

#[test]
fn a_launch_that_waited_for_the_gpu_past_its_hold_asks_for_the_token() {
    // e, capped at 0.5, launches 20 ms kernels beside a busy f. A launch passes the token
    // check in the hold's last stretch, then waits in the queue-ahead bound for a probe a whole
    // kernel ahead of it on the GPU. Meanwhile e's quota runs out and the idle thread ends the
    // hold (drained, released; gem-schd grants f). A launch that went on to the driver after
    // that wait ran with no token, in f's turn, charged to no one: on an H200 a tenant capped
    // at 0.5 with such kernels got 0.610 of the GPU's time, charged 0.499, and its neighbour
    // at 0.5 got 0.347 (0.469 and 0.483 with the check). Through the fake driver e ran 0.656
    // of the time against 0.478 charged. A launch that waited for the GPU checks its hold again
    // and asks for the token if the hold has ended: e then ran 0.475–0.517 against 0.446–0.482
    // charged in thirteen runs, and 0.470–0.501 against 0.441–0.474 in six once the work queued
    // behind the gate counted in the bound.
    let _s = serial();
    let r = long_kernels_beside_a_busy_neighbour();
    eprintln!(
        "e had the GPU {:.3} of the time, charged {:.3}",
        r.busy_us as f64 / r.wall_us as f64,
        r.charged_us as f64 / r.wall_us as f64
    );
    // Judged against a tenth of the run: GPU time beyond the charge was 0.18 of it with the
    // race and is 0.00–0.07 now. The rest is the fake driver's: e, granted at f's drain notice,
    // has its 20 ms kernels run whole between f's 1 ms drain kernels (the fake runs two
    // processes' kernels one by one), so f's drain lasts until they are done and f's report
    // charges them to f (drains of up to 88 ms past f's 5 ms quotas in gem-schd's debug log).
    // A GPU time-slices the two contexts instead, a slice at a time.
    assert!(
        r.busy_us <= r.charged_us + r.wall_us / 10,
        "e's GPU time {} µs beyond its charge {} µs of {} µs",
        r.busy_us,
        r.charged_us,
        r.wall_us
    );
}

#[test]
fn a_tenant_of_long_kernels_drains_about_one_kernel_past_its_quota() {
    // e's first launches of a hold queue behind the gate (gate.rs) before its Grant. That work
    // counts against the queue-ahead bound: a probe is recorded behind it at the Grant, and the
    // launch that read the Grant waits for it where it is more than the bound lets stay. Left
    // unprobed, it and that launch counted as one probe interval's work at the next probe, and
    // each of e's 1–5 ms holds ran three 20 ms kernels: drains of 55–59 ms past its quotas at
    // the median (three runs), against 15.3 ms with the probe, and 28–39 holds in the run
    // against 76–97.
    let _s = serial();
    let r = long_kernels_beside_a_busy_neighbour();
    let mut drains = r.drains_us;
    drains.sort_unstable();
    let median = drains.get(drains.len() / 2).copied().unwrap_or(0);
    let longest = drains.last().copied().unwrap_or(0);
    eprintln!(
        "e drained past its quota {} times, median {median} µs, longest {longest} µs",
        drains.len()
    );
    assert!(drains.len() >= 20, "{} drains reported", drains.len());
    // One kernel is 20 ms: the hold ends within the first, and the next waits its turn.
    assert!(
        median <= 30_000,
        "e's median drain past its quota {median} µs: more than one 20 ms kernel queued"
    );
    // The longest is the first hold's, before the bound has measured the GPU's pace: 171–183 ms
    // with every launch reading the clock until then, 290–366 ms with one launch in eight (a
    // probe eight 20 ms kernels apart).
    assert!(
        longest <= 250_000,
        "e drained {longest} µs past a quota: its first hold queued unprobed"
    );
}

/// 160 µs kernels at 30 µs of CPU each, a 3 ms pause of the CPU every 50
/// launches without synchronising (a framework's Python and allocator), a synchronisation every
/// 1,000 launches: a CPU ahead of the GPU that pauses now and then.
const PAUSING: [&str; 11] = [
    "launch",
    "--kernel-us",
    "160",
    "--launch-cpu-us",
    "30",
    "--batch",
    "1000",
    "--pause-us",
    "3000",
    "--pause-every",
    "50",
];

#[test]
fn a_tenant_alone_keeps_the_gpu_busy_through_the_pauses_of_its_cpu() {
    // A tenant alone at (1.0, 1.0) whose CPU runs ahead of the GPU (160 µs kernels at 30 µs of
    // CPU each) but pauses 3 ms every 50 launches without synchronising, as a framework's
    // Python and allocator do; a synchronisation every 1,000 launches. Held to the queue-ahead
    // bound and a 600 µs early allowance (~0.8 ms of GPU work once the pace is measured), its
    // queue runs dry in each pause: busy 0.773. (The default early allowance, 4 ms, hides most
    // of these pauses by itself.) Once its holds are renewed twice in a row it has the GPU to
    // itself, and its queue may hold the sole allowance (5 ms): busy 0.998–0.999. ResNet-50
    // training alone on an H100: 0.956–0.968 of native held to the bound, 1.002–1.009 with the
    // sole allowance.
    let _s = serial();
    let pausing = [&PAUSING[..], &["--seconds", "4"]].concat();
    let run = |sole: &str| {
        let vars = [
            ("KUBESHARE_HOOK_SOLE_AHEAD_US", sole),
            ("KUBESHARE_HOOK_EARLY_AHEAD_US", "600"),
        ];
        let (log, busy) = alone_logged(1.0, &pausing, &vars);
        let renewed = log.lines().filter(|l| l.contains("hold renewed")).count();
        eprintln!("sole allowance {sole} µs: {renewed} holds renewed, busy {busy:.3}");
        (renewed, busy)
    };
    let (renewed, deep) = run("5000");
    assert!(renewed >= 10, "{renewed} holds renewed");
    let (_, shallow) = run("0");
    assert!(
        deep >= shallow + 0.1,
        "busy {deep:.3} with the sole allowance, {shallow:.3} without"
    );
    assert!(deep >= 0.85, "busy {deep:.3} with the sole allowance");
}

/// One run of the newcomer test below: e alone at (0.5, 1.0), its CPU ahead of the GPU, with
/// `e_env` in its environment; f starts five times beside it and launches one kernel. Returns
/// f's waits for its first launch, e's renewed quotas and e's drains past its quota at the
/// hand-overs (µs, from e's log).
fn newcomer_beside_a_sole_holder(e_env: &[(&str, &str)]) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let env = Env::new();
    env.write_config(&[("e", 0.5, 1.0, GIB), ("f", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd(&["e", "f"]);
    let e_args = [&PAUSING[..], &["--seconds", "6.5"]].concat();
    let e = env
        .workload("e", "proc", &e_args)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .envs(e_env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let one = ["launch", "--kernel-us", "100", "--count", "1"];
    let mut waits = Vec::new();
    // e's first hold queues unprobed until its pace is measured, in its last tick.
    std::thread::sleep(Duration::from_millis(400));
    for _ in 0..5 {
        // e's holds renew again once f has gone (idle after 10 ms): twice in a row within ~100 ms.
        std::thread::sleep(Duration::from_millis(600));
        let out = env.run("f", "proc", &one);
        waits.push(out[0]["first_launch_us"].as_u64().unwrap());
    }
    let e = e.wait_with_output().unwrap();
    assert!(e.status.success(), "{e:?}");
    let log = String::from_utf8_lossy(&e.stderr);
    let quotas = log
        .lines()
        .filter_map(|l| number_after(l, "hold renewed for "))
        .collect();
    let drains = log
        .lines()
        .filter_map(|l| number_after(l, "(reported overuse "))
        .collect();
    (waits, quotas, drains)
}

#[test]
fn a_newcomer_waits_for_a_sole_holders_quota_and_its_allowance_only() {
    // The sole allowance's price: e renews its holds (50 ms quotas) and may keep 5 ms of GPU
    // work queued; f's first launch waits for the rest of e's quota, then for e's queue, which e
    // drains past its quota (and reports as overuse). The control, in the same conditions, is
    // e with no bound at all (`KUBESHARE_HOOK_MAX_AHEAD_US=0`). On a quiet machine e drained
    // 0.4–5.4 ms with the bound and 8–46 ms without, and f waited 2–42 ms against up to 42 ms;
    // under CI's load the bound's drains reached 20 ms once (a wall-clock bound of 15 ms
    // failed there), so the drains are judged against the control's, in total: how far the
    // control's CPU gets ahead depends on the machine's load (in one CI run four of its six
    // drains were 6–8 ms and one 61 ms, their median 7.2 ms against the bound's 4.8).
    let _s = serial();
    let (waits, quotas, drains) = newcomer_beside_a_sole_holder(&[]);
    let (waits0, _, drains0) =
        newcomer_beside_a_sole_holder(&[("KUBESHARE_HOOK_MAX_AHEAD_US", "0")]);
    eprintln!(
        "f's first launch after {waits:?} µs (no bound: {waits0:?}); e's quotas up to {:?} µs, \
         its drains past them {drains:?} µs (no bound: {drains0:?})",
        quotas.iter().max()
    );
    assert!(quotas.len() >= 10, "e's renewals: {quotas:?}");
    assert!(drains.len() >= 5, "e's hand-overs: {drains:?}");
    assert!(
        drains0.len() >= 5,
        "e's hand-overs with no bound: {drains0:?}"
    );
    assert!(
        2 * drains.iter().sum::<u64>() <= drains0.iter().sum::<u64>(),
        "e drained {drains:?} µs past its quotas with the bound, {drains0:?} without"
    );
    // So f waits at most e's quota (50 ms) and that drain.
    assert!(
        waits.iter().all(|w| *w <= 100_000),
        "f waited {waits:?} µs for its first launch"
    );
}

/// The fill gem-schd logged for its client (its "busy" debug lines, from the hook's Busy
/// frames: the median of the later half), and how many Busy frames it logged.
fn fill_logged(log: &std::path::Path) -> (f64, usize) {
    let text = std::fs::read_to_string(log).unwrap();
    let fills: Vec<f64> = text
        .lines()
        .filter(|l| l.contains(" busy ") || l.ends_with(" busy"))
        .filter_map(|l| {
            let at = l.find("fill=")? + 5;
            let v = l[at..].trim_start_matches('"');
            v.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .next()?
                .parse()
                .ok()
        })
        .collect();
    // The median of the later half: the fill settles after the process's first holds, and its
    // last reports come as it exits (its last samples, with little hold time left to report
    // beside them, moved the last fill by up to 0.1 on a loaded machine).
    let mut later = fills[fills.len() / 2..].to_vec();
    later.sort_by(f64::total_cmp);
    (
        later.get(later.len() / 2).copied().unwrap_or(f64::NAN),
        fills.len(),
    )
}

/// Each Busy frame's own reading in gem-schd's log: its GPU time over the hold time it fell in.
fn readings_logged(log: &std::path::Path) -> Vec<f64> {
    let field = |l: &str, name: &str| -> Option<f64> {
        let at = l.find(name)? + name.len();
        l[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter(|l| l.contains(" busy ") || l.ends_with(" busy"))
        .filter_map(|l| Some((field(l, "busy_us=")?, field(l, "held_us=")?)))
        .filter(|(_, held)| *held > 0.0)
        .map(|(busy, held)| busy / held)
        .collect()
}

/// 100 µs kernels with 400 µs of CPU each for 3 s: the GPU waits for the CPU most of the time.
const LAUNCH_BOUND_3S: [&str; 9] = [
    "launch",
    "--kernel-us",
    "100",
    "--launch-cpu-us",
    "400",
    "--batch",
    "20",
    "--seconds",
    "3",
];

#[test]
fn gem_schd_learns_how_busy_a_tenant_keeps_the_gpu_from_its_timed_launches() {
    // With co-running on, gem-schd asks the hook (Options) to time one launch in ~256 with an
    // event pair and report the GPU time with the hold time it fell in (Busy); gem-schd keeps
    // the client's fill. A tenant whose CPU waits between short kernels (launch-bound, like
    // batch-1 inference) and one whose CPU runs far ahead (like training) must be told apart,
    // each near the busy fraction it measured itself. Without co-running nothing is timed.
    let _s = serial();
    let run = |schd_args: &[&str], args: &[&str]| {
        let env = Env::new();
        env.write_config(&[("e", 1.0, 1.0, GIB)]);
        let (_schd, log) = env.start_schd_debug(&["e"], schd_args);
        let out = env.run("e", "proc", args);
        let (own, _, _) = busy_fraction(&out[0], 500);
        let (fill, reports) = fill_logged(&log);
        eprintln!(
            "{schd_args:?} {args:?}: the tenant measured busy {own:.3}, gem-schd's fill {fill:.3} after {reports} reports"
        );
        (own, fill, reports)
    };
    let co = ["--co-run-below", "0.6"];
    let launch_bound = LAUNCH_BOUND_3S;
    let (own, fill, reports) = run(&co, &launch_bound);
    assert!(reports >= 10, "only {reports} Busy frames reached gem-schd");
    assert!(
        own < 0.6,
        "the launch-bound tenant kept the GPU {own:.3} busy"
    );
    assert!(
        (fill - own).abs() <= 0.1,
        "launch-bound: gem-schd's fill {fill:.3}, the tenant's own measure {own:.3}"
    );
    let far_ahead: Vec<&str> = CPU_AHEAD[..CPU_AHEAD.len() - 1]
        .iter()
        .copied()
        .chain(["3"])
        .collect();
    // A tenant that keeps the GPU busy: its fill must read so too.
    let busy_and_read_so = |what: &str, args: &[&str]| {
        let (own, fill, _) = run(&co, args);
        assert!(own > 0.8, "{what}: kept the GPU only {own:.3} busy");
        assert!(
            (fill - own).abs() <= 0.1,
            "{what}: gem-schd's fill {fill:.3}, the tenant's own measure {own:.3}"
        );
    };
    busy_and_read_so("far ahead", &far_ahead);
    // 25 ms kernels, 40 launches a second: the gap drawn at the first sample (~256 launches)
    // would wait 3-10 s for the next one, and the fill decayed to ~0.03 meanwhile; an overdue
    // sample is taken at the next launch after a report.
    let long = [
        "launch",
        "--kernel-us",
        "25000",
        "--batch",
        "4",
        "--seconds",
        "3",
    ];
    busy_and_read_so("long kernels", &long);
    let (_, _, reports) = run(&[], &launch_bound);
    assert_eq!(
        reports, 0,
        "Busy frames sent to a gem-schd that does not co-run"
    );
}

#[test]
fn timing_every_launch_reads_each_hold_of_a_launch_bound_tenant() {
    // KUBESHARE_HOOK_BUSY_EVERY=1 times every launch, so each Busy frame reads its own holds'
    // GPU time rather than a few samples each standing for its gap: every reading, not only
    // gem-schd's average over them, is the tenant's busy fraction. (Sampled one in ~256, about
    // half the same tenant's readings fall within 0.1 of it; its average does.)
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 1.0, 1.0, GIB)]);
    let (_schd, log) = env.start_schd_debug(&["e"], &["--co-run-below", "0.6"]);
    let out = env
        .workload("e", "proc", &LAUNCH_BOUND_3S)
        .env("KUBESHARE_HOOK_BUSY_EVERY", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "workload failed: {:?}", out.status);
    let (own, _, _) = busy_fraction(&parse_lines(&out.stdout)[0], 500);
    let (fill, _) = fill_logged(&log);
    let readings = readings_logged(&log);
    let close = readings.iter().filter(|r| (*r - own).abs() <= 0.1).count();
    eprintln!(
        "every launch timed: busy {own:.3}, gem-schd's fill {fill:.3}; {close} of {} readings within 0.1 of it",
        readings.len()
    );
    assert!(
        readings.len() >= 10,
        "only {} Busy frames reached gem-schd",
        readings.len()
    );
    assert!(
        close * 10 >= readings.len() * 9,
        "{close} of {} readings within 0.1 of the tenant's busy {own:.3}: {readings:?}",
        readings.len()
    );
    assert!(
        (fill - own).abs() <= 0.05,
        "gem-schd's fill {fill:.3}, the tenant's own measure {own:.3}"
    );
}

/// e launches 40 kernels of 10 ms at 3 ms of CPU each (its queue-ahead bound off, so the queue
/// grows to ~280 ms) in its first hold, ~200 ms long (gem-schd's base quota is 300 ms; its
/// grace, 500 ms, outlasts the drain), and then waits for them; f asks for the token meanwhile
/// (its one launch blocks). e's launching ends ~120 ms into its hold, so the hook's idle thread
/// starts waiting for e's queue (the first step of an idle release) well before the quota ends.
/// `e_env` goes into e's environment. Returns (when f's first launch passed, when e's queued
/// work had run), both Unix µs.
fn newcomer_beside_a_long_drain(e_env: &[(&str, &str)]) -> (u64, u64) {
    let env = Env::new();
    env.write_config(&[("e", 0.5, 1.0, GIB), ("f", 0.5, 1.0, GIB)]);
    let _schd = env.start_schd_with(
        &["e", "f"],
        &["--base-quota-ms", "300", "--grace-ms", "500"],
    );
    let e_args = [
        "launch",
        "--kernel-us",
        "10000",
        "--launch-cpu-us",
        "3000",
        "--batch",
        "40",
        "--count",
        "40",
    ];
    let mut e = env
        .workload("e", "proc", &e_args)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .env("KUBESHARE_HOOK_MAX_AHEAD_US", "0")
        .envs(e_env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let granted = said_on_stderr(&mut e, "granted");
    let e = Proc(e);
    granted
        .recv_timeout(Duration::from_secs(10))
        .expect("e's grant");
    let f = env.run(
        "f",
        "symbol",
        &["launch", "--kernel-us", "1000", "--count", "1"],
    );
    let e = e.finish(Duration::from_secs(20));
    let f_first = f[0]["first_launch_unix_us"].as_u64().unwrap();
    let e_start =
        e[0]["first_launch_unix_us"].as_u64().unwrap() - e[0]["first_launch_us"].as_u64().unwrap();
    (f_first, e_start + e[0]["wall_us"].as_u64().unwrap())
}

#[test]
fn the_next_holder_launches_while_the_last_ones_queued_work_drains() {
    // e's hold ends while its process waits for its own queued work (~200 ms more): the hook's
    // idle thread tells gem-schd it drains (a Renew answered Yield, or, with renewals off, a
    // Drain), and gem-schd grants f at once; f's launch passes then and queues behind e's
    // work, instead of after e's drain and report (the GPU idled for those and f's wake-up at
    // every hand-over; handed over after the report, f's launch passed 0.6–1.6 ms after e's
    // work had run here). The idle thread waits for e's queue from ~10 ms after e's last launch,
    // long before the quota ends: while that wait ran on the idle thread itself, under the
    // token lock, nothing ended the hold at its quota, and f's launch passed ~1 ms after e's
    // work had run (in ~1 run of 4 with e's last launch ~9 ms before its quota end, in every
    // run here).
    let _s = serial();
    for e_env in [&[][..], &[("KUBESHARE_HOOK_RENEW", "0")][..]] {
        let (f_first, e_drained) = newcomer_beside_a_long_drain(e_env);
        eprintln!(
            "{e_env:?}: f's first launch passed {:.1} ms before e's work had run",
            (e_drained as f64 - f_first as f64) / 1000.0
        );
        assert!(
            f_first + 40_000 <= e_drained,
            "{e_env:?}: f's first launch at {f_first}, e drained at {e_drained} (Unix µs)"
        );
    }
}

#[test]
fn an_idle_co_runner_gives_its_co_hold_back_instead_of_renewing_it() {
    // e, light (100 µs kernels, 500 µs of CPU each), co-runs beside f's 2 ms kernels, then
    // computes 1 s on the CPU launching nothing, and exits. Its co-hold must end once its
    // queue is seen drained: renewed at each quota's end "while the process waits", it kept a
    // co-hold every 20 ms, charged and counted as co-running, for as long as it stayed idle
    // (a PyTorch tenant's 13 s of profiler teardown on an H200).
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.5, 1.0, GIB), ("f", 0.5, 1.0, GIB)]);
    let (_schd, log) = env.start_schd_debug(&["e", "f"], &["--co-run-below", "0.6"]);
    let f_args = ["launch", "--kernel-us", "2000", "--seconds", "3.5"];
    let f = Proc(env.workload("f", "dlsym", &f_args).spawn().unwrap());
    let e_args = [
        "launch",
        "--kernel-us",
        "100",
        "--launch-cpu-us",
        "500",
        "--batch",
        "3000",
        "--think-us",
        "1000000",
        "--seconds",
        "1.5",
    ];
    env.run("e", "proc", &e_args);
    let exited = unix_us() as f64 / 1e6 % 86_400.0;
    f.finish(Duration::from_secs(30));
    let text = std::fs::read_to_string(&log).unwrap();
    let e_lines: Vec<&str> = text.lines().filter(|l| l.contains("client=e ")).collect();
    let co_holds = e_lines
        .iter()
        .filter(|l| l.contains(" grant ") && l.contains("co=true"))
        .count();
    // gem-schd's last word with e (RFC 3339, UTC) as seconds of the day, like `exited`.
    let last = e_lines
        .iter()
        .rev()
        .find(|l| !l.contains("connection closed"))
        .and_then(|l| {
            let hms = l.split('T').nth(1)?.split('Z').next()?;
            let mut p = hms.split(':').map(|x| x.parse::<f64>().ok());
            Some(p.next()?? * 3600.0 + p.next()?? * 60.0 + p.next()??)
        })
        .expect("gem-schd logged nothing of e");
    let quiet = (exited - last).rem_euclid(86_400.0);
    eprintln!("e: {co_holds} co-holds; gem-schd heard last from it {quiet:.3} s before it exited");
    assert!(co_holds >= 5, "e co-ran only {co_holds} times");
    assert!(
        quiet >= 0.8,
        "e's co-hold went on through its 1 s without a launch: gem-schd heard from it {quiet:.3} s \
         before it exited; its last lines:\n{}",
        e_lines[e_lines.len().saturating_sub(6)..].join("\n")
    );
}

#[test]
fn hooks_told_soon_take_their_grants_without_reconnecting() {
    // With gem-schd's --soon, a holder whose drains run long (3 ms kernels, past a fifth of the
    // 5 ms min quota) says at each quota's end that it drains, and gem-schd tells the tenant
    // that goes next Soon. Its hook (no gate page here) reads it, polls for the Grant and goes
    // on: every Soon is followed by a grant on the same connection (a hook that could not read
    // it would fail the request and connect again), and the two split the GPU by their requests.
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.5, 0.5, GIB), ("f", 0.5, 0.5, GIB)]);
    let (_schd, log) = env.start_schd_debug(&["e", "f"], &["--soon"]);
    let (fe, ff, share_e) = long_drain_pair(&env, &[("KUBESHARE_HOOK_GATE_AHEAD_US", "0")], None);
    let text = std::fs::read_to_string(&log).unwrap();
    let count = |what: &str, client: &str| {
        let client = format!("client={client}");
        text.lines()
            .filter(|l| l.contains(what) && l.contains(&client))
            .count()
    };
    let told = count(" soon", "e") + count(" soon", "f");
    let connected = [
        count("client connected", "e"),
        count("client connected", "f"),
    ];
    eprintln!(
        "GPU time e {fe:.3}, f {ff:.3}; e's share {share_e:.3}; Soon {told} times; connections {connected:?}"
    );
    // Most hand-overs come from a long drain (374–403 Soons in 4 s on an idle machine): tens
    // show that every one is followed by its grant.
    assert!(told >= 50, "gem-schd told Soon {told} times:\n{text}");
    // One token and one memory connection each, for the whole run.
    assert!(
        connected.iter().all(|n| *n <= 2),
        "connections per client: {connected:?}"
    );
    assert_split_evenly(fe, ff, share_e);
}

/// e and f, each (0.5, 0.5), running [`long_drains`] side by side to their end, with `vars` in
/// both and f's hook log at debug written to `f_log` when given: their GPU time and e's share
/// of it (`pair_busy`).
fn long_drain_pair(env: &Env, vars: &[(&str, &str)], f_log: Option<&Path>) -> (f64, f64, f64) {
    let mut e = env.workload("e", "proc", &long_drains("200"));
    let mut f = env.workload("f", "symbol", &long_drains("200"));
    e.envs(vars.iter().copied());
    f.envs(vars.iter().copied());
    if let Some(path) = f_log {
        f.env("KUBESHARE_HOOK_LOG", "debug")
            .stderr(std::fs::File::create(path).unwrap());
    }
    let (e, f) = (Proc(e.spawn().unwrap()), Proc(f.spawn().unwrap()));
    let t = Duration::from_secs(30);
    let (e, f) = (e.finish(t), f.finish(t));
    pair_busy(&e[0], &f[0], 1000)
}

/// Two tenants at equal requests split the GPU time evenly and keep it busy: 0.88–0.91 of the
/// time here, 0.84–0.87 beside one CPU hog (the fake runs only while its processes get a CPU
/// to launch on).
fn assert_split_evenly(fe: f64, ff: f64, share_e: f64) {
    assert!(
        (share_e - 0.5).abs() <= 0.05,
        "e got {share_e:.3} of the GPU time, not 0.5 ± 0.05"
    );
    assert!(fe + ff >= 0.8, "GPU mostly idle: {fe:.3} + {ff:.3}");
}

#[test]
fn hooks_with_a_gate_queue_launches_ahead_of_their_grants() {
    // Without --soon gem-schd still tells a connection with a gate page Soon (the hook asks for
    // one by default). The tenant that goes next then queues its launch behind the gate
    // instead of blocking; gem-schd opens the gate with the Grant, and a later launch (or the
    // idle thread) reads it and starts the hold. Every queueing ahead ends in a grant on the
    // same connection, and the two still split the GPU by their requests: work held back
    // behind the gate does not run in the other tenant's turn.
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.5, 0.5, GIB), ("f", 0.5, 0.5, GIB)]);
    let (_schd, log) = env.start_schd_debug(&["e", "f"], &[]);
    let hook_log = env.path().join("f-hook.log");
    let (fe, ff, share_e) = long_drain_pair(&env, &[], Some(&hook_log));
    let schd = std::fs::read_to_string(&log).unwrap();
    let hook = std::fs::read_to_string(&hook_log).unwrap();
    let lines = |text: &str, what: &str| text.lines().filter(|l| l.contains(what)).count();
    let gated = lines(&schd, "gate page given");
    let queued = lines(&hook, "launches queue behind the gate");
    let granted =
        lines(&hook, "work queued behind the gate") + lines(&hook, "read by the idle thread");
    let connected = lines(&schd, "client connected");
    eprintln!(
        "GPU time e {fe:.3}, f {ff:.3}; e's share {share_e:.3}; gate pages {gated}; f queued ahead {queued} times, granted so {granted}; connections {connected}"
    );
    assert_eq!(gated, 2, "one gate page per token connection:\n{schd}");
    // 120–165 times in 4 s on an idle machine.
    assert!(queued >= 30, "f queued ahead {queued} times:\n{hook}");
    // The last one may be cut short by the end of the run.
    assert!(
        granted + 1 >= queued,
        "f queued ahead {queued} times, granted so {granted}:\n{hook}"
    );
    assert!(connected <= 4, "connections: {connected}");
    assert_split_evenly(fe, ff, share_e);
}
