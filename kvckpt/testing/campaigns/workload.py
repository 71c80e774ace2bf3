"""The mixed workload the kill and power-cut campaigns crash: a trainer loop and producer threads over
one open buffer, logging every *acknowledged* operation.

Producers commit through every commit path of the buffer, each a :data:`COMMIT_PATHS` name the log
records: ``group`` (:meth:`~kvckpt.ReplayBuffer.commit_group`, sometimes retried as after a lost
acknowledgement), ``sample`` (:meth:`~kvckpt.ReplayBuffer.commit_sample`, one row at a time),
``encoded`` (:meth:`~kvckpt.ReplayBuffer.commit_encoded` of rows the producer encoded at the edge
with a :class:`~kvckpt.storage.encoding.RowEncoder` built from the config, as a remote producer
does) and ``many`` (:meth:`~kvckpt.ReplayBuffer.commit_many`: several groups, raw or edge-encoded,
in one durable transaction, with one item among them that must be refused inside it: a copy of a
lease from another store, or other content for a group of the same batch). Before a ``group``,
``sample`` or ``encoded`` commit, a producer streams its samples' token progress as an engine
does: one :meth:`~kvckpt.ReplayBuffer.record_progress_many` per "engine step" (sometimes one
:meth:`~kvckpt.ReplayBuffer.record_progress` per sample), each acknowledged chunk logged as
``progress`` with the durable length, resuming a redispatched sample from its durable prefix (which
must be the row's own first tokens). The trainer admits, selects, finishes steps, evicts, aborts
and checkpoints in the background to numbered files. Beside the buffer, a writer thread drives a
value store in the same run directory (:mod:`kvckpt.testing.campaigns.values_workload`).

Every row is :func:`make_row` of its group and index, so a checker can regenerate any stored row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import random
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvckpt import (
    BufferConfig,
    DuplicateCommit,
    ForeignLease,
    FutureVersion,
    GateTimeout,
    KvckptError,
    Lease,
    Prompt,
    ReplayBuffer,
    UnknownGroup,
    keep_latest,
)
from kvckpt.storage.encoding import RowEncoder
from kvckpt.testing.campaigns.values_workload import start_value_writer

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
CHECKPOINT_GLOB = "ckpt-*.kvckpt"
#: How a producer commits; each acknowledged commit is logged with ``via`` set to one of these.
COMMIT_PATHS = ("group", "sample", "encoded", "many")
_PATH_WEIGHTS = (0.35, 0.3, 0.15, 0.2)
#: The errors a deliberately refused ``commit_many`` item may end in, by how it was made wrong
#: (``UnknownGroup``: the trainer aborted the group meanwhile).
REFUSALS = {"foreign": (ForeignLease, UnknownGroup), "duplicate": (DuplicateCommit, UnknownGroup)}
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


class Log(Protocol):
    """Where the workload records acknowledged operations (:class:`OpLog`, or the power-cut pipe)."""

    def append(self, **op: Any) -> None:
        """Record one operation durably (outside the store) before returning."""


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


class Workload:
    """The child's trainer loop and producer threads over one open buffer."""

    def __init__(self, buf: ReplayBuffer, log: Log, ckdir: str, seed: int) -> None:
        self.buf, self.log, self.ckdir, self.seed = buf, log, ckdir, seed
        self.rng = random.Random(seed)
        self.work: queue.Queue[Lease] = queue.Queue()
        self.encoder = RowEncoder.from_config(buf.config.to_dict())  # the edge encoder a remote producer builds

    def producer(self, k: int) -> None:
        """Take leases off the queue and commit them, each by a commit path drawn at random."""
        rng = random.Random(self.seed * 1000 + k)
        try:
            while True:
                try:
                    lease = self.work.get(timeout=0.05)
                except queue.Empty:
                    continue
                path = rng.choices(COMMIT_PATHS, _PATH_WEIGHTS)[0]
                if path == "many":
                    self.commit_many([lease, *self._more(2)], rng)
                    continue
                with contextlib.suppress(UnknownGroup):  # the trainer aborted it meanwhile
                    self._generate(lease, path, rng)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)

    def _more(self, n: int) -> list[Lease]:
        leases = []
        with contextlib.suppress(queue.Empty):
            for _ in range(n):
                leases.append(self.work.get_nowait())
        return leases

    def _rows(self, lease: Lease, salt: str = "") -> dict[int, dict[str, np.ndarray]]:
        return {i: make_row(lease.group_id + salt, i) for i in lease.missing}

    def stream(self, lease: Lease, rng: random.Random) -> None:
        """Record the token progress of ``lease``'s missing samples in chunks of 1-6 tokens, one
        batched call per step, from each sample's durable prefix, and stop at a random step (the
        rest of the row is "generated" without progress, as after a short interval)."""
        done = {}
        for index, got in self.buf.progress(lease).items():
            want = make_row(lease.group_id, index)["input_ids"][:got.length]
            if not np.array_equal(got.tokens.numpy(), want):
                self.log.append(op="violation", what=f"the durable prefix of {lease.group_id}_g{index} is not the "
                                                     f"row's first {got.length} tokens")
            done[index] = got.length
        rows = {i: make_row(lease.group_id, i) for i in lease.missing}
        for _ in range(rng.randrange(1, 6)):
            items = []
            for i, row in rows.items():
                start = done.get(i, 0)
                n = min(rng.randrange(1, 7), len(row["input_ids"]) - start)
                if n > 0:
                    chunk = slice(start, start + n)
                    items.append({"lease": lease, "index": i, "start": start, "weight_version": lease.start_weight,
                                  "tokens": row["input_ids"][chunk], "logprobs": row["logprobs"][chunk]})
            if not items:
                return
            many = rng.random() < 0.7
            results = self.buf.record_progress_many(items) if many else [self._one(item) for item in items]
            for item, result in zip(items, results, strict=True):
                if isinstance(result, (UnknownGroup, FutureVersion)):
                    return  # aborted meanwhile / a restore went back past this lease's weights
                if isinstance(result, BaseException):
                    raise result
                done[item["index"]] = result
                self.log.append(op="progress", gid=lease.group_id, index=item["index"], end=result,
                                via="many" if many else "one")

    def _one(self, item: dict[str, Any]) -> Any:
        try:
            return self.buf.record_progress(item["lease"], item["index"], **{
                k: v for k, v in item.items() if k not in ("lease", "index")})
        except KvckptError as exc:
            return exc

    def _generate(self, lease: Lease, path: str, rng: random.Random) -> None:
        gid = lease.group_id
        self.stream(lease, rng)
        if path == "group":
            rows = self._rows(lease)
            self._acknowledge(gid, None, self.buf.commit_group(lease, rows), path)
            if rng.random() < 0.1:  # the acknowledgement was "lost": the retry must write nothing
                with contextlib.suppress(UnknownGroup, DuplicateCommit):  # evicted / rows dropped since
                    if not self.buf.commit_group(lease, rows).replayed:
                        raise AssertionError(f"retried commit of {gid!r} was applied twice")
        elif path == "encoded":
            encoded = [r.to_dict() for r in self.encoder.encode(lease, self._rows(lease))]  # the wire form
            self._acknowledge(gid, None, self.buf.commit_encoded(lease, encoded), path)
        else:
            for i in lease.missing:
                time.sleep(rng.random() * 0.002)
                self._acknowledge(gid, i, self.buf.commit_sample(lease, i, make_row(gid, i)), path)

    def commit_many(self, leases: list[Lease], rng: random.Random) -> None:
        """Commit ``leases`` in one ``commit_many`` call, with one item that must be refused in the
        shared transaction: a copy of one lease from another store (its right rows, placed before
        it: the real commit after it must not be a replay) or other content for one group (placed
        after it: a duplicate). Every other item is acknowledged on its own."""
        items: list[dict[str, Any]] = []
        for lease in leases:
            rows = self._rows(lease)
            if rng.random() < 0.5:
                items.append({"lease": lease, "rows": rows})
            else:
                items.append({"lease": lease, "encoded": [r.to_dict() for r in self.encoder.encode(lease, rows)]})
        victim = rng.randrange(len(leases))
        how = rng.choice(sorted(REFUSALS))
        if how == "foreign":
            wrong = dataclasses.replace(leases[victim], store_id="another-store")
            at = victim
            items.insert(at, {"lease": wrong, "rows": self._rows(leases[victim])})
        else:
            at = victim + 1
            items.insert(at, {"lease": leases[victim], "rows": self._rows(leases[victim], salt="~other")})
        results = self.buf.commit_many(items)
        for i, (item, result) in enumerate(zip(items, results, strict=True)):
            gid = item["lease"].group_id
            if i == at:
                if isinstance(result, REFUSALS[how]):
                    self.log.append(op="refused", gid=gid, how=how, error=type(result).__name__)
                else:
                    self.log.append(op="violation", what=f"commit_many applied the {how} item of {gid!r}: {result!r}")
            elif isinstance(result, UnknownGroup):
                continue  # the trainer aborted it meanwhile
            elif isinstance(result, BaseException):
                raise result
            elif result.replayed:
                self.log.append(op="violation", what=f"commit_many's commit of {gid!r} was a replay: the {how} "
                                                     "item before it was written")
            else:
                self._acknowledge(gid, None, result, "many")

    def _acknowledge(self, gid: str, index: int | None, result: Any, via: str) -> None:
        digest = self.buf.group(gid).digest if result.ready else None
        self.log.append(op="commit", gid=gid, index=index, ready=result.ready, digest=digest, via=via)

    def trainer(self, deadline: float) -> None:
        """Admit, select, finish steps, evict, abort and checkpoint until ``deadline`` (monotonic)."""
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


def run_workload(buf: ReplayBuffer, log: Log, ckdir: str, seed: int, ready: Callable[[], None]) -> None:
    """Redispatch ``buf``'s ledger, start three producers, call ``ready`` and run the trainer loop
    (checkpoints go to ``ckdir``), logging each acknowledged operation to ``log``; exits the
    process when the loop ends (the parent kills it before)."""
    work = Workload(buf, log, ckdir, seed)
    start_value_writer(os.path.dirname(ckdir), log, seed)  # the value store beside it (values_workload)
    entries = buf.ledger()
    log.append(op="start", ledger=[e.group_id for e in entries])
    for entry in entries:
        work.work.put(entry.lease(buf.store.store_id))
    for k in range(3):
        threading.Thread(target=work.producer, args=(k,), daemon=True).start()
    ready()
    work.trainer(time.monotonic() + _CHILD_SECONDS)
    os._exit(0)  # producers are daemons mid-loop; the parent expected a kill, not this exit
