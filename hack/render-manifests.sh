#!/usr/bin/env bash
# manifests/ is the Helm chart (charts/kubeshare) rendered once, for users who
# deploy with kubectl: one source, two ways to install. Edit the chart, then run
# this; `make test` runs it with --check and fails when manifests/ has drifted.
#
# Usage: hack/render-manifests.sh [--check]
# Env:   HELM (default: the binary hack/build-helm.sh builds)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK=0
case "${1:-}" in
  --check) CHECK=1 ;;
  "") ;;
  -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
  *) echo "render-manifests: unknown argument: $1" >&2; exit 2 ;;
esac
HELM="${HELM:-$("$REPO/hack/build-helm.sh" | tail -n 1)}"

# The values manifests/ is rendered with: it creates its namespace, binds the
# local rig's users too, and leaves the webhook's certificate to the user
# (CA_BUNDLE placeholder, Secret kubeshare-webhook-tls; README, "Deploying").
VALUES=(--namespace kubeshare-system --set createNamespace=true --set rbac.localRigUsers=true
        --set webhook.certs.mode=manual)
# template in the chart -> file in manifests/
declare -A FILES=(
  [namespace.yaml]=00-namespace.yaml [rbac.yaml]=rbac.yaml [flowschema.yaml]=flowschema.yaml
  [admission-policy.yaml]=admission-policy.yaml [kube-scheduler.yaml]=kube-scheduler.yaml
  [node-daemon.yaml]=node-daemon.yaml [webhook.yaml]=webhook.yaml
)

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
for t in "${!FILES[@]}"; do
  # Helm orders a file's objects by kind (its install order) and leaves blank lines
  # where template actions were; the chart has none of its own.
  {
    echo "# Generated from charts/kubeshare/templates/$t by hack/render-manifests.sh: edit the chart."
    "$HELM" template kubeshare "$REPO/charts/kubeshare" "${VALUES[@]}" --show-only "templates/$t" \
      | sed -e '1{/^---$/d}' -e '/^# Source: /d' -e '/^[[:space:]]*$/d'
  } >"$OUT/${FILES[$t]}"
done

if ((CHECK)); then
  status=0
  for f in "${FILES[@]}"; do
    if ! diff -u "$REPO/manifests/$f" "$OUT/$f" >"$OUT/$f.diff"; then
      echo "render-manifests: manifests/$f differs from the chart (run hack/render-manifests.sh):" >&2
      cat "$OUT/$f.diff" >&2
      status=1
    fi
  done
  extra=$(cd "$REPO/manifests" && ls *.yaml | while read -r f; do [[ -e "$OUT/$f" ]] || echo "$f"; done)
  [[ -z "$extra" ]] || { echo "render-manifests: manifests/ holds files the chart does not render: $extra" >&2; status=1; }
  exit $status
fi
cp "$OUT"/*.yaml "$REPO/manifests/"
echo "render-manifests: manifests/ rendered from charts/kubeshare" >&2
