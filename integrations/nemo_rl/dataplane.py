"""NeMo-RL's ``DataPlaneClient`` direct-by-key calls, answered from the store a ``TQReplayBuffer`` owns.

NeMo-RL's SingleController moves tensors through its data plane: after ``sampler.select`` it
``get_samples`` the advantage inputs of the selected batch, ``put_samples`` the ``advantages`` it
computed under the same ``sample_ids`` (``{group_id}_g{i}``), the trainer reads the batch with
``get_samples`` / ``get_data``, and the controller ``clear_samples`` it after training. With the
kvckpt buffer the rows are in the kvckpt store, so :class:`KvckptDataPlane` answers those calls
(same names, keywords and return types) from that store.

What is stored where:

* **committed rows** (what ``commit`` wrote) are in the store and never change: ``put_samples``
  does not touch them, so no call here is a state transition and none writes to LMDB;
* **derived values** (``advantages``, a re-masked ``sample_mask``) live in this client's memory,
  next to the rows of groups *claimed* by the current step only, and shadow a stored field of the
  same name on read. They are recomputable from the rows and are never checkpointed: after a
  crash, a restore or a recovery the claim is undone, the group is ready again and the controller
  computes them again when it selects it. Memory is bounded by the claimed rows;
* ``prompt_ids_for_adv`` (NeMo-RL's prompt-token column) is derived on read when the schema does
  not store it: a row's leading tokens up to its first ``token_mask`` = 1 token, i.e. the prompt
  before the first assistant turn (one group's rows share it, as the advantage estimator needs).

``clear_samples`` drops derived values and hides the rows from this client; the rows leave the
store when the step closes (``finish_step``), since a crash before a checkpoint covers the step
must be able to return them to ready.

With ``inner=`` (NeMo-RL's own client, which its trainer workers read through), the buffer
:meth:`~KvckptDataPlane.publish` es each selected batch's committed rows into it, and
``put_samples`` / ``clear_samples`` are forwarded to it too: the inner data plane then holds the
batches being trained and nothing else, a cache the store can refill (after a restart the next
``select`` publishes again).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

from kvckpt.integrations.nemo_rl.meta import ReplayMeta

from kvckpt import CLAIMED, READY, ReplayBuffer, row_id
from kvckpt.errors import BadArgument, NotSelectable, SchemaMismatch


class ServedBuffer(Protocol):
    """What a :class:`KvckptDataPlane` reads of its buffer (a :class:`~.adapter.TQReplayBuffer`)."""

    @property
    def core(self) -> ReplayBuffer: ...

    @property
    def partition_id(self) -> str: ...

#: NeMo-RL's prompt-token column (``AdvantageConfig.prompt_ids_field``), derived when not stored.
PROMPT_IDS_FIELD = "prompt_ids_for_adv"


def split_sample_id(sample_id: str) -> tuple[str, int]:
    """``(group_id, row index)`` of a NeMo-RL sample id ``{group_id}_g{i}``.

    Raises:
        BadArgument: not of that form.
    """
    group_id, sep, index = str(sample_id).rpartition("_g")
    if not sep or not index.isdigit() or row_id(group_id, int(index)) != sample_id:
        raise BadArgument(f"sample_id {sample_id!r} is not of the form '{{group_id}}_g{{i}}'")
    return group_id, int(index)


def _invoke(client: Any, method_name: str, **kwargs: Any) -> Any:
    method = getattr(client, method_name)
    remote = getattr(method, "remote", None)
    return remote(**kwargs) if remote is not None else method(**kwargs)


async def call_client(client: Any, method_name: str, **kwargs: Any) -> Any:
    """Call a NeMo-RL data-plane client as its controller's ``_call_dp`` does and wait for the
    answer: a Ray actor's method (``.remote``, its reference awaited), a coroutine function
    (awaited) or a plain method."""
    result = _invoke(client, method_name, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def _once_done(pending: Any, value: Any) -> Any:
    await pending
    return value


def _stack_or_nest(rows: list[Any]) -> Any:
    """One batched tensor: stacked when every row has one shape, else a jagged nested tensor."""
    import torch

    if all(r.shape == rows[0].shape for r in rows):
        return torch.stack(rows)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _rows_of(value: Any, name: str, n: int) -> list[Any]:
    import torch

    if not isinstance(value, torch.Tensor):
        raise SchemaMismatch(f"put_samples: field {name!r} is a {type(value).__name__}, not a tensor (no pickled "
                             "values on the data plane: tensorise it, or pass primitives as tags)")
    rows = list(value.unbind(0)) if value.is_nested else [value[i] for i in range(value.shape[0])] \
        if value.dim() else []
    if len(rows) != n:
        raise SchemaMismatch(f"put_samples: field {name!r} has {len(rows)} rows for {n} sample_ids")
    return [row.detach().clone() for row in rows]


class KvckptDataPlane:
    """NeMo-RL's data-plane client over a kvckpt buffer's store (see the module docstring).

    Build it unbound and hand it to ``TQReplayBuffer(dp_client, ...)`` (which binds it, as
    NeMo-RL's ``setup.py`` builds the client first), or pass the buffer here. ``inner``: a
    NeMo-RL data-plane client that selected batches are published to (see :meth:`publish`).
    """

    def __init__(self, buffer: ServedBuffer | None = None, *, inner: Any = None) -> None:
        self._buffer = buffer
        self.inner = inner
        self._lock = threading.Lock()
        self._derived: dict[str, dict[int, dict[str, Any]]] = {}  # group id -> row -> field -> value
        self._cleared: dict[str, set[int]] = {}  # group id -> rows clear_samples hid
        self._timeline: str | None = None  # the store's history the two dicts belong to

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickles unbound, with ``inner`` only: derived values belong to this process's claims
        (the buffer that travels with it binds the copy again)."""
        return _unbound, (self.inner,)

    def bind(self, buffer: ServedBuffer) -> None:
        """Answer from ``buffer``'s store (``TQReplayBuffer`` calls it with its ``dp_client``).

        Raises:
            BadArgument: already bound to another buffer.
        """
        if self._buffer is not None and self._buffer is not buffer:
            raise BadArgument("this KvckptDataPlane already serves another TQReplayBuffer")
        self._buffer = buffer

    @property
    def buffer(self) -> ServedBuffer:
        """The buffer whose store this client reads.

        Raises:
            BadArgument: not bound yet.
        """
        if self._buffer is None:
            raise BadArgument("KvckptDataPlane is not bound: pass it to TQReplayBuffer(dp_client, ...) first")
        return self._buffer

    def _check_partition(self, partition_id: str) -> None:
        if partition_id != self.buffer.partition_id:
            raise BadArgument(f"partition_id {partition_id!r} is not this buffer's {self.buffer.partition_id!r}")

    def _live(self, group_ids: Sequence[str]) -> None:
        """Forget what belongs to another store history or to groups no longer claimed (lock held)."""
        timeline = self.buffer.core.state()["timeline"]
        if timeline != self._timeline:
            self._derived.clear()
            self._cleared.clear()
            self._timeline = timeline
        for gid in {*group_ids, *self._derived, *self._cleared}:
            group = self.buffer.core.group(gid)
            if group is None or group.state != CLAIMED:
                self._derived.pop(gid, None)
                self._cleared.pop(gid, None)

    # -- direct-by-key ----------------------------------------------------------------------------
    def put_samples(self, sample_ids: Sequence[str], partition_id: str, fields: Any = None,
                    tags: Sequence[Mapping[str, Any]] | None = None) -> ReplayMeta | Awaitable[ReplayMeta]:
        """Keep derived values for rows of groups claimed by the current step (memory only; the
        committed rows are untouched) and pass the call on to ``inner``. Returns the written rows'
        metadata (no ``sequence_lengths``, as NeMo-RL's put result); with an async ``inner``, a
        coroutine returning it once ``inner`` has them (see :meth:`_forward`).

        Args:
            sample_ids: ``{group_id}_g{i}`` ids of claimed groups.
            partition_id: the buffer's partition.
            fields: a ``TensorDict`` or mapping of batched tensors (jagged nested or dense, one row
                per sample id).
            tags: per-row primitives; checked for alignment and returned, not kept.

        Raises:
            BadArgument: another partition, a malformed sample id, or a group not claimed (derived
                values belong to a training step; ready rows are committed and immutable).
            SchemaMismatch: a non-tensor value, or a row count other than ``len(sample_ids)``.
        """
        self._check_partition(partition_id)
        ids = [split_sample_id(s) for s in sample_ids]
        if tags is not None and len(tags) != len(ids):
            raise SchemaMismatch(f"put_samples: {len(tags)} tags for {len(ids)} sample_ids")
        names = list(fields.keys()) if fields is not None else []
        values = {name: _rows_of(fields.get(name), name, len(ids)) for name in names}
        with self._lock:
            self._live([gid for gid, _ in ids])
            for gid, index in ids:
                group = self.buffer.core.group(gid)
                if group is None or group.state != CLAIMED or index >= group.group_size:
                    state = "unknown" if group is None else group.state
                    raise BadArgument(f"put_samples: {row_id(gid, index)!r} is not a row of a group claimed "
                                      f"by the current step ({state}); committed rows are never rewritten")
            for i, (gid, index) in enumerate(ids):
                row = self._derived.setdefault(gid, {}).setdefault(index, {})
                row.update((name, values[name][i]) for name in names)
                self._cleared.get(gid, set()).discard(index)
        group_ids = list(dict.fromkeys(gid for gid, _ in ids))
        meta = ReplayMeta(partition_id, group_ids, list(sample_ids), list(names), [],
                          [dict(t) for t in tags] if tags is not None else [])
        return self._forward(meta, "put_samples", sample_ids=list(sample_ids), partition_id=partition_id,
                             fields=fields, tags=None if tags is None else [dict(t) for t in tags])

    def _forward(self, value: Any, method_name: str, **kwargs: Any) -> Any:
        """``value``, once the call is passed on to ``inner`` (if any). An async ``inner`` (its
        answer a coroutine or a Ray reference) makes the answer a coroutine that gives ``value``
        once ``inner`` is done: the controller's ``_call_dp`` awaits it."""
        if self.inner is None:
            return value
        pending = _invoke(self.inner, method_name, **kwargs)
        return _once_done(pending, value) if inspect.isawaitable(pending) else value

    def get_samples(self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]) -> Any:
        """The ``select_fields`` of ``sample_ids`` as a ``TensorDict`` batched along ``sample_ids``
        (a field whose rows differ in shape is a jagged nested tensor): derived values first, then
        the committed rows, then a derived ``prompt_ids_for_adv``.

        Raises:
            BadArgument: another partition, a malformed id, or a field that is neither stored nor
                derived for a row. NotSelectable: a row ``clear_samples`` hid, or of a group neither
                ready nor claimed (consumed, evicted, aborted, unknown).
        """
        from tensordict import TensorDict

        self._check_partition(partition_id)
        if not sample_ids:
            return TensorDict({}, batch_size=(0,))
        ids = [split_sample_id(s) for s in sample_ids]
        group_ids = list(dict.fromkeys(gid for gid, _ in ids))
        with self._lock:
            self._live(group_ids)
            hidden = [row_id(g, i) for g, i in ids if i in self._cleared.get(g, ())]
            derived = {(g, i): dict(self._derived.get(g, {}).get(i, {})) for g, i in ids}
        if hidden:
            raise NotSelectable(f"rows {hidden[:4]} were cleared by clear_samples")
        stored = self.buffer.core.schema.fields
        wanted = [f for f in select_fields if f in stored]
        if PROMPT_IDS_FIELD in select_fields and PROMPT_IDS_FIELD not in stored:
            wanted += [f for f in ("input_ids", "token_mask") if f not in wanted]
        batch = self.buffer.core.read_batch(group_ids, fields=wanted, layout="list")
        gone = [g.group_id for g in batch.groups if g.state not in (READY, CLAIMED)]
        if gone:
            raise NotSelectable(f"groups {gone[:4]} are no longer in the buffer (trained or given up); their rows "
                                "stay in the store only until a checkpoint covers their step")
        rows = {(g, i): row for g, i, row in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True)}
        out = {}
        for name in select_fields:
            column = []
            for gid, index in ids:
                row = rows.get((gid, index))
                if row is None:
                    raise NotSelectable(f"group {gid!r} has no row {index}")
                if name in derived[(gid, index)]:
                    column.append(derived[(gid, index)][name])
                elif name in stored:
                    column.append(row[name])
                elif name == PROMPT_IDS_FIELD:
                    column.append(self._prompt_ids(row))
                else:
                    raise BadArgument(f"field {name!r} is neither in the store's schema {list(stored)} nor "
                                      f"put for sample {row_id(gid, index)!r}")
            out[name] = _stack_or_nest(column)
        return TensorDict(out, batch_size=(len(ids),))

    @staticmethod
    def _prompt_ids(row: Mapping[str, Any]) -> Any:
        mask = row["token_mask"].reshape(-1)
        first = int(mask.nonzero()[0]) if bool(mask.any()) else len(mask)
        return row["input_ids"][:first]

    def get_data(self, meta: Any, select_fields: Sequence[str] | None = None) -> Any:
        """:meth:`get_samples` of ``meta``'s rows: ``select_fields``, else ``meta.fields``.

        Raises:
            BadArgument: neither names a field (nothing is fetched implicitly), or as :meth:`get_samples`.
        """
        fields = select_fields if select_fields is not None else meta.fields
        if fields is None:
            raise BadArgument("get_data needs select_fields or meta.fields; nothing is fetched implicitly")
        return self.get_samples(list(meta.sample_ids), meta.partition_id, list(fields))

    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> Awaitable[None] | None:
        """Drop the derived values of ``sample_ids`` (``None``: of every row) and hide those rows
        from this client; ids of groups whose rows are gone are ignored, as NeMo-RL's clients do.
        The call is passed on to ``inner`` (an async one's answer is a coroutine to await).

        Raises:
            BadArgument: another partition, a malformed id, or a row of a *ready* group: it
                leaves the buffer with its rows only through ``sampler.evict`` or
                ``remove_group(..., remove_in_dp=True)`` (one state transition each).
        """
        self._check_partition(partition_id)
        with self._lock:
            if sample_ids is None:
                self._derived.clear()
                return self._forward(None, "clear_samples", sample_ids=None, partition_id=partition_id)
            ids = [split_sample_id(s) for s in sample_ids]
            self._live([gid for gid, _ in ids])
            for gid in dict.fromkeys(gid for gid, _ in ids):
                group = self.buffer.core.group(gid)
                if group is not None and group.state == READY:
                    raise BadArgument(f"clear_samples: group {gid!r} is ready in the buffer; its rows leave only "
                                      "through sampler.evict or remove_group(..., remove_in_dp=True)")
            for gid, index in ids:
                if gid in self._derived:
                    self._derived[gid].pop(index, None)
                group = self.buffer.core.group(gid)
                if group is not None and group.state == CLAIMED:
                    self._cleared.setdefault(gid, set()).add(index)
        return self._forward(None, "clear_samples", sample_ids=list(sample_ids), partition_id=partition_id)

    async def publish(self, meta: ReplayMeta) -> None:
        """Put the committed rows of a selected batch (every stored field, tagged with each row's
        ``weight_version``) into ``inner``, so NeMo-RL's trainer workers read them where they
        look, and return once ``inner`` has them (a coroutine or Ray call of an async client is
        awaited, see :func:`call_client`). No-op without ``inner``. The buffer awaits it after each
        ``select`` (and ``remove(..., remove_in_dp=False)``) and undoes the claim if it raises.

        Raises:
            NotSelectable: a group's rows are gone. Whatever ``inner.put_samples`` raises.
        """
        if self.inner is None or not meta.sample_ids:
            return
        fields = await asyncio.to_thread(self.get_samples, list(meta.sample_ids), meta.partition_id,
                                         list(self.buffer.core.schema.fields))
        await call_client(self.inner, "put_samples", sample_ids=list(meta.sample_ids), partition_id=meta.partition_id,
                          fields=fields, tags=[dict(t) for t in meta.tags])

    def close(self) -> None:
        """Drop every derived value (the store is the buffer's to close). Idempotent."""
        with self._lock:
            self._derived.clear()
            self._cleared.clear()


def _unbound(inner: Any) -> KvckptDataPlane:
    """Unpickle a :class:`KvckptDataPlane` (see its ``__reduce__``)."""
    return KvckptDataPlane(inner=inner)
