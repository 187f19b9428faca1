#!/usr/bin/env bash
# The main job: set up (idempotent), then a short real RL training run of the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/turnrl train examples/calculator/train.yaml "$@"
