#!/usr/bin/env bash
# The local KubeShare demo (`make demo`): no GPU, no Docker, one command.
#
# Builds what it needs, brings up a real control plane as local processes
# (hack/cluster.sh: etcd, kube-apiserver, KCM, two kube-schedulers, kwok),
# applies the chart's admission policies and FlowSchema (manifests/), starts the
# scheduler extender, the admission webhook (TLS, registered by URL)
# and one node daemon in fake mode per kwok node, applies the workloads in
# examples/, waits for them to settle, and prints the `kubectl sharedgpu` table
# and the apiserver's refusal of a pod with a bad label. Everything is left
# running; `make demo-down` (hack/demo-down.sh) stops it.
#
# Usage: hack/demo.sh
# Env:   KUBESHARE_DEMO_DIR      run dir: logs, pids, kubeconfigs (default /tmp/kubeshare-demo)
#        KUBESHARE_DEMO_NODES    kwok nodes (default 4; the first half H100s, the rest A100s)
#        KUBESHARE_DEMO_GPUS     simulated GPUs per node (default 4)
#        KUBESHARE_DEMO_PROFILE  cargo profile: debug (default) or release
#        KUBESHARE_DEMO_TIMEOUT  seconds to wait for the workloads to settle (default 120)
# Re-running is safe: it stops the previous demo in the same dir first.
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
DEMO="${KUBESHARE_DEMO_DIR:-/tmp/kubeshare-demo}"
NODES="${KUBESHARE_DEMO_NODES:-4}"
GPUS="${KUBESHARE_DEMO_GPUS:-4}"
PROFILE="${KUBESHARE_DEMO_PROFILE:-debug}"
SETTLE="${KUBESHARE_DEMO_TIMEOUT:-120}"
NS=kubeshare-demo

STEP="starting"
if [[ -t 2 ]]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD="" PLAIN=""; fi
say() { printf '%s==> %s%s\n' "$BOLD" "$*" "$PLAIN" >&2; }
note() { echo "    $*" >&2; }
die() { echo "demo: error: $*" >&2; exit 1; }
# Any failure (die, or a command failing under set -e) ends here.
on_exit() {
  local rc=$?
  (( rc == 0 )) && return 0
  echo >&2
  echo "demo: FAILED during: $STEP (exit $rc)" >&2
  echo "demo: logs are in $DEMO/logs; stop what was started with: make demo-down" >&2
}
trap on_exit EXIT

case "$PROFILE" in
  debug) CARGO_PROFILE=(); TARGET="$REPO/target/debug" ;;
  release) CARGO_PROFILE=(--release); TARGET="$REPO/target/release" ;;
  *) die "KUBESHARE_DEMO_PROFILE must be debug or release, not '$PROFILE'" ;;
esac
[[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "KUBESHARE_DEMO_NODES must be 1..99"
[[ "$GPUS" =~ ^[1-9]$ ]] || die "KUBESHARE_DEMO_GPUS must be 1..9"
case "$DEMO" in /*) ;; *) DEMO="$PWD/$DEMO" ;; esac
export KUBESHARE_DEMO_DIR="$DEMO"
# Node roots must be short: gem-schd's sockets live at
# <root>/pods/<pod-uid>/<gpu-uuid>.sock, and a Unix socket path has at most 107
# bytes (the real root, /var/lib/kubeshare, fits). So each node daemon gets
# <SHORT>/<i>, through a symlink SHORT -> $DEMO/roots (same name in demo-down.sh).
SHORT="/tmp/ks$(printf '%s' "$DEMO" | cksum | cut -c1-5)"

# ------------------------------------------------------------------ helpers

# tail_log NAME: the end of a component's log, to explain a failure.
tail_log() { [[ -f "$DEMO/logs/$1.log" ]] && tail -n 20 "$DEMO/logs/$1.log" | sed 's/^/    | /' >&2 || true; }

# start NAME CMD...: detached (own session, survives this script), logs to
# logs/NAME.log, pid to pids/NAME.pid. Every command line names $DEMO, which
# hack/demo-down.sh checks before it signals a pid (guards against pid reuse).
start() {
  local name="$1"; shift
  setsid "$@" >"$DEMO/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$DEMO/pids/$name.pid"
  note "started $name (pid $!, log $DEMO/logs/$name.log)"
}

alive() { kill -0 "$(cat "$DEMO/pids/$1.pid")" 2>/dev/null; }

# wait_for WHAT SECONDS COMPONENT CMD...: retry CMD until it succeeds; fail when
# the component dies or time runs out. COMPONENT may be - for none.
wait_for() {
  local what="$1" secs="$2" comp="$3"; shift 3
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if [[ "$comp" != - ]] && ! alive "$comp"; then
      tail_log "$comp"
      die "$comp exited while waiting for $what (log: $DEMO/logs/$comp.log)"
    fi
    if (( $(date +%s) >= deadline )); then
      [[ "$comp" == - ]] || tail_log "$comp"
      die "timed out after ${secs}s waiting for $what"
    fi
    sleep 0.5
  done
}

k() { "$K8S_BIN/kubectl" --kubeconfig "$KUBECONFIG" "$@"; }

# ------------------------------------------------------------------ 0. clean

STEP="stopping a previous demo in $DEMO"
if [[ -d "$DEMO" ]]; then
  "$HACK/demo-down.sh" >/dev/null 2>&1 || "$HACK/demo-down.sh" >&2 || die "could not stop the previous demo"
fi
rm -rf "$DEMO"
mkdir -p "$DEMO/logs" "$DEMO/pids" "$DEMO/nodes" "$DEMO/roots"
if [[ -e "$SHORT" && ! -L "$SHORT" ]]; then
  die "$SHORT exists and is not our symlink; move it away"
fi
ln -sfn "$DEMO/roots" "$SHORT"
for t in cargo jq curl openssl setsid ss; do
  command -v "$t" >/dev/null || die "$t is required (see docs/demo.md)"
done

# ------------------------------------------------------------------ 1. build

STEP="building the KubeShare binaries (cargo build ${CARGO_PROFILE[*]:-})"
say "Building KubeShare ($PROFILE; log $DEMO/logs/build.log)"
crates=(-p kubeshare-scheduler -p kubeshare-webhook -p kubeshare-node-daemon -p kubectl-sharedgpu)
if ! (cd "$REPO" && cargo build "${CARGO_PROFILE[@]}" "${crates[@]}") >"$DEMO/logs/build.log" 2>&1; then
  tail -n 30 "$DEMO/logs/build.log" >&2
  die "cargo build failed (full log: $DEMO/logs/build.log)"
fi
# gem-schd and the hook: the node daemon runs one gem-schd per GPU and installs
# the hook for pods. The demo's pods run no CUDA code, so it goes on without
# them if they do not build, and says so.
OPTIONAL_OK=1
if ! (cd "$REPO" && cargo build "${CARGO_PROFILE[@]}" -p gem-schd -p gemhook) >>"$DEMO/logs/build.log" 2>&1; then
  OPTIONAL_OK=0
fi
for b in kubeshare-extender kubeshare-webhook kubeshare-node-daemon kubectl-sharedgpu; do
  [[ -x "$TARGET/$b" ]] || die "cargo build did not produce $TARGET/$b"
done

STEP="building the Kubernetes control plane (hack/build-k8s.sh)"
say "Kubernetes binaries (hack/build-k8s.sh; the first build takes several minutes, then it is cached)"
K8S_BIN="$("$HACK/build-k8s.sh" 2>"$DEMO/logs/build-k8s.log" | tail -n 1)" \
  || { tail -n 30 "$DEMO/logs/build-k8s.log" >&2; die "hack/build-k8s.sh failed (log: $DEMO/logs/build-k8s.log)"; }
[[ -x "$K8S_BIN/kubectl" ]] || die "hack/build-k8s.sh printed '$K8S_BIN', which has no kubectl"
note "$K8S_BIN"

# ------------------------------------------------------------------ 2. cluster

STEP="starting the control plane (hack/cluster.sh up $DEMO/cluster)"
say "Control plane: etcd, kube-apiserver, controller-manager, default + kubeshare schedulers, kwok"
if ! KUBESHARE_K8S_BIN="$K8S_BIN" "$HACK/cluster.sh" up "$DEMO/cluster" >"$DEMO/logs/cluster-up.log" 2>&1; then
  tail -n 30 "$DEMO/logs/cluster-up.log" >&2
  die "hack/cluster.sh up failed (log: $DEMO/logs/cluster-up.log, component logs: $DEMO/cluster/logs)"
fi
# shellcheck disable=SC1091
. "$DEMO/cluster/cluster.env"
KC="$DEMO/cluster/kubeconfig"
note "apiserver $KUBESHARE_APISERVER, component logs in $DEMO/cluster/logs"

# ------------------------------------------------------------------ 2b. policies

STEP="applying the admission policies and the FlowSchema (manifests/)"
say "Admission policies and API priority, as the chart installs them (manifests/ is rendered from it)"
# The same files a kubectl install applies: manifests/ is charts/kubeshare rendered
# (hack/render-manifests.sh; `make test` checks they agree), so the demo holds the
# same rules as a cluster: only the extender writes the allocation record, sharedgpu/
# labels never change, the namespace opt-out needs its own RBAC verb, and no pod
# outside kube-system and kubeshare-system mounts KubeShare's host directory.
k apply -f "$REPO/manifests/admission-policy.yaml" -f "$REPO/manifests/flowschema.yaml" \
  >"$DEMO/logs/policies.log" 2>&1 \
  || { cat "$DEMO/logs/policies.log" >&2; die "applying manifests/admission-policy.yaml and flowschema.yaml failed"; }
# A tenant of namespace default (ClusterRole edit), impersonated by the admin: each
# policy is live once it refuses the tenant (they load asynchronously). The webhook is
# not registered yet, so the refusals are the policies' own.
k create rolebinding kubeshare-demo-tenant -n default --clusterrole=edit --user=kubeshare:demo-tenant \
  >>"$DEMO/logs/policies.log" 2>&1 || die "creating the demo tenant's RoleBinding failed"
# refuses_tenant NEEDLE: a server-side dry run of the pod on stdin, as the tenant,
# fails with NEEDLE in the message.
refuses_tenant() {
  local out
  out="$(k create --dry-run=server --as=kubeshare:demo-tenant -n default -f - 2>&1)" && return 1
  grep -q "$1" <<<"$out"
}
probe_record_policy() {
  refuses_tenant "allocation record" <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: forged-record, annotations: {sharedgpu/gpu_uuid: GPU-forged}}
spec: {containers: [{name: c, image: registry.k8s.io/pause:3.10}]}
EOF
}
probe_host_dir_policy() {
  refuses_tenant "KubeShare's host directory" <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: host-root}
spec:
  containers: [{name: c, image: registry.k8s.io/pause:3.10, volumeMounts: [{name: host, mountPath: /host}]}]
  volumes: [{name: host, hostPath: {path: /}}]
EOF
}
wait_for "policy kubeshare-record to refuse a forged record" 30 - probe_record_policy
wait_for "policy kubeshare-host-dir to refuse a hostPath of /" 30 - probe_host_dir_policy
note "kubeshare-record, kubeshare-namespace-opt-out, kubeshare-host-dir and FlowSchema kubeshare-scheduler applied"

# ------------------------------------------------------------------ 3. extender

STEP="starting the scheduler extender"
say "Scheduler extender on 127.0.0.1:$KUBESHARE_EXTENDER_PORT (called by the kubeshare-scheduler profile)"
start extender "$TARGET/kubeshare-extender" \
  --listen "127.0.0.1:$KUBESHARE_EXTENDER_PORT" --kubeconfig "$KC/extender.kubeconfig"
wait_for "the extender's /readyz" 60 extender \
  curl -sf --max-time 2 "http://127.0.0.1:$KUBESHARE_EXTENDER_PORT/readyz"

# ------------------------------------------------------------------ 4. webhook

STEP="starting the admission webhook"
say "Admission webhook on https://127.0.0.1:$KUBESHARE_WEBHOOK_PORT (TLS, own CA)"
CA_BUNDLE="$("$TARGET/kubeshare-webhook" certs --ip 127.0.0.1 --dns localhost \
  --out "$DEMO/webhook-tls" 2>>"$DEMO/logs/webhook-certs.log" | tail -n 1)"
[[ -n "$CA_BUNDLE" ]] || die "kubeshare-webhook certs printed no caBundle (log: $DEMO/logs/webhook-certs.log)"
start webhook "$TARGET/kubeshare-webhook" serve --listen "127.0.0.1:$KUBESHARE_WEBHOOK_PORT" \
  --cert "$DEMO/webhook-tls/tls.crt" --key "$DEMO/webhook-tls/tls.key"
wait_for "the webhook's /healthz" 30 webhook \
  curl -sf --max-time 2 --cacert "$DEMO/webhook-tls/ca.crt" "https://127.0.0.1:$KUBESHARE_WEBHOOK_PORT/healthz"

# The webhook configurations of manifests/webhook.yaml (rules, matchConditions,
# selectors), registered by URL instead of by Service: the apiserver dials
# 127.0.0.1 directly (a Service would need kube-proxy and a pod).
k create --dry-run=client -o json -f "$REPO/manifests/webhook.yaml" 2>"$DEMO/logs/webhook-register.log" \
  | jq -s --arg url "https://127.0.0.1:$KUBESHARE_WEBHOOK_PORT" --arg ca "$CA_BUNDLE" '
      {apiVersion: "v1", kind: "List", items: [.[]
        | select(.kind | endswith("WebhookConfiguration"))
        | .webhooks |= map(.clientConfig = {url: ($url + .clientConfig.service.path), caBundle: $ca})]}' \
  >"$DEMO/webhook-config.json" \
  || { cat "$DEMO/logs/webhook-register.log" >&2; die "reading manifests/webhook.yaml failed"; }
[[ "$(jq '[.items[].webhooks[]] | length' "$DEMO/webhook-config.json")" -ge 1 ]] \
  || { cat "$DEMO/logs/webhook-register.log" >&2; die "no webhook configuration found in manifests/webhook.yaml"; }
k apply -f "$DEMO/webhook-config.json" >>"$DEMO/logs/webhook-register.log" 2>&1 \
  || { cat "$DEMO/logs/webhook-register.log" >&2; die "registering the webhook failed"; }
# The apiserver picks the configuration up within a second or so: wait until a
# server-side dry run of a labelled pod comes back mutated.
probe_webhook() {
  [[ "$(k create --dry-run=server -o jsonpath='{.spec.schedulerName}' -f - <<'EOF'
apiVersion: v1
kind: Pod
metadata: {name: webhook-probe, namespace: default, labels: {sharedgpu/gpu_request: "0.1", sharedgpu/gpu_limit: "0.1"}}
spec: {containers: [{name: c, image: registry.k8s.io/pause:3.10}]}
EOF
)" == kubeshare-scheduler ]]
}
wait_for "the apiserver to call the webhook" 30 webhook probe_webhook

# ------------------------------------------------------------------ 5. nodes

STEP="creating kwok nodes and their node daemons"
say "$NODES kwok nodes x $GPUS simulated GPUs, one node daemon each (fake inventory)"
if (( OPTIONAL_OK )) && [[ -x "$TARGET/gem-schd" ]]; then
  DAEMON_EXTRA=(--gem-schd "$TARGET/gem-schd")
  [[ -f "$TARGET/libgemhook.so" ]] && DAEMON_EXTRA+=(--hook-lib "$TARGET/libgemhook.so")
else
  DAEMON_EXTRA=()
  note "gem-schd did not build (see $DEMO/logs/build.log): node daemons write the per-GPU configs but run no gem-schd"
fi
node_names=()
for ((i = 0; i < NODES; i++)); do
  name="kwok-gpu-$i"
  node_names+=("$name")
  if (( i < (NODES + 1) / 2 )); then
    model=NVIDIA-H100-80GB-HBM3; mem=$((80 * 1024 * 1024 * 1024))
  else
    model=NVIDIA-A100-SXM4-40GB; mem=$((40 * 1024 * 1024 * 1024))
  fi
  dir="$DEMO/nodes/$name"
  root="$SHORT/$i"
  mkdir -p "$dir" "$DEMO/roots/$i"
  # Deterministic UUIDs whose first group (what the table shows) reads
  # NNNNGGGG: node number, then GPU index.
  jq -n --arg model "$model" --argjson mem "$mem" --argjson n "$i" --argjson g "$GPUS" \
    'def pad4: ("000" + tostring)[-4:];
     {gpus: [range(0; $g) as $j | {
        uuid: ("GPU-" + ($n|pad4) + ($j|pad4) + "-5ba7-4e1d-9c0f-6b1e2d3c4a50"),
        index: $j, model: $model, memory: $mem}]}' >"$dir/inventory.json"
  k apply -f - >>"$DEMO/logs/nodes.log" 2>&1 <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $name
  labels: {type: kwok, kubernetes.io/hostname: $name, kubernetes.io/os: linux}
  annotations: {kwok.x-k8s.io/node: fake}
EOF
  start "node-daemon-$name" "$TARGET/kubeshare-node-daemon" \
    --node-name "$name" --root "$root" --fake-inventory "$dir/inventory.json" \
    --kubeconfig "$KC/node-daemon.kubeconfig" --listen 127.0.0.1:0 --resync-secs 10 \
    "${DAEMON_EXTRA[@]}"
done
node_ready() {
  [[ "$(k get node "$1" -o json | jq -r '
      ([.status.conditions[]? | select(.type == "Ready") | .status] == ["True"])
      and (.metadata.annotations["sharedgpu/inventory"] // "" | length > 0)')" == true ]]
}
for name in "${node_names[@]}"; do
  wait_for "node $name to be Ready with its GPU inventory" 60 "node-daemon-$name" node_ready "$name"
done
note "all nodes Ready and publishing sharedgpu/inventory"

# ------------------------------------------------------------------ 6. workloads

STEP="applying the workloads in examples/"
say "Workloads (examples/): fractional pods, a Deployment, a whole-GPU pod, a coscheduled Job, tags"
k apply -f "$REPO/examples/00-namespace.yaml" >"$DEMO/logs/apply.log" 2>&1 \
  || { cat "$DEMO/logs/apply.log" >&2; die "creating namespace $NS failed"; }
wait_for "the default ServiceAccount in $NS" 30 - k -n "$NS" get serviceaccount default
# One file at a time, each placed before the next: the placement is deterministic
# for a given order of arrivals, so every run prints the same table (applied all
# at once, the order in which the scheduler meets the pods varies from run to run).
# bound_at_least N: N pods of the namespace are bound (wants-b200 never is).
bound_at_least() {
  k -n "$NS" get pods -o json | jq -e --argjson n "$1" '
    [.items[] | select(.metadata.name != "wants-b200")] as $p
    | ($p | length) >= $n and ([$p[] | select(.spec.nodeName == null)] | length) == 0' >/dev/null
}
placed=0
for f in whole-gpu.yaml coscheduled-job.yaml tags.yaml fractional.yaml unplaceable.yaml; do
  if ! k apply -f "$REPO/examples/$f" >>"$DEMO/logs/apply.log" 2>&1; then
    cat "$DEMO/logs/apply.log" >&2
    die "kubectl apply -f examples/$f failed"
  fi
  case "$f" in
    whole-gpu.yaml) placed=$((placed + 1)) ;;
    coscheduled-job.yaml) placed=$((placed + 3)) ;;
    tags.yaml) placed=$((placed + 6)) ;;
    fractional.yaml) placed=$((placed + 4)) ;;
    *) continue ;;
  esac
  wait_for "the pods of examples/$f to be placed" "$SETTLE" extender bound_at_least "$placed"
done
# Any other workload file (added later) comes last.
for f in "$REPO"/examples/*.yaml; do
  case "$(basename "$f")" in
    00-namespace.yaml | whole-gpu.yaml | coscheduled-job.yaml | tags.yaml | fractional.yaml | unplaceable.yaml) ;;
    *) k apply -f "$f" >>"$DEMO/logs/apply.log" 2>&1 || { cat "$DEMO/logs/apply.log" >&2; die "kubectl apply -f $f failed"; } ;;
  esac
done
sed 's/^/    /' "$DEMO/logs/apply.log" >&2

STEP="waiting for the workloads to settle"
say "Waiting for the pods to be placed (up to ${SETTLE}s)"
# Settled: the pods of every workload exist, every one is Running, except
# wants-b200, which the scheduler has marked unschedulable.
EXPECTED_RUNNING=14
settled() {
  k -n "$NS" get pods -o json | jq -e --argjson want "$EXPECTED_RUNNING" '
    ([.items[] | select(.metadata.name != "wants-b200" and .status.phase == "Running")] | length) == $want
    and ([.items[] | select(.metadata.name == "wants-b200")
          | .status.conditions[]? | select(.type == "PodScheduled" and .status == "False")] | length) == 1'
}
deadline=$(( $(date +%s) + SETTLE ))
until settled >/dev/null 2>&1; do
  for c in extender webhook; do
    alive "$c" || { tail_log "$c"; die "the $c exited (log: $DEMO/logs/$c.log)"; }
  done
  if (( $(date +%s) >= deadline )); then
    k -n "$NS" get pods -o wide >&2 || true
    echo "    extender log:" >&2; tail_log extender
    die "the workloads did not settle in ${SETTLE}s"
  fi
  sleep 1
done
k -n "$NS" get pods -o wide 2>&1 | sed 's/^/    /' >&2

# ------------------------------------------------------------------ 7. refusal

STEP="showing a refused pod"
say "A pod with a bad label (examples/refused/bad-label.yaml) is refused by the apiserver:"
if k apply -f "$REPO/examples/refused/bad-label.yaml" >"$DEMO/refused.txt" 2>&1; then
  k delete -f "$REPO/examples/refused/bad-label.yaml" --wait=false >/dev/null 2>&1 || true
  cat "$DEMO/refused.txt" >&2
  die "the webhook did not refuse examples/refused/bad-label.yaml"
fi
grep -q 'denied the request' "$DEMO/refused.txt" \
  || { cat "$DEMO/refused.txt" >&2; die "kubectl failed, but not with the webhook's denial"; }
sed 's/^/    /' "$DEMO/refused.txt"

# ------------------------------------------------------------------ 8. node side

STEP="showing a node's per-GPU config"
# The busiest GPU's resource-config, as its node daemon wrote it and its gem-schd
# reads it (Gemini's format: count, then "POD-UID REQUEST LIMIT GPU_MEM").
busiest="$(for f in "$DEMO"/roots/*/gpus/*/resource-config.txt; do
  [[ -f "$f" ]] && echo "$(head -n 1 "$f") $f"; done | sort -rn | head -n 1 | cut -d' ' -f2-)"
if [[ -n "$busiest" ]]; then
  n="${busiest#"$DEMO"/roots/}"
  say "On node kwok-gpu-${n%%/*}: <root>/${n#*/} (read by that GPU's gem-schd)"
  uid_names="$(k get pods -A -o json | jq -r '.items[] | "\(.metadata.uid) \(.metadata.namespace)/\(.metadata.name)"')"
  { read -r count; echo "    $count"
    while read -r uid rest; do
      echo "    $uid $rest    # $(awk -v u="$uid" '$1 == u {print $2}' <<<"$uid_names")"
    done; } <"$busiest"
fi

# ------------------------------------------------------------------ 9. table

STEP="printing the allocation table"
say "kubectl sharedgpu: who holds which GPU"
KUBECONFIG="$KUBECONFIG" "$TARGET/kubectl-sharedgpu" | tee "$DEMO/table.txt"

# kubectl and the plugin side by side, so that `kubectl sharedgpu` finds it.
mkdir -p "$DEMO/bin"
ln -sfn "$K8S_BIN/kubectl" "$DEMO/bin/kubectl"
ln -sfn "$TARGET/kubectl-sharedgpu" "$DEMO/bin/kubectl-sharedgpu"

cat <<EOF

The demo is running (logs: $DEMO/logs, control plane: $DEMO/cluster/logs).
  export KUBECONFIG=$KUBECONFIG
  export PATH=$DEMO/bin:\$PATH      # kubectl, and the kubectl-sharedgpu plugin
  kubectl get pods -n $NS -o wide
  kubectl sharedgpu
Stop everything with: make demo-down
EOF
