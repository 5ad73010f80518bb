"""A tenant of hack/gpu/share.py that measures the GPU time it gets, not only its throughput.

Protocol as tenant.py: warm up, print {"ready": true}, wait for {"start_at": t} on stdin, run
for --seconds, print one JSON line. Modes:

  burst   bursts of bf16 4096^3 matmuls lasting --burst-ms of GPU time, a sync after each.
          Every matmul is bracketed by CUDA events, and a 1-element kernel is launched just
          before its start event: that launch is where libgemhook may hold the thread for the
          token, so no wait for the token falls between the events. The events give the GPU
          busy time exactly (whatever the clocks), and placed in time: each is read relative to
          a reference event recorded at the start; "busy" = [[start s, end s]] per kernel.
  train50 torchvision ResNet-50 training steps, batch 64 (one fixed batch).
  fill    matmuls in the off-windows of --duty-on-ms/--duty-off-ms (Filler says why).
  tick    a tiny kernel every --tick-us (Tick says why).
  infer18 torchvision ResNet-18 inference, batch 1, one sync per request; latencies in ms,
          each request's start (s from the run's start) and its GPU span in ms (CUDA events
          before its first kernel and after its last: a request split by a turn spans the wait).
          With --duty-on-ms/--duty-off-ms it runs natively in windows (ON ms of requests, then
          OFF ms in which the GPU gets no request: --duty-idle sleep idles the CPU too, spin
          keeps the CPU busy, fill keeps the GPU busy with this process's own matmuls), the
          pattern exclusive turns impose without a scheduler: is a request slower in a short
          window by itself? Each request says whether it opened its window ("first").
"""

import argparse
import json
import os
import sys
import time

import torch


def emit(d):
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


class Burst:
    def __init__(self, burst_ms):
        n = 4096
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.probe = torch.zeros(1, device="cuda")
        # Calibrate the matmul's GPU time (before any sharing starts).
        for _ in range(20):
            torch.matmul(self.a, self.b, out=self.c)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for _ in range(50):
            torch.matmul(self.a, self.b, out=self.c)
        e.record()
        e.synchronize()
        self.kernel_ms = s.elapsed_time(e) / 50
        self.per = max(1, round(burst_ms / self.kernel_ms))
        self.ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.per)]
        self.busy = []
        self.ref = torch.cuda.Event(enable_timing=True)
        self.waits_inside = 0
        self.start()

    def start(self):
        """Marks the run's start on the GPU's clock (the stream is idle: it completes now)."""
        self.busy.clear()
        self.ref.record()
        self.ref.synchronize()

    def step(self, t0):
        waited = []
        for s, e in self.ev:
            self.probe.add_(1)  # the gate: a token wait happens here, before the start event
            s.record()
            t = time.perf_counter()
            torch.matmul(self.a, self.b, out=self.c)
            # The deadline (on a coarse clock) may also pass between the probe and this
            # launch: then the wait fell between the events. The queue was drained before
            # the wait, so the kernel ran right before its end event.
            waited.append(time.perf_counter() - t > 0.0005)
            e.record()
        torch.cuda.synchronize()
        for (s, e), w in zip(self.ev, waited):
            end = self.ref.elapsed_time(e) / 1000
            start = end - self.kernel_ms / 1000 if w else self.ref.elapsed_time(s) / 1000
            self.busy.append([round(start, 6), round(end, 6)])
        self.waits_inside += sum(waited)
        return self.per


class Train50:
    def __init__(self):
        import torchvision
        self.m = torchvision.models.resnet50().cuda()
        self.opt = torch.optim.SGD(self.m.parameters(), lr=0.01)
        self.x = torch.randn(64, 3, 224, 224, device="cuda")
        self.y = torch.randint(0, 1000, (64,), device="cuda")
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, t0):
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.m(self.x), self.y).backward()
        self.opt.step()
        torch.cuda.synchronize()
        return 1


def wait_until(until, spin=False):
    """Until time.time() reaches `until`: in sleeps of at most 1 ms, or spinning."""
    while time.time() < until:
        if not spin:
            time.sleep(max(0.0, min(until - time.time(), 0.001)))


class Matmuls:
    """bf16 4096^3 matmuls that keep the GPU busy for a given time: `kernel_s` is one's time,
    measured once."""
    def __init__(self):
        n = 4096
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.run(1)
        t = time.perf_counter()
        self.run(20)
        self.kernel_s = (time.perf_counter() - t) / 20

    def run(self, n):
        """n matmuls, then a sync."""
        for _ in range(n):
            torch.matmul(self.a, self.a, out=self.c)
        torch.cuda.synchronize()

    def fill(self, seconds):
        """As many matmuls as take `seconds` (at least one); returns how many."""
        n = max(1, round(seconds / self.kernel_s))
        self.run(n)
        return n


class Filler:
    """Native matmuls that fill the off-windows of a --duty-on-ms/--duty-off-ms pattern (and
    sleep through its on-windows): with an infer18 tenant in the same pattern, two contexts
    take exclusive turns on the wall clock, without a scheduler or a hook."""
    def __init__(self, duty):
        self.on, self.off = duty[0], duty[1]
        self.mm = Matmuls()

    def step(self, t0):
        k, into = divmod(max(time.time() - t0, 0.0), self.on + self.off)
        if into < self.on:  # the other tenant's window
            until = t0 + k * (self.on + self.off) + self.on
            wait_until(until)
            into = self.on
        # Kernels that end by the window's end (the last may overrun by half a kernel's time).
        return self.mm.fill(self.on + self.off - into)


class Tick:
    """A 1-element kernel and a sync every --tick-us: a GPU that is never idle for longer,
    at almost no load. Beside a windowed infer18 tenant: is it the GPU's idle time that slows
    the next requests?"""
    def __init__(self, tick_us):
        self.x = torch.zeros(1, device="cuda")
        self.every = tick_us / 1e6

    def step(self, t0):
        t = time.perf_counter()
        self.x.add_(1)
        torch.cuda.synchronize()
        while time.perf_counter() - t < self.every:
            time.sleep(self.every / 10)
        return 1


class Infer18:
    def __init__(self, duty=None, batch=1):
        import torchvision
        self.m = torchvision.models.resnet18().cuda().eval()
        self.x = torch.randn(batch, 3, 224, 224, device="cuda")
        self.lat, self.req_t, self.gpu_ms, self.first = [], [], [], []
        self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self.duty = duty  # (on s, off s, idle, guard s) or None
        self.window = None  # the index of the current on-window
        self.mm = Matmuls() if duty and duty[2] == "fill" else None

    def off_phase(self, t0):
        """Waits out an off-window if one is due; True when this request opens an on-window."""
        on, off, idle, guard = self.duty
        now = time.time() - t0
        k, into = divmod(max(now, 0.0), on + off)
        # In the off part, or too late in the window for a request to end inside it (the guard):
        # idle until the next window opens.
        if into >= on - guard:
            until = t0 + (k + 1) * (on + off)
            if idle == "fill":
                self.mm.fill(off)
            wait_until(until, spin=idle != "sleep")
            k += 1
        opens = self.window != k
        self.window = k
        return opens

    def step(self, t0):
        first = self.off_phase(t0) if self.duty else False
        s, e = self.ev
        self.req_t.append(round(time.time() - t0, 5))
        t = time.perf_counter()
        with torch.no_grad():
            s.record()
            self.m(self.x)
            e.record()
        torch.cuda.synchronize()
        self.lat.append(round((time.perf_counter() - t) * 1000, 3))
        self.gpu_ms.append(round(s.elapsed_time(e), 3))
        self.first.append(first)
        return 1


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", required=True, choices=["burst", "train50", "infer18", "fill", "tick"])
    p.add_argument("--tick-us", type=float, default=500, help="tick: a kernel this often")
    p.add_argument("--burst-ms", type=float, default=16)
    p.add_argument("--batch", type=int, default=1, help="infer18: images per request")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--label", default="")
    p.add_argument("--duty-on-ms", type=float,
                   help="infer18: requests in windows this long; fill: matmuls between them")
    p.add_argument("--duty-off-ms", type=float, default=5, help="... separated by this long")
    p.add_argument("--duty-idle", choices=["sleep", "spin", "fill"], default="sleep")
    p.add_argument("--duty-guard-ms", type=float, default=0,
                   help="infer18: no request starts this close to its window's end")
    p.add_argument("--cpu", type=int, help="pin the process to this CPU (share.py's SHARE_PIN=1)")
    a = p.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    torch.cuda.init()
    if a.mode == "fill" and not a.duty_on_ms:
        p.error("--mode fill needs --duty-on-ms")
    duty = ((a.duty_on_ms / 1000, a.duty_off_ms / 1000, a.duty_idle, a.duty_guard_ms / 1000)
            if a.duty_on_ms else None)
    w = {"burst": lambda: Burst(a.burst_ms), "train50": Train50,
         "infer18": lambda: Infer18(duty, a.batch), "fill": lambda: Filler(duty),
         "tick": lambda: Tick(a.tick_us)}[a.mode]()
    for _ in range(3):
        w.step(time.time())
    if hasattr(w, "lat"):
        for v in (w.lat, w.req_t, w.gpu_ms, w.first):
            v.clear()
    emit({"ready": True})
    start = float(json.loads(sys.stdin.readline())["start_at"])
    while time.time() < start:
        time.sleep(0.0005)
    if hasattr(w, "start"):
        w.start()
    end = start + a.seconds
    ops, series = 0, []
    while True:
        ops += w.step(start)
        now = time.time()
        series.append([round(now - start, 4), ops])
        if now >= end:
            break
    out = {"label": a.label, "mode": a.mode, "ops": ops, "wall_s": time.time() - start,
           "rate": ops / (time.time() - start), "series": series}
    if hasattr(w, "busy"):
        out.update(busy=w.busy, kernel_ms=w.kernel_ms, per_burst=w.per, waits_inside=w.waits_inside)
    if hasattr(w, "lat"):
        out.update(lat_ms=w.lat, req_t=w.req_t, gpu_ms=w.gpu_ms, first=w.first)
    emit(out)


if __name__ == "__main__":
    main()
