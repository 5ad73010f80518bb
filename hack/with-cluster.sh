#!/usr/bin/env bash
# Run a command against a fresh local control plane, then always stop it.
#
# Usage: hack/with-cluster.sh COMMAND [ARGS...]
#   Builds (or reuses) the binaries, runs `hack/cluster.sh up` in a new run dir,
#   exports KUBESHARE_TEST_CLUSTER (and the rest of cluster.env) to COMMAND,
#   brings the cluster down on exit — success, failure or Ctrl-C — and exits
#   with COMMAND's status. The run dir (logs) is kept for inspection.
# Env: KUBESHARE_WITH_CLUSTER_RUN_DIR (default <repo>/target/kubeshare-make-test)
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
[[ $# -gt 0 ]] || { sed -n '2,10p' "$0" >&2; exit 2; }

RUN="${KUBESHARE_WITH_CLUSTER_RUN_DIR:-$REPO/target/kubeshare-make-test}"
# A cluster left running in this run dir by a killed earlier run: stop it.
"$HACK/cluster.sh" down "$RUN" >/dev/null 2>&1 || true

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  "$HACK/cluster.sh" down "$RUN" || true
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$HACK/cluster.sh" up "$RUN" >/dev/null
# shellcheck disable=SC1091
. "$RUN/cluster.env"
echo "with-cluster: cluster up in $RUN (logs in $RUN/logs)" >&2

set +e
"$@"
rc=$?
set -e
exit "$rc"
