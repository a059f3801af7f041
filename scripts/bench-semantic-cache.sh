#!/usr/bin/env bash
# The semantic cache on a labelled set (scripts/data/paraphrases.json: a question, a
# paraphrase, and a question worded alike that means something else): for a sweep of
# thresholds, how often the paraphrase hits (hit rate) and the look-alike hits (false-hit
# rate), from the embeddings the cache compares; then the latency of a hit beside a miss's,
# through `tandem up --semantic-cache`.
#
#   bash scripts/bench-semantic-cache.sh            # the native model (SmolLM2-135M) embeds
#   ENGINE=mocker bash scripts/bench-semantic-cache.sh
#   EMBEDDINGS_URL=http://host/v1/embeddings bash scripts/bench-semantic-cache.sh
#
# Needs only the Rust toolchain and python3 (standard library).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked --bin tandem >&2
port=${PORT:-18731}
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "port $port is in use (PORT=… picks another)" >&2
  exit 1
fi
flags=(--port "$port" --admin-listen off --semantic-cache)
[ "${ENGINE:-}" = mocker ] && flags+=(--engine mocker)
[ -n "${EMBEDDINGS_URL:-}" ] && flags+=(--semantic-cache-embeddings-url "$EMBEDDINGS_URL")
log=$(mktemp)
target/release/tandem up "${flags[@]}" >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
python3 scripts/lib/bench_semantic_cache.py "http://127.0.0.1:$port" \
  scripts/data/paraphrases.json "${EMBEDDINGS_URL:-}"
