"""The built wheel ships every package, and nothing else: an editable install would hide a missing
one, and a stale ``build/`` directory would ship modules the source no longer has."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
from _paths import ROOT

#: Each source folder and where the build maps it in the package (pyproject's ``package-dir``).
MAPPED = (("kvckpt", "kvckpt"), ("integrations", "kvckpt/integrations"), ("reference", "kvckpt/reference"),
          ("tools", "kvckpt/tools"))


def _source_packages() -> set[str]:
    found = set()
    for top, prefix in MAPPED:
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(f"{prefix}/{init.parent.relative_to(ROOT / top).as_posix()}".rstrip("/.") + "/__init__.py")
    return found


def _source_modules() -> set[str]:
    found = set()
    for top, prefix in MAPPED:
        found |= {f"{prefix}/{path.relative_to(ROOT / top).as_posix()}" for path in (ROOT / top).rglob("*.py")}
    return found


def _clean_copy(dest: pathlib.Path) -> pathlib.Path:
    """The source tree as git sees it (tracked, plus untracked files it does not ignore), without
    ``build/`` or any other ignored output, so the wheel is built from exactly the source."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_wheel_contains_every_package_and_only_the_source(tmp_path: pathlib.Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout, to build from exactly the tracked source")
    source = _clean_copy(tmp_path / "src")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True)
    if build.returncode != 0 and "No module named" in build.stderr:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip()[-200:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    [wheel] = tmp_path.glob("kvckpt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert _source_packages() - names == set()
    shipped = {n for n in names if n.endswith(".py")}
    assert shipped == _source_modules(), (sorted(shipped - _source_modules()), sorted(_source_modules() - shipped))
