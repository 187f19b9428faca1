#!/usr/bin/env bash
# The packed trainer's attention kernels on one GPU call: the GPU test of turnrl's Triton kernels, the attention
# probe (varlen FA2 against them, with a sweep of their blockings), and `turnrl bench train` (the README's
# command) with trainer.packed_attention flash and triton, interleaved REPEATS times.
#   bash benchmarks/attention_gpu.sh        (results in $OUT, default runs/attention_gpu)
# With the probe's sweep, a third arm runs triton at the sweep's fastest blockings (attention_best_blocking.py).
# PARTS (default: gpu_tests probe train), ARMS (default: flash triton best), REPEATS (2), PROFILE=1 (bench train --profile on the last pair),
# FORWARD / KEYS / QUERIES (blockings to sweep, program block:step block:warps:stages), ONLY_ON (e.g. H200).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/attention_gpu}; mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
[[ -n "${ONLY_ON:-}" && "$GPU" != *"$ONLY_ON"* ]] && { echo "not an $ONLY_ON: nothing run"; exit 0; }
PARTS=${PARTS:-gpu_tests probe train}
run_part() { local name=$1; shift; [[ " $PARTS " == *" ${PART:-$name} "* ]] || return 0; local start=$(date +%s)
             timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: rc=$? $(( $(date +%s) - start ))s"; }
run_part gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_flash_kernel.py tests/bench/test_bench_profile.py
tail -1 "$OUT/gpu_tests.log" 2>/dev/null
run_part probe python3 benchmarks/attention_backends_probe.py --variants varlen_fa2,triton \
    --triton-forward "${FORWARD:-128:128:8:3,128:64:4:3,128:64:8:2,64:64:4:3,64:32:4:3}" \
    --triton-keys "${KEYS:-64:32:8:3,64:32:8:2,64:64:8:3,64:16:4:3,64:32:4:2}" \
    --triton-queries "${QUERIES:-64:64:4:3,64:32:4:3,128:32:8:3,128:64:8:3}" --json "$OUT/probe.json"
grep -E "^(varlen|triton)" "$OUT/probe.log" 2>/dev/null | cut -c1-220
TRAIN="--model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 --peak-tflops 790 trainer.compile=true \
trainer.micro_batch_tokens=65536 trainer.packing=true"
REPEATS=${REPEATS:-2}
for i in $(seq 1 "$REPEATS"); do
    for kernel in ${ARMS:-flash triton best}; do
        extra=""; [[ -n "${PROFILE:-}" && $i == "$REPEATS" ]] && extra="--profile"
        if [[ $kernel == best ]]; then
            [[ -f "$OUT/probe.json" ]] || continue
            PART=train run_part "train_best_$i" python3 benchmarks/attention_best_blocking.py "$OUT/probe.json" -- \
                bench train $TRAIN trainer.packed_attention=triton $extra --json "$OUT/train_best_$i.json"
        else
            PART=train run_part "train_${kernel}_$i" python3 -m turnrl bench train $TRAIN \
                trainer.packed_attention=$kernel $extra --json "$OUT/train_${kernel}_$i.json"
        fi
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); s=r['summary']; print(sys.argv[2], 'update_s', \
s['update_s'], 'mfu_executed', s['update_mfu_executed'], 'host_syncs', r.get('host_syncs'))" \
            "$OUT/train_${kernel}_$i.json" "$kernel $i" 2>/dev/null
    done
done
