#!/usr/bin/env bash
# Deploys KubeShare with its Helm chart (charts/kubeshare) as a user does, in
# fake-GPU mode: `helm upgrade --install` with the chart's self-signed webhook
# certificate, and the node daemon reading a fake inventory per node from a
# ConfigMap made here. Used by hack/kind-demo.sh (kind) and hack/with-cluster.sh
# --node (the test rig's real node), so both deploy the same chart the same way.
# (manifests/ is the same chart rendered; `make test` checks they agree.)
#
# Usage: hack/deploy.sh [--tag TAG] [--gpus N] [--fake-gpu-dir DIR] [--cdi-spec-dir DIR [--cdi-dev-dir DIR]]
#   --tag TAG  run the KubeShare images with this tag (default: the manifests' latest)
#   --gpus N   simulated GPUs per node (default 4): the first node gets H100s, the others A100s
#   --fake-gpu-dir DIR  the nodes' host directory with fake-gpu/ (the pods' shared simulated
#              GPUs) and lib/libnvidia-ml.so.1 (the fake driver): the node daemon lists
#              the pods' GPU processes through it (chart value nodeDaemon.fakeGpuDir)
#   --cdi-spec-dir DIR  GPUs through CDI (chart value cdi.enabled, docs/node.md "CDI"): the
#              node daemon writes its spec into DIR (a spec dir of the node's runtime)
#              and runs the kubeshare.io/gpu device plugin; the webhook asks for it
#   --cdi-dev-dir DIR  with --cdi-spec-dir, on nodes without a driver: make stand-in
#              device nodes in DIR (nvidia0..N-1 and nvidiactl, NVIDIA's major number
#              195) for the spec to name (the host paths must be the nodes' own)
# Env: KUBECTL (the kubectl command line, default `kubectl`),
#      HELM_KUBE_ARGS (helm's flags for the same cluster, e.g. `--kubeconfig F`
#        or `--kube-context C`), HELM (default: built by hack/build-helm.sh),
#      KUBESHARE_DEPLOY_TIMEOUT (seconds, default 300),
#      K8S_VERSION (the rig's Kubernetes version: the kube-scheduler image to run).
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
NS=kubeshare-system
TAG=latest
GPUS=4
FAKE_GPU_DIR=
CDI_SPEC_DIR=
CDI_DEV_DIR=
TIMEOUT="${KUBESHARE_DEPLOY_TIMEOUT:-300}"
read -ra KUBECTL <<<"${KUBECTL:-kubectl}"

log() { echo "deploy: $*" >&2; }
die() { log "error: $*"; exit 1; }
k() { "${KUBECTL[@]}" "$@"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) TAG="${2:?}"; shift 2 ;;
    --gpus) GPUS="${2:?}"; shift 2 ;;
    --fake-gpu-dir) FAKE_GPU_DIR="${2:?}"; shift 2 ;;
    --cdi-spec-dir) CDI_SPEC_DIR="${2:?}"; shift 2 ;;
    --cdi-dev-dir) CDI_DEV_DIR="${2:?}"; shift 2 ;;
    *) sed -n '2,25p' "$0" >&2; exit 2 ;;
  esac
done
command -v jq >/dev/null || die "jq is required"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
HELM="${HELM:-$("$HACK/build-helm.sh" | tail -n 1)}"
read -ra HELM_KUBE <<<"${HELM_KUBE_ARGS:-}"
k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null

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

# ------------------------------------------------------------------ CDI
cdi_args=()
if [[ -n "$CDI_SPEC_DIR" ]]; then
  cdi_args=(--set cdi.enabled=true --set "cdi.specDir=$CDI_SPEC_DIR")
  if [[ -n "$CDI_DEV_DIR" ]]; then
    # The driver's character devices as the spec names them: the runtime copies their
    # type and numbers into the container; nothing opens them (the fake libcuda runs).
    mkdir -p "$CDI_DEV_DIR"
    for ((j = 0; j < GPUS; j++)); do
      [[ -c "$CDI_DEV_DIR/nvidia$j" ]] || mknod "$CDI_DEV_DIR/nvidia$j" c 195 "$j"
    done
    [[ -c "$CDI_DEV_DIR/nvidiactl" ]] || mknod "$CDI_DEV_DIR/nvidiactl" c 195 255
    cdi_args+=(--set "cdi.devDir=$CDI_DEV_DIR")
  fi
  log "CDI: spec in $CDI_SPEC_DIR${CDI_DEV_DIR:+, stand-in devices in $CDI_DEV_DIR}"
fi

# ------------------------------------------------------------------ deploy
log "helm upgrade --install kubeshare charts/kubeshare (tag $TAG)"
# localRigUsers: the rig's tests also act as the components' local identities.
"$HELM" "${HELM_KUBE[@]}" upgrade --install kubeshare "$REPO/charts/kubeshare" --namespace "$NS" \
  --set images.tag="$TAG" --set nodeDaemon.fakeInventoryConfigMap=kubeshare-fake-inventory \
  --set rbac.localRigUsers=true ${K8S_VERSION:+--set images.kubeScheduler=registry.k8s.io/kube-scheduler:$K8S_VERSION} \
  ${FAKE_GPU_DIR:+--set nodeDaemon.fakeGpuDir=$FAKE_GPU_DIR} "${cdi_args[@]}" \
  >"$WORK/helm.log" 2>&1 \
  || { cat "$WORK/helm.log" >&2; die "helm upgrade --install failed"; }
log "waiting for KubeShare to roll out (up to ${TIMEOUT}s)"
k -n "$NS" rollout status deployment/kubeshare-webhook --timeout="${TIMEOUT}s" >/dev/null
k -n "$NS" rollout status deployment/kubeshare-scheduler --timeout="${TIMEOUT}s" >/dev/null
k -n "$NS" rollout status daemonset/kubeshare-node-daemon --timeout="${TIMEOUT}s" >/dev/null
# The scheduler pods' kube-schedulers elect a leader through this Lease; until one
# holds it, no GPU pod is placed.
deadline=$(( $(date +%s) + TIMEOUT ))
until [[ -n "$(k -n "$NS" get lease kubeshare-scheduler -o jsonpath='{.spec.holderIdentity}' 2>/dev/null)" ]]; do
  (( $(date +%s) < deadline )) || die "no kube-scheduler leads (Lease $NS/kubeshare-scheduler; logs: kubectl -n $NS logs deploy/kubeshare-scheduler -c kube-scheduler)"
  sleep 1
done
for n in "${workers[@]}"; do
  deadline=$(( $(date +%s) + TIMEOUT ))
  until [[ -n "$(k get node "$n" -o jsonpath='{.metadata.annotations.sharedgpu/inventory}')" ]]; do
    (( $(date +%s) < deadline )) || die "node $n has no sharedgpu/inventory annotation (node daemon logs: kubectl -n $NS logs ds/kubeshare-node-daemon)"
    sleep 1
  done
done
log "KubeShare is up"
