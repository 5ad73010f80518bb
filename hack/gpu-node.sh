#!/usr/bin/env bash
# KubeShare on one real GPU machine: the machine is a whole Kubernetes cluster of one
# node. etcd, kube-apiserver, kube-controller-manager and the default kube-scheduler run
# as host processes (hack/cluster.sh's command lines and certificates); containerd, runc
# and a kubelet run in a private mount namespace (hack/node.sh's configs and mounts), so
# that `down` leaves nothing; everything shares the host's network (no CNI, no
# kube-proxy, no iptables: every pod has hostNetwork), and KubeShare is installed from its
# Helm chart. Made for a GPU machine that has none of this installed and cannot download:
# `pack` (here) builds and stages every binary, image root filesystem and the rendered
# chart into xz parts of at most 55 MiB; `unpack` (there) lays them out; `up` starts it
# all; `scenarios` runs kubeshare-gpu-scenarios; `down` removes it all and checks the
# host. See docs/gpu-node.md.
#
# Usage:
#   hack/gpu-node.sh pack [--no-build] [--fast] [--part N]  build (release), stage .device-carry/gpu-node-N
#   hack/gpu-node.sh unpack N                 unpack part N into STATE
#   hack/gpu-node.sh up [--fake-gpu] [--cdi|--no-cdi] [--driver-lib-dir DIR]
#   hack/gpu-node.sh scenarios [ARGS...]      kubeshare-gpu-scenarios scenarios (its --help)
#   hack/gpu-node.sh status                   pods, nodes, warnings, the logs' tails
#   hack/gpu-node.sh down [--purge]           stop everything, remove what it made, check the host
#   hack/gpu-node.sh exec CMD...              CMD in the node's mount namespace
#   hack/gpu-node.sh host-state               what `down` compares with `up`'s snapshot
#   hack/gpu-node.sh preflight                what `up` depends on, as this machine has it
# up --fake-gpu: the fake libcuda and a fake inventory (as hack/deploy.sh sets up the CI
#   node) instead of NVML; the scenarios then run cuda-workload.
# up --cdi (the default where the packed chart has CDI values): KubeShare's device plugin
#   hands each pod its GPU through CDI, and DRA is on (pods may claim shares with
#   ResourceClaims); --no-cdi: no device plugin and no DRA, the scenarios' pods run
#   privileged (every host device).
# Env: KSGPU_STATE (default /var/tmp/ksgpu), KSGPU_NODE_IP (default: the address of the
#      default route, else the first global IPv4 address, else an alias on lo),
#      KSGPU_UP_TIMEOUT (seconds per wait, default 180); at pack: K8S_VERSION (v1.37.2),
#      KSGPU_NODE_NAME (kubeshare-gpu), KSGPU_FAKE_GPUS (1), KSGPU_CHART_SET (more
#      `--set k=v,...` for every rendering), KSGPU_XZ_PRESET (xz preset, default 9; the
#      dictionary is sized to each part so that all of it is one window).
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# hack/node.sh's functions (configs, mounts, cgroups, host checks); this script's own
# SELF, log, die, usage and cmd_* replace its ones below. hack/cluster.sh's are used only
# in subshells (cluster_call): the two define some names alike.
# shellcheck source=node.sh
. "$HACK/node.sh"
REPO="$(cd "$HACK/.." && pwd)"
SELF="$HACK/gpu-node.sh"

log() { echo "gpu-node: $*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; }

STATE="${KSGPU_STATE:-/var/tmp/ksgpu}"
# hack/node.sh's and hack/cluster.sh's run dir: the certificates are STATE/pki.
RUN="$STATE"
TIMEOUT="${KSGPU_UP_TIMEOUT:-180}"
CGROUP=ks-gpunode
# Fixed ports, apart from the CI rig's (hack/cluster.sh takes 20000-31999) and from a
# kubelet's defaults (10248, 10250): another node rig on the machine does not collide.
P_ETCD=16379 P_ETCD_PEER=16380 P_APISERVER=16443 P_KCM=16257 P_SCHED=16259
KUBELET_PORT=10350 KUBELET_HEALTHZ_PORT=10348
# KubeShare's own ports on the host network (the chart's): webhook, kube-scheduler,
# extender, node daemon.
CHART_PORTS=(8443 10259 8888 9477)
# On in every component (most are beta and on already in 1.37; KubeShare's DRA driver
# uses consumable capacity, docs/dra.md).
FEATURE_GATES="DRAConsumableCapacity=true,DRAPartitionableDevices=true,DRADeviceBindingConditions=true,DRAFractionalCapacityRange=true,ResourceHealthStatus=true"
K8S_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet)
CTRD_BINARIES=(containerd containerd-shim-runc-v2 ctr)
RUST_BINARIES=(kubeshare-gpu-scenarios)
# Images from root filesystems staged here (hack/images.sh stage), and two made at `up`:
# kube-scheduler from bin/ (not carried twice) and gpu-host (links only).
STAGED_IMAGES=(extender webhook node-daemon workload pause)
GPU_HOST_IMAGE="docker.io/kubeshare/gpu-host:latest"
# The parts: what goes where (xz of each at most PART_LIMIT). The Kubernetes binaries
# together: one xz stream whose dictionary holds them all stores their shared code
# once (the four compress to 44 MiB together; docs/gpu-node.md).
PART_LIMIT=$((55 << 20))
PARTS=(
  "bin/kube-apiserver bin/kube-controller-manager bin/kube-scheduler bin/kubelet bin/etcd"
  "bin/containerd bin/containerd-shim-runc-v2 bin/ctr bin/runc bin/kubeshare-gpu-scenarios rootfs chart pki images.tsv pack.env"
)
RUNC_VERSION=v1.5.3

# --------------------------------------------------------------- helpers

runner() { "$STATE/bin/kubeshare-gpu-scenarios" --kubeconfig "$STATE/kubeconfig/admin.kubeconfig" "$@"; }

# tcp_listening PORT: something listens on PORT (any address, IPv4 or IPv6).
tcp_listening() {
  local hex; hex="$(printf '%04X' "$1")"
  grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:0000 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

py() {
  local p
  for p in "${KSGPU_PYTHON:-}" /usr/bin/python3 python3 /opt/torch/.venv/bin/python; do
    [[ -n "$p" ]] && command -v "$p" >/dev/null 2>&1 && { "$p" "$@"; return; }
  done
  die "no python3 found (set KSGPU_PYTHON)"
}

# cluster_call CMD...: CMD with hack/cluster.sh's functions, in a subshell, with this
# rig's run dir, binaries and ports, and readiness checks that need no curl.
cluster_call() {
  (
    # shellcheck source=cluster.sh
    . "$HACK/cluster.sh"
    RUN="$STATE" BIN="$STATE/bin" API_BIND=127.0.0.1
    # (cluster.sh's TIMEOUT is its own env's; this rig's applies.)
    TIMEOUT="${KSGPU_UP_TIMEOUT:-180}"
    IDENTITIES+=("kubelet system:node:$NODE_NAME system:nodes")
    export KUBESHARE_FEATURE_GATES="$FEATURE_GATES"
    etcd_healthy() { tcp_listening "$P_ETCD"; }
    api_ready() { runner wait-api --timeout-secs 1 --apiserver-only >/dev/null 2>&1; }
    log() { echo "gpu-node: $*" >&2; }
    "$@"
  )
}

load_pack_env() {
  [[ -f "$STATE/pack.env" ]] || die "no $STATE/pack.env: unpack the parts first (hack/gpu-node.sh unpack N)"
  # shellcheck disable=SC1091
  . "$STATE/pack.env"
}

load_up_env() {
  [[ -f "$STATE/up.env" ]] || return 1
  # shellcheck disable=SC1091
  . "$STATE/up.env"
}

# The node's address: the source address of the default route, else the first global
# IPv4 address, else none (then `up` adds an alias on lo).
detect_node_ip() {
  if [[ -n "${KSGPU_NODE_IP:-}" ]]; then echo "$KSGPU_NODE_IP"; return; fi
  local ip
  ip="$(py - <<'EOF' 2>/dev/null || true
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("198.51.100.1", 9))  # routing only: a UDP connect sends nothing
print(s.getsockname()[0])
EOF
)"
  if [[ -z "$ip" || "$ip" == 127.* ]]; then
    # /proc/net/fib_trie: a "/32 host LOCAL" line follows each local address.
    ip="$(awk '/\|--/ {a=$2} /\/32 host LOCAL/ && a !~ /^127\./ {print a; exit}' /proc/net/fib_trie 2>/dev/null || true)"
  fi
  echo "$ip"
}

# lo_alias add|del IP: an address on lo (lo:ksgpu) for hosts with no other, through the
# ioctls ifconfig uses (no `ip` there).
lo_alias() {
  py - "$1" "$2" <<'EOF'
import fcntl, socket, struct, sys
op, ip = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
name = b"lo:ksgpu"
def ifreq(addr):
    return struct.pack("16sH2s4s8s", name, socket.AF_INET, b"\0\0", socket.inet_aton(addr), b"\0" * 8)
if op == "add":
    fcntl.ioctl(s, 0x8916, ifreq(ip))                  # SIOCSIFADDR
    fcntl.ioctl(s, 0x891C, ifreq("255.255.255.255"))   # SIOCSIFNETMASK
else:
    flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", name, 0, b"\0" * 14)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", name, flags & ~1, b"\0" * 14))  # SIOCSIFFLAGS, not UP
EOF
}

# ------------------------------------------------------------ host state

# What this rig could leave behind, in a form that diffs cleanly; only what no one
# else on the machine changes (other node rigs may run beside it), so `down` can be strict.
gpu_host_state() {
  host_state_sysctls
  host_state_paths
  host_state_cgroups "$CGROUP"
  [[ ! -f /sys/fs/cgroup/cgroup.subtree_control ]] \
    || echo "cgroup root subtree_control: $(cat /sys/fs/cgroup/cgroup.subtree_control)"
  echo "# mounts naming $STATE or $CGROUP"
  grep -F -e "$STATE" -e "$CGROUP" /proc/self/mountinfo | awk '{print $5}' | sort || true
  echo "# processes of the rig (command line naming $STATE, or in /$CGROUP)"
  rig_processes | sort | uniq -c
  echo "# ports of the rig listening"
  local p
  for p in "$P_ETCD" "$P_ETCD_PEER" "$P_APISERVER" "$P_KCM" "$P_SCHED" "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" "${CHART_PORTS[@]}"; do
    tcp_listening "$p" && echo "listening $p"
  done
  echo "# the node's address alias"
  awk '/\|--/ {a=$2} /\/32 host LOCAL/ && a == "10.255.255.254" {print "local address " a}' /proc/net/fib_trie 2>/dev/null | sort -u
}

rig_processes() {
  local d cmd cg st
  for d in /proc/[0-9]*; do
    cmd="$(tr '\0' ' ' 2>/dev/null <"$d/cmdline")" || continue
    cg="$(cat "$d/cgroup" 2>/dev/null)" || continue
    read -r st 2>/dev/null <"$d/stat" || continue
    [[ "${st##*) }" == Z* ]] && continue
    # This script's own processes are not the rig's (its `_inside` is, by its cgroup).
    if { [[ "$cmd" == *"$STATE"* && "$cmd" != *gpu-node.sh* ]] || [[ "$cg" == *"/$CGROUP/"* || "$cg" == *"/$CGROUP" ]]; }; then
      st="${st#*(}"
      echo "${st%)*}"
    fi
  done
}

# ------------------------------------------------------------------ pack

# A static runc (its release's build: glibc and libseccomp linked in), so the GPU machine
# needs no libseccomp of its own; cached like the other binaries.
build_runc() {
  local root="${KUBESHARE_CACHE:-$HOME/.cache/kubeshare}/runc-$RUNC_VERSION"
  if [[ -x "$root/bin/runc" ]]; then echo "$root/bin/runc"; return; fi
  log "building a static runc $RUNC_VERSION (once; cached in $root)"
  command -v go >/dev/null || die "go is needed to build runc"
  mkdir -p "$root/seccomp"
  (cd "$root" && apt-get download libseccomp-dev >&2) || die "apt-get download libseccomp-dev failed"
  dpkg -x "$root"/libseccomp-dev_*.deb "$root/seccomp"
  local sc="$root/seccomp/usr" pc
  pc="$(dirname "$(find "$sc" -name libseccomp.pc | head -n 1)")"
  sed -i "s|^prefix=.*|prefix=$sc|" "$pc/libseccomp.pc"
  GOPATH="$root/go" GOCACHE="$root/go-cache" GOTOOLCHAIN=local GOFLAGS=-mod=mod \
    PKG_CONFIG_PATH="$pc" CGO_ENABLED=1 GOBIN="$root/bin" \
    go install -trimpath -tags "seccomp urfave_cli_no_docs netgo osusergo" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -extldflags -static" \
    "github.com/opencontainers/runc@$RUNC_VERSION" >&2
  if ldd "$root/bin/runc" >/dev/null 2>&1; then die "runc is not static"; fi
  go clean -cache -modcache >/dev/null 2>&1 || true
  rm -rf "$root/go" "$root/go-cache"
  echo "$root/bin/runc"
}

# render NAME [--set ...]: the chart as this node installs it, into STAGE/chart/NAME.yaml.
render() {
  local name="$1"; shift
  local extra=()
  [[ -z "${KSGPU_CHART_SET:-}" ]] || extra=(--set "$KSGPU_CHART_SET")
  "$HELM" template kubeshare "$REPO/charts/kubeshare" --namespace kubeshare-system \
    --set createNamespace=true --set hostNetwork=true \
    --set k8sServiceHost=127.0.0.1 --set k8sServicePort="$P_APISERVER" \
    --set scheduler.replicas=1 --set webhook.replicas=1 \
    --set images.kubeScheduler="registry.k8s.io/kube-scheduler:$K8S_VERSION" \
    "$@" "${extra[@]}" >"$STAGE/chart/$name.yaml"
}

# The fake inventory hack/deploy.sh makes for the CI node's first GPU node (H100s).
fake_inventory() {
  local gpus="$1" j sep="" list=""
  for ((j = 0; j < gpus; j++)); do
    list+="$sep{\"uuid\":\"GPU-0000$(printf '%04d' "$j")-5ba7-4e1d-9c0f-6b1e2d3c4a50\",\"index\":$j,\"model\":\"NVIDIA-H100-80GB-HBM3\",\"memory\":$((80 << 30))}"
    sep=","
  done
  cat <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: kubeshare-fake-inventory
  namespace: kubeshare-system
data:
  $NODE_NAME.json: '{"gpus":[$list]}'
EOF
}

cmd_pack() {
  local build=1 fast=0 only=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --no-build) build=0; shift ;;
      # Compress only these parts (the others are kept as they are): part 1 holds only
      # Kubernetes' binaries, so a change to KubeShare needs part 2 alone.
      --part) only+=("${2:?--part needs a number}"); shift 2 ;;
      # For trying the scripts: xz's fastest preset, parts may then be over the limit.
      --fast) fast=1; KSGPU_XZ_PRESET=0; shift ;;
      *) die "pack: unknown argument $1" ;;
    esac
  done
  local b t0 tb
  for b in xz tar sha256sum openssl gcc umoci busybox; do command -v "$b" >/dev/null || die "pack needs $b"; done
  K8S_VERSION="${K8S_VERSION:-v1.37.2}"
  NODE_NAME="${KSGPU_NODE_NAME:-kubeshare-gpu}"
  t0=$(date +%s)
  local k8s ctrd runc target="${CARGO_TARGET_DIR:-$REPO/target}/release"
  k8s="$(K8S_VERSION="$K8S_VERSION" "$HACK/build-k8s.sh" | tail -n 1)"
  ctrd="$("$HACK/build-containerd.sh" | tail -n 1)"
  HELM="${HELM:-$("$HACK/build-helm.sh" | tail -n 1)}"
  runc="$(build_runc)"
  if (( build )); then
    tb=$(date +%s)
    # No LTO and no symbols: thin LTO made the release link take over 20 min on the CI
    # machine's 2 cores (docs/node.md), and symbols are most of the carried size.
    export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_STRIP=symbols
    cargo build --release --locked -p kubeshare-scheduler -p kubeshare-webhook \
      -p kubeshare-node-daemon -p gem-schd -p gemhook -p fake-libcuda >&2
    cargo build --release --locked -p kubeshare-testkit --bin kubeshare-gpu-scenarios >&2
    log "cargo build --release: $(( $(date +%s) - tb ))s"
  fi
  STAGE="$REPO/target/gpu-node/stage"
  rm -rf "$STAGE"
  mkdir -p "$STAGE/bin" "$STAGE/rootfs" "$STAGE/chart"
  for b in "${K8S_BINARIES[@]}"; do cp "$k8s/$b" "$STAGE/bin/"; done
  for b in "${CTRD_BINARIES[@]}"; do cp "$ctrd/$b" "$STAGE/bin/"; done
  cp "$runc" "$STAGE/bin/runc"
  for b in "${RUST_BINARIES[@]}"; do cp "$target/$b" "$STAGE/bin/"; done
  KUBESHARE_IMAGES_PROFILE=release K8S_VERSION="$K8S_VERSION" "$HACK/images.sh" stage "$STAGE/.images" "${STAGED_IMAGES[@]}"
  for b in "${STAGED_IMAGES[@]}"; do mv "$STAGE/.images/$b/rootfs" "$STAGE/rootfs/$b"; done
  rm -rf "$STAGE/.images"
  { K8S_VERSION="$K8S_VERSION" "$HACK/images.sh" list
    echo "gpu-host|$GPU_HOST_IMAGE|/bin/sh|0:0|PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin|no"
  } >"$STAGE/images.tsv"
  # The chart, rendered here (helm is 86 MB; the rendering is a few kB): for NVML on the
  # host's driver, for the fake GPU, and for CDI where the chart has its values.
  render gpu --set nodeDaemon.driverLibDir=/usr/local/nvidia/lib64
  render fake --set nodeDaemon.fakeInventoryConfigMap=kubeshare-fake-inventory \
    --set nodeDaemon.fakeGpuDir=/var/lib/kubeshare-test
  fake_inventory "${KSGPU_FAKE_GPUS:-1}" >"$STAGE/chart/fake-inventory.yaml"
  if grep -q '^cdi:' "$REPO/charts/kubeshare/values.yaml"; then
    # GPUs through CDI: the node daemon's kubeshare.io/gpu device plugin hands each pod its
    # GPU as a CDI device (spec in /var/run/cdi, containerd's spec dir here), the webhook
    # asks for it; on the fake GPU with stand-in device nodes, as the CI node does.
    # With DRA too where the chart has it (docs/dra.md): the node daemon runs with --dra
    # (a kubelet plugin in the kubelet's /var/lib/kubelet, the claims' CDI specs in the same
    # spec dir) and the DeviceClass is installed, so pods may also claim shares
    # (scenario `claims`); label pods are placed as before. The feature gates above are on.
    local dra=()
    ! grep -q '^dra:' "$REPO/charts/kubeshare/values.yaml" || dra=(--set dra.enabled=true)
    render cdi --set nodeDaemon.driverLibDir=/usr/local/nvidia/lib64 --set cdi.enabled=true "${dra[@]}"
    render fake-cdi --set nodeDaemon.fakeInventoryConfigMap=kubeshare-fake-inventory \
      --set nodeDaemon.fakeGpuDir=/var/lib/kubeshare-test \
      --set cdi.enabled=true --set cdi.devDir=/var/lib/kubeshare-test/cdi-dev "${dra[@]}"
  fi
  # The certificates (hack/cluster.sh's, plus the kubelet's client identity): openssl
  # is not needed there.
  STAGE="$STAGE" NODE_NAME="$NODE_NAME" cluster_call_pki
  cat >"$STAGE/pack.env" <<EOF
NODE_NAME=$NODE_NAME
K8S_VERSION=$K8S_VERSION
FAKE_GPUS=${KSGPU_FAKE_GPUS:-1}
PARTS=${#PARTS[@]}
PACKED="$(date -u +%FT%TZ) $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo ?)"
EOF
  log "staged in $(( $(date +%s) - t0 ))s: $(du -sh "$STAGE" | cut -f1)"

  local out="$REPO/.device-carry" i pids=() tx
  mkdir -p "$out"
  tx=$(date +%s)
  for i in "${!PARTS[@]}"; do
    local n=$((i + 1)) dir="$out/gpu-node-$((i + 1))" mib
    if ((${#only[@]})) && [[ " ${only[*]} " != *" $n "* ]]; then
      [[ -f "$dir/part.tar.xz" ]] || die "part $n was never packed (pack without --part)"
      continue
    fi
    rm -rf "$dir"; mkdir -p "$dir"
    # shellcheck disable=SC2086
    mib=$(( ($(cd "$STAGE" && du -scb ${PARTS[$i]} | tail -n 1 | cut -f1) >> 20) + 1 ))
    (( mib >= 8 )) || mib=8
    # shellcheck disable=SC2086
    ( tar -C "$STAGE" --owner=0 --group=0 --numeric-owner -cf - ${PARTS[$i]} \
        | xz --lzma2=preset="${KSGPU_XZ_PRESET:-9}",dict="${mib}MiB" -T1 >"$dir/part.tar.xz"
      (cd "$dir" && sha256sum part.tar.xz >SHA256SUMS)
      echo "part $n of ${#PARTS[@]}: ${PARTS[$i]}" >"$dir/INFO" ) &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || die "compressing a part failed"; done
  local report="$out/gpu-node-sizes.txt" f sz over=0
  {
    echo "# hack/gpu-node.sh pack, $(date -u +%FT%TZ); xz preset ${KSGPU_XZ_PRESET:-9}, parts in parallel: $(( $(date +%s) - tx ))s"
    echo "# staged (uncompressed) sizes, bytes:"
    (cd "$STAGE" && du -sb bin/* rootfs/* chart pki)
    for i in "${!PARTS[@]}"; do
      f="$out/gpu-node-$((i + 1))/part.tar.xz"
      sz=$(stat -c %s "$f")
      echo "part $((i + 1)): $sz bytes ($((sz >> 20)) MiB), limit $PART_LIMIT: ${PARTS[$i]}"
      (( sz <= PART_LIMIT )) || over=1
    done
  } >"$report"
  cat "$report" >&2
  if (( over )); then
    (( fast )) || die "a part is over $((PART_LIMIT >> 20)) MiB: move items to another part (PARTS in $SELF)"
    log "a part is over $((PART_LIMIT >> 20)) MiB (--fast: xz preset 0)"
  fi
  log "packed in $(( $(date +%s) - t0 ))s: carry .device-carry/gpu-node-1 … gpu-node-${#PARTS[@]}"
}

# gen_pki of hack/cluster.sh into STAGE/pki, with the kubelet's identity added.
cluster_call_pki() {
  (
    # shellcheck source=cluster.sh
    . "$HACK/cluster.sh"
    RUN="$STAGE"
    IDENTITIES+=("kubelet system:node:$NODE_NAME system:nodes")
    gen_pki
  )
}

# ---------------------------------------------------------------- unpack

cmd_unpack() {
  local n="${1:?unpack needs a part number}" dir
  dir="$REPO/.device-carry/gpu-node-$n"
  [[ -f "$dir/part.tar.xz" ]] || die "no $dir/part.tar.xz (carry .device-carry/gpu-node-$n)"
  local t0; t0=$(date +%s%N)
  (cd "$dir" && sha256sum -c --quiet SHA256SUMS) || die "$dir/part.tar.xz is damaged"
  mkdir -p "$STATE/parts"
  if command -v xz >/dev/null; then
    tar -C "$STATE" -xJf "$dir/part.tar.xz"
  else
    # No xz on the machine: Python's lzma reads it.
    py -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 20)' \
      "$dir/part.tar.xz" | tar -C "$STATE" -xf -
  fi
  cp "$dir/INFO" "$STATE/parts/$n"
  log "unpacked part $n into $STATE in $(( ($(date +%s%N) - t0) / 1000000 )) ms ($(cat "$dir/INFO"))"
  # Each binary runs here (not a noexec mount, not damaged): its version line.
  local item out flag
  for item in $(cut -d: -f2- "$dir/INFO"); do
    case "$item" in
      bin/containerd-shim-runc-v2) flag=-v ;;
      bin/kubeshare-gpu-scenarios) flag=--help ;;
      bin/*) flag=--version ;;
      *) continue ;;
    esac
    if ! out="$("$STATE/$item" "$flag" 2>&1)"; then
      die "$STATE/$item does not run here: $(head -n 2 <<<"$out")"
    fi
    log "  $item: $(head -n 1 <<<"$out")"
  done
}

# ---------------------------------------------------------------- images

# oci_archive NAME REF ENTRYPOINT USER ENV ROOTFS OUT: ROOTFS as a one-layer OCI image
# archive (uncompressed layer), the index's ref.name the full reference as
# hack/images.sh writes it (containerd imports by it). Needs only tar and sha256sum.
oci_archive() {
  local name="$1" ref="$2" entry="$3" user="$4" env="$5" rootfs="$6" out="$7"
  local w="$STATE/images/.work-$name"
  rm -rf "$w"; mkdir -p "$w/blobs/sha256"
  tar -C "$rootfs" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf "$w/layer.tar" .
  local layer lsize envjson="" e cfg csum msum man
  layer="$(sha256sum "$w/layer.tar" | cut -d' ' -f1)"
  lsize="$(stat -c %s "$w/layer.tar")"
  mv "$w/layer.tar" "$w/blobs/sha256/$layer"
  if [[ -n "$env" ]]; then
    local envs; IFS=',' read -ra envs <<<"$env"
    for e in "${envs[@]}"; do envjson+="${envjson:+,}\"$e\""; done
  fi
  cfg="{\"architecture\":\"amd64\",\"os\":\"linux\",\"config\":{\"User\":\"$user\",\"Entrypoint\":[\"$entry\"]${envjson:+,\"Env\":[$envjson]}},\"rootfs\":{\"type\":\"layers\",\"diff_ids\":[\"sha256:$layer\"]}}"
  csum="$(printf '%s' "$cfg" | sha256sum | cut -d' ' -f1)"
  printf '%s' "$cfg" >"$w/blobs/sha256/$csum"
  man="{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:$csum\",\"size\":${#cfg}},\"layers\":[{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$layer\",\"size\":$lsize}]}"
  msum="$(printf '%s' "$man" | sha256sum | cut -d' ' -f1)"
  printf '%s' "$man" >"$w/blobs/sha256/$msum"
  printf '%s' "{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.index.v1+json\",\"manifests\":[{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:$msum\",\"size\":${#man},\"annotations\":{\"org.opencontainers.image.ref.name\":\"$ref\"}}]}" >"$w/index.json"
  printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$w/oci-layout"
  tar -C "$w" -cf "$out" oci-layout index.json blobs
  rm -rf "$w"
}

# Every image of images.tsv as an OCI archive in STATE/images.
build_images() {
  local name ref entry user env _ root
  mkdir -p "$STATE/images"
  while IFS='|' read -r name ref entry user env _; do
    root="$STATE/rootfs/$name"
    case "$name" in
      kube-scheduler)
        # The host's own kube-scheduler binary, not a second copy in the parts.
        root="$STATE/images/.rootfs-kube-scheduler"
        rm -rf "$root"; mkdir -p "$root/usr/local/bin" "$root/tmp"; chmod 1777 "$root/tmp"
        ln "$STATE/bin/kube-scheduler" "$root/usr/local/bin/kube-scheduler" 2>/dev/null \
          || cp "$STATE/bin/kube-scheduler" "$root/usr/local/bin/kube-scheduler" ;;
      gpu-host)
        # For pods running the host's programs from read-only hostPath mounts of /usr (and
        # PyTorch's tree): the merged-/usr links a Debian/Ubuntu root has, and empty dirs.
        root="$STATE/images/.rootfs-gpu-host"
        rm -rf "$root"; mkdir -p "$root"/{usr,etc,opt,dev,proc,sys,root,var/tmp,tmp}
        chmod 1777 "$root/tmp" "$root/var/tmp"
        ln -s usr/bin "$root/bin"; ln -s usr/sbin "$root/sbin"
        ln -s usr/lib "$root/lib"; ln -s usr/lib64 "$root/lib64"
        echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
        echo "root:x:0:" >"$root/etc/group" ;;
    esac
    [[ -d "$root" ]] || die "no root filesystem for image $name ($root)"
    oci_archive "$name" "$ref" "$entry" "$user" "$env" "$root" "$STATE/images/$name.tar"
  done <"$STATE/images.tsv"
  rm -rf "$STATE/images/.rootfs-"*
}

import_images() {
  local f
  for f in "$STATE"/images/*.tar; do
    "$STATE/bin/ctr" -a "$NODE/containerd.sock" -n k8s.io images import --no-unpack=false "$f" \
      >>"$NODE/logs/import.log" 2>&1 || { tail -n 20 "$NODE/logs/import.log" >&2; die "importing $f failed"; }
  done
}

# ------------------------------------------------------------------- up

# The node's configs: hack/node.sh's writers with this rig's ports, paths and cgroup.
write_node_configs() {
  mkdir -p "$NODE"/{cni-conf,cni-bin,sysctl,kubeshare,test,pod-logs,kubelet,containerd,logs,pids,pki}
  # containerd 2.x (CTRD_BIN: CDI on); its spec dir inside the node's tmpfs /run, where
  # a node daemon writing to the usual /var/run/cdi puts it; no CNI plugin is ever run.
  CTRD_BIN="$STATE/bin" CDI_SPEC_DIR=/var/run/cdi CNI_BIN="$NODE/cni-bin" write_containerd_config
  # containerd's CRI reports the network ready (and so the kubelet the Node) only with a
  # CNI config loaded; every pod here has hostNetwork, so no plugin of it ever runs.
  cat >"$NODE/cni-conf/10-hostnetwork-only.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "hostnetwork-only", "plugins": [{"type": "loopback"}]}
EOF
  cat /etc/resolv.conf >"$NODE/resolv.conf" 2>/dev/null || : >"$NODE/resolv.conf"
  local gates="featureGates:" g
  for g in ${FEATURE_GATES//,/ }; do gates+=$'\n'"  ${g%%=*}: ${g#*=}"; done
  KUBELET_ADDRESS="$NODE_IP" KUBELET_PORT="$KUBELET_PORT" KUBELET_HEALTHZ_PORT="$KUBELET_HEALTHZ_PORT" \
    KUBELET_SERVING_CERT=0 KUBELET_RESOLV_CONF="$NODE/resolv.conf" KUBELET_CONFIG_EXTRA="$gates" \
    KUBELET_CGROUP_ROOT="/$CGROUP" write_kubelet_config
  write_sysctl_files
}

cmd_up() {
  local fake=0 cdi="" libdir=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --fake-gpu) fake=1; shift ;;
      --cdi) cdi=1; shift ;;
      --no-cdi) cdi=0; shift ;;
      --driver-lib-dir) libdir="${2:?}"; shift 2 ;;
      *) die "up: unknown argument $1" ;;
    esac
  done
  need_root
  local b
  for b in unshare nsenter setsid mount tar sha256sum base64 awk sed grep find; do
    command -v "$b" >/dev/null || die "up needs $b"
  done
  load_pack_env
  local n
  for ((n = 1; n <= PARTS; n++)); do [[ -f "$STATE/parts/$n" ]] || die "part $n is not unpacked (hack/gpu-node.sh unpack $n)"; done
  ! load_up_env || die "already up in $STATE (hack/gpu-node.sh down first)"
  for b in "$P_ETCD" "$P_APISERVER" "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" "${CHART_PORTS[@]}"; do
    ! tcp_listening "$b" || die "port $b is taken on this machine"
  done
  local t0; t0=$(date +%s%N)
  NODE="$STATE/node"
  rm -rf "$NODE" "$STATE/logs" "$STATE/pids" "$STATE/images" "$STATE/etcd" "$STATE/kubeconfig" "$STATE/config"
  mkdir -p "$NODE/logs" "$STATE/logs" "$STATE/pids"
  gpu_host_state >"$STATE/host-before.txt"

  # GPUs through CDI where the packed chart has it, unless --no-cdi.
  if [[ -z "$cdi" ]]; then
    if [[ -f "$STATE/chart/cdi.yaml" ]]; then cdi=1; else cdi=0; fi
  fi
  local manifest="$STATE/chart/gpu.yaml" extra=()
  (( ! cdi )) || manifest="$STATE/chart/cdi.yaml"
  if (( fake )); then
    manifest="$STATE/chart/fake.yaml"; extra=("$STATE/chart/fake-inventory.yaml")
    (( ! cdi )) || manifest="$STATE/chart/fake-cdi.yaml"
  fi
  [[ -f "$manifest" ]] || die "--cdi: this pack's chart has no CDI values (no $manifest)"
  if (( ! fake )); then
    # NVML for the node daemon: the driver's library dir (the chart was rendered with
    # /usr/local/nvidia/lib64).
    local d
    if [[ -z "$libdir" ]]; then
      for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64; do
        [[ -e "$d/libnvidia-ml.so.1" ]] && { libdir="$d"; break; }
      done
    fi
    [[ -n "$libdir" && -e "$libdir/libnvidia-ml.so.1" ]] || die "no libnvidia-ml.so.1 found (--driver-lib-dir DIR)"
    sed "s#/usr/local/nvidia/lib64#$libdir#g" "$manifest" >"$STATE/chart/deploy.yaml"
    manifest="$STATE/chart/deploy.yaml"
  fi
  if ! grep -q '^Seccomp_filters:' /proc/self/status; then
    # A kernel without seccomp filters: containerd refuses a pod that asks for the
    # runtime's default profile (the chart's kubeshare-scheduler does).
    log "this kernel has no seccomp filters: the chart's seccompProfile RuntimeDefault is dropped"
    sed '/seccompProfile: {type: RuntimeDefault}/d' "$manifest" >"$STATE/chart/deploy-noseccomp.yaml"
    manifest="$STATE/chart/deploy-noseccomp.yaml"
  fi

  NODE_IP="$(detect_node_ip)"
  local alias=""
  if [[ -z "$NODE_IP" ]]; then
    NODE_IP=10.255.255.254 alias=1
    lo_alias add "$NODE_IP" || die "no address for the node and none could be added to lo"
  fi
  cat >"$STATE/up.env" <<EOF
NODE_IP=$NODE_IP
NODE_ALIAS=$alias
FAKE=$fake
CDI=$cdi
DRIVER_LIB_DIR=$libdir
EOF
  trap 'rc=$?; if [[ $rc != 0 ]]; then log "up failed (logs: $STATE/logs, $NODE/logs); bringing it down"; cmd_down --keep-logs || true; fi' EXIT
  log "node $NODE_NAME at $NODE_IP, state $STATE, $( ((fake)) && echo fake GPU || echo "NVML from $libdir")"

  # The images are built while the control plane starts.
  build_images >"$STATE/logs/images.log" 2>&1 &
  local images_pid=$!

  cluster_call write_kubeconfigs
  cluster_call write_default_scheduler_config
  cluster_call start_etcd_apiserver
  cluster_call start_kcm
  cluster_call start_default_scheduler

  write_node_configs
  local track; track="$(cgroup_tree_create "$CGROUP")"
  (
    echo "$BASHPID" >"$track/cgroup.procs"
    exec setsid unshare --mount --propagation private -- "$SELF" _inside
  ) >"$NODE/logs/node-init.log" 2>&1 </dev/null &
  INIT_PID=$!
  echo "INIT_PID=$INIT_PID" >>"$STATE/up.env"
  wait_node_part containerd test -e "$NODE/containerd.ready"
  wait "$images_pid" || { cat "$STATE/logs/images.log" >&2; die "building the images failed"; }
  import_images
  touch "$NODE/images.ready"
  log "images imported ($(ls "$STATE/images" | wc -l))"

  runner wait-api --timeout-secs "$TIMEOUT"
  runner wait-node "$NODE_NAME" --timeout-secs "$TIMEOUT"
  if (( fake )); then
    install -D -m 0755 "$STATE/rootfs/workload/usr/lib/x86_64-linux-gnu/libcuda.so.1" "$NODE/test/lib/libnvidia-ml.so.1"
    if (( cdi )); then
      # Stand-in device nodes for the CDI spec to name (as hack/deploy.sh makes them for
      # the CI node): the runtime copies their type and numbers; nothing opens them.
      local j dev="$NODE/test/cdi-dev"
      mkdir -p "$dev"
      for ((j = 0; j < ${FAKE_GPUS:-1}; j++)); do mknod "$dev/nvidia$j" c 195 "$j"; done
      mknod "$dev/nvidiactl" c 195 255
    fi
  fi
  runner deploy --node "$NODE_NAME" --timeout-secs "$TIMEOUT" "${extra[@]}" "$manifest"
  trap - EXIT
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "$ms" >"$STATE/up-ms"
  log "up in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s: KubeShare on $NODE_NAME ($(basename "$manifest" .yaml), GPUs $( ((cdi)) && echo "through CDI" || echo "to privileged pods"))"
}

# wait_node_part WHAT CMD...: until CMD succeeds; the node's first process must live.
wait_node_part() {
  local what="$1"; shift
  local deadline=$(( $(date +%s) + TIMEOUT ))
  until "$@" >/dev/null 2>&1; do
    [[ -d "/proc/$INIT_PID" ]] || { tail -n 30 "$NODE/logs/node-init.log" "$NODE"/logs/containerd.log >&2 || true; die "the node stopped while waiting for $what"; }
    (( $(date +%s) < deadline )) || die "$what not ready after ${TIMEOUT}s (logs: $NODE/logs)"
    sleep 0.1
  done
}

# The node's first process, in its own mount namespace: tmpfs over the paths the
# runtime and the kubelet write whatever their config says (hack/node.sh's), and over
# containerd's root (overlayfs needs an upper dir it supports: tmpfs is one anywhere).
cmd_inside() {
  load_pack_env
  load_up_env || die "no up.env"
  NODE="$STATE/node"
  node_mounts
  mkdir -p /run/cdi
  mount -t tmpfs -o mode=700 ksgpu-containerd "$NODE/containerd"
  export PATH="$STATE/bin:$PATH"
  pids=()
  trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 0' TERM INT
  start_containerd
  until [[ -e "$NODE/images.ready" ]]; do sleep 0.1; done
  "$STATE/bin/kubelet" --config="$NODE/kubelet.yaml" --kubeconfig="$STATE/kubeconfig/kubelet.kubeconfig" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --root-dir=/var/lib/kubelet \
    --cert-dir="$NODE/pki" --node-labels="nvidia.com/gpu.present=true" --v=2 \
    >"$NODE/logs/kubelet.log" 2>&1 &
  pids+=($!); echo $! >"$NODE/pids/kubelet.pid"
  wait
}

# ------------------------------------------------------------- preflight

# What `up` depends on, as this machine has it; changes nothing. Exits non-zero on a
# blocker (a missing tool, no usable cgroup controllers, a port taken).
cmd_preflight() {
  local bad=0 b d
  say() { printf '%-22s %s\n' "$1" "$2"; }
  [[ "$(id -u)" == 0 ]] || { say root "NO"; bad=1; }
  for b in unshare nsenter setsid mount tar sha256sum base64 awk sed grep find tr; do
    command -v "$b" >/dev/null || { say "tool $b" missing; bad=1; }
  done
  say xz "$(command -v xz || echo "none (unpack uses Python's lzma)")"
  say python "$(for p in "${KSGPU_PYTHON:-}" /usr/bin/python3 python3 /opt/torch/.venv/bin/python; do [[ -n "$p" ]] && command -v "$p" && break; done || echo none)"
  say kernel "$(uname -r)"
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    say cgroup "v2; controllers: $(cat /sys/fs/cgroup/cgroup.controllers)"
    say "cgroup subtree" "$(cat /sys/fs/cgroup/cgroup.subtree_control)"
    say "cgroup root procs" "$(wc -l </sys/fs/cgroup/cgroup.procs) (of this namespace's root; $(cut -d: -f3 /proc/self/cgroup) is ours)"
    for b in cpu memory pids; do
      grep -qw "$b" /sys/fs/cgroup/cgroup.controllers || { say "cgroup $b" "missing"; bad=1; }
    done
  else
    say cgroup "v1: $(ls /sys/fs/cgroup | tr '\n' ' ')"
  fi
  say seccomp "$(grep -E '^Seccomp(_filters)?:' /proc/self/status | tr '\n\t' '  ')"
  say overlayfs "$(grep -qw overlay /proc/filesystems && echo yes || echo "not loaded (modprobe overlay?)")"
  say "node address" "$(detect_node_ip || true) $([[ -n "$(detect_node_ip || true)" ]] || echo "(none: up adds 10.255.255.254 on lo)")"
  for b in "$P_ETCD" "$P_ETCD_PEER" "$P_APISERVER" "$P_KCM" "$P_SCHED" "$KUBELET_PORT" "$KUBELET_HEALTHZ_PORT" "${CHART_PORTS[@]}"; do
    ! tcp_listening "$b" || { say "port $b" "TAKEN"; bad=1; }
  done
  for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /lib/x86_64-linux-gnu /usr/lib64; do
    [[ -e "$d/libnvidia-ml.so.1" || -e "$d/libcuda.so.1" ]] \
      && say "driver libs" "$d: $(cd "$d" && ls libnvidia-ml.so.1 libcuda.so.1 2>/dev/null | tr '\n' ' ')"
  done
  say "/dev/nvidia*" "$(ls /dev | grep '^nvidia' | tr '\n' ' ')"
  say "torch python" "$(readlink -f /opt/torch/.venv/bin/python 2>/dev/null || echo none)"
  say "ld.so.cache" "$([[ -e /etc/ld.so.cache ]] && echo yes || echo no)"
  say "state" "$STATE: $(df -h "$(dirname "$STATE")" | awk 'NR==2 {print $4 " free"}'); parts: $(ls "$STATE/parts" 2>/dev/null | tr '\n' ' ')"
  (( bad == 0 )) || die "preflight found a blocker (above)"
}

# ----------------------------------------------------------------- down

cmd_down() {
  local purge=0 keep_logs=1
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --purge) purge=1; shift ;;
      --keep-logs) shift ;;
      *) die "down: unknown argument $1" ;;
    esac
  done
  need_root
  NODE="$STATE/node"
  local t0; t0=$(date +%s%N)
  if load_up_env; then
    load_pack_env
    # The node first (kubelet, containerd, shims, pods: all in its cgroup tree; its mount
    # namespace dies with them), then the control plane (by its pid files).
    cgroup_tree_kill "$CGROUP"
    cgroup_tree_remove "$CGROUP"
    cluster_call cmd_down
    [[ -z "${NODE_ALIAS:-}" ]] || lo_alias del "$NODE_IP" || log "could not remove the address $NODE_IP from lo"
    rm -rf "$NODE/containerd" "$NODE/kubeshare" "$NODE/test" "$NODE/kubelet" "$NODE/cni-bin" \
      "$STATE/images" "$STATE/kubeconfig" "$STATE/config" "$STATE/pids" "$STATE/etcd" \
      "$STATE"/*-certs "$STATE/chart/deploy.yaml" "$STATE/chart/deploy-noseccomp.yaml"
    rm -f "$STATE/up.env" "$NODE/containerd.ready" "$NODE/images.ready" "$NODE"/pids/*.pid
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    log "down in $((ms / 1000)).$(printf '%03d' $((ms % 1000)))s (logs kept: $STATE/logs, $NODE/logs, $NODE/pod-logs)"
  else
    log "not up in $STATE"
  fi
  if [[ -f "$STATE/host-before.txt" ]]; then
    gpu_host_state >"$STATE/host-after.txt"
    if ! diff -u "$STATE/host-before.txt" "$STATE/host-after.txt" >"$STATE/host-diff.txt"; then
      cat "$STATE/host-diff.txt" >&2
      die "the host differs from before up (above; $STATE/host-diff.txt)"
    fi
    log "host state as before up (checked: $STATE/host-after.txt)"
  fi
  if (( purge )); then
    rm -rf "$STATE"
    log "removed $STATE"
  fi
  : "$keep_logs"
}

cmd_status() {
  runner status || true
  local f
  for f in "$STATE"/logs/*.log "$STATE"/node/logs/*.log; do
    [[ -f "$f" ]] || continue
    echo "--- $f"; tail -n 8 "$f"
  done
}

cmd_scenarios() {
  load_pack_env
  load_up_env || die "not up in $STATE"
  local mode=()
  if (( FAKE )); then mode=(--workload fake); fi
  # Through CDI the runtime hands pods the GPU; otherwise they run privileged.
  if (( CDI )); then mode+=(--device-access cdi); fi
  # The torch pods' LD_LIBRARY_PATH: the driver dir `up` found.
  if [[ -n "${DRIVER_LIB_DIR:-}" && " $* " != *" --lib-path "* ]]; then mode+=(--lib-path "$DRIVER_LIB_DIR"); fi
  runner scenarios --test-dir "$STATE/node/test" --script "$HACK/gpu-node/gpu_share.py" "${mode[@]}" "$@"
}

main() {
  local cmd="${1:-}"
  [[ -n "$cmd" ]] || { usage >&2; exit 2; }
  shift
  case "$cmd" in
    pack) cmd_pack "$@" ;;
    unpack) cmd_unpack "$@" ;;
    up) load_pack_env; cmd_up "$@" ;;
    _inside) cmd_inside ;;
    down) [[ ! -f "$STATE/pack.env" ]] || load_pack_env; cmd_down "$@" ;;
    status) cmd_status ;;
    scenarios) cmd_scenarios "$@" ;;
    exec) load_up_env || die "not up"; exec nsenter -t "$INIT_PID" -m -- "$@" ;;
    host-state) gpu_host_state ;;
    preflight) cmd_preflight ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

# One line: bash reads a script as it runs it, and this file may change meanwhile.
main "$@"; exit
