#!/usr/bin/env bash
# `turnrl bench gateway`, overhead part only (--prompts 0: no real model), on the GPU host's CPU: what the
# gateway costs per call there (1 and 256 sessions, the stand-in engine answering at once and after ~1 s).
#
# The device machine has no network and no PyPI, and its Python (3.12, torch, transformers) lacks the web stack
# (fastapi, uvicorn, aiohttp, httpx, ...). Before, here with PyPI, fill the ignored .devcache/gw-wheels (~13 MB)
# with cp312 manylinux x86_64 wheels of it, the same versions as this checkout's .venv:
#   bash benchmarks/gateway_gpu/run_gpu.sh --prepare
# Device machine, from the repo root (carry .devcache/gw-wheels and .devcache/smollm2-tokenizer):
#   OUT=$OUT bash benchmarks/gateway_gpu/run_gpu.sh
#   -> $OUT/gpu_host_bench_gateway_overhead.json, $OUT/gpu_host_bench_gateway_overhead.txt (host info + table)
# Only the packages the interpreter lacks (or has in a version a wheel's requirement rules out) are unpacked
# into a scratch folder (GW_TARGET, /tmp/gwpkgs) put on PYTHONPATH; the interpreter's environment is not touched.
# The chat template/tokenizer: the SmolLM2 one from .devcache/smollm2-tokenizer (or TOKENIZER=DIR), copied into a
# temporary model directory with SmolLM2's config.json (no weights: with --prompts 0 no model is loaded) and
# passed as model.name, so turnrl never tries to build its default model (that needs PyPI).
# Further arguments go to `turnrl bench gateway` (e.g. --turns 4, or config overrides).
# Environment: PYTHON, WHEELS (.devcache/gw-wheels), GW_TARGET (/tmp/gwpkgs), TOKENIZER, SESSIONS (1,256),
# ENGINE_MS (0,1000), BENCH_TIMEOUT (540 s: the device machine stops a command at 600 s; here, 2 cores: 251 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.devcache/gw-wheels}
TARGET=${GW_TARGET:-/tmp/gwpkgs}
# what the overhead bench imports beyond torch/transformers (turnrl.gateway, turnrl.bench.gateway(_client)):
# uvicorn picks httptools when it is there, as it does in this checkout's .venv
ROOTS="fastapi starlette pydantic uvicorn httptools uvloop aiohttp httpx anyio jinja2 markupsafe pyyaml orjson"
VERSIONS="fastapi==0.136.3 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.55.0 h11==0.16.0
httptools==0.9.0 uvloop==0.23.0 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0
frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 httpx==0.29.0 httpcore==1.0.9 anyio==4.16.0
idna==3.20 certifi==2026.10.19.post1 sniffio==1.3.1 Jinja2==3.1.6 MarkupSafe==3.0.4 PyYAML==6.0.4 orjson==3.13.0
typing_extensions==4.16.0 typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7 click==8.5.1"

PY=${PYTHON:-}
if [ -z "$PY" ]; then  # this checkout's virtual environment, else the first interpreter that has torch
  for p in .venv/bin/python /opt/torch/.venv/bin/python3 python3 python; do
    if command -v "$p" >/dev/null && "$p" -c "import torch, transformers" 2>/dev/null; then PY=$p; break; fi
  done
fi
[ -n "$PY" ] || { echo "no python with torch and transformers found; set PYTHON=" >&2; exit 2; }

if [ "${1:-}" = --prepare ]; then   # here, with PyPI: the wheels for the device machine's CPython 3.12
  mkdir -p "$WHEELS"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --dest "$WHEELS" --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 $VERSIONS || exit 1
  ls "$WHEELS" && du -sh "$WHEELS"
  exit 0
fi

OUT=${OUT:-runs/gateway_gpu}
mkdir -p "$OUT"
txt=$OUT/gpu_host_bench_gateway_overhead.txt
json=$OUT/gpu_host_bench_gateway_overhead.json
: > "$txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

{
  echo "== $(date -u +%FT%TZ) $(git log -1 --format="%h %s" 2>/dev/null | cut -c1-72)"
  echo "== python: $PY ($(command -v "$PY")) $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  echo "== nproc: $(nproc)"
  lscpu | head -20
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
} 2>&1 | tee -a "$txt"

# The wheels the interpreter needs: from ROOTS, each requirement the interpreter's environment already satisfies
# stays; any other is taken from WHEELS (a wheel compatible with this interpreter) with its own requirements.
if [ -e "$TARGET" ] && [ ! -f "$TARGET/.turnrl-gwpkgs" ]; then   # only ever a folder this script made
  echo "$TARGET exists and is not this script's: set GW_TARGET" | tee -a "$txt"; exit 2
fi
rm -rf "$TARGET" && mkdir -p "$TARGET" && touch "$TARGET/.turnrl-gwpkgs"
# shellcheck disable=SC2086
"$PY" - "$WHEELS" "$TARGET" $ROOTS <<'PYEOF' 2>&1 | tee -a "$txt"
import email.parser, importlib.metadata as md, os, re, shutil, sys, zipfile
try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
wheels_dir, target, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
tags = {str(t): i for i, t in enumerate(sys_tags())}
wheels = {}   # name -> (preference, path, version)
for f in sorted(os.listdir(wheels_dir)) if os.path.isdir(wheels_dir) else []:
    if not f.endswith(".whl"):
        continue
    name, version, _, wtags = parse_wheel_filename(f)
    rank = min((tags[str(t)] for t in wtags if str(t) in tags), default=None)
    if rank is not None and (name not in wheels or rank < wheels[name][0]):
        wheels[name] = (rank, os.path.join(wheels_dir, f), version)

def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

def requires(path):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]

chosen, kept, missing = {}, {}, []
queue = [(Requirement(r), "(bench)") for r in roots]
while queue:
    req, by = queue.pop(0)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = canonicalize_name(req.name)
    if name in chosen:
        if not req.specifier.contains(chosen[name][1], prereleases=True):
            print(f"warning: {by} wants {req}, the wheel is {chosen[name][1]}")
        continue
    have = installed(name)
    if have is not None and req.specifier.contains(have, prereleases=True):
        kept.setdefault(name, have)
        continue
    if name not in wheels:
        missing.append(f"{req} (for {by}; installed: {have})")
        continue
    _, path, version = wheels[name]
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{req} (for {by}; wheel {version}, installed: {have})")
        continue
    kept.pop(name, None)
    chosen[name] = (path, version, have)
    queue += [(r, f"{name} {version}") for r in requires(path)]
print("kept from the interpreter:", " ".join(f"{n}=={v}" for n, v in sorted(kept.items())) or "-")
print(f"from {wheels_dir} into {target}:",
      " ".join(f"{n}=={v}" + (f" (over {h})" if h else "") for n, (_, v, h) in sorted(chosen.items())) or "-")
if missing:
    sys.exit("no wheel for: " + "; ".join(missing))
# what else in the interpreter's environment requires a package this shadows, in a version it rules out
for dist in md.distributions():
    for r in dist.requires or []:
        r = Requirement(r)
        n = canonicalize_name(r.name)
        if n in chosen and chosen[n][2] and (r.marker is None or r.marker.evaluate({"extra": ""})) \
                and not r.specifier.contains(chosen[n][1], prereleases=True):
            print(f"warning: {dist.metadata['Name']} requires {r}; {n} {chosen[n][1]} is put before it")
for path, _, _ in chosen.values():   # a wheel is a zip of what goes on sys.path (+ .data/purelib|platlib)
    with zipfile.ZipFile(path) as z:
        z.extractall(target)
for d in os.listdir(target):
    if d.endswith(".data"):
        for sub in ("purelib", "platlib"):
            src = os.path.join(target, d, sub)
            if os.path.isdir(src):
                shutil.copytree(src, target, dirs_exist_ok=True)
        shutil.rmtree(os.path.join(target, d))
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || { echo "== installing the wheels failed" | tee -a "$txt"; exit 1; }
export PYTHONPATH="$PWD:$TARGET${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "
import importlib, sys
for m in 'fastapi starlette pydantic uvicorn httptools uvloop aiohttp httpx orjson jinja2 yaml torch transformers tokenizers'.split():
    x = importlib.import_module(m)
    print(f'{m:12s} {getattr(x, \"__version__\", \"?\"):24s} {x.__file__}')
" 2>&1 | tee -a "$txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "== imports failed" | tee -a "$txt"; exit 1; }

tok=${TOKENIZER:-}
if [ -z "$tok" ]; then
  for d in .devcache/smollm2-tokenizer "${TURNRL_HOME:-$HOME/.cache/turnrl}/models/smollm2-135m-instruct"; do
    if [ -f "$d/tokenizer_config.json" ]; then tok=$d; break; fi
  done
fi
[ -n "$tok" ] || { echo "no SmolLM2 tokenizer: carry .devcache/smollm2-tokenizer (bash" \
  "benchmarks/fast_prefix/run_gpu.sh --prepare makes it), or set TOKENIZER=DIR" | tee -a "$txt"; exit 2; }
model=$(mktemp -d "${TMPDIR:-/tmp}/turnrl-gateway-model.XXXXXX")
trap 'rm -rf "$model"' EXIT
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json config.json; do
  [ -f "$tok/$f" ] && cp "$tok/$f" "$model/"
done
# turnrl resolves model.name to a directory holding config.json; SmolLM2-135M-Instruct's (never loaded here)
[ -f "$model/config.json" ] || cat > "$model/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false, "attention_dropout": 0.0,
 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "unk_token_id": 0, "head_dim": 64, "hidden_act": "silu",
 "hidden_size": 576, "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192,
 "mlp_bias": false, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
 "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
 "tie_word_embeddings": true, "dtype": "bfloat16", "use_cache": true, "vocab_size": 49152}
EOF

cmd=("$PY" -m turnrl bench gateway "model.name=$model" --sessions "${SESSIONS:-1,256}"
     --engine-ms "${ENGINE_MS:-0,1000}" --prompts 0 --json "$json" "$@")
echo "== tokenizer $tok; timeout ${BENCH_TIMEOUT:-540}s: ${cmd[*]}" | tee -a "$txt"
start=$(date +%s)
timeout "${BENCH_TIMEOUT:-540}" "${cmd[@]}" 2>&1 | tee -a "$txt"
rc=${PIPESTATUS[0]}
echo "== exit status $rc after $(( $(date +%s) - start ))s" | tee -a "$txt"
exit "$rc"
