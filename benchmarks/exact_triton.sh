#!/bin/bash
# The exact mode's one-kernel tree sum (turnrl/exact/triton_sum.py) on one H200: the exactness tests in bf16
# (gpu-marked, and the ops on cuda, the kernel's bit-for-bit test among them), then `turnrl bench engine` with
# the fast engine's default (fast-compile) and the exact mode, with the kernel and with the plain tree
# (TURNRL_EXACT_TRITON=0). Device machine, repo root, carry .devcache/models/tiny-random
# (TURNRL_HOME=.devcache turnrl models prepare tiny-random):  OUT=dir bash benchmarks/exact_triton.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/exact_out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/exact tests/engines/test_fast_exact.py \
  tests/train/test_exact_training.py -k "cuda or gpu" -rA 2>&1 | tail -25 | tee $OUT/h200_exact_tests.txt
timeout 200 python3 -m turnrl bench engine --model qwen2.5-0.5b-shape --batch 256 --prompt 256 --new 256 \
  --variants fast-compile,fast-exact --json $OUT/h200_engine_exact.json 2>&1 | grep -v Warn | tail -12
TURNRL_EXACT_TRITON=0 timeout 120 python3 -m turnrl bench engine --model qwen2.5-0.5b-shape --batch 256 \
  --prompt 256 --new 256 --variants fast-exact --json $OUT/h200_engine_exact_plain_tree.json 2>&1 | grep -v Warn | tail -8
