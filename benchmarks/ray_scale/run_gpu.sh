#!/usr/bin/env bash
# The Ray scale-out benchmark on a 2-GPU machine: split placement (1 engine GPU + 1 trainer GPU), FSDP2 on 2 GPUs
# vs 1, async vs sync step time. Prints a table; writes $OUT/ray_scale.json and $OUT/log.txt; exits non-zero
# when a phase failed or a self-check did not hold.
#   bash benchmarks/ray_scale/run_gpu.sh        (offline: run benchmarks/ray_scale/prepare_carry.sh first, here)
# Extra arguments go to bench.py (e.g. --steps 4, --model tiny, --phase scaling).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/ray_scale}
PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the first interpreter that has torch
  for p in python python3; do
    if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then PY=$(command -v "$p"); break; fi
  done
fi
[ -n "$PY" ] || { echo "no python with torch found; set PYTHON=" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's turnrl, for the driver and Ray's workers
if ! "$PY" -c "import ray" 2>/dev/null; then
  wheels=(--no-index --find-links .whl/ray ray)
  "$PY" -m pip install -q "${wheels[@]}" 2>/dev/null ||
    "$PY" -m pip install -q --break-system-packages "${wheels[@]}" 2>/dev/null ||
    { "$PY" -m pip install -q --target .ray_site "${wheels[@]}" && export PYTHONPATH="$PWD/.ray_site:$PYTHONPATH"; }
fi
"$PY" -c "import torch, ray; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count(), 'ray', ray.__version__)"
"$PY" benchmarks/ray_scale/bench.py --tokenizer "${TOKENIZER:-runs/bench-tokenizer}" --out "$OUT" "$@" 2>&1 |
  tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
