"""The crafted hostile files of ``tests/_crafted.py`` in formats 1 and 2, which every entry point
still reads (each table in its own named database, ``tests/_old_format.py``): every case through
every entry point must fail closed exactly as its format-3 twin does.

A case that edits records is built on a format-3 base and then rewritten into the old layout (raw
LMDB calls, the hostile values moved as they are); a case that edits pages or replaces the file is
built on a base rewritten first. Every case's twin in format 3 is built the same way from the
same base.

* CI: ``restore`` and ``ReplayBuffer.open(readonly=True)`` + ``read_batch`` on every case of the
  three formats, one fresh process per format (so one crash fails the test): same outcome, same
  error type as format 3, never a generic exception.
* ``-m slow``: the whole campaign of ``tests/durability/test_crafted_files.py`` (a fresh process per file
  and entry point, every ``kvckpt`` verb through the console script, memory and terminal-escape
  checks) on formats 1 and 2, and the same exit status and message (paths and numbers aside) as
  format 3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _crafted
import lmdb
import pytest
from _old_format import rewrite_as_named_tables
from _paths import child_env

from kvckpt.storage.store import FORMAT_VERSION, MAX_DBS

#: The current format (one tree; format 4 since token progress, written exactly as format 3 when a
#: file holds no progress) first, then the two named-table formats every entry point still reads.
VERSIONS = (FORMAT_VERSION, 1, 2)


def as_old_format(path: str, version: int) -> None:
    """Rewrite the closed format-3 file ``path`` into format ``version``'s layout, then compact it
    (raw LMDB calls): no free page keeps a stale format-3 copy that a page edit could hit instead
    of the live tree."""
    rewrite_as_named_tables(path, version)
    env = lmdb.open(path, subdir=False, max_dbs=MAX_DBS, lock=False, readonly=True)
    try:
        env.copy(path + ".compact", compact=True)
    finally:
        env.close()
    os.replace(path + ".compact", path)


def build_bases(directory: str) -> dict[str, str]:
    """The two valid format-3 checkpoints every case of every format is made from."""
    from kvckpt.testing.campaigns.fuzz import build_base

    os.makedirs(directory, exist_ok=True)
    bases = {kind: os.path.join(directory, f"base-{kind}.kvckpt") for kind in ("small", "large")}
    for kind, path in bases.items():
        build_base(path, kind == "large")
    return bases


def build_all(directory: str, version: int, bases: dict[str, str]) -> dict[str, str]:
    """Every crafted case (and the two bases) in format ``version``, from the format-3 ``bases``;
    case name -> file."""
    os.makedirs(directory, exist_ok=True)
    old = {}
    for kind, path in bases.items():
        old[kind] = os.path.join(directory, f"base-{kind}-v{version}.kvckpt")
        shutil.copyfile(path, old[kind])
        if version != FORMAT_VERSION:
            as_old_format(old[kind], version)
    out = {f"base-{kind}": path for kind, path in old.items()}
    for case in _crafted.CASES:
        path = os.path.join(directory, f"{case.name}.kvckpt")
        if _crafted.edits_records(case):
            shutil.copyfile(bases[case.base], path)
            case.build(path)
            if version != FORMAT_VERSION:
                as_old_format(path, version)
        else:
            shutil.copyfile(old[case.base], path)
            case.build(path)
        out[case.name] = path
    return out


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    from kvckpt.storage.store import Store

    bases = build_bases(str(tmp_path_factory.mktemp("bases")))  # one store id, in every format
    made = {v: build_all(str(tmp_path_factory.mktemp(f"format{v}")), v, bases) for v in VERSIONS}
    for version, files in made.items():
        with Store(files["base-small"], readonly=True) as store:  # a valid file: safe to open unchecked
            assert store.info["version"] == version
    return made


#: Where formats 1 and 2 fail closed with another specific error than format 3, and why:
#: ``(version, case, entry) -> (error type, reason)``. Each is asserted as listed.
OTHER_ERROR = {
    (1, "state-5000-digit-int", "restore"): (
        "CorruptRecord", "restore upgrades a format-1 copy before it verifies it, and the upgrade's lease "
        "fencing reads meta/state: CorruptRecord naming meta/state, not VerificationFailed"),
}


def _in_process(files: dict[str, str], work: str) -> dict[tuple[str, str], dict[str, Any]]:
    """``restore`` and ``readonly`` on every file, all in one fresh process."""
    cmd = [sys.executable, __file__, work, *(f"{name}={path}" for name, path in files.items())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=child_env())
    assert done.returncode == 0, f"the reader process died ({done.returncode}): {done.stderr[-3000:]}"
    return {(d["name"], d["entry"]): d for d in map(json.loads, done.stdout.splitlines())}


def test_restore_and_readonly_fail_closed_in_formats_1_and_2_exactly_as_in_format_3(crafted, tmp_path):
    with ThreadPoolExecutor(2) as pool:
        found = dict(zip(VERSIONS, pool.map(lambda v: _in_process(crafted[v], str(tmp_path / f"v{v}")), VERSIONS),
                         strict=True))
    cases = {c.name: c for c in _crafted.CASES}
    assert set(found[FORMAT_VERSION]) == {(n, e) for n in crafted[FORMAT_VERSION] for e in ("restore", "readonly")}
    differ = []
    for (name, entry), twin in sorted(found[FORMAT_VERSION].items()):
        for version in (1, 2):
            got = found[version][(name, entry)]
            want = twin["outcome"], OTHER_ERROR.get((version, name, entry), (twin.get("type"),))[0]
            if got.get("generic") or (got["outcome"], got.get("type")) != want:
                differ.append(f"format {version} {name} / {entry}: {got['outcome']} {got.get('type')} "
                              f"{got.get('message', '')[:200]!r}; format 3: {twin['outcome']} {twin.get('type')}")
        must = name.startswith("base-") or entry in cases[name].must_refuse
        if must and twin["outcome"] != ("ok" if name.startswith("base-") else "error"):
            differ.append(f"format 3 {name} / {entry}: {twin['outcome']} {twin.get('message', '')[:200]!r}")
    refused = sum(d["outcome"] == "error" for v in (1, 2) for (n, _), d in found[v].items() if n in cases)
    print(f"\nformats 1 and 2: {len(cases)} crafted cases + 2 bases x restore/readonly: "
          f"{refused} refusals, each as format 3's but the {len(OTHER_ERROR)} listed; differences {len(differ)}")
    assert not differ, "\n".join(differ)


def _said(result: dict[str, Any], paths: dict[str, str]) -> str:
    """What an entry point said, with the files' paths and every number masked (the rewritten
    files differ in size and page numbers from their format-3 twins), and a named database of
    formats 1 and 2 named as format 3's main one."""
    text = result.get("type", "") + " " + result.get("message", "") + result["stderr"] + result["stdout"]
    text = re.sub(r"\S*/(base-\w+|[\w.*-]+)\.kvckpt", r"<\1>", text)
    for name in paths:
        text = text.replace(f"<{name}>", "<file>")
    text = re.sub(r"\b[0-9a-f]{8}(?=\.partial)", "<random>", text)  # restore's private copy
    # lmdb.verify names the database a damaged page is in: formats 1 and 2 keep each table in a
    # named database ("main/rows DB"), format 3 has only the main one ("main DB"). The same
    # damage, named by the layout's own database: equal, the rest of the message compared.
    text = re.sub(r"\bmain/\w+ DB\b", "main DB", text)
    text = re.sub(r"[+-]?\d[\d,]*", "#", text)  # sizes, page numbers, times, the format version
    return re.sub(r"\s+", " ", text)[-600:]  # columns aligned to the numbers' widths


@pytest.mark.slow
def test_every_crafted_file_in_formats_1_and_2_at_every_entry_point_fails_closed_as_format_3(crafted, tmp_path):
    """The whole campaign of ``tests/durability/test_crafted_files.py``, each file in every format."""
    from _crafted_runs import ENTRIES, judge, run_cli, run_in_process_entries

    cases = {c.name: c for c in _crafted.CASES}
    jobs = [(v, name, entry) for v in VERSIONS for name in crafted[v] for entry in ("python", *ENTRIES[2:])]

    def job(item: tuple[int, str, str]) -> list[tuple[int, str, dict[str, Any]]]:
        version, name, entry = item
        files = crafted[version]
        work = str(tmp_path / f"v{version}" / name / entry.replace(" ", "_"))
        if entry == "python":
            return [(version, name, r) for r in run_in_process_entries(files[name], work)]
        large = name == "base-large" or (name in cases and cases[name].base == "large")
        return [(version, name, run_cli(entry, files[name], files["base-large" if large else "base-small"], work))]

    with ThreadPoolExecutor(2) as pool:
        results = {(v, n, r["entry"]): r for batch in pool.map(job, jobs) for v, n, r in batch}
    violations = []
    for (version, name, entry), result in sorted(results.items()):
        why = judge(cases.get(name), result)
        if why:
            violations.append(f"format {version} {name} / {entry}: {why}")
        twin = results[(FORMAT_VERSION, name, entry)]
        if version == FORMAT_VERSION:
            continue
        other = OTHER_ERROR.get((version, name, entry))
        if other is not None and entry in ("restore", "readonly"):
            same = result["verdict"] == twin["verdict"] and result.get("type") == other[0]
        else:
            same = (result["verdict"], result["status"], _said(result, crafted[version])) == \
                (twin["verdict"], twin["status"], _said(twin, crafted[FORMAT_VERSION]))
        if not same:
            violations.append(f"format {version} {name} / {entry}: {result['verdict']} (exit {result['status']}) "
                              f"{_said(result, crafted[version])[-300:]!r}; format 3: {twin['verdict']} "
                              f"(exit {twin['status']}) {_said(twin, crafted[FORMAT_VERSION])[-300:]!r}")
    print(f"\n{len(results)} runs ({len(cases)} crafted cases + 2 bases x {len(ENTRIES)} entry points x formats "
          f"{VERSIONS}); violations {len(violations)}")
    assert not violations, "\n".join(violations)


if __name__ == "__main__":
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        work = os.path.join(sys.argv[1], name)
        os.makedirs(work, exist_ok=True)
        for entry in ("restore", "readonly"):
            print(json.dumps({"name": name, "entry": entry, **_crafted.run_entry(entry, path, work)}), flush=True)
