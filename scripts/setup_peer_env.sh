#!/usr/bin/env bash
# Build .venv-NAME, a peer's own virtualenv, from scripts/peer_envs/NAME.txt.
#
# Usage: bash scripts/setup_peer_env.sh NAME [VENV_DIR]   (default VENV_DIR: .venv-NAME)
#
# NAME.txt holds pip requirement lines (pip reads them with -r) and header comments:
#   # python: python3.11             the interpreter the venv is made with (PYTHON_<NAME> overrides it)
#   # uninstall: pkg pkg             removed after the install (wheels the peer drags in but breaks on)
#   # import: mod mod                imported once installed, as a smoke check (optional)
#   # tests: tests/a.py tests/b.py   what `make test` runs in the venv ...
#   # marker: NAME                   ... with -m "NAME and not slow"; the main suite excludes the marker
#   # pip-options: --opt ...         added to both pip installs (optional; e.g. --no-deps where the spec lists
#                                    every package itself, kvckpt's own dependencies included)
# kvckpt itself (editable), pytest, pyyaml and hypothesis (tests/conftest.py's helpers use kvckpt.testing's
# conformance suite) are installed into every peer venv.
# A peer's pins conflict with the main .venv, so each peer lives apart. Downloads resume after a
# dropped connection (pip's --resume-retries) and a failed install is tried 3 times. Idempotent: a
# stamp file records a finished install; it is redone when NAME.txt, pyproject.toml or this script
# changes.
set -euo pipefail

cd "$(dirname "$0")/.."
NAME="${1:?usage: bash scripts/setup_peer_env.sh NAME [VENV_DIR] (NAME: one of scripts/peer_envs/*.txt)}"
SPEC="scripts/peer_envs/$NAME.txt"
if [[ ! -f "$SPEC" ]]; then
    echo "no peer environment '$NAME': $SPEC does not exist (known: $(ls scripts/peer_envs | sed 's/\.txt$//' | tr '\n' ' '))" >&2
    exit 2
fi
VENV="${2:-.venv-$NAME}"
STAMP="$VENV/.kvckpt-peer-installed"
header() { sed -n "s/^# $1: *//p" "$SPEC" | head -n 1; }
OVERRIDE="PYTHON_$(echo "$NAME" | tr '[:lower:]-' '[:upper:]_')"
PYTHON="${!OVERRIDE:-$(header python)}"
PYTHON="${PYTHON:-python3}"
PIP_OPTIONS="$(header pip-options)"
if ! "$PYTHON" -c "" 2>/dev/null && command -v pyenv >/dev/null; then
    # a pyenv shim of a version that is installed but not selected (python3.13 beside a 3.11 global):
    # the newest installed release of that minor version
    RELEASE="$(pyenv versions --bare | grep -x "${PYTHON#python}\.[0-9]*" | sort -V | tail -n 1 || true)"
    if [[ -n "$RELEASE" ]]; then
        PYTHON="$(pyenv root)/versions/$RELEASE/bin/$PYTHON"
    fi
fi

if [[ -f "$STAMP" && "$STAMP" -nt "$SPEC" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt "$0" ]]; then
    exit 0
fi

echo "setting up $VENV from $SPEC with $PYTHON (pip output in $VENV/setup.log)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"
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
# A peer and its pins can be a GB of downloads: a dropped connection resumes (pip's
# --resume-retries), and a failed install is tried again before the set-up gives up.
for attempt in 1 2 3; do
    # shellcheck disable=SC2086  # PIP_OPTIONS is a list of options
    if "$VENV/bin/python" -m pip install -q --resume-retries 10 $PIP_OPTIONS -r "$SPEC" >> "$LOG" 2>&1; then
        break
    fi
    if [[ $attempt == 3 ]]; then
        tail -n 40 "$LOG" >&2
        echo "pip install -r $SPEC failed 3 times; full output in $LOG" >&2
        exit 1
    fi
    echo "pip install -r $SPEC failed (attempt $attempt of 3); trying again" >&2
    sleep 10
done
UNINSTALL="$(header uninstall)"
if [[ -n "$UNINSTALL" ]]; then
    # shellcheck disable=SC2086  # a list of package names
    "$VENV/bin/python" -m pip uninstall -q -y $UNINSTALL >> "$LOG" 2>&1 || true
fi
# shellcheck disable=SC2086  # PIP_OPTIONS is a list of options
pip_quiet install -q $PIP_OPTIONS -e . "pytest>=8" "pyyaml>=6" "hypothesis>=6.100"
"$VENV/bin/python" - "$(header import)" <<'PY'
import importlib
import sys

import kvckpt

modules = sys.argv[1].split()
found = [importlib.import_module(name) for name in modules]
print(" ".join(f"{name} {getattr(module, '__version__', '?')}" for name, module in zip(modules, found))
      or f"kvckpt {kvckpt.__version__}")
PY
touch "$STAMP"
