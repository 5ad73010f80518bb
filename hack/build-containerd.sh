#!/usr/bin/env bash
# Build a containerd with CDI support (containerd 2.x: CDI is in its CRI plugin,
# `enable_cdi`) and its runc shim from Go modules, with no Docker and no release
# downloads, for the real-node tests that inject GPUs through CDI (docs/node.md,
# "CDI"). Debian's containerd 1.6 predates CDI. Binaries are cached outside the
# repository, keyed by the pinned version; a warm call checks a stamp and
# returns at once.
#
# Usage: hack/build-containerd.sh [--print-bin-dir] [--force]
#   Prints the bin dir as the last line of stdout.
# Env:   KUBESHARE_CACHE (default ~/.cache/kubeshare), GO (default go),
#        CONTAINERD_VERSION (default below), BUILD_K8S_PARALLEL (go build -p,
#        default 2), BUILD_K8S_KEEP_GO_CACHES=1 to keep Go's build and module
#        caches (by default removed after a successful build, as build-k8s.sh does).
#
# containerd's go.mod has no `replace` directives, so `go install pkg@version`
# builds its commands directly (no wrapper module as for kubernetes).
set -euo pipefail

# v2.2.9: the newest patch of the 2.2 line on the module proxy; its go.mod asks
# for Go 1.25 (2.3 and 2.4 need newer toolchains than some CI images carry).
CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.2.9}"

GO="${GO:-go}"
PAR="${BUILD_K8S_PARALLEL:-2}"
FORCE=0
for a in "$@"; do
  case "$a" in
    --force) FORCE=1 ;;
    --print-bin-dir) ;; # the bin dir is always printed last
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "build-containerd: unknown argument: $a" >&2; exit 2 ;;
  esac
done

CACHE="${KUBESHARE_CACHE:-$HOME/.cache/kubeshare}"
KEY="containerd-${CONTAINERD_VERSION}"
ROOT="$CACHE/$KEY"
BIN="$ROOT/bin"
STAMP="$BIN/.stamp"
BINARIES=(containerd containerd-shim-runc-v2 ctr)
MOD=github.com/containerd/containerd/v2

log() { echo "build-containerd: $*" >&2; }

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

export GOCACHE="${BUILD_K8S_GOCACHE:-$ROOT/go-cache}"
export GOMODCACHE="${BUILD_K8S_GOMODCACHE:-$ROOT/go-mod}"
command -v "$GO" >/dev/null || { log "Go toolchain '$GO' not found"; exit 1; }

mkdir -p "$ROOT"
# One builder at a time per cache key (see build-k8s.sh).
exec 9>"$ROOT/.lock"
flock 9
if [[ $FORCE == 0 ]] && is_warm; then
  echo "$BIN"
  exit 0
fi
rm -f "$STAMP"
mkdir -p "$BIN"

export GOTOOLCHAIN=local GOFLAGS=-mod=mod
START=$(date +%s)
LD="-s -w -X $MOD/version.Version=$CONTAINERD_VERSION -X $MOD/version.Package=$MOD"

# no_btrfs: the btrfs snapshotter needs libbtrfs headers at build time and the
# node uses overlayfs. containerd itself keeps cgo (as its own release builds
# do); the shim is static, as containerd's Makefile builds it (SHIM_CGO_ENABLED=0).
log "go install containerd, ctr @$CONTAINERD_VERSION (-p $PAR)"
GOBIN="$BIN" CGO_ENABLED=1 "$GO" install -p "$PAR" -trimpath -tags no_btrfs -ldflags "$LD" \
  "$MOD/cmd/containerd@$CONTAINERD_VERSION" "$MOD/cmd/ctr@$CONTAINERD_VERSION"
log "go install containerd-shim-runc-v2 @$CONTAINERD_VERSION"
GOBIN="$BIN" CGO_ENABLED=0 "$GO" install -p "$PAR" -trimpath -ldflags "$LD" \
  "$MOD/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"

for b in "${BINARIES[@]}"; do
  [[ -x "$BIN/$b" ]] || { log "missing $BIN/$b after build"; exit 1; }
done
"$BIN/containerd" --version >&2
echo "$KEY" >"$STAMP"
if [[ "${BUILD_K8S_KEEP_GO_CACHES:-0}" != 1 ]]; then
  "$GO" clean -cache -modcache >/dev/null 2>&1 || true
  rm -rf "$GOCACHE" "$GOMODCACHE"
  log "Go caches removed (BUILD_K8S_KEEP_GO_CACHES=1 keeps them)"
fi
log "done in $(( $(date +%s) - START ))s"
echo "$BIN"
