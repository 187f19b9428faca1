#!/bin/bash
# The exact mode's CUDA kernels (turnrl/exact/triton_ops.py: GEMM, attention, RMSNorm, SiLU*up, rotary, the
# head's vocabulary tree, the tree sum) on one H200: the exactness tests in bf16 (gpu-marked, and the ops on
# cuda), then `turnrl bench engine` with the fast engine's default (fast-compile) and the exact mode.
# Device machine, repo root, carry .devcache/models/tiny-random
# (TURNRL_HOME=.devcache turnrl models prepare tiny-random):  OUT=dir bash benchmarks/exact_triton.sh
# TURNRL_EXACT_TRITON=0 turns the kernels off (the exact mode then runs its plain torch ops).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/exact_out}; mkdir -p $OUT
STAMP=${STAMP:-$(date -u +%F)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/exact tests/engines/test_fast_exact.py \
  tests/train/test_exact_training.py -k "cuda or gpu" -rA 2>&1 | tail -30 | tee $OUT/h200_exact_tests_$STAMP.txt
timeout ${BENCH_S:-240} python3 -m turnrl bench engine --model qwen2.5-0.5b-shape --batch 256 --prompt 256 --new 256 \
  --variants ${VARIANTS:-fast-compile,fast-exact} --json $OUT/h200_engine_exact_kernels_$STAMP.json 2>&1 | grep -v Warn | tail -12
