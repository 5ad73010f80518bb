#!/usr/bin/env bash
# The backlog reproduction of the allocation-record issue, as anyone can run it:
# for each run a fresh local control plane (hack/with-cluster.sh), 1,000 kwok
# nodes x 8 simulated GPUs, 2,000 pods at gpu_request = gpu_limit = 0.25 created
# while the kubeshare-scheduler is stopped, then released; half of the runs also
# SIGKILL the extender once mid-way. Each run ends with the check of the API's
# records (no GPU above 1.0, every bound pod with its record); the script fails
# if any run fails it. Results: one JSON line per run in $OUT (current figures: docs/benchmarks.md).
#
# Usage: hack/bench-backlog.sh [RUNS] [-- backlog-bench args...]
#   RUNS   runs of each mode (plain, extender killed), default 3
# Env:     OUT (default target/bench-backlog/results.jsonl)
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HACK/.."
RUNS="${1:-3}"
shift || true
[[ "${1:-}" != "--" ]] || shift
OUT="${OUT:-target/bench-backlog/results.jsonl}"
mkdir -p "$(dirname "$OUT")"

cargo build --release --locked -p kubeshare-scheduler --bin kubeshare-extender \
  -p kubeshare-bench --bin backlog-bench
hack/build-k8s.sh >/dev/null

fail=0
for mode in plain kill; do
  for ((i = 1; i <= RUNS; i++)); do
    extra=()
    [[ $mode == kill ]] && extra=(--kill-extender-at 1000)
    echo "bench-backlog: run $i of $RUNS ($mode)" >&2
    start=$(date +%s)
    if ! hack/with-cluster.sh target/release/backlog-bench --out "$OUT" "${extra[@]}" "$@"; then
      fail=1
    fi
    echo "bench-backlog: run $i ($mode) took $(( $(date +%s) - start )) s" >&2
  done
done
echo "bench-backlog: results in $OUT" >&2
exit "$fail"
