"""Launch-bound overhead of the hook with many short A/B alternations.

A Python-driven loop of tiny kernels varies by about ±10 % between identical native runs, so
one A-B-B-A round (bench.py) cannot resolve a 2 % target. This runs N pairs (order alternating),
each pair native then hooked or the reverse, and reports the per-pair slowdowns, their median
and the slowdown of the summed rates. Run by `hack/gpu-bench.sh --overhead`;
usage: overhead.py ARTIFACT_DIR OUT_DIR [PAIRS] [SECONDS].
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "hack", "gpu"))
import bench  # noqa: E402

art, out = sys.argv[1], sys.argv[2]
pairs_n = int(sys.argv[3]) if len(sys.argv) > 3 else 10
secs = float(sys.argv[4]) if len(sys.argv) > 4 else 3
b = bench.Bench(os.path.abspath(f"{art}/libgemhook.so.1"), os.path.abspath(f"{art}/gem-schd"), out)

pairs = []
with b.schd([("solo", 1.0, 1.0, 200 * bench.GIB)]):
    for i in range(pairs_n):
        order = ["native", "hook"] if i % 2 == 0 else ["hook", "native"]
        rates = {}
        for kind in order:
            r = b.phase([(f"small-{kind}-{i}", "small", None if kind == "native" else "solo")], secs)
            rates[kind] = list(r.values())[0]["rate"]
        pairs.append(rates)

slow = [100 * (1 - p["hook"] / p["native"]) for p in pairs]
res = {
    "pairs": pairs,
    "slowdown_pct_per_pair": [round(x, 2) for x in slow],
    "median_slowdown_pct": round(statistics.median(slow), 2),
    "summed_rates_slowdown_pct": round(
        100 * (1 - sum(p["hook"] for p in pairs) / sum(p["native"] for p in pairs)), 2),
    "native_spread_pct": round(
        100 * (max(p["native"] for p in pairs) / min(p["native"] for p in pairs) - 1), 1),
}
with open(os.path.join(out, "overhead.json"), "w") as f:
    json.dump(res, f)
print(json.dumps(res, indent=1))
