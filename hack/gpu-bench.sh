#!/usr/bin/env bash
# GPU benchmark of libgemhook + gem-schd: overhead, accuracy, elasticity, memory cap,
# coverage, on one NVIDIA GPU with PyTorch. Prints one JSON table; raw results, a log and a
# plot of the shares over time go to the output folder.
#
#   hack/gpu-bench.sh [--artifacts DIR] [--out DIR] [--pacing | --overhead | --share [SCENARIO ...]
#                     | --mix [SCENARIO ...]]
#
# --pacing runs hack/gpu/pacing.py instead: per-second shares of a capped tenant alone with
# gem-schd's --pace-ms on and off, elasticity and accuracy 0.3/0.7.
# --overhead runs hack/gpu/overhead.py: the small-kernel overhead over many A/B pairs.
# --share runs hack/gpu/share.py: the shares table (shares as GPU time, the training and
# inference pair, reload, two processes, kill -9), or the scenarios named after it.
# --mix runs hack/gpu/mix.py: mixes of different workloads (capped beside elastic, four at
# 0.1-0.4, with and without co-running), each tenant's GPU time read from the GPU's clock;
# with MIX_CUPTI naming a CUPTI 13.2 or later (a folder with include/ and lib/, such as
# nvidia/cu13 from the nvidia-cuda-cupti wheel), from each context's own time slices;
# with MIX_READING=rates, steps and latencies only (nothing traced).
#
# DIR (default .device-carry/gemhook) holds libgemhook.so.1 and gem-schd; when missing they are built
# here (`make hook-release`, which needs cargo). Current figures: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

art=.device-carry/gemhook
out=${OUT:-gpu-bench-out}
pacing=0
overhead=0
share=0
mix=0
scenarios=()
while [ $# -gt 0 ]; do
  case "$1" in
    --artifacts) art=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --pacing) pacing=1; shift ;;
    --overhead) overhead=1; shift ;;
    --share) share=1; shift; scenarios=("$@"); break ;;
    --mix) mix=1; shift; scenarios=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
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
if [ "$overhead" = 1 ]; then
  exec timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/overhead.py "$art" "$out"
fi
if [ "$share" = 1 ]; then
  exec timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/share.py "$art" "$out" "${scenarios[@]}"
fi
if [ "$mix" = 1 ]; then
  if [ -n "${MIX_CUPTI:-}" ]; then
    cupti=$(realpath "$MIX_CUPTI")
    if [ "${MIX_READING:-}" != rates ]; then
      # CUPTI 13.2+ (include/, lib/libcupti.so.13): each tenant's GPU time from its own time
      # slices (hack/gpu/gputrace.cu) instead of torch.profiler's records.
      lib=$(mktemp -d)/libgputrace.so
      nvcc -O2 -shared -Xcompiler -fPIC -I "$cupti/include" -o "$lib" hack/gpu/gputrace.cu \
        -L "$cupti/lib" -l:libcupti.so.13 -Xlinker -rpath="$cupti/lib"
      export MIX_GPUTRACE=$lib
    fi
    if [ "${MIX_ENGINE:-0}" = 1 ]; then
      # With MIX_ENGINE=1 the hook reads its tenant's engine time from the same CUPTI
      # (docs/hook.md); with MIX_READING=rates nothing is traced, so the records go into the
      # hook's own buffers (KUBESHARE_HOOK_CUPTI_BUFFER_KB), as in a pod without a profiler.
      # With the hook's forced flushes (its default) it costs more than it gains; unforced
      # (KUBESHARE_HOOK_CUPTI_FLUSH_FORCED=0) with small buffers it moves GPU time from an
      # elastic neighbour to the capped tenant (docs/benchmarks.md, "Engine time").
      # Each of its flushes also retires gputrace's buffer: small ones (GPUTRACE_BUFFER_KB)
      # keep that cheap.
      export KUBESHARE_HOOK_CUPTI=$cupti/lib/libcupti.so.13
      export GPUTRACE_BUFFER_KB=${GPUTRACE_BUFFER_KB:-256}
    fi
  fi
  exec timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/mix.py "$art" "$out" "${scenarios[@]}"
fi
if [ "$pacing" = 1 ]; then
  exec timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/pacing.py "$art" "$out"
fi
timeout "${BENCH_TIMEOUT:-560}" python3 hack/gpu/bench.py --hook "$art/libgemhook.so.1" --schd "$art/gem-schd" --out "$out"
