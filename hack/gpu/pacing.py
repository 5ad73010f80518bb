"""Pacing check on a real GPU (gem-schd --pace-ms), reusing hack/gpu/bench.py's Bench.
Run by `hack/gpu-bench.sh --pacing`; usage: pacing.py ARTIFACT_DIR OUT_DIR. Runs: native matmul/train rates; a (0.5, 0.5) tenant alone (train and
matmul) with pacing 1000 ms, matmul with 500 ms and 0 (off); elasticity and accuracy 0.3/0.7
as in bench.py. Prints one JSON table; per-bin shares in the raw output."""
import json, os, stat, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "hack", "gpu"))
import bench  # noqa: E402

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "400"))
art, out = sys.argv[1], sys.argv[2]
b = bench.Bench(os.path.abspath(f"{art}/libgemhook.so.1"), os.path.abspath(f"{art}/gem-schd"), out)
real_schd = b.schd_bin
GIB = bench.GIB
table, raw = {"errors": {}}, {}


def with_pace(ms):
    """gem-schd with --pace-ms ms, through a wrapper (bench.py starts gem-schd itself)."""
    w = os.path.join(b.root, f"gem-schd-pace{ms}")
    with open(w, "w") as f:
        f.write(f'#!/bin/sh\nexec {real_schd} --pace-ms {ms} "$@"\n')
    os.chmod(w, stat.S_IRWXU)
    return w


def bins(r, solo, width, upto):
    """Share (rate / native rate) per bin of `width` s over [0, upto)."""
    out, t = [], 0.0
    while t + width <= upto + 1e-9:
        out.append(round(bench.rate_between(r, t, t + width) / solo, 3))
        t += width
    return out


def save():
    with open(os.path.join(out, "pacing.json"), "w") as f:
        json.dump({"table": table, "raw": raw}, f)


def step(name, fn):
    if time.time() - T0 > BUDGET:
        table["errors"][name] = "skipped: time budget"
        return
    t = time.time()
    try:
        fn()
    except Exception as e:
        table["errors"][name] = repr(e)
        bench.log(name, "FAILED", repr(e))
    bench.log(name, "took %.1f s" % (time.time() - t))
    save()


solo = {}


def native():
    for mode, secs in [("matmul", 5), ("train", 6)]:
        r = list(b.phase([(f"{mode}-native", mode, None)], secs).values())[0]
        solo[mode] = r["rate"]
    table["native_rate"] = dict(solo)


def alone(mode, pace, secs):
    def run():
        b.schd_bin = with_pace(pace)
        try:
            with b.schd([("c", 0.5, 0.5, 60 * GIB)]):
                r = list(b.phase([(f"{mode}-p{pace}", mode, "c")], secs).values())[0]
        finally:
            b.schd_bin = real_schd
        per_s = bins(r, solo[mode], 1.0, secs)
        raw[f"alone_{mode}_pace{pace}"] = {"series": r["series"], "per_0.5s": bins(r, solo[mode], 0.5, secs)}
        # the longest stretch without a completed step
        ts = [0.0] + [p[0] for p in r["series"]]
        table[f"alone_{mode}_pace{pace}"] = {
            "share_run": round(r["rate"] / solo[mode], 4), "per_1s": per_s,
            "per_1s_min": min(per_s), "per_1s_max": max(per_s),
            "longest_step_gap_s": round(max(b2 - a2 for a2, b2 in zip(ts, ts[1:])), 3),
            "correct": r["correct"]}
    return run


def elasticity():
    with b.schd([("e", 0.3, 1.0, 40 * GIB), ("f", 0.7, 1.0, 40 * GIB)]):
        a = b.phase([("e", "matmul", "e")], 8)
        both = b.phase([("e", "matmul", "e"), ("f", "matmul", "f")], 20)
    table["elasticity"] = {"alone_of_native": round(a["e"]["rate"] / solo["matmul"], 4),
                           "beside_busy_share": round(both["e"]["rate"] / solo["matmul"], 4),
                           "busy_neighbour_share": round(both["f"]["rate"] / solo["matmul"], 4)}


def accuracy():
    with b.schd([("a", 0.3, 0.3, 40 * GIB), ("b", 0.7, 0.7, 40 * GIB)]):
        r = b.phase([("a", "matmul", "a"), ("b", "matmul", "b")], 20)
    sa, sb = r["a"]["rate"] / solo["matmul"], r["b"]["rate"] / solo["matmul"]
    table["accuracy_0.3_0.7"] = {"a_share": round(sa, 4), "b_share": round(sb, 4),
                                 "max_err_pp": round(100 * max(abs(sa - .3), abs(sb - .7)), 2),
                                 "a_per_1s": bins(r["a"], solo["matmul"], 1.0, 20)}


step("native", native)
step("alone_train_1000", alone("train", 1000, 20))
step("alone_matmul_1000", alone("matmul", 1000, 15))
step("elasticity", elasticity)
step("accuracy", accuracy)
step("alone_matmul_500", alone("matmul", 500, 15))
step("alone_matmul_0", alone("matmul", 0, 15))
table["wall_s"] = round(time.time() - T0, 1)
save()
print(json.dumps(table, indent=1))
