#!/usr/bin/env bash
# A/B on one machine: `turnrl bench train` (README's packed, compiled command, with its kernel profile) with the
# fused head's chunk passes as the Triton kernels of turnrl/train/head_kernel.py (`triton`, CUDA's default since
# 2026-12-06), as torch.compile'd pure chunk bodies (`compiled`, the default before) and as the compiled in-place
# bodies (`inplace`, the CPU ones).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-runs/fused_head_ab}; mkdir -p "$OUT"
ARGS="bench train --model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 --peak-tflops 790 ${PROFILE---profile} trainer.compile=true trainer.micro_batch_tokens=65536 trainer.packing=true ${EXTRA:-}"
i=0
for variant in ${VARIANTS:-triton compiled triton compiled}; do
  i=$((i + 1)); name="train_${i}_$variant"
  timeout "${STEP_TIMEOUT:-240}" python3 - $ARGS --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 <<PY
import sys
import torch
import turnrl.train.fused_head as f
bodies = {"compiled": (f._fused_forward, f._fused_backward), "inplace": (f._chunk_forward, f._chunk_backward)}
if "$variant" in bodies:
    f._KERNELS["cuda"] = tuple(torch.compile(fn, dynamic=True) for fn in bodies["$variant"])
from turnrl.cli import main
sys.exit(main(sys.argv[1:]))
PY
  echo "== $variant rc=$?"; grep -E "^ +[0-9]+ +[0-9.]+ |update_mfu_executed|logprob_pass_s|^peak" "$OUT/$name.log" | head -8
done
