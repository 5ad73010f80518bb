"""Unified-memory mode on a real GPU (docs/benchmarks.md, "Unified-memory mode"; docs/um.md).

    python3 hack/gpu/um-bench.py --hook DIR/libgemhook.so.1 --schd DIR/gem-schd --out OUT

Three inference-like jobs (hack/gpu/um-job.py) whose peaks add up to about 1.3x the GPU's
memory, each a gem-schd client (request 0.33, limit 1.0):

- normal: device mode, together: at least one must fail with an out-of-memory error;
- sequential: device mode, one after another (the baseline without sharing);
- um: unified-memory mode (KUBESHARE_HOOK_UM=1), together, prefetch and empty-cache on;
- um-noopt: the same with both optimisations off (Gemini_UM's comparison);
- ceiling: a unified-mode job allocating 1 GiB chunks under a 6 GiB managed ceiling;
- overhead: one job that fits, alone, busy (no sleeps), device mode vs unified mode.

Every phase writes its raw results to OUT/um-<phase>.json as it ends; OUT/um-summary.json
holds the table. Each phase has its own time limit, so a slow one does not hide the others.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import start_schd, write_config  # noqa: E402
GIB = 1 << 30


def log(*a):
    print("[um-bench]", *a, file=sys.stderr, flush=True)


def gpu():
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.total,name", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[0]
    uuid, mib, name = [x.strip() for x in out.split(",")]
    return uuid.lower().replace("gpu-", "GPU-"), int(mib) * (1 << 20), name


class Bench:
    def __init__(self, hook, schd, out):
        self.hook, self.schd_bin, self.out = hook, schd, out
        self.uuid, self.mem, self.name = gpu()
        self.root = tempfile.mkdtemp(prefix="ks-um-")
        self.schd_args = []

    @contextlib.contextmanager
    def schd(self, clients, tag, args=None):
        cfg = os.path.join(self.root, f"rc-{tag}.txt")
        write_config(cfg, clients)
        tmpl = os.path.join(self.root, tag, "{client}", "{gpu}.sock")
        with open(os.path.join(self.out, f"um-{tag}-schd.log"), "a") as logf, \
                start_schd(self.schd_bin, self.uuid, cfg, tmpl, clients, logf,
                           self.schd_args if args is None else args):
            yield lambda client: os.path.join(self.root, tag, client)

    def spawn(self, args, sock_dir, env, tag, label):
        e = dict(os.environ)
        e.update({"PYTHONUNBUFFERED": "1", "LD_PRELOAD": self.hook, "KUBESHARE_SOCKET_DIR": sock_dir,
                  "KUBESHARE_HOOK_LOG": "info"})
        e.update(env)
        err = open(os.path.join(self.out, f"um-{tag}-{label}.log"), "w")
        return subprocess.Popen([sys.executable, os.path.join(HERE, "um-job.py"), "--label", label] + args,
                                env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)

    def together(self, jobs, timeout):
        """jobs: [(label, Popen)]. Waits for every ready (or error), starts them at once, collects."""
        deadline = time.time() + timeout
        res, ready = {}, []
        for lbl, p in jobs:
            line = p.stdout.readline()
            d = json.loads(line) if line.strip() else {"error": f"exited rc {p.wait()}"}
            if d.get("ready"):
                ready.append((lbl, p))
            else:
                res[lbl] = d
        start_at = time.time() + 0.5
        for _, p in ready:
            p.stdin.write(json.dumps({"start_at": start_at}) + "\n")
            p.stdin.flush()
        for lbl, p in ready:
            # A blocking readline bounded by the phase's deadline (a killed job ends it).
            left = deadline - time.time()
            try:
                out, _ = p.communicate(timeout=max(1, left))
                lines = [x for x in out.splitlines() if x.strip()]
                res[lbl] = json.loads(lines[-1]) if lines else {"error": f"no result, rc {p.returncode}"}
            except subprocess.TimeoutExpired:
                p.kill()
                res[lbl] = {"error": f"timed out after {timeout} s"}
        for _, p in jobs:
            if p.poll() is None:
                p.kill()
        return res


def throughput(res):
    ok = [r for r in res.values() if "iters" in r]
    if not ok:
        return None
    iters = sum(r["iters"] for r in ok)
    span = max(r["t1"] for r in ok) - min(r["t0"] for r in ok)
    return iters / span


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hook", required=True)
    ap.add_argument("--schd", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--sleep-ms", type=float, default=1000)
    # Coarse slices: a hand-over in unified-memory mode may migrate pages, so each hold should
    # cover at least one iteration (the same settings for every phase).
    ap.add_argument("--schd-args", default="--base-quota-ms 1000 --min-quota-ms 600 --max-wait-ms 3000")
    ap.add_argument("--um-env", default="", help="extra KEY=VALUE,... for the UM jobs of every phase")
    ap.add_argument("--only", default="ceiling,normal,sequential,um,overhead,noopt,shares")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    b = Bench(os.path.abspath(a.hook), os.path.abspath(a.schd), a.out)
    b.schd_args = a.schd_args.split()
    mg = b.mem // GIB
    persist, eph = max(1, round(0.1 * mg)), max(1, round(0.33 * mg))
    peak = (persist + eph) * GIB
    resident = b.mem // 3
    ceiling = 2 * resident
    job = ["--persist-gib", str(persist), "--ephemeral-gib", str(eph), "--iters", str(a.iters),
           "--sleep-ms", str(a.sleep_ms)]
    summary = {"gpu": b.name, "memory_gib": round(b.mem / GIB, 1), "jobs": 3,
               "job_peak_gib": persist + eph, "sum_of_peaks_over_gpu": round(3 * (persist + eph) * GIB / b.mem, 2),
               "schd_args": a.schd_args, "persist_gib": persist, "ephemeral_gib": eph, "iters": a.iters, "sleep_ms": a.sleep_ms,
               "um_resident_gib": round(resident / GIB, 1), "um_ceiling_gib": round(ceiling / GIB, 1)}
    log(json.dumps(summary))
    um_env = {"KUBESHARE_HOOK_UM": "1", "KUBESHARE_UM_RESIDENT_BYTES": str(resident), "KUBESHARE_HOOK_LOG": "debug"}
    um_env.update(dict(kv.split("=", 1) for kv in a.um_env.split(",") if kv))
    summary["um_env_extra"] = a.um_env
    clients = lambda cap: [(f"j{i}", 0.33, 1.0, cap) for i in range(3)]

    def save(tag, res):
        with open(os.path.join(a.out, f"um-{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "um-summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        log(tag, json.dumps(summary.get(tag)))

    def phase(tag, fn):
        if tag not in a.only.split(","):
            return
        t = time.time()
        try:
            summary[tag] = fn()
        except Exception as e:  # one phase's failure must not hide the others
            summary[tag] = {"failed": repr(e)}
        summary[tag]["phase_s"] = round(time.time() - t, 1)
        save(tag, summary[tag])

    def ceiling_probe():
        cap = 6 * GIB
        with b.schd([("c", 0.5, 1.0, cap)], "ceiling") as sd:
            p = b.spawn(["--probe-ceiling"], sd("c"), um_env, "ceiling", "c")
            out, _ = p.communicate(timeout=60)
        r = json.loads(out.splitlines()[-1])
        r["ceiling_gib"] = cap // GIB
        r["holds"] = r.get("error") == "OutOfMemoryError" and r["held_gib"] <= cap // GIB
        return r

    def normal():
        with b.schd(clients(peak + 3 * GIB), "normal") as sd:
            jobs = [(f"j{i}", b.spawn(job + ["--seed", str(i)], sd(f"j{i}"), {}, "normal", f"j{i}")) for i in range(3)]
            res = b.together(jobs, 90)
        return {"results": res, "oom": sum(1 for r in res.values() if r.get("error") == "OutOfMemoryError"),
                "completed": sum(1 for r in res.values() if "iters" in r)}

    def sequential():
        res = {}
        with b.schd(clients(peak + 3 * GIB), "sequential") as sd:
            for i in range(3):
                p = b.spawn(job + ["--seed", str(i)], sd(f"j{i}"), {}, "sequential", f"j{i}")
                res.update(b.together([(f"j{i}", p)], 60))
        ok = [r for r in res.values() if "iters" in r]
        thr = sum(r["iters"] for r in ok) / sum(r["t1"] - r["t0"] for r in ok) if ok else None
        return {"results": res, "throughput_it_s": thr, "correct": all(r.get("correct") for r in res.values())}

    def um(tag, extra):
        env = dict(um_env, **extra)
        with b.schd(clients(ceiling), tag) as sd:
            jobs = [(f"j{i}", b.spawn(job + ["--seed", str(i)], sd(f"j{i}"), env, tag, f"j{i}")) for i in range(3)]
            res = b.together(jobs, 100)
        counts = {}
        for i in range(3):
            try:
                text = open(os.path.join(a.out, f"um-{tag}-j{i}.log")).read()
                counts[f"j{i}"] = {"iterations_done": text.count("iteration "), "grants": text.count(": granted "), "prefetch_lines": text.count("prefetched "),
                                   "cache_emptied": text.count("emptied PyTorch's cache"),
                                   "pytorch_detected": "PyTorch detected" in text}
            except OSError:
                pass
        return {"results": res, "throughput_it_s": throughput(res), "hook": counts,
                "completed": sum(1 for r in res.values() if "iters" in r),
                "correct": all(r.get("correct") for r in res.values())}

    def overhead():
        out = {}
        small = ["--persist-gib", str(persist), "--ephemeral-gib", str(max(1, eph // 2)), "--iters", "20",
                 "--sleep-ms", "0"]
        for mode, env in (("device", {}), ("um", um_env)):
            with b.schd([("o", 1.0, 1.0, ceiling)], f"overhead-{mode}") as sd:
                p = b.spawn(small, sd("o"), env, f"overhead-{mode}", "o")
                r = b.together([("o", p)], 60)["o"]
            out[mode] = r
            if "iters" in r:
                out[f"{mode}_s_per_iter"] = (r["t1"] - r["t0"]) / r["iters"]
        if "device_s_per_iter" in out and "um_s_per_iter" in out:
            out["um_over_device"] = out["um_s_per_iter"] / out["device_s_per_iter"]
        return out

    def shares():
        # Two UM jobs whose sets fit (4 + 4 GiB each), busy, capped at their requests 0.3 and
        # 0.7, gem-schd with its default (fine) slices: each one's rate over its solo rate.
        small = ["--persist-gib", "4", "--ephemeral-gib", "4", "--sleep-ms", "0"]
        out = {}
        with b.schd([("s", 1.0, 1.0, ceiling)], "shares-solo", []) as sd:
            r = b.together([("s", b.spawn(small + ["--seconds", "6"], sd("s"), um_env, "shares-solo", "s"))], 60)["s"]
        out["solo"] = r
        solo = r["iters"] / (r["t1"] - r["t0"])
        with b.schd([("a", 0.3, 0.3, ceiling), ("b", 0.7, 0.7, ceiling)], "shares-pair", []) as sd:
            jobs = [(c, b.spawn(small + ["--seconds", "10", "--seed", str(i)], sd(c), um_env, "shares-pair", c))
                    for i, c in enumerate("ab")]
            res = b.together(jobs, 60)
        out["pair"] = res
        for c, want in (("a", 0.3), ("b", 0.7)):
            r = res[c]
            share = r["iters"] / (r["t1"] - r["t0"]) / solo
            out[f"share_{c}"] = round(share, 4)
            out[f"error_pp_{c}"] = round(100 * (share - want), 2)
        out["correct"] = all(x.get("correct") for x in list(res.values()) + [out["solo"]])
        return out

    phase("ceiling", ceiling_probe)
    phase("shares", shares)
    phase("normal", normal)
    phase("sequential", sequential)
    phase("um", lambda: um("um", {}))
    phase("overhead", overhead)
    phase("noopt", lambda: um("noopt", {"KUBESHARE_UM_PREFETCH": "0", "KUBESHARE_UM_EMPTY_CACHE": "0"}))
    seq = (summary.get("sequential") or {}).get("throughput_it_s")
    for k in ("um", "noopt"):
        t = (summary.get(k) or {}).get("throughput_it_s")
        if seq and t:
            summary[f"{k}_over_sequential"] = round(t / seq, 3)
    save("summary", summary)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
