#!/usr/bin/env bash
# The fast engine's decode step on this tree against a reference, in one GPU call: the fast engine's GPU tests,
# `turnrl bench engine` (fast-compile) on this tree and on a copy of it whose turnrl/ is overlaid with the files
# under $BASE (e.g. the last commit's versions of the files a change touches), interleaved REPEATS times, then
# the attention kernel's blockings inside the real step (decode_split_ab.py), and on an H200 the README's
# `turnrl bench train` too. Make the reference here first, e.g.:
#   mkdir -p .abbase/engines/fast && for f in step decoder attention_kernel; do
#     git show HEAD:turnrl/engines/fast/$f.py > .abbase/engines/fast/$f.py; done
# then on the device (carry .abbase):  BASE=.abbase bash benchmarks/engine_ab_gpu.sh   (results in $OUT)
# PARTS (default: gpu_tests engine_ab sweep, plus train on an H200), REPEATS (2), BLOCKINGS (see
# decode_split_ab.py), ONLY_ON (e.g. H200: run nothing on other cards).
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TURNRL_HOME=$PWD/.devcache HF_HUB_OFFLINE=1
OUT=${OUT:-runs/engine_ab}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)     # absolute: the reference runs elsewhere
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
DEFAULT_PARTS="gpu_tests engine_ab sweep"; [[ "$GPU" == *H200* ]] && DEFAULT_PARTS="gpu_tests engine_ab train sweep"
PARTS=${PARTS:-$DEFAULT_PARTS}
[[ -n "${ONLY_ON:-}" && "$GPU" != *"$ONLY_ON"* ]] && { echo "not an $ONLY_ON: nothing run"; exit 0; }
run_part() { local name=$1; shift; [[ " $PARTS " == *" ${PART:-$name} "* ]] || return 0; local start=$(date +%s)
             timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1; echo "== $name: rc=$? $(( $(date +%s) - start ))s"; }
ENGINE="--model qwen2.5-0.5b-shape --batch 256 --prompt 256 --new 256 --variants fast-compile"
run_part gpu_tests python3 -m pytest -q -m gpu -p no:cacheprovider tests/engines/test_fast.py \
    tests/engines/test_sample_kernel.py tests/engines/test_fast_prefix.py tests/engines/test_fast_exact.py
tail -1 "$OUT/gpu_tests.log" 2>/dev/null
REF=/tmp/engine_ab_ref
if [[ -n "${BASE:-}" ]]; then rm -rf $REF; mkdir -p $REF; cp -r turnrl $REF/; cp -r "$BASE"/. $REF/turnrl/; fi
summary() { python3 -c "import json,sys; v=json.load(open(sys.argv[1]))['variants']['fast-compile']; s=v.get('step',{}); \
print(sys.argv[2], 'step_ms', s.get('step_ms'), 'layers_ms', s.get('layers_ms'), 'decode_tok/s', v.get('decode_tokens_per_s'), \
'fraction_of_bound', v.get('fraction_of_bound'), v.get('error', ''))" "$1" "$2" 2>/dev/null; }
for i in $(seq 1 "${REPEATS:-2}"); do
    PART=engine_ab run_part "engine_new_$i" python3 -m turnrl bench engine $ENGINE --json "$OUT/engine_new_$i.json"
    summary "$OUT/engine_new_$i.json" "new $i"
    [[ -n "${BASE:-}" ]] || continue
    PART=engine_ab run_part "engine_ref_$i" bash -c "cd $REF && PYTHONPATH=$REF python3 -m turnrl bench engine $ENGINE \
        --json $OUT/engine_ref_$i.json"
    summary "$OUT/engine_ref_$i.json" "ref $i"
done
run_part train python3 -m turnrl bench train --model qwen2.5-0.5b-shape --batch 64 --seq-len 1024 --lora-rank 0 \
    trainer.compile=true trainer.micro_batch_tokens=65536 trainer.packing=true --json "$OUT/train.json"
grep -E "mfu|update_s|tokens_per_s" "$OUT/train.log" 2>/dev/null | head -8
run_part sweep python3 benchmarks/decode_split_ab.py --split-keys "${BLOCKINGS:-512:64:4:3,512:128:4:3,512:64:4:4,512:32:4:4,512:64:8:3,512:128:8:3}" \
    --out "$OUT/sweep.json"
grep "split_keys" "$OUT/sweep.log" 2>/dev/null | cut -c1-300
