"""What reading GPU time costs a tenant: each mix workload's steps/s alone, without and with
torch.profiler (CUDA activity only), the loop as mix_tenant.py runs it; with MIX_GPUTRACE
(a build of gputrace.cu, as hack/gpu-bench.sh makes from MIX_CUPTI) also with gputrace's
records as the mix harness takes them (`slices`), with the context-switch records alone
(`switches`: what a tenant reading only its own time slices would pay) and with the kernel
records alone (`kernels`: what a tenant reading its own kernels' GPU time would pay).

    python3 hack/gpu/profiler_cost.py [SECONDS] [work ...]
"""
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mix_tenant import SLICES, workload  # noqa: E402  (loads gputrace's CUPTI before torch)

import torch  # noqa: E402


class Records:
    """One way of reading the GPU's records around a run: `profiler`, `slices`, `switches`,
    `kernels`."""

    def __init__(self, how):
        self.how = how

    def __enter__(self):
        if self.how == "profiler":
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.how == "slices":
            SLICES.gt_start()
        elif self.how == "switches":
            SLICES.gt_start_switches()
        elif self.how == "kernels":
            SLICES.gt_start_kernels()

    def __exit__(self, *exc):
        if self.how == "profiler":
            self.prof.__exit__(None, None, None)
        elif self.how in ("slices", "switches", "kernels"):
            with tempfile.NamedTemporaryFile(prefix="gputrace-") as f:
                SLICES.gt_stop(f.name.encode())
            SLICES.gt_reset()


def run(step, seconds, how=None):
    syncs = getattr(step, "syncs", False)
    steps = 0
    with Records(how):
        end = time.time() + seconds
        t0 = time.perf_counter()
        while time.time() < end:
            step()
            steps += 1
            if not syncs and steps % 4 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
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
        plain = run(step, seconds)
        ways = ["profiler"] + (["slices", "switches", "kernels"] if SLICES else [])
        rates = {how: run(step, seconds, how) for how in ways}
        plain2 = run(step, seconds)
        out[w] = {"plain": round(plain, 1), "plain_again": round(plain2, 1)}
        for how, rate in rates.items():
            out[w][how] = round(rate, 1)
            out[w][f"{how}_of_plain"] = round(rate / max(plain, plain2), 3)
        print(json.dumps({w: out[w]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
