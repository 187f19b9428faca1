#!/usr/bin/env bash
# Admission graphs on the GPU (turnrl/engines/fast/admit.py), A/B on the multi-turn bench of run_gpu.sh:
#   1. the fast engine's GPU tests (admit, prefix cache, engine) and sdpa_probe.py (the prefill attention);
#   2. run_gpu.sh with engine.fast_admission_graphs=true, then =false (prefix cache on and off each; GRAPHS_OFF=cache:
#      the cache variant only for false);
#   3. SWITCH_S set (seconds, several allowed): graphs on, cache on, with sys.setswitchinterval(each) in the bench;
#   4. SPY set (a py-spy binary): a per-thread py-spy profile (raw, 100 Hz) of the graphs-on cache run.
# Device machine, from the repo root (carry .devcache/smollm2-tokenizer, made here with run_gpu.sh --prepare):
#   OUT=$OUT bash benchmarks/fast_prefix/admission_ab.sh     -> $OUT/admission_ab.tar.gz (logs, JSON, profiles)
# REPEATS (3) as in run_gpu.sh; GPU_TESTS: other test files for step 1. benchmarks/fast_prefix/summarize.py prints each repeat's counters.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/admission_ab}
W=$OUT/admission_ab
mkdir -p "$W"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
stamp() { echo "== $(date -u +%T) $*"; }
stamp "gpu tests"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/engines/test_fast_admit.py \
  tests/engines/test_fast_prefix.py tests/engines/test_fast.py} > "$W/gpu_tests.txt" 2>&1
tail -2 "$W/gpu_tests.txt"
stamp "sdpa probe"
timeout 120 python3 benchmarks/fast_prefix/sdpa_probe.py --json "$W/sdpa_probe.json" 2>&1 | tee "$W/sdpa_probe.txt"
for graphs in true false; do
  stamp "graphs $graphs"
  variants="cache nocache"
  [ "$graphs" = false ] && [ "${GRAPHS_OFF:-}" = cache ] && variants=cache
  OUT=$W NAME=mt_graphs_$graphs VARIANTS=$variants bash benchmarks/fast_prefix/run_gpu.sh \
    engine.fast_admission_graphs=$graphs > /dev/null 2>&1
  for v in $variants; do python3 benchmarks/fast_prefix/summarize.py "$W/mt_graphs_${graphs}_$v.json"; done
done
for interval in ${SWITCH_S:-}; do
  stamp "switch interval $interval s"
  mkdir -p "$W/site_$interval" && echo "import sys; sys.setswitchinterval($interval)" > "$W/site_$interval/sitecustomize.py"
  PYTHONPATH=$W/site_$interval:$PWD OUT=$W NAME=mt_switch_$interval VARIANTS=cache \
    bash benchmarks/fast_prefix/run_gpu.sh > /dev/null 2>&1
  python3 benchmarks/fast_prefix/summarize.py "$W/mt_switch_${interval}_cache.json"
done
if [ -n "${SPY:-}" ]; then
  stamp "py-spy"
  printf '#!/bin/bash\nexec %s record -r 100 --threads -f raw -o %s/spy_$$.raw -- python3 "$@"\n' "$SPY" "$W" \
    > "$W/spy_python" && chmod +x "$W/spy_python"
  PYTHON=$W/spy_python OUT=$W NAME=mt_spy VARIANTS=cache REPEATS=2 bash benchmarks/fast_prefix/run_gpu.sh \
    > /dev/null 2>&1
  python3 benchmarks/fast_prefix/summarize.py "$W/mt_spy_cache.json"
fi
stamp "done"
tar -czf "$OUT/admission_ab.tar.gz" -C "$OUT" admission_ab && rm -rf "$W"
