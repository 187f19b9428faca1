#!/usr/bin/env bash
# The fused SwiGLU MLP (trainer.fused_mlp, turnrl/train/swiglu_kernel.py) on one GPU call: its GPU test, the kernel
# probe (benchmarks/swiglu_probe.py: each kernel against what it replaces, a sweep of blockings, the whole MLP), then
# the train bench's arms through benchmarks/attention_gpu.sh (default: fused_mlp off, on, and on at the probe's
# fastest blockings), with a profile of one update each.
#   OUT=runs/swiglu_gpu bash benchmarks/swiglu_gpu.sh   (ARMS, REPEATS, STEP_TIMEOUT, CLOCKS as attention_gpu.sh;
#   GATE_UP / DOWN_BACK: the probe's sweeps)
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/swiglu_gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_swiglu_kernel.py > "$OUT/swiglu_tests.log" 2>&1
echo "== swiglu gpu test: $(tail -1 "$OUT/swiglu_tests.log")"
sweep=()
[[ -n "${GATE_UP:-}" ]] && sweep+=(--gate-up "$GATE_UP")
[[ -n "${DOWN_BACK:-}" ]] && sweep+=(--down-back "$DOWN_BACK")
timeout "${PROBE_TIMEOUT:-240}" python3 benchmarks/swiglu_probe.py "${sweep[@]}" --json "$OUT/swiglu_probe.json" \
    > "$OUT/swiglu_probe.log" 2>&1
echo "== swiglu probe: rc=$?"; grep -E "^(gate_up|down_back|fused|unfused) " "$OUT/swiglu_probe.log" | cut -c1-900
OUT=$OUT PARTS=train REPEATS=${REPEATS:-1} PROFILE=1 \
    ARMS="${ARMS:-triton:bfloat16 triton:bfloat16+trainer.fused_mlp=true mlpbest:bfloat16}" bash benchmarks/attention_gpu.sh
