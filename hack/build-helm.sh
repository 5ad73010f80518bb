#!/usr/bin/env bash
# Build helm from Go modules (no release download), cached outside the repository
# and keyed by its version; a warm call returns at once. Used by `make test`
# (chart lint, template, server-side dry run; manifests/ rendered from the chart)
# and by hack/deploy.sh when it installs KubeShare with the chart.
#
# Usage: hack/build-helm.sh        prints the helm binary's path as the last line
# Env:   KUBESHARE_CACHE (default ~/.cache/kubeshare), GO (default go),
#        HELM_VERSION (default below), BUILD_K8S_PARALLEL (go build -p, default 2).
set -euo pipefail

# Helm 4: its chart API (v2 charts) is the one Helm 3 reads too.
HELM_VERSION="${HELM_VERSION:-v4.3.1}"
GO="${GO:-go}"
PAR="${BUILD_K8S_PARALLEL:-2}"
case "${1:-}" in
  -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
  "") ;;
  *) echo "build-helm: unknown argument: $1" >&2; exit 2 ;;
esac

CACHE="${KUBESHARE_CACHE:-$HOME/.cache/kubeshare}"
ROOT="$CACHE/helm-$HELM_VERSION"
BIN="$ROOT/bin/helm"
log() { echo "build-helm: $*" >&2; }

if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
command -v "$GO" >/dev/null || { log "Go toolchain '$GO' not found"; exit 1; }

mkdir -p "$ROOT"
# One build at a time per cache (make test and a demo may start together).
exec 9>"$ROOT/.lock"
flock 9
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi

major="${HELM_VERSION%%.*}"
# Go's caches are scratch space: removed once the binary exists (CI's disk is small).
export GOCACHE="$ROOT/go-cache" GOMODCACHE="$ROOT/go-mod"
t0=$(date +%s)
log "go install helm.sh/helm/$major/cmd/helm@$HELM_VERSION"
GOBIN="$ROOT/bin.tmp" GOFLAGS=-mod=mod "$GO" install -p "$PAR" -trimpath \
  -ldflags "-s -w -X helm.sh/helm/$major/internal/version.version=$HELM_VERSION" \
  "helm.sh/helm/$major/cmd/helm@$HELM_VERSION"
mkdir -p "$ROOT/bin"
mv "$ROOT/bin.tmp/helm" "$BIN"
"$GO" clean -cache -modcache >/dev/null 2>&1 || true
rm -rf "$ROOT/bin.tmp" "$GOCACHE" "$GOMODCACHE"
log "built in $(( $(date +%s) - t0 ))s"
echo "$BIN"
