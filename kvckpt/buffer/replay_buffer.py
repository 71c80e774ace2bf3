"""The replay buffer: groups, the ownership ledger, cursors and samplers over one store.

Every state transition is exactly one durable LMDB write transaction:

==================== ===============================================================================
transition           written atomically
==================== ===============================================================================
``admit``            ``dispatch_index`` (gated samplers), dataloader state, one ledger entry per prompt
``advance_dispatch`` ``dispatch_index`` (gated samplers), dataloader state; prompts join via ``admit``
``redispatch``       one ledger entry's ``attempt`` + 1 (and its ``start_weight``)
``commit_group``     all rows, group record ready with ``end_weight``, ledger entry deleted, indexes
``commit_sample``    one row and the ledger entry's sibling progress (the group once all n are in)
``select``           chosen ready groups -> claimed by the current step
``finish_step``      claimed -> consumed, ``trainer_version`` + 1, rows of checkpointed steps dropped
``evict``            out-of-window ready groups -> evicted, their rows deleted
``abort``            ledger entry -> aborted tombstone, shortfall credited, reason recorded
``recover``          reconcile to a trainer version, bump every ledger attempt (fencing zombies)
==================== ===============================================================================

so there is no moment, on disk or in memory, where a prompt is both a committed group and a
ledger entry, or neither. Row payloads are encoded (and checksummed) before the transaction
starts, outside the store's writer lock; the transaction itself only puts bytes.

A prompt's life: ``admit`` -> ledger entry (lease) -> ``commit_group`` -> ``ready`` ->
``select`` -> ``claimed`` -> ``finish_step`` -> ``consumed`` (rows dropped once a checkpoint
covers the step, or kept with ``retain_consumed``). Side exits: ``evict`` (ready, out of window)
and ``abort`` (in flight). Group records stay as small tombstones so every prompt that ever left
the dataloader remains accounted for.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvckpt import args
from kvckpt.errors import (
    AbandonedTimeline,
    BadArgument,
    CapacityError,
    CorruptRecord,
    DuplicateCommit,
    ForeignLease,
    FormatError,
    GateTimeout,
    InvariantViolation,
    KvckptError,
    LeaseMismatch,
    NotSelectable,
    SchemaMismatch,
    StaleAttempt,
    StoreNotFound,
    UnknownGroup,
)
from kvckpt.samplers import BufferView, Sampler, create_sampler
from kvckpt.storage import codec, keys
from kvckpt.storage.encoding import CheckedRow, EncodedRow, RowEncoder, check_encoded
from kvckpt.storage.group_commit import GroupCommitter
from kvckpt.storage.schema import RowSchema
from kvckpt.storage.store import FORMAT_VERSION, Store, Txn, makedirs_durable
from kvckpt.tables.digest import check_group_rows, row_digest
from kvckpt.tables.records import (
    ABORTED,
    CLAIMED,
    CONSUMED,
    EVICTED,
    READY,
    Admission,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Prompt,
    Selection,
)

CONFIG_KEY, STATE_KEY, DATALOADER_KEY, SHORTFALL_KEY, CHECKPOINT_KEY = (
    b"config", b"state", b"dataloader", b"shortfall", b"checkpoint")
#: ``meta/shapes``: field name -> the shape the store pinned at the field's first commit.
SHAPES_KEY = b"shapes"
log = logging.getLogger("kvckpt.buffer")
#: A wait for the gate logs a warning this often (seconds).
WAIT_LOG_SECONDS = 30.0
#: A commit slower than this (seconds, encode and durable transaction) is logged as slow.
SLOW_COMMIT_SECONDS = 1.0
COUNTERS = ("admitted", "committed", "samples_committed", "selected", "consumed", "evicted", "aborted",
            "redispatched", "raw_bytes", "stored_bytes")


@dataclass
class BufferConfig:
    """What a buffer is, persisted in the store so a reopen needs no arguments.

    Args:
        group_size: rows per group (n completions per prompt).
        schema: the row schema (a :class:`RowSchema` or its dict form).
        sampler: a sampler config dict (``{"name": "in_order", "max_lookahead_versions": 1}``),
            a name, or a :class:`Sampler`.
        max_buffered_rollouts: capacity: in-flight plus ready groups never exceed it.
        groups_per_step: prompts per training step; used to refuse a capacity that deadlocks.
        retain_consumed: keep consumed groups' rows (for replay or SFT export). Defaults to False.
        compression_level: zstd level of row payloads, 0 for none. Defaults to 1.
        durable_checkpoints: consumed rows are dropped only once this many later checkpoints
            exist, so a trainer can still resume from an older model checkpoint. Defaults to 2.
        wait_timeout: seconds ``admit`` and ``advance_dispatch`` wait for the gate or capacity when
            the caller gives no ``timeout`` (then :class:`~kvckpt.errors.GateTimeout`); ``None``
            waits forever. Waits are logged on ``kvckpt.buffer``. Defaults to 600.
    """

    group_size: int
    schema: RowSchema | Mapping[str, Any]
    sampler: Any = "in_order"
    max_buffered_rollouts: int = 64
    groups_per_step: int = 1
    retain_consumed: bool = False
    compression_level: int = codec.DEFAULT_LEVEL
    durable_checkpoints: int = 2
    wait_timeout: float | None = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.schema, RowSchema):
            self.schema = RowSchema.from_dict(self.schema) if "fields" in self.schema else RowSchema(self.schema)
        self.sampler = create_sampler(self.sampler)
        for name in ("group_size", "max_buffered_rollouts", "groups_per_step", "durable_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadArgument(f"{name} must be an integer >= 1, got {value!r}")
        self.wait_timeout = args.timeout("wait_timeout", self.wait_timeout)
        if self.wait_timeout is not None and not math.isfinite(self.wait_timeout):
            raise BadArgument("wait_timeout must be finite; None waits forever")
        self.sampler.check_capacity(self.max_buffered_rollouts, self.groups_per_step)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored under ``meta/config``."""
        return {"group_size": self.group_size, "schema": self.schema.to_dict(),
                "sampler": self.sampler.config(), "max_buffered_rollouts": self.max_buffered_rollouts,
                "groups_per_step": self.groups_per_step, "retain_consumed": self.retain_consumed,
                "compression_level": self.compression_level, "durable_checkpoints": self.durable_checkpoints,
                "wait_timeout": self.wait_timeout}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> BufferConfig:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(doc))


def _new_state() -> dict[str, Any]:
    return {"dispatch_index": -1, "trainer_version": 0, "weight_version": 0, "admissions": 0, "seq": 0,
            "inflight": 0, "ready": 0, "claimed": 0, "durable": [], "drop_floor": 0,
            "timeline": new_timeline(), "counters": dict.fromkeys(COUNTERS, 0)}


def new_timeline() -> str:
    """A fresh random timeline id: one per create, restore and recovery (see :class:`Lease`)."""
    return uuid.uuid4().hex


@dataclass
class Batch:
    """Rows of selected groups, ready for training. Owns its memory (no open transaction).

    ``tensors`` maps field names to torch tensors: ``padded`` gives ``[N, L_max]`` token fields
    (right-padded with ``pad_value``) and stacked row fields; ``packed`` gives 1-D concatenated
    token fields with ``cu_seqlens``. Text fields are lists of ``N`` ``str`` / ``bytes``. ``rows``
    (layout ``list``) keeps one dict per row.
    """

    group_ids: list[str]
    row_indices: list[int]
    lengths: Any
    tensors: dict[str, Any] = field(default_factory=dict)
    cu_seqlens: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    groups: list[GroupInfo] = field(default_factory=list)


class ReplayBuffer:
    """A crash-consistent replay buffer over one kvckpt store file.

    Create one with :meth:`create`, reopen with :meth:`open` (no arguments needed: the config is
    in the store). Thread-safe: producers may commit from several threads (row encoding runs in
    parallel; transactions are serialised). Never share one across ``fork``.

    Examples:
        >>> import tempfile, torch
        >>> path = tempfile.mkdtemp() + "/buf.kv"
        >>> buf = ReplayBuffer.create(path, BufferConfig(
        ...     group_size=2, schema={"input_ids": ("int64", "token"), "total_reward": ("float32", "row")},
        ...     sampler={"name": "in_order", "max_lookahead_versions": 1}, max_buffered_rollouts=4))
        >>> [lease] = buf.admit([Prompt(prompt_idx=7)], dataloader_state=b"cursor=1")
        >>> row = {"input_ids": torch.tensor([1, 2, 3]), "total_reward": torch.tensor(1.0)}
        >>> buf.commit_group(lease, [row, row]).ready
        True
        >>> buf.select(1, 1).group_ids == [lease.group_id]
        True
        >>> buf.close()
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        doc = store.read(lambda t: t.get_json("meta", CONFIG_KEY))
        if doc is None:
            raise BadArgument(f"{store.path!r} is a kvckpt store without a replay buffer config; "
                              "create it with ReplayBuffer.create")
        if store.info.get("version") == 1 and not store.readonly:
            _upgrade_from_v1(store)
        self.config = BufferConfig.from_dict(doc)
        self.sampler: Sampler = self.config.sampler
        self.schema: RowSchema = self.config.schema
        self._changed = threading.Condition()
        self._latencies: deque[float] = deque(maxlen=4096)
        #: the group committer every commit goes through (``stats``: durable transactions and the
        #: transitions they held; :meth:`stats` reports both).
        self.committer = GroupCommitter(store)
        self._encoder = self.row_encoder()

    # -- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, config: BufferConfig, *, map_size: int | None = None) -> ReplayBuffer:
        """Create a new store file holding an empty buffer (and its parent directory, if missing).

        Raises:
            BadArgument: the file already exists (open it with :meth:`open`).
        """
        import os

        if os.path.exists(path):
            raise BadArgument(f"{path!r} already exists; use ReplayBuffer.open to reopen it")
        kwargs = {"map_size": map_size} if map_size else {}
        makedirs_durable(os.path.dirname(os.path.abspath(path)))
        store = Store(path, create=True, **kwargs)
        try:
            def init(txn: Txn) -> None:
                txn.put_json("meta", CONFIG_KEY, config.to_dict())
                txn.put_json("meta", STATE_KEY, _new_state())
                txn.put_json("meta", SHORTFALL_KEY, {})
            store.write(init)
            return cls(store)
        except BaseException:
            store.close()
            raise

    @classmethod
    def open(cls, path: str, *, readonly: bool = False, map_size: int | None = None) -> ReplayBuffer:
        """Reopen an existing buffer (its config comes from the store).

        ``readonly=True`` never writes, and works on a store another handle (in this process or
        another) has open for writing: it reads consistent snapshots of it. A file no writer holds
        (a checkpoint, a copy) is untrusted: it is opened through
        :func:`kvckpt.durability.safe_open.open_readonly` (structure-checked before liblmdb maps it; the map
        is the file's size, or ``map_size``).

        Raises:
            StoreNotFound: no store at ``path`` (make one with :meth:`create`).
            StoreLocked: another writable handle holds it (open it ``readonly=True`` to look at it).
            FormatError: not a sound kvckpt store, or its config passes its checksum but is not
                one kvckpt writes (a damaged or crafted file).
        """
        from kvckpt.durability.safe_open import open_readonly

        try:
            store = open_readonly(path, map_size=map_size) if readonly else Store(path, map_size=map_size)
        except StoreNotFound:
            raise StoreNotFound(f"no kvckpt store at {path!r}; make one with ReplayBuffer.create") from None
        try:
            return cls(store)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
            store.close()
            if isinstance(exc, KvckptError):
                raise
            raise FormatError(f"{path!r}: meta/config passes its checksum but is not a config kvckpt writes "
                              f"({type(exc).__name__}: {str(exc)[:200]}); the file is damaged or crafted") from None
        except BaseException:
            store.close()
            raise

    def close(self) -> None:
        """Close the store. Idempotent."""
        self.store.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> str:
        """The store file."""
        return self.store.path

    # -- internal helpers ------------------------------------------------------------------------
    def _write(self, fn: Any) -> Any:
        result = self.store.write(fn)
        self._notify()
        return result

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    @staticmethod
    def _state(txn: Txn) -> dict[str, Any]:
        st = txn.get_json("meta", STATE_KEY)
        if st is None:
            raise InvariantViolation("meta/state is missing")
        return st

    @staticmethod
    def _group(txn: Txn, group_id: str) -> GroupInfo | None:
        doc = txn.get_json("groups", keys.group_key(group_id))
        return None if doc is None else GroupInfo.from_dict(doc)

    @staticmethod
    def _entry(txn: Txn, group_id: str) -> LedgerEntry | None:
        doc = txn.get_json("ledger", keys.group_key(group_id))
        return None if doc is None else LedgerEntry.from_dict(doc)

    @staticmethod
    def _put_group(txn: Txn, group: GroupInfo) -> None:
        txn.put_json("groups", keys.group_key(group.group_id), group.to_dict())

    @staticmethod
    def _put_entry(txn: Txn, entry: LedgerEntry) -> None:
        txn.put_json("ledger", keys.group_key(entry.group_id), entry.to_dict())

    @staticmethod
    def _ready_index(txn: Txn, group: GroupInfo, add: bool) -> None:
        gid = group.group_id.encode()
        index_keys = [keys.index_key(keys.READY_BY_SEQ, None, group.seq),
                      keys.index_key(keys.READY_BY_WEIGHT, group.start_weight, group.seq)]
        if group.target_step is not None:
            index_keys.append(keys.index_key(keys.READY_BY_TARGET, group.target_step, group.seq))
        for key in index_keys:
            if add:
                txn.put("index", key, gid)
            elif not txn.delete("index", key):
                raise InvariantViolation(f"ready index entry of group {group.group_id!r} is missing")

    @staticmethod
    def _step_index(txn: Txn, prefix: bytes, step: int, group: GroupInfo, add: bool) -> None:
        key = keys.index_key(prefix, step, group.seq)
        if add:
            txn.put("index", key, group.group_id.encode())
        elif not txn.delete("index", key):
            raise InvariantViolation(f"index {prefix.decode()} entry of group {group.group_id!r} is missing")

    @staticmethod
    def _pending_index(txn: Txn, entry: LedgerEntry, add: bool) -> None:
        key = keys.index_key(keys.PENDING_BY_WEIGHT, entry.start_weight, entry.seq)
        if add:
            txn.put("index", key, entry.group_id.encode())
        else:
            txn.delete("index", key)

    @staticmethod
    def _delete_rows(txn: Txn, group_id: str) -> int:
        cur = txn.cursor("rows")
        prefix = keys.row_prefix(group_id)
        count = 0
        if cur.set_range(prefix):
            while cur.key().startswith(prefix):
                count += 1
                if not cur.delete():
                    break
        return count

    def _resolve(self, txn: Txn, gids: Iterable[str]) -> list[GroupInfo]:
        groups = []
        for gid in gids:
            group = self._group(txn, gid)
            if group is None:
                raise InvariantViolation(f"index points to group {gid!r}, which has no record")
            groups.append(group)
        return groups

    # -- admission -------------------------------------------------------------------------------
    def admissible(self, count: int = 1) -> bool:
        """Whether ``count`` prompts could be admitted now (gate open and capacity free)."""
        return self.store.read(lambda t: self._admission_blocker(self._state(t), count) is None)

    def _admission_blocker(self, st: dict[str, Any], count: int, gated: bool = True) -> str | None:
        gate = self.sampler.gate_window if gated else None
        if gate is not None and st["dispatch_index"] >= st["trainer_version"] + gate:
            return (f"gate closed: dispatch_index {st['dispatch_index']} >= trainer_version "
                    f"{st['trainer_version']} + window {gate}")
        if st["inflight"] + st["ready"] + count > self.config.max_buffered_rollouts:
            return (f"capacity: {st['inflight']} in flight + {st['ready']} ready + {count} > "
                    f"max_buffered_rollouts {self.config.max_buffered_rollouts}")
        return None

    def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None = None,
              *, timeout: float | None = None, weight_version: int | None = None,
              admission: Admission | None = None) -> list[Lease]:
        """Admit one dataloader batch: the prompts become ledger entries and get leases.

        Gated samplers first wait (outside any transaction) until ``dispatch_index <
        trainer_version + W`` and capacity is free; the cursor advance, the dataloader state and
        the ledger entries are then one transaction. ``in_order`` stamps every prompt with
        ``target_step = dispatch_index`` after the increment.

        Args:
            prompts: :class:`Prompt` objects, prompt indices, or dicts with Prompt's fields.
            dataloader_state: the trainer's opaque dataloader state *after* this batch; stored
                with the admission so a restart resumes the dataloader exactly past it.
            timeout: seconds to wait for the gate and capacity; ``0`` does not wait, ``math.inf``
                waits forever. Defaults to the config's ``wait_timeout``.
            weight_version: the rollout weight version the prompts are generated with
                (``start_weight``). Defaults to the buffer's current weight version.
            admission: join an admission :meth:`advance_dispatch` already made instead of making
                one: no gate wait and no cursor advance; the prompts get its ``admission_id`` and
                ``target_step`` (only capacity is waited for). Defaults to a new admission.

        Raises:
            GateTimeout: the gate or capacity stayed closed for ``timeout`` seconds.
            CapacityError: the batch alone is larger than ``max_buffered_rollouts``.
            BadArgument: a duplicate or already-used group id, or an ``admission`` this store did
                not issue.
        """
        batch = [_as_prompt(p) for p in prompts]
        weight_version = args.optional_integer("weight_version", weight_version)
        timeout = args.timeout("timeout", timeout)
        _check_dataloader_state(dataloader_state)
        if admission is not None and not isinstance(admission, Admission):
            raise BadArgument(f"admission must be an Admission from advance_dispatch, got {type(admission).__name__}")
        if not batch:
            raise BadArgument("admit needs at least one prompt")
        if len(batch) > self.config.max_buffered_rollouts:
            raise CapacityError(f"a batch of {len(batch)} prompts exceeds max_buffered_rollouts "
                                f"{self.config.max_buffered_rollouts}")
        ids = [p.group_id for p in batch if p.group_id is not None]
        if len(ids) != len(set(ids)):
            raise BadArgument("duplicate group ids within one admission")
        return self._write_when_open(
            lambda txn: self._admit_txn(txn, batch, dataloader_state, weight_version, admission), timeout)

    def advance_dispatch(self, dataloader_state: bytes | None = None, *, timeout: float | None = None) -> Admission:
        """Make an admission without prompts yet; prompts join it with ``admit(..., admission=...)``.

        The gate wait happens outside any transaction; ``dispatch_index`` + 1 (gated samplers) and
        the dataloader state are then one transaction. This is NeMo-RL's split admission (cursor
        first, then one ``reserve`` per prompt): two transactions in all, so a crash between them
        leaves an admission, and with ``dataloader_state`` a dataloader position, that no ledger
        entry owns. :meth:`admit` does both in one transaction and is the recommended path.

        Args:
            dataloader_state: the dataloader state after the batch, stored with the cursor.
            timeout: seconds to wait for the gate and capacity; ``0`` does not wait, ``math.inf``
                waits forever. Defaults to the config's ``wait_timeout``.

        Raises:
            GateTimeout: the gate stayed closed for ``timeout`` seconds.
        """
        timeout = args.timeout("timeout", timeout)
        _check_dataloader_state(dataloader_state)

        def txn_fn(txn: Txn) -> Admission | str:
            st = self._state(txn)
            blocker = self._admission_blocker(st, 0)
            if blocker is not None:
                return blocker
            admission = self._new_admission(st)
            self._put_dataloader_state(txn, dataloader_state)
            txn.put_json("meta", STATE_KEY, st)
            return admission

        return self._write_when_open(txn_fn, timeout)

    def _write_when_open(self, fn: Any, timeout: float | None) -> Any:
        """Run ``fn`` in a transaction until it returns something other than a blocker string,
        waiting (outside any transaction) at most ``timeout`` seconds, the config's by default."""
        if timeout is None:
            timeout = math.inf if self.config.wait_timeout is None else self.config.wait_timeout
        start = time.monotonic()
        deadline, next_log = start + timeout, start + WAIT_LOG_SECONDS
        while True:
            result = self._write(fn)
            if not isinstance(result, str):
                if time.monotonic() >= start + WAIT_LOG_SECONDS:
                    log.info("%s: admission went through after %.1fs", self.path, time.monotonic() - start)
                return result
            with self._changed:
                now = time.monotonic()
                if now >= deadline:
                    raise GateTimeout(f"admission still blocked after {timeout}s: {result} (raise the timeout, "
                                      "or BufferConfig.wait_timeout, if training is just slow)")
                if now >= next_log:
                    log.warning("%s: admission has waited %.0fs: %s", self.path, now - start, result)
                    next_log = now + WAIT_LOG_SECONDS
                self._changed.wait(min(0.05, deadline - now))

    def _new_admission(self, st: dict[str, Any]) -> Admission:
        """Advance the cursor (gated samplers) and issue the next admission id, in ``st``."""
        target = None
        if self.sampler.gate_window is not None:
            st["dispatch_index"] += 1
            if self.sampler.stamps_target_step:
                target = st["dispatch_index"]
        admission = Admission(f"a{st['admissions']}", st["dispatch_index"], target)
        st["admissions"] += 1
        return admission

    @staticmethod
    def _check_joined(st: dict[str, Any], admission: Admission) -> None:
        number = admission.admission_id[1:]
        if not (admission.admission_id.startswith("a") and number.isdigit() and int(number) < st["admissions"]):
            raise BadArgument(f"admission {admission.admission_id!r} was not issued by this store "
                              f"({st['admissions']} admissions so far)")
        if admission.target_step is not None and admission.target_step > st["dispatch_index"]:
            raise BadArgument(f"admission {admission.admission_id!r} is stamped for step {admission.target_step}, "
                              f"past the store's dispatch_index {st['dispatch_index']}")

    @staticmethod
    def _free_id(txn: Txn, gid: str) -> str:
        """``gid``, or ``gid.N`` if a caller already chose it: a generated id never blocks admission."""
        candidate, n = gid, 0
        while txn.get("ledger", keys.group_key(candidate)) is not None \
                or txn.get("groups", keys.group_key(candidate)) is not None:
            n += 1
            candidate = f"{gid}.{n}"
        return candidate

    @staticmethod
    def _put_dataloader_state(txn: Txn, dataloader_state: bytes | None) -> None:
        if dataloader_state is not None:
            txn.put("meta", DATALOADER_KEY, codec.encode(
                {"state": np.frombuffer(bytes(dataloader_state), np.uint8)}, level=0))

    def _admit_txn(self, txn: Txn, batch: list[Prompt], dataloader_state: bytes | None,
                   weight_version: int | None, admission: Admission | None) -> list[Lease] | str:
        st = self._state(txn)
        blocker = self._admission_blocker(st, len(batch), gated=admission is None)
        if blocker is not None:
            return blocker  # nothing written: the caller waits outside the transaction
        if admission is None:
            admission = self._new_admission(st)
            id_format = f"{admission.admission_id}-p{{j}}"
        else:
            self._check_joined(st, admission)
            id_format = f"{admission.admission_id}-s{{seq}}"  # a joined admission's prompts arrive over many calls
        admission_id, target = admission.admission_id, admission.target_step
        start_weight = st["weight_version"] if weight_version is None else weight_version
        leases = []
        for j, prompt in enumerate(batch):
            gid = prompt.group_id or self._free_id(txn, id_format.format(j=j, seq=st["seq"]))
            gkey = keys.group_key(gid)
            if txn.get("ledger", gkey) is not None or txn.get("groups", gkey) is not None:
                raise BadArgument(f"group id {gid!r} is already in use in this store")
            entry = LedgerEntry(gid, admission_id, prompt.prompt_idx, prompt.task_name, self.config.group_size,
                                target, start_weight, attempt=0, seq=st["seq"], timeline=st["timeline"])
            st["seq"] += 1
            self._put_entry(txn, entry)
            self._pending_index(txn, entry, add=True)
            leases.append(entry.lease(self.store.store_id))
        st["inflight"] += len(batch)
        st["counters"]["admitted"] += len(batch)
        self._put_dataloader_state(txn, dataloader_state)
        txn.put_json("meta", STATE_KEY, st)
        return leases

    # -- commits ---------------------------------------------------------------------------------
    def row_encoder(self) -> RowEncoder:
        """An encoder of rows for this store; build the same elsewhere with ``RowEncoder.from_config``."""
        return RowEncoder(self.schema, self.config.group_size, self.config.compression_level)

    def _check_shapes(self, txn: Txn, encoded: list[CheckedRow]) -> None:
        """Hold the rows' shapes against the store's pins (``meta/shapes``); fields seen for the first
        time are pinned in this same transaction, so the pin and the rows that set it commit together."""
        pins = txn.get_json("meta", SHAPES_KEY) or {}
        new = self.schema.pin(pins, [(r.where, r.shapes) for r in encoded])
        if new is not None:
            txn.put_json("meta", SHAPES_KEY, new)

    @staticmethod
    def _digest(value: bytes) -> str:
        return row_digest(value)

    def commit_group(self, lease: Lease, rows: Sequence[Mapping[str, Any]] | Mapping[int, Mapping[str, Any]],
                     *, end_weight: int | None = None) -> CommitResult:
        """Commit a whole group under its lease: rows + group ready + ledger entry deleted.

        ``rows`` is either all ``group_size`` rows, or (after recovery reused some siblings) just
        the rows of ``lease.missing`` in that order, or a dict ``{row index: row}``.

        Retrying exactly the same commit after a lost acknowledgement returns the same result with
        ``replayed=True`` and writes nothing.

        Raises:
            UnknownGroup: the group is neither in flight nor committed (aborted, evicted, unknown).
            StaleAttempt: the lease is fenced: :class:`~kvckpt.errors.ForeignLease` (another store),
                :class:`~kvckpt.errors.AbandonedTimeline` (issued before a restore or recovery), or
                plain ``StaleAttempt`` (a redispatch issued a newer attempt).
            LeaseMismatch: the lease's group size, prompt or stamps differ from its ledger entry.
            DuplicateCommit: the group is already committed with other content.
            SchemaMismatch: wrong row count, missing/extra field, wrong dtype or shape.
        """
        t0 = time.perf_counter()
        self._check_lease(lease)
        end_weight = args.optional_integer("end_weight", end_weight)
        encoded = self._encoder.encode(lease, rows)
        return self._commit(lease, encoded, end_weight, True, t0)

    def commit_sample(self, lease: Lease, index: int, row: Mapping[str, Any],
                      *, end_weight: int | None = None) -> CommitResult:
        """Commit one row (sibling) of a group; the group becomes ready in the transaction that
        adds its last row. Same refusals and idempotence as :meth:`commit_group`."""
        t0 = time.perf_counter()
        self._check_lease(lease)
        end_weight = args.optional_integer("end_weight", end_weight)
        index = args.integer("index", index, minimum=None)
        encoded = self._encoder.encode(lease, {index: row})
        return self._commit(lease, encoded, end_weight, False, t0)

    def commit_encoded(self, lease: Lease, rows: Sequence[EncodedRow | Mapping[str, Any]], *,
                       end_weight: int | None = None, whole: bool = True) -> CommitResult:
        """Commit rows a producer encoded itself (:class:`~kvckpt.storage.encoding.RowEncoder`), checked
        here without being rebuilt (:func:`~kvckpt.storage.encoding.check_encoded`).

        ``whole=True`` is :meth:`commit_group`'s semantics, ``False`` :meth:`commit_sample`'s (one
        row). Same refusals and idempotence; a record that fails its checks is a
        :class:`~kvckpt.errors.SchemaMismatch` and nothing is written.
        """
        t0 = time.perf_counter()
        self._check_lease(lease)
        end_weight = args.optional_integer("end_weight", end_weight)
        checked = check_encoded(self.schema, self.config.group_size, lease.group_id, rows)
        if not whole and len(checked) != 1:
            raise SchemaMismatch(f"a single-row commit of group {lease.group_id!r} carries {len(checked)} rows")
        return self._commit(lease, checked, end_weight, whole, t0)

    def commit_many(self, items: Sequence[Mapping[str, Any]]) -> list[CommitResult | KvckptError]:
        """Commit several groups (or single rows) in one durable transaction, each its own
        transition: one refused item (stale lease, duplicate, schema) does not fail the others.

        Each item is ``{"lease": Lease, "rows": rows, "end_weight": int | None}``, plus
        ``"index": i`` for a single-row commit (then ``rows`` is that row); or ``"encoded": [...]``
        instead of ``rows``: rows a producer encoded (as :meth:`commit_encoded` takes them, with
        ``"index"`` set for a single-row commit). Returns, in item order, each commit's result or
        the error that refused it (nothing of it was written). Every result is durable when this
        returns.
        """
        t0 = time.perf_counter()
        jobs, out = [], []
        for item in items:
            try:
                lease = item["lease"]
                self._check_lease(lease)
                end_weight = args.optional_integer("end_weight", item.get("end_weight"))
                whole = item.get("index") is None
                if "encoded" in item:
                    checked = check_encoded(self.schema, self.config.group_size, lease.group_id, item["encoded"])
                    if not whole and [r.index for r in checked] != [item["index"]]:
                        raise SchemaMismatch(f"a single-row commit of group {lease.group_id!r} must carry "
                                             f"exactly row {item['index']!r}")
                    jobs.append((lease, checked, end_weight, whole))
                else:
                    rows = item["rows"] if whole else {args.integer("index", item["index"], minimum=None): item["rows"]}
                    jobs.append((lease, self._encoder.encode(lease, rows), end_weight, whole))
                out.append(None)
            except KvckptError as exc:
                out.append(exc)
            except (KeyError, TypeError) as exc:
                out.append(BadArgument(f"a commit_many item needs lease and rows (and optionally end_weight, "
                                       f"index): {exc!r}"))
        results = iter(self._commit_all(jobs, t0))
        return [next(results) if slot is None else slot for slot in out]

    def _commit(self, lease: Lease, encoded: list[CheckedRow], end_weight: int | None, whole: bool,
                t0: float) -> CommitResult:
        [result] = self._commit_all([(lease, encoded, end_weight, whole)], t0)
        if isinstance(result, BaseException):
            raise result
        return result

    def _commit_all(self, jobs: list[tuple[Lease, list[CheckedRow], int | None, bool]], t0: float) -> list[Any]:
        """Run commit transitions through the group committer: each acknowledged once durable."""
        results = self.committer.submit_many([
            functools.partial(self._commit_txn, lease=lease, encoded=encoded, end_weight=end_weight, whole=whole)
            for lease, encoded, end_weight, whole in jobs])
        self._notify()
        elapsed = time.perf_counter() - t0
        for (lease, _, _, _), result in zip(jobs, results, strict=True):
            if isinstance(result, StaleAttempt):
                log.warning("%s: fenced a commit of group %r (%s differs): %s", self.path, lease.group_id,
                            result.differs, result)
            elif not isinstance(result, BaseException):
                self._latencies.append(elapsed)
        if elapsed >= SLOW_COMMIT_SECONDS:
            log.warning("%s: %d commit(s) took %.2fs (encode and durable transaction)", self.path, len(jobs), elapsed)
        return results

    def _check_lease(self, lease: Any) -> None:
        """What can be refused before encoding: not a lease, or a group size the store does not have."""
        if not isinstance(lease, Lease):
            raise BadArgument(f"commits take a Lease (from admit, redispatch or a recovery plan; Lease.from_dict "
                              f"for one sent over the wire), got {type(lease).__name__}")
        if lease.group_size != self.config.group_size:
            raise LeaseMismatch(f"commit of group {lease.group_id!r} refused: the lease says group_size="
                                f"{lease.group_size!r} but this store's groups have {self.config.group_size} rows; "
                                "nothing was written", "group_size")

    def _commit_txn(self, txn: Txn, *, lease: Lease, encoded: list[CheckedRow], end_weight: int | None,
                    whole: bool) -> CommitResult:
        gid = lease.group_id
        entry = self._entry(txn, gid)
        digests = {str(r.index): self._digest(r.value) for r in encoded}
        if entry is None:
            return self._replayed_commit(txn, lease, digests)
        _fence(lease, self.store.store_id, entry.timeline, entry.attempt, "in flight")
        _check_against_entry(lease, entry)
        siblings = set(entry.siblings)
        merged = dict(entry.digests)
        if not whole:
            for r in encoded:
                if r.index in siblings:
                    if merged.get(str(r.index)) == digests[str(r.index)]:
                        return CommitResult(gid, ready=False, replayed=True)
                    raise DuplicateCommit(f"row {keys.row_id(gid, r.index)} is already committed "
                                          "with other content")
        self._check_shapes(txn, encoded)
        st = self._state(txn)
        raw, stored = entry.raw_bytes, entry.stored_bytes
        for r in encoded:
            key = keys.row_key(gid, r.index)
            if r.index in siblings:  # a whole commit regenerated a kept sibling: it replaces it
                old = txn.get("rows", key)
                raw -= codec.decode(old, f"rows/{keys.row_id(gid, r.index)}").nbytes
                stored -= len(old)
            txn.put("rows", key, r.value)
            raw += r.raw_bytes
            stored += len(r.value)
        st["counters"]["raw_bytes"] += raw - entry.raw_bytes
        st["counters"]["stored_bytes"] += stored - entry.stored_bytes
        merged.update(digests)
        siblings.update(r.index for r in encoded)
        if not whole:
            st["counters"]["samples_committed"] += len(encoded)
        if len(siblings) < entry.group_size:
            self._put_entry(txn, LedgerEntry.from_dict({
                **entry.to_dict(), "siblings": tuple(sorted(siblings)), "digests": merged,
                "raw_bytes": raw, "stored_bytes": stored}))
            txn.put_json("meta", STATE_KEY, st)
            return CommitResult(gid, ready=False, rows_written=len(encoded))
        group = GroupInfo(
            gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size, READY,
            entry.start_weight, st["weight_version"] if end_weight is None else int(end_weight),
            entry.target_step, entry.attempt,
            self._digest("".join(merged[str(i)] for i in range(entry.group_size)).encode()),
            raw_bytes=raw, stored_bytes=stored, timeline=entry.timeline)
        txn.delete("ledger", keys.group_key(gid))
        self._pending_index(txn, entry, add=False)
        self._put_group(txn, group)
        self._ready_index(txn, group, add=True)
        st["inflight"] -= 1
        st["ready"] += 1
        st["counters"]["committed"] += 1
        txn.put_json("meta", STATE_KEY, st)
        return CommitResult(gid, ready=True, rows_written=len(encoded))

    def _replayed_commit(self, txn: Txn, lease: Lease, digests: dict[str, str]) -> CommitResult:
        gid = lease.group_id
        group = self._group(txn, gid)
        if group is None:
            raise UnknownGroup(f"group {gid!r} is neither in flight nor committed in this store; "
                               "nothing was written")
        if group.state in (EVICTED, ABORTED):
            raise UnknownGroup(f"group {gid!r} was {group.state} ({group.reason or 'no reason'}); "
                               "the commit was refused and wrote nothing")
        _fence(lease, self.store.store_id, group.timeline, group.attempt, f"committed ({group.state})")
        if group.rows_stored:
            stored = {str(int.from_bytes(k[-4:], "big")): self._digest(v)
                      for k, v in txn.iter_prefix("rows", keys.row_prefix(gid))}
            if all(stored.get(i) == d for i, d in digests.items()):
                return CommitResult(gid, ready=True, replayed=True)
        raise DuplicateCommit(f"group {gid!r} is already committed ({group.state}) with other content; "
                              "nothing was written")

    # -- training side ---------------------------------------------------------------------------
    def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """Claim up to ``max_groups`` eligible ready groups for the current step (one transaction).

        Fewer than ``min_groups`` eligible gives an empty selection and writes nothing. Claimed
        groups' rows stay readable (:meth:`read_batch`) until :meth:`finish_step`.
        """
        max_groups = self.config.groups_per_step if max_groups is None else max_groups

        def txn_fn(txn: Txn) -> Selection:
            st = self._state(txn)
            step = st["trainer_version"]
            gids = self.sampler.select(BufferView(txn), step, min_groups, max_groups)
            claimed = []
            for group in self._resolve(txn, gids):
                if group.state != READY:
                    raise InvariantViolation(f"sampler chose group {group.group_id!r} in state {group.state}")
                self._ready_index(txn, group, add=False)
                group = GroupInfo.from_dict({**group.to_dict(), "state": CLAIMED, "claimed_step": step})
                self._put_group(txn, group)
                self._step_index(txn, keys.CLAIMED_BY_STEP, step, group, add=True)
                claimed.append(group)
            if claimed:
                st["ready"] -= len(claimed)
                st["claimed"] += len(claimed)
                st["counters"]["selected"] += len(claimed)
                txn.put_json("meta", STATE_KEY, st)
            return Selection(step, tuple(claimed))

        return self._write(txn_fn)

    def finish_step(self, *, weight_version: int | None = None) -> int:
        """Close the current step: its claimed groups -> consumed, ``trainer_version`` + 1.

        The rollout weight version follows the trainer (set ``weight_version`` if the weight sync
        is not immediate). Consumed rows stay stored until enough checkpoints cover their step
        (``durable_checkpoints``), then are dropped here unless ``retain_consumed``.

        Returns:
            The new trainer version.
        """
        def txn_fn(txn: Txn) -> int:
            st = self._state(txn)
            step = st["trainer_version"]
            prefix = keys.CLAIMED_BY_STEP + keys.i64(step)
            gids = [gid.decode() for _, gid in txn.iter_prefix("index", prefix)]
            for group in self._resolve(txn, gids):
                self._step_index(txn, keys.CLAIMED_BY_STEP, step, group, add=False)
                group = GroupInfo.from_dict({**group.to_dict(), "state": CONSUMED, "consumed_step": step})
                self._put_group(txn, group)
                self._step_index(txn, keys.CONSUMED_BY_STEP, step, group, add=True)
            st["claimed"] -= len(gids)
            st["counters"]["consumed"] += len(gids)
            st["trainer_version"] = step + 1
            st["weight_version"] = step + 1 if weight_version is None else int(weight_version)
            self._drop_consumed(txn, st)
            txn.put_json("meta", STATE_KEY, st)
            return st["trainer_version"]

        return self._write(txn_fn)

    def _drop_consumed(self, txn: Txn, st: dict[str, Any]) -> None:
        """Drop rows of groups consumed before the oldest kept durable checkpoint."""
        if self.config.retain_consumed or len(st["durable"]) < self.config.durable_checkpoints:
            return
        floor = st["durable"][-self.config.durable_checkpoints]
        if floor <= st["drop_floor"]:
            return
        stop = keys.CONSUMED_BY_STEP + keys.i64(floor)
        doomed = [(k, v.decode()) for k, v in txn.iter_prefix("index", keys.CONSUMED_BY_STEP) if k < stop]
        for key, gid in doomed:
            txn.delete("index", key)
            self._delete_rows(txn, gid)
            group = self._group(txn, gid)
            self._put_group(txn, GroupInfo.from_dict({**group.to_dict(), "rows_stored": False}))
        st["drop_floor"] = floor

    def evict(self, group_ids: Iterable[str] | None = None) -> list[str]:
        """Remove ready groups the sampler can no longer select (their rows are deleted).

        Restore never evicts; the first ``evict`` after it applies the current window.

        Args:
            group_ids: discard exactly these ready groups instead (a deliberate discard, e.g.
                NeMo-RL's ``remove_group`` of a committed slot). Defaults to the sampler's choice.

        Raises:
            BadArgument: a named group is not ready (nothing is evicted then).
        """
        def txn_fn(txn: Txn) -> list[str]:
            st = self._state(txn)
            if group_ids is None:
                gids = list(self.sampler.evictable(BufferView(txn), st["trainer_version"]))
                reason = f"outside {self.sampler.name} window at version {st['trainer_version']}"
            else:
                gids, reason = list(dict.fromkeys(group_ids)), "discarded by the caller"
                for gid in gids:
                    group = self._group(txn, gid)
                    if group is None or group.state != READY:
                        raise BadArgument(f"group {gid!r} is {'unknown' if group is None else group.state}, "
                                          "not ready: only ready groups can be evicted")
            for group in self._resolve(txn, gids):
                self._ready_index(txn, group, add=False)
                self._delete_rows(txn, group.group_id)
                self._put_group(txn, GroupInfo.from_dict({
                    **group.to_dict(), "state": EVICTED, "rows_stored": False, "reason": reason}))
            if gids:
                st["ready"] -= len(gids)
                st["counters"]["evicted"] += len(gids)
                txn.put_json("meta", STATE_KEY, st)
            return gids

        return self._write(txn_fn)

    def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``
        (NeMo-RL's in_order top-up for a step left short by a dropped prompt), in one transaction.

        Returns:
            The lender's step (which now lacks a group), or ``None`` if no later ready group exists.
        """
        def txn_fn(txn: Txn) -> int | None:
            cur = txn.cursor("index")
            upper = keys.READY_BY_TARGET + b"\xff"
            if not cur.set_range(upper):
                cur.last()
            elif not cur.prev():
                return None
            key = cur.key()
            if not key.startswith(keys.READY_BY_TARGET):
                return None
            lender = keys.from_i64(key[len(keys.READY_BY_TARGET):len(keys.READY_BY_TARGET) + 8])
            if lender <= to_target_step:
                return None
            [group] = self._resolve(txn, [cur.value().decode()])
            self._ready_index(txn, group, add=False)
            group = GroupInfo.from_dict({**group.to_dict(), "target_step": int(to_target_step)})
            self._put_group(txn, group)
            self._ready_index(txn, group, add=True)
            return lender

        return self._write(txn_fn)

    def redispatch(self, group_id: str, *, start_weight: int | None = None) -> Lease:
        """Hand an in-flight prompt to a new attempt: its ``attempt`` + 1 (fencing the old lease)
        and, if given, a new ``start_weight`` (the weight it is now generated with), in one
        transaction. Siblings already committed one by one are kept (``lease.missing``).

        Raises:
            UnknownGroup: no ledger entry for ``group_id``.
        """
        args.identifier("group_id", group_id)
        start_weight = args.optional_integer("start_weight", start_weight)

        def txn_fn(txn: Txn) -> Lease:
            entry = self._entry(txn, group_id)
            if entry is None:
                raise UnknownGroup(f"group {group_id!r} is not in flight; nothing to redispatch")
            self._pending_index(txn, entry, add=False)
            st = self._state(txn)
            entry = LedgerEntry.from_dict({
                **entry.to_dict(), "attempt": entry.attempt + 1, "timeline": st["timeline"],
                "start_weight": entry.start_weight if start_weight is None else start_weight})
            self._put_entry(txn, entry)
            self._pending_index(txn, entry, add=True)
            st["counters"]["redispatched"] += 1
            txn.put_json("meta", STATE_KEY, st)
            return entry.lease(self.store.store_id)

        return self._write(txn_fn)

    def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt: ledger entry -> aborted tombstone with ``reason``, its
        partial rows deleted, and ``batch_shortfall[target_step]`` credited.

        Raises:
            UnknownGroup: no ledger entry for ``group_id``.
        """
        self._write(lambda txn: self._abort_txn(txn, [group_id], reason))

    def abort_stale_inflight(self) -> list[str]:
        """Abort every in-flight prompt the sampler says is useless now (only ``windowed`` has any)."""
        def txn_fn(txn: Txn) -> list[str]:
            st = self._state(txn)
            gids = list(self.sampler.inflight_to_abort(BufferView(txn), st["trainer_version"]))
            if gids:
                self._abort_txn(txn, gids, f"stale at version {st['trainer_version']}")
            return gids

        return self._write(txn_fn)

    def _abort_txn(self, txn: Txn, gids: list[str], reason: str) -> None:
        st = self._state(txn)
        shortfall = txn.get_json("meta", SHORTFALL_KEY) or {}
        for gid in gids:
            entry = self._entry(txn, gid)
            if entry is None:
                raise UnknownGroup(f"group {gid!r} is not in flight; nothing to abort")
            txn.delete("ledger", keys.group_key(gid))
            self._pending_index(txn, entry, add=False)
            self._delete_rows(txn, gid)
            self._put_group(txn, GroupInfo(
                gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size,
                ABORTED, entry.start_weight, -1, entry.target_step, entry.attempt, "", rows_stored=False,
                reason=reason, timeline=entry.timeline))
            if entry.target_step is not None:
                shortfall[str(entry.target_step)] = shortfall.get(str(entry.target_step), 0) + 1
        st["inflight"] -= len(gids)
        st["counters"]["aborted"] += len(gids)
        txn.put_json("meta", SHORTFALL_KEY, shortfall)
        txn.put_json("meta", STATE_KEY, st)

    # -- reading ---------------------------------------------------------------------------------
    def read_batch(self, groups: Selection | Iterable[str], *, fields: Sequence[str] | None = None,
                   layout: str = "padded", pad_value: float = 0) -> Batch:
        """Read the rows of the given groups as torch tensors; no transaction stays open.

        Args:
            groups: a :class:`Selection` or group ids (claimed, ready or retained consumed).
            fields: fields to return. Defaults to every stored field.
            layout: ``"padded"`` (``[N, L_max]``), ``"packed"`` (1-D plus ``cu_seqlens``) or
                ``"list"`` (one dict per row). Defaults to ``"padded"``.
            pad_value: fill value for padded token fields. Defaults to 0.

        Raises:
            NotSelectable: a group has no stored rows (evicted, aborted, dropped or unknown).
            CorruptRecord: a row failed its checksum or does not match the store's schema.
            InvariantViolation: a row's payload names another group or index than its key.
            SchemaMismatch: rows whose shapes do not stack (only in a store written before shapes
                were pinned); the list layout reads them.
        """
        if layout not in ("padded", "packed", "list"):
            raise BadArgument(f"layout must be padded, packed or list, got {layout!r}")
        unknown = sorted(set(fields or ()) - set(self.schema.fields))
        if unknown:
            raise BadArgument(f"fields {unknown} are not in the store's schema {list(self.schema.fields)}")
        gids = groups.group_ids if isinstance(groups, Selection) else list(groups)

        def txn_fn(txn: Txn) -> tuple[list[GroupInfo], list[tuple[str, int, bytes]], dict[str, Any]]:
            infos, raw = [], []
            for gid in gids:
                group = self._group(txn, gid)
                if group is None or not group.rows_stored or group.state in (EVICTED, ABORTED):
                    state = "unknown" if group is None else f"{group.state}, rows stored: {group.rows_stored}"
                    raise NotSelectable(f"group {gid!r} has no readable rows ({state})")
                infos.append(group)
                for key, value in txn.iter_prefix("rows", keys.row_prefix(gid)):
                    raw.append((gid, int.from_bytes(key[-4:], "big"), value))
            pins = txn.get_json("meta", SHAPES_KEY) or {}
            return infos, raw, pins if isinstance(pins, dict) else {}

        infos, raw, pins = self.store.read(txn_fn)
        check_group_rows(infos, raw)
        try:
            limits = self.schema.limits(pins)
        except SchemaMismatch as exc:  # meta/shapes is checksummed JSON, but not what a writer stores
            raise CorruptRecord("meta/shapes", str(exc)) from None
        decoded = []
        for gid, index, value in raw:
            record = codec.decode(value, f"rows/{keys.row_id(gid, index)}", limits=limits)
            if record.meta.get("group_id") != gid or record.meta.get("index") != index:
                raise InvariantViolation(f"row {keys.row_id(gid, index)} holds the payload of "
                                         f"{record.meta.get('group_id')!r} row {record.meta.get('index')!r}")
            try:
                self.schema.check_record(record, f"rows/{keys.row_id(gid, index)}")
            except SchemaMismatch as exc:  # a stored row the store's own schema refuses is damage
                raise CorruptRecord(f"rows/{keys.row_id(gid, index)}", str(exc)) from None
            decoded.append({k: v for k, v in record.tensors().items() if fields is None or k in fields})
        return _assemble(self.schema, infos, raw, decoded, layout, pad_value)

    # -- inspection ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Cursors, counts and counters as one consistent dict (a copy)."""
        return self.store.read(self._state)

    @property
    def trainer_version(self) -> int:
        """The current training step (number of finished steps)."""
        return self.state()["trainer_version"]

    def group(self, group_id: str) -> GroupInfo | None:
        """A group's record (any state), or ``None``."""
        return self.store.read(lambda t: self._group(t, group_id))

    def ledger(self) -> list[LedgerEntry]:
        """Every in-flight prompt, in dispatch order."""
        entries = self.store.read(lambda t: [LedgerEntry.from_dict(codec.decode_meta(v, f"ledger/{k!r}"))
                                             for k, v in t.iter_prefix("ledger", b"")])
        return sorted(entries, key=lambda e: e.seq)

    def groups(self, states: Iterable[str] | None = None) -> list[GroupInfo]:
        """Group records (optionally filtered by state), in dispatch order."""
        wanted = None if states is None else set(states)
        docs = self.store.read(lambda t: [GroupInfo.from_dict(codec.decode_meta(v, f"groups/{k!r}"))
                                          for k, v in t.iter_prefix("groups", b"")])
        return sorted((g for g in docs if wanted is None or g.state in wanted), key=lambda g: g.seq)

    def dataloader_state(self) -> bytes | None:
        """The dataloader state stored with the last admission (or restored), or ``None``."""
        value = self.store.read(lambda t: t.get("meta", DATALOADER_KEY))
        return None if value is None else codec.decode(value, "meta/dataloader").arrays["state"].tobytes()

    def batch_shortfall(self) -> dict[int, int]:
        """Prompts aborted per target step (the step closes that many groups short)."""
        doc = self.store.read(lambda t: t.get_json("meta", SHORTFALL_KEY)) or {}
        return {int(k): v for k, v in doc.items()}

    def count_for_target_step(self, step: int) -> int:
        """In-flight plus ready groups stamped for ``step`` (NeMo-RL's top-up guard)."""
        def txn_fn(txn: Txn) -> int:
            ready = sum(1 for _ in BufferView(txn).ready_for_target(step))
            pending = sum(1 for _, v in txn.iter_prefix("ledger", b"")
                          if codec.decode_meta(v).get("target_step") == step)
            return ready + pending
        return self.store.read(txn_fn)

    def stats(self) -> dict[str, Any]:
        """Counters users graph: admitted, committed, selected, consumed, evicted, aborted, ledger
        size, bytes raw and stored, this process's commit latency percentiles (seconds), and the
        writer's last reader check (``oldest_reader_lag``: commits the oldest open snapshot is
        behind; ``stale_readers_cleared``; see :meth:`kvckpt.storage.store.Store.check_readers`), and the group
        committer's ``commit_transactions`` (durable transactions) and ``commit_transitions`` (commits they held)."""
        st = self.state()
        lat = sorted(self._latencies)
        out = dict(st["counters"])
        out.update(ledger_size=st["inflight"], ready=st["ready"], claimed=st["claimed"],
                   trainer_version=st["trainer_version"], dispatch_index=st["dispatch_index"],
                   file_bytes=self.store.file_size(), **self.store.reader_stats,
                   commit_transactions=self.committer.stats["transactions"],
                   commit_transitions=self.committer.stats["transitions"])
        if lat:
            out.update(commit_latency_p50=lat[len(lat) // 2], commit_latency_p99=lat[int(len(lat) * 0.99)])
        return out

    def wait_for_change(self, timeout: float) -> None:
        """Block until another thread of this process commits a transaction, or ``timeout``."""
        with self._changed:
            self._changed.wait(timeout)

    # -- recovery --------------------------------------------------------------------------------
    def recover(self, resume_version: int | None = None, *, sampler: Any = None,
                max_buffered_rollouts: int | None = None, checksums: bool = False, deep: bool = False) -> Any:
        """Reconcile the store to a trainer version and fence in-flight work (one transaction).

        See :func:`kvckpt.durability.recovery.recover` for the full contract; this is its method form.
        """
        from kvckpt.durability.recovery import recover

        return recover(self, resume_version, sampler=sampler, max_buffered_rollouts=max_buffered_rollouts,
                       checksums=checksums, deep=deep)

    def checkpoint(self, dest: str, trainer_state: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """Stamp and copy a checkpoint in the background; see :func:`kvckpt.durability.checkpoint.checkpoint`."""
        from kvckpt.durability.checkpoint import checkpoint

        return checkpoint(self, dest, trainer_state, **kwargs)


def _assemble(schema: RowSchema, infos: list[GroupInfo], raw: list[tuple[str, int, bytes]],
              decoded: list[dict[str, Any]], layout: str, pad_value: float) -> Batch:
    import torch

    by_gid = {g.group_id: g for g in infos}
    for gid, group in by_gid.items():
        count = sum(1 for g, _, _ in raw if g == gid)
        if count != group.group_size:
            raise InvariantViolation(f"group {gid!r} has {count} stored rows, expected {group.group_size}")
    token = [f for f in schema.token_fields if decoded and f in decoded[0]]
    lengths = torch.tensor([int(row[token[0]].shape[0]) if token else 0 for row in decoded], dtype=torch.int64)
    batch = Batch([g for g, _, _ in raw], [i for _, i, _ in raw], lengths, groups=infos)
    if layout == "list":
        batch.rows = decoded
        return batch
    if not decoded:
        return batch
    for name in decoded[0]:
        values = [row[name] for row in decoded if name in row]
        if len(values) != len(decoded):
            continue  # an optional field some rows lack: only available in the list layout
        if schema.fields[name].dtype in codec.TEXT_DTYPES:
            batch.tensors[name] = values  # text: one str / bytes per row
            continue
        _check_stackable(name, name in token, values, raw)
        if name in token:
            if layout == "packed":
                batch.tensors[name] = torch.cat(values)
            else:
                batch.tensors[name] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True,
                                                                      padding_value=pad_value)
        else:
            batch.tensors[name] = torch.stack(values)
    if layout == "packed":
        batch.cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return batch


def _check_stackable(name: str, token: bool, values: list[Any], raw: list[tuple[str, int, bytes]]) -> None:
    """Refuse (instead of a torch error) rows whose shapes cannot be stacked: only a store written
    before shapes were pinned can hold them."""
    first = tuple(values[0].shape[1:] if token else values[0].shape)
    for value, (gid, index, _) in zip(values, raw, strict=True):
        shape = tuple(value.shape[1:] if token else value.shape)
        if shape != first:
            part = "trailing dims" if token else "shape"
            raise SchemaMismatch(f"rows {keys.row_id(raw[0][0], raw[0][1])} and {keys.row_id(gid, index)}: field "
                                 f"{name!r} has {part} {list(first)} and {list(shape)}, which do not stack (the "
                                 "store predates shape pinning); read them with layout='list'")


def _as_prompt(value: Any) -> Prompt:
    """A :class:`Prompt` from what ``admit`` accepts; anything else is a :class:`BadArgument`."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"prompt_idx", "task_name", "group_id"})
        if unknown or "prompt_idx" not in value:
            raise BadArgument(f"a prompt dict needs prompt_idx (and optionally task_name, group_id); "
                              f"got keys {sorted(value)}")
        return Prompt(**value)
    return Prompt(prompt_idx=value)


def _check_dataloader_state(value: Any) -> None:
    if value is not None and not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"dataloader_state must be bytes (the trainer's opaque state), got {type(value).__name__}")


def _fence(lease: Lease, store_id: str, timeline: str, attempt: int, where: str) -> None:
    """Refuse ``lease`` unless its store id, timeline and attempt are exactly the current ones."""
    gid = lease.group_id
    if lease.store_id != store_id:
        issued = f"store {lease.store_id}" if lease.store_id else "a kvckpt that issued no store id"
        raise ForeignLease(f"commit of group {gid!r} refused: the lease was issued by {issued}, not by this "
                           f"store ({store_id}); nothing was written")
    if lease.timeline != timeline:
        raise AbandonedTimeline(
            f"commit of group {gid!r} refused: the lease belongs to timeline {lease.timeline or '(none)'}, but the "
            f"group is {where} on timeline {timeline} (a restore or recovery came after the lease was issued: "
            "this worker is a zombie); nothing was written")
    if lease.attempt != attempt:
        older = "older than" if lease.attempt < attempt else "newer than"
        raise StaleAttempt(f"commit of group {gid!r} under attempt {lease.attempt} refused: it is {older} the "
                           f"current attempt {attempt} (the lease was fenced by a redispatch); nothing was written")


_LEASE_AUTHORITY = ("group_size", "prompt_idx", "task_name", "admission_id", "target_step", "start_weight")


def _check_against_entry(lease: Lease, entry: LedgerEntry) -> None:
    """Refuse a lease whose description of the group differs from its ledger entry's."""
    for name in _LEASE_AUTHORITY:
        if getattr(lease, name) != getattr(entry, name):
            raise LeaseMismatch(f"commit of group {lease.group_id!r} refused: the lease says {name}="
                                f"{getattr(lease, name)!r} but the ledger entry holds {getattr(entry, name)!r}; "
                                "nothing was written", name)


def _upgrade_from_v1(store: Store) -> None:
    """Upgrade a format-1 store in place, in one transaction: give it a timeline and move every
    ledger entry onto it with its attempt bumped, so leases a version-1 kvckpt issued (which
    carry no store id or timeline) are fenced rather than trusted."""
    def txn_fn(txn: Txn) -> None:
        st = txn.get_json("meta", STATE_KEY)
        if st is None:
            raise InvariantViolation("meta/state is missing")
        st["timeline"] = new_timeline()
        for key, value in list(txn.iter_prefix("ledger", b"")):
            entry = LedgerEntry.from_dict(codec.decode_meta(value, f"ledger/{key!r}"))
            txn.put_json("ledger", key, LedgerEntry.from_dict(
                {**entry.to_dict(), "attempt": entry.attempt + 1, "timeline": st["timeline"]}).to_dict())
        txn.put_json("meta", STATE_KEY, st)
        txn.put_json("meta", b"format", {**store.info, "version": FORMAT_VERSION, "upgraded_from": 1})

    store.write(txn_fn)
    store.info = {**store.info, "version": FORMAT_VERSION, "upgraded_from": 1}
