#!/usr/bin/env bash
# The fast engine's decode step on one GPU: its GPU tests, `turnrl bench engine` with the rotary embedding inside
# the cache-write and attention kernels (`fast-compile`, the default) against it in its own kernel
# (`fast-torch-rope`), and the attention kernel's split size inside the real step (decode_split_ab.py).
# From the repo root on the device (carry .devcache/models/tiny-random, made here with
# `TURNRL_HOME=.devcache turnrl models prepare tiny-random`):
#   bash benchmarks/engine_gpu.sh        (results and logs in $OUT, default runs/engine_gpu)
# PARTS (default all): which of gpu_tests engine split to run; SPLITS: split sizes to try (default 128,256).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/engine_gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
PARTS=${PARTS:-gpu_tests engine split}
run_part() { local name=$1; shift; [[ " $PARTS " == *" $name "* ]] || return 0; local start=$(date +%s)
             timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: rc=$? $(( $(date +%s) - start ))s"; }
run_part gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/engines/test_fast.py \
    tests/engines/test_sample_kernel.py tests/engines/test_fast_prefix.py
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
run_part engine python3 -m turnrl bench engine --model qwen2.5-0.5b-shape --batch 256 --prompt 256 --new 256 \
    --variants fast-compile,fast-torch-rope --json "$OUT/engine.json"
grep -v -E "Loading|Warn" "$OUT/engine.log" 2>/dev/null | tail -20
run_part split python3 benchmarks/decode_split_ab.py --split-keys "${SPLITS:-128,256}" --out "$OUT/split.json"
grep "split_keys" "$OUT/split.log" 2>/dev/null
