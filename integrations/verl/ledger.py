"""The verl ledger: one kvckpt file holding everything verl's V1 replay buffer keeps in TransferQueue.

:class:`VerlLedger` owns the file (a TransferQueue value store, :class:`ValueStore`, with the key
layout of :mod:`.records`) and runs as one named Ray actor (:data:`VerlLedgerActor`), so every
process of a verl job (the trainer, each agent-loop worker) writes through one writer. The actor runs
every call one at a time (its default concurrency group) except :meth:`checkpoint`, which runs in a
group of its own (:data:`CHECKPOINT_GROUP`), as the TransferQueue backend's owner actor does: a
checkpoint blocks puts only for its stamp transaction, and puts keep landing while the snapshot copies.
Each call that changes state is one durable write transaction:

* :meth:`open_run`: a new run token (the restart's fence);
* :meth:`put` / :meth:`clear`: one TransferQueue put or clear of verl's;
* :meth:`resume`: drops what a checkpoint covers (groups consumed at or before its step) and
  returns groups consumed after it to the buffer;
* :meth:`checkpoint`: a one-file snapshot (the value store's stamp-and-copy recipe), then the
  checkpoint's step and the purge of the groups it covers;
* :meth:`load`: the checkpoint plus what finished since: when the live store descends from it, the
  checkpoint's groups the live store no longer holds are put back (one transaction) and every live
  group is kept; otherwise the checkpoint file replaces the live store and the current run's token
  is written back.

Every call that changes state carries the caller's run token and is refused with
:class:`~.errors.StaleRun`, before anything changes, when it is not the current run's. The fence
is checked inside the call's write transaction (the value store's ``fence``: the run record's
write identity is the token), so no run can open between the check and the write; a checkpoint
checks it inside its stamp transaction, and a load (a file copy, not a transaction) before the copy.

Every call whose write depends on what it reads reads inside its one write transaction, after its fence
(``ValueStore.update``): :meth:`~VerlLedger.open_run` (the run number), :meth:`~VerlLedger.clear` (the
checkpoint record, the marks of its keys, their records), :meth:`~VerlLedger.retain` (what it deletes),
:meth:`~VerlLedger.resume` (the checkpoint's step, every item and mark, the cursor it returns), what a checkpoint
does after its copy (its step record and the purge of the marks it covers), a put that ends a group and
:meth:`~VerlLedger.settle_progress` (the progress they delete), and :meth:`~VerlLedger.record_progress` (the
fence, the trainer's step, every chunk). So no write lands between a call's read and its write, whichever
concurrency group or process wrote it, and none of them relies on a lock for that. The ledger's one mutex
(:func:`_exclusive`; a checkpoint takes it for its step record and purge only) keeps every write away from a
:meth:`~VerlLedger.load`, which swaps the file (a copy, not a transaction); the snapshot copy holds no mutex,
so puts land while it copies.

Consumed marks are bounded: a mark is only kept while a checkpoint exists that a restart could
resume from with the mark's step after it. Before the ledger's first checkpoint a restart trains from
scratch, as verl's (``_load_checkpoint``: no ``global_step_N``, step 0, the initial weights, the
dataloader from its start), so a sampled group is deleted, not marked; after it, each checkpoint
deletes the marks it covers, so at most the groups sampled since the last checkpoint are marked.

Replication (issue 44; docs/replication.md, "The value store on Ray"): with ``replication=`` the ledger's file is a
replicated primary shipping its log to a standby ledger actor (``standby=True``), and every call that
writes is acknowledged at the configured level (:class:`~kvckpt.integrations.ray.values.ReplicatedValueStore`,
which then holds the file; it is imported only then, so a ledger without replication is as it was); a standby
answers only the replication calls until :meth:`VerlLedger.promote`.

Long (over 400 lines): the ledger is one actor class, every verl call it serves beside the records it changes.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import ray
from kvckpt.integrations.transferqueue.values import decode_value, encode_value, new_write_id
from kvckpt.integrations.verl.errors import StaleRun
from kvckpt.integrations.verl.records import (
    CHECKPOINT_KEY,
    CONSUMED,
    CURSOR_KEY,
    ITEMS,
    MARKS,
    MAX_TOKENS,
    PROGRESS,
    RUN_KEY,
    TAG,
    TRAINER_KEY,
    done_key,
    groups_lacking,
    item_prefix,
    mark_index_key,
    progress_prefix,
    record_key,
    split,
    split_mark_index,
)
from kvckpt.integrations.verl.upgrade import upgrade_progress

from kvckpt import ValueStore, ValueView, makedirs_durable, write_id_of
from kvckpt.errors import BadArgument, FencedWrite, KvckptError, NotStandby

_Call = TypeVar("_Call", bound=Callable[..., Any])


def _exclusive(method: _Call) -> _Call:
    """``method`` run holding the ledger's mutex, so it never runs beside a :meth:`VerlLedger.load` (a file swap)
    the checkpoint group could otherwise overlap. Not what keeps a call's reads and its write together: each
    call reads inside its write transaction (``ValueStore.update``)."""

    @functools.wraps(method)
    def run(self: VerlLedger, *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]

#: zstd level of the records the ledger itself encodes (run, checkpoint step, consumed marks).
_LEVEL = 1


class VerlLedger:
    """The single writer of a verl ledger file (see the module docstring).

    Args:
        path: the live ledger file; created if missing (a format-1 file's token progress is moved into format 2
            first: :mod:`.upgrade`). Keep it on a local disk.
        max_tokens: the longest sample prefix its token progress records (a longer one is refused).

    Raises:
        FormatError: the file is a kvckpt store of another kind.
        StoreLocked: another process holds the file for writing.
    """

    def __init__(self, path: str, max_tokens: int = MAX_TOKENS, *, replication: Any = None,
                 standby: bool = False) -> None:
        if replication is None and not standby:
            self._values: Any = ValueStore(path)
        else:
            from kvckpt.integrations.ray.values import ReplicatedValueStore

            self._values = ReplicatedValueStore(path, replication=replication, standby=standby)
        self.path = self._values.path
        self.max_tokens = max_tokens
        self._mutex = threading.Lock()
        if getattr(self._values, "role", "primary") == "standby":
            return  # upgraded when promoted
        try:
            upgrade_progress(self._values, max_tokens)
        except BaseException:
            self._values.close()
            raise

    # -- replication (the shipper of a primary ledger calls these on its standby) ---------------------
    def _replica(self) -> Any:
        if isinstance(self._values, ValueStore):
            raise NotStandby(f"the verl ledger {self.path!r} is not replicated (no replication, not a standby)")
        return self._values

    def replica_status(self) -> dict[str, Any] | None:
        """The file's replication status (:meth:`ReplicatedValueStore.replica_status`)."""
        return self._replica().replica_status()

    def apply_log(self, records: list[bytes]) -> int:
        """As a standby: apply a shipped batch, one durable transaction, idempotent by sequence."""
        return self._replica().apply_log(records)

    def receive_snapshot(self, token: str, offset: int, data: bytes) -> None:
        """As a standby: one chunk of the primary's snapshot."""
        self._replica().receive_snapshot(token, offset, data)

    def install_snapshot(self, token: str, size: int) -> int:
        """As a standby: install the snapshot received under ``token``; the sequence it holds."""
        return self._replica().install_snapshot(token, size)

    def watch_primary(self, node_id: str) -> None:
        """As a standby: the primary's node."""
        self._replica().watch_primary(node_id)

    @_exclusive
    def promote(self) -> dict[str, Any]:
        """As a standby: become the primary ledger (a new epoch, in one transaction; the old primary is
        refused from then on) and return its replication status with ``promoted_from``. The runs and their
        tokens are the ledger's as the standby applied them: verl's workers keep their run token, and a
        restarted trainer opens a new run as after any restart.

        Raises:
            NotStandby: this ledger is a primary, or its standby never received a snapshot.
        """
        status = self._replica().promote()
        upgrade_progress(self._values, self.max_tokens)  # as a primary's open does
        return status

    def info(self) -> dict[str, Any]:
        """The live file's path, its run number, the step of its last checkpoint (``None`` before the first),
        the trainer's step (:meth:`trainer_step`; ``None`` while none is reported) and how many consumed marks it
        holds."""
        run = self._get(RUN_KEY) or {}
        checkpoint, trainer = self._get(CHECKPOINT_KEY), self._get(TRAINER_KEY)
        return {"path": self.path, "run": run.get("run", 0),
                "checkpoint_step": None if checkpoint is None else int(checkpoint["step"]),
                "trainer_step": None if trainer is None else int(trainer["step"]),
                "consumed_marks": len(self._values.keys(MARKS))}

    # -- the run -----------------------------------------------------------------------------------
    @_exclusive
    def open_run(self) -> dict[str, Any]:
        """Start a new run (one transaction): every token handed out before is fenced from now on.

        Returns ``{"token": ..., "run": n}``.
        """
        token, opened = new_write_id(), {}

        def plan(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            opened.update(token=token, run=int((_read(view, RUN_KEY) or {}).get("run", 0)) + 1)  # read inside it
            return [RUN_KEY], [encode_value(RUN_KEY, {"run": opened["run"]}, token, _LEVEL)], []

        self._values.update(plan)
        return opened

    def _run_id(self) -> str | None:
        raw = self._values.get([RUN_KEY])[0]
        return None if raw is None else write_id_of(raw, RUN_KEY)

    def _check(self, token: str) -> None:
        """Refuse a stale ``token`` before work outside a transaction (a load's file copy, a checkpoint's directory)."""
        current = self._run_id()
        if current != token:
            raise StaleRun(self.path, token, current)

    def _write(self, token: str, keys: list[str], values: list[bytes], deletes: list[str]) -> None:
        """One write transaction of run ``token``, its fence checked inside it."""
        try:
            self._values.write(keys, values, deletes, fence=(RUN_KEY, token))
        except FencedWrite as exc:
            raise StaleRun(self.path, token, exc.found) from None

    def _update(self, token: str, plan: Callable[[ValueView], tuple[list[str], list[bytes], list[str]]]) -> None:
        """One write transaction of run ``token`` whose reads (``plan``'s) happen inside it, after its fence."""
        try:
            self._values.update(plan, fence=(RUN_KEY, token))
        except FencedWrite as exc:
            raise StaleRun(self.path, token, exc.found) from None

    # -- verl's TransferQueue calls -----------------------------------------------------------------
    @_exclusive
    def put(self, token: str, keys: list[str], values: list[bytes], ended: list[str] | None = None) -> None:
        """One TransferQueue put of a process of run ``token``: its encoded records, one transaction.

        ``ended``: the prompts whose groups this put ends (their ``finished`` / ``failure`` status): the token
        progress of their samples (every record under ``verl/progress/{uid}/``) is deleted in the same transaction, so a
        finished sample's progress lasts until its group's trajectories are all durable, and no longer.

        Raises:
            StaleRun: ``token`` is not the current run's.
        """
        prefixes = [f"{PROGRESS}{uid}/" for uid in dict.fromkeys(ended or [])]
        self._update(token, lambda view: (keys, values, [k for p in prefixes for k in view.keys(p)]))

    @_exclusive
    def clear(self, token: str, partition_id: str, keys: list[str], consumed_step: int | None = None) -> int:
        """One TransferQueue clear of run ``token`` (one transaction); returns how many keys it removed.

        With ``consumed_step`` the keys were taken by that training step: once the ledger has a
        checkpoint they are marked consumed and kept (a crash before a checkpoint covers the step
        returns them); before its first checkpoint they are deleted (a restart then trains from
        scratch). A trajectory whose prompt is marked consumed is marked with the prompt's step. Any
        other key's records are deleted. Reads the marks of the cleared keys and their prompts only.

        Raises:
            StaleRun: ``token`` is not the current run's.
        """
        names = sorted({k for key in keys for k in (key, key.split("_", 1)[0])})
        mark_keys = [record_key(partition_id, key, CONSUMED) for key in names]  # a bad name refused before

        def plan(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            # read inside the transaction: a checkpoint's record or a mark that lands before it opens is seen
            taken = consumed_step if consumed_step is not None and view.get(CHECKPOINT_KEY) is not None else None
            marks = {key: int(_decoded(mk, raw)["step"])
                     for key, mk in zip(names, mark_keys, strict=True) if (raw := view.get(mk)) is not None}
            write_keys, values, deletes = [], [], []
            for key in keys:
                step = taken if taken is not None else marks.get(key.split("_", 1)[0])
                old = marks.get(key)
                if old is not None and old != step:
                    deletes.append(mark_index_key(old, partition_id, key))
                if step is None:
                    deletes.extend(view.keys(item_prefix(partition_id, key)))
                else:
                    mark = record_key(partition_id, key, CONSUMED)
                    index = mark_index_key(int(step), partition_id, key)
                    write_keys += [mark, index]
                    values += [encode_value(mark, {"step": int(step)}, new_write_id(), _LEVEL),
                               encode_value(index, {}, new_write_id(), _LEVEL)]
            return write_keys, values, deletes

        self._update(token, plan)
        return len(keys)

    @_exclusive
    def set_cursor(self, token: str, state: Any, keys: list[str], values: list[bytes]) -> None:
        """A dispatch: the prompts' records and the dataloader state after fetching them, one transaction."""
        cursor = encode_value(CURSOR_KEY, state, new_write_id(), _LEVEL)
        self._write(token, [*keys, CURSOR_KEY], [*values, cursor], [])

    @_exclusive
    def retain(self, token: str, listing: dict[str, list[str]]) -> int:
        """Keep only the items TransferQueue lists (``{partition: [key, ...]}``), in one transaction, and
        drop the dispatch cursor and the last checkpoint's record: a restart that resumes nothing (sync
        mode, as verl's sync trainer; an async run whose trainer loads no checkpoint, as verl's
        ``_load_checkpoint`` finding none or ``resume_mode=disable``) keeps nothing a fresh TransferQueue
        does not hold, and the live store no longer descends from any checkpoint (:meth:`load` then copies
        the file in, even the last one). Returns how many records were deleted.

        Raises:
            StaleRun: ``token`` is not the current run's.
        """
        listed = {(p, k) for p, keys in listing.items() for k in keys}
        doomed: list[str] = []

        def plan(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            doomed[:] = [k for k in view.keys(ITEMS) if split(k)[:2] not in listed]
            doomed.extend(i for i in view.keys(MARKS) if split_mark_index(i)[1:] not in listed)
            doomed.extend(view.keys(CURSOR_KEY) + view.keys(CHECKPOINT_KEY) + view.keys(TRAINER_KEY))
            return [], [], doomed

        self._update(token, plan)
        return len(doomed)

    @_exclusive
    def trainer_step(self, token: str, step: int) -> None:
        """The trainer of run ``token`` is at training step ``step`` (verl's ``global_steps``, the version of the
        weights it sends its rollout servers next), one transaction: from now on token progress of a later
        weight version is refused :class:`~kvckpt.errors.FutureVersion` (:meth:`record_progress`), as the replay
        buffer refuses progress newer than its trainer's version. :meth:`resume` and :meth:`retain` (a restart)
        drop it: the restarted trainer reports its step at its first sample, and until then no version is checked
        (a replaced run's servers are fenced by the run token instead).

        Raises:
            StaleRun: ``token`` is not the current run's.
            BadArgument: ``step`` is not an integer >= 0.
        """
        if type(step) is not int or step < 0:
            raise BadArgument(f"verl ledger: a trainer step is an integer >= 0, got {step!r}")
        self._write(token, [TRAINER_KEY], [encode_value(TRAINER_KEY, {"step": step}, new_write_id(), _LEVEL)], [])

    # -- restart -----------------------------------------------------------------------------------
    @_exclusive
    def resume(self, token: str, step: int | None = None) -> dict[str, Any]:
        """Settle consumed groups against the checkpoint at ``step`` (the ledger's last one by default),
        in one transaction, and return what TransferQueue must hold.

        Groups consumed at or before ``step`` are deleted (the checkpoint's weights trained on them);
        groups consumed after it are finished again (those weights were lost). An explicit ``step`` (a
        checkpoint just loaded) is recorded as the ledger's last checkpoint. Returns
        ``{"items": {partition: {key: {"tags": {...}, "fields": {...}}}}, "cursor": state or None,
        "step": step}``.

        Raises:
            StaleRun: ``token`` is not the current run's.
        """
        # An explicit step is the checkpoint just loaded: it becomes the ledger's last one (a copied-in file
        # holds the step of the checkpoint before it, or none, since its record is written after the copy).
        record = [] if step is None else [encode_value(CHECKPOINT_KEY, {"step": int(step)}, new_write_id(), _LEVEL)]
        settled: dict[str, Any] = {}

        def plan(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            # everything it settles and returns is read inside the transaction (a mark that lands before it opens)
            at = int((_read(view, CHECKPOINT_KEY) or {}).get("step", 0)) if step is None else int(step)
            items, marks = _items_of((key, view.get(key)) for key in view.keys(ITEMS))
            deletes: list[str] = [TRAINER_KEY]  # the restarted trainer reports its step again (trainer_step)
            for (partition_id, key), mark_step in marks.items():
                deletes.append(mark_index_key(mark_step, partition_id, key))
                if mark_step <= at:
                    deletes.extend(view.keys(item_prefix(partition_id, key)))
                    items[partition_id].pop(key, None)
                else:
                    deletes.append(record_key(partition_id, key, CONSUMED))
            settled.update(items={p: dict(v) for p, v in items.items()}, cursor=_read(view, CURSOR_KEY), step=at)
            return [CHECKPOINT_KEY] if record else [], record, deletes

        self._update(token, plan)
        return settled

    def snapshot(self) -> dict[str, Any]:
        """What the ledger holds, read-only: ``{"items": {partition: {key: {"tags", "fields"}}}, "consumed":
        {partition: {key: step}}, "cursor": state or None}``; consumed keys are not in ``items``."""
        keys = self._values.keys(ITEMS)
        items, marks = _items_of(zip(keys, self._values.get(keys), strict=True))
        consumed: dict[str, dict[str, int]] = defaultdict(dict)
        for (partition_id, key), step in marks.items():
            items[partition_id].pop(key, None)
            consumed[partition_id][key] = step
        return {"items": {p: dict(v) for p, v in items.items()}, "consumed": dict(consumed),
                "cursor": self._get(CURSOR_KEY)}

    # -- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, token: str, dest: str, step: int) -> dict[str, Any]:
        """Copy the ledger to ``dest`` as one file (stamp, snapshot copy, fsync, rename), then record
        ``step`` as the last checkpoint and delete the groups consumed at or before it (one transaction;
        it reads the consumed-mark index, not the ledger). ``dest``'s directory is created if missing.

        Returns the stamp (``checkpoint_id``, ``created``, ``values``, ``file_bytes``).

        Raises:
            StaleRun: ``token`` is not the current run's; nothing is written, ``dest`` included.
        """
        self._check(token)  # before the directory is made; checked again inside the stamp transaction
        makedirs_durable(os.path.dirname(os.path.abspath(dest)))
        try:
            stamp = self._values.checkpoint(dest, fence=(RUN_KEY, token))
        except FencedWrite as exc:
            raise StaleRun(self.path, token, exc.found) from None
        record = encode_value(CHECKPOINT_KEY, {"step": int(step)}, new_write_id(), _LEVEL)

        def purge(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            # the marks it deletes are listed inside its transaction: a mark that lands before it opens is seen
            deletes = []
            for index in view.keys(MARKS):
                mark_step, partition_id, key = split_mark_index(index)
                if mark_step > step:
                    break  # the index is in step order
                deletes += [index, *view.keys(item_prefix(partition_id, key))]
            return [CHECKPOINT_KEY], [record], deletes

        with self._mutex:  # not for its reads (inside its transaction): a load swaps the file, it must not run beside
            self._update(token, purge)
        return stamp

    @_exclusive
    def load(self, source: str, checkpoint_id: str, token: str) -> bool:
        """Make the ledger the checkpoint ``source`` (stamp ``checkpoint_id``) plus what finished since, for the
        run ``token``. Returns whether the file was copied in.

        If the live store's last stamp is ``checkpoint_id`` and the live store still descends from it
        (it has a checkpoint record: :meth:`retain` drops it when a run starts over), every prompt group
        of the checkpoint the live store no longer holds is put back, in one write transaction (the file
        opened untrusted, the run's fence checked inside that transaction); a group the live store holds
        keeps its live records (every trajectory finished since), and so do the dispatch cursor and the
        run. So a group cleared after the save (evicted as stale against a trainer version the load rolls
        back, or wiped) comes back as the checkpoint held it, and consumed marks it held come back for
        :meth:`resume` to settle. Otherwise the live store moved past the checkpoint (a later one was
        stamped from it, or it started over): the file (validated first) replaces it, and the run record
        is then the current run's (one transaction).

        Raises:
            StaleRun: ``token`` is not the current run's; nothing changes.
            CheckpointError: the file's stamp is not ``checkpoint_id``; nothing changes.
            FormatError / CorruptRecord / RecoveryError: the file is not a valid ledger checkpoint; nothing changes.
                (A format-1 checkpoint, an older kvckpt's, is upgraded after its copy, :mod:`.upgrade`.)
        """
        self._check(token)
        if self._values.stamp_id() == checkpoint_id and self._get(CHECKPOINT_KEY) is not None:
            try:
                self._values.merge_checkpoint(source, groups_lacking, checkpoint_id=checkpoint_id,
                                              fence=(RUN_KEY, token))
            except FencedWrite as exc:
                raise StaleRun(self.path, token, exc.found) from None
            return False
        run = self._get(RUN_KEY) or {}
        self._values.load(source, checkpoint_id=checkpoint_id)
        upgrade_progress(self._values, self.max_tokens)  # a checkpoint an older kvckpt wrote: format 1
        self._values.put([RUN_KEY], [encode_value(RUN_KEY, {"run": run.get("run", 0)}, token, _LEVEL)])
        return True

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._values.close()

    # -- token progress ----------------------------------------------------------------------------
    @_exclusive
    def record_progress(self, token: str, items: list[dict[str, Any]]) -> list[int | KvckptError]:
        """One flush of a rollout server's token progress, in ONE write transaction of run ``token``, under the
        replay buffer's rules (``ValueStore.record_progress``: the buffer's progress transition over the ledger's
        records, every check inside the transaction).

        Each item is ``{"uid", "session", "start", "tokens", "logprobs", "versions"}`` (a chunk; ``"final": True``
        also marks the sample done once the chunk is durable) or ``{"uid", "session", "drop": True}`` (the sample's
        progress is deleted, before the chunks are judged). Returns per item the sample's durable token count
        after it, or the kvckpt error refusing it (nothing of it written), as the buffer answers its progress:
        :class:`~kvckpt.errors.FutureVersion` (a token of a weight version after the trainer's step,
        :meth:`trainer_step`, read inside the transaction; not checked before the trainer reports one),
        :class:`~kvckpt.errors.ProgressGap` (a gap), ``SchemaMismatch`` (past ``max_tokens``, lengths that
        differ), ``DuplicateCommit`` (other tokens where some are durable), :class:`~.errors.StaleRun` (``token``
        is not the current run's; nothing of the call is written), and a resend of a durable chunk gets its
        first answer, even from a replaced run.
        """
        chunks, positions, drops, finals = [], [], [], []
        for n, item in enumerate(items):
            uid, session = item["uid"], item["session"]
            if item.get("drop"):
                drops += [progress_prefix(uid, session), done_key(uid, session)]
                continue
            positions.append(n)
            finals.append(done_key(uid, session) if item.get("final") else None)
            chunks.append({"group": uid, "index": session, "start": item["start"], "tokens": item["tokens"],
                           "logprobs": item["logprobs"], "versions": item["versions"]})
        written: list[bool] = []

        def marks(results: list[int | KvckptError]) -> tuple[list[str], list[bytes]]:
            written.append(True)  # the fence held
            done = [key for key, r in zip(finals, results, strict=True) if key is not None and isinstance(r, int)]
            return done, [encode_value(key, {}, new_write_id(), _LEVEL) for key in done]

        results = self._values.record_progress(chunks, max_tokens=self.max_tokens, prefix=PROGRESS,
                                               fence=(RUN_KEY, token), drop=drops, then=marks, newest=_trainer_step)
        stale = None if written else StaleRun(self.path, token, next(
            (r.found for r in results if isinstance(r, FencedWrite)), self._run_id()))
        out: list[int | KvckptError] = [0 if stale is None else stale] * len(items)
        for n, result in zip(positions, results, strict=True):
            out[n] = stale if isinstance(result, FencedWrite) and stale is not None else result
        return out

    @_exclusive
    def settle_progress(self, token: str, inflight_uids: list[str]) -> int:
        """At a restart: delete the progress of every prompt not in ``inflight_uids`` (one transaction); returns
        how many records went.

        Raises:
            StaleRun: ``token`` is not the current run's; nothing is deleted.
        """
        keep = set(inflight_uids)
        doomed: list[str] = []

        def plan(view: ValueView) -> tuple[list[str], list[bytes], list[str]]:
            doomed[:] = [k for k in view.keys(PROGRESS) if k[len(PROGRESS):].split("/", 1)[0] not in keep]
            return [], [], doomed

        self._update(token, plan)
        return len(doomed)

    def progress(self, uid: str, session: int) -> dict[str, Any] | None:
        """The durable progress of sample ``session`` of prompt ``uid``: ``{"tokens", "logprobs", "versions"}``
        (lists, in token order) and ``"done"``, or ``None`` if none is recorded.

        Raises:
            CorruptRecord: a chunk is damaged, or the chunks leave a gap or overlap.
        """
        held = self._values.progress(uid, session, max_tokens=self.max_tokens, prefix=PROGRESS)
        done = self._values.get([done_key(uid, session)])[0] is not None
        if held is None and not done:
            return None
        tokens, logprobs, versions = held if held is not None else ([], [], [])
        return {"tokens": list(map(int, tokens)), "logprobs": list(map(float, logprobs)),
                "versions": list(map(int, versions)), "done": done}

    # -- reading -----------------------------------------------------------------------------------
    def _get(self, key: str) -> Any:
        raw = self._values.get([key])[0]
        return None if raw is None else _decoded(key, raw)


def _decoded(key: str, raw: bytes) -> Any:
    """The value of the stored record ``raw`` of ``key``."""
    return decode_value(key, raw, write_id_of(raw, key))


def _read(view: ValueView, key: str) -> Any:
    """The value of ``key`` as ``view`` (a write transaction's) sees it, or ``None``."""
    raw = view.get(key)
    return None if raw is None else _decoded(key, raw)


def _items_of(stored: Iterable[tuple[str, bytes | None]],
              ) -> tuple[dict[str, dict[str, dict[str, dict[str, Any]]]], dict[tuple[str, str], int]]:
    """The items (``{partition: {key: {"tags", "fields"}}}``) and consumed marks (``{(partition, key): step}``) of
    the item records ``stored`` (``(ledger key, record or None)``)."""
    items: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(dict)
    marks: dict[tuple[str, str], int] = {}
    for ledger_key, raw in stored:
        if raw is None:
            continue
        partition_id, key, kind, name = split(ledger_key)
        value = _decoded(ledger_key, raw)
        if kind == CONSUMED:
            marks[(partition_id, key)] = int(value["step"])
            continue
        item = items[partition_id].setdefault(key, {"tags": {}, "fields": {}})
        item["tags" if kind == TAG else "fields"][name] = value
    return items, marks


def _trainer_step(view: ValueView) -> tuple[int, str] | None:
    """The newest weight version token progress may carry: the trainer's step (``None`` before it reports one)."""
    trainer = _read(view, TRAINER_KEY)
    if trainer is None:
        return None
    step = int(trainer["step"])
    return step, f"the trainer is at step {step}"


#: The ledger actor's concurrency group for :meth:`VerlLedger.checkpoint` (one at a time, beside every other call).
CHECKPOINT_GROUP = "checkpoint"

#: :class:`VerlLedger` as a Ray actor, the file's only writer: every call one at a time, except a checkpoint,
#: called with ``.options(concurrency_group=CHECKPOINT_GROUP)`` so puts keep landing while it copies.
VerlLedgerActor = ray.remote(num_cpus=0, concurrency_groups={CHECKPOINT_GROUP: 1})(VerlLedger)


def ledger_actor(path: str, name: str, namespace: str) -> Any:
    """The named ledger actor serving ``path``, started on this node if none runs.

    Raises:
        BadArgument: an actor of that name serves another file.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    path = os.path.abspath(path)
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # Detached: verl's workers and a restarted trainer reach it by name whoever started it; it ends
    # with the Ray cluster (a killed job's local cluster takes it along) or by ray.kill.
    actor = VerlLedgerActor.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
                                    scheduling_strategy=node).remote(path)
    served = ray.get(actor.info.remote())["path"]
    if served != path:
        raise BadArgument(f"the Ray actor {name!r} already serves the verl ledger {served!r}, not {path!r}")
    return actor
