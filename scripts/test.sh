#!/usr/bin/env bash
# The test command (README): sets up what the tests need on a fresh machine, then runs the
# formatting check, clippy with warnings denied, and every test in the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages the build and tests need: protoc and the well-known .proto files for
# etcd-client's build; the real etcd and nats-server that the runtime and integration tests
# start on free loopback ports; UCX's headers and libraries, with libclang and pkg-config for
# bindgen, for the KV transfer's UCX transport.
APT_PACKAGES=(protobuf-compiler libprotobuf-dev etcd-server nats-server libucx-dev libclang-dev pkg-config)
. scripts/lib/apt.sh
ensure_apt "${APT_PACKAGES[@]}"

rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
