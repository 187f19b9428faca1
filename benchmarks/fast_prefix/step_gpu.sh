#!/usr/bin/env bash
# Whole RL steps on one GPU with the multi-turn work of run_gpu.sh: `turnrl bench step` on guess_number (64 prompts
# x n 4 = 256 trajectories, 4 policy turns of at most 64 tokens, its simulated user between them), full fine-tuning
# of a random-init Qwen2.5-0.5B shape (make_model.py, bf16 engine, bf16 autocast trainer, packed micro-batches) on
# the fast engine. Variants (VARIANTS, default "old new", ROUNDS times, alternating on one machine):
#   old: engine.fast_prefix_cache=false engine.gc_freeze=false (the defaults before 2026-12-06)
#   new: the defaults (prefix cache on, heap frozen after the engine starts and after the first step)
# Device machine, from the repo root (carry .devcache/smollm2-tokenizer, made with run_gpu.sh --prepare):
#   OUT=$OUT bash benchmarks/fast_prefix/step_gpu.sh    -> $OUT/step_{old,new}_N.json, one line a step each
# STEPS (3) counted after WARMUP (1); further arguments are config overrides for every variant.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HF_HUB_OFFLINE=1
OUT=${OUT:-runs/step_gpu}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
model=$(mktemp -d "${TMPDIR:-/tmp}/turnrl-step-model.XXXXXX")
trap 'rm -rf "$model"' EXIT
"$PY" benchmarks/fast_prefix/make_model.py "$model" --tokenizer "${TOKENIZER:-.devcache/smollm2-tokenizer}" \
  --shape "${SHAPE:-qwen2.5-0.5b}" --device "${DEVICE:-cuda}" > "$OUT/make_model.log" 2>&1 || { tail "$OUT/make_model.log"; exit 1; }
work=(examples/calculator/train.yaml "model.name=$model" model.lora.rank=0 engine.kind=hf engine.max_batch_size=256
      data.train.task=guess_number "data.train.options={}" "reward.functions=[last_number]" "reward.weights=[1.0]"
      reward.accuracy_part=last_number data.prompts_per_step=64 rollout.n=4 rollout.concurrency=256
      rollout.max_assistant_turns=4 rollout.max_user_turns=4 rollout.max_response_tokens=1024
      rollout.sampling.max_tokens_per_turn=64 trainer.micro_batch_tokens=16384 trainer.packing=true
      logging.progress=off)
for round in $(seq "${ROUNDS:-1}"); do
  for variant in ${VARIANTS:-old new}; do
    case $variant in
      old) switch=(engine.fast_prefix_cache=false engine.gc_freeze=false) ;;
      *) switch=() ;;
    esac
    timeout "${STEP_TIMEOUT:-240}" "$PY" -m turnrl bench step "${work[@]}" "${switch[@]}" "$@" --steps "${STEPS:-3}" \
      --warmup "${WARMUP:-1}" --json "$OUT/step_${variant}_$round.json" > "$OUT/step_${variant}_$round.log" 2>&1 \
      || { echo "== $variant $round failed"; tail -5 "$OUT/step_${variant}_$round.log"; continue; }
    "$PY" - "$OUT/step_${variant}_$round.json" "$variant $round" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
for r in report["runs"]:
    e = r["engine_stats"]
    print(f"{sys.argv[2]:>6} step {r['step']}{'w' if r['warmup'] else ' '} step {r['step_s']:6.2f} s rollout "
          f"{r['rollout_s']:5.2f} logprob {r['logprob_s']:5.2f} update {r['update_s']:5.2f} sync {r['sync_s']:5.2f} | "
          f"{r['rollout_tokens_per_s']:8.0f} tok/s turns {r['turns_mean']:.2f} prefill {e.get('prefill_tokens')} "
          f"gen {e.get('generated_tokens')} | gc {r.get('gc_pause_s') or 0:.3f} s ({r.get('gc_full_collections')} full)")
PYEOF
  done
done
