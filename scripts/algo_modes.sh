#!/usr/bin/env bash
# One short run per loss mode / correction / DAPO on the calculator task (examples/calculator/train.yaml with
# overrides), then a table of each run's per-step metrics. Usage: bash scripts/algo_modes.sh [STEPS] [MODE...]
# Runs go to runs/modes/<mode>/; mini_batches=2 gives the second optimizer step a ratio != 1 to clip.
# EXTRA="data.prompts_per_step=2 rollout.n=4" adds overrides to every run; OUT=DIR writes elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-3}; shift || true
declare -A MODES=(
  [ppo]="trainer.mini_batches=2"
  [gspo]="algo.loss_mode=gspo algo.loss_agg=seq-mean-token-mean algo.clip_low=3e-4 algo.clip_high=4e-4 trainer.mini_batches=2"
  [cispo]="algo.loss_mode=cispo algo.clip_low=1.0 trainer.mini_batches=2"
  [gmpo]="algo.loss_mode=gmpo algo.loss_agg=seq-mean-token-mean algo.clip_low=0.4 algo.clip_high=0.4 trainer.mini_batches=2"
  [correction_token]="algo.correction.is_level=token algo.correction.is_cap=2.0 algo.correction.rs_level=token algo.correction.rs_high=1.5 algo.correction.veto=1e-4"
  [correction_seq]="algo.correction.is_level=sequence algo.correction.is_cap=2.0 algo.correction.rs_level=geometric algo.correction.rs_high=1.02 algo.correction.veto=1e-4"
  [dapo]="algo.filter_groups.enable=true algo.filter_groups.metric=accuracy algo.filter_groups.max_rounds=3 reward.overlong.buffer=100"
)
selected=("$@"); [ ${#selected[@]} -eq 0 ] && selected=(ppo gspo cispo gmpo correction_token correction_seq dapo)
for mode in "${selected[@]}"; do
  # shellcheck disable=SC2086
  .venv/bin/python -m turnrl train examples/calculator/train.yaml trainer.steps="$steps" logging.progress=off \
      output_dir="${OUT:-runs/modes}/$mode" ${MODES[$mode]} ${EXTRA:-}
done
.venv/bin/python - "${selected[@]}" <<'PY'
import json, os, sys
out = os.environ.get("OUT", "runs/modes")
keys = ["reward/mean", "accuracy", "loss/policy", "clip_fraction", "grad_norm", "mismatch/mean_abs",
        "correction/weight_mean", "correction/rejected_token_fraction", "correction/rejected_seq_fraction",
        "correction/veto_seq_fraction", "filter_groups/kept", "filter_groups/dropped", "filter_groups/rounds",
        "filter_groups/filled", "reward/overlong", "time/step_s"]
for mode in sys.argv[1:]:
    rows = [json.loads(x) for x in open(f"{out}/{mode}/metrics.jsonl")]
    print(f"\n{mode}")
    for k in keys:
        if any(k in r for r in rows):
            print(f"  {k:40s}" + " ".join(f"{r.get(k, float('nan')):9.4f}" for r in rows))
PY
