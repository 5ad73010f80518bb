#!/usr/bin/env bash
# The demo workloads on a kind cluster (needs Docker, kind and kubectl), with
# KubeShare deployed from manifests/ as on a real cluster: the second
# kube-scheduler with the extender sidecar, the webhook behind its Service, and
# the node daemon DaemonSet, here in fake mode (4 simulated GPUs per worker).
# The deployment itself is hack/deploy.sh, shared with the test rig's real node.
#
# Usage: hack/kind-demo.sh [up|down]
#   up (default)  create the cluster (kind-config.yaml) if needed, build and load
#                 the images, deploy, run examples/, print `kubectl sharedgpu`
#   down          delete the kind cluster
# Env: KIND_CLUSTER (default kubeshare, as in kind-config.yaml),
#      KUBESHARE_TAG (image tag, default dev), KUBESHARE_KIND_TIMEOUT (default 300 s)
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
CLUSTER="${KIND_CLUSTER:-kubeshare}"
TAG="${KUBESHARE_TAG:-dev}"
TIMEOUT="${KUBESHARE_KIND_TIMEOUT:-300}"
DEMO_NS=kubeshare-demo
CTX="kind-$CLUSTER"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { echo "kind-demo: error: $*" >&2; exit 1; }
k() { kubectl --context "$CTX" "$@"; }

for t in docker kind kubectl jq cargo; do
  command -v "$t" >/dev/null || die "$t is required"
done

case "${1:-up}" in
  down)
    kind delete cluster --name "$CLUSTER"
    exit 0 ;;
  up) ;;
  *) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# ------------------------------------------------------------------ cluster
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  say "kind cluster $CLUSTER exists; reusing it"
else
  say "Creating kind cluster $CLUSTER (kind-config.yaml)"
  kind create cluster --name "$CLUSTER" --config "$REPO/kind-config.yaml"
fi

# ------------------------------------------------------------------ images
say "Building images (Dockerfile targets extender, webhook, node-daemon) with tag $TAG"
for target in extender webhook node-daemon; do
  DOCKER_BUILDKIT=1 docker build --target "$target" -t "kubeshare/kubeshare-$target:$TAG" "$REPO"
  kind load docker-image --name "$CLUSTER" "kubeshare/kubeshare-$target:$TAG"
done

# ------------------------------------------------------------------ deploy
# The same script, manifests and fake inventories as the test rig's real node
# (hack/with-cluster.sh --node): 4 simulated GPUs per worker.
say "Deploying KubeShare with its Helm chart (hack/deploy.sh)"
KUBECTL="kubectl --context $CTX" HELM_KUBE_ARGS="--kube-context $CTX" KUBESHARE_DEPLOY_TIMEOUT="$TIMEOUT" \
  "$HACK/deploy.sh" --tag "$TAG" --gpus 4

# ------------------------------------------------------------------ workloads
say "Workloads (examples/)"
k apply -f "$REPO/examples/00-namespace.yaml"
deadline=$(( $(date +%s) + 60 ))
until k -n "$DEMO_NS" get serviceaccount default >/dev/null 2>&1; do
  (( $(date +%s) < deadline )) || die "no default ServiceAccount in $DEMO_NS"
  sleep 1
done
k apply -f "$REPO/examples/"
say "Waiting for the pods to run (wants-b200 stays Pending: no B200 here)"
deadline=$(( $(date +%s) + TIMEOUT ))
until k -n "$DEMO_NS" get pods -o json | jq -e '
    ([.items[] | select(.metadata.name != "wants-b200" and .status.phase == "Running")] | length) == 14' >/dev/null; do
  if (( $(date +%s) >= deadline )); then
    k -n "$DEMO_NS" get pods -o wide >&2
    die "the workloads did not start in ${TIMEOUT}s"
  fi
  sleep 2
done
k -n "$DEMO_NS" get pods -o wide

say "A pod with a bad label is refused:"
if k apply -f "$REPO/examples/refused/bad-label.yaml"; then
  die "the webhook did not refuse examples/refused/bad-label.yaml"
fi

say "kubectl sharedgpu"
(cd "$REPO" && cargo build --release -q -p kubectl-sharedgpu)
"$REPO/target/release/kubectl-sharedgpu" --context "$CTX"
echo
echo "Delete the cluster with: hack/kind-demo.sh down"
