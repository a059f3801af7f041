#!/usr/bin/env bash
# The native engine beside llama.cpp on the same GGUF and the same threads, in one run:
# prefill of a 512-token prompt, decode at batch 1 after 512 tokens of context, and (tandem)
# 16 concurrent streams' aggregate decode rate. Prints one JSON line per engine.
#
#   bash scripts/bench-engine.sh [MODEL.gguf] [THREADS]
#
# llama.cpp runs through llama-cpp-python 0.3.36, which builds llama.cpp from source into
# target/python/llama on first use (about 10-15 minutes on 2 cores): a benchmark, not CI.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${2:-2}
[ -f "$model" ] || { echo "no $model: scripts/test.sh fetches the SmolLM2 GGUF" >&2; exit 1; }

venv=target/python/llama
if [ ! -x "$venv/bin/python3" ] || ! "$venv/bin/python3" -c 'import llama_cpp' 2>/dev/null; then
  python3 -m venv "$venv"
  # A VM may show AMX in cpuinfo without enabling its tile state: llama.cpp's native build
  # then uses AMX and crashes in its first forward pass. There, build for the same
  # instruction sets by name, AMX off.
  if grep -qw amx_int8 /proc/cpuinfo; then
    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
      -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF"
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=$threads "$venv/bin/python3" -m pip install --quiet \
    --disable-pip-version-check --no-cache-dir llama-cpp-python==0.3.36 numpy
fi

cargo build --release --quiet -p tandem-native --example bench_engine
"${CARGO_TARGET_DIR:-target}/release/examples/bench_engine" "$model" "$threads"

"$venv/bin/python3" - "$model" "$threads" <<'PY'
import json, sys, time
from llama_cpp import Llama

model, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False)
prompt = [200 + (i * 7919 + 9 * 31) % 40000 for i in range(512)]
best = float("inf")
for _ in range(3):
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    best = min(best, time.perf_counter() - start)
llm.reset()
llm.eval(prompt)
token = 1000
start = time.perf_counter()
for _ in range(64):
    llm.eval([token])
    token = (token * 31 + 7) % 40000
decode = 64 / (time.perf_counter() - start)
print(json.dumps({"engine": "llama.cpp (llama-cpp-python 0.3.36)", "threads": threads,
                  "prefill_512_tok_s": 512 / best, "decode_b1_ctx512_tok_s": decode}))
PY
