#!/usr/bin/env bash
# The latency `tandem frontend --backend-url` adds in front of an OpenAI-compatible server:
# oha (https://github.com/hatoo/oha, `cargo install oha`) drives the same non-streaming
# /v1/completions request, at a fixed rate, once straight at a stand-in engine that answers
# at once and once through the frontend in front of that same engine, at each concurrency;
# the pairs alternate within one run. Prints one table row per concurrency (p50 / p99 of both
# and the difference) and leaves oha's JSON under $OUT.
#
#   bash scripts/bench-gateway.sh            # dist build, 8/32/128 connections, 300 req/s
#   PROFILE=release bash scripts/bench-gateway.sh   # the quicker --release build
#   CONNS="8 32" RATE=500 DURATION=20s bash scripts/bench-gateway.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CONNS=${CONNS:-"8 32 128"}
RATE=${RATE:-300}
DURATION=${DURATION:-15s}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-$(mktemp -d /tmp/tandem-gateway-XXXX)}
mkdir -p "$OUT"
OHA=${OHA:-oha}
command -v "$OHA" >/dev/null || { echo "oha not found: cargo install oha" >&2; exit 1; }

# The shipping profile (Cargo.toml's `dist`), as scripts/bench-gateways.sh builds it.
PROFILE=${PROFILE:-dist}
cargo build --profile "$PROFILE" --locked --bin tandem --bin tandem-standin >&2
BIN=target/$PROFILE

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ENGINE_PORT=$(free_port)
FRONT_PORT=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# The engine answers at once: the mocker's step times divided by 1e9.
"$BIN/tandem-standin" --listen "127.0.0.1:$ENGINE_PORT" --speedup-ratio 1e9 \
  >"$OUT/engine.log" 2>&1 &
pids+=($!)
"$BIN/tandem" frontend --listen "127.0.0.1:$FRONT_PORT" \
  --backend-url "http://127.0.0.1:$ENGINE_PORT" >"$OUT/frontend.log" 2>&1 &
pids+=($!)
for _ in $(seq 200); do
  curl -sf "127.0.0.1:$FRONT_PORT/health" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -sf "127.0.0.1:$FRONT_PORT/health" >/dev/null || { echo "frontend not healthy" >&2; cat "$OUT/frontend.log" >&2; exit 1; }

# 64 prompt tokens as ids (both servers take them as is), one output token.
PROMPT=$(python3 -c 'print(",".join(str(100 + i) for i in range(64)))')
BODY="{\"model\":\"mocker\",\"prompt\":[$PROMPT],\"max_tokens\":1,\"temperature\":0}"

run() { # name url conns round
  "$OHA" --no-tui --output-format json -z "$DURATION" -c "$3" -q "$RATE" -m POST \
    -H 'content-type: application/json' -d "$BODY" "$2/v1/completions" \
    >"$OUT/$1-c$3-r$4.json"
}

# Warm-up: connections, the frontend's and engine's first requests.
"$OHA" --no-tui -z 2s -c 8 -q 200 -m POST -H 'content-type: application/json' -d "$BODY" \
  "http://127.0.0.1:$FRONT_PORT/v1/completions" >/dev/null

for c in $CONNS; do
  for r in $(seq "$ROUNDS"); do
    run direct "http://127.0.0.1:$ENGINE_PORT" "$c" "$r"
    run frontend "http://127.0.0.1:$FRONT_PORT" "$c" "$r"
  done
done

python3 - "$OUT" "$CONNS" "$ROUNDS" <<'EOF'
import json, sys, statistics
out, conns, rounds = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
def load(name, c, r):
    with open(f"{out}/{name}-c{c}-r{r}.json") as f:
        j = json.load(f)
    p = j["latencyPercentiles"]
    ok = j["statusCodeDistribution"]
    return p["p50"] * 1e3, p["p99"] * 1e3, j["summary"]["requestsPerSec"], ok
print("| connections | direct p50 ms | direct p99 ms | frontend p50 ms | frontend p99 ms | added p50 ms | added p99 ms | req/s | status codes |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for c in conns:
    d = [load("direct", c, r) for r in range(1, rounds + 1)]
    f = [load("frontend", c, r) for r in range(1, rounds + 1)]
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    codes = {}
    for x in f:
        for k, v in x[3].items():
            codes[k] = codes.get(k, 0) + v
    print(f"| {c} | {med(d,0):.3f} | {med(d,1):.3f} | {med(f,0):.3f} | {med(f,1):.3f} | "
          f"{med(f,0)-med(d,0):.3f} | {med(f,1)-med(d,1):.3f} | {med(f,2):.0f} | {codes} |")
print(f"\n(oha JSON in {out}; medians over {rounds} alternating rounds)")
EOF
