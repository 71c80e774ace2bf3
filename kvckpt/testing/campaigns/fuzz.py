"""Corruption fuzzing (:func:`run_fuzz_campaign`, ``python -m kvckpt.testing.campaigns.campaign fuzz --cases N``).

Valid checkpoint files are damaged (bit flips in meta pages, page headers and data, bursts,
truncation, zeroed, swapped and duplicated pages, appended garbage, foreign LMDB files, random
bytes) and restored by long-lived worker processes. Every case must end in a
:class:`~kvckpt.errors.KvckptError` that says the file is damaged (:data:`DAMAGE_ERRORS`), or in a
restore whose live store is identical (every key, value and lookup) to the restore of the
undamaged file except for the rows of groups whose ``read_batch`` then refuses them (restore does
not read rows: they are checked where they are read; counted ``detected``, "at read"). A worker
that dies or hangs, any other exception, or different data is a violation.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import queue
import random
import select
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from kvckpt import (
    CorruptRecord,
    FormatError,
    InvariantViolation,
    KvckptError,
    Prompt,
    RecoveryError,
    ReplayBuffer,
    restore,
)
from kvckpt.storage import codec, keys
from kvckpt.storage.layout import ONE_TREE_TABLES
from kvckpt.storage.store import TABLES, Store
from kvckpt.tables.access import Tables
from kvckpt.tables.digest import row_digest
from kvckpt.testing.campaigns.harness import CampaignRun, Findings
from kvckpt.testing.campaigns.workload import GROUP_SIZE, GROUPS_PER_STEP, SAMPLERS, make_row, workload_config

#: Damage kinds and their weights in a fuzz campaign.
DAMAGE = {"flip": 4, "flip-meta": 2, "flip-header": 3, "flip-data": 3, "burst": 2, "truncate": 2, "zero-page": 2,
          "swap-pages": 1, "dup-page": 1, "append": 1, "foreign": 1, "random": 1, "random-body": 1}
_BASES = ("small", "large")


@dataclass
class FuzzResult(Findings):
    """What a fuzz campaign found: outcomes per damage kind, the errors raised, and violations."""

    cases: int = 0
    detected: int = 0
    harmless: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, case: dict[str, Any], outcome: str, detail: str) -> None:
        """Record one case's outcome (``detected``, ``harmless`` or ``violation``)."""
        self.cases += 1
        counts = self.by_kind.setdefault(case["kind"], {})
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "detected":
            self.detected += 1
            self.errors[detail] = self.errors.get(detail, 0) + 1
        elif outcome == "harmless":
            self.harmless += 1
        else:
            self.violations.append(f"case {case}: {detail}")

    def summary(self) -> str:
        """The one-line summary the CLI prints."""
        errors = ", ".join(f"{name} {count}" for name, count in sorted(self.errors.items(), key=lambda x: -x[1]))
        return (f"fuzz: cases {self.cases}, corruptions detected {self.detected} ({errors}), harmless "
                f"{self.harmless} (restored identical data), violations found {len(self.violations)}, "
                f"{self.seconds:.0f}s")


def build_base(path: str, large: bool) -> None:
    """Write a valid checkpoint file holding every kind of record: ready, claimed-then-consumed
    (rows dropped by later checkpoints), evicted and aborted groups, partial siblings in the ledger,
    a shortfall and a dataloader state. ``large`` adds branch pages and overflow (multi-page) rows."""
    live = path + ".live"
    sampler = {"name": "windowed", "max_staleness_versions": 1} if large else SAMPLERS[0]
    buf = ReplayBuffer.create(live, workload_config(sampler, capacity=64))
    tokens = 900 if large else 16
    try:
        cursor = 0
        for step in range(24 if large else 6):
            leases = buf.admit([Prompt(cursor + j) for j in range(GROUPS_PER_STEP + 1)],
                               dataloader_state=str(cursor + 3).encode())
            cursor += 3
            buf.commit_group(leases[0], [make_row(leases[0].group_id, i, tokens) for i in range(GROUP_SIZE)])
            for i in range(GROUP_SIZE - (step % 2) * 2):
                buf.commit_sample(leases[1], i, make_row(leases[1].group_id, i, tokens))
            if step % 3 == 2:
                buf.abort(leases[2].group_id, "fuzz base")
            buf.select(1, GROUPS_PER_STEP)
            buf.finish_step()
            buf.evict()
            if step % 4 == 3:
                buf.checkpoint(f"{path}.{step}", {"step": step}, background=False).wait()
        buf.checkpoint(path, {"base": "large" if large else "small"}, background=False).wait()
    finally:
        buf.close()
    for leftover in glob.glob(f"{path}.*"):
        os.unlink(leftover)


def build_foreign(directory: str) -> list[str]:
    """LMDB files kvckpt must refuse: another application's tables, kvckpt's table names without a
    kvckpt format record, and a kvckpt store of an unknown format version."""
    paths = []
    kvckpt_tables = tuple(t.encode() for t in TABLES)
    for name, tables in (("other-app.mdb", (b"users", b"orders")), ("same-tables.mdb", kvckpt_tables)):
        path = os.path.join(directory, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a restarted worker rebuilds them
        env = lmdb.open(path, subdir=False, max_dbs=8, map_size=1 << 24, lock=False)
        with env.begin(write=True) as txn:
            for table in tables:
                db = env.open_db(table, txn=txn)
                for i in range(50):
                    txn.put(f"{table.decode()}-{i}".encode(), os.urandom(40 + i * 30), db=db)
        env.close()
        paths.append(path)
    path = os.path.join(directory, "future-format.mdb")
    for leftover in (path, path + "-lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    with Store(path, create=True) as store:
        store.write(lambda t: t.put_json("meta", b"format", {**store.info, "version": 99}))
    paths.append(path)
    return paths


def damage(data: bytes, kind: str, rng: random.Random, foreign: list[str]) -> bytes:
    """Return ``data`` (an LMDB file) damaged the way ``kind`` names (see :data:`DAMAGE`)."""
    psize = struct.unpack_from("<I", data, 40)[0] if len(data) >= 44 else 4096
    psize = psize if psize in (1024, 2048, 4096, 8192, 16384, 32768, 65536) else 4096
    pages = max(len(data) // psize, 3)
    out = bytearray(data)

    def flip(lo: int, hi: int, count: int) -> None:
        for _ in range(count):
            pos = rng.randrange(lo, min(hi, len(out)))
            out[pos] ^= 1 << rng.randrange(8)

    def page(lo: int = 2) -> int:
        return rng.randrange(lo, pages)

    if kind == "flip":
        flip(0, len(out), rng.choice((1, 1, 1, 2, 3, 8)))
    elif kind == "flip-meta":
        flip(0, 2 * psize, rng.choice((1, 1, 2)))
    elif kind == "flip-header":
        p = page()
        flip(p * psize, p * psize + 64, 1)
    elif kind == "flip-data":
        flip(2 * psize, len(out), rng.choice((1, 1, 2, 4)))
    elif kind == "burst":
        start = rng.randrange(len(out))
        out[start:start + rng.randint(1, 64)] = rng.randbytes(rng.randint(1, 64))
    elif kind == "truncate":
        del out[rng.randrange(len(out)):]
    elif kind == "zero-page":
        p = page(0)
        out[p * psize:(p + 1) * psize] = bytes(psize)
    elif kind in ("swap-pages", "dup-page"):
        a, b = page(), page()
        pa, pb = bytes(out[a * psize:(a + 1) * psize]), bytes(out[b * psize:(b + 1) * psize])
        out[b * psize:(b + 1) * psize] = pa
        if kind == "swap-pages":
            out[a * psize:(a + 1) * psize] = pb
    elif kind == "append":
        out += rng.randbytes(rng.randint(1, 3 * psize))
    elif kind == "foreign":
        with open(rng.choice(foreign), "rb") as f:
            out = bytearray(f.read())
    elif kind == "random":
        out = bytearray(rng.randbytes(rng.choice((0, 100, psize, len(data)))))
    elif kind == "random-body":
        out[2 * psize:] = rng.randbytes(len(out) - 2 * psize)
    else:
        raise ValueError(f"unknown damage kind {kind!r}")
    return bytes(out)


def dump(buf: ReplayBuffer, plan: Any) -> dict[str, str] | str:
    """What a restore hands back, as ``{record: digest}``: every key and value of every table
    (``"plan"``: the redispatch plan and its states), or a sentence when a key that iteration finds
    is missed by a lookup."""
    out = {}
    with buf.store.reader() as txn:
        for table in ONE_TREE_TABLES:
            for key, value in txn.iter_prefix(table, b""):
                if not txn.has(table, key):
                    return f"lookup of {table}/{key!r} misses a key iteration finds"
                value = _without_timeline(table, key, value)
                out[f"{table}/{key.hex()}"] = hashlib.sha256(value).hexdigest()
    plan_doc = {k: v for k, v in plan.report().items() if not k.endswith("_seconds") and k != "timeline"}
    leases = [{k: v for k, v in lease.to_dict().items() if k != "timeline"} for lease in plan.leases]
    doc = [plan_doc, leases, plan.trainer_state, (plan.dataloader_state or b"").hex()]
    out["plan"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return out


def refused_reads(buf: ReplayBuffer) -> tuple[set[str], str | None]:
    """The groups a trainer's reads would refuse (rows are checked where they are read), and the
    name of the first error: every group with rows whose ``read_batch`` raises a
    :data:`DAMAGE_ERRORS` error or :class:`~kvckpt.errors.InvariantViolation`, and every ledger
    entry whose stored siblings differ from the digests it recorded (the group it completes into
    carries a digest built from those, so its first ``read_batch`` refuses it)."""
    refused, first = set(), None
    for group in buf.groups():
        if group.rows_stored and group.state not in ("evicted", "aborted"):
            try:
                buf.read_batch([group.group_id], layout="list")
            except (*DAMAGE_ERRORS, InvariantViolation) as exc:
                refused.add(group.group_id)
                first = first or type(exc).__name__
    with buf.store.reader() as txn:
        for entry in Tables(txn).entries():
            stored = {str(i): txn.get("rows", keys.row_key(entry.group_id, i)) for i in entry.siblings}
            if any(v is None or row_digest(v) != entry.digests.get(i) for i, v in stored.items()):
                refused.add(entry.group_id)
                first = first or "CorruptRecord"
    return refused, first


def differs_only_in(got: dict[str, str], reference: dict[str, str], groups: set[str]) -> bool:
    """Whether ``got`` equals ``reference`` except for rows of ``groups`` (as :func:`dump` keys them)."""
    prefixes = tuple(f"rows/{gid.encode().hex()}00" for gid in groups)
    return {k: v for k, v in got.items() if not k.startswith(prefixes)} == \
        {k: v for k, v in reference.items() if not k.startswith(prefixes)} if prefixes else got == reference


def _without_timeline(table: str, key: bytes, value: bytes) -> bytes:
    """A record as :func:`dump` compares it: every restore starts a fresh random timeline (by design,
    for fencing), so the state's and the ledger entries' ``timeline`` is left out; all else is kept."""
    if table == "ledger" or (table == "meta" and key == b"state"):
        doc = codec.decode_meta(value)
        doc.pop("timeline", None)
        return json.dumps(doc, sort_keys=True).encode()
    return value


#: The errors that say "this file is damaged" (a generic KvckptError or a BadArgument about the
#: temporary copy does not: a fuzz case ending in one is a violation).
DAMAGE_ERRORS = (FormatError, CorruptRecord, RecoveryError)


def fuzz_worker(directory: str, trusted: bool) -> None:
    """Serve fuzz cases read as JSON lines on stdin; answer one JSON line each on stdout."""
    bases, foreign, live = {}, build_foreign(directory), os.path.join(directory, "live.kv")
    for name in _BASES:
        path = os.path.join(directory, f"base-{name}.kvckpt")
        with open(path, "rb") as f:
            data = f.read()
        buf, plan = restore(path, live, overwrite=True)
        try:
            bases[name] = (data, dump(buf, plan))
        finally:
            buf.close()
    case_path = os.path.join(directory, "case.kvckpt")
    for line in sys.stdin:
        case = json.loads(line)
        data, reference = bases[case["base"]]
        with open(case_path, "wb") as f:
            f.write(damage(data, case["kind"], random.Random(case["seed"]), foreign))
        try:
            buf, plan = restore(case_path, live, overwrite=True, trusted=trusted)
            try:
                got = dump(buf, plan)
                refused, error = refused_reads(buf) if got != reference else (set(), None)
            finally:
                buf.close()
            if got == reference:
                outcome, detail = "harmless", ""
            elif isinstance(got, dict) and refused and differs_only_in(got, reference, refused):
                outcome, detail = "detected", f"{error} (at read)"
            else:
                outcome, detail = "violation", f"restored different data: {str(got)[:300]}"
        except DAMAGE_ERRORS as exc:
            outcome, detail = "detected", type(exc).__name__
        except KvckptError as exc:
            outcome, detail = "violation", f"{type(exc).__name__} does not say the file is damaged: {exc}"
        except Exception as exc:
            outcome, detail = "violation", f"{type(exc).__name__} escaped: {exc}"
        print(json.dumps({"outcome": outcome, "detail": detail}), flush=True)


class _Worker:
    """A long-lived fuzz worker process; restarted after it dies or hangs."""

    def __init__(self, directory: str, trusted: bool) -> None:
        self.directory, self.trusted, self.proc = directory, trusted, None

    def run(self, case: dict[str, Any], timeout: float) -> tuple[str, str]:
        if self.proc is None:
            cmd = [sys.executable, "-m", "kvckpt.testing.campaigns.campaign", "fuzz-worker", self.directory] + \
                  (["--trusted"] if self.trusted else [])
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            self.proc.stdin.write((json.dumps(case) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if line:
            doc = json.loads(line)
            return doc["outcome"], doc["detail"]
        self.stop()
        return "violation", ("the worker died (signal or exit)" if ready else f"hung for {timeout}s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self.proc = None


def fuzz_cases(count: int, seed: int) -> list[dict[str, Any]]:
    """The reproducible list of cases a campaign runs: base file, damage kind, damage seed."""
    rng = random.Random(seed)
    kinds, weights = list(DAMAGE), list(DAMAGE.values())
    return [{"id": i, "base": rng.choice(_BASES), "kind": rng.choices(kinds, weights)[0],
             "seed": rng.randrange(1 << 32)} for i in range(count)]


def run_fuzz_campaign(cases: int, *, seed: int = 0, workers: int = 2, directory: str | None = None,
                      trusted: bool = False, timeout: float = 60.0, minutes: float | None = None,
                      progress: Callable[[FuzzResult], None] | None = None) -> FuzzResult:
    """Damage valid checkpoints ``cases`` times and restore each in a worker process.

    Args:
        cases: number of damaged files.
        seed: makes the cases reproducible (:func:`fuzz_cases`).
        workers: long-lived worker processes. Defaults to 2.
        directory: scratch space (a temporary directory, removed afterwards, by default).
        trusted: restore with ``trusted=True`` (no structure pass before liblmdb maps the copy; the
            tree proof inside recovery) to measure what that costs; such a campaign is expected to
            report violations (``docs/reliability.md``).
        timeout: seconds one case may take before its worker counts as hung.
        minutes: start no case after this many minutes (``result.cases`` says how many ran).
        progress: called after every case with the running result.
    """
    result = FuzzResult()
    todo: queue.Queue[dict[str, Any]] = queue.Queue()
    for case in fuzz_cases(cases, seed):
        todo.put(case)
    lock = threading.Lock()
    with CampaignRun(result, directory, "kvckpt-fuzz-", minutes=minutes, progress=progress) as run:

        def serve(k: int) -> None:
            worker = _Worker(os.path.join(run.root, f"worker-{k}"), trusted)
            os.makedirs(worker.directory, exist_ok=True)
            for name in _BASES:
                shutil.copyfile(os.path.join(run.root, f"base-{name}.kvckpt"),
                                os.path.join(worker.directory, f"base-{name}.kvckpt"))
            try:
                while not run.out_of_time():
                    try:
                        case = todo.get_nowait()
                    except queue.Empty:
                        return
                    outcome, detail = worker.run(case, timeout)
                    with lock:
                        result.add(case, outcome, detail)
                        run.tick()
            finally:
                worker.stop()

        for name in _BASES:
            build_base(os.path.join(run.root, f"base-{name}.kvckpt"), large=name == "large")
        threads = [threading.Thread(target=serve, args=(k,)) for k in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return result
