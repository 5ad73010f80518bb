"""How many kernels a batch-1 ResNet-18 request launches, and its time per request alone: what a
per-kernel cost (event_cost.cu) adds to a launch-bound tenant such as batch-1 inference.

    python3 hack/gpu/infer_kernels.py
"""

import time

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

m = torchvision.models.resnet18().cuda().eval()
x = torch.randn(1, 3, 224, 224, device="cuda")
with torch.no_grad():
    for _ in range(30):  # warm-up: cuDNN's choices, the caching allocator
        m(x)
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            m(x)
            torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t, n = time.perf_counter(), 500
    for _ in range(n):
        m(x)
        torch.cuda.synchronize()
    print({"kernels_per_request": len(kernels) / 10, "ms_per_request": 1000 * (time.perf_counter() - t) / n})
