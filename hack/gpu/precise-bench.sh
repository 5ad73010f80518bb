#!/usr/bin/env bash
# The launch gate's cost in the last coarse tick of a hold, where it also reads
# the precise clock. Over the fake driver (no-op launches), one client alone, pinned to one core:
# with 50 ms grants (the coarse clock alone for all but the last tick) and with 3 ms grants
# (shorter than a 4 ms tick: every launch reads the precise clock), each with the precise
# deadline on and off (KUBESHARE_HOOK_PRECISE_DEADLINE). Results: $OUT/precise-bench.jsonl.
#   hack/gpu/precise-bench.sh ARTIFACT_DIR
set -uo pipefail
art=$(cd "$1" && pwd); out=${OUT:-$PWD/out}; mkdir -p "$out"; cd "$art"
work=$(mktemp -d); pid=; trap 'kill $pid 2>/dev/null; rm -rf "$work"' EXIT
F=GPU-0123abcd-4567-89ef-0123-456789abcdef
mkdir -p "$work/lib" && ln -sf "$art/libfake_cuda.so" "$work/lib/libcuda.so.1"
printf '1\na 1.0 1.0 1000000000\n' >"$work/rc.txt"
python3 -c 'import time; print("clock resolution (coarse, precise):", time.clock_getres(6), time.clock_getres(time.CLOCK_MONOTONIC))' | tee "$out/clock-res.txt"
for q in 50 3; do
  ./gem-schd --gpu $F --config "$work/rc.txt" --socket-template "$work/pods/{client}/{gpu}.sock" \
    --base-quota-ms $q --min-quota-ms $q --quiet-ms 0 2>"$work/schd.log" &
  pid=$!; sleep 0.5
  for precise in 1 0 1 0; do
    printf '{"quota_ms": %s, "precise": %s, "result": ' $q $precise >>"$out/precise-bench.jsonl"
    FAKE_CUDA_NOOP_LAUNCH=1 FAKE_CUDA_DEVICES=$F LD_LIBRARY_PATH="$work/lib" LD_PRELOAD="$art/libgemhook.so.1" \
      KUBESHARE_SOCKET_DIR="$work/pods/a" KUBESHARE_HOOK_LOG=off KUBESHARE_HOOK_PRECISE_DEADLINE=$precise taskset -c ${CPU:-2} \
      ./cuda-workload --lookup symbol launch-bench --rounds 200 --launches 20000 | tr -d '\n' >>"$out/precise-bench.jsonl"
    echo '}' >>"$out/precise-bench.jsonl"
  done
  kill $pid; wait $pid 2>/dev/null; pid=
done
FAKE_CUDA_NOOP_LAUNCH=1 FAKE_CUDA_DEVICES=$F LD_LIBRARY_PATH="$work/lib" taskset -c ${CPU:-2} \
  ./cuda-workload --lookup symbol launch-bench --rounds 200 --launches 20000 | tee "$out/precise-bench-control.json"
cat "$out/precise-bench.jsonl"
