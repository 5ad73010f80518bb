"""One tenant of the GPU benchmark (hack/gpu-bench.sh): a PyTorch workload that warms up, prints
{"ready": true}, waits for a start time on stdin, runs for --seconds and prints one JSON line
with its throughput, a (time, ops) series, and whether its results were correct.

Modes: matmul (large bf16 matmul bursts), small (many tiny kernels), train (torchvision
ResNet-18 training steps), graph (a captured CUDA graph replayed), cublas (fp32 cuBLAS loop),
mem (memory cap checks).
"""

import argparse
import json
import sys
import time

import torch


def emit(d):
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


def wait_for_go():
    emit({"ready": True})
    line = sys.stdin.readline()
    start_at = float(json.loads(line)["start_at"])
    while time.time() < start_at:
        time.sleep(0.0005)
    return start_at


class Matmul:
    """Bursts of 20 bf16 8192^3 matmuls, then a sync (about 30 ms of GPU work per burst)."""

    def __init__(self):
        n = 8192
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.per = 20

    def step(self):
        for _ in range(self.per):
            c = self.a @ self.b
        torch.cuda.synchronize()
        del c
        return self.per

    def check(self):
        c = (self.a[:64].float() @ self.b[:, :64].float())
        d = (self.a @ self.b)[:64, :64].float()
        return bool(torch.allclose(c, d, rtol=2e-2, atol=2.0))


class Small:
    """Many tiny elementwise kernels (launch-bound), a sync every 500."""

    def __init__(self):
        self.x = torch.ones(1 << 16, device="cuda")
        self.per = 500
        self.n = 0

    def step(self):
        x = self.x
        for _ in range(self.per):
            x.mul_(1.0000001).add_(1e-7)
        torch.cuda.synchronize()
        self.n += self.per
        return self.per

    def check(self):
        return bool(torch.isfinite(self.x).all().item())


class Train:
    """ResNet-18 training steps on one fixed random batch (the loss must go down)."""

    def __init__(self):
        import torchvision

        torch.manual_seed(0)
        self.model = torchvision.models.resnet18(num_classes=10).cuda()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(64, 3, 224, 224, device="cuda")
        self.y = torch.randint(0, 10, (64,), device="cuda")
        self.losses = []

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.losses.append(float(loss.item()))
        return 1

    def check(self):
        return len(self.losses) > 5 and self.losses[-1] < self.losses[0]


class Graph:
    """A captured CUDA graph of 10 bf16 4096^3 matmul layers, replayed; compared with eager."""

    def __init__(self):
        n = 4096
        torch.manual_seed(0)
        self.x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / 64
        self.w = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(10)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.fwd()
        torch.cuda.current_stream().wait_stream(s)
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            self.out = self.fwd()
        self.per = 5

    def fwd(self):
        h = self.x
        for w in self.w:
            h = torch.relu(h @ w)
        return h

    def step(self):
        for _ in range(self.per):
            self.g.replay()
        torch.cuda.synchronize()
        return self.per

    def check(self):
        self.g.replay()
        torch.cuda.synchronize()
        return bool(torch.allclose(self.out.float(), self.fwd().float(), rtol=1e-2, atol=1e-2))


class Cublas:
    """fp32 GEMMs and batched GEMMs of several shapes through cuBLAS."""

    def __init__(self):
        torch.manual_seed(0)
        self.a = torch.randn(3000, 2048, device="cuda")
        self.b = torch.randn(2048, 4096, device="cuda")
        self.p = torch.randn(64, 256, 512, device="cuda")
        self.q = torch.randn(64, 512, 256, device="cuda")
        self.per = 10

    def step(self):
        for _ in range(self.per):
            c = self.a @ self.b
            d = torch.bmm(self.p, self.q)
        torch.cuda.synchronize()
        del c, d
        return self.per

    def check(self):
        c = (self.a @ self.b)[:32, :32].double()
        ref = self.a[:32].double() @ self.b[:, :32].double()
        d = torch.bmm(self.p, self.q)[:2].double()
        dref = torch.bmm(self.p[:2].double(), self.q[:2].double())
        return bool(torch.allclose(c, ref, rtol=1e-3, atol=1e-2) and torch.allclose(d, dref, rtol=1e-3, atol=1e-2))


MODES = {"matmul": Matmul, "small": Small, "train": Train, "graph": Graph, "cublas": Cublas}


def run_workload(args):
    w = MODES[args.mode]()
    for _ in range(2):  # warm-up (cuBLAS handles, autotuning, allocator)
        w.step()
    start = wait_for_go()
    end = start + args.seconds
    ops = 0
    series = []
    while True:
        ops += w.step()
        now = time.time()
        series.append([round(now - start, 4), ops])
        if now >= end:
            break
    wall = time.time() - start
    emit({"label": args.label, "mode": args.mode, "ops": ops, "wall_s": wall, "rate": ops / wall,
          "series": series, "correct": w.check()})


def run_mem(args):
    gib = 1 << 30
    out = {"label": args.label, "mode": "mem"}
    free, total = torch.cuda.mem_get_info()
    out["mem_get_info"] = [free, total]
    torch.empty(1, device="cuda")
    if args.try_gib:
        for g in args.try_gib:
            try:
                t = torch.empty(int(g * gib), dtype=torch.uint8, device="cuda")
                t.fill_(1)
                torch.cuda.synchronize()
                out.setdefault("tries", []).append([g, "ok"])
                del t
                torch.cuda.empty_cache()
            except torch.OutOfMemoryError:
                out.setdefault("tries", []).append([g, "OutOfMemoryError"])
    if args.hold_gib:
        held = torch.empty(int(args.hold_gib * gib), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
        out["held_gib"] = args.hold_gib
        out["mem_get_info_holding"] = list(torch.cuda.mem_get_info())
        emit(out)
        sys.stdin.readline()  # hold until told to go
        del held
        return
    emit(out)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", required=True, choices=list(MODES) + ["mem"])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--label", default="")
    p.add_argument("--try-gib", type=float, nargs="*")
    p.add_argument("--hold-gib", type=float, default=0.0)
    args = p.parse_args()
    torch.cuda.init()
    if args.mode == "mem":
        run_mem(args)
    else:
        run_workload(args)


if __name__ == "__main__":
    main()
