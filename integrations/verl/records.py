"""Where verl's TransferQueue traffic lives in the ledger file, and how a batch becomes records.

verl keeps everything its V1 replay buffer knows in TransferQueue: per key (a prompt ``{uid}`` or a
trajectory ``{uid}_{session}_{index}``) a tag (``status``, ``global_steps``, ...) and fields. The
ledger stores each tag entry and each field of each key as its own TransferQueue value record
(:mod:`kvckpt.integrations.transferqueue.values`: checksummed, no pickle), under

* ``p/{partition}/{key}/t/{name}``: one tag entry (a later put of the same name replaces it, as
  TransferQueue merges tags),
* ``p/{partition}/{key}/f/{field}``: one field of one sample,
* ``p/{partition}/{key}/c``: the key was consumed by the training step in its value (kept until a
  checkpoint at or after that step covers it),

plus four records of the run: ``verl/run`` (its write identity is the current run's token),
``verl/cursor`` (the trainer's dataloader state at the last dispatch), ``verl/checkpoint`` (the
step of the last checkpoint the ledger was copied into) and ``verl/trainer`` (the trainer's step, the newest
weight version a token may carry; absent until the trainer reports one, and again after a restart),
and an index of the consumed marks by step,
``verl/consumed/{step:012d}/{partition}/{key}``, written and deleted in the same transaction as the
mark it indexes: a checkpoint finds the marks it covers without reading the rest of the ledger.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from kvckpt.errors import BadArgument

RUN_KEY = "verl/run"
CURSOR_KEY = "verl/cursor"
CHECKPOINT_KEY = "verl/checkpoint"
#: The trainer's training step (verl's ``global_steps``, its weights' version): no token progress of a later version.
TRAINER_KEY = "verl/trainer"
ITEMS = "p/"
TAG, FIELD, CONSUMED = "t", "f", "c"
MARKS = "verl/consumed/"


def item_prefix(partition_id: str, key: str = "") -> str:
    """The prefix of every record of ``key`` in ``partition_id`` (of the whole partition without ``key``)."""
    for what, name in (("partition id", partition_id), ("key", key)):
        if not isinstance(name, str) or "/" in name:
            raise BadArgument(f"verl ledger: a {what} is a string without '/', got {name!r}")
    return f"{ITEMS}{partition_id}/{key}/" if key else f"{ITEMS}{partition_id}/"


def record_key(partition_id: str, key: str, kind: str, name: str = "") -> str:
    """The ledger key of one tag entry (``TAG``), field (``FIELD``) or the consumed mark (``CONSUMED``)."""
    return item_prefix(partition_id, key) + (f"{kind}/{name}" if name else kind)


def split(ledger_key: str) -> tuple[str, str, str, str]:
    """``(partition_id, key, kind, name)`` of an item record's ledger key."""
    parts = ledger_key[len(ITEMS):].split("/", 3)
    if not ledger_key.startswith(ITEMS) or len(parts) < 3 or parts[2] not in (TAG, FIELD, CONSUMED):
        raise BadArgument(f"verl ledger: {ledger_key!r} is not an item record key")
    return parts[0], parts[1], parts[2], parts[3] if len(parts) == 4 else ""


def mark_index_key(step: int, partition_id: str, key: str) -> str:
    """The index entry of ``key``'s consumed mark of training step ``step`` (ordered by step)."""
    item_prefix(partition_id, key)  # the same refusal of a '/' in either name
    if type(step) is not int or not 0 <= step < 10**12:
        raise BadArgument(f"verl ledger: a training step is an integer in [0, 10**12), got {step!r}")
    return f"{MARKS}{step:012d}/{partition_id}/{key}"


def split_mark_index(index_key: str) -> tuple[int, str, str]:
    """``(step, partition_id, key)`` of a consumed-mark index entry."""
    parts = index_key[len(MARKS):].split("/")
    if not index_key.startswith(MARKS) or len(parts) != 3 or not parts[0].isdigit():
        raise BadArgument(f"verl ledger: {index_key!r} is not a consumed-mark index key")
    return int(parts[0]), parts[1], parts[2]


def group_of(ledger_key: str) -> tuple[str, str] | None:
    """``(partition_id, uid)`` of the prompt group an item record or a consumed-mark index entry belongs to
    (a prompt ``{uid}`` and its trajectories ``{uid}_{session}_{index}`` are one group); ``None`` for the
    run's own records (run, cursor, checkpoint)."""
    if ledger_key.startswith(ITEMS):
        partition_id, key, _, _ = split(ledger_key)
    elif ledger_key.startswith(MARKS):
        _, partition_id, key = split_mark_index(ledger_key)
    else:
        return None
    return partition_id, key.split("_", 1)[0]


def groups_lacking(saved_keys: list[str], live: Any) -> list[str]:
    """The keys of ``saved_keys`` (a checkpoint's) whose whole group the live ledger no longer holds: not one
    record of its prompt or of any of its trajectories (``live.has(prefix)``). A group the live ledger holds
    keeps its live records only, so a group is never a mixture of two moments."""
    held: dict[tuple[str, str], bool] = {}
    chosen = []
    for ledger_key in saved_keys:
        group = group_of(ledger_key)
        if group is None:
            continue
        if group not in held:
            partition_id, uid = group
            held[group] = live.has(item_prefix(partition_id, uid)) or live.has(f"{ITEMS}{partition_id}/{uid}_")
        if not held[group]:
            chosen.append(ledger_key)
    return chosen


def rows_of(fields: TensorDict | Mapping[str, Any] | None, count: int, *, single: bool) -> list[dict[str, Any]]:
    """The per-key field values of a put, as TransferQueue splits them.

    ``single`` is ``kv_put`` with a dict: each value is the one sample's own. Otherwise ``fields``
    is a batch of ``count``: dense tensors are indexed, nested tensors unbound, ``NonTensorStack``
    elements taken one by one and a ``NonTensorData`` repeated.
    """
    if fields is None:
        return [{} for _ in range(count)]
    if single and not isinstance(fields, TensorDict):
        return [dict(fields)]
    if not isinstance(fields, TensorDict):
        raise BadArgument(f"verl ledger: fields of a batch put are a TensorDict, not {type(fields).__name__}")
    if fields.batch_size[:1] != torch.Size([count]):
        raise BadArgument(f"verl ledger: fields of batch size {tuple(fields.batch_size)} for {count} keys")
    rows: list[dict[str, Any]] = [{} for _ in range(count)]
    for name in fields.keys():  # noqa: SIM118 (iterating a TensorDict yields its rows, not its keys)
        value = fields.get(name)
        if isinstance(value, NonTensorStack):
            items = value.tolist()
        elif isinstance(value, NonTensorData):
            items = [value.data] * count
        elif isinstance(value, torch.Tensor):
            items = list(value.unbind(0)) if value.is_nested else [value[i] for i in range(count)]
        else:
            raise BadArgument(f"verl ledger: field {name!r} is a {type(value).__name__}; the ledger stores tensors "
                              "and non-tensor data (TensorDict's NonTensorData / NonTensorStack)")
        for row, item in zip(rows, items, strict=True):
            row[name] = item
    return rows


def state_to_json(value: Any) -> Any:
    """A dataloader ``state_dict`` as JSON: tensors (a sampler's generator state) as dtype, shape, items."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "items": value.reshape(-1).tolist()}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise BadArgument("verl ledger: a dataloader state with a non-string key cannot be stored")
        return {k: state_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [state_to_json(v) for v in value]
    return value


def state_from_json(value: Any) -> Any:
    """The inverse of :func:`state_to_json` (tensor dtypes restricted to torch's plain numeric ones)."""
    if isinstance(value, dict) and "__tensor__" in value:
        dtype = getattr(torch, str(value["__tensor__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise BadArgument(f"verl ledger: a stored dataloader state names dtype {value['__tensor__']!r}")
        return torch.tensor(value["items"], dtype=dtype).reshape(value["shape"])
    if isinstance(value, dict):
        return {k: state_from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [state_from_json(v) for v in value]
    return value


#: Token progress of in-flight samples, recorded under the replay buffer's rules (``ValueStore.record_progress``,
#: ledger format 2): ``verl/progress/{uid}/{session}/{start:010d}`` (one chunk of one weight version: token ids,
#: logprobs, in the buffer's chunk encoding) and ``verl/progress/{uid}/{session}.done`` (the sample finished: its
#: last chunk is in). Format 1 (kvckpt before issue 45) kept three records per chunk, ``.../{start:010d}/{t|l|v}``,
#: and ``.../done``; :mod:`.upgrade` moves them into format 2 when the ledger opens.
PROGRESS = "verl/progress/"
#: The longest sample prefix the ledger records (verl's ``response_length`` is far below it).
MAX_TOKENS = 1 << 20


def progress_prefix(uid: str, session: int) -> str:
    """The prefix of every progress chunk of sample ``session`` of prompt ``uid``."""
    item_prefix("train", uid)  # the same refusal of a '/' in the uid
    if type(session) is not int or session < 0:
        raise BadArgument(f"verl ledger: a session id is an integer >= 0, got {session!r}")
    return f"{PROGRESS}{uid}/{session}/"


def done_key(uid: str, session: int) -> str:
    """The key of the mark that sample ``session`` of prompt ``uid`` finished."""
    return progress_prefix(uid, session)[:-1] + ".done"
