"""The value store's part of the kill and power-cut campaigns: a writer thread on a value store
next to the crashed buffer (``values.kv`` in the run directory), and the checker of what it logged.

The writer is the one writer of its file and runs the operations the TransferQueue backend and the
verl ledger make, each logged when acknowledged (``op`` is the kind the report counts):

* ``vrun``: a new run record (the verl ledger's ``open_run``): later writes are fenced with it;
* ``vput``: a write fenced by the current run: puts 1-3 keys under a fresh write identity and
  deletes 0-2 others, one transaction (the ledger's ``put`` / ``clear`` / ``resume``);
* ``vclear``: a clear by write identity, some identities current, some stale (TransferQueue's
  ``kv_clear``): exactly the current ones go;
* ``vstale``: a write fenced by an earlier run, which must be refused (``FencedWrite``) and write nothing;
* ``vckpt``: a checkpoint to ``ckpt/values-N.kv`` (the core's primitive), logged with what it holds.

Before each write the writer logs its intent (``vintent``: the keys it puts, with their write
identities, and the keys it deletes); a child first logs what the store holds (``vstart``), so the
checker knows the outcome of a write the previous crash interrupted. Every value is a pure
function of its key and write identity (:func:`value_of`), so the checker compares bytes.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvckpt import FencedWrite, KvckptError, ValueStore, keep_latest, verify_path
from kvckpt.durability.safe_open import open_readonly
from kvckpt.storage import codec
from kvckpt.testing.campaigns.harness import start_writer
from kvckpt.values.records import KEY_PREFIX, write_id_of

VALUES_FILE = "values.kv"
CHECKPOINT_GLOB = "values-*.kv"
RUN_KEY = "run"
KEYS = tuple(f"k{i:02d}" for i in range(16))
#: The kinds of acknowledged value-store operations a campaign counts.
KINDS = ("vrun", "vput", "vclear", "vstale", "vckpt")
_WEIGHTS = (0.04, 0.55, 0.25, 0.08, 0.08)


def is_value_op(message: bytes) -> bool:
    """Whether a logged operation (one JSON line as the workload writes it) is the value store's."""
    return message.startswith(b'{"op":"v') and not message.startswith(b'{"op":"violation"')


def value_of(key: str, write_id: str) -> bytes:
    """The record stored under ``key`` by the write ``write_id``: 0.5-8 KB derived from both."""
    seed = hashlib.blake2b(f"{key}/{write_id}".encode(), digest_size=8).digest()
    size = 512 + int.from_bytes(seed[:2], "big") % 7680
    payload = (seed * (size // 8 + 1))[:size]
    return codec.encode({"v": np.frombuffer(payload, np.uint8)}, {"k": key, "w": write_id, "t": "bytes"}, 0)


def held(store: ValueStore) -> dict[str, str | None]:
    """Every key of ``store`` with the write identity of its record."""
    keys = store.keys()
    return {k: write_id_of(raw, k) for k, raw in zip(keys, store.get(keys), strict=True) if raw is not None}


class ValueWriter:
    """The value store's writer thread of one campaign child (see the module docstring)."""

    def __init__(self, run: str, log: Any, seed: int) -> None:
        self.store = ValueStore(os.path.join(run, VALUES_FILE))
        self.ckdir, self.log, self.rng = os.path.join(run, "ckpt"), log, random.Random(seed)
        self.model = held(self.store)
        self.log.append(op="vstart", state=self.model)
        self.token: str | None = self.model.get(RUN_KEY)  # the run this child continues
        self.stale: list[str] = []  # runs this child replaced

    def _write(self, kind: str, puts: dict[str, str], deletes: list[str], fence: str | None) -> None:
        self.log.append(op="vintent", puts=puts, deletes=deletes)
        self.store.write(list(puts), [value_of(k, w) for k, w in puts.items()], deletes,
                         fence=None if fence is None else (RUN_KEY, fence))
        for key in deletes:
            self.model.pop(key, None)
        self.model.update(puts)
        self.log.append(op=kind)

    def step(self) -> None:
        """One operation drawn at random."""
        rng = self.rng
        kind = "vrun" if self.token is None else rng.choices(KINDS, _WEIGHTS)[0]
        if kind == "vrun":
            if self.token is not None:
                self.stale.append(self.token)
            self.token = uuid.uuid4().hex[:16]
            self._write("vrun", {RUN_KEY: self.token}, [], None)
        elif kind == "vput":
            wid = uuid.uuid4().hex[:16]
            puts = {k: wid for k in rng.sample(KEYS, rng.randint(1, 3))}
            deletes = [k for k in rng.sample(KEYS, rng.randint(0, 2)) if k not in puts]
            self._write("vput", puts, deletes, self.token)
        elif kind == "vclear":
            keys = rng.sample(KEYS, rng.randint(1, 3))
            wids = [self.model.get(k) if rng.random() < 0.6 else "not-its-write" for k in keys]
            gone = [k for k, w in zip(keys, wids, strict=True) if w is not None and self.model.get(k) == w]
            self.log.append(op="vintent", puts={}, deletes=gone)
            deleted = self.store.clear(keys, wids)
            if deleted != len(gone):
                self.log.append(op="violation", what=f"value clear of {keys} deleted {deleted}, not {len(gone)}")
            for key in gone:
                self.model.pop(key)
            self.log.append(op="vclear")
        elif kind == "vstale" and self.stale:
            try:
                self.store.write(["stale"], [value_of("stale", "stale")], [], fence=(RUN_KEY, rng.choice(self.stale)))
                self.log.append(op="violation", what="a value write fenced by an earlier run was applied")
            except FencedWrite:
                self.log.append(op="vstale")
        elif kind == "vckpt":
            numbers = [int(os.path.basename(p)[7:-3]) for p in glob.glob(os.path.join(self.ckdir, CHECKPOINT_GLOB))]
            path = os.path.join(self.ckdir, f"values-{max(numbers, default=-1) + 1:06d}.kv")
            stamp = self.store.checkpoint(path)
            self.log.append(op="vckpt", path=os.path.basename(path), id=stamp["checkpoint_id"], state=self.model)
            keep_latest(self.ckdir, CHECKPOINT_GLOB, keep=2)


def start_value_writer(run: str, log: Any, seed: int) -> None:
    """Open the run's value store and start its writer on a daemon thread
    (:func:`~kvckpt.testing.campaigns.harness.start_writer`)."""
    writer = ValueWriter(run, log, seed)
    start_writer("kvckpt-campaign-values", writer.step, writer.rng)


def expected_states(ops: list[dict[str, Any]], bad: Callable[[str], None]) -> tuple[dict[str, str], dict[str, str]]:
    """Replay the value-store operations of ``ops``: the state every acknowledged write implies,
    and that state plus the write in flight at the end (if any). Each ``vstart`` must be one of
    the two states the operations before it allowed."""
    state: dict[str, str] = {}
    pending: dict[str, Any] | None = None
    started = False
    for op in ops:
        kind = op["op"]
        if kind == "vstart":
            allowed = [state] if pending is None else [state, _apply(state, pending)]
            if started and op["state"] not in allowed:
                bad(f"the value store a child opened holds {_diff(op['state'], state)} against what was acknowledged")
            state, pending, started = dict(op["state"]), None, True
        elif kind == "vintent":
            pending = op
        elif kind in ("vrun", "vput", "vclear"):
            if pending is not None:
                state = _apply(state, pending)
            pending = None
    return state, state if pending is None else _apply(state, pending)


def _write_id(raw: bytes, key: str) -> str | None:
    """The record's write identity, or ``"<damaged>"`` (verify has reported why)."""
    try:
        return write_id_of(raw, key)
    except KvckptError:
        return "<damaged>"


def _apply(state: dict[str, str], intent: dict[str, Any]) -> dict[str, str]:
    after = {k: w for k, w in state.items() if k not in intent["deletes"]}
    after.update(intent["puts"])
    return after


def _diff(got: dict[str, Any], want: dict[str, Any]) -> str:
    keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return ", ".join(f"{k}: {got.get(k)} (acknowledged {want.get(k)})" for k in keys[:8]) or "the same"


def check_values(run: str, ops: list[dict[str, Any]], scratch: str, bad: Callable[[str], None],
                 checked: set[str] | None = None) -> int:
    """Check the run's value store and its checkpoints against the logged ``ops``; returns how many
    checkpoint files were loaded (``checked``: names already loaded, skipped and extended).

    The store opens, verifies, holds exactly the acknowledged state (or that plus the write in
    flight), every value is the bytes its write put, no write of an earlier run landed; every
    file under a checkpoint name loads (validated) and an acknowledged one holds what it was
    acknowledged with."""
    if not any(op["op"] == "vstart" for op in ops):
        return 0  # the crash came before the writer opened its store
    path = os.path.join(run, VALUES_FILE)
    report = verify_path(path, checksums=True)
    for problem in report.problems[:5]:
        if problem.code != "open":  # said below, with what was acknowledged
            bad(f"value store: {problem}")
    acked, with_pending = expected_states(ops, bad)
    try:
        with open_readonly(path) as store:  # read-only: a power-cut image is where the next cut continues
            stored = store.read(lambda txn: {k[len(KEY_PREFIX):].decode(): bytes(v)
                                             for k, v in txn.iter_prefix("rows", KEY_PREFIX)})
    except KvckptError as exc:
        acknowledged = sum(op["op"] in KINDS for op in ops)
        bad(f"the value store does not open ({acknowledged} acknowledged value operations): "
            f"{type(exc).__name__}: {exc}")
        return 0
    state = {k: _write_id(raw, k) for k, raw in stored.items()}
    if state not in (acked, with_pending):
        bad(f"the value store holds {_diff(state, acked)} against what was acknowledged")
    for key, raw in stored.items():
        if raw != value_of(key, state[key]):
            bad(f"the value under {key!r} is not the bytes its write put")
    logged = {op["path"]: op for op in ops if op["op"] == "vckpt"}
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(run, "ckpt", CHECKPOINT_GLOB)))
    loads = 0
    checked = set() if checked is None else checked
    for name in names:
        if name in checked:
            continue
        target = ValueStore(os.path.join(scratch, "values-loaded.kv"))
        try:
            stamp = target.load(os.path.join(run, "ckpt", name))
            loads += 1
            checked.add(name)
            if name in logged:
                if stamp["checkpoint_id"] != logged[name]["id"]:
                    bad(f"value checkpoint {name} holds stamp {stamp['checkpoint_id']}, not the acknowledged one")
                if held(target) != logged[name]["state"]:
                    bad(f"value checkpoint {name} holds {_diff(held(target), logged[name]['state'])}")
        except KvckptError as exc:
            bad(f"value checkpoint {name} under a final name does not load: {type(exc).__name__}: {exc}")
        finally:
            target.close()
    if logged and max(logged) not in names and max(logged) > max(names, default=""):
        bad(f"acknowledged value checkpoint {max(logged)} is missing")
    return loads
