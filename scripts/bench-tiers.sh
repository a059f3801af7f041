#!/usr/bin/env bash
# Time to first token of one prompt by where its KV is: computed cold, found in the device
# arena, found in the host tier (evicted there by a second prompt of the same size, copied
# back on the hit), and found in the disk tier (likewise, on a cluster with a disk tier and
# no host tier; DROP_CACHES=1 drops the page cache first, so the blocks come from the
# device, not from memory). `tandem up --model` with one decode worker whose device arena
# holds about one such prompt (--kv-memory-mb) and a host or disk tier that holds several.
# ROUNDS (default 2) rounds, fresh prompts each; one JSON line per round, then the medians.
# Each measurement also names the tiers the router's index saw the prompt in.
#
#   ROUNDS=2 TOKENS=4000 bash scripts/bench-tiers.sh [MODEL.gguf] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${2:-2}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }
target=${CARGO_TARGET_DIR:-target}
# TANDEM=path: a tandem built elsewhere (a GPU machine without Rust); flags in TANDEM_FLAGS
# go to every cluster (--device cuda).
if [ -z "${TANDEM:-}" ]; then
  cargo build --release --quiet --bin tandem
  TANDEM=$target/release/tandem
fi

python3 - "$TANDEM" "$model" "$threads" "${ROUNDS:-2}" "${TOKENS:-4000}" <<'PY'
import http.client, json, os, shutil, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.join(os.getcwd(), "scripts/lib"))
import tandem_up

tandem, model, threads, rounds, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
# This model's KV: 22.5 KiB per token, 360 KiB per 16-token block.
block_kib = 360
prompt_mb = (n // 16 + 1) * block_kib / 1024
# Room for one such prompt and a little: the second one evicts all of the first.
device_mb = int(prompt_mb) + 4
host_blocks = 4 * (n // 16 + 1)

def up(tier):
    flags = ["--model", model, "--prefill", "0", "--decode", "1", "--threads", threads,
             "--kv-memory-mb", str(device_mb), *os.environ.get("TANDEM_FLAGS", "").split()]
    if tier == "host":
        flags += ["--host-blocks", str(host_blocks)]
    else:
        flags += ["--kv-disk-dir", disk_dir, "--kv-disk-mb", str(int(4 * prompt_mb) + 16)]
    return tandem_up.start(tandem, flags)

disk_dir = tempfile.mkdtemp(prefix="tandem-bench-tiers-")

def seen():
    """The tiers the router's index held the last routed prompt in."""
    c = http.client.HTTPConnection("127.0.0.1", tandem_up.admin_port(port), timeout=60)
    c.request("GET", "/status.json")
    d = json.loads(c.getresponse().read())["backend"]["decisions"][0]["decode"]["candidates"][0]
    return {t: d[f"overlap_{t}"] for t in ("device", "host", "disk")}

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
    return first, cached, seen()

def prompt(seed):
    return [200 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]

runs = []
try:
    for tier in ("host", "disk"):
        p, port = up(tier)
        try:
            ttft(prompt(0)[:64])
            for rnd in range(rounds):
                a, b = prompt(10 * rnd + 1 + (tier == "disk")), prompt(10 * rnd + 5)
                cold = ttft(a)
                row = {"tier": tier, "cold_s": cold[0]}
                if tier == "host":
                    device = ttft(a)
                    row["device_s"], row["device_seen"] = device[0], device[2]
                ttft(b)  # pushes a's blocks out of the device arena, into the tier below
                if tier == "disk" and os.environ.get("DROP_CACHES") == "1":
                    subprocess.run(["sync"], check=True)
                    try:
                        with open("/proc/sys/vm/drop_caches", "w") as f:
                            f.write("1\n")
                        row["page_cache"] = "dropped"
                    except OSError as e:
                        row["page_cache"] = f"kept ({e.strerror})"
                lower = ttft(a)
                row[f"{tier}_s"], row[f"{tier}_seen"] = lower[0], lower[2]
                row[f"{tier}_cached_tokens"] = lower[1]
                runs.append(row)
                print(json.dumps({"round": rnd, **{k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in row.items()}}), flush=True)
        finally:
            tandem_up.stop(p)
    med = lambda k: round(statistics.median(r[k] for r in runs if k in r), 3)
    print(json.dumps({"model": model, "threads": int(threads), "prompt_tokens": n,
                      "device_kv_mb": device_mb, "host_blocks": host_blocks,
                      "cold_s": med("cold_s"), "device_s": med("device_s"),
                      "host_s": med("host_s"), "disk_s": med("disk_s")}))
finally:
    shutil.rmtree(disk_dir, ignore_errors=True)
PY
