#!/usr/bin/env bash
# GPU check of tandem-kv-transfer and the workers, for a machine with an NVIDIA GPU: builds
# with `--features cuda`, runs the CUDA region test on the real device, the two-process
# transfer benchmark with CUDA regions on both sides (device-to-device copy as the baseline)
# and prints its table, then a prefill and a decode worker with their KV arenas in GPU memory
# (remote prefill output == local output). Takes a few minutes (mostly the release builds);
# fails with a clear message, exit status 2, when there is no GPU or driver.
#
#   bash scripts/gpu-check.sh [--full]   (--full: 3 rounds, 200 ms cells)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "gpu-check: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi -L >/dev/null 2>&1 || fail "nvidia-smi sees no GPU"
ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' || fail "libcuda.so (the CUDA driver library) is not installed"
command -v cargo >/dev/null 2>&1 || fail "cargo not found"
nvidia-smi -L

# Build requirements of the `ucx` feature (bindgen over Debian's UCX headers).
APT_PACKAGES=(libucx-dev libclang-dev pkg-config)
. scripts/lib/apt.sh
ensure_apt "${APT_PACKAGES[@]}"

mode=(--quick)
[ "${1:-}" = "--full" ] && mode=()

echo "== build (release, --features cuda)"
cargo build --release -p tandem-kv-transfer --features cuda --benches --tests

echo "== CUDA region test on the device"
cargo test --release -p tandem-kv-transfer --features cuda --lib -- region::tests --nocapture

echo "== two-process transfer benchmark, CUDA regions"
export UCX_NET_DEVICES=lo
timeout 600 cargo bench -p tandem-kv-transfer --features cuda --bench transfer -- --gpu "${mode[@]}"

echo "== workers with KV arenas in GPU memory: remote prefill == local, token for token"
cargo test --release -p tandem-decode-worker --features cuda --test remote_prefill -- gpu_arenas --nocapture
