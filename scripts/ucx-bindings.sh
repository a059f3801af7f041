#!/usr/bin/env bash
# Regenerates the UCP bindings that tandem-kv-transfer checks in
# (crates/kv-transfer/src/ucx/sys_generated.rs) from this machine's UCX headers, with bindgen
# (crates/kv-transfer/tests/ucx_bindings.rs is the generator; its normal test checks the file is
# up to date). Needs Debian's libucx-dev and libclang-dev; the build itself needs neither.
set -euo pipefail
cd "$(dirname "$0")/.."
TANDEM_WRITE_UCX_BINDINGS=1 cargo test -p tandem-kv-transfer --test ucx_bindings -- --nocapture
git --no-pager diff --stat -- crates/kv-transfer/src/ucx/sys_generated.rs || true
