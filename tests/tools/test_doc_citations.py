"""Every test a document cites exists.

A citation is a path under ``tests/`` (``tests/test_x.py``), optionally with a test name
(``tests/test_x.py::test_y``), in README.md, BENCHMARKS.md, docs/*.md or a docstring or comment
of the library, tools, integrations and benchmarks. A cited file must exist; a cited name must be
a function or class defined in that file (``*`` in a name matches as in a shell pattern, and so does
``*`` in the path: ``tests/integrations/trl/test_trl_*.py`` must match at least one file).
Renaming or moving a test without its citation fails here, so a promise in the docs never points
at a test that no longer holds it.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from _paths import ROOT

#: Lower-case paths only: ``tests/test_NAME_a.py`` in docs/architecture.md is a placeholder.
CITATION = re.compile(r"\btests/(?P<file>[a-z0-9_*]+(?:/[a-z0-9_*]+)*\.py)(?:::(?P<name>[A-Za-z_*][A-Za-z0-9_*]*))?")
DEFINED = re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
SOURCES = ("kvckpt", "integrations", "reference", "tools", "benchmarks")


def cited_by() -> list[Path]:
    """The files whose citations are checked."""
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    return docs + sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))


def broken_citations(text: str, tests: Path) -> list[str]:
    """The citations in ``text`` that name a missing file under ``tests`` or a name it does not define."""
    broken = []
    for match in CITATION.finditer(text):
        paths = sorted(p for p in tests.glob(match["file"]) if p.is_file())
        if not paths:
            broken.append(f"{match[0]}: no such file")
        elif match["name"] and not any(fnmatchcase(name, match["name"]) for path in paths
                                       for name in DEFINED.findall(path.read_text())):
            broken.append(f"{match[0]}: {match['file']} defines no {match['name']}")
    return broken


@pytest.mark.parametrize("source", cited_by(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_exists(source: Path) -> None:
    assert broken_citations(source.read_text(), ROOT / "tests") == []


def test_the_check_fails_on_a_missing_file_and_a_missing_name(tmp_path: Path) -> None:
    (tmp_path / "test_here.py").write_text("def test_present():\n    pass\n")
    text = ("see tests/test_here.py, tests/test_here.py::test_present, tests/test_gone.py, "
            "tests/test_here.py::test_renamed, tests/test_here.py::test_pres*, tests/test_here.py::*_absent; "
            "tests/test_he*.py::test_present, tests/test_moved_*.py; tests/test_NAME_a.py is a placeholder")
    assert broken_citations(text, tmp_path) == [
        "tests/test_gone.py: no such file",
        "tests/test_here.py::test_renamed: test_here.py defines no test_renamed",
        "tests/test_here.py::*_absent: test_here.py defines no *_absent",
        "tests/test_moved_*.py: no such file",
    ]
