"""``scripts/mutation_check.py``: it tells a killed mutant from a surviving one and from one whose
text moved, and the net of ``tests/core/test_net.py`` kills every mutation of its built-in list.

Both are marked slow (``make test-slow``): each mutant is a fresh pytest process on a copy of the
tree (about 80 s for the first test, a few minutes for the second, on the shared 2-core box).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _paths import ROOT

SCRIPT = ROOT / "scripts" / "mutation_check.py"
FENCING = "tests/core/test_net.py::test_redispatch_fences_the_previous_lease"
pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900)


def verdicts(output: str) -> dict[str, str]:
    """``name -> verdict`` from the table the script prints."""
    rows = output[output.index("mutation "):].splitlines()[1:-1]
    return {row.split()[0]: row.split()[1] for row in rows}


def test_killed_survived_and_moved_mutations_are_told_apart(tmp_path):
    mutations = [
        {"name": "killed", "file": "kvckpt/storage/keys.py", "old": 'return group_key(group_id) + b"\\x00"',
         "new": "return group_key(group_id)",
         "tests": ["tests/core/test_net.py::test_operations_on_a_group_leave_groups_whose_ids_extend_its_id_untouched"
                   "[read]"]},
        {"name": "survived", "file": "kvckpt/storage/keys.py", "old": '"""Prefix of every row key of a group."""',
         "new": '"""Prefix of every row key of a group (a docstring change no test can see)."""',
         "tests": [FENCING]},
        {"name": "moved", "file": "kvckpt/storage/keys.py", "old": "text that is not in the file", "new": "",
         "tests": [FENCING]},
    ]
    listed = tmp_path / "mutations.json"
    listed.write_text(json.dumps(mutations))
    done = run("--mutations", str(listed))
    assert done.returncode == 1, done.stdout + done.stderr  # not everything was killed
    assert verdicts(done.stdout) == {"killed": "killed", "survived": "survived", "moved": "n/a"}
    assert "1 killed, 1 survived, 0 error, 1 n/a" in done.stdout
    assert "imports from" not in done.stderr  # the copy, not the editable install, was tested


def test_the_net_kills_every_built_in_mutation():
    done = run()
    assert done.returncode == 0, done.stdout + done.stderr
    names = [line.split(":")[0] for line in run("--list").stdout.splitlines()]
    assert verdicts(done.stdout) == dict.fromkeys(names, "killed")
