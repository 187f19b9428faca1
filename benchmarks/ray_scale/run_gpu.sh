#!/usr/bin/env bash
# The Ray scale-out benchmark on a 2-GPU machine: split placement (1 engine GPU + 1 trainer GPU), FSDP2 on 2 GPUs
# vs 1, async vs sync step time. Prints a table; writes $OUT/ray_scale.json and $OUT/log.txt.
#   bash benchmarks/ray_scale/run_gpu.sh            (after benchmarks/ray_scale/prepare_carry.sh, if offline)
# Extra arguments go to bench.py (e.g. --steps 4 --model tiny).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/ray_scale}
PY=${PYTHON:-python}
mkdir -p "$OUT"
if ! "$PY" -c "import ray" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .whl/ray ray
fi
if ! "$PY" -c "import turnrl" 2>/dev/null; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # Ray's workers inherit it
fi
TOKENIZER=${TOKENIZER:-runs/bench-tokenizer}
"$PY" -c "import torch, ray; print('torch', torch.__version__, 'cuda', torch.cuda.device_count(), 'ray', ray.__version__)"
"$PY" benchmarks/ray_scale/bench.py --tokenizer "$TOKENIZER" --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
