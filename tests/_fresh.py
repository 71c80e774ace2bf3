"""Running a snippet in a fresh interpreter: what a restarted producer or trainer sees."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run_fresh(code: str, **kwargs) -> dict:
    """Run ``code`` in a fresh interpreter (``ARGS`` holds ``kwargs``); its last stdout line is JSON."""
    prelude = "import json, os, signal, sys, torch\nfrom kvckpt import *\nARGS = json.loads(sys.argv[1])\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=120)
    return {"rc": proc.returncode, "out": json.loads(proc.stdout.splitlines()[-1]) if proc.stdout else None,
            "err": proc.stderr}
