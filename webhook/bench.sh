#!/usr/bin/env bash
# Admission latency benchmark (docs/webhook.md): starts the release webhook on
# loopback with fresh certificates and drives it from a separate process
# (kubeshare-webhook-bench) at a fixed rate; prints p50/p90/p99 and errors.
#   webhook/bench.sh                      1,000 req/s for 30 s over 64 connections
#   RATE=2000 DURATION=10 CONNS=32 webhook/bench.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RATE="${RATE:-1000}"
DURATION="${DURATION:-30}"
CONNS="${CONNS:-64}"
PORT="${PORT:-18443}"

cargo build --release -p kubeshare-webhook --bin kubeshare-webhook --example kubeshare-webhook-bench \
  --manifest-path "$ROOT/Cargo.toml" >&2
BIN="$ROOT/target/release"
DIR="$(mktemp -d)"
PID=""
cleanup() {
  if [[ -n "$PID" ]]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
  rm -rf "$DIR"
}
trap cleanup EXIT

"$BIN/kubeshare-webhook" certs --ip 127.0.0.1 --out "$DIR" >/dev/null
RUST_LOG=warn "$BIN/kubeshare-webhook" serve --listen "127.0.0.1:$PORT" \
  --cert "$DIR/tls.crt" --key "$DIR/tls.key" &
PID=$!
for _ in $(seq 50); do
  curl -sf --cacert "$DIR/ca.crt" "https://127.0.0.1:$PORT/healthz" >/dev/null && break
  sleep 0.1
done
echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
"$BIN/examples/kubeshare-webhook-bench" --addr "127.0.0.1:$PORT" --ca "$DIR/ca.crt" \
  --rate "$RATE" --duration "$DURATION" --connections "$CONNS"
curl -sf --cacert "$DIR/ca.crt" "https://127.0.0.1:$PORT/metrics" | grep 'endpoint="mutate"'
