#!/usr/bin/env bash
# Build the local control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok) and the real node's kubelet and kube-proxy from Go modules, with no Docker and no
# release downloads. Binaries are cached outside the repository, keyed by the
# pinned versions; a warm call checks a stamp and returns in well under a second.
#
# Usage: hack/build-k8s.sh [--print-bin-dir] [--force]
#   Prints the bin dir as the last line of stdout.
# Env:   KUBESHARE_CACHE (default ~/.cache/kubeshare), GO (default go),
#        BUILD_K8S_PARALLEL (go build -p, default 2),
#        BUILD_K8S_KEEP_GO_CACHES=1 to keep Go's build and module caches (by
#        default they live under the cache dir only while building and are
#        removed after a successful build: ~5 GiB that CI's disk cannot spare).
#
# Why wrapper modules: k8s.io/kubernetes and etcd's server module have directory
# `replace` directives in their go.mod, which `go install pkg@version` refuses.
# A throw-away module that requires them (and, for kubernetes, replaces every
# staging module with its tagged v0.Y.Z release) builds them like any
# dependency. The staging list is read from k8s.io/kubernetes' own go.mod.
set -euo pipefail

# v1.34.10: the newest v1.34 patch whose go.mod the Go checksum database
# verifies here (v1.34.11 and v1.34.12 are on the proxy but sum.golang.org
# answers 404 for them, and we do not turn checksum verification off).
K8S_VERSION="${K8S_VERSION:-v1.34.10}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"

GO="${GO:-go}"
PAR="${BUILD_K8S_PARALLEL:-2}"
FORCE=0
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    --print-bin-dir) ;; # the bin dir is always printed last
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "build-k8s: unknown argument: $a" >&2; exit 2 ;;
  esac
done

CACHE="${KUBESHARE_CACHE:-$HOME/.cache/kubeshare}"
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}"
ROOT="$CACHE/$KEY"
BIN="$ROOT/bin"
STAMP="$BIN/.stamp"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd kwok)

log() { echo "build-k8s: $*" >&2; }

is_warm() {
  [[ -f "$STAMP" ]] || return 1
  [[ "$(cat "$STAMP")" == "$KEY" ]] || return 1
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

if [[ $FORCE == 0 ]] && is_warm; then
  echo "$BIN"
  exit 0
fi

# Go's caches are scratch space here: once the binaries exist nothing reads them.
export GOCACHE="${BUILD_K8S_GOCACHE:-$ROOT/go-cache}"
export GOMODCACHE="${BUILD_K8S_GOMODCACHE:-$ROOT/go-mod}"
command -v "$GO" >/dev/null || { log "Go toolchain '$GO' not found (need Go >= 1.26 for kwok $KWOK_VERSION)"; exit 1; }
command -v jq >/dev/null || { log "jq not found"; exit 1; }

mkdir -p "$ROOT"
# One builder at a time per cache key: two `make test` runs started together
# wait for each other instead of building twice into the same directory.
exec 9>"$ROOT/.lock"
flock 9
if [[ $FORCE == 0 ]] && is_warm; then
  echo "$BIN"
  exit 0
fi
rm -f "$STAMP"
mkdir -p "$BIN"

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
START=$(date +%s)

# ---------------------------------------------------------------- kubernetes
build_kubernetes() {
  local dir="$ROOT/src/kubernetes"
  mkdir -p "$dir"
  log "resolving k8s.io/kubernetes@$K8S_VERSION"
  local info gomod modtime
  info=$(cd "$dir" && "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION")
  if [[ "$(jq -r '.Error // empty' <<<"$info")" != "" ]]; then
    log "$(jq -r .Error <<<"$info")"; exit 1
  fi
  gomod=$(jq -r .GoMod <<<"$info")
  modtime=$(jq -r .Time <<<"$info")
  [[ -f "$gomod" ]] || { log "no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }

  # Staging modules: every `k8s.io/<m> => ./staging/src/k8s.io/<m>` replace in
  # kubernetes' own go.mod. Their tags are v0.Y.Z for kubernetes v1.Y.Z.
  local staging_ver="v0.${K8S_VERSION#v1.}"
  local staging
  staging=$(grep -oE '^[[:space:]]*k8s\.io/[a-z0-9._-]+[[:space:]]+=>[[:space:]]+\./staging/src/k8s\.io/[a-z0-9._-]+' "$gomod" \
              | awk '{print $1}' | sort -u)
  local n
  n=$(wc -l <<<"$staging")
  [[ $n -ge 20 ]] || { log "found only $n staging replaces in $gomod; refusing to guess"; exit 1; }
  log "$n staging modules, pinned to $staging_ver"

  {
    echo "module kubeshare.local/build/kubernetes"
    echo
    echo "go 1.24.0"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    local m
    for m in $staging; do echo "	$m => $m $staging_ver"; done
    echo ")"
  } >"$dir/go.mod"
  cat >"$dir/tools.go" <<'EOF'
//go:build tools

// Package tools pins the kubernetes commands this module builds.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
EOF
  rm -f "$dir/go.sum"
  log "go mod tidy (kubernetes)"
  (cd "$dir" && "$GO" mod tidy)

  local minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local ld="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$modtime"
  done
  log "go build kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy (-p $PAR)"
  (cd "$dir" && "$GO" build -p "$PAR" -trimpath -ldflags "$ld" -o "$BIN/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubectl \
      k8s.io/kubernetes/cmd/kubelet \
      k8s.io/kubernetes/cmd/kube-proxy)
}

# ---------------------------------------------------------------------- etcd
build_etcd() {
  # A separate module, so minimal version selection does not raise kubernetes'
  # shared dependencies (grpc, otel) or the other way round.
  local dir="$ROOT/src/etcd"
  mkdir -p "$dir"
  cat >"$dir/go.mod" <<EOF
module kubeshare.local/build/etcd

go 1.24.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF
  cat >"$dir/tools.go" <<'EOF'
//go:build tools

// Package tools pins the etcd server command (the module root's main package).
package tools

import _ "go.etcd.io/etcd/server/v3"
EOF
  rm -f "$dir/go.sum"
  log "go mod tidy (etcd $ETCD_VERSION)"
  (cd "$dir" && "$GO" mod tidy)
  log "go build etcd"
  (cd "$dir" && "$GO" build -p "$PAR" -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3)
}

# ---------------------------------------------------------------------- kwok
build_kwok() {
  # kwok's go.mod has no replace directives, so `go install pkg@version` works.
  log "go install kwok $KWOK_VERSION"
  # (kwok's version is a constant in its source; no -X needed.)
  GOBIN="$BIN" "$GO" install -p "$PAR" -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

t0=$(date +%s); build_etcd;       log "etcd built in $(( $(date +%s) - t0 ))s"
t0=$(date +%s); build_kwok;       log "kwok built in $(( $(date +%s) - t0 ))s"
t0=$(date +%s); build_kubernetes; log "kubernetes built in $(( $(date +%s) - t0 ))s"

for b in "${BINARIES[@]}"; do
  [[ -x "$BIN/$b" ]] || { log "missing $BIN/$b after build"; exit 1; }
done
echo "$KEY" >"$STAMP"
if [[ "${BUILD_K8S_KEEP_GO_CACHES:-0}" != 1 ]]; then
  # The module cache is read-only on disk; Go's own clean commands remove it.
  "$GO" clean -cache -modcache >/dev/null 2>&1 || true
  rm -rf "$ROOT/src" "$GOCACHE" "$GOMODCACHE"
  log "Go caches removed (BUILD_K8S_KEEP_GO_CACHES=1 keeps them)"
fi
log "done in $(( $(date +%s) - START ))s"
echo "$BIN"
