#!/usr/bin/env bash
# tandem in front of a real llama.cpp server, as a new user would put it there: llama.cpp's
# Python server (llama-cpp-python 0.3.36, `python -m llama_cpp.server`) on the SmolLM2 GGUF,
# and `tandem frontend --backend-url` in front of it. That server has no GET /health and
# refuses prompts of token ids (a 500 wrapping its validation error), so the sidecar watches
# it another way and sends it text: a completion's prompt, a chat's messages for the
# server's own template. Checks that a
# greedy completion and a greedy chat through tandem are the server's own answers, word for
# word, with the server's usage, and prints what the sidecar found at start.
#
# llama-cpp-python builds llama.cpp from source into target/python/llama on first use (15-20
# minutes on 2 cores): a check to run by hand, not in CI, where tests/engines.rs runs the
# same paths against tandem-standin --text-prompts --no-health.
#
#   bash scripts/try-llama-server.sh [model.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."

model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }
venv=target/python/llama
if ! "$venv/bin/python3" -c 'import llama_cpp.server, uvicorn' 2>/dev/null; then
  python3 -m venv "$venv"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/python3" -m pip install --quiet \
    --disable-pip-version-check --no-cache-dir 'llama-cpp-python[server]==0.3.36' numpy
fi
cargo build --release --locked --bin tandem >&2

OUT=${OUT:-$(mktemp -d /tmp/tandem-llama-XXXX)}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SERVER=$(free_port)
FRONT=$(free_port)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$venv/bin/python3" -m llama_cpp.server --model "$model" --host 127.0.0.1 --port "$SERVER" \
  --n_ctx 4096 --n_threads 1 >"$OUT/llama-server.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do curl -sf "127.0.0.1:$SERVER/v1/models" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "127.0.0.1:$SERVER/v1/models" >/dev/null || { cat "$OUT/llama-server.log" >&2; exit 1; }

target/release/tandem frontend --listen "127.0.0.1:$FRONT" --admin-listen off \
  --backend-url "http://127.0.0.1:$SERVER" --tokenizer "$model" --model smollm2 \
  --context-length 4096 >"$OUT/frontend.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do
  curl -sf "127.0.0.1:$FRONT/health" >/dev/null 2>&1 && break
  sleep 0.1
done

echo "== what the sidecar found at start (frontend log)"
grep -E "liveness|token-id prompts|engine found" "$OUT/frontend.log" | sed 's/^/  /'

python3 - "$SERVER" "$FRONT" <<'EOF'
import json, sys, urllib.error, urllib.request
server, front = sys.argv[1], sys.argv[2]
def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

status, body = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
print(f"== the server itself, asked with token ids: {status}")
chat = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24,
        "temperature": 0, "model": "smollm2"}
completion = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
              "model": "smollm2"}
ok = True
for name, path, body, text in [
    ("chat", "/v1/chat/completions", chat, lambda r: r["choices"][0]["message"]["content"]),
    ("completion", "/v1/completions", completion, lambda r: r["choices"][0]["text"]),
]:
    s1, direct = post(server, path, body)
    s2, through = post(front, path, body)
    assert s1 == 200 and s2 == 200, (s1, direct, s2, through)
    same = text(direct) == text(through)
    usage = (direct["usage"]["prompt_tokens"], through["usage"]["prompt_tokens"])
    ok &= same and usage[0] == usage[1]
    print(f"== {name}: {'the same answer' if same else 'ANSWERS DIFFER'}; prompt tokens "
          f"server {usage[0]}, through tandem {usage[1]}")
    print(f"   server: {text(direct)!r}\n   tandem: {text(through)!r}")
status, body = post(front, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
print(f"== a token-id prompt through tandem: {status} {body}")
ok &= status == 400
sys.exit(0 if ok else 1)
EOF
echo "(logs in $OUT)"
