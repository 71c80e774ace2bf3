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

import json
import os
import resource
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _crafted
import pytest

from kvckpt.storage.store import DEFAULT_MAP_SIZE
from kvckpt.testing.workload import GROUP_SIZE

#: Address space each reader may reserve (torch alone maps about 3 GiB of it); ``restore`` also
#: maps the writable live store it opens (64 GiB of address space, untouched).
AS_LIMIT = 6 << 30
#: Peak resident memory a reader may reach on any of these files (the bases need about 400 MiB).
RSS_LIMIT = 1 << 30
KVCKPT = os.path.join(os.path.dirname(sys.executable), "kvckpt")
ENTRIES = _crafted.ENTRIES
IN_PROCESS = ("restore", "readonly")


def _limit(address_space: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


#: Runs ``argv[2:]`` as its child and writes that child's peak RSS (bytes) to the file ``argv[1]``,
#: then exits as the child did (re-raising the signal that killed it). Linux carries a process's
#: peak RSS across ``fork`` + ``exec`` from the process that forked it, so a reader forked straight
#: from pytest reports at least pytest's own peak (which grows with every test run before this
#: one); a grandchild forked from this small interpreter reports only its own.
_MEASURE = ("import os, signal, subprocess, sys; child = subprocess.Popen(sys.argv[2:]); "
            "_, status, usage = os.wait4(child.pid, 0); open(sys.argv[1], 'w').write(str(usage.ru_maxrss * 1024)); "
            "code = os.waitstatus_to_exitcode(status); "
            "code < 0 and (signal.signal(-code, signal.SIG_DFL), os.kill(os.getpid(), -code)); sys.exit(code)")


def _run(cmd: list[str], cwd: str, address_space: int) -> tuple[int, str, str, int]:
    """Run ``cmd`` under the limit; returns (status, stdout, stderr, peak RSS bytes) of that command
    alone (measured by :data:`_MEASURE`, not inherited from this process)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    rss_file = os.path.join(cwd, "peak-rss")
    with open(os.path.join(cwd, "stdout"), "w+b") as out, open(os.path.join(cwd, "stderr"), "w+b") as err:
        proc = subprocess.Popen([sys.executable, "-c", _MEASURE, rss_file, *cmd], cwd=cwd, env=env, stdout=out,
                                stderr=err, preexec_fn=_limit(address_space))
        proc.wait()
        out.seek(0)
        err.seek(0)
        with open(rss_file) as f:
            rss = int(f.read())
        return proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), rss


def run_in_process_entries(path: str, work: str) -> list[dict[str, Any]]:
    """restore and readonly on one file, in one fresh process; one result per entry point."""
    os.makedirs(work, exist_ok=True)
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_crafted.py"), path, work]
    status, out, err, rss = _run(cmd, work, AS_LIMIT + DEFAULT_MAP_SIZE)
    docs = {d["entry"]: d for d in map(json.loads, out.strip().splitlines()) if d} if status == 0 else {}
    results = []
    for entry in IN_PROCESS:
        doc = docs.get(entry, {})
        result = {"entry": entry, "status": status, "rss": rss, "stdout": "", "stderr": err[-2000:], **doc}
        if status < 0:
            result["verdict"] = "crash"
        elif not doc or doc.get("generic"):
            result["verdict"] = "generic"
        else:
            result["verdict"] = "ok" if doc["outcome"] == "ok" else "refused"
        results.append(result)
    return results


def run_cli(entry: str, path: str, base: str, work: str) -> dict[str, Any]:
    """One ``kvckpt`` verb on one file through the console script; classify what happened."""
    os.makedirs(work, exist_ok=True)
    verb, *flags = entry.split()
    args = {"export": [path, os.path.join(work, "out.jsonl"), "--format", "jsonl"], "diff": [base, path],
            "compact": [path, os.path.join(work, "out.kv")]}.get(verb, [path])
    status, out, err, rss = _run([KVCKPT, verb, *flags, *args], work, AS_LIMIT)
    result: dict[str, Any] = {"entry": entry, "status": status, "rss": rss, "stdout": out[-3000:],
                              "stderr": err[-2000:]}
    if status < 0:
        result["verdict"] = "crash"
    elif "Traceback" in err or status not in (0, 1, 2):
        result["verdict"] = "generic"
    else:
        result["verdict"] = "ok" if status == 0 or (verb == "diff" and status == 1 and not err) else "refused"
    return result


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _crafted.build_all(str(tmp_path_factory.mktemp("crafted")))


def _judge(case: _crafted.Case | None, result: dict[str, Any]) -> str | None:
    """Why this result is a violation, or None."""
    entry, verdict = result["entry"], result["verdict"]
    if verdict in ("crash", "generic"):
        return verdict
    if result["rss"] > RSS_LIMIT:
        return f"memory ({result['rss'] >> 20} MiB)"
    if "\x1b" in result["stdout"] or "\x1b" in result["stderr"]:
        return "raw terminal escape in the output"
    if case is None:  # a base: every entry point accepts it
        return None if verdict == "ok" else f"refused a valid file: {result['stderr'][-300:]}"
    if verdict == "ok" and entry in case.must_refuse:
        return "wrong data: accepted a file it must refuse"
    if verdict == "refused" and entry not in IN_PROCESS:
        said = result["stderr"] + result["stdout"]
        if "kvckpt" not in said and case.name not in said:
            return f"the refusal names nothing: {said[-300:]}"
    if case.name == "sparse-tail-3GiB" and entry == "restore" and result.get("live_bytes", 0) > 1 << 20:
        return f"restore copied {result['live_bytes']} bytes of holes"
    return None


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
        why = _judge(cases.get(name), result)
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
