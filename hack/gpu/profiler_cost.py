"""What reading GPU time through torch.profiler costs a tenant: each mix workload's steps/s
alone, without and with the profiler (CUDA activity only), the loop as mix_tenant.py runs it.

    python3 hack/gpu/profiler_cost.py [SECONDS] [work ...]
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mix_tenant import workload  # noqa: E402


def run(step, seconds, prof):
    syncs = getattr(step, "syncs", False)
    steps = 0
    from torch.profiler import ProfilerActivity, profile
    ctx = profile(activities=[ProfilerActivity.CUDA]) if prof else None
    if ctx:
        ctx.__enter__()
    end = time.time() + seconds
    t0 = time.perf_counter()
    while time.time() < end:
        step()
        steps += 1
        if not syncs and steps % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if ctx:
        ctx.__exit__(None, None, None)
    return steps / dt


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 4
    works = sys.argv[2:] or ["elem", "matmul", "gpt", "decode", "conv", "encoder"]
    out = {}
    for w in works:
        step = workload(w)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        plain = run(step, seconds, False)
        prof = run(step, seconds, True)
        plain2 = run(step, seconds, False)
        out[w] = {"plain": round(plain, 1), "profiled": round(prof, 1), "plain_again": round(plain2, 1),
                  "profiled_of_plain": round(prof / max(plain, plain2), 3)}
        print(json.dumps({w: out[w]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
