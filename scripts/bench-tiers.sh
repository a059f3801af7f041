#!/usr/bin/env bash
# Time to first token of one prompt by where its KV is: computed cold, found in the device
# arena, and found in the host tier (evicted there by a second prompt of the same size, copied
# back on the hit). `tandem up --model` with one decode worker whose device arena holds about
# one such prompt (--kv-memory-mb) and a host tier that holds several (--host-blocks). ROUNDS
# (default 2) rounds, fresh prompts each; one JSON line per round, then the medians.
#
#   ROUNDS=2 TOKENS=4000 bash scripts/bench-tiers.sh [MODEL.gguf] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${2:-2}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }
target=${CARGO_TARGET_DIR:-target}
cargo build --release --quiet --bin tandem

python3 - "$target/release/tandem" "$model" "$threads" "${ROUNDS:-2}" "${TOKENS:-4000}" <<'PY'
import http.client, json, os, statistics, sys, time

sys.path.insert(0, os.path.join(os.getcwd(), "scripts/lib"))
import tandem_up

tandem, model, threads, rounds, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# This model's KV: 22.5 KiB per token, 360 KiB per 16-token block.
block_kib = 360
prompt_mb = (n // 16 + 1) * block_kib / 1024
# Room for one such prompt and a little: the second one evicts all of the first.
device_mb = int(prompt_mb) + 4
host_blocks = 4 * (n // 16 + 1)

def up():
    return tandem_up.start(
        tandem, ["--model", model, "--prefill", "0", "--decode", "1", "--threads", threads,
                 "--kv-memory-mb", str(device_mb), "--host-blocks", str(host_blocks)])

def ttft(prompt):
    body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"HTTP {r.status}: {r.read()!r}")
    first, cached = None, None
    for line in r:
        if not line.startswith(b"data: {"):
            continue
        if first is None:
            first = time.perf_counter() - start
        u = json.loads(line[6:]).get("usage")
        if u:
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    return first, cached

def prompt(seed):
    return [200 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]

p, port = up()
try:
    ttft(prompt(0)[:64])
    runs = []
    for rnd in range(rounds):
        a, b = prompt(2 * rnd + 1), prompt(2 * rnd + 2)
        cold = ttft(a)
        device = ttft(a)
        ttft(b)  # pushes a's blocks out of the device arena, into the host tier
        host = ttft(a)
        row = {"cold_s": cold[0], "device_s": device[0], "host_s": host[0],
               "cached_tokens": {"cold": cold[1], "device": device[1], "host": host[1]}}
        runs.append(row)
        print(json.dumps({"round": rnd, **{k: (round(v, 3) if isinstance(v, float) else v)
                                          for k, v in row.items()}}), flush=True)
    med = lambda k: round(statistics.median(r[k] for r in runs), 3)
    print(json.dumps({"model": model, "threads": int(threads), "prompt_tokens": n,
                      "device_kv_mb": device_mb, "host_blocks": host_blocks,
                      "cold_s": med("cold_s"), "device_s": med("device_s"),
                      "host_s": med("host_s")}))
finally:
    tandem_up.stop(p)
PY
