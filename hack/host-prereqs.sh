#!/usr/bin/env bash
# The host packages `make test` needs besides Rust and Go: tools of the local control plane
# (jq, openssl, curl, ss, flock, setsid) and of the real node it runs on this machine
# (containerd, runc, the CNI plugins, umoci and busybox-static for its images, iptables,
# conntrack, unshare, nsenter, gcc for the static pause binary), and numpy for the GPU
# harness's analysis tests where no python3 has it. Installs the missing ones with apt-get
# (Debian, Ubuntu). Not root: prints the one command to run as root, and fails.
# `make host-prereqs` and .ci/run call it; `make test` runs it first.
#   hack/host-prereqs.sh [--check]     --check: only report, never install
set -euo pipefail

# TOOL:PACKAGE (Debian package names).
tools=(jq:jq openssl:openssl curl:curl ss:iproute2 ip:iproute2 flock:util-linux
       setsid:util-linux unshare:util-linux nsenter:util-linux containerd:containerd
       runc:runc umoci:umoci busybox:busybox-static iptables:iptables conntrack:conntrack
       gcc:gcc)

missing=()
add() { [[ " ${missing[*]-} " == *" $1 "* ]] || missing+=("$1"); }
for t in "${tools[@]}"; do
  command -v "${t%%:*}" >/dev/null 2>&1 || add "${t##*:}"
done
# The real node's bridge network (hack/node.sh) uses the CNI plugins from this package.
[[ -x /usr/lib/cni/bridge ]] || add containernetworking-plugins
# The GPU harness's analysis tests (hack/gpu/harness-test.sh) need a python3 with numpy.
python3 -c 'import numpy' >/dev/null 2>&1 || /usr/bin/python3 -c 'import numpy' >/dev/null 2>&1 ||
  add python3-numpy

((${#missing[@]})) || exit 0
if [[ ${1-} == --check ]]; then
  echo "host-prereqs: missing packages: ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "host-prereqs: missing packages (Debian names): ${missing[*]}; install them with your package manager" >&2
  exit 1
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "host-prereqs: missing ${missing[*]}; run as root: apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "host-prereqs: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
