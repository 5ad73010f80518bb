"""What reading GPU time costs a tenant: each mix workload's steps/s alone, without and with
torch.profiler (CUDA activity only), the loop as mix_tenant.py runs it; with MIX_GPUTRACE
(a build of gputrace.cu, as hack/gpu-bench.sh makes from MIX_CUPTI) also with gputrace's
records as the mix harness takes them (`slices`), with the context-switch records alone
(`switches`: what a tenant reading only its own time slices would pay) and with the kernel
records alone (`kernels`: what a tenant reading its own kernels' GPU time would pay).
MIX_COST_WAYS=w1,w2 runs those ways instead; among them `switches_every`, the switch records
flushed every MIX_FLUSH_US (default 5000) µs from a thread (what a hook charging its tenant the
slices it held, report by report, would pay), with how long each flush took and how late the
records came (`switches_every_stats`). Switch records come only where another context shares
the GPU: run a neighbour beside it, and name one way a run. Between ways the records are turned
off (gputrace's gt_reset); turning the switch records off while another context ran hung the
mix's co-located tenants once, and a run of `switches,switches_every` beside a neighbour ran
past its timeout, where `switches_every` alone ran through.

    python3 hack/gpu/profiler_cost.py [SECONDS] [work ...]
"""
import ctypes
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mix_tenant import SLICES, workload  # noqa: E402  (loads gputrace's CUPTI before torch)

import torch  # noqa: E402


FLUSH_US = int(os.environ.get("MIX_FLUSH_US", "5000"))


class Records:
    """One way of reading the GPU's records around a run: `profiler`, `slices`, `switches`,
    `switches_every`, `kernels`; `stats`, what the flushes cost (`switches_every`)."""

    def __init__(self, how):
        self.how = how
        self.stats = None

    def __enter__(self):
        if self.how == "profiler":
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif self.how == "slices":
            SLICES.gt_start()
        elif self.how == "switches":
            SLICES.gt_start_switches()
        elif self.how == "switches_every":
            SLICES.gt_start_switches_every(FLUSH_US)
        elif self.how == "kernels":
            SLICES.gt_start_kernels()

    def __exit__(self, *exc):
        if self.how == "profiler":
            self.prof.__exit__(None, None, None)
        elif self.how in ("slices", "switches", "switches_every", "kernels"):
            if self.how == "switches_every":
                buf = ctypes.create_string_buffer(256)
                SLICES.gt_flush_stats(buf, ctypes.c_size_t(len(buf)))
                self.stats = buf.value.decode()
            with tempfile.NamedTemporaryFile(prefix="gputrace-") as f:
                SLICES.gt_stop(f.name.encode())
            SLICES.gt_reset()


def run(step, seconds, how=None, stats=None):
    """Steps a second; with `stats` (a dict), what the flushes cost under `how`."""
    syncs = getattr(step, "syncs", False)
    steps = 0
    records = Records(how)
    with records:
        end = time.time() + seconds
        t0 = time.perf_counter()
        while time.time() < end:
            step()
            steps += 1
            if not syncs and steps % 4 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    if stats is not None and records.stats:
        stats[how] = records.stats
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
        ways = (os.environ["MIX_COST_WAYS"].split(",") if os.environ.get("MIX_COST_WAYS")
                else ["profiler"] + (["slices", "switches", "kernels"] if SLICES else []))
        stats = {}
        rates = {how: run(step, seconds, how, stats) for how in ways}
        plain2 = run(step, seconds)
        out[w] = {"plain": round(plain, 1), "plain_again": round(plain2, 1)}
        for how, rate in rates.items():
            out[w][how] = round(rate, 1)
            out[w][f"{how}_of_plain"] = round(rate / max(plain, plain2), 3)
        for how, line in stats.items():
            out[w][f"{how}_stats"] = line
        print(json.dumps({w: out[w]}), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
