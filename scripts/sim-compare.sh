#!/usr/bin/env bash
# Runs one matrix of `tandem sim` configurations (both bundled traces, every policy, every
# disaggregation mode, several routers with and without sync, delays, snapshots, host tier,
# synthetic workloads, a sweep) with two tandem binaries and reports every run whose JSON or
# markdown differs. For refactors that must leave the simulator's figures unchanged.
#
#   bash scripts/sim-compare.sh OLD_BINARY NEW_BINARY [OUTDIR]
#
# SNAPSHOT_OLD / SNAPSHOT_NEW: extra flags for the snapshot-mode runs of either side (e.g.
# SNAPSHOT_NEW="--merge-load-reports true" against a binary from before 2026-12-01).
set -euo pipefail
old=$1 new=$2 out=${3:-$(mktemp -d)}
here=$(cd "$(dirname "$0")/.." && pwd)
traces=${TRACES:-$here/traces}
C="$traces/conversation_trace.jsonl"
S="$traces/synthetic_trace.jsonl"

runs() { # SNAPSHOT_FLAGS
  local snap=$1
  cat <<RUNS
--trace $C --limit 2000 --workers 8 --policy kv
--trace $C --limit 1000 --workers 8 --policy round-robin
--trace $C --limit 1000 --workers 8 --policy random
--trace $C --limit 1000 --workers 8 --policy least-loaded
--trace $C --limit 1000 --workers 8 --policy power-of-two
--trace $C --limit 1000 --workers 8 --policy cache-aware
--trace $C --limit 1000 --workers 8 --policy prefix-hash
--trace $C --limit 1000 --workers 8 --policy kv --temperature 0.5
--trace $S --limit 2000 --workers 8 --policy kv --arrival-speedup 2
--trace $C --limit 1500 --workers 6 --prefill-workers 2 --disagg isl-bounding
--trace $C --limit 1500 --workers 6 --prefill-workers 2 --disagg always
--trace $C --limit 1500 --workers 6 --prefill-workers 2 --disagg prefill-load
--trace $C --limit 1500 --workers 6 --prefill-workers 2 --disagg isl-or-load
--trace $S --limit 1500 --workers 5 --prefill-workers 3 --disagg always --arrival-speedup 2
--trace $C --limit 2000 --workers 8 --routers 4
--trace $C --limit 2000 --workers 8 --routers 4 --event-delay-ms 50
--trace $C --limit 2000 --workers 8 --routers 4 --replica-sync false
--trace $C --limit 2000 --workers 8 --routers 4 --arrival-jitter-ms 3000
--trace $C --limit 1500 --workers 8 --routers 4 --replica-sync false --snapshot-interval-ms 500 $snap
--trace $C --limit 1500 --workers 8 --routers 4 --replica-sync false --snapshot-interval-ms 2000 --snapshot-stagger --policy least-loaded $snap
--trace $C --limit 1500 --workers 8 --routers 2 --snapshot-interval-ms 500 --event-delay-ms 20 $snap
--trace $C --limit 1500 --workers 8 --device-blocks 1024 --host-blocks 2048 --policy kv
--workload shared-prefix --requests 800 --rate 30 --workers 4 --isl 256 --prefix-len 1024 --seed 7
--workload multi-turn --requests 300 --rate 5 --workers 4 --turns 4 --think-time-ms 2000 --seed 3 --arrival gamma
--workload random --requests 500 --rate 40 --workers 4 --prefill-workers 2 --disagg isl-or-load --isl 3000 --isl-spread 0.5 --seed 11
--workload random --requests 1000 --rate 50 --workers 8 --sweep-rate 20,40 --seed 2
RUNS
}

side() { # BINARY DIR SNAPSHOT_FLAGS
  mkdir -p "$2"
  local i=0
  while read -r line; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    "$1" sim $line --json "$2/$i.json" > "$2/$i.md" 2> "$2/$i.err" || echo "run $i failed: $line" >&2
  done < <(runs "$3")
}

side "$old" "$out/old" "${SNAPSHOT_OLD:-}"
side "$new" "$out/new" "${SNAPSHOT_NEW:-}"
differ=0
i=0
while read -r line; do
  i=$((i + 1))
  if ! cmp -s "$out/old/$i.json" "$out/new/$i.json" || ! cmp -s "$out/old/$i.md" "$out/new/$i.md"; then
    echo "differs: run $i: $line"
    differ=$((differ + 1))
  fi
done < <(runs "")
echo "$i runs, $differ differ (outputs in $out)"
