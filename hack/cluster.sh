#!/usr/bin/env bash
# The local Kubernetes control plane for KubeShare's tests and demo: etcd,
# kube-apiserver, kube-controller-manager, the default kube-scheduler, a second
# kube-scheduler (profile kubeshare-scheduler, calling our extender) and kwok,
# all as plain processes on loopback, with a CA and one client certificate per
# identity. See docs/control-plane.md.
#
# Usage:
#   hack/cluster.sh up   [RUN_DIR] [--owner-pid PID]   start, wait until ready
#   hack/cluster.sh down [RUN_DIR]                     stop everything (TERM, then KILL)
#   hack/cluster.sh env  [RUN_DIR]                     print RUN_DIR/cluster.env
#
# RUN_DIR defaults to $KUBESHARE_RUN_DIR or <repo>/target/kubeshare-cluster.
# --owner-pid PID: a watchdog brings the cluster down when PID exits (used by
# the Rust testkit when a test process starts its own cluster).
# Env: KUBESHARE_K8S_BIN (use these binaries instead of hack/build-k8s.sh),
#      KUBESHARE_PORT_CLAIMS (dir of port claims, default /tmp/kubeshare-port-claims),
#      KUBESHARE_UP_TIMEOUT (seconds per readiness wait, default 120),
#      KUBESHARE_APISERVER_BIND (address the apiserver listens on, default 127.0.0.1;
#        0.0.0.0 lets a real node's network namespace reach it, see hack/node.sh),
#      KUBESHARE_LOCAL_SCHEDULER (1, default: run the kubeshare-scheduler process
#        here; 0: leave that to KubeShare deployed from manifests/ on a real node),
#      KUBESHARE_SCHED_QPS, KUBESHARE_SCHED_BURST (both schedulers' client limits,
#        alike; unset: upstream's 50 / 100),
#      KUBESHARE_MANAGED_RESOURCES (1: the extender sees only pods marked
#        kubeshare.io/gpu-pod, as manifests/ configure it; default 0: every pod),
#      KUBESHARE_APISERVER_PROFILING (true: the apiserver serves /debug/pprof to the
#        admin, for `kubectl get --raw '/debug/pprof/profile?seconds=N'`; default false),
#      KUBESHARE_NODE_MONITOR_GRACE_PERIOD (the node lifecycle controller's grace
#        before a node whose lease and status are stale is NotReady and tainted;
#        unset: upstream's default; for benches that want to rule out lease
#        lapses of kwok's nodes on saturated cores: a longer grace changed nothing).
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"

log() { echo "cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

RUN="${RUN:-}"
OWNER=""
CLAIMS="${KUBESHARE_PORT_CLAIMS:-/tmp/kubeshare-port-claims}"
TIMEOUT="${KUBESHARE_UP_TIMEOUT:-120}"
API_BIND="${KUBESHARE_APISERVER_BIND:-127.0.0.1}"
LOCAL_SCHEDULER="${KUBESHARE_LOCAL_SCHEDULER:-1}"

# Components in start order; `down` stops them in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubeshare-scheduler kwok)
# Identities with a client certificate: name CN O(group, may be empty).
IDENTITIES=(
  "admin kubeshare:admin system:masters"
  "kube-controller-manager system:kube-controller-manager -"
  "kube-scheduler system:kube-scheduler -"
  "kwok kubeshare:kwok system:masters"
  "extender kubeshare:scheduler-extender -"
  "webhook kubeshare:webhook -"
  "node-daemon kubeshare:node-daemon -"
  "apiserver-kubelet kube-apiserver-kubelet-client -"
)

# ------------------------------------------------------------------ processes

# cmdline_has PID TEXT: PID's command line mentions TEXT. Read whole, not piped into
# `grep -q`: under pipefail, grep's early exit could end `tr` by SIGPIPE and the check
# fail for a live process (a CI run then waited forever on a running apiserver).
cmdline_has() {
  local cmd
  cmd="$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null)" || return 1
  [[ "$cmd" == *"$2"* ]]
}

# pid_alive PID: true when PID runs and its command line mentions this run dir
# (guards against pid reuse after a crash).
pid_alive() {
  local pid="$1"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  cmdline_has "$pid" "$RUN"
}

# proc_state PID: the state letter in /proc/PID/stat (R, S, Z, ...), empty when gone.
proc_state() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  stat="${stat##*) }"
  echo "${stat:0:1}"
}

# not_dead PID: for waiting on a component we just started. While the kernel loads
# a new program, /proc/PID/cmdline reads empty for a moment, so pid_alive alone
# can report a process that is starting as gone; here only a missing or zombie
# process counts as dead. A process in uninterruptible sleep (D: reading its binary
# from disk, say) is alive whatever its cmdline reads: a kube-apiserver in state D at
# its start was once taken for dead and failed a CI run ("exited (status unknown: pid
# ... is in state D)"), likely the rare "exited with an empty log" of earlier runs too.
not_dead() {
  local pid="$1" state
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  state="$(proc_state "$pid")"
  [[ -n "$state" && "$state" != Z ]] || return 1
  [[ "$state" == D ]] && return 0
  pid_alive "$pid" && return 0
  [[ -z "$(tr -d '\0' <"/proc/$pid/cmdline" 2>/dev/null)" ]]
}

live_pids() {
  local f pid
  for f in "$RUN"/pids/*.pid; do
    [[ -f "$f" ]] || continue
    pid="$(cat "$f")"
    if pid_alive "$pid"; then echo "$pid"; fi
  done
}

# start NAME BINARY ARGS...: detached (own session), logs to logs/NAME.log.
start() {
  local name="$1"; shift
  setsid "$@" >"$RUN/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/pids/$name.pid"
  log "started $name (pid $!)"
  owner_check
}

owner_check() {
  if [[ -n "$OWNER" ]] && ! kill -0 "$OWNER" 2>/dev/null; then
    log "owner $OWNER exited during up; stopping"
    cmd_down
    exit 1
  fi
}

# wait_for NAME CMD...: retry CMD until it succeeds, the component dies, or timeout.
wait_for() {
  local name="$1"; shift
  local deadline=$(( $(date +%s) + TIMEOUT ))
  local pidf="$RUN/pids/$name.pid"
  until "$@" >/dev/null 2>&1; do
    if [[ -f "$pidf" ]] && ! not_dead "$(cat "$pidf")"; then
      tail -n 30 "$RUN/logs/$name.log" >&2 || true
      # Its exit status (128+N: killed by signal N): twice a component exited at start
      # with an empty log, under load, and the status is the only clue left.
      local rc=0 pid
      pid="$(cat "$pidf")"
      # `wait` on a process that still runs would block for good: only for one that is
      # gone or a zombie (not_dead's verdict is re-read from /proc first).
      if [[ "$(proc_state "$pid")" =~ ^(Z|)$ ]]; then
        wait "$pid" 2>/dev/null || rc=$?
      else
        rc="unknown: pid $pid is in state $(proc_state "$pid")"
      fi
      die "$name exited (status $rc); see $RUN/logs/$name.log"
    fi
    if (( $(date +%s) > deadline )); then
      tail -n 30 "$RUN/logs/$name.log" >&2 || true
      die "$name not ready after ${TIMEOUT}s; see $RUN/logs/$name.log"
    fi
    owner_check
    sleep 0.2
  done
  log "$name ready"
}

# ---------------------------------------------------------------------- ports

port_in_use() { [[ -n "$(ss -Htan "( sport = :$1 )" 2>/dev/null)" ]]; }

# A claim file per port records the run dir that reserved it, so a second
# cluster started beside this one (and our not-yet-listening extender and
# webhook ports) never collide. A claim is stale when its run dir is gone, or
# when none of its processes runs and the claim is older than 10 minutes.
claim_stale() {
  local f="$1" owner
  owner="$(cat "$f" 2>/dev/null || true)"
  [[ -n "$owner" && -d "$owner" ]] || return 0
  [[ -n "$(find "$f" -mmin +10 2>/dev/null)" ]] || return 1
  local p
  for p in "$owner"/pids/*.pid; do
    [[ -f "$p" ]] || continue
    if cmdline_has "$(cat "$p")" "$owner"; then
      return 1
    fi
  done
  return 0
}

alloc_port() {
  local try p
  mkdir -p "$CLAIMS"
  for try in $(seq 1 500); do
    # Below the kernel's ephemeral range (32768+), so outgoing connections
    # cannot take our ports between reservation and use.
    p=$(( 20000 + RANDOM % 12000 ))
    port_in_use "$p" && continue
    if [[ -e "$CLAIMS/$p" ]]; then
      claim_stale "$CLAIMS/$p" || continue
      rm -f "$CLAIMS/$p"
    fi
    if ( set -o noclobber; echo "$RUN" >"$CLAIMS/$p" ) 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  die "no free port found"
}

release_ports() {
  local f
  for f in "$CLAIMS"/*; do
    [[ -f "$f" ]] || continue
    if [[ "$(cat "$f" 2>/dev/null)" == "$RUN" ]]; then rm -f "$f"; fi
  done
}

# ----------------------------------------------------------------------- PKI

b64() { base64 -w0 <"$1"; }

gen_pki() {
  local pki="$RUN/pki"
  mkdir -p "$pki"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$pki/ca.key" -sha256 -days 3650 -subj "/CN=kubeshare-test-ca" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$pki/ca.crt" 2>/dev/null

  # A separate CA for the aggregation layer's request-header authentication
  # (nothing uses it; without it every component logs errors about the missing
  # requestheader-client-ca-file). No certificate is ever issued from it.
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/front-proxy-ca.key" 2>/dev/null
  openssl req -x509 -new -key "$pki/front-proxy-ca.key" -sha256 -days 3650 -subj "/CN=kubeshare-front-proxy-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$pki/front-proxy-ca.crt" 2>/dev/null

  # sign NAME SUBJECT EXTFILE-CONTENT
  sign() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/$1.key" 2>/dev/null
    openssl req -new -key "$pki/$1.key" -subj "$2" -out "$pki/$1.csr" 2>/dev/null
    printf '%s\n' "$3" >"$pki/$1.ext"
    openssl x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
      -sha256 -days 3650 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
    rm -f "$pki/$1.csr" "$pki/$1.ext"
  }
  local serving="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth"
  sign apiserver "/CN=kube-apiserver" "$serving
subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.96.0.1"
  # Ready-made serving cert for our webhook on 127.0.0.1 (tests may mint their own with the CA).
  sign webhook-serving "/CN=kubeshare-webhook" "$serving
subjectAltName=IP:127.0.0.1,DNS:localhost"

  local client="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  local entry name cn org subj
  for entry in "${IDENTITIES[@]}"; do
    read -r name cn org <<<"$entry"
    subj="/CN=$cn"
    [[ "$org" == "-" ]] || subj="/O=$org$subj"
    sign "client-$name" "$subj" "$client"
  done

  # Service-account token signing key (RSA: what the apiserver expects by default).
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key" 2>/dev/null
  openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  chmod 600 "$pki"/*.key
}

write_kubeconfigs() {
  local dir="$RUN/kubeconfig" pki="$RUN/pki" entry name cn org
  mkdir -p "$dir"
  for entry in "${IDENTITIES[@]}"; do
    read -r name cn org <<<"$entry"
    cat >"$dir/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubeshare
  cluster:
    server: https://127.0.0.1:$P_APISERVER
    certificate-authority-data: $(b64 "$pki/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $(b64 "$pki/client-$name.crt")
    client-key-data: $(b64 "$pki/client-$name.key")
contexts:
- name: $name@kubeshare
  context:
    cluster: kubeshare
    user: $name
    namespace: default
current-context: $name@kubeshare
EOF
    chmod 600 "$dir/$name.kubeconfig"
  done
}

# ------------------------------------------------------------------- configs

# Both schedulers' client limits, alike (hack/bench-scale.sh raises them so
# that neither scheduler is throttled by its client; upstream: 50 / 100).
sched_client_limits() {
  if [[ -n "${KUBESHARE_SCHED_QPS:-}" ]]; then
    echo "  qps: $KUBESHARE_SCHED_QPS
  burst: ${KUBESHARE_SCHED_BURST:-$KUBESHARE_SCHED_QPS}"
  fi
}

# The default scheduler's configuration (profile default-scheduler).
write_default_scheduler_config() {
  local c="$RUN/config" client_limits
  mkdir -p "$c"
  client_limits="$(sched_client_limits)"
  cat >"$c/kube-scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $RUN/kubeconfig/kube-scheduler.kubeconfig
$client_limits
leaderElection:
  leaderElect: false
profiles:
- schedulerName: default-scheduler
EOF
}

write_configs() {
  local c="$RUN/config"
  write_default_scheduler_config
  local client_limits
  client_limits="$(sched_client_limits)"
  # As manifests/ configure it: only pods marked kubeshare.io/gpu-pod (the
  # webhook marks GPU pods) go through the extender. Off by default: most tests
  # create GPU pods without the webhook, and so without the mark.
  local managed=""
  if [[ "${KUBESHARE_MANAGED_RESOURCES:-0}" == 1 ]]; then
    managed="  managedResources:
  - name: kubeshare.io/gpu-pod
    ignoredByScheduler: true"
  fi
  # KUBESHARE_EXTENDER_HTTPS=1: the extender over TLS (then HTTP/2, one connection
  # for every concurrent call), with the rig's 127.0.0.1 serving certificate.
  local ext_url="http://127.0.0.1:$P_EXTENDER" ext_tls=""
  if [[ "${KUBESHARE_EXTENDER_HTTPS:-0}" == 1 ]]; then
    ext_url="https://127.0.0.1:$P_EXTENDER"
    ext_tls="  enableHTTPS: true
  tlsConfig:
    caFile: $RUN/pki/ca.crt"
  fi
  # KUBESHARE_SCHED_PCT=N: the kubeshare profile's percentageOfNodesToScore
  # (kube-scheduler's adaptive default when unset, as the chart leaves it: ~42 %
  # at 1,000 nodes).
  local pct=""
  [[ -z "${KUBESHARE_SCHED_PCT:-}" ]] || pct="  percentageOfNodesToScore: $KUBESHARE_SCHED_PCT"
  # Our scheduler: its only profile is kubeshare-scheduler, and every pod it
  # schedules goes through the extender (unless KUBESHARE_MANAGED_RESOURCES). Short
  # backoffs so tests do not wait long after the extender rejects a pod.
  cat >"$c/kubeshare-scheduler.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $RUN/kubeconfig/kube-scheduler.kubeconfig
$client_limits
leaderElection:
  leaderElect: false
podInitialBackoffSeconds: 1
podMaxBackoffSeconds: 2
profiles:
- schedulerName: kubeshare-scheduler
$pct
extenders:
- urlPrefix: $ext_url
  filterVerb: filter
  prioritizeVerb: prioritize
  bindVerb: bind
  weight: 1
  nodeCacheCapable: true
  httpTimeout: 10s
$managed
$ext_tls
EOF
  cp "$HACK/cluster-stages.yaml" "$c/kwok-stages.yaml"
}

write_env() {
  local k="$RUN/kubeconfig"
  cat >"$RUN/cluster.env" <<EOF
# Written by hack/cluster.sh up. Source it: . $RUN/cluster.env
export KUBESHARE_TEST_CLUSTER=$RUN
export KUBESHARE_RUN_DIR=$RUN
export KUBESHARE_K8S_BIN=$BIN
export KUBECONFIG=$k/admin.kubeconfig
export KUBESHARE_APISERVER=https://127.0.0.1:$P_APISERVER
export KUBESHARE_EXTENDER_PORT=$P_EXTENDER
export KUBESHARE_WEBHOOK_PORT=$P_WEBHOOK
export KUBESHARE_CA_CERT=$RUN/pki/ca.crt
export KUBESHARE_CA_KEY=$RUN/pki/ca.key
EOF
  local entry name cn org kubeconfigs="{}" users="{}"
  for entry in "${IDENTITIES[@]}"; do
    read -r name cn org <<<"$entry"
    kubeconfigs="$(jq -c --arg n "$name" --arg p "$k/$name.kubeconfig" '. + {($n): $p}' <<<"$kubeconfigs")"
    users="$(jq -c --arg n "$name" --arg u "$cn" '. + {($n): $u}' <<<"$users")"
  done
  jq -n \
    --arg run "$RUN" --arg bin "$BIN" --arg url "https://127.0.0.1:$P_APISERVER" \
    --arg ca "$RUN/pki/ca.crt" --arg cakey "$RUN/pki/ca.key" \
    --arg wcrt "$RUN/pki/webhook-serving.crt" --arg wkey "$RUN/pki/webhook-serving.key" \
    --argjson kc "$kubeconfigs" --argjson users "$users" \
    --argjson etcd "$P_ETCD" --argjson peer "$P_ETCD_PEER" --argjson api "$P_APISERVER" \
    --argjson kcm "$P_KCM" --argjson sched "$P_SCHED" --argjson ksched "$P_KSCHED" \
    --argjson kwok "$P_KWOK" --argjson ext "$P_EXTENDER" --argjson wh "$P_WEBHOOK" \
    '{run_dir: $run, bin_dir: $bin, apiserver_url: $url,
      ca_cert: $ca, ca_key: $cakey, webhook_serving_cert: $wcrt, webhook_serving_key: $wkey,
      scheduler_name: "kubeshare-scheduler", kwok_node_label: {key: "type", value: "kwok"},
      ports: {etcd: $etcd, etcd_peer: $peer, apiserver: $api, kube_controller_manager: $kcm,
              kube_scheduler: $sched, kubeshare_scheduler: $ksched, kwok: $kwok,
              extender: $ext, webhook: $wh},
      kubeconfigs: $kc, users: $users}' >"$RUN/cluster.json.tmp"
  mv "$RUN/cluster.json.tmp" "$RUN/cluster.json"
}

# -------------------------------------------------------------------- checks

curl_api() {
  curl -sf --max-time 3 --cacert "$RUN/pki/ca.crt" \
    --cert "$RUN/pki/client-admin.crt" --key "$RUN/pki/client-admin.key" "$@"
}
etcd_healthy() { curl -sf --max-time 3 "http://127.0.0.1:$P_ETCD/health" | grep -q '"health":"true"'; }
api_ready() { [[ "$(curl_api "https://127.0.0.1:$P_APISERVER/readyz")" == ok ]]; }
# kube-controller-manager and kube-scheduler serve /healthz to anyone (their
# default --authorization-always-allow-paths), over TLS with a self-signed cert.
secure_healthz() { [[ "$(curl -skf --max-time 3 "https://127.0.0.1:$1/healthz")" == ok ]]; }
kwok_healthy() { [[ "$(curl -sf --max-time 3 "http://127.0.0.1:$P_KWOK/healthz")" == ok ]]; }
default_sa() { curl_api "https://127.0.0.1:$P_APISERVER/api/v1/namespaces/default/serviceaccounts/default" >/dev/null; }

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$RUN/kubeconfig/admin.kubeconfig" "$@"; }

# ------------------------------------------------------------ components
# One function per component that every mode runs (hack/gpu-node.sh runs them too, with
# its own RUN, BIN and ports P_*). KUBESHARE_FEATURE_GATES: --feature-gates of the
# apiserver, kube-controller-manager and the schedulers (unset: none).

# etcd, then kube-apiserver (each waited for).
start_etcd_apiserver() {
  local pki="$RUN/pki"
  start etcd "$BIN/etcd" --name=kubeshare --data-dir="$RUN/etcd" \
    --listen-client-urls="http://127.0.0.1:$P_ETCD" --advertise-client-urls="http://127.0.0.1:$P_ETCD" \
    --listen-peer-urls="http://127.0.0.1:$P_ETCD_PEER" --initial-advertise-peer-urls="http://127.0.0.1:$P_ETCD_PEER" \
    --initial-cluster="kubeshare=http://127.0.0.1:$P_ETCD_PEER" \
    --unsafe-no-fsync --log-level=warn
  wait_for etcd etcd_healthy

  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$P_ETCD" \
    --bind-address="$API_BIND" --advertise-address=127.0.0.1 --secure-port="$P_APISERVER" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --requestheader-client-ca-file="$pki/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --kubelet-client-certificate="$pki/client-apiserver-kubelet.crt" \
    --kubelet-client-key="$pki/client-apiserver-kubelet.key" \
    --enable-aggregator-routing=true --kubelet-preferred-address-types=InternalIP \
    --service-account-issuer=https://kubernetes.default.svc \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --service-cluster-ip-range=10.96.0.0/16 \
    --endpoint-reconciler-type=none --allow-privileged=true \
    --cert-dir="$RUN/apiserver-certs" --profiling="${KUBESHARE_APISERVER_PROFILING:-false}" \
    ${KUBESHARE_FEATURE_GATES:+--feature-gates="$KUBESHARE_FEATURE_GATES"}
  wait_for kube-apiserver api_ready
}

start_kcm() {
  local pki="$RUN/pki" kc="$RUN/kubeconfig"
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$kc/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig="$kc/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig="$kc/kube-controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$P_KCM" --cert-dir="$RUN/kcm-certs" \
    --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --controllers=endpoints-controller,endpointslice-controller,serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,namespace-controller,garbage-collector-controller,job-controller,ttl-after-finished-controller,replicaset-controller,deployment-controller,daemonset-controller,statefulset-controller,node-lifecycle-controller,pod-garbage-collector-controller,clusterrole-aggregation-controller,resourceclaim-controller \
    ${KUBESHARE_NODE_MONITOR_GRACE_PERIOD:+--node-monitor-grace-period="$KUBESHARE_NODE_MONITOR_GRACE_PERIOD"} \
    --profiling=false ${KUBESHARE_FEATURE_GATES:+--feature-gates="$KUBESHARE_FEATURE_GATES"}
}

# The cluster's default scheduler (profile default-scheduler).
start_default_scheduler() {
  local kc="$RUN/kubeconfig"
  start kube-scheduler "$BIN/kube-scheduler" --config="$RUN/config/kube-scheduler.yaml" \
    --authentication-kubeconfig="$kc/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig="$kc/kube-scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$P_SCHED" --cert-dir="$RUN/kube-scheduler-certs" \
    ${KUBESHARE_FEATURE_GATES:+--feature-gates="$KUBESHARE_FEATURE_GATES"}
}

# ------------------------------------------------------------------ commands

cmd_up() {
  if [[ -n "$(live_pids)" ]]; then
    die "a cluster is already running in $RUN (hack/cluster.sh down $RUN first)"
  fi
  local t0; t0=$(date +%s%N)
  if [[ -n "${KUBESHARE_K8S_BIN:-}" ]]; then
    BIN="$KUBESHARE_K8S_BIN"
  else
    BIN="$("$HACK/build-k8s.sh" | tail -n 1)"
  fi
  local b
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
    [[ -x "$BIN/$b" ]] || die "missing $BIN/$b (run hack/build-k8s.sh)"
  done
  for b in openssl curl jq ss setsid; do
    command -v "$b" >/dev/null || die "$b is required"
  done

  # A failed `up` leaves nothing running.
  trap 'rc=$?; if [[ $rc != 0 ]]; then log "up failed; stopping what was started"; cmd_down; fi' EXIT
  release_ports
  rm -rf "$RUN/etcd" "$RUN/pki" "$RUN/kubeconfig" "$RUN/config" "$RUN/pids" "$RUN/logs" \
         "$RUN/cluster.env" "$RUN/cluster.json" "$RUN/ready"
  mkdir -p "$RUN/pids" "$RUN/logs" "$RUN/etcd"
  chmod 700 "$RUN/etcd"

  P_ETCD=$(alloc_port); P_ETCD_PEER=$(alloc_port); P_APISERVER=$(alloc_port)
  P_KCM=$(alloc_port); P_SCHED=$(alloc_port); P_KSCHED=$(alloc_port); P_KWOK=$(alloc_port)
  P_EXTENDER=$(alloc_port); P_WEBHOOK=$(alloc_port)

  gen_pki
  write_kubeconfigs
  write_configs
  write_env
  log "run dir $RUN, apiserver https://127.0.0.1:$P_APISERVER"

  local kc="$RUN/kubeconfig"
  start_etcd_apiserver

  # The local KubeShare processes need their RBAC; with KubeShare deployed on the
  # real node instead, its Helm release brings the RBAC (and must own it).
  if [[ "$LOCAL_SCHEDULER" == 1 ]]; then
    kubectl_admin apply -f "$REPO/manifests/00-namespace.yaml" -f "$REPO/manifests/rbac.yaml" \
      >"$RUN/logs/rbac-apply.log" 2>&1 \
      || { cat "$RUN/logs/rbac-apply.log" >&2; die "applying manifests/rbac.yaml failed"; }
    log "applied manifests/rbac.yaml"
  fi

  start_kcm
  start_default_scheduler
  if [[ "$LOCAL_SCHEDULER" == 1 ]]; then
    start kubeshare-scheduler "$BIN/kube-scheduler" --config="$RUN/config/kubeshare-scheduler.yaml" \
      --authentication-kubeconfig="$kc/kube-scheduler.kubeconfig" \
      --authorization-kubeconfig="$kc/kube-scheduler.kubeconfig" \
      --bind-address=127.0.0.1 --secure-port="$P_KSCHED" --cert-dir="$RUN/kubeshare-scheduler-certs" \
      ${KUBESHARE_FEATURE_GATES:+--feature-gates="$KUBESHARE_FEATURE_GATES"}
  fi
  start kwok "$BIN/kwok" --kubeconfig="$kc/kwok.kubeconfig" \
    --config="$RUN/config/kwok-stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-label-selector=type=kwok \
    --server-address="127.0.0.1:$P_KWOK" \
    --node-ip=10.77.0.1 --cidr=10.78.0.0/16 --node-lease-duration-seconds=40

  wait_for kube-controller-manager secure_healthz "$P_KCM"
  wait_for kube-scheduler secure_healthz "$P_SCHED"
  [[ "$LOCAL_SCHEDULER" != 1 ]] || wait_for kubeshare-scheduler secure_healthz "$P_KSCHED"
  wait_for kwok kwok_healthy
  wait_for kube-controller-manager default_sa

  if [[ -n "$OWNER" ]]; then
    # The watchdog's command line names the run dir, so `down` finds and stops it too.
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" down "$3"' \
      kubeshare-cluster-watchdog "$OWNER" "$HACK/cluster.sh" "$RUN" \
      >"$RUN/logs/watchdog.log" 2>&1 </dev/null &
    echo $! >"$RUN/pids/watchdog.pid"
    log "watchdog $! stops the cluster when pid $OWNER exits"
  fi

  trap - EXIT
  date -u +%FT%TZ >"$RUN/ready"
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  log "up in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s; . $RUN/cluster.env"
  echo "$RUN"
}

cmd_down() {
  local f pid name pids=()
  # Reverse start order; the watchdog first (unless it is us).
  for name in watchdog kwok kubeshare-scheduler kube-scheduler kube-controller-manager kube-apiserver etcd; do
    f="$RUN/pids/$name.pid"
    [[ -f "$f" ]] || continue
    pid="$(cat "$f")"
    [[ "$pid" != "$$" ]] || continue
    # not_dead, not pid_alive: a component that `up` started a moment ago may still be
    # exec'ing (empty cmdline); it must be stopped too, or it outlives the cluster.
    if not_dead "$pid"; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  local deadline=$(( $(date +%s) + 10 ))
  while (( $(date +%s) < deadline )); do
    local alive=0
    for pid in "${pids[@]}"; do not_dead "$pid" && alive=1; done
    (( alive )) || break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do
    if not_dead "$pid"; then
      log "pid $pid ignored SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  for pid in "${pids[@]}"; do
    local n=0
    while not_dead "$pid" && (( n < 50 )); do sleep 0.1; n=$((n + 1)); done
  done
  rm -f "$RUN"/pids/*.pid "$RUN/ready"
  rm -rf "$RUN/etcd"
  release_ports
  log "down ($RUN)"
}

cmd_env() {
  [[ -f "$RUN/cluster.env" ]] || die "no cluster.env in $RUN (not up?)"
  cat "$RUN/cluster.env"
}

main() {
  local cmd="${1:-}"
  [[ -n "$cmd" ]] || { usage >&2; exit 2; }
  shift
  RUN=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --owner-pid) OWNER="${2:?--owner-pid needs a pid}"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      -*) die "unknown option $1" ;;
      *) [[ -z "$RUN" ]] || die "more than one RUN_DIR given"; RUN="$1"; shift ;;
    esac
  done
  RUN="${RUN:-${KUBESHARE_RUN_DIR:-$REPO/target/kubeshare-cluster}}"
  mkdir -p "$RUN"
  RUN="$(cd "$RUN" && pwd)"
  case "$cmd" in
    up) cmd_up ;;
    down) cmd_down ;;
    env) cmd_env ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

# Sourced (hack/gpu-node.sh reuses the certificates, configs and component command
# lines with RUN set by itself): only the functions above.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
