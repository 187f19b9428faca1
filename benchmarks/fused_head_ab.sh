#!/usr/bin/env bash
# A/B on one machine: `turnrl bench train` (README's packed, compiled command) with the fused head's pure chunk
# bodies (what CUDA compiles now) and with the in-place bodies (the CPU ones, compiled on CUDA before).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/fused_head_ab}; mkdir -p "$OUT"
ARGS="bench train --model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 --peak-tflops 790 trainer.compile=true trainer.micro_batch_tokens=65536 trainer.packing=true ${EXTRA:-}"
i=0
for variant in ${VARIANTS:-pure inplace pure}; do
  i=$((i + 1)); name="train_${i}_$variant"
  timeout 240 python3 - $ARGS --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 <<PY
import sys
import turnrl.train.fused_head as f
if "$variant" == "inplace":
    f._fused_forward, f._fused_backward = f._chunk_forward, f._chunk_backward
from turnrl.cli import main
sys.exit(main(sys.argv[1:]))
PY
  echo "== $variant rc=$?"; grep -E "update_mfu_executed|update_s |logprob_pass_s" "$OUT/$name.log"
done
