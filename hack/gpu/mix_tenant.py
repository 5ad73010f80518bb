"""A tenant of hack/gpu/mix.py: one workload, its GPU time read from the GPU's own timestamps.

Protocol as share_tenant.py: warm up, print {"ready": true}, wait for {"start_at": t} on
stdin, run for --seconds, print one JSON line.

GPU time comes from CUPTI's kernel records (through torch.profiler): each kernel's start and
end as the GPU stamped them, on the host's clock, so that the intervals of different
processes can be merged (mix.py computes each tenant's busy time and the GPU's busy time over
any window from them). Where two contexts share the GPU, the driver time-slices them and each
one's records also span the other's slices; with MIX_GPUTRACE naming a build of gputrace.cu
(CUPTI 13.2 or later), the records come from it instead, with the compute engine's context
switches: the result then also carries `held`, the intervals this context held the engine (on
the switch records' own clock), and mix.py keeps only the part of the records inside them
(slices.py). Nothing here reads gem-schd or the hook: the figures are independent of
what the scheduler charges. With MIX_READING=rates nothing is traced (no records, `reading`
"rates"): only the steps and latencies, for a run where a tracer in the process would change
what is measured (the hook's own CUPTI buffers are used only where no tracer registers
its own). The result carries the union of this process's kernel intervals
as [[start s, end s]] relative to start_at (merged where they touch, to keep it small), the
steps done, and for `decode` each token's latency.

Workloads (kernel sizes from ~30 us to ~25 ms; eager and CUDA graphs; cuBLAS, cuDNN
convolutions, attention, elementwise):
  elem     chains of elementwise ops on 16M floats (~30-60 us kernels), eager
  matmul   fp16 batched matmuls (cuBLAS, four ~0.22 ms kernels a step on an H200)
  conv     torchvision ResNet-18 training steps, batch 256 at 112 px (cuDNN)
  attn     scaled-dot-product attention forward and backward, fp16
  gpt      a small GPT-style training loop (causal self-attention, AdamW), eager
  decode   batch-1 decode: one CUDA-graph replay per token, the token read back each time
  encoder  nn.TransformerEncoder training steps
  long     fp32 8192^3 matmuls without TF32 (~20+ ms kernels)
"""

import argparse
import contextlib
import ctypes
import json
import os
import sys
import tempfile
import time

# gputrace's CUPTI (13.2 or later) has to be the process's libcupti.so.13: loaded before torch,
# whose own, older one would otherwise be bound first and refuse the context-switch records.
SLICES = (ctypes.CDLL(os.environ["MIX_GPUTRACE"], mode=ctypes.RTLD_GLOBAL)
          if os.environ.get("MIX_GPUTRACE") else None)
RATES_ONLY = os.environ.get("MIX_READING") == "rates"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from slices import held_intervals  # noqa: E402


# A step of a syncing workload at least this long is listed with its start time.
SLOW_STEP_MS = 5.0
# A first kernel after an idle gap this long gets its launch call's return time listed.
LAUNCHED_AFTER_GAP_NS = 50_000


def emit(d):
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


def workload(name):
    """A callable doing one step of the workload (no sync unless the workload syncs itself)."""
    dev = "cuda"
    if name == "elem":
        x = torch.randn(16 << 20, device=dev)

        def step():
            y = x
            for _ in range(20):
                y = torch.sin(y) * 1.0001 + 0.5
            return y
        return step
    if name == "matmul":
        a = torch.randn(8, 2048, 2048, device=dev, dtype=torch.float16)
        b = torch.randn(8, 2048, 2048, device=dev, dtype=torch.float16)

        def step():
            for _ in range(4):
                torch.bmm(a, b)
        return step
    if name == "long":
        torch.backends.cuda.matmul.allow_tf32 = False
        a = torch.randn(8192, 8192, device=dev)
        b = torch.randn(8192, 8192, device=dev)

        def step():
            torch.mm(a, b)
        return step
    if name == "conv":
        import torchvision
        m = torchvision.models.resnet18(num_classes=100).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        xb = torch.randn(256, 3, 112, 112, device=dev)
        yb = torch.randint(0, 100, (256,), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(xb), yb).backward()
            opt.step()
        return step
    if name == "attn":
        q, k, v = (torch.randn(16, 16, 2048, 64, device=dev, dtype=torch.float16, requires_grad=True)
                   for _ in range(3))

        def step():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.sum().backward()
        return step
    if name == "gpt":
        return gpt_train(dev)
    if name == "decode":
        return decode(dev)
    if name == "encoder":
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
        m = nn.TransformerEncoder(layer, 4).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        xb = torch.randn(128, 128, 512, device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            m(xb).pow(2).mean().backward()
            opt.step()
        return step
    raise SystemExit(f"unknown workload {name!r}")


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=8192, d=512, h=8, layers=6, ctx=256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, h) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def gpt_train(dev):
    m = Gpt().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
    xb = torch.randint(0, 8192, (64, 256), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(xb[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1)).backward()
        opt.step()
    return step


def decode(dev):
    """One token: a 12-layer MLP stack at batch 1 (fp16) and an argmax, captured once as a CUDA
    graph and replayed per token; the token is read back (a sync) before the next replay."""
    d = 2048
    layers = [nn.Linear(d, d).to(dev).half() for _ in range(12)]
    emb = torch.randn(8192, d, device=dev, dtype=torch.float16)
    head = torch.randn(d, 8192, device=dev, dtype=torch.float16)
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    out = torch.zeros(1, dtype=torch.long, device=dev)

    def body():
        x = emb[tok]
        for lin in layers:
            x = F.gelu(lin(x))
        out.copy_((x @ head).argmax(dim=-1))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()

    def step():
        g.replay()
        t = int(out.item())
        tok.fill_(t % 8192)
    step.syncs = True
    return step


def profiler_clock_offset(res, wall_ns, mono_ns):
    """What to add to the profiler's timestamps to get the host's wall clock (ns): the profiler
    stamps on the wall clock or on CLOCK_MONOTONIC depending on the build; its start, read just
    after `wall_ns`/`mono_ns`, says which. Both clocks are the same for every process here."""
    start = res.trace_start_ns() if hasattr(res, "trace_start_ns") else res.trace_start_us() * 1000
    if abs(start - wall_ns) < 60e9:
        return 0
    if abs(start - mono_ns) < 60e9:
        return wall_ns - mono_ns
    raise SystemExit(f"profiler clock unknown: start {start}, wall {wall_ns}, monotonic {mono_ns}")


def profiler_spans(prof, offset_ns):
    """torch.profiler's GPU records as (start, end, correlation) on the host's wall clock (ns),
    and each runtime call's return by correlation."""
    spans, returned = [], {}
    for e in prof.profiler.kineto_results.events():
        corr = e.correlation_id() if hasattr(e, "correlation_id") else 0
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            if corr and e.name().startswith("cu"):
                returned[corr] = e.start_ns() + e.duration_ns() + offset_ns
            continue
        s = e.start_ns() + offset_ns
        spans.append((s, s + e.duration_ns(), corr))
    return spans, returned


class SliceTrace:
    """gputrace.cu's records in place of torch.profiler's: the same spans and returns, and the
    intervals this context held the compute engine on the switch records' clock (None where no
    switch was recorded)."""

    def __init__(self, lib):
        self.lib = lib
        fd, self.path = tempfile.mkstemp(prefix="gputrace-")
        os.close(fd)

    def __enter__(self):
        rc = self.lib.gt_start()
        if rc:
            raise SystemExit(f"gputrace: CUPTI's kernel records could not be enabled ({rc})")
        return self

    def __exit__(self, *exc):
        if self.lib.gt_stop(self.path.encode()):
            raise SystemExit(f"gputrace: could not write {self.path}")

    def read(self):
        offset, ctx, switches, spans, returned, self.enabled = 0, None, [], [], {}, {}
        with open(self.path) as f:
            for line in f:
                w = line.split()
                if w[0] == "o":
                    offset = int(w[1])
                elif w[0] == "e":
                    self.enabled[w[1]] = int(w[2])
                elif w[0] == "c":
                    ctx = int(w[1])
                elif w[0] == "d":
                    self.dropped = int(w[1])
                elif w[0] == "k":
                    spans.append((int(w[1]) + offset, int(w[2]) + offset, int(w[3])))
                elif w[0] == "r":
                    returned[int(w[1])] = int(w[2]) + offset
                elif w[0] == "s":
                    switches.append((int(w[1]) + offset, int(w[2]), int(w[3])))
        keep = os.environ.get("MIX_GPUTRACE_KEEP")
        if keep:  # the raw records too, for a look at how a reading came about
            os.replace(self.path, os.path.join(keep, f"{os.getpid()}.trace"))
        else:
            os.unlink(self.path)
        self.switches = len(switches)
        return spans, returned, held_intervals(switches, ctx)


def kernel_intervals(spans, returned, base_ns):
    """The union of this process's GPU activity (kernels, copies, sets) from CUPTI's records,
    as merged [start, end] ns on the host's wall clock, from `base_ns` on; and, for each merged
    interval that follows an idle gap of at least LAUNCHED_AFTER_GAP_NS, [its start, when the
    runtime call that launched its first record returned] (seconds after `base_ns`), so that a
    hand-over's lag splits into the process's wake-up and launch (grant to that return; the
    hook's gate waits inside the call) and the GPU's part (that return to the kernel's start)."""
    merged, launched = [], []
    for s, t, corr in sorted(spans):
        if t <= base_ns:
            continue  # warm-up, before the timed run
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
            continue
        if merged and s - merged[-1][1] >= LAUNCHED_AFTER_GAP_NS and corr in returned:
            launched.append([rel(s, base_ns), rel(returned[corr], base_ns)])
        merged.append([s, t])
    return merged, launched


def rel(ns, base_ns):
    return round((ns - base_ns) / 1e9, 7)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument("--label", default="")
    ap.add_argument("--cpu", type=int)
    a = ap.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    step = workload(a.work)
    syncs = getattr(step, "syncs", False)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    lat, slow, steps = [], [], 0
    from torch.profiler import ProfilerActivity, profile
    wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
    # The trace starts before `ready`, so that however long it takes to start is not spent
    # inside the timed run (`profiler_start_s` says how long).
    if RATES_ONLY:
        trace = contextlib.nullcontext()
    elif SLICES:
        trace = SliceTrace(SLICES)
    else:
        trace = profile(activities=[ProfilerActivity.CUDA])
    with trace:
        profiler_start_s = round(time.time() - wall_ns / 1e9, 3)
        emit({"ready": True})
        start_at = json.loads(sys.stdin.readline())["start_at"]
        while time.time() < start_at:
            time.sleep(0.001)
        base_ns = int(start_at * 1e9)
        cpu0 = time.process_time()
        end = start_at + a.seconds
        while time.time() < end:
            t0 = time.perf_counter()
            step()
            if syncs:
                ms = (time.perf_counter() - t0) * 1e3
                lat.append(round(ms, 4))
                if ms >= SLOW_STEP_MS:
                    # When it started (s after start_at) too, to find what it waited for.
                    slow.append([round(time.time() - ms / 1e3 - start_at, 5), round(ms, 3)])
            steps += 1
            if not syncs and steps % 4 == 0:
                # Bounds what the CPU queues ahead, as a training loop's loss.item() does.
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        cpu_s = round(time.process_time() - cpu0, 3)
    reading = {"reading": "records"}
    if RATES_ONLY:
        records, launched = [], []
        reading = {"reading": "rates"}
    elif SLICES:
        spans, returned, held = trace.read()
        records, launched = kernel_intervals(spans, returned, base_ns)
        reading.update(switches=trace.switches, dropped=trace.dropped, enabled=trace.enabled)
        if held is not None:
            # Cut to this context's own slices by mix.py (slices.py), with its neighbours'.
            reading["held"] = [[rel(s, base_ns), rel(t, base_ns)] for s, t in held]
    else:
        offset = profiler_clock_offset(trace.profiler.kineto_results, wall_ns, mono_ns)
        records, launched = kernel_intervals(*profiler_spans(trace, offset), base_ns)
    busy = [[rel(s, base_ns), rel(t, base_ns)] for s, t in records]
    emit({"label": a.label, "work": a.work, "steps": steps, "seconds": a.seconds,
          "busy": busy, "launched": launched, "lat_ms": lat, "slow": slow, "cpu_s": cpu_s,
          "profiler_start_s": profiler_start_s, "start_at": start_at, **reading})


if __name__ == "__main__":
    main()
