#!/usr/bin/env bash
# Scheduling GPU shares claimed through DRA at scale, beside the extender path, on one
# fresh local control plane (hack/bench-scale.sh's rig: 1,000 kwok nodes x 8 simulated
# GPUs, both kube-schedulers at the same raised client limits). Each node's
# ResourceSlice is the one the node daemon builds (node-daemon/src/dra/slice.rs),
# published by the bench since kwok runs no daemon. Per round, streamed by 8 clients:
#   a2:   plain pods, default-scheduler (the control);
#   b:    GPU pods at 0.25 through the KubeShare extender (labels);
#   dra:  pods each with a claim from a ResourceClaimTemplate (compute 300, memory 4Gi
#         of one GPU of the DeviceClass gpu.kubeshare.io), allocated by the stock
#         default-scheduler through consumable capacity; kube-controller-manager makes
#         the claims;
#   drac: dra with each claim created by the bench just before its pod.
# Prints one JSON line per run and a summary table; fails if a dra run's claims break
# the books (a device's allocated compute above 1000, a bound pod whose claim is not
# allocated on its node). Appends the machine's load before and after to OUT.
#
# Usage: hack/bench-dra.sh [ROUNDS] [-- scale-bench args...]
#   e.g. hack/bench-dra.sh 1 -- --pods 1000 --configs a2,dra
# Env:   OUT (default target/bench-dra/results.jsonl); the rest as hack/bench-scale.sh.
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HACK/.."
ROUNDS="${1:-1}"
shift || true
[[ "${1:-}" != "--" ]] || shift
export OUT="${OUT:-target/bench-dra/results.jsonl}"
mkdir -p "$(dirname "$OUT")"
export K8S_VERSION="${K8S_VERSION:-v1.37.2}"

load() { printf '{"%s": {"loadavg": "%s", "cores": %s, "at": "%s"}}\n' \
  "$1" "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)" "$(date -u +%FT%TZ)" >>"$OUT"; }
load machine_before
# The defaults, unless given (a repeated list flag would add to them, not replace them).
defaults=()
[[ " $* " == *" --configs "* ]] || defaults+=(--configs a2,b,dra,drac)
[[ " $* " == *" --modes "* ]] || defaults+=(--modes stream)
hack/bench-scale.sh "$ROUNDS" -- "${defaults[@]}" "$@"
load machine_after
echo "bench-dra: results in $OUT" >&2
