#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU: the native engine on the device (its kernels
# against f64 and against the CPU's f32 path, batch invariance bit for bit, real text, its
# speed), served through `tandem up --device cuda` with disaggregated == aggregated bit for bit
# over the in-process copy and TCP, CUDA KV regions, and workers with KV arenas in GPU memory
# (remote prefill == local). Fails with a clear message, exit status 2, when there is no GPU.
#
#   bash scripts/gpu-check.sh                   build here (cargo, --features cuda), then run
#   bash scripts/gpu-check.sh --build-only DIR  build the binaries into DIR (no GPU needed)
#   bash scripts/gpu-check.sh --prebuilt DIR    run DIR's binaries (a GPU machine without Rust)
#
# MODEL=PATH checks another GGUF; SYNTHETIC=1 says it is scripts/lib/synthetic_gguf.py's
# (the real model's shape with random weights, where the file cannot travel): its text is
# noise, so the real-text test is left out.
#
# NVRTC (libnvrtc.so, CUDA 12 or later) must be findable: the kernels are compiled at run
# time. Where only a versioned libnvrtc.so.N is installed (CUDA 13, or the pip wheels), the
# script links it under a name the loader looks for.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
model=${MODEL:-target/models/SmolLM2-135M-Instruct.Q4_1.gguf}

fail() { echo "gpu-check: $*" >&2; exit 2; }

build() {
  local dir=$1
  mkdir -p "$dir"
  # Bindgen over Debian's UCX headers (the `ucx` feature of the tests' workers).
  APT_PACKAGES=(libucx-dev libclang-dev pkg-config protobuf-compiler)
  . scripts/lib/apt.sh
  ensure_apt "${APT_PACKAGES[@]}"
  cargo build --release --locked --features cuda --bin tandem
  cargo build --release --locked -p tandem-native --features cuda --example bench_engine
  # The test binaries, by name (cargo's are hashed).
  cargo test --release --locked --no-run --message-format=json \
    --features tandem-native/cuda,tandem-kv-transfer/cuda,tandem-decode-worker/cuda \
    -p tandem-native -p tandem-kv-transfer -p tandem-decode-worker \
    | python3 -c '
import json, os, shutil, sys
names = {("native", "tandem_native"): "native-lib", ("native", "engine"): "native-engine",
         ("kv-transfer", "tandem_kv_transfer"): "kv-transfer-lib",
         ("decode-worker", "remote_prefill"): "decode-remote-prefill"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        crate = os.path.basename(os.path.dirname(m["manifest_path"]))
        name = names.get((crate, m["target"]["name"]))
        if name:
            shutil.copy(m["executable"], os.path.join(sys.argv[1], name))
' "$dir"
  cp target/release/tandem target/release/examples/bench_engine "$dir/"
  strip "$dir"/* 2>/dev/null || true
  echo "$root" > "$dir/root"
  ls -la "$dir"
}

case "${1:-}" in
  --build-only) build "${2:?--build-only DIR}"; exit 0 ;;
  --prebuilt) bin=$(cd "${2:?--prebuilt DIR}" && pwd) ;;
  *) bin=$root/target/gpu-check; build "$bin" ;;
esac

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi -L >/dev/null 2>&1 || fail "nvidia-smi sees no GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ -f "$model" ] || fail "$model is missing (scripts/test.sh fetches it)"
# The engine tests read the model where scripts/test.sh puts it.
if [ ! -e target/models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p target/models
  ln -sf "$(cd "$(dirname "$model")" && pwd)/$(basename "$model")" \
    target/models/SmolLM2-135M-Instruct.Q4_1.gguf
fi

# NVRTC under a name cudarc's loader tries (libnvrtc.so or libnvrtc.so.12).
if ! ldconfig -p | grep -q 'libnvrtc\.so\(\.12\)\? '; then
  lib=$( (ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null; \
          find /usr /opt -name 'libnvrtc.so.*' -not -name '*alt*' 2>/dev/null) | grep -v builtins | head -1)
  [ -n "$lib" ] || fail "NVRTC (libnvrtc.so) not found: install CUDA's nvrtc (or the nvidia-cuda-nvrtc wheel)"
  mkdir -p /tmp/gpu-check-lib
  ln -sf "$lib" /tmp/gpu-check-lib/libnvrtc.so
  export LD_LIBRARY_PATH=/tmp/gpu-check-lib:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "NVRTC: $lib"
fi
# The test binaries read the model and fixtures where they were built: that tree is this one.
built=$(cat "$bin/root")
if [ "$built" != "$root" ] && [ ! -e "$built" ]; then
  mkdir -p "$(dirname "$built")" && ln -s "$root" "$built"
fi

status=0
section() { echo; echo "== $*"; }
check() { if "$@"; then echo "PASS: $*"; else echo "FAIL: $*"; status=1; fi; }

section "the kernels: compiled by NVRTC, products against f64, batch invariance"
check "$bin/native-lib" gpu:: --test-threads=1
section "the engine on the GPU: invariance, the f32 reference, real text"
skip=()
[ -n "${SYNTHETIC:-}" ] && skip=(--skip answers_in_real_text)
check "$bin/native-engine" gpu_ --nocapture --test-threads=1 "${skip[@]}"
section "speed (prefill 512, decode batch 1 at context 512 and 16, 16 and 64 streams)"
check "$bin/bench_engine" "$model" 1 cuda
section "served: tandem up --device cuda, disaggregated == aggregated"
check python3 scripts/lib/served_identity.py "$bin/tandem" "$model" --device cuda
section "CUDA KV regions and workers with KV arenas in GPU memory"
check "$bin/kv-transfer-lib" region:: --nocapture
check "$bin/decode-remote-prefill" gpu_arenas --nocapture
exit $status
