"""The machinery under share.py's scenarios: gem-schd started per scenario with a resource
config, tenants (share_tenant.py) spawned with or without the hook and started together, the
GPU's clocks and (SHARE_NVML=1) NVML's per-process utilisation sampled while they run, and the
helpers that turn per-kernel busy intervals into shares per window."""

import contextlib
import ctypes
import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import (Bench, read_results, start_schd, start_together, tenants_running,  # noqa: E402
                   write_config)

GIB = 1 << 30
# Colour codes of a log written by an older build (logs are plain text now).
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ShareBench(Bench):
    extra = []  # more gem-schd arguments, for a variant of a scenario
    debug = False  # gem-schd and hook debug logs (every grant, with its wait) into bench.log
    schd_debug = False  # gem-schd's debug log only (every grant with the client's charged time)
    hook_env = {}  # more environment for the hooked tenants, for a variant of a scenario
    label_env = {}  # more environment for one tenant by its label (a variant's "infer" only)
    last_clocks = None  # the GPU's SM clock, power and utilisation over the last run's timed part

    def schd(self, clients):
        """gem-schd with `clients` = [(id, request, limit, mem_bytes)] and `extra` arguments."""
        self.write_config(clients)
        tmpl = os.path.join(self.root, "pods", "{client}", "{gpu}.sock")
        env = dict(os.environ, RUST_LOG="gem_schd=debug" if self.debug or self.schd_debug else "info")
        return start_schd(self.schd_bin, self.uuid, os.path.join(self.root, "rc.txt"), tmpl, clients,
                          self.logs, self.extra, env)

    def spawn(self, args, client=None, env=None):
        label = args[args.index("--label") + 1] if "--label" in args else ""
        cpu = pinned_cpu(label)
        if cpu is not None:
            args = args + ["--cpu", str(cpu)]
        e = dict(os.environ, PYTHONUNBUFFERED="1")
        if client is not None:
            e.update(LD_PRELOAD=self.hook, KUBESHARE_SOCKET_DIR=self.sock_dir(client),
                     KUBESHARE_HOOK_LOG="debug" if self.debug else "info", **self.hook_env)
        e.update(env or {})
        return subprocess.Popen([sys.executable, os.path.join(HERE, "share_tenant.py")] + args, env=e,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logs, text=True)

    def write_config(self, clients):
        write_config(os.path.join(self.root, "rc.txt"), clients)

    def run(self, tenants, seconds, at=(), timeout=150):
        """tenants: [(label, [tenant args], client or None)]; `at`: [(s after start, fn)]."""
        procs = [(lbl, self.spawn(args + ["--seconds", str(seconds), "--label", lbl], client,
                                  self.label_env.get(lbl)))
                 for lbl, args, client in tenants]

        with tenants_running(procs, timeout, f"tenants {[t[0] for t in tenants]}"):
            start_at = start_together(procs)
            timers = [threading.Timer(start_at + t - time.time(), fn) for t, fn in at]
            for t in timers:
                t.start()
            with sample_clocks() as clocks, sample_nvml({p.pid: lbl for lbl, p in procs}) as sm:
                res = read_results(procs)
            if sm:
                clocks["nvml_sm_pct"] = sm
            self.last_clocks = clocks
            return res


def pinned_cpu(label):
    """With SHARE_PIN=1, the CPU a tenant is pinned to by its label: one per physical core (no
    two tenants on hyperthread siblings), skipping the first core, so that tenants never share
    a core. It did not remove the spread of a launch-bound tenant's native rate (batch-1
    inference: 1.55–2.93 ms per request over three runs of one pinned call on an H100)."""
    if os.environ.get("SHARE_PIN") != "1":
        return None
    def topology(cpu, what):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/{what}") as f:
                return f.read().strip()
        except OSError:
            return str(cpu)
    cores = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault((topology(cpu, "physical_package_id"), topology(cpu, "core_id")), cpu)
    firsts = sorted(cores.values())[1:]
    order = ["infer", "train", "a", "b", "c", "a1", "a2", "native"]
    i = order.index(label) if label in order else len(order) + sum(map(ord, label)) % 8
    return firsts[(2 * i) % len(firsts)] if firsts else None


class NvmlSample(ctypes.Structure):
    """nvmlProcessUtilizationSample_t."""
    _fields_ = [("pid", ctypes.c_uint), ("ts_us", ctypes.c_ulonglong), ("sm", ctypes.c_uint),
                ("mem", ctypes.c_uint), ("enc", ctypes.c_uint), ("dec", ctypes.c_uint)]


@contextlib.contextmanager
def sample_nvml(labels, period=0.05):
    """With SHARE_NVML=1, NVML's per-process SM utilisation of each tenant by its label
    (`labels`: pid -> label): nvmlDeviceGetProcessUtilization polled every `period` s for the
    samples since the last one, as HAMi's limiter reads it. The driver takes a sample per
    process about every 200 ms (H200, driver 580), so the summary gives each label its samples
    as [wall time s, SM %] and the median spacing of all samples (`period_s`): a tenant's share
    of a window is the sum of its SM % × the spacing over the window (`nvml_share`)."""
    summary = {}
    if os.environ.get("SHARE_NVML") != "1":
        yield summary
        return
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        dev = ctypes.c_void_p()
        if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)):
            raise OSError("nvmlInit or the device handle failed")
    except OSError as e:
        summary["error"] = repr(e)
        yield summary
        return
    stop = threading.Event()
    seen = {}

    def poll():
        last = ctypes.c_ulonglong(0)
        while not stop.wait(period):
            n = ctypes.c_uint(0)
            # NVML_ERROR_INSUFFICIENT_SIZE (7) with the count when there are new samples.
            if nvml.nvmlDeviceGetProcessUtilization(dev, None, ctypes.byref(n), last) not in (0, 7):
                continue
            if not n.value:
                continue
            buf = (NvmlSample * n.value)()
            if nvml.nvmlDeviceGetProcessUtilization(dev, buf, ctypes.byref(n), last):
                continue
            for x in buf[:n.value]:
                seen.setdefault(x.ts_us, []).append((x.pid, x.sm))
                last.value = max(last.value, x.ts_us)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield summary
    finally:
        stop.set()
        t.join()
        nvml.nvmlShutdown()
        stamps = sorted(seen)
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
        summary["period_s"] = gaps[len(gaps) // 2] / 1e6 if gaps else None
        for ts in stamps:
            for pid, sm in seen[ts]:
                if pid in labels:
                    summary.setdefault(labels[pid], []).append([ts / 1e6, sm])


def nvml_share(summary, label, t0, t1):
    """The label's share of [t0, t1) (wall time) by NVML's samples (`sample_nvml`), or None."""
    xs, period = summary.get(label), summary.get("period_s")
    if not xs or not period or t1 <= t0:
        return None
    return round(sum(sm / 100 * period for ts, sm in xs if t0 <= ts < t1) / (t1 - t0), 4)


@contextlib.contextmanager
def sample_clocks():
    """The GPU's SM clock (MHz), power (W), utilisation (%), memory clock (MHz), performance
    state (the N of PN) and PCIe link generation every 50 ms while the block runs, as p10 / p50 /
    p90 of each: a partly idle GPU clocks higher than a busy one, so a tenant's
    native rate and its rate beside a neighbour may be measured at different clocks."""
    summary = {}
    keys = ["sm_mhz", "power_w", "util_pct", "mem_mhz", "pstate", "pcie_gen"]
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,utilization.gpu,"
                          "clocks.mem,pstate,pcie.link.gen.current",
                          "--format=csv,noheader,nounits", "-lms", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # With SHARE_PIN=1, the frequency of the inference tenant's core too (a launch-bound
    # tenant's speed is its CPU's).
    cpu = pinned_cpu("infer")
    freq, stop = [], threading.Event()
    def sample_freq():
        path = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq"
        while not stop.wait(0.05):
            try:
                with open(path) as f:
                    freq.append(int(f.read()) / 1000)
            except (OSError, ValueError):
                return
    sampler = threading.Thread(target=sample_freq, daemon=True)
    if cpu is not None:
        sampler.start()
    try:
        yield summary
    finally:
        stop.set()
        if freq:
            summary["infer_cpu_mhz"] = [pct(freq, .1), pct(freq, .5), pct(freq, .9)]
        p.send_signal(signal.SIGINT)  # its loop ends cleanly on ^C, with its output flushed
        try:
            out = p.communicate(timeout=5)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0]
        rows = []
        for line in out.splitlines():
            try:
                rows.append([float(x.strip().lstrip("P")) for x in line.split(",")])
            except ValueError:
                continue  # a partial last line, or "[N/A]"
        for i, key in enumerate(keys):
            col = [r[i] for r in rows if len(r) > i]
            if col:
                summary[key] = [pct(col, .1), pct(col, .5), pct(col, .9)]
        summary["samples"] = len(rows)


def windows(busy, t0, t1, width):
    """GPU busy fraction per window of `width` s in [t0, t1), from the kernels' [start, end]
    (s from the tenant's start, on the GPU's clock)."""
    n = int(round((t1 - t0) / width))
    acc = [0.0] * n
    for a, b in busy:
        if b <= t0 or a >= t1:
            continue
        for i in range(max(0, int((a - t0) // width)), min(n, int((b - t0) // width) + 1)):
            lo, hi = t0 + i * width, t0 + (i + 1) * width
            acc[i] += max(0.0, min(b, hi) - max(a, lo))
    return [round(x / width, 4) for x in acc]


def sliding_max(busy, t0, t1, width=1.0, step=0.1):
    """The largest busy fraction over any window of `width` s starting on a `step` grid."""
    fine = windows(busy, t0, t1, step)
    k = int(round(width / step))
    return round(max(sum(fine[i:i + k]) / k for i in range(len(fine) - k + 1)), 4)


def union(*lists):
    """Merged intervals: the GPU time of several processes of one client (when both run in
    one hold, the GPU time-slices between their contexts and each one's events span the
    other's kernels too, so their sums would count it twice)."""
    out = []
    for a, b in sorted(x for l in lists for x in l):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def total_busy(busy, t0, t1):
    """Fraction of [t0, t1) the kernels kept the GPU busy."""
    return windows(busy, t0, t1, t1 - t0)[0]


def burst(ms):
    return ["--mode", "burst", "--burst-ms", str(ms)]


def schd_log(logfile, since=0):
    """gem-schd's log lines after byte `since`, without colour codes."""
    with open(logfile) as f:
        f.seek(since)
        for line in f:
            yield ANSI.sub("", line)


# A grant's debug line: its client and whether it is a co-hold.
GRANT = re.compile(r"grant client=(\S+) .* co=(true|false)")


def charged(logfile, since, client, until=None):
    """gem-schd's charged time of `client` over its 10 s window at its last grant logged after
    byte `since` of the log (the debug line of each grant carries it), as a fraction; with
    `until` (host clock, s), its last grant at or before then (a tenant that outlives its
    neighbours is otherwise read alone)."""
    last = None
    for line in schd_log(logfile, since):
        if f"client={client} " in line and " grant" in line:
            m = re.search(r"usage_us=(\d+)", line)
            if not m:
                continue
            if until is not None and log_time(line) > until:
                break
            last = int(m.group(1))
    return None if last is None else round(last / 10e6, 4)


def log_time(line):
    """A gem-schd log line's timestamp (its RFC 3339 UTC prefix) on the host clock, s."""
    stamp = line.split(" ", 1)[0].rstrip("Z")
    return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc).timestamp()


def fills(logfile, since=0):
    """Per client, the fills gem-schd logged (its debug `busy` lines, one per Busy report from
    the hook) after byte `since` of its log, and how many of its grants were co-holds:
    {client: {"last", "median", "reports", "limit_in_force_median", "grants", "co_grants"}};
    where its reports carried engine time (the hook's CUPTI readings), also `engine`
    (`engine_summary`)."""
    seen, limits, grants, engine = {}, {}, {}, {}
    for line in schd_log(logfile, since):
        g = GRANT.search(line)
        if g:
            n = grants.setdefault(g.group(1), [0, 0])
            n[0] += 1
            n[1] += g.group(2) == "true"
        # By field name, not position: a field added to the line (as `earlier_us` was once)
        # left every fill out of a whole GPU call's results.
        if "busy_us=" in line and "fill=" in line:
            kv = dict(re.findall(r"(\w+)=\"?([^\s\"]+)", line))
            try:
                client, fill = kv["client"], float(kv["fill"])
            except (KeyError, ValueError):
                continue
            seen.setdefault(client, []).append(fill)
            if kv.get("limit", "").isdigit():
                limits.setdefault(client, []).append(int(kv["limit"]))
            if kv.get("engine_us", "").isdigit():
                engine.setdefault(client, []).append((log_time(line), int(kv["engine_us"])))
    out = {c: {"last": v[-1], "median": pct(v, 0.5), "reports": len(v),
               "limit_in_force_median": pct(limits[c], 0.5) if limits.get(c) else None,
               "grants": grants.get(c, [0, 0])[0], "co_grants": grants.get(c, [0, 0])[1]}
           for c, v in seen.items()}
    for c, reports in engine.items():
        out[c]["engine"] = engine_summary(reports)
    return out


def engine_summary(reports):
    """A client's engine time reports, [(host clock s, engine_us)]: how many, their sum, the
    largest, and the wall time they span (first to last). One process's contexts hold the
    engine one at a time, so a sum above the span (`above_wall`) is a fault of the readings, not
    a measurement: the books once summed 3,987 s over 17.6 s."""
    span = reports[-1][0] - reports[0][0]
    total = sum(e for _, e in reports) / 1e6
    return {"reports": len(reports), "engine_s": round(total, 3), "span_s": round(span, 3),
            "largest_ms": round(max(e for _, e in reports) / 1e3, 2),
            "above_wall": total > span + 0.1}


def drains(logfile, since=0):
    """Per client, how far its turns ran past their quotas, from gem-schd's debug log after byte
    `since`: the overuse each TokenRequest reported after a turn (its drain: the work queued
    before the deadline, which a neighbour waits for), as {client: [p50, p90, max] ms}. Co-holds
    are left out: their drains run beside the holder's kernels."""
    co, out = {}, {}
    for line in schd_log(logfile, since):
        g = GRANT.search(line)
        if g:
            co[g.group(1)] = g.group(2) == "true"
            continue
        w = re.search(r"waits conn=\d+ client=(\S+) overuse_us=(\d+)", line)
        if w and co.get(w.group(1)) is False:
            out.setdefault(w.group(1), []).append(int(w.group(2)) / 1e3)
    return {c: [round(pct(v, 0.5), 2), round(pct(v, 0.9), 2), round(max(v), 2)]
            for c, v in out.items()}


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def stall(series):
    ts = [0.0] + [p[0] for p in series]
    return round(max(b - a for a, b in zip(ts, ts[1:])), 4)


def variant(scenario, extra, hook_env=None, debug=False, schd_debug=False):
    """`scenario` with more gem-schd arguments (and hook environment), as a scenario of its own;
    `debug`: every grant logged by gem-schd and the hook, `schd_debug`: by gem-schd only (with
    the client's charged time)."""
    def run(b, raw):
        b.extra, b.hook_env, b.debug = extra, hook_env or {}, debug or b.debug
        b.schd_debug = schd_debug or b.schd_debug
        try:
            return scenario(b, raw)
        finally:
            b.extra, b.hook_env, b.debug, b.schd_debug = [], {}, False, False
    return run


def for_label(scenario, label, env):
    """`scenario` with more environment for the tenant labelled `label` only."""
    def run(b, raw):
        b.label_env = {label: env}
        try:
            return scenario(b, raw)
        finally:
            b.label_env = {}
    return run
