#!/usr/bin/env bash
# Variants of `turnrl bench train` (Qwen2.5-0.5B shape, 64 rows x <= 1024 tokens, full fine-tuning) on one GPU,
# each writing $OUT/<name>.json and $OUT/<name>.log and printing its MFU lines. From the repo root, e.g. the
# runs behind benchmarks/results/h200_bench_train.json and h200_bench_train_padded.json:
#   bash benchmarks/run_train_variants.sh \
#     h200_bench_train "trainer.compile=true trainer.micro_batch_tokens=65536 trainer.packing=true" \
#     h200_bench_train_padded "trainer.compile=true trainer.micro_batch_tokens=65536"
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/train_variants}; mkdir -p "$OUT"
BASE="--model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0"
while [ $# -ge 2 ]; do
  name=$1; over=$2; shift 2
  start=$(date +%s)
  timeout "${VARIANT_TIMEOUT:-240}" python3 -m turnrl bench train $BASE $over --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "== $name ($over): rc=$? $(( $(date +%s) - start ))s"
  grep -E "update_mfu_6n|update_mfu_with|update_tokens_per_s|padding|peak memory|Error|error" "$OUT/$name.log" | head -8
done
