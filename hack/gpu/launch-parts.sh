#!/usr/bin/env bash
# Where the hook's per-launch time goes on a GPU: the in-process launch A/B (launch_ab.cu,
# hooked cuLaunchKernel against the driver's own) for the hook inert (no socket directory: the
# wrapper and its mode check only), active as gem-schd's only client at 1.0 (the default
# gate), with the queue-ahead bound off (KUBESHARE_HOOK_MAX_AHEAD_US=0), with the precise
# deadline off (KUBESHARE_HOOK_PRECISE_DEADLINE=0), and both off; rounds alternate the
# variants, REPEAT times (default 3). One JSON line per run in OUT/launch-parts.jsonl.
#   hack/gpu/launch-parts.sh ARTIFACT_DIR OUT
set -uo pipefail
art=$(cd "$1" && pwd); out=$2; mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=solo-ab.sh
. "$here/solo-ab.sh"
for _ in $(seq "${REPEAT:-3}"); do
  for v in inert default ahead0 precise0 both0; do
    set=(env LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/pods/solo")
    case $v in
      inert) set=(env LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/none") ;;
      ahead0) set+=(KUBESHARE_HOOK_MAX_AHEAD_US=0) ;;
      precise0) set+=(KUBESHARE_HOOK_PRECISE_DEADLINE=0) ;;
      both0) set+=(KUBESHARE_HOOK_MAX_AHEAD_US=0 KUBESHARE_HOOK_PRECISE_DEADLINE=0) ;;
    esac
    r=$("${set[@]}" taskset -c 3 "$work/launch_ab" 300 1000) || { echo "launch_ab failed ($v)" >&2; continue; }
    echo "{\"variant\": \"$v\", \"ab\": $r}" | tee -a "$out/launch-parts.jsonl"
  done
done
exit 0
