#!/usr/bin/env bash
# Stop the local demo (`make demo-down`): the node daemons (and their gem-schd),
# the webhook, the extender, then the control plane. Leaves the logs in place.
#
# Usage: hack/demo-down.sh
# Env:   KUBESHARE_DEMO_DIR (default /tmp/kubeshare-demo)
# Only processes the demo recorded (pid files) are signalled, and only when their
# command line names the demo dir. Exits non-zero if one of them is still running.
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEMO="${KUBESHARE_DEMO_DIR:-/tmp/kubeshare-demo}"
case "$DEMO" in /*) ;; *) DEMO="$PWD/$DEMO" ;; esac
# The short symlink to $DEMO/roots that node roots go through (see demo.sh).
SHORT="/tmp/ks$(printf '%s' "$DEMO" | cksum | cut -c1-5)"

log() { echo "demo-down: $*" >&2; }

if [[ ! -d "$DEMO" ]]; then
  log "nothing to stop ($DEMO does not exist)"
  exit 0
fi

# ours PID: the pid runs and its command line names the demo dir (or the
# short path to its node roots).
ours() {
  local pid="$1" cmd
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  cmd="$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" || return 1
  [[ "$cmd" == *"$DEMO"* || "$cmd" == *"$SHORT/"* ]]
}

# stop PIDFILE...: SIGTERM, up to 15 s for a graceful exit (the node daemon
# stops its gem-schd first), then SIGKILL.
stop() {
  local f pid pids=()
  for f in "$@"; do
    [[ -f "$f" ]] || continue
    pid="$(cat "$f" 2>/dev/null || true)"
    if ours "$pid"; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  ((${#pids[@]})) || return 0
  local deadline=$(( $(date +%s) + 15 )) alive
  while (( $(date +%s) < deadline )); do
    alive=0
    for pid in "${pids[@]}"; do ours "$pid" && alive=1; done
    (( alive )) || break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do
    if ours "$pid"; then
      log "pid $pid ignored SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  for pid in "${pids[@]}"; do
    local n=0
    while ours "$pid" && (( n < 50 )); do sleep 0.1; n=$((n + 1)); done
  done
}

shopt -s nullglob
stop "$DEMO"/pids/node-daemon-*.pid
# A gem-schd the node daemon left behind (it records them next to their configs).
stop "$DEMO"/roots/*/gpus/*/gem-schd.pid
stop "$DEMO"/pids/webhook.pid "$DEMO"/pids/extender.pid
rm -f "$DEMO"/pids/*.pid

if [[ -d "$DEMO/cluster" ]]; then
  "$HACK/cluster.sh" down "$DEMO/cluster" || log "hack/cluster.sh down reported an error"
fi

# Check: no process of ours names the demo dir any more.
left=()
for p in /proc/[0-9]*; do
  pid="${p#/proc/}"
  [[ "$pid" == "$$" ]] && continue
  cmd="$(tr '\0' ' ' 2>/dev/null <"$p/cmdline" || true)"
  [[ "$cmd" == *"$DEMO"* || "$cmd" == *"$SHORT/"* ]] || continue
  exe="$(basename "$(readlink "$p/exe" 2>/dev/null || echo ?)")"
  case "$exe" in
    kubeshare-*|gem-schd|etcd|kube-*|kwok|kubectl-sharedgpu) left+=("$pid $cmd") ;;
  esac
done
if ((${#left[@]})); then
  log "still running:"
  printf '  %s\n' "${left[@]}" >&2
  exit 1
fi
if [[ -L "$SHORT" && "$(readlink "$SHORT")" == "$DEMO/roots" ]]; then rm -f "$SHORT"; fi
log "stopped; no demo process left (logs kept in $DEMO/logs)"
