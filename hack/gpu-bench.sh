#!/usr/bin/env bash
# GPU benchmark of libgemhook + gem-schd (issue 7): overhead, accuracy, elasticity, memory cap,
# coverage, on one NVIDIA GPU with PyTorch. Prints one JSON table; raw results, a log and a
# plot of the shares over time go to the output folder.
#
#   hack/gpu-bench.sh [--artifacts DIR] [--out DIR]
#
# DIR (default .device-carry/gemhook) holds libgemhook.so.1 and gem-schd; when missing they are built
# here (`make hook-release`, which needs cargo). Results are described in docs/gpu-benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

art=.device-carry/gemhook
out=${OUT:-gpu-bench-out}
while [ $# -gt 0 ]; do
  case "$1" in
    --artifacts) art=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ ! -f "$art/libgemhook.so.1" ] || [ ! -x "$art/gem-schd" ]; then
  make hook-release
  art=.device-carry/gemhook
fi
mkdir -p "$out"

nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/bench.py --hook "$art/libgemhook.so.1" --schd "$art/gem-schd" --out "$out"
