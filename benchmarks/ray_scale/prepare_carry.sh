#!/usr/bin/env bash
# Run here (with network to PyPI) before the GPU run: what the GPU machine lacks, in two ignored folders.
#   .whl/ray/              Ray for CPython 3.12 manylinux x86_64 and its dependencies (offline install there).
#                          Ray's Java jar and the dashboard's source maps are dropped (unused; 79 -> 45 MB), so
#                          the whole carry stays under 64 MiB.
#   runs/bench-tokenizer/  the SmolLM2 tokenizer and chat template (the benchmark's model is built from it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
RAY_VERSION=${RAY_VERSION:-2.60.0}
dest=.whl/ray
rm -rf "$dest" && mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux_2_28_x86_64)
"$PY" -m pip download -q --no-deps "${plat[@]}" "ray==$RAY_VERSION" -d "$tmp"
"$PY" -m pip download -q "${plat[@]}" click jsonschema "msgpack>=1,<2" "protobuf>=3.20.3" requests "packaging>=24.2" \
  filelock pyyaml -d "$dest"
"$PY" - "$tmp"/ray-*.whl "$dest" <<'PYEOF'
import os, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
drop = lambda n: n.startswith("ray/jars/") or (n.startswith("ray/dashboard/client/build/") and n.endswith(".map"))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(os.path.join(dest, os.path.basename(src)), "w",
                                                  zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for item in zin.infolist():
        if drop(item.filename):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = "".join(l + "\n" for l in data.decode().splitlines() if not drop(l.split(",")[0])).encode()
        zout.writestr(item, data)
PYEOF
mkdir -p runs/bench-tokenizer
"$PY" -c "import turnrl.models as m; m.prepare('tiny-random')" >/dev/null
src=$("$PY" -c "import turnrl.models as m; print(m.model_dir('tiny-random'))")
cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/chat_template.jinja runs/bench-tokenizer/
du -sh "$dest" runs/bench-tokenizer
