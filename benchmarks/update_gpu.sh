#!/usr/bin/env bash
# The update path on one GPU: the GPU tests, `turnrl bench train` (packed, compiled, full fine-tuning) with a
# kernel profile, the same with LoRA rank 32, and the shared-prefix lane cost. From the repo root on the device:
#   bash benchmarks/update_gpu.sh      (results and logs in $OUT, default runs/update_gpu)
# The GPU tests need the tiny-random model, which the device cannot build (no network for SmolLM2): prepare it
# here with `TURNRL_HOME=.devcache turnrl models prepare tiny-random` (16 MB) and name .devcache in `carry`.
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/update_gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# PARTS (default all): which of gpu_tests train_full train_lora lane_cost to run
PARTS=${PARTS:-gpu_tests train_full train_lora lane_cost}
step() { local name=$1; shift; [[ " $PARTS " == *" $name "* ]] || return 0; local start=$(date +%s); timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1
         echo "== $name: rc=$? $(( $(date +%s) - start ))s"; }
step gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/engines/test_fast.py \
    tests/engines/test_fast_exact.py tests/engines/test_fast_prefix.py tests/engines/test_sample_kernel.py \
    tests/train/test_exact_training.py tests/exact/test_ops.py
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
BASE="--model qwen2.5-0.5b-shape --batch 64 --seq-len 1024"
step train_full python3 -m turnrl bench train $BASE --lora-rank 0 --profile trainer.compile=true \
    trainer.micro_batch_tokens=65536 trainer.packing=true --json "$OUT/train_full.json"
grep -E "update_mfu|update_tokens_per_s|profile of|^  [a-z_]+ +[0-9]|Error" "$OUT/train_full.log" 2>/dev/null | head -30
step train_lora python3 -m turnrl bench train $BASE --lora-rank 32 --steps 2 --repeats 2 trainer.compile=true \
    trainer.micro_batch_tokens=65536 trainer.packing=true --json "$OUT/train_lora.json"
grep -E "update_mfu_6n|update_tokens_per_s|Error" "$OUT/train_lora.log" 2>/dev/null | head -5
step lane_cost python3 benchmarks/lane_cost_probe.py --prefix 512 --lengths 256,512,1024,2048
grep -E "lane_cost_tokens_median|s_per_suffix|Error" "$OUT/lane_cost.log" 2>/dev/null
