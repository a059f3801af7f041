#!/usr/bin/env bash
# tandem's frontend beside SGLang's model gateway (`smg` 1.13.0) and vLLM's router
# (`vllm-router` 0.1.17), each in front of the same fast OpenAI-compatible server
# (`tandem-standin --speedup-ratio 1e9`, which answers at once), as a newcomer would compare
# gateways: wrk at 8 connections with 20 ms think time for the latency each adds and the CPU
# it spends per request, then wrk with no think time at rising connections for the most
# requests per second it passes. Rounds alternate between the gateways; each figure is the
# median of the rounds. One more row, `tandem-up`, is `tandem up` with one in-process mocker
# worker answering at once (no server behind it: its CPU is frontend and engine together,
# to compare with the stub's own); and `floor`, the least a proxy on hyper costs
# (`tandem-floor-proxy`: bodies passed through unparsed, not in the default set), to read
# each gateway's own work off. Prints one table (markdown) and leaves wrk's output under
# $OUT.
#
#   bash scripts/bench-gateways.sh                       # 3 rounds, 10 s per latency run
#   ROUNDS=1 SECONDS_LATENCY=5 bash scripts/bench-gateways.sh
#   GATEWAYS="direct tandem-kv vllm-rr" bash scripts/bench-gateways.sh
#   GATEWAYS="direct floor vllm-rr tandem-kv" bash scripts/bench-gateways.sh
#   BASELINE=/tmp/tandem-old GATEWAYS="direct tandem-kv" bash scripts/bench-gateways.sh  # before/after
#   PROFILE=release bash scripts/bench-gateways.sh       # builds as `--release`, not `dist`
#
# Installs: wrk (Debian) and the two wheels in a venv of their own (target/python/gateways).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/apt.sh
ensure_apt wrk

venv=target/python/gateways
[ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
"$venv/bin/python3" -m pip install --quiet --disable-pip-version-check \
  smg==1.13.0 vllm-router==0.1.17

# The shipping profile (Cargo.toml's `dist`: whole-program LTO); PROFILE=release for a
# quicker build of a change being tried.
export PROFILE="${PROFILE:-dist}"
cargo build --profile "$PROFILE" --locked --bin tandem --bin tandem-standin --bin tandem-floor-proxy >&2
exec python3 scripts/lib/bench_gateways.py "$@"
