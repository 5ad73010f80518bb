#!/usr/bin/env bash
# Scheduling at scale, side by side (current figures in docs/benchmarks.md):
# a fresh local control plane whose two kube-schedulers have the same raised
# client limits, 1,000 kwok nodes x 8 simulated GPUs, and in each of ROUNDS repetitions 2,000 pods
# for each configuration (a2: default profile, plain pods; b: KubeShare profile,
# GPU pods at 0.25; c: KubeShare profile, plain pods), streamed by 8 clients and
# as a backlog. Prints one JSON line per run and a summary table; fails if a
# run's records break the books (a GPU above 1.0, a bound pod without a record).
#
# Usage: hack/bench-scale.sh [ROUNDS] [-- scale-bench args...]
# Env:   OUT (default target/bench-scale/results.jsonl), QPS (default 1000),
#        MANAGED (1, default: the extender sees only GPU pods, as manifests/
#        configure it; 0: every pod of the kubeshare profile), FILTER_TOP (1,
#        default, as the chart sets it: filter passes only its best node; 0: all),
#        HTTPS (0, default: kube-scheduler calls the extender over plain HTTP/1.1;
#        1: over TLS, hence HTTP/2, with the rig's 127.0.0.1 certificate),
#        KUBESHARE_SCHED_PCT (unset: kube-scheduler's adaptive default, as the
#        chart leaves it; N: the kubeshare profile's percentageOfNodesToScore)
#        GRACE (unset: the node lifecycle controller's default grace before a node
#        with a stale lease is tainted; e.g. 5m, to rule out lease lapses of kwok's
#        nodes on the saturated cores: measured, it changed nothing)
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HACK/.."
ROUNDS="${1:-2}"
shift || true
[[ "${1:-}" != "--" ]] || shift
OUT="${OUT:-target/bench-scale/results.jsonl}"
mkdir -p "$(dirname "$OUT")"

cargo build --release --locked -p kubeshare-scheduler --bin kubeshare-extender \
  -p kubeshare-bench --bin scale-bench
hack/build-k8s.sh >/dev/null

extra=()
[[ "${MANAGED:-1}" == 1 ]] || extra=(--unmarked)
# The serving certificate exists once the cluster is up, hence the inner shell.
KUBESHARE_EXTENDER_FILTER_TOP="${FILTER_TOP:-1}" KUBESHARE_EXTENDER_HTTPS="${HTTPS:-0}" \
  KUBESHARE_SCHED_QPS="${QPS:-1000}" KUBESHARE_SCHED_BURST="${QPS:-1000}" \
  KUBESHARE_MANAGED_RESOURCES="${MANAGED:-1}" \
  KUBESHARE_NODE_MONITOR_GRACE_PERIOD="${GRACE:-}" \
  hack/with-cluster.sh bash -c 'if [[ $KUBESHARE_EXTENDER_HTTPS == 1 ]]; then
      export KUBESHARE_EXTENDER_TLS_CERT=$KUBESHARE_TEST_CLUSTER/pki/webhook-serving.crt
      export KUBESHARE_EXTENDER_TLS_KEY=$KUBESHARE_TEST_CLUSTER/pki/webhook-serving.key
    fi
    exec "$@"' scale-bench target/release/scale-bench --rounds "$ROUNDS" --out "$OUT" "${extra[@]}" "$@"
echo "bench-scale: results in $OUT" >&2
