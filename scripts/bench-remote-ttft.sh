#!/usr/bin/env bash
# Remote prefill's cost in time to first token, on the real model: `tandem up --model` with
# one prefill and one decode worker (THREADS each; one computes at a time), prompts of 512,
# 2,048 and 8,000 fresh token ids (nothing cached anywhere), one token each, streamed.
# `--disagg never` prefills on the decode worker (local TTFT); `--disagg always` on the
# prefill worker, whose KV then moves over each KV transport. ROUNDS (default 2) interleaved
# rounds; prints one JSON line per round and then the medians: remote TTFT ÷ local TTFT per
# transport and prompt size (issue goal: ≤ 1.05 on local and ucx, ≤ 1.10 on tcp).
#
#   ROUNDS=2 bash scripts/bench-remote-ttft.sh [MODEL.gguf] [THREADS] [TRANSPORTS...]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${2:-2}
shift $(($# < 2 ? $# : 2))
transports=${*:-local tcp ucx inline}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }
target=${CARGO_TARGET_DIR:-target}
# TANDEM=path: a tandem built elsewhere (a GPU machine without Rust); flags in TANDEM_FLAGS
# go to every cluster (--device cuda).
if [ -z "${TANDEM:-}" ]; then
  cargo build --release --quiet --bin tandem
  TANDEM=$target/release/tandem
fi

python3 - "$TANDEM" "$model" "$threads" "${ROUNDS:-2}" ${SIZES:-512 2048 8000} \
  -- $transports <<'PY'
import http.client, json, os, statistics, sys, time

sys.path.insert(0, os.path.join(os.getcwd(), "scripts/lib"))
import tandem_up

tandem, model, threads, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rest = sys.argv[5:]
sizes = [int(s) for s in rest[: rest.index("--")]]
transports = rest[rest.index("--") + 1 :]

def up(flags):
    # 8,000 tokens of this model's KV are 176 MB: room for one at a time and then some.
    return tandem_up.start(
        tandem, ["--model", model, "--prefill", "1", "--decode", "1", "--threads", threads,
                 "--kv-memory-mb", "400", *flags, *os.environ.get("TANDEM_FLAGS", "").split()],
        roles=("prefill", "decode"))

def ttft(port, n, seed, remote):
    prompt = [200 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]
    body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "stream": True,
            "temperature": 0}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"HTTP {r.status}: {r.read()!r}")
    assert (r.getheader("x-tandem-prefill-worker") is not None) == remote, "prefilled elsewhere"
    first = None
    for line in r:
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter() - start
    return first

configs = [("local-prefill", ["--disagg", "never"], False)] + [
    (t, ["--disagg", "always", "--kv-transport", t], True) for t in transports]
seed = 1
runs = []
for rnd in range(rounds):
    row = {}
    for name, flags, remote in configs:
        p, port = up(flags)
        try:
            # A short warm-up prompt: first-request costs (connections, allocations) out.
            ttft(port, 64, 10_000 + seed, remote)
            for n in sizes:
                seed += 1
                row[f"{name}/{n}"] = ttft(port, n, seed, remote)
        finally:
            tandem_up.stop(p)
    ratios = {f"{t}/{n}": row[f"{t}/{n}"] / row[f"local-prefill/{n}"]
              for t in transports for n in sizes}
    runs.append((row, ratios))
    print(json.dumps({"round": rnd, "ttft_s": {k: round(v, 3) for k, v in row.items()},
                      "remote_over_local": {k: round(v, 3) for k, v in ratios.items()}}),
          flush=True)

med = lambda key, i: round(statistics.median(r[i][key] for r in runs), 3)
print(json.dumps({
    "model": model, "threads": int(threads), "rounds": rounds,
    "local_ttft_s": {n: med(f"local-prefill/{n}", 0) for n in sizes},
    "remote_over_local": {t: {n: med(f"{t}/{n}", 1) for n in sizes} for t in transports},
}))
PY
