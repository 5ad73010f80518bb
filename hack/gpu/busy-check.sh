#!/usr/bin/env bash
# The hook's Busy reports on a GPU: what timing a sample of launches costs a launch (in-process
# A/B of empty kernels, hooked vs the driver's own, for each KUBESHARE_HOOK_BUSY_EVERY in
# $EVERY; `ask` leaves it unset, so the hook does what gem-schd asks: here, without
# co-running, nothing), then share.py scenarios with each client's fill from gem-schd's log
# (`+fill`).
# SCHD_ARGS adds gem-schd arguments for the A/B (`--co-run-below 0.6`: `ask` then gets what a
# gem-schd that co-runs asks for).
#   EVERY="32 0 ask" hack/gpu/busy-check.sh ARTIFACT_DIR OUT [share.py scenario ...]
# ARTIFACT_DIR holds libgemhook.so.1 and gem-schd (cargo build --release -p gemhook -p gem-schd).
set -uo pipefail
art=$(cd "$1" && pwd); out=$2; shift 2; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=solo-ab.sh
. "$here/solo-ab.sh"
for e in ${EVERY:-32 0 ask}; do
  echo "== per-launch cost, KUBESHARE_HOOK_BUSY_EVERY=$e"
  if [ "$e" = ask ]; then set=(env -u KUBESHARE_HOOK_BUSY_EVERY); else set=(env KUBESHARE_HOOK_BUSY_EVERY="$e"); fi
  "${set[@]}" LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/pods/solo" \
    taskset -c 3 "$work/launch_ab" 300 1000 | tee -a "$out/launch-ab-every$e.jsonl"
done
kill "${pids[@]}" 2>/dev/null; pids=()
[ $# -gt 0 ] && SHARE_PIN=${SHARE_PIN:-1} python3 "$here/share.py" "$art" "$out/s" "$@"
exit 0
