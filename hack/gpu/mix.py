"""Shares for mixes of different workloads, read from the GPU's clock (docs/benchmarks.md,
"Mixes of workloads"). Run by `hack/gpu-bench.sh --mix` on a machine with a GPU.

    python3 hack/gpu/mix.py ARTIFACT_DIR OUT [scenario ...]
    python3 hack/gpu/mix.py --judge OUT1/mix.json OUT2/mix.json ...   # targets over a run in parts
    python3 hack/gpu/mix.py --brief OUT1/mix.json ...                  # a line per group of tenants

ARTIFACT_DIR holds libgemhook.so.1 and gem-schd. MIX_SCHD_ARGS adds gem-schd arguments to every
scenario (e.g. `--charge-by-fill`). MIX_MPS=1 runs every scenario (but `mps`) with its tenants
as clients of an MPS server started for it, the hook and gem-schd's tokens still gating their
launches: the kernels of the holder's drain and of the next holder's first launches, and of a
co-runner beside the holder, then run side by side instead of in the driver's time slices. Each
scenario starts gem-schd with a resource config, starts mix_tenant.py tenants together (with the
hook, each its own client) and reads each tenant's GPU time from CUPTI's kernel records
(mix_tenant.py), never from gem-schd. Beside it, gem-schd's own charge (its debug log, over its
10 s window at its last grant before the timed run's end) and the difference, flagged when
above 1 pp. Under co-running, and where a drain runs beside the next holder's kernels, two
contexts' kernel records overlap (each spans the other's time slices), so each tenant also gets
`gpu_alone`, `min_5s_alone` and `max_1s_alone`: its GPU time where no other tenant's record
overlaps it, the lower bound beside the plain figures' upper bound. Floors are judged on the
lower bound, limits on the upper. With MIX_GPUTRACE (gpu-bench.sh builds it from MIX_CUPTI,
CUPTI 13.2 or later), each tenant's records are cut to its own context's time slices instead
(slices.py; `reading` "slices", `fit` how the switch records' clock was matched): exact under
time-slicing, the bounds then agree and no two tenants' time overlaps. `holds` splits each
tenant's turns from its co-holds (gem-schd's log): their wall time, what gem-schd charges a
capped client, beside its GPU time in them and, read from slices, the time its context held
the engine in them. gem-schd's
fill of each tenant (`fill_judged`, from the hook's event pairs) goes beside its GPU time over
the time it was charged for (`gpu_per_charged`), flagged `fill_differs` when 0.05 apart;
SHARE_NVML=1 adds each tenant's share by NVML's per-process SM utilisation (`nvml_sm`). How far
each tenant's turns ran past their quotas (its drains, which a neighbour waits for) is
`drain_past_quota_ms` (p50, p90, max), from gem-schd's log, and its waits for the token
(`waits`: from each request that waits to its grant, p50 / p90 / p99 / max, how many past 10 ms
and how many waited as a co-runner repaying its lead). A tenant
whose first kernel came late into the timed run is flagged `late_start`; a syncing tenant
(decode) lists its five slowest steps, each with gem-schd's grants, releases and waits while it
ran (`slowest_steps`). `targets` judges the project's targets for mixes on the scenarios run
(`native`, `colocated` and `mps` give the bars they are judged against when run together).
Prints one JSON table; OUT/mix.json holds it, and OUT/mix-raw.json every tenant's intervals.
With MIX_READING=rates the tenants trace nothing: steps, latencies, gem-schd's charges and the
hook's engine time only, for the hook's own CUPTI buffers, which a tracer's would replace; no
targets are judged (`_reading`).

Scenarios:
  native          each workload alone, no hook: steps/s, GPU busy fraction, decode latency
  colocated       each pair with decode (MIX_PAIRS; gpt+decode by default) side by side, no
                  hook (the driver's time-slicing): decode's latency bar beside that neighbour
  capped_elastic  three pairs, a capped tenant (0.5/0.5) beside an elastic one (0.5/1.0)
  four            conv, matmul, elem, encoder at 0.1/0.2/0.3/0.4, request = limit
  capped_elastic_corun  the same pairs with gem-schd co-running light clients (--co-run-below
                  MIX_CORUN, default 0.6 as the chart runs it)
  four_corun      the same with gem-schd co-running light clients (--co-run-below MIX_CORUN)
  priority        a guaranteed tenant (0.5/0.5) beside two opportunistic ones (sharedgpu/priority
                  0: 0.3/1.0 and 0.2/1.0), all busy; then the same config with the guaranteed
                  tenant idle. Workloads from MIX_PRIORITY (default matmul,conv,attn: the
                  guaranteed one first)
  mps             gpt beside decode, no hook, as clients of an MPS server started for the run
                  (nvidia-cuda-mps-control): with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 50 each,
                  then without percentages: the overlap and latency bar that tokens are
                  compared with
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import log  # noqa: E402
from share_bench import (GIB, GRANT, ShareBench, charged, drains, fills, log_time,  # noqa: E402
                         nvml_share, pct, schd_log, sliding_max, union, windows)
from slices import intersect, own_time  # noqa: E402

SECONDS = 14
# Measured from here on: the tenants' first second holds gem-schd's quiet start and warm-up.
SKIP = 2.0
PAIRS = [("gpt", "decode"), ("conv", "elem"), ("long", "attn")]
# A tenant whose first kernel comes later than this into the timed run is flagged `late_start`
# (the slowest first kernel of a run started together, on an H200: 0.14 s, conv).
LATE_START_S = 0.5
FOUR = [("conv", 0.1), ("matmul", 0.2), ("elem", 0.3), ("encoder", 0.4)]
# MIX_READING=rates: the tenants trace nothing (mix_tenant.py), so every GPU-time figure reads 0.
RATES = "rates: steps and latencies only, no GPU time read"


class MixBench(ShareBench):
    def write_config(self, clients):
        """clients: [(id, request, limit, mem_bytes[, class])]: the class column where given."""
        path = os.path.join(self.root, "rc.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{len(clients)}\n")
            for c in clients:
                f.write(" ".join(str(x) for x in c) + "\n")
        os.rename(path + ".tmp", path)

    def spawn(self, args, client=None, env=None):
        """A mix_tenant.py process, with the hook and its client's socket directory when
        `client` is set (its log at KUBESHARE_HOOK_LOG, `info` by default, into bench.log)."""
        e = dict(os.environ, PYTHONUNBUFFERED="1")
        if client is not None:
            e.update(LD_PRELOAD=self.hook, KUBESHARE_SOCKET_DIR=self.sock_dir(client),
                     KUBESHARE_HOOK_LOG=os.environ.get("KUBESHARE_HOOK_LOG", "info"))
        e.update(getattr(self, "extra_env", None) or {})
        e.update(env or {})
        return subprocess.Popen([sys.executable, os.path.join(HERE, "mix_tenant.py")] + args,
                                env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self.logs, text=True)

    def tenants(self, specs, seconds=SECONDS):
        """specs: [(label, workload, client or None)] run together; results by label, each
        tenant's records cut to its own time slices where it recorded them (slices.py)."""
        res = self.run([(lbl, ["--work", work], client) for lbl, work, client in specs], seconds,
                       timeout=seconds + 180)
        own_time(res)
        return res


def busy_figures(r, t0, t1):
    """A tenant's GPU time over [t0, t1): the mean, the smallest over any 5 s window and the
    largest over any 1 s window (0.1 s grid)."""
    busy = r["busy"]
    fine = windows(busy, t0, t1, 0.1)

    def slide(width):
        k = int(round(width / 0.1))
        return [sum(fine[i:i + k]) / k for i in range(len(fine) - k + 1)] or [0.0]
    return {"gpu": round(sum(fine) / len(fine), 4), "min_5s": round(min(slide(5.0)), 4),
            "max_1s": round(sliding_max(busy, t0, t1), 4)}


def minus(a, b):
    """The parts of sorted, disjoint intervals `a` outside sorted, disjoint intervals `b`."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while s < e and k < len(b) and b[k][0] < e:
            if b[k][0] > s:
                out.append([s, b[k][0]])
            s = max(s, b[k][1])
            k += 1
        if s < e:
            out.append([s, e])
    return out


def alone_figures(res, lbl, others, t0, t1):
    """A tenant's GPU time counted only where no other tenant's kernel record overlaps it: a
    lower bound under co-running, where two contexts time-slice and each record spans the
    other's slices (the plain figures are the upper bound; in turns the two agree)."""
    mine = minus(res[lbl]["busy"], union(*[res[o]["busy"] for o in others]))
    return {"gpu_alone": windows(mine, t0, t1, t1 - t0)[0],
            "min_5s_alone": busy_figures({"busy": mine}, t0, t1)["min_5s"],
            "max_1s_alone": round(sliding_max(mine, t0, t1), 4)}


def lower_bound(t, key):
    """A tenant's figure `key` ("gpu", "min_5s") counted only where no other tenant's record
    overlaps it, when measured: a floor judged on it cannot be met by time two contexts' records
    both claim (a drain beside the next holder's kernels)."""
    return t.get(f"{key}_alone", t[key])


def kernel_walk(res, labels, t0, t1):
    """The tenants' kernel intervals over [t0, t1) in start order, clipped to it, each as
    (start, end, tenant, prev_end, prev_owner): where the union of the intervals before it
    ended, and whose interval reached furthest there (None, None before the first)."""
    spans = sorted((a, b, lbl) for lbl in labels for a, b in res[lbl]["busy"] if b > t0 and a < t1)
    end, owner = None, None
    for a, b, lbl in spans:
        a, b = max(a, t0), min(b, t1)
        yield a, b, lbl, end, owner
        if end is None or b > end:
            end, owner = b, lbl


def handovers(res, labels, t0, t1):
    """Where the GPU idled between the tenants' kernels over [t0, t1), from the GPU's clock:
    each gap in the union of their kernel intervals is a hand-over gap when the kernels on its
    two sides are different tenants', else the tenant's own (its CPU launching, its syncs).
    Also the time two tenants' kernel records overlap (contexts time-sliced, or MPS clients
    side by side), which the per-tenant figures count twice."""
    switch_gaps, overlap = [], 0.0
    # Per tenant: the gaps before its kernels, at a hand-over to it and between its own.
    to_it = {lbl: 0.0 for lbl in labels}
    own_by = {lbl: 0.0 for lbl in labels}
    for a, b, lbl, end, owner in kernel_walk(res, labels, t0, t1):
        if end is not None and a > end:
            if lbl != owner:
                switch_gaps.append(a - end)
                to_it[lbl] += a - end
            else:
                own_by[lbl] += a - end
        elif end is not None and lbl != owner:
            overlap += min(b, end) - a
    wall = t1 - t0
    switch_gaps.sort()
    return {"switches_per_s": round(len(switch_gaps) / wall, 1),
            "idle_at_switches": round(sum(switch_gaps) / wall, 4),
            "switch_gap_p50_ms": round(1e3 * pct(switch_gaps, 0.5), 3) if switch_gaps else None,
            "switch_gap_p90_ms": round(1e3 * pct(switch_gaps, 0.9), 3) if switch_gaps else None,
            "idle_own": round(sum(own_by.values()) / wall, 4), "overlap": round(overlap / wall, 4),
            "idle_at_switches_to": {k: round(v / wall, 4) for k, v in to_it.items()},
            "idle_own_of": {k: round(v / wall, 4) for k, v in own_by.items()}}


def token_events(logfile, since):
    """gem-schd's grants, releases, waits, renewals asked and drain notices logged after byte
    `since`, as (host time s, short text), in order."""
    out = []
    with open(logfile) as f:
        f.seek(since)
        for line in f:
            m = re.search(r"gem_schd::daemon: (grant|release|token request waits|renew|drain) "
                          r".*?client=(\S+)(?: quota_us=(\d+))?(?: used_us=(\d+))?"
                          r"(?: burst_us=(\d+))?.*?(co=\w+)?$", line.strip())
            if not m:
                continue
            what, client, quota, used, burst, co = m.groups()
            text = f"{'waits' if what.startswith('token') else what} {client}"
            if quota:
                text += f" quota {int(quota) / 1e3:g} ms {co or ''}".rstrip()
            if used:
                text += f" used {int(used) / 1e3:g} ms"
            if burst:
                text += f" after {int(burst) / 1e3:g} ms"
            out.append((log_time(line), text))
    return out


# A release's debug line: its client.
RELEASE = re.compile(r"release conn=\d+ client=(\S+)")
# A request that waits: its client, and whether it waits as a co-runner repaying its lead.
WAITS = re.compile(r"token request waits conn=\d+ client=(\S+) .*?(?:repaying=(true|false))?$")


def turn_waits(logfile, since, spans):
    """Per client of `spans` ({client: (t0, t1)}, the host clock), its waits for the token in
    gem-schd's debug log after byte `since`: from a request in [t0, t1) that waits (a process's
    first, if several of the client's wait) to the client's next grant: how many, p50 / p90 /
    p99 / max in ms, how many past 10 ms, and how many the request line marked `repaying` (a
    co-runner back in turns, bounded at two min quotas while it repays its lead). What a
    latency-bound tenant's slowest steps are made of, counted over all its waits rather than
    its five slowest."""
    pending, waits = {}, {}
    for line in schd_log(logfile, since):
        g = GRANT.search(line)
        if g:
            asked = pending.pop(g.group(1), None)
            if asked is not None:
                waits.setdefault(g.group(1), []).append((log_time(line) - asked[0], asked[1]))
            continue
        w = WAITS.search(line.strip())
        if w and w.group(1) in spans and w.group(1) not in pending:
            at = log_time(line)
            t0, t1 = spans[w.group(1)]
            if t0 <= at < t1:
                pending[w.group(1)] = (at, w.group(2) == "true")
    out = {}
    for client, v in waits.items():
        ms = sorted(1e3 * w for w, _ in v)
        out[client] = {"n": len(ms), "p50_ms": round(pct(ms, 0.5), 2),
                       "p90_ms": round(pct(ms, 0.9), 2), "p99_ms": round(pct(ms, 0.99), 2),
                       "max_ms": round(ms[-1], 2), "over_10ms": sum(1 for w in ms if w > 10),
                       "repaying": sum(1 for _, rep in v if rep)}
    return out


def holds(logfile, since):
    """Per client, its holds in gem-schd's debug log after byte `since`: [(grant, release,
    co-hold?)] on the host clock (s), a hold ending at the client's next release."""
    granted, out = {}, {}
    for line in schd_log(logfile, since):
        g = GRANT.search(line)
        if g:
            granted[g.group(1)] = (log_time(line), g.group(2) == "true")
            continue
        r = RELEASE.search(line)
        if r and r.group(1) in granted:
            at, co = granted.pop(r.group(1))
            out.setdefault(r.group(1), []).append((at, log_time(line), co))
    return out


def hold_figures(r, spans, t0, t1):
    """A tenant's turns and co-holds wholly within [t0, t1) (`spans`: [(grant, release, co)] in
    s from its start): how many, their wall time (what gem-schd charges a capped client), the
    time its context held the engine in them (read from slices) and its GPU time in them, s."""
    def total(intervals):
        return round(sum(b - a for a, b in intervals), 4)
    out = {}
    for kind, co in (("turns", False), ("co_holds", True)):
        within = [[a, b] for a, b, c in spans if c == co and a >= t0 and b <= t1]
        f = {"n": len(within), "wall_s": total(within),
             "gpu_s": total(intersect(r["busy"], within))}
        if "held" in r:
            f["held_s"] = total(intersect(r["held"], within))
        out[kind] = f
    return out


def turn_grants(logfile, since, labels, start_at):
    """gem-schd's grants to each tenant logged after byte `since`, as (s after start_at, quota
    s), in order; and, over every turn, how late its holder's notice (its Renew or Drain)
    reached gem-schd after the turn's quota ran out (s)."""
    grants = {lbl: [] for lbl in labels}
    notice_after = []
    quota_end = {}
    with open(logfile) as f:
        f.seek(since)
        for line in f:
            m = re.search(r"gem_schd::daemon: (grant|renew|drain) .*?client=(\S+)"
                          r"(?: quota_us=(\d+))?", line)
            if not m or m.group(2) not in grants:
                continue
            what, lbl, quota = m.groups()
            t = log_time(line) - start_at
            if what == "grant":
                q = int(quota or 0) / 1e6
                grants[lbl].append((t, q))
                quota_end[lbl] = t + q
            elif lbl in quota_end:
                notice_after.append(t - quota_end.pop(lbl))
    return grants, notice_after


def last_grant(grants, at, within=0.05):
    """The last of `grants` ((time, quota), in order) at or before `at` and at most `within`
    s before it, or None."""
    g = [x for x in grants if at - within <= x[0] <= at]
    return g[-1] if g else None


def own_idle_in_turns(res, labels, t0, t1, grants):
    """Where in its turns each tenant's own idle time lies (the gaps between its own kernels,
    `handovers`), by when the gap began against its last grant: in the turn's first ms (its
    process waking and launching again), later within the quota (its CPU's pauses, its own
    syncs), past the quota (its drain: a blocked launching thread, work queued late), or with
    no grant to it in the 50 ms before (a co-hold's, a renewal's or a reconnection's). Each a
    share of the wall time, so the four add up to `idle_own`."""
    parts = ("first_ms", "in_quota", "past_quota", "without_grant")
    out = {lbl: dict.fromkeys(parts, 0.0) for lbl in labels}
    for a, _, lbl, end, owner in kernel_walk(res, labels, t0, t1):
        if end is None or a <= end or lbl != owner:
            continue
        g = last_grant(grants[lbl], end)
        if g is None:
            part = "without_grant"
        elif end - g[0] < 0.001:
            part = "first_ms"
        elif end - g[0] < g[1]:
            part = "in_quota"
        else:
            part = "past_quota"
        out[lbl][part] += a - end
    wall = t1 - t0
    return {lbl: {k: round(v / wall, 4) for k, v in o.items()} for lbl, o in out.items()}


def handover_lags(res, labels, t0, t1, grants, notice_after):
    """What each hand-over gap (one tenant's last kernel, then another's first) waited for:
    gem-schd's grant to the next tenant (its last before that kernel, `turn_grants`) against
    the previous tenant's last kernel end (negative: granted while that one still drained) and
    against the next tenant's first kernel start (its wake-up and first launch), both on the
    host clock, p50 / p90 in ms; the latter split where the runtime call that launched that
    kernel returned (the tenant's `launched`): grant to return (the process's wake-up and
    launch call), return to the kernel's start (the GPU's part: its queue, a context switch).
    A gap with no grant to its tenant in the 50 ms before is counted apart (a co-hold's
    kernels, or a turn's later process). Also, over every turn, when its holder's notice
    reached gem-schd after the turn's quota ran out."""
    after_end, to_kernel, unmatched = [], [], 0
    to_return, return_to_kernel = [], []
    launched = {lbl: dict(map(tuple, res[lbl].get("launched", []))) for lbl in labels}
    for a, _, lbl, end, owner in kernel_walk(res, labels, t0, t1):
        if end is not None and a > end and lbl != owner:
            g = last_grant(grants[lbl], a)
            if g:
                after_end.append(g[0] - end)
                to_kernel.append(a - g[0])
                r = launched[lbl].get(a)
                if r is not None and g[0] <= r <= a:
                    to_return.append(r - g[0])
                    return_to_kernel.append(a - r)
            else:
                unmatched += 1

    def p(xs, q):
        return round(1e3 * pct(sorted(xs), q), 3) if xs else None
    return {"gaps": len(after_end) + unmatched, "without_grant": unmatched,
            "grant_after_last_end_ms": [p(after_end, 0.5), p(after_end, 0.9)],
            "grant_to_first_kernel_ms": [p(to_kernel, 0.5), p(to_kernel, 0.9)],
            "split": len(to_return),
            "grant_to_launch_return_ms": [p(to_return, 0.5), p(to_return, 0.9)],
            "launch_return_to_kernel_ms": [p(return_to_kernel, 0.5), p(return_to_kernel, 0.9)],
            "notice_after_quota_end_ms": [p(notice_after, 0.5), p(notice_after, 0.9)]}


def slow_steps(r, events, n=5):
    """The `n` slowest steps a syncing tenant listed (`slow`: [start s after start_at, ms]), each
    with gem-schd's token events from 1 ms before it started to its end: what it waited for."""
    out = []
    for at, ms in sorted(r.get("slow") or [], key=lambda x: -x[1])[:n]:
        t0 = r["start_at"] + at
        seen = [f"{1e3 * (t - t0):+.2f} ms {text}" for t, text in events
                if t0 - 0.001 <= t <= t0 + ms / 1e3]
        out.append({"at_s": at, "ms": ms, "events": seen[:16] + ([f"... {len(seen) - 16} more"]
                                                                 if len(seen) > 16 else [])})
    return out


def latency(r):
    lat = r.get("lat_ms") or []
    if len(lat) < 10:
        return {}
    lat = lat[len(lat) // 10:]
    return {"lat_p50_ms": pct(lat, 0.5), "lat_p99_ms": pct(lat, 0.99), "lat_max_ms": max(lat)}


def shared_run(b, clients, raw, key, extra=(), idle=()):
    """clients: [(label, workload, request, limit[, class])] under gem-schd, those labelled in
    `idle` configured but not started; the table row."""
    b.extra = list(extra) + os.environ.get("MIX_SCHD_ARGS", "").split()
    logf = os.path.join(b.out, "bench.log")
    b.logs.flush()
    since = os.path.getsize(logf)
    b.schd_debug = True
    running = [c for c in clients if c[0] not in idle]
    try:
        with b.schd([(c[0], c[2], c[3], 40 * GIB, *c[4:]) for c in clients]):
            res = b.tenants([(c[0], c[1], c[0]) for c in running])
    finally:
        b.schd_debug, b.extra = False, []
    raw[key] = res
    t1 = SECONDS - 0.5
    row = {}
    events = token_events(logf, since)
    for lbl, work, req, lim, *cls in running:
        r = res[lbl]
        f = busy_figures(r, SKIP, t1)
        f.update(alone_figures(res, lbl, [c[0] for c in running if c[0] != lbl], SKIP, t1))
        # gem-schd's charge covers its 10 s window at its last grant: compare the GPU time of
        # the same 10 s.
        ch = charged(logf, since, lbl, r["start_at"] + t1 if "start_at" in r else None)
        same = windows(r["busy"], t1 - 10, t1, 10)[0]
        f.update(work=work, request=req, limit=lim, steps_per_s=round(r["steps"] / SECONDS, 2),
                 charged=ch, gpu_last_10s=same, **{"class": (cls or ["guaranteed"])[0]})
        if ch is not None:
            f["charge_minus_gpu_pp"] = round(100 * (ch - same), 2)
            f["charge_differs"] = abs(ch - same) > 0.01
        f["short_of_request_pp"] = round(100 * (req - f["min_5s"]), 2)
        f["over_limit_pp"] = round(100 * (f["max_1s"] - lim), 2)
        f["over_limit_alone_pp"] = round(100 * (f["max_1s_alone"] - lim), 2)
        f.update(latency(r))
        if r.get("slow") and "start_at" in r:
            f["slowest_steps"] = slow_steps(r, events)
        # A tenant whose first kernel comes late was not running for part of the timed run:
        # its figures, and its neighbours', are then not those of the mix.
        f["first_kernel_s"] = r["busy"][0][0] if r["busy"] else None
        f["profiler_start_s"] = r.get("profiler_start_s")
        # "slices": GPU time is the records inside this context's own time slices (exact under
        # time-slicing); "records": all its records, which overlap a neighbour's slices.
        f["reading"] = r.get("reading", "records")
        for k in ("switches", "dropped", "records_s", "held_s", "fit"):
            if k in r:
                f[k] = r[k]
        # The process's CPU time over the timed run, a share of one core (what waiting costs it:
        # the hook's spin after a Soon, for one).
        if r.get("cpu_s") is not None:
            f["cpu_cores"] = round(r["cpu_s"] / SECONDS, 3)
        late = f["first_kernel_s"] is None or f["first_kernel_s"] > LATE_START_S
        if late and f["reading"] != "rates":
            f["late_start"] = True
            log(f"{key}: {lbl}'s first kernel came {f['first_kernel_s']} s into the run")
        row[lbl] = f
    every = union(*[res[c[0]]["busy"] for c in running])
    row["gpu_busy"] = round(windows(every, SKIP, t1, t1 - SKIP)[0], 4)
    labels = [c[0] for c in running]
    row["gaps"] = handovers(res, labels, SKIP, t1)
    starts = {res[lbl].get("start_at") for lbl in labels}
    if len(starts) == 1 and None not in starts:
        grants, notice_after = turn_grants(logf, since, labels, starts.pop())
        row["gaps"]["lags"] = handover_lags(res, labels, SKIP, t1, grants, notice_after)
        row["gaps"]["own_in_turns"] = own_idle_in_turns(res, labels, SKIP, t1, grants)
    else:
        row["gaps"]["lags"] = None
    # How each client was served: its turns and co-holds, the fills gem-schd judged it by.
    row["grants"] = fills(logf, since)
    past = drains(logf, since)
    spans = holds(logf, since)
    waits = turn_waits(logf, since, {lbl: (res[lbl]["start_at"] + SKIP, res[lbl]["start_at"] + t1)
                                     for lbl, *_ in running if "start_at" in res[lbl]})
    for lbl, *_ in running:
        f = row[lbl]
        r = res[lbl]
        if lbl in spans and "start_at" in r:
            mine = [(a - r["start_at"], b - r["start_at"], co) for a, b, co in spans[lbl]]
            f["holds"] = hold_figures(r, mine, SKIP, t1)
        if lbl in waits:
            f["waits"] = waits[lbl]
        if lbl in past:
            f["drain_past_quota_ms"] = past[lbl]
        # gem-schd's fill (the hook's event pairs) beside what the GPU's clock gives for the
        # same: the tenant's GPU time over the time it was charged for, the last 10 s.
        judged = row["grants"].get(lbl, {}).get("median")
        if judged is not None and f.get("charged"):
            f["fill_judged"] = judged
            f["gpu_per_charged"] = round(f["gpu_last_10s"] / f["charged"], 3)
            f["fill_differs"] = abs(judged - f["gpu_per_charged"]) > 0.05
        f.update(nvml_figure(b, lbl, res[lbl], SKIP, t1))
    return row


def nvml_figure(b, lbl, r, t0, t1):
    """With SHARE_NVML=1, the tenant's share of [t0, t1) s after its start by NVML's
    per-process SM utilisation (`nvml_sm`; share_bench.sample_nvml): the driver's own
    per-process figure, beside the GPU time CUPTI's records give."""
    sm = (getattr(b, "last_clocks", None) or {}).get("nvml_sm_pct") or {}
    if "start_at" not in r:
        return {}
    v = nvml_share(sm, lbl, r["start_at"] + t0, r["start_at"] + t1)
    return {} if v is None else {"nvml_sm": v}


def native(b, raw, works=("gpt", "decode", "conv", "elem", "long", "attn", "matmul", "encoder")):
    works = os.environ.get("MIX_NATIVE", ",".join(works)).split(",")
    out = {}
    for w in works:
        r = b.tenants([(w, w, None)], 8)[w]
        raw[f"native_{w}"] = r
        out[w] = {"steps_per_s": round(r["steps"] / 8, 2),
                  "gpu": round(windows(r["busy"], 1, 7.5, 6.5)[0], 4), **latency(r),
                  **nvml_figure(b, w, r, 1, 7.5)}
    return out


def pairs():
    """The (capped, elastic) pairs: MIX_PAIRS (`a+b,c+d`), or PAIRS."""
    if "MIX_PAIRS" in os.environ:
        return [tuple(p.split("+")) for p in os.environ["MIX_PAIRS"].split(",")]
    return PAIRS


def colocated(b, raw):
    """Each pair with decode in it (gpt+decode when none has), natively side by side, no hook:
    the latency bar of decode beside that neighbour."""
    out = {}
    for pair in [p for p in pairs() if "decode" in p] or [("gpt", "decode")]:
        key = "+".join(pair)
        res = b.tenants([(lbl, lbl, None) for lbl in pair])
        raw[f"colocated_{key}"] = res
        t1 = SECONDS - 0.5
        out[key] = {lbl: {"steps_per_s": round(res[lbl]["steps"] / SECONDS, 2),
                          "gpu": windows(res[lbl]["busy"], SKIP, t1, t1 - SKIP)[0],
                          **latency(res[lbl]), **nvml_figure(b, lbl, res[lbl], SKIP, t1)}
                    for lbl in res}
    return out


def capped_elastic(b, raw, extra=()):
    out = {}
    for capped, elastic in pairs():
        key = f"{capped}+{elastic}"
        out[key] = shared_run(b, [(capped, capped, 0.5, 0.5), (elastic, elastic, 0.5, 1.0)], raw,
                              key + ("_corun" if extra else ""), extra)
    return out


def co_run_args():
    """gem-schd's co-running argument: MIX_CORUN's threshold, the chart's 0.6 by default."""
    return ["--co-run-below", os.environ.get("MIX_CORUN", "0.6")]


def capped_elastic_corun(b, raw):
    return capped_elastic(b, raw, co_run_args())


def four(b, raw, extra=()):
    return shared_run(b, [(w, w, s, s) for w, s in FOUR], raw, "four" + ("_corun" if extra else ""),
                      extra)


def four_corun(b, raw):
    return four(b, raw, co_run_args())


def priority(b, raw):
    g, o, p = os.environ.get("MIX_PRIORITY", "matmul,conv,attn").split(",")
    clients = [(f"g_{g}", g, 0.5, 0.5, "guaranteed"), (f"o_{o}", o, 0.3, 1.0, "opportunistic"),
               (f"p_{p}", p, 0.2, 1.0, "opportunistic")]
    return {"all_busy": shared_run(b, clients, raw, "priority"),
            "guaranteed_idle": shared_run(b, clients, raw, "priority_idle", idle=(f"g_{g}",))}


@contextlib.contextmanager
def mps_server(b):
    """An MPS control daemon for the block, its pipe and log directories under the bench's
    root; every tenant spawned meanwhile is its client (`b.extra_env`)."""
    pipe = os.path.join(b.root, "mps-pipe")
    logs = os.path.join(b.root, "mps-log")
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    extra = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    ctl = shutil.which("nvidia-cuda-mps-control") or "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
    if not os.access(ctl, os.X_OK):
        raise RuntimeError("nvidia-cuda-mps-control not found")
    env = dict(os.environ, **extra)
    subprocess.run([ctl, "-d"], env=env, check=True)
    # MPS clients run side by side, not in time slices: their records are read as they are.
    b.extra_env = dict(extra, MIX_GPUTRACE="")
    try:
        yield extra
    finally:
        b.extra_env = None
        subprocess.run([ctl], input="quit\n", env=env, text=True)


def mps(b, raw):
    """gpt and decode as MPS clients, no hook: each at 50 % of the SMs, then unrestricted."""
    out = {}
    with mps_server(b) as extra:
        for key, pct_sm in (("sm50", "50"), ("unrestricted", None)):
            b.extra_env = dict(extra, MIX_GPUTRACE="",
                               **({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": pct_sm} if pct_sm else {}))
            specs = [(lbl, ["--work", lbl], None) for lbl in ("gpt", "decode")]
            res = b.run(specs, SECONDS, timeout=SECONDS + 180)
            raw[f"mps_{key}"] = res
            t1 = SECONDS - 0.5
            out[key] = {lbl: {"steps_per_s": round(res[lbl]["steps"] / SECONDS, 2),
                              "gpu": windows(res[lbl]["busy"], SKIP, t1, t1 - SKIP)[0],
                              **latency(res[lbl])} for lbl in res}
    return out


def target(row, wanted, measured, met):
    return {"row": row, "target": wanted, "measured": measured, "met": bool(met)}


def colocated_p99(colocated, pair, work):
    """`work`'s p99 co-located natively beside the same neighbour (`pair`), or None. Older
    tables co-located gpt+decode only, keyed by tenant."""
    if not any("+" in k for k in colocated):
        beside = colocated if pair == "gpt+decode" else {}
    else:
        beside = colocated.get(pair) or {}
    return (beside.get(work) or {}).get("lat_p99_ms")


def pair_targets(table):
    """The targets of the capped-beside-elastic pairs, in turns and co-running. A tenant's floor
    is its request less 2 pp, or what it keeps the GPU busy alone (`native`) less 2 pp when that
    is lower: no share of time makes a tenant busier than it is alone."""
    out = []
    native = table.get("native") or {}
    colocated = table.get("colocated") or {}
    mps50 = (table.get("mps") or {}).get("sm50") or {}
    for scenario in ("capped_elastic", "capped_elastic_corun"):
        for pair, row in (table.get(scenario) or {}).items():
            if not isinstance(row, dict) or "error" in row:
                continue
            tenants = {k: v for k, v in row.items() if isinstance(v, dict) and "request" in v}
            at = f"{scenario} {pair}"
            for lbl, t in tenants.items():
                alone = (native.get(t["work"]) or {}).get("gpu")
                floor = min(t["request"], alone) if alone is not None else t["request"]
                worst = lower_bound(t, "min_5s")
                out.append(target(f"{at}: {lbl} ({t['request']}/{t['limit']})",
                                  f"worst 5 s >= {floor - 0.02:.3f}", worst,
                                  worst >= floor - 0.02))
                if "lat_p99_ms" in t:
                    bar = colocated_p99(colocated, pair, t["work"])
                    out.append(target(f"{at}: {lbl} p99",
                                      f"<= {bar} ms (co-located)" if bar else "co-located p99 (not run)",
                                      t["lat_p99_ms"], bar is not None and t["lat_p99_ms"] <= bar))
                    out.append(target(f"{at}: {lbl} max", "<= 20 ms", t["lat_max_ms"],
                                      t["lat_max_ms"] <= 20))
            for lbl, t in tenants.items() if "decode" in tenants else ():
                if lbl == "decode":
                    continue
                gpu = lower_bound(t, "gpu")
                out.append(target(f"{at}: {lbl} beside decode", "GPU time >= 0.48", gpu,
                                  gpu >= 0.48))
                bar = (mps50.get(t["work"]) or {}).get("steps_per_s")
                if bar:
                    out.append(target(f"{at}: {lbl} steps/s", f">= {bar} (MPS 50/50)",
                                      t["steps_per_s"], t["steps_per_s"] >= bar))
    return out


def four_targets(table):
    """The targets of the four at 0.1-0.4: each within 2 pp of its request and the GPU 0.98 busy
    in turns; no busiest second above a limit + 1 pp co-running."""
    out = []
    four = table.get("four") or {}
    if "gpu_busy" in four:
        for lbl, t in four.items():
            if isinstance(t, dict) and "request" in t:
                # Short of the request by its lower bound, over it by all its records.
                low = lower_bound(t, "gpu")
                out.append(target(f"four: {lbl} ({t['request']})",
                                  "GPU time within 2 pp of its request",
                                  [low, t["gpu"]] if low != t["gpu"] else t["gpu"],
                                  low >= t["request"] - 0.02 and t["gpu"] <= t["request"] + 0.02))
        out.append(target("four: GPU busy", ">= 0.98", four["gpu_busy"], four["gpu_busy"] >= 0.98))
    for lbl, t in (table.get("four_corun") or {}).items():
        if isinstance(t, dict) and "limit" in t:
            out.append(target(f"four_corun: {lbl} ({t['limit']})",
                              f"busiest 1 s <= {t['limit'] + 0.01:.2f}", t["max_1s"],
                              t["max_1s"] <= t["limit"] + 0.01))
    return out


def targets(table):
    """The project's targets for mixes, judged on the scenarios in `table` (one run, one host):
    [{"row", "target", "measured", "met"}]; none where no GPU time was read (MIX_READING=rates)."""
    if table.get("_reading") == RATES:
        return []
    return pair_targets(table) + four_targets(table)


ALL = ["native", "colocated", "capped_elastic", "capped_elastic_corun", "four", "four_corun", "priority", "mps"]


def judge(paths):
    """The targets judged on the scenarios of several mix.json files together (later files'
    scenarios replace earlier ones'): for a matrix run in parts on one host."""
    table = {}
    for p in paths:
        with open(p) as f:
            table.update({k: v for k, v in json.load(f).items() if k != "targets"})
    return targets(table)


def is_tenant(v):
    return isinstance(v, dict) and ("gpu" in v or "steps_per_s" in v)


def tenant_brief(name, t):
    """One tenant's figures in a few words: GPU time (gem-schd's charge), its rate, decode's
    p99 / max, its co-holds of its grants, its longest wait for the token."""
    words = [name]
    charged = f" ({t['charged']:.3f})" if t.get("charged") is not None else ""
    rates_only = t.get("reading") == "rates"
    if rates_only:
        words.append(f"untraced{charged}")
    elif "gpu" in t:
        words.append(f"{t['gpu']:.3f}{charged}")
    if "lat_p99_ms" in t:
        words.append(f"p99 {t['lat_p99_ms']:.2f} max {t.get('lat_max_ms', 0):.1f} ms")
    if "steps_per_s" in t and (rates_only or "lat_p99_ms" not in t):
        words.append(f"{t['steps_per_s']:g}/s")
    holds = t.get("holds")
    if holds and holds["co_holds"]["n"]:
        n = holds["co_holds"]["n"]
        words.append(f"co {n}/{n + holds['turns']['n']}")
    if t.get("waits", {}).get("n"):
        words.append(f"wait max {t['waits']['max_ms']:.1f} ms")
    return " ".join(words)


def brief(table):
    """A line per group of tenants run together in a mix.json table (a scenario, or one pair
    of it): each tenant's `tenant_brief`, then the GPU's busy fraction where measured."""
    lines = []
    for name, v in table.items():
        if name.startswith("_") or name == "targets" or not isinstance(v, dict):
            continue
        if "error" in v:
            lines.append(f"{name}: {v['error']}")
            continue
        groups = [(name, v)] if any(is_tenant(x) for x in v.values()) else [
            (f"{name} {k}", x) for k, x in v.items() if isinstance(x, dict)]
        for label, g in groups:
            parts = [tenant_brief(k, t) for k, t in g.items() if is_tenant(t)]
            if "gpu_busy" in g:
                parts.append(f"busy {g['gpu_busy']:.3f}")
            faulty = [c for c, x in g.get("grants", {}).items()
                      if x.get("engine", {}).get("above_wall")]
            if faulty:
                parts.append("ENGINE TIME ABOVE WALL TIME: " + ", ".join(sorted(faulty)))
            lines.append(f"{label}: " + " | ".join(parts))
    return lines


def main():
    if sys.argv[1:2] == ["--judge"]:
        print(json.dumps(judge(sys.argv[2:]), indent=1))
        return
    if sys.argv[1:2] == ["--brief"]:
        for p in sys.argv[2:]:
            with open(p) as f:
                print("\n".join(f"{p}: {line}" for line in brief(json.load(f))))
        return
    art, out = sys.argv[1], sys.argv[2]
    which = sys.argv[3:] or ALL
    os.makedirs(out, exist_ok=True)
    b = MixBench(os.path.join(art, "libgemhook.so.1"), os.path.join(art, "gem-schd"), out)
    table, raw = {"_gpu": b.uuid}, {}
    under_mps = os.environ.get("MIX_MPS") == "1"
    if under_mps:
        table["_mps"] = "every tenant an MPS client, gem-schd's tokens gating its launches"
    if os.environ.get("MIX_READING") == "rates":
        table["_reading"] = RATES
    for name in which:
        t0 = time.time()
        try:
            with (mps_server(b) if under_mps and name != "mps" else contextlib.nullcontext()):
                table[name] = globals()[name](b, raw)
        except Exception as e:  # one failed scenario must not lose the others
            table[name] = {"error": repr(e)}
        table["targets"] = targets(table)
        log(name, f"{time.time() - t0:.0f} s", json.dumps(table[name]))
        with open(os.path.join(out, "mix.json"), "w") as f:
            json.dump(table, f, indent=1)
        with open(os.path.join(out, "mix-raw.json"), "w") as f:
            json.dump(raw, f)
    print(json.dumps(table))


if __name__ == "__main__":
    main()
