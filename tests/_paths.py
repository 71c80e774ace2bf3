"""Where the repository and its tests are, for a test in any sub-folder of tests/, and the
environment a child interpreter needs to import tests/'s helper modules (``_buffers``, ...)."""

from __future__ import annotations

import os
from pathlib import Path

#: tests/: the helper modules and the crafted-file and fencing scripts live here.
TESTS = Path(__file__).resolve().parent
#: The repository root.
ROOT = TESTS.parent


def child_env() -> dict[str, str]:
    """This process's environment with tests/ first on ``PYTHONPATH``, for a test that runs its own
    file (or a helper script) in a fresh interpreter."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
