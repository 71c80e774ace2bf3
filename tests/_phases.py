"""One phase of a fresh-process crash test: a helper script of tests/ run in a session of its own.

Imported by tests/integrations/verl/test_verl_stream_crash.py and test_verl_reissue_crash.py (stdlib only, so the
main suite collects them without verl), and by their phase scripts (:func:`write_json`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def run_phase(script: Path, work: Path, phase: str, *, deadline_s: float = 400) -> int:
    """Run ``python script phase work`` (output in ``work/phase.out``) in its own process group and return its exit
    status (``-SIGKILL`` when it killed its own group). Past ``deadline_s`` the group is SIGKILLed and the status of
    that kill returned, so a hung phase fails its test instead of hanging it."""
    with open(work / f"{phase}.out", "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), phase, str(work)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline = time.monotonic() + deadline_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def write_json(work: str, name: str, value: object) -> None:
    """Write ``value`` to ``work/name`` durably and whole (a temporary file, fsynced, renamed): a phase's report,
    which a kill of its own process group right after must not leave half written."""
    path = os.path.join(work, name)
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
