"""GPU work for hack/gpu-node.sh's scenarios (kubeshare-gpu-scenarios), run inside pods
with the host's PyTorch (/opt/torch, mounted read-only). Prints one JSON line per result.

  share --seconds S [--barrier FILE] [--size N]   matmuls for S seconds, then their GPU time
  mem --chunk-mib M                               the memory the pod sees, then allocate to OOM
  probe                                           CUDA visible or not (pods without a share)

GPU time: CUDA events between consecutive matmuls give each one's time on the GPU, plus
any idle gap before it when the hook held its launch back (the GPU drained the queue
meanwhile). Launches the hook did not hold (host-side launch under 0.5 ms) give the
kernel's own time; the median of those times the number of matmuls is the GPU time used
(busy_ms). sum_event_ms, the raw sum, counts the gaps too: an upper bound.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def emit(**kv):
    print(json.dumps(kv), flush=True)


def nvidia_devs():
    return sorted(d for d in os.listdir("/dev") if d.startswith("nvidia"))


def share(args):
    import torch

    dev = torch.device("cuda")
    n = args.size
    a = torch.randn(n, n, device=dev, dtype=torch.float16)
    b = torch.randn(n, n, device=dev, dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    emit(phase="ready", device=torch.cuda.get_device_name(0), size=n, dev_nvidia=nvidia_devs())
    if args.barrier:
        while not os.path.exists(args.barrier):
            time.sleep(0.02)
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    launch_s = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        h = time.perf_counter()
        a @ b
        launch_s.append(time.perf_counter() - h)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
        # Keep the queue short (16 matmuls): the host's view of time stays close to the GPU's.
        if len(events) > 16:
            events[-16].synchronize()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times = [events[i].elapsed_time(events[i + 1]) for i in range(len(events) - 1)]
    free = sorted(t for t, l in zip(times, launch_s) if l < 0.0005) or sorted(times)
    median = free[len(free) // 2]
    emit(
        phase="done",
        kernels=len(times),
        wall_s=round(wall, 3),
        kernel_ms_median=round(median, 4),
        kernel_ms_p10=round(free[len(free) // 10], 4),
        busy_ms=round(median * len(times), 1),
        sum_event_ms=round(sum(times), 1),
        held_launches=sum(1 for l in launch_s if l >= 0.0005),
    )


def nvidia_smi():
    for exe in ("nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi", "/usr/bin/nvidia-smi"):
        try:
            out = subprocess.run(
                [exe, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        return {"rc": out.returncode, "out": out.stdout.strip(), "err": out.stderr.strip()[-300:]}
    return {"rc": None, "out": "", "err": "no nvidia-smi found"}


def mem(args):
    import torch

    free, total = torch.cuda.mem_get_info()
    emit(phase="meminfo", free=free, total=total, nvidia_smi=nvidia_smi())
    chunk = args.chunk_mib << 20
    held = []
    try:
        while len(held) < 100000:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        emit(phase="oom", allocated=len(held) * chunk, chunks=len(held), error=str(e).splitlines()[0][:200])
        return
    emit(phase="no-oom", allocated=len(held) * chunk)


def probe(_args):
    info = {"phase": "probe", "dev_nvidia": nvidia_devs(),
            "nvidia_visible_devices": os.environ.get("NVIDIA_VISIBLE_DEVICES")}
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
    except Exception as e:  # noqa: BLE001 - any failure means no GPU here
        info["cuda_error"] = str(e)[:200]
    emit(**info)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("share")
    s.add_argument("--seconds", type=float, default=20)
    s.add_argument("--barrier")
    s.add_argument("--size", type=int, default=8192)
    m = sub.add_parser("mem")
    m.add_argument("--chunk-mib", type=int, default=256)
    sub.add_parser("probe")
    args = p.parse_args()
    {"share": share, "mem": mem, "probe": probe}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
