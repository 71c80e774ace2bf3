"""Fault campaigns: break kvckpt on purpose, many times, and check every promise after each break.

**Crash campaign** (:func:`run_crash_campaign`, ``python -m kvckpt.testing.campaign --kills N``). A child
process runs a mixed workload on a live store (it never imports torch; it is forked from a fork
server, itself a fresh interpreter that only imported this module, or with ``--exec`` started as a
fresh interpreter every time):
producer threads commit whole groups and single samples, a trainer loop admits, selects, finishes
steps, evicts, aborts and checkpoints in the background to numbered files. After each call
returns, the child appends the operation to an fsynced JSON-lines log: the log holds only
*acknowledged* operations. The parent SIGKILLs the child at a random moment, then, in its own
process:

1. verifies the live store (:func:`kvckpt.durability.verify.check`, ``deep=True``);
2. replays the log against it: every acknowledged admission is a group or a ledger entry with
   its prompt, every acknowledged commit is a committed group with the acknowledged digest (or,
   for a single sample, a recorded sibling), acknowledged evictions, aborts and finished steps
   stuck; the prompts held are exactly ``0 .. cursor-1``, each once; every stored row is
   byte-for-byte the row its producer generated;
3. checks every checkpoint file under a final name (:func:`kvckpt.durability.safe_open.verify_untrusted`)
   and restores the newest into a scratch path: it verifies, holds each prompt below its own
   cursor exactly once, and everything it holds as committed is committed in the live store with
   the same digest;
4. recovers the live store (:meth:`ReplayBuffer.recover`; sometimes the next child does it) and
   lets the next child resume the workload on it, so a campaign is a chain of crashes.

**Corruption fuzzing** (:func:`run_fuzz_campaign`, ``python -m kvckpt.testing.campaign fuzz --cases N``).
Valid checkpoint files are damaged (bit flips in meta pages, page headers and data, bursts,
truncation, zeroed, swapped and duplicated pages, appended garbage, foreign LMDB files, random
bytes) and restored by long-lived worker processes. Every case must end in a
:class:`~kvckpt.errors.KvckptError`, or in a restore whose live store is identical (every key,
value and lookup) to the restore of the undamaged file. A worker that dies or hangs, any other
exception, or different data is a violation.

Both return a result whose ``violations`` list is empty when every promise held, and print one
summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import multiprocessing
import os
import queue
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from kvckpt.buffer import BufferConfig, ReplayBuffer
from kvckpt.durability.checkpoint import keep_latest, restore
from kvckpt.durability.safe_open import verify_untrusted
from kvckpt.durability.verify import check
from kvckpt.errors import (
    CorruptRecord,
    DuplicateCommit,
    FormatError,
    GateTimeout,
    KvckptError,
    RecoveryError,
    UnknownGroup,
)
from kvckpt.storage import codec
from kvckpt.storage.store import TABLES, Store
from kvckpt.tables.records import ABORTED, CLAIMED, CONSUMED, EVICTED, READY, Prompt

# -- the workload ---------------------------------------------------------------------------------

SCHEMA = {"input_ids": ("int64", "token"), "logprobs": ("float32", "token"), "reward": ("float32", "row")}
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
CAPACITY = 8
SAMPLERS = (
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 1},
    {"name": "ready_first", "max_staleness_versions": 1},
)
COMMITTED = (READY, CLAIMED, CONSUMED, EVICTED)
CHECKPOINT_GLOB = "ckpt-*.kvckpt"
_CHILD_SECONDS = 60.0


def make_row(group_id: str, index: int, max_tokens: int = 16) -> dict[str, np.ndarray]:
    """The row a producer generates for ``group_id`` row ``index``: a pure function of both, so the
    checker can regenerate it and a regenerated sibling after a crash is byte-identical."""
    seed = int.from_bytes(hashlib.blake2b(f"{group_id}/{index}".encode(), digest_size=8).digest(), "big")
    rng = np.random.default_rng(seed)
    length = 3 + int(rng.integers(0, max_tokens))
    return {"input_ids": rng.integers(0, 50_000, length, dtype=np.int64),
            "logprobs": -rng.random(length, dtype=np.float32),
            "reward": np.float32(rng.random())}


def workload_config(sampler: dict[str, Any], capacity: int = CAPACITY) -> BufferConfig:
    """The buffer configuration the campaigns use (group size 4, 2 groups per step)."""
    return BufferConfig(group_size=GROUP_SIZE, schema=SCHEMA, sampler=sampler, max_buffered_rollouts=capacity,
                        groups_per_step=GROUPS_PER_STEP)


class OpLog:
    """An append-only JSON-lines log of acknowledged operations; each line is fsynced before
    :meth:`append` returns, so a logged operation survives the SIGKILL that follows it."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def append(self, **op: Any) -> None:
        """Write one operation as one line and fsync it."""
        line = (json.dumps(op, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
            os.fsync(self._fd)


def read_log(path: str) -> list[dict[str, Any]]:
    """The complete lines of an :class:`OpLog`; a torn last line (the kill hit mid-write) is cut
    off the file so the next child appends after the last complete operation."""
    if not os.path.exists(path):
        return []
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)
    return [json.loads(line) for line in data[:end].splitlines()]


class _Workload:
    """The child's trainer loop and producer threads over one open buffer."""

    def __init__(self, buf: ReplayBuffer, log: OpLog, ckdir: str, seed: int) -> None:
        self.buf, self.log, self.ckdir, self.seed = buf, log, ckdir, seed
        self.rng = random.Random(seed)
        self.work: queue.Queue[Any] = queue.Queue()

    def producer(self, k: int) -> None:
        rng = random.Random(self.seed * 1000 + k)
        try:
            while True:
                try:
                    lease = self.work.get(timeout=0.05)
                except queue.Empty:
                    continue
                with contextlib.suppress(UnknownGroup):  # the trainer aborted it meanwhile
                    self._generate(lease, rng)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)

    def _generate(self, lease: Any, rng: random.Random) -> None:
        gid = lease.group_id
        if rng.random() < 0.6:
            rows = {i: make_row(gid, i) for i in lease.missing}
            self._acknowledge(gid, None, self.buf.commit_group(lease, rows))
            if rng.random() < 0.1:  # the acknowledgement was "lost": the retry must write nothing
                with contextlib.suppress(UnknownGroup, DuplicateCommit):  # evicted / rows dropped since
                    if not self.buf.commit_group(lease, rows).replayed:
                        raise AssertionError(f"retried commit of {gid!r} was applied twice")
            return
        for i in lease.missing:
            time.sleep(rng.random() * 0.002)
            self._acknowledge(gid, i, self.buf.commit_sample(lease, i, make_row(gid, i)))

    def _acknowledge(self, gid: str, index: int | None, result: Any) -> None:
        digest = self.buf.group(gid).digest if result.ready else None
        self.log.append(op="commit", gid=gid, index=index, ready=result.ready, digest=digest)

    def trainer(self, deadline: float) -> None:
        buf, rng, gps = self.buf, self.rng, GROUPS_PER_STEP
        cursor = int(buf.dataloader_state() or b"0")
        numbers = [int(m.group(1)) for m in (re.match(r"ckpt-(\d+)", n) for n in os.listdir(self.ckdir)) if m]
        number = max(numbers, default=-1) + 1
        pending, idle = None, 0
        while time.monotonic() < deadline:
            if self.work.qsize() < 2 * gps and buf.admissible(gps):
                with contextlib.suppress(GateTimeout):
                    leases = buf.admit([Prompt(cursor + j) for j in range(gps)],
                                       dataloader_state=str(cursor + gps).encode(), timeout=0)
                    cursor += gps
                    self.log.append(op="admit", gids=[lease.group_id for lease in leases],
                                    idx=[lease.prompt_idx for lease in leases], cursor=cursor)
                    for lease in leases:
                        self.work.put(lease)
            selection = buf.select(1, gps)
            if selection:
                self.log.append(op="select", step=selection.step, gids=selection.group_ids)
            idle = 0 if selection else idle + 1
            if selection or idle > 40:
                self.log.append(op="finish", version=buf.finish_step())
                idle = 0
            if rng.random() < 0.3 and (gids := buf.evict()):
                self.log.append(op="evict", gids=gids)
            if rng.random() < 0.1:
                for gid in buf.abort_stale_inflight():
                    self.log.append(op="abort", gid=gid)
            if rng.random() < 0.03 and (entries := buf.ledger()):
                gid = rng.choice(entries).group_id
                with contextlib.suppress(UnknownGroup):  # committed meanwhile
                    buf.abort(gid, "campaign")
                    self.log.append(op="abort", gid=gid)
            if pending is not None and pending.done():
                try:
                    result = pending.wait(0)
                    self.log.append(op="ckpt", path=result.path, version=result.trainer_version)
                except KvckptError as exc:
                    self.log.append(op="violation", what=f"checkpoint failed: {exc}")
                pending = None
                keep_latest(self.ckdir, CHECKPOINT_GLOB, keep=3)
            if pending is None and rng.random() < 0.05:
                pending = buf.checkpoint(os.path.join(self.ckdir, f"ckpt-{number:06d}.kvckpt"), {"n": number})
                number += 1
            time.sleep(0.001)


def _child_main(run: str, seed: int, recover_first: bool, ready: Callable[[], None]) -> None:
    """The workload of one child on the chain directory ``run``; calls ``ready`` once it runs."""
    buf = ReplayBuffer.open(os.path.join(run, "live.kv"))
    log = OpLog(os.path.join(run, "ops.jsonl"))
    ckdir = os.path.join(run, "ckpt")
    if recover_first:
        plan = buf.recover()
        log.append(op="recovered", leases=[lease.group_id for lease in plan.leases])
    run_workload(buf, log, ckdir, seed, ready)


def run_workload(buf: ReplayBuffer, log: Any, ckdir: str, seed: int, ready: Callable[[], None]) -> None:
    """Redispatch ``buf``'s ledger, start three producers, call ``ready`` and run the trainer loop
    (checkpoints go to ``ckdir``), logging each acknowledged operation to ``log`` (anything with
    :meth:`OpLog.append`); exits the process when the loop ends (the parent kills it before)."""
    work = _Workload(buf, log, ckdir, seed)
    entries = buf.ledger()
    log.append(op="start", ledger=[e.group_id for e in entries])
    for entry in entries:
        work.work.put(entry.lease(buf.store.store_id))
    for k in range(3):
        threading.Thread(target=work.producer, args=(k,), daemon=True).start()
    ready()
    work.trainer(time.monotonic() + _CHILD_SECONDS)
    os._exit(0)  # producers are daemons mid-loop; the parent expected a kill, not this exit


def _forked_child(run: str, seed: int, recover_first: bool, ready: Any) -> None:
    """Entry of a child forked by the fork server: stderr to the chain's file, readiness on a pipe."""
    fd = os.open(os.path.join(run, "child.stderr"), os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    try:
        _child_main(run, seed, recover_first, lambda: ready.send(True))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


_FORK_SERVER: Any = None


def _fork_server() -> Any:
    """A multiprocessing fork-server context whose server (a fresh interpreter) preloads this module
    and never opens a store, so each child forks in milliseconds with no LMDB state inherited."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        _FORK_SERVER = multiprocessing.get_context("forkserver")
        _FORK_SERVER.set_forkserver_preload(["__main__", __name__, "mfusepy"])  # mfusepy: kvckpt.testing.powerfs
    return _FORK_SERVER


# -- the checker ----------------------------------------------------------------------------------


@dataclass
class CampaignResult:
    """What a crash campaign did and found; ``violations`` is empty when every promise held."""

    kills: int = 0
    operations_checked: int = 0
    checkpoints_verified: int = 0
    checkpoints_restored: int = 0
    recoveries: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    directory: str | None = None  #: the campaign's files, kept when given or when a violation was found

    def summary(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"crash campaign: kills {self.kills}, operations checked {self.operations_checked}, "
                f"checkpoints verified {self.checkpoints_verified} (restored {self.checkpoints_restored}), "
                f"recoveries {self.recoveries}, violations found {len(self.violations)}, {self.seconds:.0f}s")


@dataclass
class Holdings:
    """What a store holds, by group id: group records, ledger entries, its state and cursor."""

    groups: dict[str, Any]
    ledger: dict[str, Any]
    state: dict[str, Any]
    cursor: int


def holdings(buf: ReplayBuffer) -> Holdings:
    """Every group, ledger entry, the state and the dataloader cursor of ``buf`` (its prompts)."""
    return Holdings({g.group_id: g for g in buf.groups()}, {e.group_id: e for e in buf.ledger()}, buf.state(),
                     int(buf.dataloader_state() or b"0"))


def _check_buffer(buf: ReplayBuffer, where: str, bad: Callable[[str], None], seen: set[bytes],
                  deep: bool = True) -> Holdings:
    """Verify ``buf``, check exactly-once prompts and that every stored row is the row its producer
    generated (``seen`` holds digests of rows already compared: a stored row never changes)."""
    report = buf.store.read(lambda t: check(t, deep=deep))
    for problem in report.problems[:20]:
        bad(f"{where}: verifier: {problem}")
    snap = holdings(buf)
    held = sorted([g.prompt_idx for g in snap.groups.values()] + [e.prompt_idx for e in snap.ledger.values()])
    if held != list(range(snap.cursor)):
        bad(f"{where}: prompts held are not exactly 0..{snap.cursor - 1} once each "
            f"(missing {sorted(set(range(snap.cursor)) - set(held))[:10]}, "
            f"extra {[i for i in held if i >= snap.cursor][:10]}, {len(held) - len(set(held))} duplicated)")
    for key, value in buf.store.read(lambda t: list(t.iter_prefix("rows", b""))):
        digest = hashlib.blake2b(key + b"\0" + value, digest_size=16).digest()
        if digest in seen:
            continue
        seen.add(digest)
        gid, index = key[:-5].decode(), int.from_bytes(key[-4:], "big")
        record = codec.decode(value, f"rows/{gid}_g{index}")
        want = make_row(gid, index)
        if set(record.arrays) != set(want) or not all(np.array_equal(record.arrays[k], v) for k, v in want.items()):
            bad(f"{where}: row {gid}_g{index} is not the row its producer generated")
    return snap


def check_history(ops: list[dict[str, Any]], snap: Holdings) -> list[str]:
    """The acknowledged operations in ``ops`` (an :class:`OpLog`) that ``snap`` does not reflect,
    as violation messages (empty when the store kept every promise)."""
    found: list[str] = []
    bad = found.append
    selected: dict[int, list[str]] = {}
    for op in ops:
        kind = op["op"]
        if kind == "start":
            selected = {}  # a new child: claims of the previous one may have been returned by recovery
        elif kind == "admit":
            for gid, idx in zip(op["gids"], op["idx"], strict=True):
                rec = snap.groups.get(gid) or snap.ledger.get(gid)
                if rec is None or rec.prompt_idx != idx:
                    bad(f"admitted prompt {idx} ({gid}) is neither a group nor a ledger entry")
            if snap.cursor < op["cursor"]:
                bad(f"dataloader cursor {snap.cursor} is behind the acknowledged {op['cursor']}")
        elif kind == "commit":
            group, entry = snap.groups.get(op["gid"]), snap.ledger.get(op["gid"])
            if op["ready"]:
                if group is None or group.state not in COMMITTED or group.digest != op["digest"]:
                    bad(f"acknowledged commit of {op['gid']} (digest {op['digest']}) is not a committed group "
                        f"with that digest: {group}")
            elif not ((group is not None and group.state in (*COMMITTED, ABORTED))
                      or (entry is not None and op["index"] in entry.siblings)):
                bad(f"acknowledged sample {op['gid']}_g{op['index']} is lost")
        elif kind == "select":
            selected[op["step"]] = op["gids"]
            for gid in op["gids"]:
                if gid not in snap.groups or snap.groups[gid].state not in COMMITTED:
                    bad(f"selected group {gid} is not a committed group")
        elif kind == "finish":
            if snap.state["trainer_version"] < op["version"]:
                bad(f"trainer_version {snap.state['trainer_version']} is behind the acknowledged {op['version']}")
            for gid in selected.pop(op["version"] - 1, []):
                group = snap.groups.get(gid)
                if group is None or group.state != CONSUMED or group.consumed_step != op["version"] - 1:
                    bad(f"group {gid} trained in acknowledged step {op['version'] - 1} is not consumed by it: {group}")
        elif kind == "evict":
            for gid in op["gids"]:
                if gid not in snap.groups or snap.groups[gid].state != EVICTED:
                    bad(f"acknowledged eviction of {gid} did not stick")
        elif kind == "abort":
            if op["gid"] not in snap.groups or snap.groups[op["gid"]].state != ABORTED:
                bad(f"acknowledged abort of {op['gid']} did not stick")
        elif kind == "violation":
            bad(f"the workload reported: {op['what']}")
    return found


def _check_checkpoints(chain: _Chain, ops: list[dict[str, Any]], live: Holdings, result: CampaignResult,
                       bad: Callable[[str], None]) -> None:
    """Every file under a final name is a complete, valid checkpoint (each is checked once: it is
    immutable); the newest restores into a state consistent with the live store."""
    ckdir = os.path.join(chain.run, "ckpt")
    files = sorted(glob.glob(os.path.join(ckdir, CHECKPOINT_GLOB)))
    logged = [op["path"] for op in ops if op["op"] == "ckpt"]
    if logged and logged[-1] not in files:
        bad(f"acknowledged checkpoint {logged[-1]} is missing")
    for path in files[:-1]:
        if path not in chain.verified:
            report = verify_untrusted(path)
            chain.verified.add(path)
            result.checkpoints_verified += 1
            for problem in report.problems[:5]:
                bad(f"checkpoint {os.path.basename(path)}: {problem}")
    if files and files[-1] not in chain.verified:
        chain.verified.add(files[-1])
        buf, _ = restore(files[-1], os.path.join(chain.run, "scratch.kv"), overwrite=True)  # verifies it first
        try:
            snap = _check_buffer(buf, f"restored {os.path.basename(files[-1])}", bad, chain.rows_seen,
                                 deep=False)
        finally:
            buf.close()
        result.checkpoints_verified += 1
        result.checkpoints_restored += 1
        compare_checkpoint(snap, live, os.path.basename(files[-1]), bad)
    for partial in glob.glob(os.path.join(ckdir, "*.partial")):
        os.unlink(partial)  # a copy the kill interrupted; never under a final name


def compare_checkpoint(snap: Holdings, live: Holdings, name: str, bad: Callable[[str], None]) -> None:
    """Report (to ``bad``) what the restored checkpoint ``snap`` holds that the live store ``live``
    of the same run contradicts: a committed group not committed live with the same digest, a
    ledger entry unknown live, a trainer version ahead of the live one."""
    for gid, group in snap.groups.items():
        now = live.groups.get(gid)
        if group.state in COMMITTED and (now is None or now.state not in COMMITTED or now.digest != group.digest):
            bad(f"group {gid} committed in checkpoint {name} is not committed live")
    for gid in snap.ledger:
        if gid not in live.groups and gid not in live.ledger:
            bad(f"ledger entry {gid} of checkpoint {name} is unknown live")
    if snap.state["trainer_version"] > live.state["trainer_version"]:
        bad(f"checkpoint {name} is ahead of the live store's trainer version")


@dataclass
class _Chain:
    """One live store that successive children crash on."""

    run: str
    ops_counted: int = 0
    recovered: bool = True  # a fresh store needs no recovery
    verified: set[str] = field(default_factory=set)
    rows_seen: set[bytes] = field(default_factory=set)

    @property
    def store(self) -> str:
        return os.path.join(self.run, "live.kv")

    @classmethod
    def start(cls, run: str, sampler: dict[str, Any]) -> _Chain:
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(os.path.join(run, "ckpt"))
        ReplayBuffer.create(os.path.join(run, "live.kv"), workload_config(sampler)).close()
        return cls(run)


def _check_after_kill(chain: _Chain, result: CampaignResult, recover: bool, bad: Callable[[str], None]) -> None:
    ops = read_log(os.path.join(chain.run, "ops.jsonl"))
    buf = ReplayBuffer.open(chain.store)
    try:
        snap = _check_buffer(buf, "live store", bad, chain.rows_seen)
        for violation in check_history(ops, snap):
            bad(violation)
        result.operations_checked += len(ops) - chain.ops_counted
        chain.ops_counted = len(ops)
        _check_checkpoints(chain, ops, snap, result, bad)
        if recover:
            plan = buf.recover()
            result.recoveries += 1
            if {lease.group_id: lease.attempt for lease in plan.leases} != \
                    {gid: e.attempt + 1 for gid, e in snap.ledger.items()}:
                bad("recovery did not hand back every ledger entry exactly once with a bumped attempt")
            _check_buffer(buf, "recovered live store", bad, chain.rows_seen, deep=False)
        chain.recovered = recover
    finally:
        buf.close()


def _run_child(chain: _Chain, seed: int, rng: random.Random, max_delay: float, fresh: bool) -> tuple[int, str]:
    """Start a child on ``chain``, SIGKILL it after a random delay; return its exit status and stderr.

    The child recovers the store itself when the parent did not after the previous kill. ``fresh``
    starts it as ``python -m kvckpt.testing.campaign child`` (a new interpreter each time, about 0.4 s);
    otherwise the fork server forks it.
    """
    errpath = os.path.join(chain.run, "child.stderr")
    open(errpath, "wb").close()  # here, not in the child: a kill may land before the child runs a line
    if fresh:
        cmd = [sys.executable, "-m", "kvckpt.testing.campaign", "child", chain.run, "--seed", str(seed)]
        if not chain.recovered:
            cmd.append("--recover")
        with open(errpath, "ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        channel, pid = proc.stdout, proc.pid

        def wait_ready(timeout: float) -> None:
            if select.select([channel], [], [], timeout)[0]:
                channel.readline()

        def reap() -> int:
            return proc.wait()
    else:
        channel, sender = _fork_server().Pipe(duplex=False)
        child = _fork_server().Process(target=_forked_child, args=(chain.run, seed, not chain.recovered, sender))
        child.start()
        sender.close()
        pid = child.pid

        def wait_ready(timeout: float) -> None:
            channel.poll(timeout)

        def reap() -> int:
            child.join()
            return child.exitcode
    try:
        if rng.random() < 0.1:  # kill during start-up, open or recovery
            time.sleep(rng.random() * 0.2)
        else:
            wait_ready(30)
            time.sleep(rng.random() * max_delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        status = reap()
    finally:
        channel.close()
    with open(errpath, "rb") as f:
        return status, f.read().decode(errors="replace")[-2000:]


def run_crash_campaign(kills: int, *, seed: int = 0, directory: str | None = None, chain: int = 25,
                       max_delay: float = 0.5, fresh_interpreter: bool = False, minutes: float | None = None,
                       progress: Callable[[CampaignResult], None] | None = None) -> CampaignResult:
    """SIGKILL a live workload ``kills`` times and check every promise after each kill.

    Args:
        kills: number of kill cycles.
        seed: makes the kill times, the workload's choices and the sampler order reproducible
            (thread interleavings are not).
        directory: where the stores, logs and checkpoints go (a temporary directory, removed
            afterwards, by default).
        chain: kills on the same live store before starting a fresh one (the sampler rotates
            through all four built-ins per chain). Defaults to 25.
        max_delay: longest wait (seconds) between the child's readiness and its kill.
        fresh_interpreter: start every child as a new ``python`` process instead of forking it
            from a fork server (slower start, same workload). Defaults to False.
        minutes: start no kill cycle after this many minutes (``result.kills`` says how many ran).
        progress: called after every kill with the running result.
    """
    rng = random.Random(seed)
    result = CampaignResult()
    t0 = time.perf_counter()
    owned = directory is None
    root = tempfile.mkdtemp(prefix="kvckpt-campaign-") if owned else os.path.abspath(directory)
    current: _Chain | None = None
    clean = 0  # violations so far: a chain that added none is deleted when the campaign owns it
    try:
        for k in range(kills):
            if minutes is not None and time.perf_counter() - t0 > minutes * 60:
                break
            if k % chain == 0:
                if owned and current is not None and len(result.violations) == clean:
                    shutil.rmtree(current.run, ignore_errors=True)
                clean = len(result.violations)
                current = _Chain.start(os.path.join(root, f"chain-{k // chain:05d}"),
                                       SAMPLERS[(k // chain + seed) % len(SAMPLERS)])
            where = f"kill {k} ({os.path.basename(current.run)})"

            def bad(message: str, where: str = where) -> None:
                result.violations.append(f"{where}: {message}")

            try:
                status, stderr = _run_child(current, rng.randrange(1 << 30), rng, max_delay, fresh_interpreter)
                if status != -signal.SIGKILL:
                    bad(f"child exited by itself with status {status}: {stderr}")
                _check_after_kill(current, result, rng.random() < 0.7, bad)
            except Exception as exc:  # a crash of the harness is a finding, not a reason to stop
                bad(f"the kill cycle raised {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
            result.kills += 1
            result.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(result)
    finally:
        result.seconds = time.perf_counter() - t0
        if owned and not result.violations:
            shutil.rmtree(root, ignore_errors=True)
        else:
            result.directory = root
    return result


# -- corruption fuzzing ---------------------------------------------------------------------------

#: Damage kinds and their weights in a fuzz campaign.
DAMAGE = {"flip": 4, "flip-meta": 2, "flip-header": 3, "flip-data": 3, "burst": 2, "truncate": 2, "zero-page": 2,
          "swap-pages": 1, "dup-page": 1, "append": 1, "foreign": 1, "random": 1, "random-body": 1}
_BASES = ("small", "large")


@dataclass
class FuzzResult:
    """What a fuzz campaign found: outcomes per damage kind, the errors raised, and violations."""

    cases: int = 0
    detected: int = 0
    harmless: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    directory: str | None = None  #: the campaign's files, kept when given or when a violation was found

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


def dump(buf: ReplayBuffer, plan: Any) -> str:
    """A digest of everything a restore hands back: every key and value of every table (and that
    each key is found by lookup, not only by iteration), the redispatch plan and its states."""
    h = hashlib.sha256()
    with buf.store.reader() as txn:
        for table in TABLES:
            cur = txn.cursor(table)
            for key, value in txn.iter_prefix(table, b""):
                if not cur.set_key(key):
                    return f"lookup of {table}/{key!r} misses a key iteration finds"
                value = _without_timeline(table, key, value)
                h.update(struct.pack("<II", len(key), len(value)) + key + value)
    plan_doc = {k: v for k, v in plan.report().items() if not k.endswith("_seconds") and k != "timeline"}
    leases = [{k: v for k, v in lease.to_dict().items() if k != "timeline"} for lease in plan.leases]
    h.update(json.dumps([plan_doc, leases, plan.trainer_state, (plan.dataloader_state or b"").hex()],
                        sort_keys=True).encode())
    return h.hexdigest()


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


def _fuzz_worker(directory: str, trusted: bool) -> None:
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
            finally:
                buf.close()
            outcome, detail = ("harmless", "") if got == reference else ("violation", f"restored different data: {got}")
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
            cmd = [sys.executable, "-m", "kvckpt.testing.campaign", "fuzz-worker", self.directory] + \
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
        trusted: restore with ``trusted=True`` (skipping :mod:`kvckpt.durability.safe_open`) to measure what
            that costs; such a campaign is expected to report violations.
        timeout: seconds one case may take before its worker counts as hung.
        minutes: start no case after this many minutes (``result.cases`` says how many ran).
        progress: called after every case with the running result.
    """
    result = FuzzResult()
    t0 = time.perf_counter()
    owned = directory is None
    root = tempfile.mkdtemp(prefix="kvckpt-fuzz-") if owned else os.path.abspath(directory)
    os.makedirs(root, exist_ok=True)
    todo: queue.Queue[dict[str, Any]] = queue.Queue()
    for case in fuzz_cases(cases, seed):
        todo.put(case)
    lock = threading.Lock()

    def serve(k: int) -> None:
        worker = _Worker(os.path.join(root, f"worker-{k}"), trusted)
        os.makedirs(worker.directory, exist_ok=True)
        for name in _BASES:
            shutil.copyfile(os.path.join(root, f"base-{name}.kvckpt"),
                            os.path.join(worker.directory, f"base-{name}.kvckpt"))
        try:
            while True:
                try:
                    case = todo.get_nowait()
                except queue.Empty:
                    return
                if minutes is not None and time.perf_counter() - t0 > minutes * 60:
                    return
                outcome, detail = worker.run(case, timeout)
                with lock:
                    result.add(case, outcome, detail)
                    result.seconds = time.perf_counter() - t0
                    if progress is not None:
                        progress(result)
        finally:
            worker.stop()

    try:
        for name in _BASES:
            build_base(os.path.join(root, f"base-{name}.kvckpt"), large=name == "large")
        threads = [threading.Thread(target=serve, args=(k,)) for k in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        result.seconds = time.perf_counter() - t0
        if owned and not result.violations:
            shutil.rmtree(root, ignore_errors=True)
        else:
            result.directory = root
    return result


# -- command line ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m kvckpt.testing.campaign [--kills N] ...``, ``... fuzz --cases N ...`` or
    ``python -m kvckpt.testing.campaign powercut --cuts N ...`` (:mod:`kvckpt.testing.powercut`); exits 1
    when a violation was found."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and not args[0].startswith("-") else "kill"
    if command == "powercut":  # power loss on a FUSE filesystem: kvckpt.testing.powercut
        from kvckpt.testing.powercut import main as powercut_main

        return powercut_main(args)
    parser = argparse.ArgumentParser(prog=f"python -m kvckpt.testing.campaign {command}")
    parser.add_argument("--seed", type=int, default=0)
    if command == "child":
        parser.add_argument("run")
        parser.add_argument("--recover", action="store_true")
        opts = parser.parse_args(args)
        _child_main(opts.run, opts.seed, opts.recover, lambda: print("ready", flush=True))
        return 0
    if command == "fuzz-worker":
        parser.add_argument("directory")
        parser.add_argument("--trusted", action="store_true")
        opts = parser.parse_args(args)
        _fuzz_worker(opts.directory, opts.trusted)
        return 0
    parser.add_argument("--dir", default=None, help="keep the campaign's files here (default: a temp dir)")
    parser.add_argument("--minutes", type=float, default=None, help="start nothing new after this long")
    if command == "fuzz":
        parser.add_argument("--cases", type=int, default=1000)
        parser.add_argument("--workers", type=int, default=2)
        parser.add_argument("--trusted", action="store_true", help="skip safe_open, to measure what it prevents")
        opts = parser.parse_args(args)
        result: Any = run_fuzz_campaign(opts.cases, seed=opts.seed, workers=opts.workers, directory=opts.dir,
                                        trusted=opts.trusted, minutes=opts.minutes,
                                        progress=_every(500, lambda r: r.cases))
    elif command == "kill":
        parser.add_argument("--kills", type=int, default=200)
        parser.add_argument("--chain", type=int, default=25, help="kills per live store before a fresh one")
        parser.add_argument("--exec", action="store_true", help="start each child as a fresh interpreter")
        opts = parser.parse_args(args)
        result = run_crash_campaign(opts.kills, seed=opts.seed, directory=opts.dir, chain=opts.chain,
                                    fresh_interpreter=opts.exec, minutes=opts.minutes,
                                    progress=_every(100, lambda r: r.kills))
    else:
        parser.error(f"unknown command {command!r} (use fuzz, powercut, or --kills N)")
    for violation in result.violations[:50]:
        print("VIOLATION", violation)
    if result.violations:
        print(f"files kept in {result.directory}")
    print(result.summary(), flush=True)
    return 1 if result.violations else 0


def _every(n: int, count: Callable[[Any], int]) -> Callable[[Any], None]:
    def report(result: Any) -> None:
        if count(result) % n == 0:
            print(result.summary(), file=sys.stderr, flush=True)
    return report


if __name__ == "__main__":
    sys.exit(main())
