#!/usr/bin/env bash
# The heap freeze (engine.gc_freeze, turnrl/observe/gc_heap.py) A/B on the multi-turn bench of run_gpu.sh, prefix
# cache on: ROUNDS rounds (2) of gc_freeze=false then =true on one machine, WARMUP (2) and REPEATS (5) as in
# run_gpu.sh, then summarize.py on each file (wall times, admissions, garbage-collection pauses per phase).
# Device machine, from the repo root (carry .devcache/smollm2-tokenizer, made here with run_gpu.sh --prepare):
#   OUT=$OUT bash benchmarks/fast_prefix/gc_ab.sh      -> $OUT/gc_ab.tar.gz (logs and JSON)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gc_ab}
W=$OUT/gc_ab
mkdir -p "$W"
export WARMUP=${WARMUP:-2} REPEATS=${REPEATS:-5} VARIANTS=cache
for round in $(seq "${ROUNDS:-2}"); do
  for freeze in false true; do
    echo "== $(date -u +%T) round $round gc_freeze=$freeze"
    OUT=$W NAME=gc_${freeze}_$round bash benchmarks/fast_prefix/run_gpu.sh engine.gc_freeze=$freeze "$@" > /dev/null 2>&1
    python3 benchmarks/fast_prefix/summarize.py "$W/gc_${freeze}_${round}_cache.json"
  done
done
tar -czf "$OUT/gc_ab.tar.gz" -C "$OUT" gc_ab
