#!/usr/bin/env bash
# Per-launch overhead of libgemhook on a real GPU: empty kernels launched from a compiled loop
# (no Python in the way), ROUNDS alternating native / hooked runs; the hook's client holds a
# (1.0, 1.0) share of a gem-schd that serves it. Prints one JSON line.
#   hack/gpu/launch-bench.sh ARTIFACT_DIR [ROUNDS] [LAUNCHES]
set -euo pipefail
art=$(cd "$1" && pwd); rounds=${2:-6}; n=${3:-300000}
work=$(mktemp -d); trap 'kill "$schd" 2>/dev/null || true; rm -rf "$work"' EXIT
nvcc -O2 -o "$work/launch_bench" "$(dirname "$0")/launch_bench.cu"
uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
printf '1\nsolo 1.0 1.0 100000000000\n' >"$work/config"
"$art/gem-schd" --gpu "$uuid" --config "$work/config" --socket-template "$work/{client}/{gpu}.sock" 2>"$work/schd.log" &
schd=$!
for _ in $(seq 50); do [ -S "$work/solo/$uuid.sock" ] && break; sleep 0.1; done
native=(); hooked=()
for r in $(seq "$rounds"); do
  native+=("$("$work/launch_bench" "$n")")
  hooked+=("$(LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/solo" "$work/launch_bench" "$n")")
done
# One more hooked run with the hook's debug log: its grants prove the launches went through the gate.
grants=$(LD_PRELOAD="$art/libgemhook.so.1" KUBESHARE_SOCKET_DIR="$work/solo" KUBESHARE_HOOK_LOG=debug \
  "$work/launch_bench" "$n" 2>&1 >/dev/null | grep -c granted || true)
python3 - "$grants" "${native[*]}" "${hooked[*]}" <<'PY'
import json, statistics, sys
g, nat, hk = int(sys.argv[1] or 0), [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
mn, mh = statistics.median(nat), statistics.median(hk)
print(json.dumps({"hook_grants_in_debug_run": g, "native_launches_per_s": nat, "hooked_launches_per_s": hk,
                  "median_native": round(mn), "median_hooked": round(mh),
                  "slowdown_pct": round(100 * (1 - mh / mn), 2),
                  # Noise only ever slows a run down, so the best runs compare the launch paths.
                  "best_native": round(max(nat)), "best_hooked": round(max(hk)),
                  "best_slowdown_pct": round(100 * (1 - max(hk) / max(nat)), 2),
                  "added_ns_per_launch": round(1e9 / mh - 1e9 / mn, 1)}))
PY
