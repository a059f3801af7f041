#!/usr/bin/env bash
# The native engine served: `tandem up --model` (one decode worker with every core, HTTP,
# routing, gRPC) beside the bare engine (the bench_engine example, same file and threads),
# in one run, ROUNDS (default 3) interleaved rounds of each (this kind of machine is noisy:
# single runs vary by ±20 %). Prints one JSON line with the medians and each round's figures:
#
# - bare: the engine's decode at batch 1 after 512 tokens and 16 streams' aggregate;
# - served: the same two through the completions API (the same prompt token ids, greedy,
#   ignore_eos, streamed), and their ratios to the bare figures of the same round;
# - the process's RSS against weights + KV budget + 100 MB, and a 2,000-token chat prompt's
#   time to first token cold and repeated (served from the prefix cache).
#
#   ROUNDS=3 bash scripts/bench-serve.sh [MODEL.gguf] [THREADS] [KV_MEMORY_MB]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${2:-2}
kv_mb=${3:-256}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }
target=${CARGO_TARGET_DIR:-target}

cargo build --release --quiet -p tandem-native --example bench_engine
cargo build --release --quiet --bin tandem

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
"$target/release/tandem" up --model "$model" --port "$port" --prefill 0 --decode 1 \
  --threads "$threads" --kv-memory-mb "$kv_mb" >"$log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null || true; rm -f "$log"' EXIT

python3 - "$port" "$up" "$model" "$kv_mb" "$target/release/examples/bench_engine" "$threads" \
  "${ROUNDS:-3}" <<'PY'
import http.client, json, os, statistics, subprocess, sys, threading, time

port, pid, model_path, kv_mb = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
bench, threads_n, rounds = sys.argv[5], sys.argv[6], int(sys.argv[7])

def request(path, body, stream):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if not stream:
        return json.loads(r.read())
    # The arrival of every chunk with text, and the tokens each stands for: a token whose
    # bytes end inside a character comes out with the next one, so the usage's count is
    # spread over the chunks.
    times, usage = [], None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    return times, usage["completion_tokens"] / len(times)

for _ in range(600):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        if c.getresponse().status == 200:
            break
    except OSError:
        pass
    time.sleep(0.1)
else:
    sys.exit("tandem up did not become ready")

def prompt(id, n):
    # bench_engine's prompts: the same token ids.
    return [200 + (i * 7919 + id * 31) % 40000 for i in range(n)]

def completion(id, n, max_tokens):
    return {"prompt": prompt(id, n), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

def served():
    # Batch 1 after 512 tokens: 64 tokens; the rate between the first and the last.
    t, per = request("/v1/completions", completion(9, 512, 65), True)
    b1 = (len(t) - 1) * per / (t[-1] - t[0])
    # 16 streams of 128-token prompts: tokens that arrive once all have their first, over the
    # time from then to the last.
    results = [None] * 16
    def run(i):
        results[i] = request("/v1/completions", completion(100 + i, 128, 65), True)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    start = max(t[0] for t, _ in results)
    end = max(t[-1] for t, _ in results)
    tokens = sum(per * sum(1 for x in t if x > start) for t, per in results)
    return b1, tokens / (end - start)

request("/v1/completions", completion(1, 32, 4), True)
per_round = []
for _ in range(rounds):
    bare = json.loads(subprocess.run([bench, model_path, threads_n], check=True,
                                     capture_output=True, text=True).stdout)
    b1, b16 = served()
    per_round.append({
        "bare_b1": bare["decode_b1_ctx512_tok_s"], "served_b1": b1,
        "bare_b16": bare["decode_b16_aggregate_tok_s"], "served_b16": b16,
        "bare_prefill_512": bare["prefill_512_tok_s"],
        "b1_ratio": b1 / bare["decode_b1_ctx512_tok_s"],
        "b16_ratio": b16 / bare["decode_b16_aggregate_tok_s"],
    })
median = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}

# A 2,000-token chat prompt, cold then repeated: time to the first streamed chunk.
words = " ".join(f"w{i * 37 % 1000}" for i in range(510))
chat = {"messages": [{"role": "user", "content": words}], "max_tokens": 2, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}
def ttft():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(chat), {"content-type": "application/json"})
    r = c.getresponse()
    first, usage = None, None
    for line in r:
        if line.startswith(b"data: {"):
            first = first or time.perf_counter() - started
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    return first, usage
cold, u_cold = ttft()
warm, u_warm = ttft()

rss_kb = int(next(l.split()[1] for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:")))
weights_mb = os.path.getsize(model_path) / 2**20
print(json.dumps({
    "engine": "tandem up (HTTP, routing, gRPC) beside the bare engine",
    "threads": int(threads_n),
    "median": median,
    "rounds": per_round,
    "rss_mb": rss_kb / 1024,
    "rss_bound_mb": weights_mb + kv_mb + 100,
    "prompt_2000_tokens": u_cold["prompt_tokens"],
    "ttft_cold_s": cold,
    "ttft_repeat_s": warm,
    "repeat_cached_tokens": u_warm["prompt_tokens_details"]["cached_tokens"],
    "ttft_repeat_over_cold": warm / cold,
}))
PY
