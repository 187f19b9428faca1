#!/bin/bash
# engine.exact on one H200: the invariance probe, the exactness tests in bf16 (gpu-marked and the ops on cuda),
# `turnrl bench engine` with the fast engine's default (fast-compile) and the exact mode (fast-exact), and
# `turnrl bench train` (README's command) for the executed-FLOP MFU. From the repo root on the device machine:
#   OUT=dir bash benchmarks/exact_gpu.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/exact_out}; mkdir -p $OUT
test -d turnrl/exact || { echo "turnrl/exact missing: not the gpu worktree"; git log -1 --oneline; exit 3; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 benchmarks/exact_probe.py cuda > $OUT/h200_exact_probe.jsonl 2>&1
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/exact tests/engines/test_fast_exact.py \
  tests/train/test_exact_training.py -k "cuda or gpu" -rA 2>&1 | tail -25 | tee $OUT/h200_exact_tests.txt
timeout 150 python3 -m turnrl bench engine --model qwen2.5-0.5b-shape --batch 256 --prompt 256 --new 256 \
  --variants fast-compile,fast-exact --json $OUT/h200_engine_exact.json 2>&1 | grep -v Warn | tail -24
timeout 120 python3 -m turnrl bench train --model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 \
  trainer.compile=true trainer.micro_batch_tokens=65536 trainer.packing=true \
  --json $OUT/h200_bench_train_executed.json 2>&1 | tail -12
