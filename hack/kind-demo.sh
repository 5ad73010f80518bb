#!/usr/bin/env bash
# The demo workloads on a kind cluster (needs Docker, kind and kubectl), with
# KubeShare deployed from manifests/ as on a real cluster: the second
# kube-scheduler with the extender sidecar, the webhook behind its Service, and
# the node daemon DaemonSet, here in fake mode (4 simulated GPUs per worker).
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
NS=kubeshare-system
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

# ------------------------------------------------------------------ webhook TLS
say "Webhook certificate for kubeshare-webhook.$NS.svc"
k apply -f "$REPO/manifests/00-namespace.yaml" -f "$REPO/manifests/rbac.yaml"
if k -n "$NS" get secret kubeshare-webhook-tls >/dev/null 2>&1 \
   && k get mutatingwebhookconfiguration kubeshare-webhook >/dev/null 2>&1; then
  # Keep the CA already registered, so a re-run does not break running pods' admission.
  CA_BUNDLE="$(k get mutatingwebhookconfiguration kubeshare-webhook -o jsonpath='{.webhooks[0].clientConfig.caBundle}')"
else
  CA_BUNDLE="$(docker run --rm --user "$(id -u):$(id -g)" -v "$WORK:/out" \
    "kubeshare/kubeshare-webhook:$TAG" certs --dns "kubeshare-webhook.$NS.svc" --out /out | tail -n 1)"
  [[ -n "$CA_BUNDLE" ]] || die "kubeshare-webhook certs printed no caBundle"
  k -n "$NS" create secret tls kubeshare-webhook-tls --cert "$WORK/tls.crt" --key "$WORK/tls.key" \
    --dry-run=client -o yaml | k apply -f -
fi

# ------------------------------------------------------------------ fake GPUs
# One inventory per worker (the same JSON the node daemon would publish from
# NVML): the first worker gets H100s, the others A100s, 4 each.
say "Fake GPU inventories for the workers"
mapfile -t workers < <(k get nodes -l nvidia.com/gpu.present=true -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
((${#workers[@]})) || die "no node is labelled nvidia.com/gpu.present=true (see kind-config.yaml)"
args=()
for i in "${!workers[@]}"; do
  if (( i == 0 )); then model=NVIDIA-H100-80GB-HBM3; mem=$((80 << 30)); else model=NVIDIA-A100-SXM4-40GB; mem=$((40 << 30)); fi
  jq -n --arg model "$model" --argjson mem "$mem" --argjson n "$i" \
    'def pad4: ("000" + tostring)[-4:];
     {gpus: [range(0; 4) as $j | {uuid: ("GPU-" + ($n|pad4) + ($j|pad4) + "-5ba7-4e1d-9c0f-6b1e2d3c4a50"),
       index: $j, model: $model, memory: $mem}]}' >"$WORK/${workers[$i]}.json"
  args+=(--from-file="${workers[$i]}.json=$WORK/${workers[$i]}.json")
done
k -n "$NS" create configmap kubeshare-fake-inventory "${args[@]}" --dry-run=client -o yaml | k apply -f -

# ------------------------------------------------------------------ deploy
say "Deploying manifests/"
sed "s|CA_BUNDLE|$CA_BUNDLE|g" "$REPO/manifests/webhook.yaml" | k apply -f -
k apply -f "$REPO/manifests/kube-scheduler.yaml" -f "$REPO/manifests/node-daemon.yaml"
# Our freshly loaded images (a non-latest tag, so the kubelet does not pull).
k -n "$NS" set image deployment/kubeshare-webhook "webhook=kubeshare/kubeshare-webhook:$TAG"
k -n "$NS" set image deployment/kubeshare-scheduler "extender=kubeshare/kubeshare-extender:$TAG"
k -n "$NS" set image daemonset/kubeshare-node-daemon "node-daemon=kubeshare/kubeshare-node-daemon:$TAG"
# Fake mode: each daemon reads its node's inventory from the ConfigMap.
if ! k -n "$NS" get daemonset kubeshare-node-daemon -o json \
     | jq -e '.spec.template.spec.containers[0].args | index("--fake-inventory=/etc/kubeshare/fake/$(NODE_NAME).json")' >/dev/null; then
  k -n "$NS" patch daemonset kubeshare-node-daemon --type=json -p '[
    {"op": "add", "path": "/spec/template/spec/volumes/-",
     "value": {"name": "fake-inventory", "configMap": {"name": "kubeshare-fake-inventory"}}},
    {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
     "value": {"name": "fake-inventory", "mountPath": "/etc/kubeshare/fake", "readOnly": true}},
    {"op": "add", "path": "/spec/template/spec/containers/0/args/-",
     "value": "--fake-inventory=/etc/kubeshare/fake/$(NODE_NAME).json"}]'
fi
say "Waiting for KubeShare to roll out (up to ${TIMEOUT}s)"
k -n "$NS" rollout status deployment/kubeshare-webhook --timeout="${TIMEOUT}s"
k -n "$NS" rollout status deployment/kubeshare-scheduler --timeout="${TIMEOUT}s"
k -n "$NS" rollout status daemonset/kubeshare-node-daemon --timeout="${TIMEOUT}s"
for n in "${workers[@]}"; do
  deadline=$(( $(date +%s) + TIMEOUT ))
  until [[ -n "$(k get node "$n" -o jsonpath='{.metadata.annotations.sharedgpu/inventory}')" ]]; do
    (( $(date +%s) < deadline )) || die "node $n has no sharedgpu/inventory annotation (node daemon logs: kubectl -n $NS logs ds/kubeshare-node-daemon)"
    sleep 2
  done
done

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
