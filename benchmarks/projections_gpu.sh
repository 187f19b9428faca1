#!/usr/bin/env bash
# The fused projections (trainer.fused_projections, turnrl/train/fused_projections.py) and the master AdamW step
# (trainer.optim.fused_master_step, turnrl/train/master_adamw.py) on one GPU call: their GPU tests, the projection
# probe (benchmarks/projection_probe.py: each side against the compiled separate projections, each kernel alone),
# then the train bench's arms through benchmarks/attention_gpu.sh (default: neither, each, both), with a profile of
# one update each (~8 minutes on an H200).
#   OUT=runs/projections_gpu bash benchmarks/projections_gpu.sh   (ARMS, REPEATS, STEP_TIMEOUT, CLOCKS as
#   attention_gpu.sh)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/projections_gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_fused_projections.py \
    tests/train/test_master_adamw.py > "$OUT/projection_tests.log" 2>&1
echo "== gpu tests: $(tail -1 "$OUT/projection_tests.log")"
timeout "${PROBE_TIMEOUT:-150}" python3 benchmarks/projection_probe.py --json "$OUT/projection_probe.json" \
    > "$OUT/projection_probe.log" 2>&1
echo "== projection probe: rc=$?"; grep -E "^(attention|mlp|kernels) " "$OUT/projection_probe.log" | cut -c1-600
# both are on by default (auto) since 2026-12-08: the first arm turns both off, the last is the default
OFF=trainer.fused_projections=off+trainer.optim.fused_master_step=off
OUT=$OUT PARTS=train REPEATS=${REPEATS:-1} PROFILE=1 \
    ARMS="${ARMS:-triton:bfloat16+$OFF triton:bfloat16+trainer.optim.fused_master_step=off \
triton:bfloat16+trainer.fused_projections=off triton:bfloat16}" bash benchmarks/attention_gpu.sh
