#!/usr/bin/env bash
# Deploys KubeShare from manifests/ as a user does, in fake-GPU mode: namespace and
# RBAC, the webhook's certificate and Secret, the webhook (Deployment + Service +
# configurations, caBundle filled in), the second kube-scheduler with the
# extender sidecar, and the node daemon DaemonSet reading a fake inventory per
# node from a ConfigMap. Used by hack/kind-demo.sh (kind) and hack/with-cluster.sh
# --node (the test rig's real node), so both deploy the same manifests the same way.
#
# Usage: hack/deploy.sh [--tag TAG] [--gpus N]
#   --tag TAG  run the KubeShare images with this tag (default: the manifests' latest)
#   --gpus N   simulated GPUs per node (default 4): the first node gets H100s, the others A100s
# Env: KUBECTL (the kubectl command line, default `kubectl`),
#      KUBESHARE_WEBHOOK_BIN (kubeshare-webhook binary that mints the certificate;
#        default target/release or target/debug/kubeshare-webhook, built if missing),
#      KUBESHARE_DEPLOY_TIMEOUT (seconds, default 300).
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
NS=kubeshare-system
TAG=latest
GPUS=4
TIMEOUT="${KUBESHARE_DEPLOY_TIMEOUT:-300}"
read -ra KUBECTL <<<"${KUBECTL:-kubectl}"

log() { echo "deploy: $*" >&2; }
die() { log "error: $*"; exit 1; }
k() { "${KUBECTL[@]}" "$@"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) TAG="${2:?}"; shift 2 ;;
    --gpus) GPUS="${2:?}"; shift 2 ;;
    *) sed -n '2,16p' "$0" >&2; exit 2 ;;
  esac
done
command -v jq >/dev/null || die "jq is required"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# ------------------------------------------------------------------ webhook TLS
log "webhook certificate for kubeshare-webhook.$NS.svc"
k apply -f "$REPO/manifests/00-namespace.yaml" -f "$REPO/manifests/rbac.yaml" >/dev/null
if k -n "$NS" get secret kubeshare-webhook-tls >/dev/null 2>&1 \
   && k get mutatingwebhookconfiguration kubeshare-webhook >/dev/null 2>&1; then
  # Keep the CA already registered, so a re-run does not break running pods' admission.
  CA_BUNDLE="$(k get mutatingwebhookconfiguration kubeshare-webhook -o jsonpath='{.webhooks[0].clientConfig.caBundle}')"
else
  WEBHOOK_BIN="${KUBESHARE_WEBHOOK_BIN:-}"
  if [[ -z "$WEBHOOK_BIN" ]]; then
    for WEBHOOK_BIN in "$REPO/target/release/kubeshare-webhook" "$REPO/target/debug/kubeshare-webhook" ""; do
      [[ -x "$WEBHOOK_BIN" ]] && break
    done
  fi
  if [[ -z "$WEBHOOK_BIN" ]]; then
    (cd "$REPO" && cargo build --locked -q -p kubeshare-webhook)
    WEBHOOK_BIN="$REPO/target/debug/kubeshare-webhook"
  fi
  CA_BUNDLE="$("$WEBHOOK_BIN" certs --dns "kubeshare-webhook.$NS.svc" --out "$WORK" 2>"$WORK/certs.log" | tail -n 1)" \
    || { cat "$WORK/certs.log" >&2; die "kubeshare-webhook certs failed"; }
  [[ -n "$CA_BUNDLE" ]] || die "kubeshare-webhook certs printed no caBundle"
  k -n "$NS" create secret tls kubeshare-webhook-tls --cert "$WORK/tls.crt" --key "$WORK/tls.key" \
    --dry-run=client -o yaml | k apply -f - >/dev/null
fi

# ------------------------------------------------------------------ fake GPUs
# One inventory per GPU node (the JSON the node daemon would publish from NVML).
log "fake GPU inventories ($GPUS per node)"
mapfile -t workers < <(k get nodes -l nvidia.com/gpu.present=true -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
((${#workers[@]})) || die "no node is labelled nvidia.com/gpu.present=true"
args=()
for i in "${!workers[@]}"; do
  if (( i == 0 )); then model=NVIDIA-H100-80GB-HBM3; mem=$((80 << 30)); else model=NVIDIA-A100-SXM4-40GB; mem=$((40 << 30)); fi
  jq -n --arg model "$model" --argjson mem "$mem" --argjson n "$i" --argjson gpus "$GPUS" \
    'def pad4: ("000" + tostring)[-4:];
     {gpus: [range(0; $gpus) as $j | {uuid: ("GPU-" + ($n|pad4) + ($j|pad4) + "-5ba7-4e1d-9c0f-6b1e2d3c4a50"),
       index: $j, model: $model, memory: $mem}]}' >"$WORK/${workers[$i]}.json"
  args+=(--from-file="${workers[$i]}.json=$WORK/${workers[$i]}.json")
done
k -n "$NS" create configmap kubeshare-fake-inventory "${args[@]}" --dry-run=client -o yaml | k apply -f - >/dev/null

# ------------------------------------------------------------------ deploy
log "applying manifests/"
sed "s|CA_BUNDLE|$CA_BUNDLE|g" "$REPO/manifests/webhook.yaml" | k apply -f - >/dev/null
k apply -f "$REPO/manifests/kube-scheduler.yaml" -f "$REPO/manifests/node-daemon.yaml" \
  -f "$REPO/manifests/flowschema.yaml" -f "$REPO/manifests/admission-policy.yaml" >/dev/null
if [[ "$TAG" != latest ]]; then
  k -n "$NS" set image deployment/kubeshare-webhook "webhook=kubeshare/kubeshare-webhook:$TAG" >/dev/null
  k -n "$NS" set image deployment/kubeshare-scheduler "extender=kubeshare/kubeshare-extender:$TAG" >/dev/null
  k -n "$NS" set image daemonset/kubeshare-node-daemon "node-daemon=kubeshare/kubeshare-node-daemon:$TAG" >/dev/null
fi
# Fake mode: each daemon reads its node's inventory from the ConfigMap.
if ! k -n "$NS" get daemonset kubeshare-node-daemon -o json \
     | jq -e '.spec.template.spec.containers[0].args | index("--fake-inventory=/etc/kubeshare/fake/$(NODE_NAME).json")' >/dev/null; then
  k -n "$NS" patch daemonset kubeshare-node-daemon --type=json -p '[
    {"op": "add", "path": "/spec/template/spec/volumes/-",
     "value": {"name": "fake-inventory", "configMap": {"name": "kubeshare-fake-inventory"}}},
    {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
     "value": {"name": "fake-inventory", "mountPath": "/etc/kubeshare/fake", "readOnly": true}},
    {"op": "add", "path": "/spec/template/spec/containers/0/args/-",
     "value": "--fake-inventory=/etc/kubeshare/fake/$(NODE_NAME).json"}]' >/dev/null
fi
log "waiting for KubeShare to roll out (up to ${TIMEOUT}s)"
k -n "$NS" rollout status deployment/kubeshare-webhook --timeout="${TIMEOUT}s" >/dev/null
k -n "$NS" rollout status deployment/kubeshare-scheduler --timeout="${TIMEOUT}s" >/dev/null
k -n "$NS" rollout status daemonset/kubeshare-node-daemon --timeout="${TIMEOUT}s" >/dev/null
for n in "${workers[@]}"; do
  deadline=$(( $(date +%s) + TIMEOUT ))
  until [[ -n "$(k get node "$n" -o jsonpath='{.metadata.annotations.sharedgpu/inventory}')" ]]; do
    (( $(date +%s) < deadline )) || die "node $n has no sharedgpu/inventory annotation (node daemon logs: kubectl -n $NS logs ds/kubeshare-node-daemon)"
    sleep 1
  done
done
log "KubeShare is up"
