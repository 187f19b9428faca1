#!/usr/bin/env bash
# One GPU call for the decode step's weight products and the update's parameter dtype, in this order (PARTS):
#   engine       the fast engine's GPU tests and `turnrl bench engine` (engine_gpu.sh's parts): the card's baseline
#   train        param_dtype_probe.py's two arms: `turnrl bench train`, the README's command with --profile, on
#                fp32 parameters under autocast and on bf16 parameters
#   exact_tests  the exact mode's GPU-marked tests
#   gemm         decode_gemm_probe.py: cuBLAS, cuBLASLt, split-K Triton, inductor max-autotune at 256 and 128 rows
# From the repo root on the device, with .devcache/models/tiny-random carried:
#   bash benchmarks/decode_gemm_gpu.sh   (results in $OUT)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/decode_gemm_gpu}; mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
PARTS=${PARTS:-engine train exact_tests gemm}
[[ " $PARTS " == *" engine "* ]] && OUT=$OUT PARTS="gpu_tests engine" bash benchmarks/engine_gpu.sh
run_part() { local name=$1; shift; [[ " $PARTS " == *" $name "* ]] || return 0; local start=$(date +%s)
             timeout "${STEP_TIMEOUT:-400}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: rc=$? $(( $(date +%s) - start ))s"; }
TRAIN="--model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 --profile trainer.compile=true \
trainer.micro_batch_tokens=65536 trainer.packing=true"
for arm in fp32-autocast bf16-params; do
    STEP_TIMEOUT=${TRAIN_TIMEOUT:-150} run_part train python3 benchmarks/param_dtype_probe.py --arm $arm -- $TRAIN --json "$OUT/train_$arm.json"
    mv "$OUT/train.log" "$OUT/train_$arm.log" 2>/dev/null
    grep -E "update_mfu|update_s|profile of|^  [a-z_]+ +[0-9]|Error" "$OUT/train_$arm.log" | head -24
done
run_part exact_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/exact/test_ops.py tests/engines/test_fast_exact.py
tail -2 "$OUT/exact_tests.log" 2>/dev/null
run_part gemm python3 benchmarks/decode_gemm_probe.py --rows "${ROWS:-256,128}" --autotune --json "$OUT/gemm.json"
grep -E "^ *[0-9]+ |us\"|Error" "$OUT/gemm.log" | tail -20
