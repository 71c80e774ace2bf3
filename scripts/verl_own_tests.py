"""Run verl's own V1 test files, unmodified, against verl's buffer and the kvckpt one, and compare.

Usage (in the verl venv, from the repository root):

    .venv-verl/bin/python scripts/verl_own_tests.py --source PATH [--commit REV] [--buffer verl|kvckpt|both]

``PATH`` is a verl checkout: a work tree holding ``tests/trainer/ppo/v1``, or a git directory read at
``--commit`` (default ``1dda039b9``, the commit docs/integrations.md cites). verl's wheel and its sdist
ship no V1 tests, and kvckpt does not copy them, so the files come from there. They are written
byte for byte into a scratch directory and run with ``tests/_verl_switch.py`` (``--verl-buffer``)
in a fresh pytest process per buffer. Prints each file's passed/failed/error counts per buffer and
every test whose outcome differs; ``--json FILE`` writes the outcomes. Exit status 0 unless pytest
could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: verl's V1 test files the issue names, under ``tests/trainer/ppo/v1/``.
FILES = ("test_replay_buffer_on_cpu.py", "test_reissue_inflight_on_cpu.py", "test_trainer_base_on_cpu.py")
SUBDIR = "tests/trainer/ppo/v1"


def verl_files(source: Path, commit: str, into: Path) -> list[Path]:
    """Write verl's test files from ``source`` (a work tree, or a git directory at ``commit``) into ``into``."""
    out = []
    for name in FILES:
        tree_file = source / SUBDIR / name
        if tree_file.is_file():
            data = tree_file.read_bytes()
        else:
            data = subprocess.run(["git", f"--git-dir={source}", "show", f"{commit}:{SUBDIR}/{name}"],
                                  check=True, capture_output=True).stdout
        (into / name).write_bytes(data)
        out.append(into / name)
    return out


def run(buffer: str, files: list[Path], scratch: Path, timeout: float) -> dict[str, str]:
    """One pytest process over ``files`` with ``--verl-buffer=buffer``: ``{file::test: outcome}``."""
    report = scratch / f"junit-{buffer}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    (scratch / "pytest.ini").write_text("[pytest]\n")  # verl's files, not kvckpt's pytest settings
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_verl_switch", f"--verl-buffer={buffer}",
                    "-p", "no:cacheprovider", f"--junitxml={report}", *map(str, files)],
                   cwd=scratch, env=env, timeout=timeout, check=False)
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
    return outcomes


def summary(results: dict[str, dict[str, str]]) -> str:
    """Per file and buffer: passed / failed / errors / skipped; then every test whose outcome differs."""
    lines = []
    for name in FILES:
        stem = name[:-3]
        for buffer, outcomes in results.items():
            mine = [o for t, o in outcomes.items() if t.startswith(stem + ".py::")]
            counts = {k: mine.count(k) for k in ("passed", "failure", "error", "skipped")}
            lines.append(f"{name} [{buffer}]: {counts['passed']} passed, {counts['failure']} failed, "
                         f"{counts['error']} errors, {counts['skipped']} skipped, of {len(mine)}")
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        for test in sorted(set(ra) | set(rb)):
            if ra.get(test) != rb.get(test):
                lines.append(f"differs: {test}: {a} {ra.get(test)}, {b} {rb.get(test)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, type=Path, help="a verl work tree or git directory")
    parser.add_argument("--commit", default="1dda039b9", help="the verl commit, when --source is a git directory")
    parser.add_argument("--buffer", choices=("verl", "kvckpt", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest process")
    parser.add_argument("--json", type=Path, help="write {buffer: {test: outcome}} here")
    args = parser.parse_args()
    buffers = ("verl", "kvckpt") if args.buffer == "both" else (args.buffer,)
    with tempfile.TemporaryDirectory(prefix="verl_own_") as tmp:
        scratch = Path(tmp)
        files = verl_files(args.source, args.commit, scratch)
        results = {buffer: run(buffer, files, scratch, args.timeout) for buffer in buffers}
    print(summary(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
