"""Every code block in README.md and docs/*.md runs as written.

Blocks are found by their fence's language:

* ``python`` — run as a script in a fresh temporary directory, in a new interpreter. A block
  whose first line starts with ``>>>`` is a doctest instead (``ELLIPSIS`` on, so a shown
  traceback may elide its detail with ``...``).
* ``console`` — a shell session: each ``$ `` line (with the heredoc lines that follow it) is a
  command, the lines up to the next ``$ `` are its transcript. The command must exit with the
  status the transcript ends with (``[exit status N]``), 0 when it shows none, and never print a
  Python traceback. ``kvckpt`` and ``python`` are this interpreter's. The console blocks of one
  file share one temporary directory, in order (later transcripts look at files earlier ones
  made).
* ``sh`` / ``bash`` — every non-comment line is a command that must exit 0 (run from the
  repository root).
* ``yaml`` / ``json`` — must parse (YAML with ``yaml.safe_load``); a YAML document with an
  ``output_dir`` is a reference-trainer config and must also pass ``TrainerConfig.from_any``
  (which refuses unknown keys).

Anything else (``text``, no language: diagrams, listings) is not code. A marker comment on the
line right before a fence changes what happens to that block, and says why:

* ``<!-- snippet: skip (why) -->`` — deliberately not run (the reason must name what does check it,
  or why nothing can);
* ``<!-- snippet: slow (why) -->`` — run, but only with the tests marked ``slow``
  (``make test-slow``);
* ``<!-- snippet: continues -->`` — a python block that continues the previous python block of
  the same file: both run as one script.

tests/tools/test_docs_snippets.py::test_every_block_is_run_or_marked keeps the marker list honest: an
unknown marker, a marker without a reason, or one before a block of no runnable language fails.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _paths import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "console", "sh", "bash", "yaml", "json"}
MARKER = re.compile(r"<!--\s*snippet:\s*(?P<kind>[a-z]+)\s*(?:\((?P<why>.*)\))?\s*-->")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
EXIT = re.compile(r"^\[exit status (\d+)\]$")
TIMEOUT = 600


@dataclass
class Block:
    """One fenced block: where it is, its language, its text and its marker (if any)."""

    path: Path
    line: int
    lang: str
    text: str
    marker: str | None = None
    why: str | None = None
    parts: list[Block] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, in order, each with the marker right before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.search(lines[start - 1]) if start else None
        found.append(Block(path, start + 1, match["lang"], "\n".join(lines[start + 1:end]) + "\n",
                           marker["kind"] if marker else None, (marker["why"] or "").strip() if marker else None))
        i = end + 1
    return found


def units(path: Path) -> list[Block]:
    """The runnable units of a file: python blocks (a ``continues`` block joined to the one before
    it), its console blocks as one session, sh/bash/yaml/json blocks one by one; ``skip`` blocks
    left out, ``slow`` blocks kept (marked by the caller)."""
    out: list[Block] = []
    session: Block | None = None
    last_python: Block | None = None
    for block in blocks(path):
        if block.lang not in RUNNABLE or block.marker == "skip":
            continue
        if block.lang == "python" and block.marker == "continues" and last_python is not None:
            last_python.parts.append(block)
            continue
        if block.lang == "console" and block.marker != "slow":
            if session is None:
                session = Block(path, block.line, "console", "")
                out.append(session)
            session.parts.append(block)
            continue
        if block.lang == "python":
            last_python = block
        block.parts = [block] if not block.parts else block.parts
        out.append(block)
    for unit in out:
        if not unit.parts:
            unit.parts = [unit]
    return out


def _params() -> list[object]:
    params = []
    for path in DOCS:
        for unit in units(path):
            marks = [pytest.mark.slow] if any(p.marker == "slow" for p in unit.parts) else []
            params.append(pytest.param(unit, id=unit.name, marks=marks))
    return params


def _env() -> dict[str, str]:
    """This environment's ``bin`` first on ``PATH``: its ``python`` and ``kvckpt`` answer."""
    bindir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str] | str, cwd: Path, env: dict[str, str], stdin: str | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=TIMEOUT,
                          shell=isinstance(cmd, str), executable="/bin/bash" if isinstance(cmd, str) else None)


def console_commands(text: str) -> list[tuple[str, int]]:
    """The commands of a console transcript, each with the exit status its transcript shows."""
    commands: list[tuple[str, int]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            i += 1
            continue
        cmd = [lines[i][2:]]
        heredoc = re.search(r"<<'?(\w+)'?", cmd[0])
        i += 1
        if heredoc:
            while i < len(lines) and lines[i] != heredoc[1]:
                cmd.append(lines[i])
                i += 1
            cmd.append(heredoc[1])
            i += 1
        status = 0
        while i < len(lines) and not lines[i].startswith("$ "):
            exit_line = EXIT.match(lines[i].strip())
            if exit_line:
                status = int(exit_line[1])
            i += 1
        commands.append(("\n".join(cmd), status))
    return commands


@pytest.mark.parametrize("unit", _params())
def test_block_runs_as_written(unit: Block, tmp_path: Path) -> None:
    env = _env()
    if unit.lang == "python":
        source = "".join(part.text for part in unit.parts)
        if source.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(source, {}, unit.name, str(unit.path), unit.line)
            script = ("import doctest, sys\n"
                      f"test = doctest.DocTestParser().get_doctest({source!r}, {{}}, {unit.name!r}, None, 0)\n"
                      "runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)\n"
                      "runner.run(test)\nsys.exit(1 if runner.failures else 0)\n")
            assert test.examples, f"{unit.name}: a doctest block without examples"
        else:
            script = source
        proc = _run([sys.executable, "-c", script], tmp_path, env)
        assert proc.returncode == 0, f"{unit.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    elif unit.lang == "console":
        for part in unit.parts:
            for cmd, status in console_commands(part.text):
                proc = _run(cmd, tmp_path, env)
                shown = f"{part.name}: `{cmd.splitlines()[0]}` exited {proc.returncode}, the transcript shows {status}"
                assert proc.returncode == status, f"{shown}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
                assert "Traceback (most recent call last)" not in proc.stderr, f"{part.name}: {proc.stderr[-3000:]}"
    elif unit.lang in ("sh", "bash"):
        for line in unit.text.splitlines():
            cmd = line.split("#")[0].strip() if not line.lstrip().startswith("#") else ""
            if cmd:
                proc = _run(cmd, ROOT, env)
                assert proc.returncode == 0, f"{unit.name}: `{cmd}` failed:\n{proc.stderr[-3000:]}"
    elif unit.lang == "yaml":
        import yaml

        doc = yaml.safe_load(unit.text)
        assert doc is not None, f"{unit.name}: empty YAML"
        if isinstance(doc, dict) and "output_dir" in doc:  # the reference trainer's config: every key checked
            from kvckpt.reference import TrainerConfig

            TrainerConfig.from_any(doc)
    else:
        json.loads(unit.text)


def test_every_block_is_run_or_marked() -> None:
    """Markers are known, say why (skip and slow), and sit before blocks they can apply to; a
    ``continues`` block follows a python block of its file."""
    problems = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8").splitlines()
        marked_lines = {b.line - 1 for b in blocks(path) if b.marker}
        for number, line in enumerate(text, 1):
            match = MARKER.search(line)
            if match and number not in marked_lines:
                problems.append(f"{path.name}:{number}: a snippet marker not right before a fence")
        seen_python = False
        for block in blocks(path):
            if block.marker not in (None, "skip", "slow", "continues"):
                problems.append(f"{block.name}: unknown marker {block.marker!r}")
            if block.marker in ("skip", "slow") and not block.why:
                problems.append(f"{block.name}: {block.marker!r} needs a reason: "
                                f"<!-- snippet: {block.marker} (why) -->")
            if block.marker and block.lang not in RUNNABLE:
                problems.append(f"{block.name}: a marker on a {block.lang or 'plain'} block, which never runs")
            if block.marker == "continues" and (block.lang != "python" or not seen_python):
                problems.append(f"{block.name}: 'continues' must follow a python block of the same file")
            seen_python = seen_python or block.lang == "python"
    assert problems == []


def test_the_extractor_sees_what_a_reader_sees(tmp_path: Path) -> None:
    """The parser itself: markers bind to the next fence only, continues joins, console commands
    take their heredoc along and their shown exit status."""
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- snippet: skip (shown only) -->\n```python\nraise SystemExit(1)\n```\n"
                   "```python\nx = 1\n```\n<!-- snippet: continues -->\n```python\nassert x == 1\n```\n"
                   "```console\n$ python - <<'EOF'\nprint(1)\nEOF\n1\n\n$ false\n[exit status 1]\n```\n"
                   "```text\nnot code\n```\n", encoding="utf-8")
    found = blocks(doc)
    assert [(b.lang, b.marker) for b in found] == [("python", "skip"), ("python", None), ("python", "continues"),
                                                  ("console", None), ("text", None)]
    assert found[0].why == "shown only"
    made = units(doc)
    assert [(u.lang, len(u.parts)) for u in made] == [("python", 2), ("console", 1)]
    assert console_commands(found[3].text) == [("python - <<'EOF'\nprint(1)\nEOF", 0), ("false", 1)]
