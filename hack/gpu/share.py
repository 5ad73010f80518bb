"""Shares measured as GPU time (the shares table of docs/benchmarks.md), run by `hack/gpu-bench.sh --share`.

Starts gem-schd per scenario (bench.py's Bench) and runs share_tenant.py tenants with
libgemhook preloaded. A burst tenant's GPU busy time comes from CUDA events around each of its
kernels (share_tenant.py says how token waits are kept out of them); throughput is reported
beside it. Prints one JSON table; raw tenant results go to OUT/share-raw.json.

    python3 hack/gpu/share.py ARTIFACT_DIR OUT [scenario[@OTHER_ARTIFACT_DIR] ...]

`scenario@DIR` runs that scenario with DIR's hook and gem-schd instead, against the same native
baselines (measured once per invocation), so that two builds alternate in one run;
`scenario+log` runs it with gem-schd's and the hook's debug logs (every grant) in OUT/log-N-scenario.log;
`scenario+fill` with gem-schd's debug log there, and adds each client's fill (how much of its holds
its kernels kept the GPU busy, from the hook's Busy reports) to its result.
Every run also reports the GPU's SM clock, power and utilisation over its timed part; with
SHARE_PIN=1 each tenant is pinned to a core of its own.
"""

import calendar
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import log  # noqa: E402
from share_bench import (ANSI, GIB, ShareBench, burst, charged, fills, for_label, pct,  # noqa: E402
                         sliding_max, stall, total_busy, union, variant, windows)

ALL = ["alone", "three", "train_infer", "train_infer_nopace", "reload", "multiproc", "kill"]


def alone(b, raw):
    out = {}
    logf = os.path.join(b.out, "bench.log")
    for ms in (5, 16, 50):
        nat = b.run([("native", burst(ms), None)], 6)["native"]
        raw[f"native_{ms}"] = nat
        for lim in (0.3, 0.5):
            b.logs.flush()
            since = os.path.getsize(logf)
            b.schd_debug = True
            try:
                with b.schd([("a", lim, lim, 8 * GIB)]):
                    r = b.run([("a", burst(ms), "a")], 12)["a"]
            finally:
                b.schd_debug = False
            raw[f"alone_{lim}_{ms}"] = r
            w = windows(r["busy"], 2, 12, 1.0)
            sm = sliding_max(r["busy"], 2, 12)
            out[f"limit {lim}, {ms} ms bursts"] = {
                "busy_per_1s_max": max(w), "busy_per_1s_min": min(w), "busy_mean": round(sum(w) / len(w), 4),
                "busy_any_1s_max": sm, "over_limit_pp_max": round(100 * (sm - lim), 2),
                # gem-schd's charged time over the 10 s before its last grant (~[2.5, 12.5] s)
                "charged_last_10s": charged(logf, since, "a"),
                "throughput_of_native": round(r["rate"] / nat["rate"], 4),
                "kernel_ms": round(r["kernel_ms"], 3), "per_burst": r["per_burst"]}
    return out


def three(b, raw):
    cl = [("a", 0.2, 0.2, 8 * GIB), ("b", 0.3, 0.3, 8 * GIB), ("c", 0.5, 0.5, 8 * GIB)]
    with b.schd(cl):
        r = b.run([(c[0], burst(16), c[0]) for c in cl], 15)
    raw["three"] = r
    return {c[0]: {"target": c[1], "busy": round(total_busy(r[c[0]]["busy"], 3, 15), 4),
                   "busy_any_1s_max": sliding_max(r[c[0]]["busy"], 3, 15),
                   "busy_per_1s": windows(r[c[0]]["busy"], 3, 15, 1.0),
                   "throughput_kernels_per_s": round(r[c[0]]["rate"], 1)} for c in cl}


NATIVE = {}


def train_infer_with(extra, hook_env=None, debug=False):
    # A lambda: train_infer is defined further down.
    return variant(lambda b, raw: train_infer(b, raw), extra, hook_env, debug)


# train_infer with gem-schd's pacing off: is pacing what stalls the tenants?
train_infer_nopace = train_infer_with(["--pace-ms", "0"])
# train_infer without the hold cap under contention (`--max-hold-ms 0`): the control.
train_infer_nohold = train_infer_with(["--max-hold-ms", "0"])
# train_infer with a 1 ms min quota: the holder's turn (and what it queues) shorter.
train_infer_minq1 = train_infer_with(["--min-quota-ms", "1"])
# ... 10 and 20 ms: fewer turns, so fewer first requests after the other context's turn (each
# ~1 ms slower natively) and fewer hand-overs for training, against a longer wait for a request.
train_infer_minq10 = train_infer_with(["--min-quota-ms", "10"])
train_infer_minq20 = train_infer_with(["--min-quota-ms", "20"])
# train_infer with a 10 ms starvation bound (`--max-wait-ms 10`, default 50).
train_infer_wait10 = train_infer_with(["--max-wait-ms", "10"])
# train_infer with a 5 ms starvation bound.
train_infer_wait5 = train_infer_with(["--max-wait-ms", "5"])
# train_infer ranked by usage over the window (`--max-lag-ms 0`): the control.
train_infer_lag0 = train_infer_with(["--max-lag-ms", "0"])
# train_infer with the hold cap under contention at 10 ms (`--max-hold-ms 10`).
train_infer_hold10 = train_infer_with(["--max-hold-ms", "10"])
# train_infer with capped clients paced even while the waiting clients' requests add up to
# the whole GPU (`--unpaced-when-full false`): the control.
train_infer_pacefull = train_infer_with(["--unpaced-when-full", "false"])
# Plain turns, the control for drain-aware turns and the precise deadline (a capped client's
# grant under full contention is the min quota; the hook's deadline on the coarse clock alone).
PLAIN_TURNS = (["--turn-includes-drain", "false"], {"KUBESHARE_HOOK_PRECISE_DEADLINE": "0", "KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
train_infer_plainturns = train_infer_with(*PLAIN_TURNS)
train_infer_plainturns_debug = train_infer_with(*PLAIN_TURNS, debug=True)
# Each part on its own: the precise deadline only, the drain-aware turns only.
train_infer_clock = train_infer_with(["--turn-includes-drain", "false"], {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
train_infer_drain = train_infer_with([], {"KUBESHARE_HOOK_PRECISE_DEADLINE": "0", "KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
# The hook's queue-ahead bound (KUBESHARE_HOOK_MAX_AHEAD_US, default 200; off: noahead).
train_infer_noahead = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
train_infer_ahead200 = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "200"})
train_infer_ahead500 = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "500"})
train_infer_ahead400 = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "400"})
train_infer_ahead200_debug = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "200"}, debug=True)
# Shorter turns: gem-schd's min quota at 3 and 2 ms (default 5).
train_infer_minq3 = train_infer_with(["--min-quota-ms", "3"])
train_infer_minq2 = train_infer_with(["--min-quota-ms", "2"])
# Shorter bounds (probes twice per bound below 200 µs).
train_infer_ahead50 = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "50"})
train_infer_ahead100 = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "100"})
train_infer_ahead50_debug = train_infer_with([], {"KUBESHARE_HOOK_MAX_AHEAD_US": "50"}, debug=True)


# train_infer with every grant logged (gem-schd and hook) into bench.log.
train_infer_debug = train_infer_with([], debug=True)
# train_infer with gem-schd's grant log only.
train_infer_schdlog = variant(lambda b, raw: train_infer(b, raw), [], schd_debug=True)
# Co-running: a client whose kernels fill less than 0.6 of its holds launches beside
# the holder; the holder's limit is raised by the pace it loses (docs/gem-schd.md).
CORUN = ["--co-run-below", "0.6"]
train_infer_corun = variant(lambda b, raw: train_infer(b, raw), CORUN)
# The same with one launch in 64 timed instead of 32 (half the sampling's cost, noisier fills).
train_infer_corun64 = variant(lambda b, raw: train_infer(b, raw), CORUN,
                              {"KUBESHARE_HOOK_BUSY_EVERY": "64"})
train_infer_corun128 = variant(lambda b, raw: train_infer(b, raw), CORUN,
                               {"KUBESHARE_HOOK_BUSY_EVERY": "128"})
train_infer_corun256 = variant(lambda b, raw: train_infer(b, raw), CORUN,
                               {"KUBESHARE_HOOK_BUSY_EVERY": "256"})


def natives(b):
    """The native (unhooked, alone) training and inference runs, once per invocation, with the
    clocks they ran at. Inference is measured SHARE_NATIVE_RUNS times (default 3) and the run
    with the median rate is its baseline, every rate kept beside it: a launch-bound tenant's
    native rate moved 346–594 requests/s between 8 s runs on one H100 host, where
    training's held to ±2 %."""
    if "train" not in NATIVE:
        NATIVE["train"] = b.run([("train", ["--mode", "train50"], None)], 8)["train"]
        NATIVE["train"]["clocks"] = b.last_clocks
    return NATIVE["train"], native_median(b, "infer", ["--mode", "infer18"])


def native_median(b, key, mode):
    """The native inference run (tenant arguments `mode`) with the median rate of
    SHARE_NATIVE_RUNS (default 3), measured once per invocation and kept as NATIVE[key], every
    rate and its clocks beside it."""
    if key not in NATIVE:
        runs = []
        for _ in range(max(1, int(os.environ.get("SHARE_NATIVE_RUNS", "3")))):
            r = b.run([("infer", mode, None)], 8)["infer"]
            r["clocks"] = b.last_clocks
            runs.append(r)
        runs.sort(key=lambda r: r["rate"])
        NATIVE[key] = runs[len(runs) // 2]
        NATIVE[key]["native_rates"] = [round(r["rate"], 1) for r in runs]
    return NATIVE[key]


def native_infer(b, raw):
    """Native inference measured again: how far the first native baseline drifts in one call."""
    _, nati = natives(b)
    r = b.run([("infer", ["--mode", "infer18"], None)], 8)["infer"]
    raw.update(infer=r, clocks=b.last_clocks)
    return {"infer": infer_stats(r, nati), "clocks": b.last_clocks}


def native_duty(on_ms, off_ms, idle, guard_ms=0, hooked=False):
    """Batch-1 inference in on-windows of `on_ms` separated by `off_ms` in which it sends
    nothing (`idle`: sleep, spin or fill, share_tenant.py says what each does; other: another
    native process fills them with matmuls, so that two contexts take turns on the wall clock;
    tick: another process launches a tiny kernel every 0.5 ms throughout, so the GPU never
    idles longer): the pattern of exclusive turns without a scheduler. With `guard_ms` no
    request starts that close to its window's end (so none runs into the other process's
    matmuls). Native unless `hooked`: then the inference tenant runs under the hook as
    gem-schd's only client, uncapped (1.0, 1.0), so the hook's launch path is in place but the
    token is never waited for (the filler stays native). Requests run slower inside short
    turns under the hook; if they do here too, the turns' pattern is the cause. Reported: each request's CPU latency and GPU span, for the ones that open a
    window and the rest, against the continuous native run."""
    def run(b, raw):
        _, nati = natives(b)
        duty = ["--duty-on-ms", str(on_ms), "--duty-off-ms", str(off_ms)]
        own = "sleep" if idle in ("other", "tick") else idle
        tenants = [("infer", ["--mode", "infer18", "--duty-idle", own,
                              "--duty-guard-ms", str(guard_ms)] + duty, None)]
        if idle == "other":  # another process fills the off-windows
            tenants.append(("a", ["--mode", "fill"] + duty, None))
        if idle == "tick":
            tenants.append(("a", ["--mode", "tick", "--tick-us", "500"], None))
        if hooked:
            tenants[0] = tenants[0][:2] + ("i",)
        with b.schd([("i", 1.0, 1.0, 8 * GIB)]) if hooked else contextlib.nullcontext():
            r = b.run(tenants, 8)["infer"]
        raw.update(infer=r, clocks=b.last_clocks)
        firsts = [i for i, f in enumerate(r["first"]) if f]
        rest = [i for i, f in enumerate(r["first"]) if not f]
        def p50(xs, idx):
            return pct([xs[i] for i in idx], .5) if idx else None
        return {"requests": len(r["lat_ms"]), "window_firsts": len(firsts),
                "first": {"ms_p50": p50(r["lat_ms"], firsts), "gpu_ms_p50": p50(r["gpu_ms"], firsts)},
                "rest": {"ms_p50": p50(r["lat_ms"], rest), "gpu_ms_p50": p50(r["gpu_ms"], rest)},
                "native": {"ms_p50": pct(nati["lat_ms"], .5), "gpu_ms_p50": pct(nati["gpu_ms"], .5),
                           "rates": nati.get("native_rates"), "clocks": nati.get("clocks")},
                "clocks": b.last_clocks}
    return run


infer_duty5_sleep = native_duty(5, 5, "sleep")
infer_duty5_spin = native_duty(5, 5, "spin")
infer_duty5_fill = native_duty(5, 5, "fill")
infer_duty500_sleep = native_duty(500, 500, "sleep")  # the control: half-second windows
infer_duty1_sleep = native_duty(5, 1, "sleep")  # a 1 ms gap
infer_duty5_other = native_duty(5, 5, "other")
infer_duty500_fill = native_duty(500, 500, "fill")
infer_duty500_other = native_duty(500, 500, "other")
infer_duty5_other_g = native_duty(5, 5, "other", 2.5)
infer_duty5_sleep_g = native_duty(5, 5, "sleep", 2.5)
infer_duty5_tick = native_duty(5, 5, "tick")
infer_duty5_other_g_hooked = native_duty(5, 5, "other", 2.5, hooked=True)
infer_duty5_sleep_hooked = native_duty(5, 5, "sleep", hooked=True)
infer_duty20_other_g = native_duty(20, 20, "other", 2.5)  # the windows of a 20 ms min quota
infer_duty20_other_g_hooked = native_duty(20, 20, "other", 2.5, hooked=True)
infer_duty500_tick = native_duty(500, 500, "tick")


def infer_stats(r, nati):
    """Inference beside others against its native run: rate, latency, and the requests that ran
    whole inside a turn (latency under twice the native median): how long those took on the
    CPU's clock and on the GPU's (their events' span), against native."""
    li, ln = r["lat_ms"], nati["lat_ms"]
    whole = [i for i, x in enumerate(li) if x < 2 * pct(ln, .5)]
    out = {"of_native": round(r["rate"] / nati["rate"], 4),
           "ms": {"p50": pct(li, .5), "p99": pct(li, .99), "max": max(li)},
           "native_ms": {"p50": pct(ln, .5), "p99": pct(ln, .99), "max": max(ln)},
           "whole_requests": round(len(whole) / len(li), 4),
           "native_rates": nati.get("native_rates")}
    if whole and "gpu_ms" in r and "gpu_ms" in nati:
        out["whole_ms_p50"] = pct([li[i] for i in whole], .5)
        out["whole_gpu_ms_p50"] = pct([r["gpu_ms"][i] for i in whole], .5)
        out["native_gpu_ms_p50"] = pct(nati["gpu_ms"], .5)
    return out


def train_infer(b, raw):
    nat, nati = natives(b)
    with b.schd([("t", 0.5, 0.5, 40 * GIB), ("i", 0.5, 0.5, 8 * GIB)]):
        r = b.run([("train", ["--mode", "train50"], "t"), ("infer", ["--mode", "infer18"], "i")], 20)
    raw.update(train_native=nat, infer_native=nati, train_infer=r, clocks=b.last_clocks)
    li, ln = r["infer"]["lat_ms"], nati["lat_ms"]
    return {"train_of_native": round(r["train"]["rate"] / nat["rate"], 4),
            "infer_of_native": round(r["infer"]["rate"] / nati["rate"], 4),
            "infer_ms": {"p50": pct(li, .5), "p99": pct(li, .99), "max": max(li)},
            "infer_native_ms": {"p50": pct(ln, .5), "p99": pct(ln, .99), "max": max(ln)},
            "train_longest_stall_s": stall(r["train"]["series"]),
            "train_native_step_s": round(1 / nat["rate"], 4),
            "infer": infer_stats(r["infer"], nati),
            "clocks": b.last_clocks, "native_clocks": {"train": nat["clocks"], "infer": nati["clocks"]}}


def burst_infer(b, raw):
    """train_infer with 5 ms matmul bursts (bf16 4096^3, 32 MiB a matrix) in training's place:
    is inference slower inside its turns beside any neighbour, or beside ResNet-50 training's
    footprint (tens of GiB of activations and many kernels) only?"""
    _, nati = natives(b)
    with b.schd([("t", 0.5, 0.5, 40 * GIB), ("i", 0.5, 0.5, 8 * GIB)]):
        r = b.run([("a", ["--mode", "burst", "--burst-ms", "5"], "t"),
                   ("infer", ["--mode", "infer18"], "i")], 20)
    raw.update(burst_infer=r, clocks=b.last_clocks)
    return {"infer": infer_stats(r["infer"], nati), "clocks": b.last_clocks}


# ... with 20 ms turns: in them whole requests beside training ran ~0.35 ms slower than the
# native windows explain; beside a matmul neighbour too, or only beside training?
burst_infer_minq20 = variant(burst_infer, ["--min-quota-ms", "20"])


def train_infer_unhooked(b, raw):
    """The pair with no hook and no gem-schd: the GPU's own time-slicing between two contexts."""
    nat, nati = natives(b)
    r = b.run([("train", ["--mode", "train50"], None), ("infer", ["--mode", "infer18"], None)], 20)
    raw.update(train_infer=r, clocks=b.last_clocks)
    return {"train_of_native": round(r["train"]["rate"] / nat["rate"], 4),
            "infer": infer_stats(r["infer"], nati), "clocks": b.last_clocks}


def train_capped_infer_free(b, raw, limit=0.5):
    """Co-running, measured before built: training under the hook capped at `limit` as
    gem-schd's only client (so it runs in turns), inference beside it with no hook, launching
    whenever it likes, in training's turns too (the GPU time-slices the two contexts itself).
    What a policy that lets a light tenant co-run while the heavy one keeps its turns would
    deliver, and what NVML says each used (SHARE_NVML=1)."""
    nat, nati = natives(b)
    with b.schd([("t", limit, limit, 40 * GIB)]):
        r = b.run([("train", ["--mode", "train50"], "t"), ("infer", ["--mode", "infer18"], None)], 20)
    raw.update(train_infer=r, clocks=b.last_clocks)
    return {"train_of_native": round(r["train"]["rate"] / nat["rate"], 4),
            "infer": infer_stats(r["infer"], nati), "clocks": b.last_clocks}


def burst_infer_free(b, raw, limit=None):
    """Co-running beside a compute-bound tenant: 5 ms bursts of bf16 matmuls (one kernel
    ~0.2 ms) under the hook capped at `limit` in turns (None: no hook either), inference free
    beside it. Also whether a kernel's event span takes in the other context's time slices:
    the matmul's per-kernel span beside co-running inference against its native span (if the
    GPU preempts kernels mid-way for the other context, a tenant's events overstate its own
    GPU time, and a co-runner's would too)."""
    nat = b.run([("a", burst(5), None)], 8)["a"]
    _, nati = natives(b)
    tenants = [("a", burst(5), "a" if limit else None), ("infer", ["--mode", "infer18"], None)]
    with b.schd([("a", limit, limit, 8 * GIB)]) if limit else contextlib.nullcontext():
        r = b.run(tenants, 20)
    raw.update(burst_native=nat, burst_infer=r, clocks=b.last_clocks)

    def spans_ms(x):
        return [1000 * (e - s) for s, e in x["busy"]]
    busy = sum(spans_ms(r["a"])) / 1000
    return {"burst_of_native": round(r["a"]["rate"] / nat["rate"], 4),
            "burst_busy_per_s": round(busy / 20, 4),
            "kernel_span_ms": {"p50": pct(spans_ms(r["a"]), .5), "p90": pct(spans_ms(r["a"]), .9)},
            "native_kernel_span_ms": {"p50": pct(spans_ms(nat), .5), "p90": pct(spans_ms(nat), .9)},
            "infer": infer_stats(r["infer"], nati), "clocks": b.last_clocks}


def burst_capped_infer_free(b, raw):
    return burst_infer_free(b, raw, 0.5)


def infer_pair(b, raw, hooked=False):
    """Two light tenants together (batch-1 inference twice): with no hook (co-running), or both
    hooked at 0.5 / 0.5 (exclusive turns). Whether two launch-bound tenants can co-run at all
    without a holder in turns, and what turns cost them."""
    _, nati = natives(b)
    tenants = [("infer", ["--mode", "infer18"], "i" if hooked else None),
               ("b", ["--mode", "infer18"], "j" if hooked else None)]
    with b.schd([("i", 0.5, 0.5, 8 * GIB), ("j", 0.5, 0.5, 8 * GIB)]) if hooked \
            else contextlib.nullcontext():
        r = b.run(tenants, 20)
    raw.update(infer_pair=r, clocks=b.last_clocks)
    return {"infer": infer_stats(r["infer"], nati), "infer_b": infer_stats(r["b"], nati),
            "clocks": b.last_clocks}


def infer_pair_hooked(b, raw):
    return infer_pair(b, raw, True)


# train_capped_infer_free with training's turns longer, to give back what the co-running
# tenant takes in them (on an H100: training 0.469-0.496 of native at 0.7, 0.507-0.548 at 0.75;
# the share that evens the pair differs by host).
def train_capped_infer_free_60(b, raw):
    return train_capped_infer_free(b, raw, 0.6)


def train_capped_infer_free_65(b, raw):
    return train_capped_infer_free(b, raw, 0.65)


def train_capped_infer_free_70(b, raw):
    return train_capped_infer_free(b, raw, 0.7)


def train_capped_infer_free_75(b, raw):
    return train_capped_infer_free(b, raw, 0.75)


infer_pair_corun = variant(infer_pair_hooked, CORUN)
three_corun = variant(lambda b, raw: three(b, raw), CORUN)


def infer_capped(b, raw):
    """Batch-1 inference alone under the hook at 0.5 (paced, no neighbour): what the token's
    turns cost it without another context on the GPU or the clocks a neighbour brings."""
    _, nati = natives(b)
    with b.schd([("i", 0.5, 0.5, 8 * GIB)]):
        r = b.run([("infer", ["--mode", "infer18"], "i")], 20)["infer"]
    raw.update(infer=r, clocks=b.last_clocks)
    return {"infer": infer_stats(r, nati), "clocks": b.last_clocks}


infer_capped_schdlog = variant(infer_capped, [], schd_debug=True)
# Alone at 0.5 with co-running on: it co-runs (nobody holds the token), charged its fill.
infer_capped_corun = variant(infer_capped, CORUN)


def train_alone(b, raw, limit):
    """ResNet-50 training alone under the hook at request = limit = `limit` (no neighbour)."""
    nat, _ = natives(b)
    with b.schd([("t", limit, limit, 40 * GIB)]):
        r = b.run([("train", ["--mode", "train50"], "t")], 20)["train"]
    raw.update(train=r, clocks=b.last_clocks)
    return {"train_of_native": round(r["rate"] / nat["rate"], 4),
            "train_of_limit": round(r["rate"] / nat["rate"] / limit, 4),
            "train_longest_stall_s": stall(r["series"]), "clocks": b.last_clocks}


def train_capped(b, raw):
    """ResNet-50 training alone under the hook at 0.5 (paced, no neighbour)."""
    return train_alone(b, raw, 0.5)


def train_capped_70(b, raw):
    """ResNet-50 training alone under the hook at 0.7: its turns as in train_capped_infer_free_70,
    with nothing beside it (how much of its holds it fills alone)."""
    return train_alone(b, raw, 0.7)


def train_uncapped(b, raw):
    """ResNet-50 training alone under the hook at 1.0: what the hook and its hand-overs cost a
    GPU-bound tenant with nothing paced, against its native rate."""
    return train_alone(b, raw, 1.0)


# Where a capped training tenant's time goes: the queue-ahead bound off, the short
# pacing window off, pacing off (the limit over gem-schd's 10 s window only), every grant logged.
train_capped_noahead = variant(train_capped, [], {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
train_capped_short0 = variant(train_capped, ["--pace-short-ms", "0"])
train_capped_pace0 = variant(train_capped, ["--pace-ms", "0"])
train_capped_schdlog = variant(train_capped, [], schd_debug=True)
train_uncapped_noahead = variant(train_uncapped, [], {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
train_uncapped_schdlog = variant(train_uncapped, [], schd_debug=True)
# A deeper queue early in a hold (KUBESHARE_HOOK_EARLY_AHEAD_US, default 600 µs, at most
# 50,000): how much of a GPU-bound tenant's loss alone is the queue the bound keeps it to?
train_uncapped_early5000 = variant(train_uncapped, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "5000"})
train_uncapped_early50000 = variant(train_uncapped, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "50000"})
train_capped_early5000 = variant(train_capped, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "5000"})
train_capped_early50000 = variant(train_capped, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "50000"})
# The sole allowance off (KUBESHARE_HOOK_SOLE_AHEAD_US=0): a process whose holds are renewed
# is held to the bound and the early allowance as without the early allowance; the control.
SOLE0 = {"KUBESHARE_HOOK_SOLE_AHEAD_US": "0"}
train_uncapped_sole0 = variant(train_uncapped, [], SOLE0)
train_capped_sole0 = variant(train_capped, [], SOLE0)
# gem-schd's min quota at 50 ms: a paced client alone holds longer, with fewer hand-overs.
train_capped_minq50 = variant(train_capped, ["--min-quota-ms", "50"])
# Renewal off (`KUBESHARE_HOOK_RENEW=0`): every quota's end drains and asks again, the rule
# without renewals; the control for the renewed holds of a tenant alone.
RENEW0 = {"KUBESHARE_HOOK_RENEW": "0"}
train_capped_renew0 = variant(train_capped, [], RENEW0)
train_uncapped_renew0 = variant(train_uncapped, [], RENEW0)
infer_capped_renew0 = variant(infer_capped, [], RENEW0)
train_infer_renew0 = train_infer_with([], RENEW0)
alone_renew0 = variant(alone, [], RENEW0)
infer_capped_sole0 = variant(infer_capped, [], SOLE0)
train_infer_sole0 = train_infer_with([], SOLE0)
alone_sole0 = variant(alone, [], SOLE0)


def reload(b, raw):
    with b.schd([("a", 0.3, 0.3, 8 * GIB), ("b", 0.7, 0.7, 8 * GIB)]):
        swap = lambda: b.write_config([("a", 0.7, 0.7, 8 * GIB), ("b", 0.3, 0.3, 8 * GIB)])  # noqa: E731
        r = b.run([("a", burst(16), "a"), ("b", burst(16), "b")], 20, at=[(8.0, swap)])
    raw["reload"] = r
    wa = windows(r["a"]["busy"], 0, 20, 0.1)
    wb = windows(r["b"]["busy"], 0, 20, 0.1)
    # Longest run of 100 ms bins at zero after the reload, per tenant.
    def zero_run(w):
        best = cur = 0
        for x in w[80:]:
            cur = cur + 1 if x < 0.01 else 0
            best = max(best, cur)
        return best * 100
    # First second-long window (sliding by 100 ms) after the reload where a's part of the GPU
    # time the two got is within 3 pp of 0.7 (absolute busy time is below the shares by the
    # tenants' own CPU time inside their holds).
    settle = None
    for i in range(80, len(wa) - 10):
        sa, sb = sum(wa[i:i + 10]), sum(wb[i:i + 10])
        if sa + sb > 0 and abs(sa / (sa + sb) - 0.7) <= 0.03:
            settle = round((i - 80) / 10, 1)
            break
    return {"before_a_b": [round(sum(wa[30:80]) / 50, 4), round(sum(wb[30:80]) / 50, 4)],
            "first_1s_after_a_b": [round(sum(wa[80:90]) / 10, 4), round(sum(wb[80:90]) / 10, 4)],
            "after_a_b_last_8s": [round(sum(wa[120:200]) / 80, 4), round(sum(wb[120:200]) / 80, 4)],
            "new_split_within_3pp_after_s": settle,
            "longest_zero_after_reload_ms": {"a": zero_run(wa), "b": zero_run(wb)}}


def multiproc(b, raw):
    with b.schd([("a", 0.4, 0.4, 16 * GIB), ("b", 0.6, 0.6, 16 * GIB)]):
        r = b.run([("a1", burst(16), "a"), ("a2", burst(16), "a"), ("b", burst(16), "b")], 15)
    raw["multiproc"] = r
    a = round(total_busy(union(r["a1"]["busy"], r["a2"]["busy"]), 3, 15), 4)
    b_ = round(total_busy(r["b"]["busy"], 3, 15), 4)
    return {"a_union": a, "b": b_, "a_of_delivered": round(a / (a + b_), 4),
            "a_throughput_kernels_per_s": round(r["a1"]["rate"] + r["a2"]["rate"], 1),
            "b_throughput_kernels_per_s": round(r["b"]["rate"], 1)}


# multiproc without the queue-ahead bound, and with a longer one: does the bound's measured pace
# (which a second process's context on the GPU slows) cost the two-process client its share?
multiproc_noahead = variant(multiproc, [], {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
multiproc_ahead800 = variant(multiproc, [], {"KUBESHARE_HOOK_MAX_AHEAD_US": "800"})
# How much more than the bound may be queued early in a hold (KUBESHARE_HOOK_EARLY_AHEAD_US,
# default 600; 0: the bound all hold long).
multiproc_early0 = variant(multiproc, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "0"})
multiproc_early5000 = variant(multiproc, [], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "5000"})
# The queue-ahead bound off for the inference tenant only (KUBESHARE_HOOK_MAX_AHEAD_US=0):
# does the ring's probing slow a launch-bound tenant's requests inside its turns?
train_infer_inoahead = for_label(train_infer, "infer", {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
infer_capped_noahead = for_label(infer_capped, "infer", {"KUBESHARE_HOOK_MAX_AHEAD_US": "0"})
# The short pacing window off (gem-schd --pace-short-ms 0): the pacing window alone.
infer_capped_short0 = variant(infer_capped, ["--pace-short-ms", "0"])
train_infer_early0 = train_infer_with([], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "0"})
train_infer_early5000 = train_infer_with([], {"KUBESHARE_HOOK_EARLY_AHEAD_US": "5000"})


def train_infer_batch(batch):
    """train_infer with ResNet-18 inference at `batch` images a request: a tenant whose fill lies
    between batch-1 inference's (~0.3) and training's (~0.8), near co-running's threshold (0.6),
    so that it may move between co-holds and turns. Its native rate is
    measured once per invocation (median of SHARE_NATIVE_RUNS)."""
    def run(b, raw):
        nat, _ = natives(b)
        mode = ["--mode", "infer18", "--batch", str(batch)]
        nati = native_median(b, f"infer_b{batch}", mode)
        with b.schd([("t", 0.5, 0.5, 40 * GIB), ("i", 0.5, 0.5, 8 * GIB)]):
            r = b.run([("train", ["--mode", "train50"], "t"), ("infer", mode, "i")], 20)
        raw.update(train_infer=r, clocks=b.last_clocks)
        return {"train_of_native": round(r["train"]["rate"] / nat["rate"], 4),
                "infer": infer_stats(r["infer"], nati), "batch": batch,
                "train_longest_stall_s": stall(r["train"]["series"]), "clocks": b.last_clocks}
    return run


train_infer_b8 = train_infer_batch(8)
train_infer_b8_corun = variant(train_infer_batch(8), CORUN)
train_infer_b16 = train_infer_batch(16)
train_infer_b16_corun = variant(train_infer_batch(16), CORUN)


# The table's other rows with co-running on: matmul tenants fill their holds (above 0.6), so
# they should keep to turns and their shares.
alone_corun = variant(alone, CORUN)


def train_pair(b, raw):
    """Two ResNet-50 training tenants at 0.3 and 0.7: both GPU-bound, with kernels of very
    different lengths (a sample of them times a long convolution or a short elementwise one),
    so a fill misread as light would let them co-run and the GPU's time slicing, not their
    limits, split it."""
    nat, _ = natives(b)
    with b.schd([("t", 0.3, 0.3, 30 * GIB), ("u", 0.7, 0.7, 30 * GIB)]):
        r = b.run([("train", ["--mode", "train50"], "t"), ("train2", ["--mode", "train50"], "u")], 20)
    raw.update(train_pair=r, clocks=b.last_clocks)
    return {"t_of_native": round(r["train"]["rate"] / nat["rate"], 4), "t_target": 0.3,
            "u_of_native": round(r["train2"]["rate"] / nat["rate"], 4), "u_target": 0.7,
            "longest_stall_s": [stall(r["train"]["series"]), stall(r["train2"]["series"])],
            "clocks": b.last_clocks}


train_pair_corun = variant(train_pair, CORUN)
# The same with 20 ms turns (gem-schd's min quota, default 5 ms): how much of the trainers' loss
# against their limits is hand-overs.
train_pair_corun_minq20 = variant(train_pair, CORUN + ["--min-quota-ms", "20"])
reload_corun = variant(reload, CORUN)
multiproc_corun = variant(multiproc, CORUN)


def grants(logfile):
    out = []
    with open(logfile) as f:
        for line in f:
            line = ANSI.sub("", line)
            m = re.match(r"(\S+)Z\s+DEBUG .*grant client=(\S+)", line)
            if m:
                t = calendar.timegm(time.strptime(m.group(1)[:19], "%Y-%m-%dT%H:%M:%S"))
                out.append((t + float("0" + m.group(1)[19:]), m.group(2)))
    return out


def launch_bench(art, out):
    """The kill scenario's launch loop: ART/launch_bench, else compiled here with nvcc."""
    have = os.path.join(art, "launch_bench")
    if os.path.exists(have):
        return have
    built = os.path.join(out, "launch_bench")
    subprocess.run(["nvcc", "-O2", "-o", built, os.path.join(HERE, "launch_bench.cu")], check=True)
    return built


def kill(b, raw, loop_bin):
    """kill -9 of the holder: time from the kill to the next grant (to the other client)."""
    cfg = os.path.join(b.root, "rc-kill.txt")
    with open(cfg, "w") as f:
        f.write("2\na 0.5 1.0 1000000000\nb 0.5 1.0 1000000000\n")
    logf = os.path.join(b.root, "schd-kill.log")
    tmpl = os.path.join(b.root, "pods", "{client}", "{gpu}.sock")
    schd = subprocess.Popen([b.schd_bin, "--gpu", b.uuid, "--config", cfg, "--socket-template", tmpl],
                            stderr=open(logf, "w"), env=dict(os.environ, RUST_LOG="gem_schd=debug"))
    env = lambda c: dict(os.environ, LD_PRELOAD=b.hook, KUBESHARE_SOCKET_DIR=b.sock_dir(c))  # noqa: E731
    res = []
    try:
        time.sleep(0.5)
        other = subprocess.Popen([loop_bin, "2000000000"], env=env("b"), stdout=subprocess.DEVNULL)
        for _ in range(6):
            a = subprocess.Popen([loop_bin, "2000000000"], env=env("a"), stdout=subprocess.DEVNULL)
            time.sleep(1.5)
            for _ in range(400):
                g = grants(logf)
                if g and g[-1][1] == "a":
                    break
                time.sleep(0.003)
            t_kill = time.time()
            a.send_signal(signal.SIGKILL)
            a.wait()
            time.sleep(0.5)
            after = [t for t, c in grants(logf) if t > t_kill and c == "b"]
            holder_was_a = bool(g) and g[-1][1] == "a"
            res.append({"holder_was_a": holder_was_a,
                        "token_back_ms": round((after[0] - t_kill) * 1000, 2) if after else None})
        other.kill()
    finally:
        schd.kill()
    raw["kill"] = res
    ok = [r["token_back_ms"] for r in res if r["holder_was_a"] and r["token_back_ms"] is not None]
    return {"runs": res, "max_token_back_ms_when_a_held": max(ok) if ok else None}


def main():
    art, out = sys.argv[1], sys.argv[2]
    which = sys.argv[3:] or ALL
    os.makedirs(out, exist_ok=True)
    b = ShareBench(os.path.join(art, "libgemhook.so.1"), os.path.join(art, "gem-schd"), out)
    # Which GPU ran the call, for comparing runs across calls (hosts differ by ~10 %).
    table, raw = {}, {"_gpu": b.uuid}
    log("gpu", b.uuid)
    main_log = b.logs
    for n, label in enumerate(which):
        name, _, other = label.partition("@")
        name, _, flag = name.partition("+")
        b.debug, b.schd_debug = flag == "log", flag == "fill"
        # Each logged scenario's debug log goes to a file of its own: OUT/log-N-NAME.log.
        logfile = os.path.join(out, f"log-{n}-{name}.log")
        b.logs = open(logfile, "w") if flag else main_log
        art_n = other or art
        b.hook, b.schd_bin = os.path.join(art_n, "libgemhook.so.1"), os.path.join(art_n, "gem-schd")
        # A scenario run twice keeps both results: "train_infer", "train_infer#2", ...
        if label in table:
            label = f"{label}#{sum(1 for x in which[:n] if x == label) + 1}"
        t0 = time.time()
        try:
            if name == "kill":
                table[label] = kill(b, raw, launch_bench(art_n, out))
            else:
                part = {}
                table[label] = globals()[name](b, part)
                raw[label] = part
        except Exception as e:  # one failed scenario must not lose the others
            table[label] = {"error": repr(e)}
        if b.logs is not main_log:
            b.logs.close()
        if flag == "fill" and isinstance(table[label], dict):
            table[label]["fill"] = fills(logfile)
        log(label, f"{time.time() - t0:.0f} s", json.dumps(table[label]))
        with open(os.path.join(out, "share-raw.json"), "w") as f:
            json.dump(raw, f)
        with open(os.path.join(out, "share.json"), "w") as f:
            json.dump(table, f, indent=1)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
