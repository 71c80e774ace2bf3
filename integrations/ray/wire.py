"""What crosses the wire between the buffer actor and its callers: one :class:`Codec` per kind of value.

The operation table (:data:`kvckpt.buffer.surface.TABLE`) names, per operation, the codec of its result
and of the arguments that need one; :data:`CODECS` implements each name once, both ways: ``to_wire``
where the value leaves a process (the actor's result, a caller's argument), ``from_wire`` where it
arrives. The actor's methods made from the table (:func:`kvckpt.integrations.ray.actor.remote_method`)
and :func:`call` (a blocking call of any actor operation with ReplayBuffer's result types) use them.

* records (leases, commit results, selections, group records, ledger entries, plans) travel as plain
  dicts (the records' ``to_dict`` / ``from_dict``);
* row payloads as numpy arrays inside one Ray object per call (:func:`to_wire` turns torch tensors into
  zero-copy numpy views; Ray ships numpy out of band);
* errors as themselves (a refused call raises the kvckpt error in the caller).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvckpt import (
    Admission,
    Batch,
    CheckpointResult,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Progress,
    RecoveryPlan,
    Selection,
)
from kvckpt.buffer.surface import BY_NAME, DIFFERS, signature
from kvckpt.errors import BadArgument


def to_wire(value: Any) -> Any:
    """Rows (nested dicts/lists of tensors) with every CPU torch tensor replaced by a zero-copy
    numpy view, so Ray ships it out of band. Dtypes numpy lacks (bfloat16) stay torch tensors."""
    if isinstance(value, Mapping):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        tensor = value.detach().cpu()
        with contextlib.suppress(TypeError):
            return tensor.numpy()
        return tensor
    return value


def _to_torch(value: Any) -> Any:
    import torch

    if isinstance(value, np.ndarray):
        # Arrays deserialised from Ray's object store are read-only views of shared memory.
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    if isinstance(value, Mapping):
        return {k: _to_torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_torch(v) for v in value]
    return value


def plan_to_dict(plan: RecoveryPlan) -> dict[str, Any]:
    """A recovery plan as a dict (leases as dicts); inverse of :func:`plan_from_dict`."""
    return dataclasses.asdict(plan)


def plan_from_dict(doc: Mapping[str, Any]) -> RecoveryPlan:
    """Rebuild a :class:`~kvckpt.RecoveryPlan` (leases as :class:`~kvckpt.Lease`) from the dict
    the actor's ``recovery_plan()``, ``recover()`` or ``restore()`` returns."""
    return RecoveryPlan(**{**doc, "leases": [Lease.from_dict(dict(x)) for x in doc["leases"]]})


def batch_to_dict(batch: Batch) -> dict[str, Any]:
    """A batch with numpy payloads and dict group records (see :func:`batch_from_dict`)."""
    return {"group_ids": batch.group_ids, "row_indices": batch.row_indices, "lengths": to_wire(batch.lengths),
            "tensors": to_wire(batch.tensors), "cu_seqlens": to_wire(batch.cu_seqlens),
            "rows": to_wire(batch.rows), "groups": [g.to_dict() for g in batch.groups]}


def batch_from_dict(doc: Mapping[str, Any]) -> Batch:
    """Rebuild a :class:`~kvckpt.Batch` (torch tensors, owning their memory) from the dict
    :meth:`BufferActor.read_batch <kvckpt.integrations.ray.actor.BufferActor.read_batch>` returns."""
    return Batch(list(doc["group_ids"]), list(doc["row_indices"]), _to_torch(doc["lengths"]),
                 tensors=_to_torch(dict(doc["tensors"])), cu_seqlens=_to_torch(doc["cu_seqlens"]),
                 rows=_to_torch(list(doc["rows"])), groups=[GroupInfo.from_dict(g) for g in doc["groups"]])


def progress_to_dict(found: Mapping[int, Progress]) -> dict[int, dict[str, Any]]:
    """A group's progress records as ``{index: {"tokens", "logprobs", "versions", "fields"}}`` with numpy
    payloads (see :func:`progress_from_dict`)."""
    return {i: to_wire({"tokens": p.tokens, "logprobs": p.logprobs, "versions": p.versions, "fields": p.fields})
            for i, p in found.items()}


def progress_from_dict(doc: Mapping[Any, Mapping[str, Any]]) -> dict[int, Progress]:
    """Rebuild :class:`~kvckpt.Progress` records (torch tensors, owning their memory) from the dict
    :meth:`BufferActor.progress <kvckpt.integrations.ray.actor.BufferActor.progress>` returns."""
    return {int(i): Progress(int(i), _to_torch(p["tokens"]), _to_torch(p["logprobs"]), _to_torch(p["versions"]),
                             _to_torch(dict(p["fields"]))) for i, p in doc.items()}


def lease_dict(lease: Lease | Mapping[str, Any]) -> dict[str, Any]:
    """A lease (or its dict) as its dict."""
    return lease.to_dict() if isinstance(lease, Lease) else dict(lease)


def _selection_from_dict(doc: Mapping[str, Any]) -> Selection:
    return Selection(doc["step"], tuple(GroupInfo.from_dict(dict(g)) for g in doc["groups"]))


def _group_ids_of(groups: Any) -> list[str]:
    """A selection (or its dict) or group ids, as the ids."""
    if isinstance(groups, Selection):
        return groups.group_ids
    if isinstance(groups, Mapping):
        return [g["group_id"] for g in groups["groups"]]
    return list(groups)


def _checkpoint_from_dict(doc: Mapping[str, Any]) -> Any:
    return CheckpointResult(**doc["result"]) if doc.get("done") else dict(doc)


def _optional(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else fn(value)


def _each(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda values: [v if isinstance(v, BaseException) else fn(v) for v in values]


def _same(value: Any) -> Any:
    return value


def _lease_item(item: Mapping[str, Any]) -> dict[str, Any]:
    return {**to_wire(dict(item)), "lease": lease_dict(item["lease"])}


@dataclass(frozen=True)
class Codec:
    """How one kind of value crosses the wire.

    Attributes:
        to_wire: the value as it leaves a process.
        from_wire: the value rebuilt where it arrives.
        wire: the annotation of the value on the wire (the actor's generated signature shows it).
    """

    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]
    wire: str


#: Every codec the operation table names.
CODECS: dict[str, Codec] = {
    "plain": Codec(_same, _same, ""),
    "lease": Codec(lease_dict, lambda d: Lease.from_dict(dict(d)), "Mapping[str, Any]"),
    "leases": Codec(lambda xs: [x.to_dict() for x in xs], lambda ds: [Lease.from_dict(dict(d)) for d in ds],
                    "list[dict[str, Any]]"),
    "admission": Codec(lambda a: a.to_dict(), lambda d: Admission.from_dict(dict(d)), "dict[str, Any]"),
    "admission?": Codec(_optional(lambda a: a.to_dict() if isinstance(a, Admission) else dict(a)),
                        _optional(lambda d: Admission.from_dict(dict(d))), "Mapping[str, Any] | None"),
    "commit": Codec(lambda r: r.to_dict(), lambda d: CommitResult.from_dict(dict(d)), "dict[str, Any]"),
    "commits": Codec(_each(lambda r: r.to_dict()), _each(lambda d: CommitResult.from_dict(dict(d))),
                     "list[dict[str, Any] | BaseException]"),
    "lease items": Codec(lambda items: [_lease_item(i) for i in items], _each(lambda i: {**i, "lease": Lease.from_dict(
        dict(i["lease"]))}), "Sequence[Mapping[str, Any]]"),
    "ids": Codec(list, list, "Iterable[str]"),
    "ids?": Codec(_optional(list), _optional(list), "Iterable[str] | None"),
    "selection or ids": Codec(_group_ids_of, _group_ids_of, "Iterable[str] | Mapping[str, Any]"),
    "selection": Codec(lambda s: s.to_dict(), _selection_from_dict, "dict[str, Any]"),
    "batch": Codec(batch_to_dict, batch_from_dict, "dict[str, Any]"),
    "progress": Codec(progress_to_dict, progress_from_dict, "dict[int, dict[str, Any]]"),
    "group?": Codec(_optional(lambda g: g.to_dict()), _optional(lambda d: GroupInfo.from_dict(dict(d))),
                    "dict[str, Any] | None"),
    "groups": Codec(lambda gs: [g.to_dict() for g in gs], lambda ds: [GroupInfo.from_dict(dict(d)) for d in ds],
                    "list[dict[str, Any]]"),
    "ledger": Codec(lambda es: [e.to_dict() for e in es], lambda ds: [LedgerEntry.from_dict(dict(d)) for d in ds],
                    "list[dict[str, Any]]"),
    "plan": Codec(plan_to_dict, plan_from_dict, "dict[str, Any]"),
    "checkpoint": Codec(_same, _checkpoint_from_dict, "dict[str, Any]"),
}
#: Results that never cross the wire: a store handle, an encoder (no operation offered on the actor returns one).
LOCAL = frozenset({"handle", "local"})


def encode_arguments(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """Operation ``name``'s keyword arguments as they leave the caller (its row's argument codecs)."""
    codecs = BY_NAME[name].args
    return {k: CODECS[codecs[k]].to_wire(v) if k in codecs else v for k, v in arguments.items()}


def call(actor: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """Run operation ``name`` of :data:`kvckpt.buffer.surface.TABLE` on the buffer actor and wait: the
    arguments go through the row's codecs, the result comes back as ReplayBuffer returns it, a refusal
    raises the actor's kvckpt error itself (not Ray's wrapper)."""
    import ray

    row = BY_NAME[name]
    offer = row.on("actor")
    if not offer.offered:
        raise BadArgument(f"the buffer actor does not offer {name}: {offer.why}")
    if offer.how == DIFFERS:  # the actor's own parameters: passed as given
        remote = getattr(actor, name).remote(*args, **encode_arguments(name, kwargs))
    else:
        remote = getattr(actor, name).remote(**encode_arguments(name, signature(name).bind(*args, **kwargs).arguments))
    try:
        doc = ray.get(remote)
    except ray.exceptions.RayTaskError as exc:
        raise exc.cause from None
    return CODECS[row.result].from_wire(doc)
