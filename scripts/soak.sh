#!/usr/bin/env bash
# The memory soak (docs/RELIABILITY.md, Memory; issue 12 §4): `tandem up --processes` with
# fast mockers, N requests with distinct prompts from `tandem bench` (a random workload: no two
# prompts share a block), and every process's RSS (VmRSS from /proc) sampled into a CSV
# against the number of requests the frontend has answered. At the end it prints, per
# process, the RSS at the start, at the end of the first quarter of the requests, at the end,
# and how much it grew over the last quarter relative to its first-quarter level: memory that
# stays flat grows by ~0 % there. The short version of this is `tests/soak.rs` (CI).
#
#   bash scripts/soak.sh                                # 100,000 requests, glibc's malloc
#   bash scripts/soak.sh --requests 20000 --features mimalloc
#   bash scripts/soak.sh --bin /tmp/tandem-jemalloc --out /tmp/soak-jemalloc
#
# Options (each also as an environment variable, in capitals):
#   --requests N      requests, all with distinct prompts (100000)
#   --concurrency C   requests in flight (40, as in the issue)
#   --isl T           prompt tokens, one English word each (1200, as in the issue)
#   --osl T           output tokens (16)
#   --speedup S       the mockers' --speedup-ratio (50)
#   --interval S      seconds between RSS samples (2)
#   --features F      cargo features of the release build (e.g. jemalloc, mimalloc)
#   --bin PATH        a built tandem binary instead of building one
#   --out DIR         where the CSV, the logs and the bench's JSON go (a new temporary folder)
#   --port P          the frontend's port (a free one)
#   --max-growth PCT  exit 1 when a tandem process's last quarter grew more than this (2)
#
# Needs etcd and nats-server on PATH (`apt-get install etcd-server nats-server`) and curl.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-100000}
CONCURRENCY=${CONCURRENCY:-40}
ISL=${ISL:-1200}
OSL=${OSL:-16}
SPEEDUP=${SPEEDUP:-50}
INTERVAL=${INTERVAL:-2}
FEATURES=${FEATURES:-}
BIN=${BIN:-}
OUT=${OUT:-}
PORT=${PORT:-}
MAX_GROWTH=${MAX_GROWTH:-2}
while [ $# -gt 0 ]; do
  case "$1" in
    --requests) REQUESTS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --isl) ISL=$2; shift 2 ;;
    --osl) OSL=$2; shift 2 ;;
    --speedup) SPEEDUP=$2; shift 2 ;;
    --interval) INTERVAL=$2; shift 2 ;;
    --features) FEATURES=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --max-growth) MAX_GROWTH=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
for tool in etcd nats-server curl; do
  command -v "$tool" >/dev/null || { echo "soak.sh: $tool not found on PATH" >&2; exit 1; }
done

if [ -z "$BIN" ]; then
  cargo build --release --locked --bin tandem ${FEATURES:+--features "$FEATURES"} >&2
  BIN=target/release/tandem
fi
OUT=${OUT:-$(mktemp -d /tmp/tandem-soak-XXXX)}
mkdir -p "$OUT"
if [ -z "$PORT" ]; then
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
fi
URL="http://127.0.0.1:$PORT"
# The frontend's /metrics is on its admin listener.
ADMIN_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ADMIN="http://127.0.0.1:$ADMIN_PORT"

up_pid=""
sampler_pid=""
cleanup() {
  [ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null || true
  if [ -n "$up_pid" ] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$up_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$up_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

"$BIN" up --engine mocker --processes --port "$PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" --speedup-ratio "$SPEEDUP" >"$OUT/up.log" 2>&1 &
up_pid=$!
ready=""
for _ in $(seq 1 300); do
  if m=$(curl -sf "$ADMIN/metrics" 2>/dev/null) &&
    echo "$m" | grep -q '^tandem_workers{role="decode"} 2' &&
    echo "$m" | grep -q '^tandem_workers{role="prefill"} 2'; then
    ready=1
    break
  fi
  kill -0 "$up_pid" 2>/dev/null || break
  sleep 0.2
done
[ -n "$ready" ] || { echo "soak.sh: the cluster did not come up" >&2; tail -40 "$OUT/up.log" >&2; exit 1; }

# The tandem processes `tandem up` started, as "pid role" lines (prefill-0, decode-1, ...,
# numbered in start order); etcd and nats-server are left out (not ours).
roles() {
  ps -o pid=,args= --ppid "$up_pid" | sort -n | awk '
    { role = $3 }
    role == "frontend" { print $1, "frontend"; next }
    role == "prefill" || role == "decode" { print $1, role "-" (n[role]++) }'
}
roles >"$OUT/processes.txt"
echo "$up_pid up" >>"$OUT/processes.txt"

# Answered requests: tandem_http_requests_total summed over its labels.
answered() {
  curl -sf "$ADMIN/metrics" 2>/dev/null |
    awk '/^tandem_http_requests_total\{/ { s += $NF } END { printf "%d\n", s }'
}
index_entries() {
  curl -sf "$ADMIN/metrics" 2>/dev/null | awk '/^tandem_index_entries / { print $NF }'
}

sample() { # elapsed answered entries: one CSV row per process
  while read -r pid role; do
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || true)
    if [ -n "$rss" ]; then echo "$1,$2,$3,$role,$pid,$rss"; fi
  done <"$OUT/processes.txt"
}

echo "elapsed_s,answered,index_entries,role,pid,rss_kib" >"$OUT/rss.csv"
start=$(date +%s.%N)
base=$(answered)
(
  while true; do
    now=$(date +%s.%N)
    elapsed=$(awk -v a="$start" -v b="$now" 'BEGIN { printf "%.1f", b - a }')
    n=$(answered)
    sample "$elapsed" "$((${n:-$base} - base))" "$(index_entries)" >>"$OUT/rss.csv"
    sleep "$INTERVAL"
  done
) &
sampler_pid=$!

echo "soak: $REQUESTS requests, $ISL-word prompts (distinct), $OSL output tokens, \
$CONCURRENCY in flight, mockers at --speedup-ratio $SPEEDUP; $BIN; output in $OUT" >&2
"$BIN" bench --url "$URL" --workload random --requests "$REQUESTS" --rate 1000000 \
  --arrival constant --isl "$ISL" --osl "$OSL" --max-concurrency "$CONCURRENCY" \
  --salt "soak-$$" --quiet --json "$OUT/bench.json" >"$OUT/bench.txt"
end=$(date +%s.%N)
# One last sample once every answer is counted.
sleep "$INTERVAL"
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
now=$(date +%s.%N)
sample "$(awk -v a="$start" -v b="$now" 'BEGIN { printf "%.1f", b - a }')" \
  "$(($(answered) - base))" "$(index_entries)" >>"$OUT/rss.csv"

seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }')
failed=$(grep -o '"failed": *[0-9]*' "$OUT/bench.json" | head -1 | grep -o '[0-9]*$' || true)
echo
echo "$REQUESTS requests in $seconds s: $(awk -v n="$REQUESTS" -v s="$seconds" \
  'BEGIN { printf "%.0f", n / s }') req/s; failed: ${failed:-?}; index entries at the end: \
$(index_entries)"
echo
# Per process: RSS at the first sample, at the first quarter's end (the first sample with a
# quarter of the requests answered), at the third quarter's end, and at the end; the last
# quarter's growth relative to the first quarter's level.
awk -F, -v n="$REQUESTS" -v max="$MAX_GROWTH" '
  NR == 1 { next }
  {
    role = $4; rss = $6 / 1024
    if (!(role in first)) { first[role] = rss; order[++k] = role }
    if ($2 >= n / 4 && !(role in q1)) q1[role] = rss
    if ($2 >= 3 * n / 4 && !(role in q3)) q3[role] = rss
    last[role] = rss
    if (rss > peak[role]) peak[role] = rss
  }
  END {
    printf "| process | start MiB | 1st quarter MiB | end MiB | peak MiB | last quarter |\n"
    printf "| --- | ---: | ---: | ---: | ---: | ---: |\n"
    bad = 0
    for (i = 1; i <= k; i++) {
      r = order[i]
      if (!(r in q1) || !(r in q3)) { printf "| %s | %.1f | - | %.1f | %.1f | - |\n", r, first[r], last[r], peak[r]; continue }
      g = 100 * (last[r] - q3[r]) / q1[r]
      printf "| %s | %.1f | %.1f | %.1f | %.1f | %+.2f %% |\n", r, first[r], q1[r], last[r], peak[r], g
      if (r != "up" && g > max) bad = 1
    }
    exit bad
  }' "$OUT/rss.csv" | tee "$OUT/summary.md" || {
  echo "soak.sh: a process grew more than $MAX_GROWTH % over the last quarter" >&2
  exit 1
}
