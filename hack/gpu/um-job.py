"""One job of the unified-memory benchmark (hack/gpu/um-bench.py, docs/benchmarks.md,
"Unified-memory mode"): an inference-like PyTorch loop in the style of Gemini_UM's benchmark.

It keeps --persist-gib of "weights" (1 GiB float32 chunks of small integers), and each
iteration builds --ephemeral-gib of "activations" from them (chunk i = weights[i % P] * c),
checks each one exactly (its float64 sum must be c x the weight chunk's sum, so any page lost
or corrupted in a migration is caught), drops them (PyTorch keeps them cached) and sleeps
--sleep-ms (the next request's arrival). It warms up (weights + one iteration), prints
{"ready": true}, waits for a start time on stdin, runs --iters iterations and prints one JSON
line: iterations, the time they took, and whether every check held; or {"error": ...} on an
out-of-memory error (the normal-mode run expects one).

--probe-ceiling: instead, allocate 1 GiB chunks until the allocation fails; print how much
was held and the error.
"""

import argparse
import json
import sys
import time

import torch

GIB = 1 << 30
N = GIB // 4  # float32 elements in a 1 GiB chunk


def emit(d):
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


def exact_sum(x):
    # Row sums of 16384 small integers stay below 2**24 (exact in float32); their float64
    # total is exact. No float64 copy of the whole chunk (that would be 2 GiB more).
    return x.view(-1, 1 << 14).sum(dim=1).double().sum().item()


def probe_ceiling():
    held = []
    try:
        while True:
            held.append(torch.empty(N, device="cuda"))
            held[-1].fill_(1.0)
    except torch.OutOfMemoryError as e:
        emit({"held_gib": len(held), "error": "OutOfMemoryError", "message": str(e)[:300]})
    except RuntimeError as e:
        emit({"held_gib": len(held), "error": "RuntimeError", "message": str(e)[:300]})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--persist-gib", type=int, default=8)
    ap.add_argument("--ephemeral-gib", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sleep-ms", type=float, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="job")
    ap.add_argument("--seconds", type=float, default=0, help="run for this long instead of --iters")
    ap.add_argument("--probe-ceiling", action="store_true")
    ap.add_argument("--no-wait", action="store_true", help="start at once (no stdin barrier)")
    a = ap.parse_args()
    if a.probe_ceiling:
        return probe_ceiling()
    try:
        g = torch.Generator(device="cuda").manual_seed(a.seed)
        weights, sums = [], []
        for _ in range(a.persist_gib):
            w = torch.randint(0, 4, (N,), device="cuda", generator=g).float()
            weights.append(w)
            sums.append(exact_sum(w))
        ok = True

        def iteration(it):
            nonlocal ok
            acts = []
            for i in range(a.ephemeral_gib):
                c = float(1 + (it + i) % 3)
                x = torch.mul(weights[i % len(weights)], c)
                acts.append(x)
            for i, x in enumerate(acts):
                c = float(1 + (it + i) % 3)
                if exact_sum(x) != c * sums[i % len(weights)]:
                    ok = False
            del acts

        iteration(0)
        torch.cuda.synchronize()
        emit({"ready": True})
        if not a.no_wait:
            start_at = float(json.loads(sys.stdin.readline())["start_at"])
            while time.time() < start_at:
                time.sleep(0.0005)
        t0 = time.time()
        busy = 0.0
        it = 0
        while (time.time() - t0 < a.seconds) if a.seconds > 0 else (it < a.iters):
            it += 1
            s = time.time()
            iteration(it)
            busy += time.time() - s
            print(f"iteration {it} done at {time.time():.3f}", file=sys.stderr, flush=True)
            time.sleep(a.sleep_ms / 1000)
        t1 = time.time()
        # The weights must have survived every migration.
        for w, s in zip(weights, sums):
            if exact_sum(w) != s:
                ok = False
        emit({"label": a.label, "iters": it, "t0": t0, "t1": t1, "busy_s": busy,
              "correct": ok, "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB})
    except torch.OutOfMemoryError as e:
        emit({"label": a.label, "error": "OutOfMemoryError", "message": str(e)[:300]})
        sys.exit(3)


if __name__ == "__main__":
    main()
