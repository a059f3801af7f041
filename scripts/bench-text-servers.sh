#!/usr/bin/env bash
# Routing over servers that take prompts as text only (as llama.cpp's Python server does):
# whose own prompt caches hit more, the frontend's kv policy (approximate: the router
# remembers where it sent each prefix) or round robin? Two stand-ins with `--text-prompts`
# (each reads text with its own tokenizer and keeps a real prefix cache, too small for every
# conversation at once) behind `tandem frontend --backend-url`; one seeded workload of chats
# that share system prompts by group, sent once per policy, each time to fresh servers. The
# servers' own counters say what their caches served (`vllm:prefix_cache_hits_total` over
# `vllm:prefix_cache_queries_total`). Prints one table row per policy.
#
#   bash scripts/bench-text-servers.sh
#   PREFIXES=12 REQUESTS=400 BLOCKS=400 bash scripts/bench-text-servers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

GROUPS_N=${PREFIXES:-8}
REQUESTS=${REQUESTS:-240}
BLOCKS=${BLOCKS:-320}
CONCURRENCY=${CONCURRENCY:-4}
SEED=${SEED:-7}
OUT=${OUT:-$(mktemp -d /tmp/tandem-text-servers-XXXX)}
mkdir -p "$OUT"

cargo build --release --locked --bin tandem --bin tandem-standin >&2
BIN=target/release

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT

wait_up() { # url what
  for _ in $(seq 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "$2 did not come up" >&2; exit 1
}

echo "| policy | requests | server cache hits / prompt tokens | hit rate | requests per server | wall s |"
echo "|---|---:|---:|---:|---|---:|"
for policy in kv round-robin; do
  engines=()
  for i in 0 1; do
    port=$(free_port)
    "$BIN/tandem-standin" --listen "127.0.0.1:$port" --text-prompts --speedup-ratio 50 \
      --device-blocks "$BLOCKS" >"$OUT/engine-$policy-$i.log" 2>&1 &
    pids+=($!)
    wait_up "127.0.0.1:$port/health" "stand-in $i"
    engines+=("http://127.0.0.1:$port")
  done
  front=$(free_port)
  admin=$(free_port)
  "$BIN/tandem" frontend --listen "127.0.0.1:$front" --admin-listen "127.0.0.1:$admin" \
    --policy "$policy" --backend-url "${engines[0]}" --backend-url "${engines[1]}" \
    >"$OUT/frontend-$policy.log" 2>&1 &
  pids+=($!)
  wait_up "127.0.0.1:$front/health" "frontend"
  for _ in $(seq 300); do
    n=$(curl -sf "127.0.0.1:$admin/metrics" | awk '/^tandem_workers\{role="decode"\}/ {print $2}')
    [ "${n:-0}" = "2" ] && break
    sleep 0.1
  done
  python3 - "$front" "$policy" "$GROUPS_N" "$REQUESTS" "$CONCURRENCY" "$SEED" "${engines[@]}" <<'EOF'
import json, random, re, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
front, policy, groups, requests, conc, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
engines = sys.argv[7:]
rng = random.Random(seed)
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()
systems = [" ".join(rng.choice(words) for _ in range(160)) + f" (group {g})" for g in range(groups)]
plan = [(rng.randrange(groups), i) for i in range(requests)]
def send(item):
    g, i = item
    body = {"messages": [{"role": "system", "content": systems[g]},
                         {"role": "user", "content": f"Question {i}: what is {words[i % len(words)]}?"}],
            "max_tokens": 4, "seed": i}
    req = urllib.request.Request(f"http://127.0.0.1:{front}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.headers.get("x-tandem-decode-worker")
start = time.time()
with ThreadPoolExecutor(conc) as pool:
    workers = list(pool.map(send, plan))
wall = time.time() - start
def counter(url, name):
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
hits = sum(counter(u, "vllm:prefix_cache_hits_total") for u in engines)
queries = sum(counter(u, "vllm:prefix_cache_queries_total") for u in engines)
spread = sorted({w: workers.count(w) for w in set(workers)}.values(), reverse=True)
print(f"| {policy} | {requests} | {hits:.0f} / {queries:.0f} | {hits / max(queries, 1):.3f} | "
      f"{spread} | {wall:.1f} |")
EOF
  cleanup
done
echo
echo "(logs in $OUT; $GROUPS_N system prompts of ~1,000 bytes, $BLOCKS blocks of 16 tokens per server)"
