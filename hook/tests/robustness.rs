//! libgemhook under the adversary, without a GPU (fake libcuda, real gem-schd): memory that
//! escapes the cap through virtual-memory mappings or ends of contexts, forked children, a hung
//! gem-schd, a gem-schd killed during a hold, a gem-schd from before Renew, and NVML's memory
//! queries.
//!
//! Needs `make hook-prereqs` (builds gemhook, fake-libcuda and gem-schd into target/debug).

mod common;

use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

#[test]
fn a_released_handle_stays_counted_while_mapped() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let bytes = (600 * MIB).to_string();
    for lookup in LOOKUPS {
        let out = env.run("a", lookup, &["vmm", "--bytes", &bytes]);
        let step = |name: &str| -> &Value {
            out.iter()
                .find(|v| v["step"] == name)
                .unwrap_or_else(|| panic!("{lookup}: no step {name} in {out:?}"))
        };
        let rel = step("released-while-mapped");
        assert_eq!(rel["rc"], 0, "{lookup}");
        // The driver keeps a mapped handle's memory: still counted.
        assert_eq!(rel["mem"]["free"], GIB - 600 * MIB, "{lookup}");
        // So a second 600 MiB does not fit under the 1 GiB cap (it escaped it before).
        assert_eq!(step("second-create")["rc"], 2, "{lookup}");
        // The last unmap frees it: credited.
        assert_eq!(step("unmapped")["mem"]["free"], GIB, "{lookup}");
        assert_eq!(step("third-create")["rc"], 0, "{lookup}");
    }
}

#[test]
fn ending_a_context_credits_the_memory_it_owned() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let bytes = (600 * MIB).to_string();
    for lookup in LOOKUPS {
        for how in ["destroy", "reset", "release"] {
            let what = format!("{lookup}/{how}");
            let out = env.run("a", lookup, &["ctx-end", "--bytes", &bytes, "--how", how]);
            assert_eq!(out[0]["step"], "allocated", "{what}");
            assert_eq!(out[0]["mem"]["free"], GIB - 600 * MIB, "{what}");
            assert_eq!(out[1]["rc"], 0, "{what}");
            assert_eq!(
                out[1]["mem"]["free"], GIB,
                "{what}: the driver freed the context's memory; the pod must get it back"
            );
        }
    }
}

#[test]
fn a_forked_child_is_another_process_of_the_client_and_the_parent_is_untouched() {
    let _s = serial();
    let env = Env::new();
    // Limit 0.5: the parent's launching thread often waits for the token, holding the
    // hook's token lock, when it forks; its memory thread is always mid-request.
    env.write_config(&[("a", 0.5, 0.5, GIB)]);
    let _schd = env.start_schd(&["a"]);
    let bytes = (600 * MIB).to_string();
    for lookup in ["symbol", "proc"] {
        let out = env.run(
            "a",
            lookup,
            &[
                "fork",
                "--bytes",
                &bytes,
                "--children",
                "4",
                "--kernel-us",
                "2000",
            ],
        );
        let parent = out
            .iter()
            .find(|v| v["parent"] == true)
            .expect("parent line");
        let children: Vec<&Value> = out.iter().filter(|v| v.get("child").is_some()).collect();
        assert_eq!(
            parent["children"].as_array().map(|c| c.len()),
            Some(4),
            "{lookup}: {out:?}"
        );
        for c in parent["children"].as_array().unwrap() {
            assert_eq!(c["exited"], true, "{lookup}: a child hung or failed: {c}");
        }
        assert_eq!(children.len(), 4, "{lookup}: {out:?}");
        for c in &children {
            // The child counts against the same pod (the parent holds 600 MiB of 1 GiB)...
            assert_eq!(c["alloc_rc"], 2, "{lookup}: {c}");
            assert_eq!(c["small_alloc_rc"], 0, "{lookup}: {c}");
            assert_eq!(c["mem"]["total"], GIB, "{lookup}: {c}");
            // ...and gets the token as its own process.
            assert_eq!(c["launch_rc"], 0, "{lookup}: {c}");
            assert_eq!(c["sync_rc"], 0, "{lookup}: {c}");
        }
        // The parent's connections were not disturbed: it launched on after the forks, and
        // its free was credited on its own connection.
        assert!(
            parent["launched_after_forks"].as_u64().unwrap() > 0,
            "{lookup}: {parent}"
        );
        assert_eq!(parent["free_rc"], 0, "{lookup}");
        assert_eq!(parent["mem"]["free"], GIB, "{lookup}: {parent}");
    }
}

#[test]
fn nvml_shows_the_pods_cap_and_use() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 0.5, 1.0, 4 * GIB)]);
    let _schd = env.start_schd(&["a"]);
    let mut holder = Proc(
        env.workload(
            "a",
            "symbol",
            &[
                "alloc",
                "--bytes",
                &(300 * MIB).to_string(),
                "--hold-ms",
                "3000",
            ],
        )
        .spawn()
        .unwrap(),
    );
    assert_eq!(holder.next_line()["codes"], json!([0]));
    let out = env.run("a", "symbol", &["nvml"]);
    for v in ["v1", "v2"] {
        let m = &out[0][v];
        assert_eq!(m["rc"], 0, "{v}");
        assert_eq!(m["total"], 4 * GIB, "{v}: {m}");
        assert_eq!(m["used"], 300 * MIB, "{v}: {m}");
        assert_eq!(m["free"], 4 * GIB - 300 * MIB, "{v}: {m}");
    }
    // Outside a pod NVML answers as the device does.
    let out = env
        .workload("a", "symbol", &["nvml"])
        .env("KUBESHARE_SOCKET_DIR", env.path().join("no-such-dir"))
        .output()
        .unwrap();
    assert_eq!(parse_lines(&out.stdout)[0]["v1"]["total"], 16 * GIB);
}

fn signal(p: &Proc, sig: i32) {
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(p.0.id() as i32, sig) };
}

#[test]
fn a_hung_gem_schd_never_blocks_memory_calls_and_launches_follow_the_policy() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, GIB)]);
    let schd = env.start_schd(&["a"]);
    signal(&schd, libc::SIGSTOP);
    let bytes = (100 * MIB).to_string();
    // Fail closed (`wait`): the allocation is refused after the timeout, not blocked.
    let t0 = Instant::now();
    let out = env
        .workload("a", "proc", &["alloc", "--bytes", &bytes])
        .env("KUBESHARE_HOOK_TIMEOUT_MS", "300")
        .output()
        .unwrap();
    let took = t0.elapsed();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(parse_lines(&out.stdout)[0]["codes"], json!([2]));
    assert!(took < Duration::from_secs(5), "blocked {took:?}");
    // Fail open (`run`): allocations and launches pass unaccounted.
    let out = env
        .workload("a", "proc", &["alloc", "--bytes", &bytes])
        .env("KUBESHARE_HOOK_TIMEOUT_MS", "300")
        .env("KUBESHARE_ON_UNREACHABLE", "run")
        .output()
        .unwrap();
    assert_eq!(parse_lines(&out.stdout)[0]["codes"], json!([0]));
    let out = env
        .workload(
            "a",
            "dlsym",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_HOOK_TIMEOUT_MS", "300")
        .env("KUBESHARE_ON_UNREACHABLE", "run")
        .output()
        .unwrap();
    assert_eq!(parse_lines(&out.stdout)[0]["kernels"], 5);
    // Under `wait`, launches wait for the hung daemon, and go on once it answers again: the
    // hook reports gem-schd unreachable (its connection timed out) and waits; only after
    // gem-schd is resumed does the first launch return.
    let mut child = env
        .workload(
            "a",
            "dlsym",
            &["launch", "--kernel-us", "1000", "--count", "5"],
        )
        .env("KUBESHARE_HOOK_TIMEOUT_MS", "300")
        .env("KUBESHARE_HOOK_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let said_wait = said_on_stderr(&mut child, "waiting (KUBESHARE_ON_UNREACHABLE=wait)");
    let mut waiting = Proc(child);
    said_wait
        .recv_timeout(Duration::from_secs(10))
        .expect("the hook never reported the stopped gem-schd unreachable");
    assert!(
        waiting.running(),
        "launched while gem-schd was hung under `wait`"
    );
    let resumed = unix_us();
    signal(&schd, libc::SIGCONT);
    let out = waiting.finish(Duration::from_secs(20));
    assert_eq!(out[0]["kernels"], 5);
    let first = out[0]["first_launch_unix_us"].as_u64().unwrap_or(0);
    assert!(
        first >= resumed,
        "the first launch returned {} µs before gem-schd was resumed",
        resumed - first
    );
    let out = env.run("a", "proc", &["alloc", "--bytes", &bytes]);
    assert_eq!(out[0]["codes"], json!([0]), "accounting works again");
}

/// Longest stretch, in ms, during which a launch run's GPU time did not grow, from its samples
/// (a launch blocked at the gate takes no samples: the gap counts).
fn longest_stall_ms(v: &Value) -> f64 {
    let s = v["samples"].as_array().unwrap();
    let pt = |x: &Value| (x[0].as_f64().unwrap(), x[1].as_f64().unwrap() / 1000.0);
    s.windows(2)
        .map(|w| {
            let ((t0, b0), (t1, b1)) = (pt(&w[0]), pt(&w[1]));
            (t1 - t0) - (b1 - b0)
        })
        .fold(0.0, f64::max)
}

#[test]
fn a_holder_stops_launching_when_its_gem_schd_dies() {
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("a", 1.0, 1.0, GIB)]);
    // Holds of 2 s: without noticing the hang-up, the holder would launch on through the
    // death and the restart (a busy client's grants are otherwise short).
    let args = [
        "--base-quota-ms",
        "2000",
        "--min-quota-ms",
        "2000",
        "--quiet-ms",
        "200",
    ];
    let schd = env.start_schd_with(&["a"], &args);
    let a = Proc(
        env.workload(
            "a",
            "proc",
            &[
                "launch",
                "--kernel-us",
                "2000",
                "--batch",
                "5",
                "--seconds",
                "2.5",
                "--sample-ms",
                "10",
            ],
        )
        .spawn()
        .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(900));
    drop(schd); // SIGKILL
    std::thread::sleep(Duration::from_millis(500));
    let _schd = env.start_schd_with(&["a"], &args);
    let out = a.finish(Duration::from_secs(20));
    let stall = longest_stall_ms(&out[0]);
    // Gone for 500 ms, then the 200 ms quiet period: the holder must have stopped for most of
    // that (it stops within a poll tick plus its queued 10 ms batch).
    assert!(
        stall >= 550.0,
        "the holder kept launching without a live gem-schd (longest stall {stall:.0} ms)"
    );
}

#[test]
fn launches_queued_behind_a_gate_run_when_gem_schd_dies() {
    // Two tenants of 3 ms kernels, whose drains run long: f is told Soon at most hand-overs and
    // queues a launch behind its gate. gem-schd is SIGKILLed right after f says so, and started
    // again 300 ms later. The lost connection's page is opened as the hook drops it, so the
    // kernel queued behind it runs (kept shut, it would hold f's queue, and f's own syncs,
    // forever); f connects again, gets a new page, and both tenants run to their end.
    let _s = serial();
    let env = Env::new();
    env.write_config(&[("e", 0.5, 0.5, GIB), ("f", 0.5, 0.5, GIB)]);
    let schd = env.start_schd(&["e", "f"]);
    let args = long_drains("10");
    let e = Proc(env.workload("e", "proc", &args).spawn().unwrap());
    let mut f = env
        .workload("f", "symbol", &args)
        .env("KUBESHARE_HOOK_LOG", "debug")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let queued = said_on_stderr(&mut f, "launches queue behind the gate");
    // Past the start-up: the second queueing ahead (there are over a hundred in a run).
    for n in 0..2 {
        queued
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("f queued behind its gate {n} times in 10 s"));
    }
    drop(schd); // SIGKILL
    std::thread::sleep(Duration::from_millis(300));
    let _schd = env.start_schd(&["e", "f"]);
    let t = Duration::from_secs(30);
    let (e, f) = (e.finish(t), Proc(f).finish(t));
    for (name, out) in [("e", &e[0]), ("f", &f[0])] {
        let stall = longest_stall_ms(out);
        // Gone 300 ms, then the 200 ms quiet period and the reconnection.
        assert!(
            stall < 2000.0,
            "{name} stood still {stall:.0} ms across the restart"
        );
    }
}

/// Which older gem-schd [`serve_like_an_old_gem_schd`] plays.
#[derive(Clone, Copy, PartialEq)]
enum Old {
    /// From before Renew (and Options, Busy, Drain, WantSoon, WantGate, Parks).
    BeforeRenew,
    /// From after Options and Busy but before Busy's `earlier_us`: it asks for reports (one
    /// launch in 8) and takes a Busy of two fields, refusing a longer one as trailing bytes.
    TwoFieldBusy,
    /// From before WantGate: it answers Options (no reports) and takes WantSoon.
    BeforeGate,
    /// From before Parks: it also answers Renew with Yield and gives gate pages, whose word it
    /// opens before each Grant.
    BeforeParks,
}

/// What an older gem-schd (`old`) does, over a real socket: answers Hello, grants every
/// TokenRequest 5 ms, passes memory calls, and answers a frame it cannot read with Error{2}
/// and a hang-up. Records the kinds of the frames it received.
fn serve_like_an_old_gem_schd(
    sock: std::path::PathBuf,
    seen: std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>,
    old: Old,
) {
    use gem_proto::{Reply, Request, code};
    use std::io::{Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let seen = seen.clone();
            std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                let two_field_busy = old == Old::TwoFieldBusy;
                let knows_soon = matches!(old, Old::BeforeGate | Old::BeforeParks);
                let knows_gate = old == Old::BeforeParks;
                let mut page: Option<gem_proto::GatePage> = None;
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Ok(Some((req, used))) = Request::decode(&buf) {
                        buf.drain(..used);
                        // A Busy frame of two fields: 4 + 1 + 1 + 16 bytes.
                        let (what, reply) = match req {
                            Request::Options if two_field_busy => {
                                ("options", Some(Reply::OptionsOk { busy_every: 8 }))
                            }
                            Request::Options if knows_soon => {
                                ("options", Some(Reply::OptionsOk { busy_every: 0 }))
                            }
                            Request::WantSoon if knows_soon => ("want_soon", None),
                            Request::Renew { .. } if knows_gate => ("renew", Some(Reply::Yield)),
                            Request::WantGate if knows_gate => {
                                let p = page.insert(gem_proto::GatePage::create().unwrap());
                                let frame = Reply::Gate.encode().unwrap();
                                gem_proto::gate::send_with_fd(s.as_raw_fd(), &frame, p.fd())
                                    .unwrap();
                                seen.lock().unwrap().push("want_gate");
                                continue;
                            }
                            Request::Busy { .. } if two_field_busy && used == 22 => ("busy", None),
                            Request::Busy { .. } if two_field_busy => {
                                seen.lock().unwrap().push("busy3");
                                let e = Reply::error(
                                    code::BAD_FRAME,
                                    gem_proto::FrameError::TrailingBytes {
                                        kind: req.kind(),
                                        extra: used - 22,
                                    }
                                    .to_string(),
                                );
                                let _ = s.write_all(&e.encode().unwrap());
                                return;
                            }
                            Request::Hello { .. } => (
                                "hello",
                                Some(Reply::HelloOk {
                                    request_milli: 1000,
                                    limit_milli: 1000,
                                    mem_limit: GIB,
                                    mem_used: 0,
                                    window_ms: 10_000,
                                }),
                            ),
                            Request::TokenRequest { .. } => {
                                if let Some(p) = &page {
                                    p.open();
                                }
                                ("request", Some(Reply::Grant { quota_us: 5000 }))
                            }
                            Request::Renew { .. }
                            | Request::Busy { .. }
                            | Request::Options
                            | Request::Drain
                            | Request::WantSoon
                            | Request::WantGate
                            | Request::Parks => {
                                let k = req.kind();
                                seen.lock().unwrap().push(match k {
                                    7 => "renew",
                                    9 => "options",
                                    10 => "drain",
                                    11 => "want_soon",
                                    12 => "want_gate",
                                    13 => "parks",
                                    _ => "busy",
                                });
                                let e = Reply::error(
                                    code::BAD_FRAME,
                                    format!("unknown frame kind {k}"),
                                );
                                let _ = s.write_all(&e.encode().unwrap());
                                return; // and hang up, as gem-schd does after a bad frame
                            }
                            Request::Release { .. } => ("release", None),
                            Request::MemAlloc { .. } => (
                                "alloc",
                                Some(Reply::MemVerdict {
                                    granted: true,
                                    used: 0,
                                    limit: GIB,
                                }),
                            ),
                            Request::MemFree { .. } => ("free", None),
                            Request::MemQuery => (
                                "query",
                                Some(Reply::MemInfo {
                                    used: 0,
                                    limit: GIB,
                                }),
                            ),
                        };
                        seen.lock().unwrap().push(what);
                        if let Some(r) = reply
                            && s.write_all(&r.encode().unwrap()).is_err()
                        {
                            return;
                        }
                    }
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
}

/// Runs a 1 s launch loop of client a beside [`serve_like_an_old_gem_schd`], with `env` in its
/// environment: the kinds of the frames that gem-schd received, once the loop got through.
fn frames_beside_an_old_gem_schd(old: Old, env_vars: &[(&str, &str)]) -> Vec<&'static str> {
    let _s = serial();
    let env = Env::new();
    let dir = env.client_dir("a");
    std::fs::create_dir_all(&dir).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    serve_like_an_old_gem_schd(dir.join(format!("{GPU}.sock")), seen.clone(), old);
    let run = env
        .workload(
            "a",
            "proc",
            &["launch", "--kernel-us", "1000", "--seconds", "1"],
        )
        .envs(env_vars.iter().copied())
        .spawn()
        .unwrap();
    let out = Proc(run).finish(Duration::from_secs(20));
    assert!(out[0]["kernels"].as_u64().unwrap() >= 200, "{out:?}");
    seen.lock().unwrap().clone()
}

/// TokenRequests from the first frame of kind `kind` on (0 if none was sent).
fn requests_after(seen: &[&str], kind: &str) -> usize {
    let first = seen.iter().position(|k| *k == kind);
    first.map_or(0, |i| seen[i..].iter().filter(|k| **k == "request").count())
}

#[test]
fn a_gem_schd_without_renew_or_options_costs_one_reconnection_each() {
    // Version skew in an upgrade: a hook with renewals and Options beside a gem-schd without
    // them (and WantSoon). The first of each is refused (Error{2}, the connection closed); the
    // hook reconnects and never sends that frame again: TokenRequests from then on, and no
    // Busy reports (nobody asked for them).
    let seen = frames_beside_an_old_gem_schd(Old::BeforeRenew, &[]);
    let count = |kind: &str| seen.iter().filter(|k| **k == kind).count();
    assert_eq!(count("renew"), 1, "Renews sent: {seen:?}");
    // Older than Renew, older than Drain: never sent.
    assert_eq!(count("drain"), 0, "Drains sent: {seen:?}");
    assert_eq!(count("options"), 1, "Options sent: {seen:?}");
    assert_eq!(count("want_soon"), 1, "WantSoon frames sent: {seen:?}");
    // Refused WantSoon: a gem-schd without Soon has no use for a gate page.
    assert_eq!(count("want_gate"), 0, "WantGate frames sent: {seen:?}");
    assert_eq!(count("busy"), 0, "Busy frames sent: {seen:?}");
    let after = requests_after(&seen, "renew");
    assert!(
        after >= 50,
        "token requests after the refusal: {after} of {seen:?}"
    );
}

#[test]
fn a_gem_schd_without_gate_pages_costs_one_reconnection() {
    // The hook beside a gem-schd from before WantGate (it knows Options and WantSoon): the
    // first WantGate is refused and the connection closed; the hook connects again, asks
    // Options and WantSoon as before and no WantGate, and its launches go on.
    let seen = frames_beside_an_old_gem_schd(Old::BeforeGate, &[]);
    let count = |kind: &str| seen.iter().filter(|k| **k == kind).count();
    assert_eq!(count("want_gate"), 1, "WantGate frames sent: {seen:?}");
    let first_gate = seen.iter().position(|k| *k == "want_gate").unwrap();
    assert!(
        seen[first_gate..].contains(&"want_soon"),
        "WantSoon asked again after the refusal: {seen:?}"
    );
    let after = requests_after(&seen, "want_gate");
    assert!(
        after >= 50,
        "token requests after the refusal: {after} of {seen:?}"
    );
}

#[test]
fn a_gem_schd_without_parks_costs_one_reconnection() {
    // A hook that parks beside a gem-schd from before Parks (it gives gate pages and answers
    // Renew): the first Parks is refused and the connection closed; the hook connects again
    // with its gate page and sends no Parks after, so its holds drain (that gem-schd may hand
    // the token on at a notice), and its launches go on.
    let seen = frames_beside_an_old_gem_schd(Old::BeforeParks, &[("KUBESHARE_HOOK_PARK", "1")]);
    let count = |kind: &str| seen.iter().filter(|k| **k == kind).count();
    assert_eq!(count("parks"), 1, "Parks frames sent: {seen:?}");
    let first = seen.iter().position(|k| *k == "parks").unwrap();
    assert!(
        seen[first..].contains(&"want_gate"),
        "a gate page asked for again after the refusal: {seen:?}"
    );
    let after = requests_after(&seen, "parks");
    assert!(
        after >= 50,
        "token requests after the refusal: {after} of {seen:?}"
    );
}

#[test]
fn a_gem_schd_reading_two_field_busy_costs_one_reconnection() {
    // Version skew in an upgrade or a rollback: a hook whose Busy carries `earlier_us` beside a
    // gem-schd that reads two fields and refuses the third as trailing bytes. The first Busy
    // is refused (the connection closed); the hook reconnects and sends no more Busy, its
    // token requests going on.
    let seen = frames_beside_an_old_gem_schd(Old::TwoFieldBusy, &[]);
    let refused = seen.iter().filter(|k| **k == "busy3").count();
    assert_eq!(refused, 1, "three-field Busy frames sent: {seen:?}");
    let after = requests_after(&seen, "busy3");
    assert!(
        after >= 50,
        "token requests after the refusal: {after} of {seen:?}"
    );
}

#[test]
fn a_gem_schd_without_drain_costs_a_hook_that_does_not_renew_one_reconnection() {
    // A hook with renewals off tells gem-schd with a Drain that it drains at each quota's end;
    // a gem-schd from before Drain refuses the first (Error{2}, the connection closed), and the
    // hook reconnects and sends no more: its token requests go on as before Drain.
    let seen = frames_beside_an_old_gem_schd(Old::BeforeRenew, &[("KUBESHARE_HOOK_RENEW", "0")]);
    let count = |kind: &str| seen.iter().filter(|k| **k == kind).count();
    assert_eq!(count("drain"), 1, "Drains sent: {seen:?}");
    assert_eq!(count("renew"), 0, "Renews sent: {seen:?}");
    let after = requests_after(&seen, "drain");
    assert!(
        after >= 50,
        "token requests after the refusal: {after} of {seen:?}"
    );
}
