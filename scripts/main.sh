#!/usr/bin/env bash
# The main job: set up (idempotent), then a short real run of the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/turnrl rollout examples/feedback_math/rollout.yaml --out runs/main "$@"
