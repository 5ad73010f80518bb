#!/usr/bin/env bash
# Run a command against a fresh local control plane, then always stop it.
#
# Usage: hack/with-cluster.sh [--node] COMMAND [ARGS...]
#   Builds (or reuses) the binaries, runs `hack/cluster.sh up` in a new run dir,
#   exports KUBESHARE_TEST_CLUSTER (and the rest of cluster.env) to COMMAND,
#   brings the cluster down on exit (success, failure, Ctrl-C; and, through the
#   --owner-pid watchdog, even if this script is killed) and exits with
#   COMMAND's status. The run dir is removed on success, kept (logs) on failure.
#   --node: also a real node (hack/node.sh: containerd, kubelet, kube-proxy; needs
#   root and the images of hack/images.sh build) with KubeShare deployed on it
#   from manifests/ (hack/deploy.sh) instead of the local kubeshare-scheduler;
#   exports KUBESHARE_NODE_DIR (RUN/node, with node.env). `down` checks that the
#   host is as before the node and fails the run if not.
# Env: KUBESHARE_WITH_CLUSTER_ROOT (default <repo>/target/kubeshare-make-test);
#      the run dir is ROOT/<pid>, so concurrent runs do not touch each other.
#      KUBESHARE_IMAGES_PROFILE (--node: the cargo profile whose libfake_cuda.so the node
#      daemon loads as NVML, as hack/images.sh; default release).
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
NODE_MODE=0
if [[ "${1:-}" == --node ]]; then NODE_MODE=1; shift; fi
[[ $# -gt 0 ]] || { sed -n '2,17p' "$0" >&2; exit 2; }

ROOT="${KUBESHARE_WITH_CLUSTER_ROOT:-$REPO/target/kubeshare-make-test}"
RUN="$ROOT/$$"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if (( NODE_MODE )); then
    "$HACK/node.sh" down "$RUN" || { [[ $rc != 0 ]] || rc=1; }
  fi
  "$HACK/cluster.sh" down "$RUN" || true
  if [[ $rc == 0 ]]; then
    rm -rf "$RUN"
  else
    echo "with-cluster: exit status $rc; cluster logs kept in $RUN/logs" >&2
    if (( NODE_MODE )); then
      echo "with-cluster: the node's logs in $RUN/node/logs, its pods' in $RUN/node/pod-logs" >&2
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$ROOT"
if (( NODE_MODE )); then
  # The node's namespace reaches the apiserver through its veth; KubeShare's own
  # scheduler runs on the node, installed with the Helm chart.
  export KUBESHARE_APISERVER_BIND=0.0.0.0 KUBESHARE_LOCAL_SCHEDULER=0
fi
if ! "$HACK/cluster.sh" up "$RUN" --owner-pid $$ >/dev/null 2>"$ROOT/$$.up.log"; then
  cat "$ROOT/$$.up.log" >&2
  exit 1
fi
rm -f "$ROOT/$$.up.log"
# shellcheck disable=SC1091
. "$RUN/cluster.env"
echo "with-cluster: cluster up in $RUN" >&2
if (( NODE_MODE )); then
  "$HACK/node.sh" up "$RUN" --owner-pid $$
  # The fake driver, as the node daemon's NVML: it lists the test pods' processes on their
  # simulated GPUs (RUN/node/test is /var/lib/kubeshare-test on the node).
  fake_nvml="${CARGO_TARGET_DIR:-$REPO/target}/${KUBESHARE_IMAGES_PROFILE:-release}/libfake_cuda.so"
  [[ -f "$fake_nvml" ]] || { echo "with-cluster: missing $fake_nvml (build fake-libcuda)" >&2; exit 1; }
  install -D -m 0755 "$fake_nvml" "$RUN/node/test/lib/libnvidia-ml.so.1"
  # A node with CDI (node.env names its containerd) gets its GPUs through CDI.
  cdi=()
  if grep -q '^CTRD_BIN=' "$RUN/node/node.env"; then
    cdi=(--cdi-spec-dir "$RUN/node/cdi" --cdi-dev-dir "$RUN/node/cdi-dev")
  fi
  KUBECTL="$KUBESHARE_K8S_BIN/kubectl --kubeconfig $RUN/kubeconfig/admin.kubeconfig" \
    HELM_KUBE_ARGS="--kubeconfig $RUN/kubeconfig/admin.kubeconfig" "$HACK/deploy.sh" --gpus 2 \
    --fake-gpu-dir /var/lib/kubeshare-test "${cdi[@]}"
  export KUBESHARE_NODE_DIR="$RUN/node"
  echo "with-cluster: node up, KubeShare deployed" >&2
fi

set +e
"$@"
rc=$?
set -e
exit "$rc"
