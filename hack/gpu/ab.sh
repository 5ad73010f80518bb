#!/usr/bin/env bash
# One build of gem-schd and the hook against another on the mix, run after run on one GPU, so
# that a change to timing is judged against the spread of runs (docs/benchmarks.md, "Mixes of
# workloads").
#
#   hack/gpu/ab.sh NEW_DIR OLD_DIR OUT [ROUNDS] -- SCENARIO ...
#
# Each DIR holds libgemhook.so.1 and gem-schd (`make hook-release`, copied aside); paths are
# from the repository's root, as hack/gpu-bench.sh takes them. Runs new, old,
# new, old, ... ROUNDS times each (default 3) through hack/gpu-bench.sh --mix, with the
# environment as given (MIX_CUPTI, MIX_PAIRS, MIX_CORUN, ...). Keeps each run's mix.json and
# gzipped log in OUT/n1, OUT/o1, ... (mix-raw.json, hundreds of MB, only with AB_KEEP_RAW=1) and
# prints a line per group of tenants per run (mix.py --brief). No run starts past AB_BUDGET
# seconds from the first (default: no bound); BENCH_TIMEOUT bounds each (default 560).
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() { sed -n '6p' "$0" >&2; exit 2; }
[ $# -ge 5 ] || usage
new=$1 old=$2 out=$3
shift 3
rounds=3
if [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] || usage
shift
[ $# -ge 1 ] || usage
for d in "$new" "$old"; do
  # gpu-bench.sh would build and run this tree instead.
  [ -f "$d/libgemhook.so.1" ] && [ -x "$d/gem-schd" ] || { echo "ab: $d lacks libgemhook.so.1 or an executable gem-schd" >&2; exit 2; }
done

mkdir -p "$out"
t0=$(date +%s)
for i in $(seq 1 "$rounds"); do
  for side in n o; do
    if [ -n "${AB_BUDGET:-}" ] && [ $(( $(date +%s) - t0 )) -ge "$AB_BUDGET" ]; then
      echo "ab: past AB_BUDGET ($AB_BUDGET s): $side$i and after not run" >&2
      break 2
    fi
    art=$new; [ "$side" = o ] && art=$old
    run=$out/$side$i
    started=$(date +%s)
    rc=0
    hack/gpu-bench.sh --artifacts "$art" --out "$run" --mix "$@" > "$run.stdout" 2>&1 || rc=$?
    [ "${AB_KEEP_RAW:-0}" = 1 ] || rm -f "$run/mix-raw.json"
    [ -f "$run/bench.log" ] && gzip -f "$run/bench.log"
    echo "ab: $side$i ($art) rc=$rc in $(( $(date +%s) - started )) s"
    [ -f "$run/mix.json" ] && python3 hack/gpu/mix.py --brief "$run/mix.json"
  done
done
