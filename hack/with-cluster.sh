#!/usr/bin/env bash
# Run a command against a fresh local control plane, then always stop it.
#
# Usage: hack/with-cluster.sh COMMAND [ARGS...]
#   Builds (or reuses) the binaries, runs `hack/cluster.sh up` in a new run dir,
#   exports KUBESHARE_TEST_CLUSTER (and the rest of cluster.env) to COMMAND,
#   brings the cluster down on exit (success, failure, Ctrl-C; and, through the
#   --owner-pid watchdog, even if this script is killed) and exits with
#   COMMAND's status. The run dir is removed on success, kept (logs) on failure.
# Env: KUBESHARE_WITH_CLUSTER_ROOT (default <repo>/target/kubeshare-make-test);
#      the run dir is ROOT/<pid>, so concurrent runs do not touch each other.
set -euo pipefail
HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HACK/.." && pwd)"
[[ $# -gt 0 ]] || { sed -n '2,12p' "$0" >&2; exit 2; }

ROOT="${KUBESHARE_WITH_CLUSTER_ROOT:-$REPO/target/kubeshare-make-test}"
RUN="$ROOT/$$"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  "$HACK/cluster.sh" down "$RUN" || true
  if [[ $rc == 0 ]]; then
    rm -rf "$RUN"
  else
    echo "with-cluster: exit status $rc; cluster logs kept in $RUN/logs" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$ROOT"
if ! "$HACK/cluster.sh" up "$RUN" --owner-pid $$ >/dev/null 2>"$ROOT/$$.up.log"; then
  cat "$ROOT/$$.up.log" >&2
  exit 1
fi
rm -f "$ROOT/$$.up.log"
# shellcheck disable=SC1091
. "$RUN/cluster.env"
echo "with-cluster: cluster up in $RUN" >&2

set +e
"$@"
rc=$?
set -e
exit "$rc"
