#!/usr/bin/env bash
# Unified-memory mode on a real GPU: runs hack/gpu/um-bench.py with the release hook
# and gem-schd, results in OUT (default um-bench-out). docs/benchmarks.md, "Unified-memory mode".
#
#   hack/gpu/um-bench.sh [ARTIFACT_DIR] [extra um-bench.py arguments]
#
# ARTIFACT_DIR (default .device-carry/um) holds libgemhook.so.1 and gem-schd
# (`cargo build --release -p gemhook -p gem-schd`); the Python scripts are taken from beside
# this script.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
art=${1:-.device-carry/um}
shift || true
out=${OUT:-um-bench-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
exec timeout "${BENCH_TIMEOUT:-560}" python3 "$here/um-bench.py" --hook "$art/libgemhook.so.1" --schd "$art/gem-schd" --out "$out" "$@"
