#!/usr/bin/env bash
# Robustness checks on a real GPU: what hook/tests/robustness.rs checks through the
# fake driver, with the real one. Memory a context or a mapping still holds (VMM create → map →
# release → create; allocations of a destroyed, reset or released context), each through both
# lookup paths, with the hook and without it (the control shows the driver's own accounting);
# and fork beside a running CUDA program (PyTorch, like a DataLoader's workers). One JSON object
# per step on stdout.
#   hack/gpu/robustness.sh ARTIFACT_DIR     (libgemhook.so.1, gem-schd, cuda-workload)
set -uo pipefail
art=$(cd "$1" && pwd); here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d); schd=; trap 'kill "$schd" 2>/dev/null; rm -rf "$work"' EXIT
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
gib=$((1 << 30)); bytes=$((600 << 20))
# Limit 0.5: the fork check's launching thread often waits for the token when it forks.
printf '1\na 0.5 0.5 %d\n' "$gib" >"$work/config"
"$art/gem-schd" --gpu "$uuid" --config "$work/config" --socket-template "$work/{client}/{gpu}.sock" 2>"$work/schd.log" &
schd=$!
for _ in $(seq 50); do [ -S "$work/a/$uuid.sock" ] && break; sleep 0.1; done
hooked() { LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/a" "$@"; }
tag() { python3 -c 'import json,sys
for l in sys.stdin:
    l=l.strip()
    if l.startswith("{"):
        v=json.loads(l); v.update(json.loads(sys.argv[1])); print(json.dumps(v))' "$1"; }
for lookup in symbol proc; do
  hooked "$art/cuda-workload" --lookup $lookup vmm --bytes $bytes | tag "{\"check\":\"vmm\",\"hook\":true,\"lookup\":\"$lookup\"}"
  "$art/cuda-workload" --lookup $lookup vmm --bytes $bytes | tag "{\"check\":\"vmm\",\"hook\":false,\"lookup\":\"$lookup\"}"
  for how in destroy reset release; do
    hooked "$art/cuda-workload" --lookup $lookup ctx-end --bytes $bytes --how $how |
      tag "{\"check\":\"ctx-end\",\"how\":\"$how\",\"hook\":true,\"lookup\":\"$lookup\"}"
  done
done
hooked timeout 120 python3 "$here/fork_check.py" | tag '{"check":"fork","hook":true}'
timeout 120 python3 "$here/fork_check.py" | tag '{"check":"fork","hook":false}'
