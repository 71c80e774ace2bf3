"""Running crafted hostile files (tests/_crafted.py) through every entry point, each in a fresh,
memory-limited process, and judging each outcome (tests/durability/test_crafted_files.py states the rules)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import _crafted

from kvckpt.storage.store import DEFAULT_MAP_SIZE

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


def judge(case: _crafted.Case | None, result: dict[str, Any]) -> str | None:
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
