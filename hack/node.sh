#!/usr/bin/env bash
# A real Kubernetes node for KubeShare's tests: containerd + runc, a kubelet and
# kube-proxy, registered to a local control plane started by hack/cluster.sh.
# See docs/node.md.
#
# The node lives the way kind's node container does, without Docker: its
# processes run in their own mount and network namespaces (unshare), joined to
# the host by a veth pair. Sysctls the kubelet and the CNI bridge write, the
# bridge itself, kube-proxy's iptables rules, pod netns files and containerd's
# shim sockets stay inside those namespaces and vanish with them. On the host,
# a node holds only: the veth's host end and a route to its pod CIDR (both go
# with the namespace), one cgroup tree /ks-node-ID per hierarchy (the kubelet's
# cgroupRoot; `down` empties and removes it) and its files under RUN_DIR/node.
#
# Usage:
#   hack/node.sh up    RUN_DIR [--owner-pid PID]  start a node on the cluster in RUN_DIR, wait until Ready
#   hack/node.sh down  RUN_DIR                    stop it, remove what it left on the host, check the host
#   hack/node.sh exec  RUN_DIR CMD...             run CMD in the node's namespaces (e.g. ctr, iptables-save)
#   hack/node.sh import RUN_DIR ARCHIVE...        import OCI archives into the node's containerd
#   hack/node.sh host-state                       print the host state that `down` compares with `up`'s
#
# RUN_DIR is the cluster's run dir (hack/cluster.sh up RUN_DIR); the node keeps
# its files in RUN_DIR/node and writes RUN_DIR/node/node.env. The apiserver must
# listen on an address the node's namespace reaches (cluster.sh up with
# KUBESHARE_APISERVER_BIND=0.0.0.0, as hack/with-cluster.sh --node does).
# Env: KUBESHARE_NODE_IMAGES (dir of OCI archives to import at up; default
#      <repo>/target/images), KUBESHARE_NODE_NAME (default kubeshare-node),
#      KUBESHARE_UP_TIMEOUT (seconds per readiness wait, default 120),
#      KUBESHARE_NODE_CDI (default 1: run the containerd 2.x that
#      hack/build-containerd.sh builds, with CDI on and RUN_DIR/node/cdi as its only
#      spec dir, as a GPU node gets its devices; 0: the host's containerd 1.6,
#      without CDI).
# Needs root, containerd, runc, the CNI plugins in /usr/lib/cni, iptables,
# conntrack, ip, unshare, nsenter.
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
SELF="$HACK/node.sh"

log() { echo "node: $*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '2,31p' "$SELF" | sed 's/^# \{0,1\}//'; }

CLAIMS=/tmp/kubeshare-node-claims
TIMEOUT="${KUBESHARE_UP_TIMEOUT:-120}"
CNI_BIN=/usr/lib/cni
# The host sysctls the kubelet sets (pkg/kubelet/cm setupKernelTunables) and the
# values it wants. Inside the node they are bind-mounted files already holding
# these values, so the kubelet finds nothing to change and the host keeps its own.
KUBELET_SYSCTLS=(
  "vm/overcommit_memory 1" "vm/panic_on_oom 0" "kernel/panic 10" "kernel/panic_on_oops 1"
  "kernel/keys/root_maxkeys 1000000" "kernel/keys/root_maxbytes 25000000"
)

# ---------------------------------------------------------------- host state

# What a node could leave behind on the host, in a form that diffs cleanly.
# Only things no one else on the machine changes, so `down` can be strict.
host_state() {
  host_state_sysctls
  echo "# links and routes of nodes (ksn*), bridges (cni*)"
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^(ksn|cni|veth)' || true
  ip route show 2>/dev/null | grep -E 'ksn|cni' || true
  host_state_paths
  host_state_cgroups 'ks-node-*'
  echo "# mounts of containers, pods, nodes"
  grep -E 'ks-node|kubelet|containerd|/run/netns|kubeshare' /proc/self/mountinfo | awk '{print $5}' | sort || true
  echo "# processes"
  # (zombies excluded: killed processes wait a moment for the host's init to reap them)
  live_comms | grep -E '^(containerd|containerd-shim|kubelet|kube-proxy|runc)' | sort | uniq -c || true
}

# The parts of host_state that hack/gpu-node.sh's check shares.
host_state_sysctls() {
  local s
  echo "# sysctls"
  for s in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops \
           kernel/keys/root_maxkeys kernel/keys/root_maxbytes net/ipv4/ip_forward \
           net/ipv4/conf/all/route_localnet net/bridge/bridge-nf-call-iptables; do
    echo "$s=$(cat "/proc/sys/$s" 2>/dev/null || echo absent)"
  done
}

host_state_paths() {
  echo "# /run/netns /run/containerd /var/lib/kubelet /var/lib/cni /var/log/pods /var/lib/kubeshare /etc/cni"
  local d
  for d in /run/netns /run/containerd /var/lib/kubelet /var/lib/cni /var/log/pods /var/lib/kubeshare /etc/cni; do
    [[ -e "$d" ]] && echo "exists $d"
  done
  return 0
}

# host_state_cgroups NAME: the node's cgroups (NAME, a glob), kubepods, k8s.io at the top
# of every hierarchy.
host_state_cgroups() {
  echo "# cgroups of nodes (${1//\*/}*, kubepods, k8s.io)"
  local h
  for h in /sys/fs/cgroup/*/; do
    find "$h" -maxdepth 1 -mindepth 1 -type d \( -name "$1" -o -name kubepods -o -name 'kubepods.slice' -o -name k8s.io \) 2>/dev/null
  done | sort
}

# The command names of the live processes (not zombies: killed processes wait a moment
# for the host's init to reap them), from /proc, so that hosts without procps (ps) work.
live_comms() {
  local f st
  for f in /proc/[0-9]*/stat; do
    read -r st 2>/dev/null <"$f" || continue
    [[ "${st##*) }" == Z* ]] && continue
    st="${st#*(}"
    echo "${st%)*}"
  done
}

# ------------------------------------------------------------------ helpers

need_root() { [[ "$(id -u)" == 0 ]] || die "a real node needs root (unshare, veth, cgroups)"; }

load_env() {
  NODE="$RUN/node"
  [[ -f "$NODE/node.env" ]] || return 1
  # shellcheck disable=SC1091
  . "$NODE/node.env"
}

# Every cgroup hierarchy mounted under /sys/fs/cgroup (v1 controllers, the named
# systemd one, the v2 unified mount of hybrid hosts, or the v2 root itself).
hierarchies() {
  local d
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo /sys/fs/cgroup; return; fi
  for d in /sys/fs/cgroup/*/; do
    d="${d%/}"
    [[ -L "$d" ]] && continue # cpu -> cpu,cpuacct style aliases
    [[ -f "$d/cgroup.procs" ]] && echo "$d"
  done
}

# The hierarchy whose cgroup.procs lists every node process (tracking only).
track_hierarchy() {
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then echo /sys/fs/cgroup
  elif [[ -d /sys/fs/cgroup/pids ]]; then echo /sys/fs/cgroup/pids
  else echo /sys/fs/cgroup/freezer; fi
}

# Pick a free node ID (1-250): its veth, cgroup and addresses are named after it.
alloc_id() {
  local id f
  mkdir -p "$CLAIMS"
  for id in $(seq 1 250); do
    f="$CLAIMS/$id"
    if [[ -e "$f" ]]; then
      local owner; owner="$(cat "$f" 2>/dev/null || true)"
      # Stale: its run dir no longer names this id and nothing of it is on the host.
      if [[ -n "$owner" && -f "$owner/node/node.env" ]] && grep -qx "NODE_ID=$id" "$owner/node/node.env"; then continue; fi
      if ip link show "ksn${id}h" >/dev/null 2>&1 || [[ -d "$(track_hierarchy)/ks-node-$id" ]]; then continue; fi
      rm -f "$f"
    fi
    if ip link show "ksn${id}h" >/dev/null 2>&1 || [[ -d "$(track_hierarchy)/ks-node-$id" ]]; then continue; fi
    if ( set -o noclobber; echo "$RUN" >"$f" ) 2>/dev/null; then echo "$id"; return 0; fi
  done
  die "no free node id"
}

b64() { base64 -w0 <"$1"; }

# sign NAME SUBJECT EXT: a key and certificate from the cluster's CA.
sign() {
  local pki="$NODE/pki" c="$RUN/pki"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/$1.key" 2>/dev/null
  openssl req -new -key "$pki/$1.key" -subj "$2" -out "$pki/$1.csr" 2>/dev/null
  printf '%s\n' "$3" >"$pki/$1.ext"
  openssl x509 -req -in "$pki/$1.csr" -CA "$c/ca.crt" -CAkey "$c/ca.key" -CAcreateserial \
    -sha256 -days 365 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
  rm -f "$pki/$1.csr" "$pki/$1.ext"
  chmod 600 "$pki/$1.key"
}

# kubeconfig NAME: for the node's components, to the apiserver through the veth.
# The apiserver's certificate names 127.0.0.1 and `kubernetes`, not the veth
# address: tls-server-name checks it against the latter.
kubeconfig() {
  cat >"$NODE/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubeshare
  cluster:
    server: https://$HOST_IP:$API_PORT
    tls-server-name: kubernetes
    certificate-authority-data: $(b64 "$RUN/pki/ca.crt")
users:
- name: $1
  user:
    client-certificate-data: $(b64 "$NODE/pki/$1.crt")
    client-key-data: $(b64 "$NODE/pki/$1.key")
contexts:
- name: $1
  context: {cluster: kubeshare, user: $1}
current-context: $1
EOF
  chmod 600 "$NODE/$1.kubeconfig"
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$RUN/kubeconfig/admin.kubeconfig" --request-timeout=10s "$@"; }

in_node() { nsenter -t "$INIT_PID" -m -n -- "$@"; }

pid_alive() { [[ "$1" =~ ^[0-9]+$ ]] && [[ -d "/proc/$1" ]]; }

# ------------------------------------------------------------------ configs

write_configs() {
  mkdir -p "$NODE/cni-conf" "$NODE/cni-ipam" "$NODE/sysctl" "$NODE/kubeshare" "$NODE/test" "$NODE/pod-logs" \
           "$NODE/kubelet" "$NODE/containerd"
  write_containerd_config
  cat >"$NODE/cni-conf/10-kubeshare.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "kubeshare-node",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
              "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$NODE/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  write_kubelet_config
  cat >"$NODE/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $NODE/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $POD_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Leave the conntrack sysctls alone (some are global, not per network namespace).
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s, udpTimeout: 0s, udpStreamTimeout: 0s}
EOF
  write_sysctl_files
}

# The files bind-mounted over the kubelet's host sysctls (see KUBELET_SYSCTLS).
write_sysctl_files() {
  local e name value
  mkdir -p "$NODE/sysctl"
  for e in "${KUBELET_SYSCTLS[@]}"; do
    read -r name value <<<"$e"
    echo "$value" >"$NODE/sysctl/${name//\//.}"
  done
}

# NODE/containerd.toml: root, state and sockets under NODE, CNI from CNI_BIN and
# NODE/cni-conf; with CTRD_BIN (containerd 2.x), CDI on with NODE/cdi (or CDI_SPEC_DIR)
# as its only spec dir.
write_containerd_config() {
  cat >"$NODE/containerd.toml" <<EOF
version = 2
root = "$NODE/containerd/root"
state = "$NODE/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$NODE/containerd.sock"
[ttrpc]
  address = "$NODE/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$NODE/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  disable_apparmor = true
  # Negative oom_score_adj needs CAP_SYS_RESOURCE, which CI machines may lack.
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$NODE/cni-conf"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$NODE/runc"
EOF
  if [[ -n "${CTRD_BIN:-}" ]]; then
    # containerd 2.x migrates this version-2 file (these keys move to its
    # io.containerd.cri.v1.runtime plugin). One spec dir, the node's own: the
    # host's /etc/cdi and /var/run/cdi belong to the host. (CDI_SPEC_DIR: another one,
    # made by the caller where it runs containerd.)
    [[ -n "${CDI_SPEC_DIR:-}" ]] || mkdir -p "$NODE/cdi"
    awk -v dir="${CDI_SPEC_DIR:-$NODE/cdi}" '{ print }
      $0 == "[plugins.\"io.containerd.grpc.v1.cri\"]" {
        print "  enable_cdi = true"; print "  cdi_spec_dirs = [\"" dir "\"]" }' \
      "$NODE/containerd.toml" >"$NODE/containerd.toml.cdi"
    mv "$NODE/containerd.toml.cdi" "$NODE/containerd.toml"
    grep -qx '  enable_cdi = true' "$NODE/containerd.toml" || die "could not turn CDI on in $NODE/containerd.toml"
  fi
}

# NODE/kubelet.yaml. Env (hack/gpu-node.sh sets them; node.sh keeps the defaults):
# KUBELET_ADDRESS (default NODE_IP), KUBELET_PORT (10250), KUBELET_HEALTHZ_PORT (10248),
# KUBELET_SERVING_CERT (1: NODE/pki/kubelet-serving.*; 0: the kubelet makes its own),
# KUBELET_RESOLV_CONF (/etc/resolv.conf), KUBELET_CGROUP_ROOT (/ks-node-NODE_ID),
# KUBELET_CONFIG_EXTRA (YAML lines appended).
write_kubelet_config() {
  local tls=""
  if [[ "${KUBELET_SERVING_CERT:-1}" == 1 ]]; then
    tls="
tlsCertFile: $NODE/pki/kubelet-serving.crt
tlsPrivateKeyFile: $NODE/pki/kubelet-serving.key"
  fi
  cat >"$NODE/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: ${KUBELET_ADDRESS:-$NODE_IP}
port: ${KUBELET_PORT:-10250}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${KUBELET_HEALTHZ_PORT:-10248}$tls
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $RUN/pki/ca.crt}
# Only the cluster's CA signs client certificates; the apiserver (logs, exec) has one.
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://$NODE/containerd.sock
cgroupDriver: cgroupfs
# This machine (and CI's) mounts cgroup v1; kubelets from 1.35 on refuse it unless told
# (a deprecation, not a removal yet).
failCgroupV1: false
cgroupRoot: ${KUBELET_CGROUP_ROOT:-/ks-node-$NODE_ID}
cgroupsPerQOS: true
# Setting -999 needs CAP_SYS_RESOURCE; the failure would only be logged.
oomScoreAdj: 0
failSwapOn: false
podLogsDir: $NODE/pod-logs
clusterDomain: cluster.local
resolvConf: ${KUBELET_RESOLV_CONF:-/etc/resolv.conf}
# The images are imported, never pulled: keep them whatever the disk holds.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
serializeImagePulls: false
registerNode: true
maxPods: 50
EOF
  [[ -z "${KUBELET_CONFIG_EXTRA:-}" ]] || echo "$KUBELET_CONFIG_EXTRA" >>"$NODE/kubelet.yaml"
}

# ------------------------------------------------------------------ inside

# Runs as the first process of the node's namespaces (see cmd_up): waits for the
# veth, sets up the network and mounts, starts containerd, the kubelet and
# kube-proxy, and stays as their parent.
cmd_inside() {
  load_env || die "no node.env"
  local deadline=$(( $(date +%s) + 30 ))
  until ip link show "ksn${NODE_ID}n" >/dev/null 2>&1; do
    (( $(date +%s) < deadline )) || die "veth ksn${NODE_ID}n never arrived"
    sleep 0.05
  done
  ip link set lo up
  ip link set "ksn${NODE_ID}n" name eth0
  ip addr add "$NODE_IP/30" dev eth0
  ip link set eth0 up
  ip route add default via "$HOST_IP"
  echo 1 >/proc/sys/net/ipv4/ip_forward

  node_mounts

  pids=()
  trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 0' TERM INT
  # KUBESHARE_NODE_CDI: containerd finds its shim (and this script its ctr) on PATH.
  [[ -z "${CTRD_BIN:-}" ]] || export PATH="$CTRD_BIN:$PATH"
  start_containerd
  # The images come before the kubelet, so that no pod ever tries a pull.
  until [[ -e "$NODE/images.ready" ]]; do sleep 0.1; done
  "$BIN/kubelet" --config="$NODE/kubelet.yaml" --kubeconfig="$NODE/kubelet.kubeconfig" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --root-dir=/var/lib/kubelet \
    --cert-dir="$NODE/pki" --node-labels="nvidia.com/gpu.present=true" --v=2 \
    >"$NODE/logs/kubelet.log" 2>&1 &
  pids+=($!); echo $! >"$NODE/pids/kubelet.pid"
  "$BIN/kube-proxy" --config="$NODE/kube-proxy.yaml" --v=2 >"$NODE/logs/kube-proxy.log" 2>&1 &
  pids+=($!); echo $! >"$NODE/pids/kube-proxy.pid"
  wait
}

# Inside the node's mount namespace: host paths that containerd, runc, CNI and the
# kubelet write whatever their config says (shim sockets, netns files, CNI caches)
# become fresh tmpfs, gone with this mount namespace; KubeShare's host directory and
# the tests' one are NODE's; the kubelet's host sysctls are NODE's files.
node_mounts() {
  mount -t tmpfs -o mode=755 node-run /run
  mkdir -p /run/lock /run/netns
  mount -t tmpfs -o mode=755 node-var-lib /var/lib
  mount -t tmpfs -o mode=755 node-var-log /var/log
  mkdir -p /var/lib/kubeshare /var/lib/kubelet /var/lib/kubeshare-test
  mount --bind "$NODE/kubeshare" /var/lib/kubeshare
  # For tests: a hostPath they can also reach from the host (RUN_DIR/node/test).
  mount --bind "$NODE/test" /var/lib/kubeshare-test
  local e name
  for e in "${KUBELET_SYSCTLS[@]}"; do
    read -r name _ <<<"$e"
    mount --bind "$NODE/sysctl/${name//\//.}" "/proc/sys/$name"
  done
}

# Starts containerd (NODE/containerd.toml; its pid joins `pids`), waits until it
# answers, touches NODE/containerd.ready.
start_containerd() {
  containerd --config "$NODE/containerd.toml" >"$NODE/logs/containerd.log" 2>&1 &
  pids+=($!); echo $! >"$NODE/pids/containerd.pid"
  local deadline=$(( $(date +%s) + 30 ))
  until ctr -a "$NODE/containerd.sock" version >/dev/null 2>&1; do
    (( $(date +%s) < deadline )) || die "containerd did not start (see $NODE/logs/containerd.log)"
    pid_alive "${pids[0]}" || die "containerd exited (see $NODE/logs/containerd.log)"
    sleep 0.1
  done
  touch "$NODE/containerd.ready"
}

# ------------------------------------------------------------------ cgroups

# The cgroup v2 controllers the kubelet needs in its cgroupRoot (those of them the
# kernel has): its cgroupfs driver checks each cgroup it uses for all of them.
KUBELET_V2_CONTROLLERS=(cpu cpuset memory hugetlb pids)

# cgroup_tree_create NAME: NAME at the top of every hierarchy (cpuset copied from the
# parent on v1); prints the cgroup the node's processes are tracked in. On v1 that is
# NAME in the pids (or freezer) hierarchy. On v2 it is the leaf NAME/node: the kubelet
# puts pods in NAME/kubepods and must turn controllers on in NAME's subtree_control,
# which the kernel refuses while NAME itself holds processes. Controllers the root's
# subtree_control lacks are turned on there too and listed in NODE/cgroup-root-enabled
# (cgroup_tree_remove turns them off again).
cgroup_tree_create() {
  local name="$1" h
  for h in $(hierarchies); do
    mkdir -p "$h/$name"
    if [[ -f "$h/cpuset.cpus" && -f "$h/$name/cpuset.cpus" ]]; then
      cat "$h/cpuset.cpus" >"$h/$name/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h/$name/cpuset.mems"
    fi
  done
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    local root=/sys/fs/cgroup c
    : >"$NODE/cgroup-root-enabled"
    for c in "${KUBELET_V2_CONTROLLERS[@]}"; do
      grep -qw "$c" "$root/cgroup.controllers" || continue
      if ! grep -qw "$c" "$root/cgroup.subtree_control"; then
        echo "+$c" >"$root/cgroup.subtree_control" \
          || die "cannot turn on the $c controller in $root/cgroup.subtree_control (a cgroup namespace whose root holds processes?)"
        echo "$c" >>"$NODE/cgroup-root-enabled"
      fi
      echo "+$c" >"$root/$name/cgroup.subtree_control" || die "cannot turn on the $c controller in $root/$name"
    done
    mkdir -p "$root/$name/node"
    echo "$root/$name/node"
  else
    echo "$(track_hierarchy)/$name"
  fi
}

# cgroup_tree_kill NAME: SIGKILL every process in NAME's tree of the tracking hierarchy
# until it stays empty, then wait (briefly) until they are reaped.
cgroup_tree_kill() {
  local track; track="$(track_hierarchy)/$1"
  local n=0 any pid try killed=()
  while [[ -d "$track" ]]; do
    any=0
    while read -r pid; do
      [[ -n "$pid" ]] || continue
      any=1
      kill -KILL "$pid" 2>/dev/null || true
      killed+=("$pid")
    done < <(find "$track" -name cgroup.procs -exec cat {} + 2>/dev/null)
    (( any )) || break
    n=$((n + 1))
    (( n < 100 )) || { log "processes keep appearing in $track"; break; }
    sleep 0.1
  done
  # Dead and out of the cgroup; wait (briefly) until they are reaped too.
  for try in $(seq 1 50); do
    any=0
    for pid in "${killed[@]}"; do
      [[ -e "/proc/$pid" && "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] && any=1
    done
    (( any )) || break
    sleep 0.1
  done
}

# cgroup_tree_remove NAME: the empty cgroups of NAME's trees, deepest first (a
# just-killed process may hold one a moment).
cgroup_tree_remove() {
  local name="$1" h try left
  for try in $(seq 1 50); do
    left=0
    for h in $(hierarchies); do
      [[ -d "$h/$name" ]] || continue
      find "$h/$name" -depth -type d -exec rmdir {} \; 2>/dev/null || true
      [[ -d "$h/$name" ]] && left=1
    done
    (( left )) || break
    sleep 0.1
  done
  for h in $(hierarchies); do [[ -d "$h/$name" ]] && log "cgroup $h/$name could not be removed"; done
  local c
  if [[ -f "$NODE/cgroup-root-enabled" ]]; then
    for c in $(cat "$NODE/cgroup-root-enabled"); do
      echo "-$c" >/sys/fs/cgroup/cgroup.subtree_control || log "could not turn the $c controller off again at the cgroup root"
    done
    rm -f "$NODE/cgroup-root-enabled"
  fi
  return 0
}

# ------------------------------------------------------------------ commands

import_images() {
  local f
  for f in "$@"; do
    in_node "${CTRD_BIN:+$CTRD_BIN/}ctr" -a "$NODE/containerd.sock" -n k8s.io images import --no-unpack=false "$f" >>"$NODE/logs/import.log" 2>&1 \
      || { tail -n 20 "$NODE/logs/import.log" >&2; die "importing $f failed"; }
    log "imported $(basename "$f")"
  done
}

node_ready() {
  kubectl_admin get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}

# The `kubernetes` Service's endpoint: the apiserver through the veth. (The
# cluster runs with --endpoint-reconciler-type=none, so nothing else sets one.)
kubernetes_endpoint() {
  kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes-node-$NODE_ID
  namespace: default
  labels:
    kubernetes.io/service-name: kubernetes
    endpointslice.kubernetes.io/managed-by: node.sh.kubeshare.io
addressType: IPv4
endpoints:
- addresses: ["$HOST_IP"]
  conditions: {ready: true}
ports:
- {name: https, port: $API_PORT, protocol: TCP}
EOF
}

cmd_up() {
  need_root
  [[ -f "$RUN/ready" && -f "$RUN/cluster.json" ]] || die "no ready cluster in $RUN (hack/cluster.sh up $RUN)"
  local b
  for b in containerd containerd-shim-runc-v2 runc ctr ip unshare nsenter iptables conntrack openssl jq; do
    command -v "$b" >/dev/null || die "$b is required (apt-get install containerd runc iptables conntrack iproute2 util-linux)"
  done
  [[ -x "$CNI_BIN/bridge" && -x "$CNI_BIN/host-local" ]] || die "CNI plugins missing in $CNI_BIN (apt-get install containernetworking-plugins)"
  BIN="$(jq -r .bin_dir "$RUN/cluster.json")"
  for b in kubelet kube-proxy kubectl; do [[ -x "$BIN/$b" ]] || die "missing $BIN/$b (run hack/build-k8s.sh)"; done
  API_PORT="$(jq -r .ports.apiserver "$RUN/cluster.json")"
  CTRD_BIN=""
  if [[ "${KUBESHARE_NODE_CDI:-1}" != 0 ]]; then
    CTRD_BIN="$("$HACK/build-containerd.sh" | tail -n 1)"
    [[ -x "$CTRD_BIN/containerd" ]] || die "hack/build-containerd.sh gave no containerd"
  fi
  NODE="$RUN/node"
  if [[ -f "$NODE/node.env" ]]; then
    log "a node was left in $RUN; bringing it down first"
    cmd_down || true
  fi
  local t0; t0=$(date +%s%N)
  rm -rf "$NODE"
  mkdir -p "$NODE/pki" "$NODE/logs" "$NODE/pids"
  host_state >"$NODE/host-before.txt"

  NODE_ID="$(alloc_id)"
  NODE_NAME="${KUBESHARE_NODE_NAME:-kubeshare-node}"
  HOST_IP="10.250.$NODE_ID.1"
  NODE_IP="10.250.$NODE_ID.2"
  POD_CIDR="10.244.$NODE_ID.0/24"
  CGROUP="ks-node-$NODE_ID"
  cat >"$NODE/node.env" <<EOF
NODE_ID=$NODE_ID
NODE_NAME=$NODE_NAME
HOST_IP=$HOST_IP
NODE_IP=$NODE_IP
POD_CIDR=$POD_CIDR
CGROUP=$CGROUP
BIN=$BIN
API_PORT=$API_PORT
NODE=$NODE
EOF
  [[ -z "$CTRD_BIN" ]] || echo "CTRD_BIN=$CTRD_BIN" >>"$NODE/node.env"
  trap 'rc=$?; if [[ $rc != 0 ]]; then log "up failed; bringing the node down"; cmd_down || true; fi' EXIT

  sign kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  sign kubelet-serving "/CN=$NODE_NAME" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$NODE_IP,DNS:$NODE_NAME"
  sign kube-proxy "/CN=system:kube-proxy" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  kubeconfig kubelet
  kubeconfig kube-proxy
  write_configs

  # The cgroup tree: every node process is tracked in it (down kills what it
  # lists), and it is the kubelet's cgroupRoot, so pods land under it too.
  local track; track="$(cgroup_tree_create "$CGROUP")"

  (
    echo "$BASHPID" >"$track/cgroup.procs"
    exec setsid unshare --mount --net --propagation private -- "$SELF" _inside "$RUN"
  ) >"$NODE/logs/node-init.log" 2>&1 </dev/null &
  INIT_PID=$!
  echo "$INIT_PID" >"$NODE/pids/init.pid"
  echo "INIT_PID=$INIT_PID" >>"$NODE/node.env"
  local hostns; hostns="$(readlink /proc/self/ns/net)"
  local deadline=$(( $(date +%s) + 10 ))
  until [[ "$(readlink "/proc/$INIT_PID/ns/net" 2>/dev/null)" != "$hostns" && -n "$(readlink "/proc/$INIT_PID/ns/net" 2>/dev/null)" ]]; do
    pid_alive "$INIT_PID" || { cat "$NODE/logs/node-init.log" >&2; die "the node's first process exited"; }
    (( $(date +%s) < deadline )) || die "the node's namespaces did not appear"
    sleep 0.05
  done

  ip link add "ksn${NODE_ID}h" type veth peer name "ksn${NODE_ID}n"
  ip link set "ksn${NODE_ID}n" netns "$INIT_PID"
  ip addr add "$HOST_IP/30" dev "ksn${NODE_ID}h"
  ip link set "ksn${NODE_ID}h" up
  # The apiserver reaches pods (webhook endpoints, aggregator routing) through the node.
  ip route add "$POD_CIDR" via "$NODE_IP" dev "ksn${NODE_ID}h"

  wait_until "containerd" 30 test -e "$NODE/containerd.ready"
  local images="${KUBESHARE_NODE_IMAGES:-$REPO/target/images}" archives=()
  if [[ -d "$images" ]]; then mapfile -t archives < <(find "$images" -maxdepth 1 -name '*.tar' | sort); fi
  if ((${#archives[@]})); then import_images "${archives[@]}"; else log "no image archives in $images (hack/images.sh build)"; fi
  touch "$NODE/images.ready"

  kubernetes_endpoint
  wait_until "node $NODE_NAME Ready" "$TIMEOUT" node_ready

  if [[ -n "$OWNER" ]]; then
    setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec "$2" down "$3"' \
      kubeshare-node-watchdog "$OWNER" "$SELF" "$RUN" >"$NODE/logs/watchdog.log" 2>&1 </dev/null &
    echo $! >"$NODE/pids/watchdog.pid"
  fi
  trap - EXIT
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "$ms" >"$NODE/up-ms"
  log "node $NODE_NAME Ready in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s (id $NODE_ID, ip $NODE_IP, pods $POD_CIDR)"
}

# wait_until WHAT SECONDS CMD...: the node's first process must stay alive meanwhile.
wait_until() {
  local what="$1" secs="$2"; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    if ! pid_alive "$INIT_PID"; then
      tail -n 20 "$NODE/logs/node-init.log" >&2 || true
      die "the node stopped while waiting for $what (logs: $NODE/logs)"
    fi
    if (( $(date +%s) > deadline )); then
      local f; for f in "$NODE"/logs/*.log; do echo "--- $f" >&2; tail -n 15 "$f" >&2; done
      die "$what not ready after ${secs}s (logs: $NODE/logs)"
    fi
    sleep 0.2
  done
  log "$what ready"
}

cmd_down() {
  need_root
  NODE="$RUN/node"
  if ! load_env; then log "no node in $RUN"; return 0; fi
  local t0; t0=$(date +%s%N)
  local f pid
  f="$NODE/pids/watchdog.pid"
  if [[ -f "$f" ]]; then
    pid="$(cat "$f")"
    [[ "$pid" == "$$" || "$pid" == "$PPID" ]] || kill -TERM "$pid" 2>/dev/null || true
  fi
  # The Node object goes too when the cluster outlives the node.
  if [[ -f "$RUN/ready" ]]; then
    kubectl_admin delete node "$NODE_NAME" --wait=false >/dev/null 2>&1 || true
    kubectl_admin -n default delete endpointslice "kubernetes-node-$NODE_ID" --wait=false >/dev/null 2>&1 || true
  fi
  # Kill everything in the node's cgroup tree (containerd, shims, kubelet, pods),
  # until it stays empty; the namespaces die with their last process.
  cgroup_tree_kill "$CGROUP"
  ip link del "ksn${NODE_ID}h" 2>/dev/null || true
  cgroup_tree_remove "$CGROUP"
  rm -rf "$NODE/containerd" "$NODE/kubeshare" "$NODE/test" "$NODE/cni-ipam" "$NODE/runc" "$NODE/kubelet" \
    "$NODE/cdi" "$NODE/cdi-dev"
  rm -f "$NODE/node.env" "$NODE"/pids/*.pid "$NODE/containerd.ready" "$NODE/images.ready"
  [[ "$(cat "$CLAIMS/$NODE_ID" 2>/dev/null)" == "$RUN" ]] && rm -f "$CLAIMS/$NODE_ID"
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "$ms" >"$NODE/down-ms"
  log "node down in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s"
  if [[ -f "$NODE/host-before.txt" ]]; then
    host_state >"$NODE/host-after.txt"
    if ! diff -u "$NODE/host-before.txt" "$NODE/host-after.txt" >"$NODE/host-diff.txt"; then
      cat "$NODE/host-diff.txt" >&2
      die "the host differs from before the node (above; $NODE/host-diff.txt)"
    fi
    log "host state as before the node (checked: $NODE/host-after.txt)"
  fi
}

main() {
  CMD="${1:-}"
  [[ -n "$CMD" ]] || { usage >&2; exit 2; }
  shift
  case "$CMD" in
    host-state) host_state; exit 0 ;;
    -h|--help|help) usage; exit 0 ;;
  esac
  RUN="${1:-}"
  [[ -n "$RUN" ]] || { usage >&2; exit 2; }
  shift
  [[ -d "$RUN" ]] || die "no run dir $RUN"
  RUN="$(cd "$RUN" && pwd)"
  OWNER=""
  case "$CMD" in
    up)
      while [[ $# -gt 0 ]]; do
        case "$1" in
          --owner-pid) OWNER="${2:?--owner-pid needs a pid}"; shift 2 ;;
          *) die "unknown argument $1" ;;
        esac
      done
      cmd_up ;;
    down) cmd_down ;;
    _inside) cmd_inside ;;
    exec)
      load_env || die "no node in $RUN"
      exec nsenter -t "$INIT_PID" -m -n -- "$@" ;;
    import)
      load_env || die "no node in $RUN"
      import_images "$@" ;;
    *) usage >&2; exit 2 ;;
  esac
}

# Sourced (hack/gpu-node.sh reuses the node's configs, mounts, cgroups and host checks):
# only the functions above.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
