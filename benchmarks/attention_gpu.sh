#!/usr/bin/env bash
# The packed trainer's attention kernels on one GPU call: the GPU test of turnrl's Triton kernels, the attention
# probe (varlen FA2 against them, with a sweep of their blockings), and `turnrl bench train` (the README's
# command) with trainer.packed_attention flash and triton, interleaved REPEATS times.
#   bash benchmarks/attention_gpu.sh        (results in $OUT, default runs/attention_gpu)
# With the probe's sweep, a third arm runs triton at the sweep's fastest blockings (attention_best_blocking.py); an
# arm `mlpbest` runs trainer.fused_mlp at the fastest blockings of $OUT/swiglu_probe.json (benchmarks/swiglu_gpu.sh).
# PARTS (default: gpu_tests probe train), ARMS (default: flash triton best; an arm may name the weights too,
# kernel:param_dtype, e.g. flash:float32 triton:bfloat16; without one, trainer.param_dtype's default, auto: bf16
# weights with fp32 masters on CUDA; and overrides after '+', e.g. triton:bfloat16+trainer.fuse_linears=true, where
# an upper-case NAME=value sets the environment, e.g. +TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1),
# REPEATS (2), PROFILE=1 (bench train --profile on the last pass), FORWARD / KEYS / QUERIES (blockings to sweep,
# program block:step block:warps:stages), ROUNDS (the probe's variants timed this many times in turn), ONLY_ON
# (e.g. H200), CLOCKS=1 (SM clock, power and throttle reasons every 250 ms in $OUT/clocks.csv). The logs and the earlier passes' JSON end
# up in $OUT/logs.tgz (the device tool brings back 8 files).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/attention_gpu}; mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
[[ -n "${ONLY_ON:-}" && "$GPU" != *"$ONLY_ON"* ]] && { echo "not an $ONLY_ON: nothing run"; exit 0; }
PARTS=${PARTS:-gpu_tests probe train}
run_part() { local name=$1; shift; [[ " $PARTS " == *" ${PART:-$name} "* ]] || return 0; local start=$(date +%s)
             echo "== $name from $(date '+%H:%M:%S')"
             timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1
             echo "== $name: rc=$? $(( $(date +%s) - start ))s, to $(date '+%H:%M:%S')"; }
# CLOCKS=1: the GPU's SM clock, power and throttle reasons every 250 ms, to line up with the parts' times
if [[ -n "${CLOCKS:-}" ]]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 250 > "$OUT/clocks.csv" 2>&1 &
    CLOCKS_PID=$!
fi
run_part gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_flash_kernel.py tests/bench/test_bench_profile.py \
    tests/train/test_master.py tests/train/test_packing.py tests/train/test_fused_head.py tests/train/test_batching.py
tail -1 "$OUT/gpu_tests.log" 2>/dev/null
run_part probe python3 benchmarks/attention_backends_probe.py --variants varlen_fa2,triton \
    --triton-forward "${FORWARD:-64:64:4:4,128:64:8:3,64:32:4:4}" \
    --triton-keys "${KEYS:-128:32:4:5,128:32:8:3,128:64:8:3,128:16:8:3,64:32:4:3,64:16:8:3}" \
    --triton-queries "${QUERIES:-128:32:4:5,128:32:8:3,128:64:8:3,64:64:4:3,64:16:4:3}" --rounds "${ROUNDS:-1}" \
    --json "$OUT/probe.json"
grep -E "^(varlen|triton)" "$OUT/probe.log" 2>/dev/null | cut -c1-220
TRAIN="--model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 --peak-tflops 790 trainer.compile=true \
trainer.micro_batch_tokens=65536 trainer.packing=true"
REPEATS=${REPEATS:-2}
for i in $(seq 1 "$REPEATS"); do
    for arm in ${ARMS:-flash triton best}; do
        overrides=""; env=(); [[ $arm == *+* ]] && overrides=$(tr '+' ' ' <<< "${arm#*+}")
        for o in $overrides; do [[ $o =~ ^[A-Z_][A-Z0-9_]*= ]] && env+=("$o"); done   # NAME=value: environment
        overrides=$(for o in $overrides; do [[ $o =~ ^[A-Z_][A-Z0-9_]*= ]] || echo "$o"; done)
        base=${arm%%+*}; kernel=${base%%:*}; weights=""
        name=$(tr -c 'A-Za-z0-9_\n' '_' <<< "${arm/:/_}")
        [[ $base == *:* ]] && weights="trainer.param_dtype=${base#*:}"
        weights="$weights $overrides"
        extra=""; [[ -n "${PROFILE:-}" && $i == "$REPEATS" ]] && extra="--profile"
        if [[ $kernel == mlpbest ]]; then   # triton attention, trainer.fused_mlp at swiglu_probe.py's fastest blockings
            [[ -f "$OUT/swiglu_probe.json" ]] || continue
            PART=train run_part "train_${name}_$i" env "${env[@]}" python3 benchmarks/swiglu_probe.py --best \
                "$OUT/swiglu_probe.json" -- bench train $TRAIN trainer.packed_attention=triton trainer.fused_mlp=true \
                $weights $extra --json "$OUT/train_${name}_$i.json"
        elif [[ $kernel == best ]]; then
            [[ -f "$OUT/probe.json" ]] || continue
            PART=train run_part "train_${name}_$i" env "${env[@]}" python3 benchmarks/attention_best_blocking.py "$OUT/probe.json" -- \
                bench train $TRAIN trainer.packed_attention=triton $weights $extra --json "$OUT/train_${name}_$i.json"
        else
            PART=train run_part "train_${name}_$i" env "${env[@]}" python3 -m turnrl bench train $TRAIN \
                trainer.packed_attention=$kernel $weights $extra --json "$OUT/train_${name}_$i.json"
        fi
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); s=r['summary']; print(sys.argv[2], 'update_s', \
s['update_s'], 'mfu_executed', s['update_mfu_executed'], 'host_syncs', r.get('host_syncs'))" \
            "$OUT/train_${name}_$i.json" "$arm $i" 2>/dev/null
    done
done
[[ -n "${CLOCKS_PID:-}" ]] && kill "$CLOCKS_PID"
# the device tool brings back 8 files: the logs and the earlier repeats' JSON travel in one archive
(cd "$OUT" && early=$(ls train_*.json 2>/dev/null | grep -v "_${REPEATS}.json$" || true) && \
    ls *.log > /dev/null 2>&1 && tar czf logs.tgz *.log $early && rm -f *.log $early)
