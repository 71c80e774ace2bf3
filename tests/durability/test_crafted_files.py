"""Crafted hostile files (tests/_crafted.py) fed to every entry point that reads a file kvckpt did
not just write: ``restore()``, ``ReplayBuffer.open(readonly=True)`` + ``read_batch``, and each
``kvckpt`` verb through the real console script.

Each run is a fresh process under an address-space limit (``RLIMIT_AS``); the test asserts, for
every file x entry point: no signal death, no generic exception (a traceback, or an exception that
is not a specific kvckpt error), bounded memory (peak RSS), no raw terminal escape in any output,
and no wrong data: every entry point a case names in ``must_refuse`` (those that read the hostile
record) refuses it, and every entry point accepts the two valid bases.
It prints the totals docs/reliability.md quotes (``pytest -s``).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _crafted
import pytest
from _crafted_runs import AS_LIMIT, ENTRIES, RSS_LIMIT, judge, run_cli, run_in_process_entries

from kvckpt.testing.campaigns.workload import GROUP_SIZE


@pytest.fixture(scope="module")
def results(crafted: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, dict[str, Any]]]:
    """Every crafted file and both bases through every entry point: (file name, result) pairs."""
    tmp_path = tmp_path_factory.mktemp("runs")
    cases = {c.name: c for c in _crafted.CASES}
    names = [*cases, "base-small", "base-large"]
    jobs: list[tuple[str, str]] = [(name, entry) for name in names for entry in ("python", *ENTRIES[2:])]

    def job(item: tuple[str, str]) -> list[tuple[str, dict[str, Any]]]:
        name, entry = item
        work = str(tmp_path / name / entry.replace(" ", "_"))
        if entry == "python":
            return [(name, r) for r in run_in_process_entries(crafted[name], work)]
        large = name == "base-large" or (name in cases and cases[name].base == "large")
        return [(name, run_cli(entry, crafted[name], crafted["base-large" if large else "base-small"], work))]

    with ThreadPoolExecutor(2) as pool:
        return [r for batch in pool.map(job, jobs) for r in batch]


def test_every_crafted_file_at_every_entry_point_fails_closed(results: list[tuple[str, dict[str, Any]]]) -> None:
    cases = {c.name: c for c in _crafted.CASES}
    violations, verdicts, peak = [], Counter(), 0
    for name, result in results:
        verdicts[result["verdict"]] += 1
        peak = max(peak, result["rss"])
        why = judge(cases.get(name), result)
        if why:
            violations.append(f"{name} / {result['entry']}: {why} (exit {result['status']}; "
                              f"{result.get('type', '')} {result.get('message', '')[:200]} {result['stderr'][-300:]})")
    hostile = [r for n, r in results if n in cases]
    print(f"\ncrafted files: {len(cases)} hostile + 2 bases x {len(ENTRIES)} entry points = {len(results)} runs; "
          f"hostile: {sum(r['verdict'] == 'refused' for r in hostile)} refused with a specific error, "
          f"{sum(r['verdict'] == 'ok' for r in hostile)} accepted where allowed; crashes {verdicts['crash']}, "
          f"generic errors {verdicts['generic']}, violations {len(violations)}; peak RSS {peak / 2**20:.0f} MiB "
          f"(limit {RSS_LIMIT >> 20} MiB, address space {AS_LIMIT >> 30} GiB)")
    for name, result in results:
        if name in cases:
            shown = result.get("type") or (result["stderr"].strip().splitlines() or [""])[-1][:150]
            print(f"  {name:32} {result['entry']:14} {result['verdict']:8} {result.get('at') or '':5} {shown}")
    print("\n".join(violations))
    assert violations == []


def test_verify_agrees_with_restore_and_reads_on_every_crafted_file(results: list[tuple[str, dict[str, Any]]]) -> None:
    """An operator verifies a checkpoint, then restores it and trains on it:

    * whatever ``restore()`` refuses, the default ``kvckpt verify`` refuses too;
    * whatever ``restore()`` or a later ``read_batch`` refuses, ``verify --deep`` refuses, naming
      the group whose read failed; a file ``verify --deep`` refuses is never restored and read
      without an error (and the default verify refuses nothing a restore and its reads accept);
    * a group whose rows fail to read never stops the others: every other group reads, its rows
      exactly as many as the same groups give in the undamaged base.
    """
    by = {(name, r["entry"]): r for name, r in results}
    bases = {c.name: c.base for c in _crafted.CASES} | {"base-small": "small", "base-large": "large"}
    disagreements = []
    for name, base in bases.items():
        restored, shallow, deep = by[name, "restore"], by[name, "verify"], by[name, "verify --deep"]
        said = deep["stdout"]
        problems = []
        if restored.get("at") == "open" and shallow["verdict"] != "refused":
            problems.append("restore() refused it, the default verify did not")
        if restored["verdict"] == "refused" and deep["verdict"] != "refused":
            problems.append(f"restore/read refused it ({restored.get('at')}), verify --deep did not")
        if "refused" in (deep["verdict"], shallow["verdict"]) and restored["verdict"] == "ok":
            problems.append("verify refused it, restore() and every read accepted it")
        for gid in restored.get("failed_groups", []):
            if gid not in said:
                problems.append(f"read_batch of {gid} failed, verify --deep does not name it: {said[-300:]}")
        if restored.get("at") == "read":
            whole = by[f"base-{base}", "restore"]["rows"]
            if restored["rows"] != whole - GROUP_SIZE * len(restored["failed_groups"]):
                problems.append(f"the other groups gave {restored['rows']} rows, the base {whole} "
                                f"less {len(restored['failed_groups'])} groups of {GROUP_SIZE}")
        disagreements += [f"{name}: {p}" for p in problems]
    assert disagreements == []


def test_every_restore_refusal_names_the_file_passed_not_the_private_copy(
        results: list[tuple[str, dict[str, Any]]], crafted: dict[str, str]) -> None:
    """restore() checks and opens a private ``live.kv.XXXXXXXX.partial`` copy, deleted when it
    refuses: its errors name the checkpoint file the caller passed."""
    refused = [(name, r["message"]) for name, r in results if r["entry"] == "restore" and r.get("at") == "open"]
    assert [(name, message) for name, message in refused if ".partial" in message] == []
    assert {"foreign-lmdb", "overflow-header-pages", "state-durable-object"} <= {name for name, _ in refused}
    for name, message in refused:
        if name in ("foreign-lmdb", "overflow-header-pages"):  # refused by the open and by the structure check
            assert repr(crafted[name]) in message, message
