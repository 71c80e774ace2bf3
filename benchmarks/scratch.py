"""The scratch directory and results file every benchmark command shares (``--work``, ``--json``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def run_in_scratch(prefix: str, work: str | None, out: str | None, fn: Callable[[str], dict[str, Any]]) -> None:
    """Run ``fn(directory)`` in ``work`` (kept) or in a new directory under /var/tmp named ``prefix...``
    (removed afterwards, even when ``fn`` raises), and write what it returns to ``out`` as JSON."""
    directory = work or tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")
    os.makedirs(directory, exist_ok=True)
    try:
        result = fn(directory)
    finally:
        if not work:
            shutil.rmtree(directory, ignore_errors=True)
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1, sort_keys=True)
