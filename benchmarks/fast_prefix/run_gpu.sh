#!/usr/bin/env bash
# The fast embedded engine (engine.kind=hf engine.fast=on) on a multi-turn workload, prefix cache on and off:
# `turnrl bench rollout` on guess_number (its simulated user answers every turn, so with a random-weight model
# every trajectory runs to rollout.max_assistant_turns), 64 prompts x n 4 = 256 trajectories in flight, 4 turns of
# at most 64 tokens, bf16, engine.max_batch_size 256, on a random-init Qwen2.5-0.5B-shaped model with the SmolLM2
# tokenizer (benchmarks/fast_prefix/make_model.py, built into a temporary directory on the GPU).
#
# Device machine, from the repo root (carry .devcache/smollm2-tokenizer; make it here first with --prepare):
#   OUT=$OUT bash benchmarks/fast_prefix/run_gpu.sh
#   -> $OUT/h200_fast_multiturn_cache.json, $OUT/h200_fast_multiturn_nocache.json,
#      $OUT/h200_fast_multiturn_compare.json (bench compare, A = nocache, B = cache), $OUT/h200_fast_multiturn_log.txt
# Here, on the CPU, the same steps at toy sizes (tiny Qwen2, 4 prompts x n 2, 2 turns of 16 tokens, float32):
#   bash benchmarks/fast_prefix/run_gpu.sh --quick        (or QUICK=1; files named quick_fast_multiturn_*)
# Copy the SmolLM2 tokenizer and chat template into .devcache/smollm2-tokenizer (ignored; 3.5 MB) to carry:
#   bash benchmarks/fast_prefix/run_gpu.sh --prepare
# Further arguments are config overrides for both runs (e.g. engine.gather_ms=2). Environment: TOKENIZER (a
# directory with the tokenizer files), REPEATS (3), WARMUP (repeats run first and left out of the summary: 1 on the
# GPU, 0 with --quick), VARIANTS ("cache nocache"), NAME (the files' prefix),
# BENCH_TIMEOUT (seconds per run, 240), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/../.."
QUICK=${QUICK:-0}
PREPARE=0
args=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    --prepare) PREPARE=1 ;;
    *) args+=("$a") ;;
  esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then  # this checkout's virtual environment, else the first interpreter that has torch
  for p in .venv/bin/python python3 python; do
    if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then PY=$p; break; fi
  done
fi
[ -n "$PY" ] || { echo "no python with torch found; set PYTHON=" >&2; exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
CACHED=${TURNRL_HOME:-$HOME/.cache/turnrl}/models

if [ "$PREPARE" = 1 ]; then
  src=${TOKENIZER:-$CACHED/smollm2-135m-instruct}
  [ -f "$src/tokenizer_config.json" ] || src=$("$PY" -c "import turnrl.models as m; print(m.resolve('smollm2-135m-instruct'))")
  mkdir -p .devcache/smollm2-tokenizer
  for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
    [ -f "$src/$f" ] && cp "$src/$f" .devcache/smollm2-tokenizer/
  done
  du -sh .devcache/smollm2-tokenizer && ls .devcache/smollm2-tokenizer
  exit 0
fi

tok=${TOKENIZER:-}
if [ -z "$tok" ]; then
  for d in .devcache/smollm2-tokenizer "$CACHED/smollm2-135m-instruct" "$CACHED/tiny-random" runs/bench-tokenizer; do
    if [ -f "$d/tokenizer_config.json" ]; then tok=$d; break; fi
  done
fi
[ -n "$tok" ] || { echo "no SmolLM2 tokenizer: run 'bash $0 --prepare' where the turnrl model cache is and carry" \
  ".devcache/smollm2-tokenizer, or set TOKENIZER=DIR" >&2; exit 2; }

if [ "$QUICK" = 1 ]; then
  OUT=${OUT:-runs/fast_prefix_quick}; name=quick_fast_multiturn
  shape=tiny; device=cpu; dtype=float32; prompts=4; n=2; turns=2; tokens=16; batch=8; repeats=${REPEATS:-1}
  warmup=${WARMUP:-0}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # a shared CPU: one thread per engine is fastest and polite
else
  OUT=${OUT:-runs/fast_prefix}; name=${NAME:-h200_fast_multiturn}
  shape=qwen2.5-0.5b; device=cuda; dtype=bfloat16; prompts=64; n=4; turns=4; tokens=64; batch=256
  repeats=${REPEATS:-3}; warmup=${WARMUP:-1}
fi
mkdir -p "$OUT"
log=$OUT/${name}_log.txt
: > "$log"
model=$(mktemp -d "${TMPDIR:-/tmp}/turnrl-fast-prefix-model.XXXXXX")
trap 'rm -rf "$model"' EXIT

{
  echo "== $(date -u +%FT%TZ) $(git log -1 --format="%h %s" 2>/dev/null | cut -c1-72) quick=$QUICK tokenizer=$tok"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$log"
"$PY" benchmarks/fast_prefix/make_model.py "$model" --tokenizer "$tok" --shape $shape --device $device 2>&1 |
  grep -v "Writing model shards" | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "make_model failed" | tee -a "$log"; exit 1; }

common=(--engine hf --task guess_number --prompts $prompts --n $n --repeats "$repeats" --warmup-repeats "$warmup"
        --max-tokens $tokens
        "model.name=$model" engine.fast=on engine.device=$device engine.dtype=$dtype engine.max_batch_size=$batch
        rollout.concurrency=$batch rollout.max_assistant_turns=$turns rollout.max_user_turns=$turns)
rc=0
for variant in ${VARIANTS:-cache nocache}; do
  if [ $variant = cache ]; then
    switch=(engine.fast_prefix_cache=true)
  else
    switch=(engine.fast_prefix_cache=false)
  fi
  echo "== $variant: turnrl bench rollout ${common[*]} ${switch[*]} ${args[*]:-}" | tee -a "$log"
  timeout "${BENCH_TIMEOUT:-240}" "$PY" -m turnrl bench rollout "${common[@]}" "${switch[@]}" "${args[@]}" \
    --json "$OUT/${name}_$variant.json" 2>&1 | grep -v -E "Loading weights|Warn" | tee -a "$log"
  status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || { echo "== $variant failed: exit status $status" | tee -a "$log"; rc=1; }
done
if [ -f "$OUT/${name}_nocache.json" ] && [ -f "$OUT/${name}_cache.json" ]; then
  echo "== compare: A = nocache, B = cache" | tee -a "$log"
  "$PY" -m turnrl bench compare "$OUT/${name}_nocache.json" "$OUT/${name}_cache.json" \
    --json "$OUT/${name}_compare.json" 2>&1 | tee -a "$log"
fi
exit $rc
