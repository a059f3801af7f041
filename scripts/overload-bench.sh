#!/usr/bin/env bash
# The issue-12 experiment: the Mooncake conversation trace replayed at its real rate against
# `tandem up` (2 prefill + 2 decode mocker workers at real speed, more load than they serve),
# once with flow control off (no worker ever counts as saturated: every request goes straight
# to a worker and queues there, as before flow control existed) and once with the defaults
# (the frontend holds requests while every decode worker is saturated, refuses past its
# bound with 429 + Retry-After). Prints one line per run from `tandem bench`'s JSON: served,
# refused, TTFT p50 / p99 of the served, goodput under the SLO. Same binary, same trace,
# one run after the other.
#
#   bash scripts/overload-bench.sh                 # the first 600 requests (~200 s each run)
#   LIMIT=1200 bash scripts/overload-bench.sh
#   BIN=target/debug/tandem LIMIT=300 bash scripts/overload-bench.sh   # an existing binary
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT=${LIMIT:-600}
TRACE=${TRACE:-traces/conversation_trace.jsonl}
OUT=${OUT:-$(mktemp -d /tmp/tandem-overload-XXXX)}
mkdir -p "$OUT"
if [ -z "${BIN:-}" ]; then
  cargo build --release --locked --bin tandem >&2
  BIN=target/release/tandem
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

run() {
  local name=$1; shift
  local port; port=$(free_port)
  "$BIN" up --engine mocker --port "$port" "$@" >"$OUT/$name.up.log" 2>&1 &
  local up=$!
  for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  "$BIN" bench --url "http://127.0.0.1:$port" --trace "$TRACE" --limit "$LIMIT" \
    --quiet --timeout-s 300 --json "$OUT/$name.json" >"$OUT/$name.bench.log" 2>&1 || true
  kill -INT "$up" 2>/dev/null || true
  wait "$up" 2>/dev/null || true
  python3 - "$name" "$OUT/$name.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
r = r["points"][0] if "points" in r else r
by = {}
for rec in r["records"]:
    e = rec.get("error")
    if e:
        k = e.split(":")[0]
        by[k] = by.get(k, 0) + 1
fails = ", ".join(f"{k}: {v}" for k, v in sorted(by.items()))
print(f"{name:>18}: {r['requests']} requests, {r['completed']} served, {r['failed']} refused or "
      f"failed ({fails or 'none'}); TTFT of the served p50 {r['ttft_ms']['p50']:.0f} ms, "
      f"p99 {r['ttft_ms']['p99']:.0f} ms; goodput {r['goodput']:.2f} req/s "
      f"(SLO attainment {r['slo_attainment']:.2f})")
PY
}

echo "trace: $TRACE, first $LIMIT requests at the recorded rate; out: $OUT"
run flow-control-off --saturation-kv-fraction 0 --saturation-waiting 0 --saturation-prefill-pool-tokens 0
run flow-control-on
