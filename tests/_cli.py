"""Running the ``kvckpt`` command line as a user does: the installed console script in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

SCRIPT = shutil.which("kvckpt", path=os.path.dirname(sys.executable))
#: The command: the console script next to this interpreter, else the module.
KVCKPT = [SCRIPT] if SCRIPT else [sys.executable, "-m", "kvckpt.tools.cli"]


def kv(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run ``kvckpt ARGS``; assert the exit status unless ``check`` is None."""
    proc = subprocess.run([*KVCKPT, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc
