"""The replay buffer facade: each public method runs one transition (:mod:`kvckpt.transitions`)
in one durable write transaction over one store.

Every state transition is exactly one durable LMDB write transaction (the table of what each one
writes atomically, and where it lives, is in :mod:`kvckpt.transitions`), so there is no moment,
on disk or in memory, where a prompt is both a committed group and a ledger entry, or neither.
Row payloads are encoded (and checksummed) before the transaction starts, outside the store's
writer lock; the transaction itself only puts bytes.

A prompt's life: ``admit`` -> ledger entry (lease) -> ``commit_group`` -> ``ready`` ->
``select`` -> ``claimed`` -> ``finish_step`` -> ``consumed`` (rows dropped once a checkpoint
covers the step, or kept with ``retain_consumed``). Side exits: ``evict`` (ready, out of window)
and ``abort`` (in flight). Group records stay as small tombstones so every prompt that ever left
the dataloader remains accounted for.

The module is long (about 830 lines) only because every public method carries its whole contract
(arguments, refusals, what is written) in its docstring; the logic is in :mod:`kvckpt.transitions`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvckpt import args
from kvckpt.buffer.batch import LAYOUTS, Batch, assemble_batch, decode_rows, read_groups
from kvckpt.durability.checkpoint import CheckpointHandle, checkpoint_store
from kvckpt.durability.format import buffer_config, malformed_config
from kvckpt.durability.recovery import RecoveryPlan, recover_store
from kvckpt.durability.safe_open import open_readonly
from kvckpt.errors import (
    BadArgument,
    CapacityError,
    GateTimeout,
    KvckptError,
    SchemaMismatch,
    StaleAttempt,
    StoreNotFound,
)
from kvckpt.samplers import Sampler
from kvckpt.storage.encoding import CheckedRow, EncodedRow, RowEncoder, check_encoded
from kvckpt.storage.group_commit import GroupCommitter
from kvckpt.storage.progress_message import ProgressEncoder, ProgressMessage, decode_message
from kvckpt.storage.replace import durable_replace
from kvckpt.storage.schema import RowSchema
from kvckpt.storage.store import Store, Txn, makedirs_durable
from kvckpt.tables import meta
from kvckpt.tables.access import Tables
from kvckpt.tables.records import (
    Admission,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Progress,
    Prompt,
    Selection,
)
from kvckpt.tables.view import BufferView
from kvckpt.transitions import admission as _admission
from kvckpt.transitions import commit, inflight, progress, progress_step, training
from kvckpt.transitions.config import BufferConfig
from kvckpt.transitions.fencing import check_lease

log = logging.getLogger("kvckpt.buffer")
#: A wait for the gate logs a warning this often (seconds).
WAIT_LOG_SECONDS = 30.0
#: A commit slower than this (seconds, encode and durable transaction) is logged as slow.
SLOW_COMMIT_SECONDS = 1.0
#: One commit job: lease, checked rows, end weight, whole group or one row.
_Job = tuple[Lease, list[CheckedRow], "int | None", bool]


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
        self.config: BufferConfig = buffer_config(store)
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
        if os.path.exists(path):
            raise BadArgument(f"{path!r} already exists; use ReplayBuffer.open to reopen it")
        kwargs = {"map_size": map_size} if map_size else {}
        makedirs_durable(os.path.dirname(os.path.abspath(path)))
        def init(txn: Txn) -> None:
            t = Tables(txn)
            t.put_config(config.to_dict())
            t.put_state(meta.new_state())
            t.put_shortfall({})

        try:  # made whole under a private name, then linked: a cut leaves a complete store or none
            with durable_replace(path, exclusive=True, leftovers=("-lock",)) as tmp, \
                    Store(tmp, create=True, **kwargs) as new:
                new.write(init)
        except FileExistsError:
            raise BadArgument(f"{path!r} already exists; use ReplayBuffer.open to reopen it") from None
        store = Store(path, **kwargs)
        try:
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
            raise malformed_config(path, exc) from None
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

    # -- running transitions ---------------------------------------------------------------------
    def _write(self, fn: Callable[[Tables], Any]) -> Any:
        """Run one transition in one durable write transaction and wake this process's waiters."""
        result = self.store.write(lambda txn: fn(Tables(txn)))
        self._notify()
        return result

    def _read(self, fn: Callable[[Tables], Any]) -> Any:
        return self.store.read(lambda txn: fn(Tables(txn)))

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- admission -------------------------------------------------------------------------------
    def admissible(self, count: int = 1) -> bool:
        """Whether ``count`` prompts could be admitted now (gate open and capacity free)."""
        return self._read(lambda t: _admission.blocker(self.config, t.state(), count) is None)

    def admit(self, prompts: Sequence[Prompt | int | Mapping[str, Any]], dataloader_state: bytes | None = None,
              *, timeout: float | None = None, weight_version: int | None = None,
              admission: Admission | None = None, holder: str | None = None) -> list[Lease]:
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
                (``start_weight``). Defaults to the buffer's current weight version. It may be
                ahead of the store's trainer and weight versions (NeMo-RL reserves with its
                generation weights before its trainer's step reaches the store); only a recovery
                given an older ``resume_version`` treats such a stamp as destroyed weights
                (docs/recovery.md, "Stamps after a rollback").
            admission: join an admission :meth:`advance_dispatch` already made instead of making
                one: no gate wait and no cursor advance; the prompts get its ``admission_id`` and
                ``target_step`` (only capacity is waited for). Defaults to a new admission.
            holder: the name of the producer the leases go to (an actor id, a node id: a name
                the producer gives), recorded in each ledger entry for :meth:`leases_held_by`.
                Defaults to none recorded.

        Raises:
            GateTimeout: the gate or capacity stayed closed for ``timeout`` seconds.
            CapacityError: the batch alone is larger than ``max_buffered_rollouts``.
            BadArgument: a duplicate or already-used group id, or an ``admission`` this store did
                not issue.
        """
        batch = [_as_prompt(p) for p in prompts]
        weight_version = args.optional_integer("weight_version", weight_version)
        holder = _holder(holder)
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
        return self._write_when_open(lambda t: _admission.admit(
            t, self.config, self.store.store_id, batch, dataloader_state, weight_version, admission, holder), timeout)

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
        return self._write_when_open(lambda t: _admission.advance(t, self.config, dataloader_state), timeout)

    def _write_when_open(self, fn: Callable[[Tables], Any], timeout: float | None) -> Any:
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

    # -- commits ---------------------------------------------------------------------------------
    def row_encoder(self) -> RowEncoder:
        """An encoder of rows for this store; build the same elsewhere with ``RowEncoder.from_config``."""
        return RowEncoder(self.schema, self.config.group_size, self.config.compression_level)

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
        check_lease(lease, self.config.group_size)
        end_weight = args.optional_integer("end_weight", end_weight)
        return self._commit(lease, self._encoder.encode(lease, rows), end_weight, True, t0)

    def commit_sample(self, lease: Lease, index: int, row: Mapping[str, Any],
                      *, end_weight: int | None = None) -> CommitResult:
        """Commit one row (sibling) of a group; the group becomes ready in the transaction that
        adds its last row. Same refusals and idempotence as :meth:`commit_group`."""
        t0 = time.perf_counter()
        check_lease(lease, self.config.group_size)
        end_weight = args.optional_integer("end_weight", end_weight)
        index = args.integer("index", index, minimum=None)
        return self._commit(lease, self._encoder.encode(lease, {index: row}), end_weight, False, t0)

    def commit_encoded(self, lease: Lease, rows: Sequence[EncodedRow | Mapping[str, Any]], *,
                       end_weight: int | None = None, whole: bool = True) -> CommitResult:
        """Commit rows a producer encoded itself (:class:`~kvckpt.storage.encoding.RowEncoder`), checked
        here without being rebuilt (:func:`~kvckpt.storage.encoding.check_encoded`).

        ``whole=True`` is :meth:`commit_group`'s semantics, ``False`` :meth:`commit_sample`'s (one
        row). Same refusals and idempotence; a record that fails its checks is a
        :class:`~kvckpt.errors.SchemaMismatch` and nothing is written.
        """
        t0 = time.perf_counter()
        check_lease(lease, self.config.group_size)
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
        jobs, out = _prepare_each(items, self._job, "commit_many", "lease and rows (and optionally end_weight, index)")
        return _merge(out, self._commit_all(jobs, t0))

    def _job(self, item: Mapping[str, Any]) -> _Job:
        """One ``commit_many`` item, checked and encoded (or its encoded rows checked)."""
        lease = item["lease"]
        check_lease(lease, self.config.group_size)
        end_weight = args.optional_integer("end_weight", item.get("end_weight"))
        whole = item.get("index") is None
        if "encoded" in item:
            checked = check_encoded(self.schema, self.config.group_size, lease.group_id, item["encoded"])
            if not whole and [r.index for r in checked] != [item["index"]]:
                raise SchemaMismatch(f"a single-row commit of group {lease.group_id!r} must carry "
                                     f"exactly row {item['index']!r}")
            return lease, checked, end_weight, whole
        rows = item["rows"] if whole else {args.integer("index", item["index"], minimum=None): item["rows"]}
        return lease, self._encoder.encode(lease, rows), end_weight, whole

    def _commit(self, lease: Lease, encoded: list[CheckedRow], end_weight: int | None, whole: bool,
                t0: float) -> CommitResult:
        [result] = self._commit_all([(lease, encoded, end_weight, whole)], t0)
        if isinstance(result, BaseException):
            raise result
        return result

    def _commit_all(self, jobs: list[_Job], t0: float) -> list[Any]:
        """Run commit transitions through the group committer: each acknowledged once durable."""
        def transition(txn: Txn, job: _Job) -> CommitResult:
            lease, encoded, end_weight, whole = job
            return commit.commit(Tables(txn), self.schema, self.store.store_id, lease, encoded, end_weight, whole)

        results = self.committer.submit_many([functools.partial(transition, job=job) for job in jobs])
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

    # -- token progress --------------------------------------------------------------------------
    def record_progress(self, lease: Lease, index: int, *, start: int, tokens: Any, logprobs: Any,
                        weight_version: int, fields: Mapping[str, Any] | None = None) -> int:
        """Make the next chunk of sample ``index``'s completion durable: the tokens generated from
        position ``start`` on, their logprobs, the weight version that produced them and any
        per-token generation ``fields`` the schema declares. One durable transaction (through the
        group committer); returns where the chunk ends (the sample's durable prefix length afterwards).

        Retrying the same chunk at the same ``start`` is a no-op answered as its first try was
        (where the chunk ends), even once the lease has been fenced since (:meth:`record_progress_many`).
        The commit of the sample's row later checks that the row's completion begins with the
        prefix and deletes it (docs/recovery.md, "Progress").

        Raises:
            StaleAttempt (or a subclass), LeaseMismatch, UnknownGroup: the lease is fenced or its
                group is not in flight, exactly as for a commit.
            SampleCommitted: the sample's row is already committed.
            FutureVersion: ``weight_version`` is newer than the buffer's trainer and weight versions.
            DuplicateCommit: another chunk already covers position ``start``.
            BadArgument: ``start`` is past the durable prefix (a gap), an empty chunk, an index
                outside the group, a field that is not a per-token field of the schema.
            SchemaMismatch: tokens and logprobs of different lengths, a lossy cast, or a prefix
                longer than the schema's ``max_tokens``.
        """
        [result] = self.record_progress_many([{"lease": lease, "index": index, "start": start, "tokens": tokens,
                                               "logprobs": logprobs, "weight_version": weight_version,
                                               "fields": fields}])
        if isinstance(result, BaseException):
            raise result
        return result

    def record_progress_many(self, items: Sequence[Mapping[str, Any]]) -> list[int | KvckptError]:
        """Record several chunks (:meth:`record_progress`'s keyword arguments plus ``lease`` and
        ``index`` per item) in one durable transaction, each its own transition: a refused item
        writes nothing and does not stop the others. Returns, in item order, where each chunk ends
        (its durable prefix afterwards) or the error that refused the item. Every result is durable
        when this returns.

        A convenience over the one wire form: the items become one step message
        (:meth:`~kvckpt.ProgressEncoder.encode_items`; one per distinct set of ``fields``) recorded as
        :meth:`record_progress_steps` records it, so a resend of the same items is answered as a
        message's resend is (the first answer again, even after the lease was fenced since, when the
        identical chunk landed), never as :class:`~kvckpt.StaleAttempt`."""
        out: list[Any] = [None] * len(items)
        checked: list[dict[str, Any]] = []
        by_fields: dict[tuple[str, ...], list[int]] = {}
        for n, item in enumerate(items):
            try:  # an item refused here is refused alone (nothing of it is written)
                check_lease(item["lease"], self.config.group_size)
                index, start, version, arrays, _ = progress.check_chunk(
                    self.schema, item["lease"], item["index"], item["start"], item["tokens"], item["logprobs"],
                    item["weight_version"], item.get("fields"))
                fields = {k[len(progress.FIELD_PREFIX):]: v for k, v in arrays.items()
                          if k.startswith(progress.FIELD_PREFIX)}
                by_fields.setdefault(tuple(sorted(fields)), []).append(len(checked))
                checked.append({"lease": item["lease"], "index": index, "start": start, "tokens": arrays["tokens"],
                                "logprobs": arrays["logprobs"], "weight_version": version, "fields": fields, "n": n})
            except KvckptError as exc:
                out[n] = exc
            except (KeyError, TypeError) as exc:
                out[n] = BadArgument(f"a record_progress_many item needs lease, index, start, tokens, logprobs and "
                                     f"weight_version (and optionally fields): {exc!r}")
        groups = [[checked[c] for c in group] for group in by_fields.values()]
        encoder = self.progress_encoder()
        results = self.record_progress_steps([encoder.encode_items(group) for group in groups])
        for group, result in zip(groups, results, strict=True):
            for item, one in zip(group, [result] * len(group) if isinstance(result, BaseException) else result,
                                 strict=True):
                out[item["n"]] = one
        return out

    def progress_encoder(self) -> ProgressEncoder:
        """An encoder of progress step messages for this store; build the same elsewhere with
        ``ProgressEncoder.from_config`` (docs/recovery.md, "Progress")."""
        return ProgressEncoder(self.schema)

    def record_progress_step(self, message: ProgressMessage | bytes) -> list[int | KvckptError]:
        """Record one engine step's progress, a :class:`~kvckpt.ProgressMessage` (one producer's
        sequences, columnar, checksummed at the edge): each sequence is its own transition, all in
        one durable transaction (through the group committer). Returns, per sequence in message
        order, where its chunk ends (``start + length``, its durable prefix afterwards) or the error
        that refused it (nothing of that sequence was written; the others are unaffected). Every
        result is durable when this returns. Sending the same message again after its first try
        landed (a lost acknowledgement, an owner restart) returns the same result per sequence
        and writes nothing (:mod:`kvckpt.transitions.progress_step`).

        Raises:
            MalformedMessage: the message as a whole: a failed checksum, a missing or mistyped
                field, arrays whose lengths disagree. Nothing of it was written.
        """
        [result] = self.record_progress_steps([message])
        if isinstance(result, BaseException):
            raise result
        return result

    def record_progress_steps(self, messages: Sequence[ProgressMessage | bytes],
                              ) -> list[list[int | KvckptError] | KvckptError]:
        """Several messages (:meth:`record_progress_step`) in one durable transaction: per message
        its per-sequence results, or the :class:`~kvckpt.MalformedMessage` that refused it whole."""
        def prepare(message: ProgressMessage | bytes) -> Callable[[Txn], list[int | KvckptError]]:
            try:
                sequences = progress_step.prepare(self.schema, self.config.group_size,
                                                  decode_message(self.schema, message))
            except (KeyError, TypeError) as exc:
                raise BadArgument(f"a record_progress_steps item needs ProgressMessage bytes: {exc!r}") from None
            return functools.partial(transition, sequences=sequences)

        def transition(txn: Txn, sequences: list[Any]) -> list[int | KvckptError]:
            return progress_step.record(Tables(txn), self.store.store_id, sequences)

        # prepared (decoded, judged, encoded) by whichever waiting caller holds the committer's preparer
        # role, while the batch before is written: see kvckpt/storage/group_commit.py
        return self.committer.submit_many(messages, prepare)

    def progress(self, lease_or_group_id: Lease | str) -> dict[int, Progress]:
        """The durable token prefix of every sample of a group that has one (``{}`` when none):
        what a new attempt (a lease from :meth:`recover`, :func:`kvckpt.restore` or
        :meth:`redispatch`) continues from; its first :meth:`record_progress` of sample ``i``
        has ``start=progress[i].length``. Read in one transaction; checked like any stored record.

        Raises:
            CorruptRecord: a stored chunk fails its checksum, is not one kvckpt writes, names another
                key, or the chunks of a sample overlap or leave a gap.
        """
        gid = lease_or_group_id.group_id if isinstance(lease_or_group_id, Lease) else lease_or_group_id
        args.identifier("group_id", gid)
        stored = self._read(lambda t: list(t.progress_chunks(gid)))
        import torch

        by_index: dict[int, list[Any]] = {}
        for index, start, value in stored:
            by_index.setdefault(index, []).append(progress.decode_chunk(self.schema, gid, index, start, value))
        found = {}
        for index, records in by_index.items():
            progress.check_contiguous(gid, index, records)
            tensors = [r.tensors() for r in records]
            # a field some chunk lacks has no value for every token: it is not part of the prefix
            names = [n[len(progress.FIELD_PREFIX):] for n in tensors[0]
                     if n.startswith(progress.FIELD_PREFIX) and all(n in c for c in tensors)]
            found[index] = Progress(
                index, torch.cat([c["tokens"] for c in tensors]), torch.cat([c["logprobs"] for c in tensors]),
                torch.cat([torch.full((r.meta["length"],), r.meta["version"], dtype=torch.int64) for r in records]),
                {n: torch.cat([c[progress.FIELD_PREFIX + n] for c in tensors]) for n in names})
        return found

    # -- training side ---------------------------------------------------------------------------
    def select(self, min_groups: int = 1, max_groups: int | None = None) -> Selection:
        """Claim up to ``max_groups`` eligible ready groups for the current step (one transaction).

        Fewer than ``min_groups`` eligible gives an empty selection and writes nothing. Claimed
        groups' rows stay readable (:meth:`read_batch`) until :meth:`finish_step`.
        """
        max_groups = self.config.groups_per_step if max_groups is None else max_groups
        return self._write(lambda t: training.select(t, self.config, min_groups, max_groups))

    def claim(self, group_ids: Iterable[str]) -> Selection:
        """Claim exactly the named ready groups for the current step, in one transaction: the
        caller's choice instead of the sampler's (NeMo-RL's ``remove(..., remove_in_dp=False)``
        of a ready slot). All or none.

        Raises:
            BadArgument: a named group is not ready (nothing is claimed then).
        """
        gids = _group_ids(group_ids)
        return self._write(lambda t: training.claim(t, gids))

    def release_claims(self, group_ids: Iterable[str]) -> list[str]:
        """Return claims of the current step to ready, in one transaction (stamps untouched): the
        rollback of a batch that was claimed but will not be trained. All or none.

        Raises:
            BadArgument: a named group is not claimed by the current step (nothing is released).
        """
        gids = _group_ids(group_ids)
        return self._write(lambda t: training.release(t, gids))

    def finish_step(self, *, weight_version: int | None = None) -> int:
        """Close the current step: its claimed groups -> consumed, ``trainer_version`` + 1.

        The rollout weight version follows the trainer (set ``weight_version`` if the weight sync
        is not immediate). Consumed rows stay stored until enough checkpoints cover their step
        (``durable_checkpoints``), then are dropped here unless ``retain_consumed``.

        Returns:
            The new trainer version.
        """
        return self._write(lambda t: training.finish_step(t, self.config, weight_version))

    def evict(self, group_ids: Iterable[str] | None = None) -> list[str]:
        """Remove ready groups the sampler can no longer select (their rows are deleted).

        Restore never evicts; the first ``evict`` after it applies the current window.

        Args:
            group_ids: discard exactly these ready groups instead (a deliberate discard, e.g.
                NeMo-RL's ``remove_group`` of a committed slot). Defaults to the sampler's choice.

        Raises:
            BadArgument: a named group is not ready (nothing is evicted then).
        """
        return self._write(lambda t: training.evict(t, self.config, group_ids))

    def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``
        (NeMo-RL's in_order top-up for a step left short by a dropped prompt), in one transaction.

        Returns:
            The lender's step (which now lacks a group), or ``None`` if no later ready group exists.
        """
        return self._write(lambda t: training.promote(t, to_target_step))

    def redispatch(self, group_id: str, *, start_weight: int | None = None, holder: str | None = None) -> Lease:
        """Hand an in-flight prompt to a new attempt: its ``attempt`` + 1 (fencing the old lease),
        ``holder`` as its holder (the producer it now goes to; ``None`` records none) and, if given,
        a new ``start_weight`` (the weight it is now generated with), in one transaction. Siblings
        already committed one by one are kept (``lease.missing``).

        Raises:
            UnknownGroup: no ledger entry for ``group_id``.
        """
        args.identifier("group_id", group_id)
        start_weight = args.optional_integer("start_weight", start_weight)
        holder = _holder(holder)
        return self._write(lambda t: inflight.redispatch(t, self.store.store_id, group_id, start_weight, holder))

    def leases_held_by(self, holder: str) -> list[Lease]:
        """The current lease of every in-flight prompt whose ledger entry records ``holder`` (given
        to :meth:`admit` or :meth:`redispatch`), in dispatch order, in one read: what a dead producer
        or node held. A recovery keeps each entry's holder (its leases are fenced all the same)."""
        args.identifier("holder", holder)
        return self._read(lambda t: inflight.held_by(t, self.store.store_id, holder))

    def redispatch_held_by(self, holder: str, *, to: str | None = None,
                           start_weight: int | None = None) -> list[Lease]:
        """:meth:`redispatch` every in-flight prompt ``holder`` holds, to the holder ``to``, in one
        transaction: the trainer's one call after a producer or its node died. Returns the new
        leases in dispatch order (none if ``holder`` holds nothing)."""
        args.identifier("holder", holder)
        to = _holder(to)
        start_weight = args.optional_integer("start_weight", start_weight)
        return self._write(lambda t: inflight.redispatch_held_by(t, self.store.store_id, holder, to, start_weight))

    def abort(self, group_id: str, reason: str) -> None:
        """Give up on an in-flight prompt: ledger entry -> aborted tombstone with ``reason``, its
        partial rows deleted, and ``batch_shortfall[target_step]`` credited.

        Raises:
            UnknownGroup: no ledger entry for ``group_id``.
        """
        self._write(lambda t: inflight.abort(t, [group_id], reason))

    def abort_stale_inflight(self) -> list[str]:
        """Abort every in-flight prompt the sampler says is useless now (only ``windowed`` has any)."""
        return self._write(lambda t: inflight.abort_stale(t, self.config))

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
        if layout not in LAYOUTS:
            raise BadArgument(f"layout must be padded, packed or list, got {layout!r}")
        unknown = sorted(set(fields or ()) - set(self.schema.fields))
        if unknown:
            raise BadArgument(f"fields {unknown} are not in the store's schema {list(self.schema.fields)}")
        gids = groups.group_ids if isinstance(groups, Selection) else list(groups)
        infos, raw, pins = self._read(lambda t: read_groups(t, gids))
        decoded = decode_rows(self.schema, infos, raw, pins, fields)
        return assemble_batch(self.schema, infos, raw, decoded, layout, pad_value)

    # -- inspection ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Cursors, counts and counters as one consistent dict (a copy)."""
        return self._read(Tables.state)

    @property
    def trainer_version(self) -> int:
        """The current training step (number of finished steps)."""
        return self.state()["trainer_version"]

    def group(self, group_id: str) -> GroupInfo | None:
        """A group's record (any state), or ``None``."""
        return self._read(lambda t: t.group(group_id))

    def ledger(self) -> list[LedgerEntry]:
        """Every in-flight prompt, in dispatch order."""
        return self._read(Tables.entries)

    def groups(self, states: Iterable[str] | None = None) -> list[GroupInfo]:
        """Group records (optionally filtered by state), in dispatch order."""
        wanted = None if states is None else set(states)
        return sorted((g for g in self._read(Tables.groups) if wanted is None or g.state in wanted),
                      key=lambda g: g.seq)

    def dataloader_state(self) -> bytes | None:
        """The dataloader state stored with the last admission (or restored), or ``None``."""
        return self._read(Tables.dataloader_state)

    def batch_shortfall(self) -> dict[int, int]:
        """Prompts aborted per target step (the step closes that many groups short)."""
        return {int(k): v for k, v in self._read(Tables.shortfall).items()}

    def count_for_target_step(self, step: int) -> int:
        """In-flight plus ready groups stamped for ``step`` (NeMo-RL's top-up guard)."""
        def count(t: Tables) -> int:
            ready = sum(1 for _ in BufferView(t.txn).ready_for_target(step))
            return ready + sum(1 for e in t.entries() if e.target_step == step)
        return self._read(count)

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

    # -- durability ------------------------------------------------------------------------------
    def recover(self, resume_version: int | None = None, *, sampler: Any = None,
                max_buffered_rollouts: int | None = None, checksums: bool = False, deep: bool = False) -> RecoveryPlan:
        """Reconcile the store to a trainer version and fence in-flight work (one transaction).

        See :func:`kvckpt.durability.recovery.recover_store` for the full contract; a switched
        sampler or capacity takes effect on this buffer too.
        """
        plan, config = recover_store(self.store, self.config, resume_version, sampler=sampler,
                                     max_buffered_rollouts=max_buffered_rollouts, checksums=checksums, deep=deep)
        self.config, self.sampler = config, config.sampler
        self._notify()
        return plan

    def checkpoint(self, dest: str | os.PathLike[str], trainer_state: Mapping[str, Any] | None = None, *,
                   overwrite: bool = False, background: bool = True) -> CheckpointHandle:
        """Stamp and copy a checkpoint (in the background by default); see
        :func:`kvckpt.durability.checkpoint.checkpoint_store`."""
        return checkpoint_store(self.store, dest, trainer_state, durable_checkpoints=self.config.durable_checkpoints,
                                overwrite=overwrite, background=background)


def _prepare_each(items: Sequence[Mapping[str, Any]], prepare: Callable[[Mapping[str, Any]], Any], call: str,
                  needs: str) -> tuple[list[Any], list[Any]]:
    """Prepare every item of a ``*_many`` call outside the transaction: the prepared ones in order,
    and per item ``None`` (prepared) or the error that refused it (then nothing of it is written)."""
    prepared: list[Any] = []
    out: list[Any] = []
    for item in items:
        try:
            prepared.append(prepare(item))
            out.append(None)
        except KvckptError as exc:
            out.append(exc)
        except (KeyError, TypeError) as exc:
            out.append(BadArgument(f"a {call} item needs {needs}: {exc!r}"))
    return prepared, out


def _merge(out: list[Any], results: Sequence[Any]) -> list[Any]:
    """The results of the prepared items put back into the slots ``_prepare_each`` left ``None``."""
    found = iter(results)
    return [next(found) if slot is None else slot for slot in out]


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


def _holder(holder: Any) -> str | None:
    """A lease holder's name as given (``None``: none), or :class:`BadArgument`."""
    return None if holder is None else args.identifier("holder", holder)


def _group_ids(group_ids: Any) -> list[str]:
    if isinstance(group_ids, str) or not isinstance(group_ids, Iterable):
        raise BadArgument(f"group_ids must be a list of group ids, got {type(group_ids).__name__}")
    return [args.identifier("group_id", gid) for gid in group_ids]


def _check_dataloader_state(value: Any) -> None:
    if value is not None and not isinstance(value, (bytes, bytearray, memoryview)):
        raise BadArgument(f"dataloader_state must be bytes (the trainer's opaque state), got {type(value).__name__}")
