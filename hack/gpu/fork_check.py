"""Fork beside a running CUDA program, as a DataLoader's workers do (hack/gpu/robustness.sh).

A thread keeps launching matmuls (under the hook it often waits for the token, holding the
hook's token lock, when the main thread forks); the main thread forks four children one after
another, each does CPU work and exits (the real driver does not let a child use CUDA its parent
initialised). Prints one JSON line: each child's exit status (or "hung" past 10 s), how many
bursts the parent launched after the forks, and a DataLoader with four workers run alongside.
"""

import json
import os
import threading
import time

import torch

x = torch.randn(4096, 4096, device="cuda")
stop = threading.Event()
bursts = [0]


def launch():
    while not stop.is_set():
        for _ in range(8):
            x @ x
        torch.cuda.synchronize()
        bursts[0] += 1


def wait(pid, seconds=10.0):
    t0 = time.time()
    while time.time() - t0 < seconds:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


t = threading.Thread(target=launch)
t.start()
time.sleep(1.0)
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        sum(i * i for i in range(200_000))
        os._exit(0)
    children.append(wait(pid))
before = bursts[0]
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.arange(4096.0).reshape(-1, 4)), batch_size=64, num_workers=4
)
seen = 0
for (batch,) in loader:
    seen += int(batch.shape[0])
    (batch.to("cuda") * 2).sum().item()
time.sleep(1.0)
after = bursts[0]
stop.set()
t.join()
print(json.dumps({"children": children, "launched_after_forks": after - before,
                  "dataloader_rows": seen}))
