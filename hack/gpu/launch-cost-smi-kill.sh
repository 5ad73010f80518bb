#!/usr/bin/env bash
# Quick GPU checks, from a folder holding the release artifacts (libgemhook.so.1,
# gem-schd, libfake_cuda.so, cuda-workload) and hack/gpu's scripts under gpu/:
# the per-launch cost over the fake driver and on the GPU (in-process A/B), nvidia-smi in a
# capped process, and kill -9 of a holder. Results go to $OUT (default ./out).
#   hack/gpu/launch-cost-smi-kill.sh ARTIFACT_DIR
set -uo pipefail
art=$(cd "$1" && pwd); out=${OUT:-$PWD/out}; mkdir -p "$out"; cd "$art"
work=$(mktemp -d); pids=(); trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"

echo "== per-launch cost over the fake driver (no-op launches), pinned to one core"
F=GPU-0123abcd-4567-89ef-0123-456789abcdef
mkdir -p "$work/fk/lib" && ln -sf "$art/libfake_cuda.so" "$work/fk/lib/libcuda.so.1"
printf '1\na 1.0 1.0 1000000000\n' >"$work/fk/rc.txt"
./gem-schd --gpu $F --config "$work/fk/rc.txt" --socket-template "$work/fk/pods/{client}/{gpu}.sock" 2>"$work/fk/schd.log" &
pids+=($!); sleep 0.5
for lookup in symbol proc; do
  FAKE_CUDA_NOOP_LAUNCH=1 FAKE_CUDA_DEVICES=$F LD_LIBRARY_PATH="$work/fk/lib" LD_PRELOAD="$art/libgemhook.so.1" \
    KUBESHARE_SOCKET_DIR="$work/fk/pods/a" KUBESHARE_HOOK_LOG=off taskset -c 2 \
    ./cuda-workload --lookup $lookup launch-bench --rounds 400 --launches 20000 | tee -a "$out/fake-launch-bench.jsonl"
done
# Control: the same without the hook (both paths are the fake's: added ≈ 0).
FAKE_CUDA_NOOP_LAUNCH=1 FAKE_CUDA_DEVICES=$F LD_LIBRARY_PATH="$work/fk/lib" taskset -c 2 \
  ./cuda-workload --lookup symbol launch-bench --rounds 400 --launches 20000 | tee -a "$out/fake-launch-bench-control.jsonl"

echo "== per-launch cost on the GPU (in-process A/B, empty kernels)"
nvcc -O2 -o launch_ab gpu/launch_ab.cu -lcuda && nvcc -O2 -o launch_bench gpu/launch_bench.cu || exit 1
U=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
printf '1\nsolo 1.0 1.0 4294967296\n' >"$work/rc.txt"
./gem-schd --gpu "$U" --config "$work/rc.txt" --socket-template "$work/pods/{client}/{gpu}.sock" 2>"$work/schd.log" &
pids+=($!); sleep 0.5
LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/pods/solo" taskset -c 3 ./launch_ab 1000 1000 | tee "$out/gpu-launch-ab.json"
taskset -c 3 ./launch_ab 300 1000 | tee "$out/gpu-launch-ab-control.json"

echo "== nvidia-smi in a process capped at 4 GiB"
LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/pods/solo" \
  nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv | tee "$out/nvidia-smi-capped.csv"
nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv | tee "$out/nvidia-smi-plain.csv"
LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/pods/solo" nvidia-smi | head -14 | tee "$out/nvidia-smi-capped.txt"
ldd "$(command -v nvidia-smi)" | tee "$out/nvidia-smi-ldd.txt"

echo "== kill -9 of a holder"
timeout 120 python3 gpu/share.py "$art" "$out" kill
