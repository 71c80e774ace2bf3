"""``scripts/mutation_check.py``: it tells a killed mutant from a surviving one, from one whose aimed tests
were all skipped (not run) and from one whose text moved, and the net kills every mutation of its built-in
list that this interpreter can run.

The first test mutates a tiny git work tree of its own (seconds). The other two are marked slow
(``make test-slow``): each mutant is a fresh pytest process on a copy of the real tree (about 80 s for the
second test, a long while for the whole list on the shared 2-core box).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import ROOT

SCRIPT = ROOT / "scripts" / "mutation_check.py"
FENCING = "tests/core/test_net.py::test_redispatch_fences_the_previous_lease"
ROW = re.compile(r"^(\S+)\s+(killed|survived|not run|error|n/a)\s+\d+\.\d\s*(.*)$")

#: A tiny tree: a module the mutations change, a test that runs, one skipped in its body and a file skipped
#: at import (as a peer's tests skip where the peer is not installed).
TINY = {
    "kvckpt/__init__.py": "",
    "kvckpt/tiny.py": "def double(x):\n    return 2 * x\n\n\ndef triple(x):\n    return 3 * x\n",
    "tests/test_tiny.py": (
        "import pytest\n\nfrom kvckpt.tiny import double, triple\n\n\n"
        "def test_double():\n    assert double(3) == 6\n\n\n"
        "def test_triple_is_called():\n    triple(1)\n\n\n"
        "def test_triple_needs_a_gpu():\n    pytest.skip('no GPU on this machine')\n    assert triple(3) == 9\n"),
    "tests/test_peer.py": (
        "import pytest\n\npytest.importorskip('a_peer_this_machine_lacks')\n\n\n"
        "def test_triple_through_the_peer():\n    from kvckpt.tiny import triple\n\n    assert triple(3) == 9\n"),
}
TINY_MUTATIONS = [
    {"name": "double-adds", "file": "kvckpt/tiny.py", "old": "return 2 * x", "new": "return 2 + x",
     "tests": ["tests/test_tiny.py::test_double"]},
    {"name": "triple-adds-unseen", "file": "kvckpt/tiny.py", "old": "return 3 * x", "new": "return 3 + x",
     "tests": ["tests/test_tiny.py::test_triple_is_called", "tests/test_tiny.py::test_triple_needs_a_gpu"]},
    {"name": "triple-adds-where-no-test-runs", "file": "kvckpt/tiny.py", "old": "return 3 * x", "new": "return 3 + x",
     "tests": ["tests/test_tiny.py::test_triple_needs_a_gpu", "tests/test_peer.py::test_triple_through_the_peer"]},
]


def run(*args: str, plugins: bool = True) -> subprocess.CompletedProcess[str]:
    """The checker with ``args``; ``plugins=False``: its pytest runs load no installed plugin (the tiny tree needs
    none, and each run starts in a fraction of a second instead of seconds)."""
    env = dict(os.environ, **({} if plugins else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=3600, env=env)


def rows(output: str) -> dict[str, tuple[str, str]]:
    """``name -> (verdict, detail)`` from the table the script prints."""
    table = output[output.index("\nmutation ") + 1:].splitlines()[1:-1]
    return {m[1]: (m[2], m[3]) for m in map(ROW.match, table) if m}


def verdicts(output: str) -> dict[str, str]:
    """``name -> verdict`` from the table the script prints."""
    return {name: verdict for name, (verdict, _) in rows(output).items()}


def test_killed_survived_and_not_run_are_told_apart_and_only_a_survivor_fails(tmp_path: Path) -> None:
    """A mutant whose aimed test fails is killed; one whose aimed tests pass (one of them skipped) survived; one
    whose every aimed test was skipped (in its body; at import, where pytest refuses the node id as "found no
    collectors") is ``not run``, with pytest's skip reasons, and counted apart. The exit status fails on the
    survivor, not on the mutation not run, unless ``--require-all``."""
    tree = tmp_path / "tree"
    for name, text in TINY.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)  # the checker copies a git work tree's files
    listed = tmp_path / "mutations.json"
    listed.write_text(json.dumps(TINY_MUTATIONS))
    common = ("--root", str(tree), "--mutations", str(listed))

    done = run(*common, plugins=False)
    assert done.returncode == 1, done.stdout + done.stderr  # one survived
    found = rows(done.stdout)
    assert {name: verdict for name, (verdict, _) in found.items()} == {
        "double-adds": "killed", "triple-adds-unseen": "survived", "triple-adds-where-no-test-runs": "not run"}
    assert "no GPU on this machine" in found["triple-adds-unseen"][1]  # the survivor names what it did not run
    reason = found["triple-adds-where-no-test-runs"][1]
    assert "no GPU on this machine" in reason and "a_peer_this_machine_lacks" in reason
    assert "1 killed, 1 survived, 1 not run, 0 error, 0 n/a" in done.stdout
    assert "imports from" not in done.stderr  # the copy, not an installed tree, was tested

    without_survivor = (*common, "--only", "double-adds", "triple-adds-where-no-test-runs")
    done = run(*without_survivor, plugins=False)
    assert done.returncode == 0, done.stdout + done.stderr  # a mutation not run is reported, not failed
    assert "1 killed, 0 survived, 1 not run, 0 error, 0 n/a" in done.stdout
    assert run(*without_survivor, "--require-all", plugins=False).returncode == 1


@pytest.mark.slow
def test_killed_survived_and_moved_mutations_are_told_apart(tmp_path: Path) -> None:
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
    assert "1 killed, 1 survived, 0 not run, 0 error, 1 n/a" in done.stdout
    assert "imports from" not in done.stderr  # the copy, not the editable install, was tested


@pytest.mark.slow
def test_the_net_kills_every_built_in_mutation() -> None:
    """Every built-in mutation is killed, or not run where this interpreter lacks what its aimed tests need
    (NeMo-Gym's, vLLM's server's: run those with the peer's interpreter, ``--python``); a survivor fails."""
    done = run()
    assert done.returncode == 0, done.stdout + done.stderr
    names = [line.split(":")[0] for line in run("--list").stdout.splitlines()]
    found = rows(done.stdout)
    assert set(found) == set(names)
    assert {name: verdict for name, (verdict, _) in found.items() if verdict != "not run"} == {
        name: "killed" for name, (verdict, _) in found.items() if verdict != "not run"}
    assert all(detail for verdict, detail in found.values() if verdict == "not run")  # each says why
