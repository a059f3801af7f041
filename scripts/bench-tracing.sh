#!/usr/bin/env bash
# What tracing costs on a live cluster, and the router's own time by phase.
#
# Runs `tandem up` (one process: frontend, prefill and decode mocker workers) under the same
# `tandem bench` load, alternately without and with OTLP export (every trace sampled, to the
# OTLP receiver of tests/otlp_receiver.py), ROUNDS times each. Per run: the bench's summary
# line, the CPU seconds the cluster's process used per request (utime + stime from
# /proc/PID/stat), the spans the receiver got, and the mean of each phase of
# `tandem_router_overhead_seconds` from the frontend's /metrics.
#
#   bash scripts/bench-tracing.sh          # TANDEM=target/release/tandem ROUNDS=2 RATE=20 N=300
#
# Needs python3 with grpcio and opentelemetry-proto (scripts/test.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

TANDEM=${TANDEM:-target/release/tandem}
ROUNDS=${ROUNDS:-2}
RATE=${RATE:-20}
N=${N:-300}
PORT=${PORT:-8100}
DIR=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$DIR"' EXIT

python3 tests/otlp_receiver.py "$DIR/otlp.port" "$DIR/spans.jsonl" 2>"$DIR/otlp.log" &
for _ in $(seq 100); do [ -s "$DIR/otlp.port" ] && break; sleep 0.1; done
OTLP="http://127.0.0.1:$(cat "$DIR/otlp.port")"

cpu_s() { # utime + stime of PID, seconds
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}

run() { # $1: label, rest: extra `tandem up` flags
  local label=$1
  shift
  "$TANDEM" up --port "$PORT" --prefill 2 --decode 2 "$@" >"$DIR/up.log" 2>&1 &
  local pid=$!
  for _ in $(seq 200); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  local spans_before
  spans_before=$(wc -l <"$DIR/spans.jsonl" 2>/dev/null || echo 0)
  local before
  before=$(cpu_s "$pid")
  "$TANDEM" bench --url "http://127.0.0.1:$PORT" --requests "$N" --rate "$RATE" --isl 1024 \
    --osl 32 --seed 1 --quiet --json "$DIR/bench.json" >/dev/null
  local after
  after=$(cpu_s "$pid")
  curl -sf "http://127.0.0.1:$PORT/metrics" >"$DIR/metrics.txt"
  sleep 2 # the batch exporter's delay: let the last spans arrive
  local spans_after
  spans_after=$(wc -l <"$DIR/spans.jsonl" 2>/dev/null || echo 0)
  kill -INT "$pid"
  wait "$pid" || true
  python3 - "$label" "$before" "$after" "$N" "$((spans_after - spans_before))" \
    "$DIR/bench.json" "$DIR/metrics.txt" <<'EOF'
import json, re, sys
label, before, after, n, spans, bench, metrics = sys.argv[1:]
b = json.load(open(bench))
text = open(metrics).read()
def series(name):
    out = {}
    for m in re.finditer(r'^%s\{phase="(\w+)"\} ([0-9.e+-]+)$' % name, text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out
sums = series("tandem_router_overhead_seconds_sum")
counts = series("tandem_router_overhead_seconds_count")
phases = " ".join(
    "%s %.1f" % (p, 1e6 * sums[p] / counts[p]) for p in ["hash", "index", "score", "total"]
    if counts.get(p)
)
s = b.get("summary", b)
def pick(*keys):
    v = s
    for k in keys:
        v = v.get(k, {}) if isinstance(v, dict) else {}
    return v if not isinstance(v, dict) else float("nan")
print("%-8s cpu/req %.2f ms | spans %s | ttft p50 %s ms p99 %s ms | tpot p50 %s ms | "
      "router mean us: %s" % (
          label, 1e3 * (float(after) - float(before)) / int(n), spans,
          pick("ttft_ms", "p50"), pick("ttft_ms", "p99"), pick("tpot_ms", "p50"), phases))
EOF
}

for r in $(seq "$ROUNDS"); do
  run "off-$r"
  run "on-$r" --otlp-endpoint "$OTLP"
done
