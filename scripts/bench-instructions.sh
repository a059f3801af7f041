#!/usr/bin/env bash
# Instructions per request of the tandem rows of scripts/bench-gateways.sh (`tandem frontend
# --backend-url` in front of the stand-in, and `tandem up` with one mocker worker), counted
# by callgrind: a figure that barely moves between runs, where CPU time on a shared VM drifts
# by a fifth (scripts/lib/bench_instructions.py says how it is taken and what it misses).
#
#   bash scripts/bench-instructions.sh
#   ROWS=tandem-kv SECONDS_RUN=5 bash scripts/bench-instructions.sh
#   BASELINE=/tmp/tandem-old bash scripts/bench-instructions.sh   # before/after, one run
#   PROFILE=release bash scripts/bench-instructions.sh            # `--release`, not `dist`
#
# Installs: wrk and valgrind (Debian).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/apt.sh
ensure_apt wrk valgrind
# The shipping profile (Cargo.toml's `dist`: whole-program LTO); PROFILE=release for a
# quicker build of a change being tried.
export PROFILE="${PROFILE:-dist}"
cargo build --profile "$PROFILE" --locked --bin tandem --bin tandem-standin --bin tandem-floor-proxy >&2
exec python3 scripts/lib/bench_instructions.py "$@"
