"""In-flight samples' token progress in the verl ledger: what one flush writes and what a resume reads.

A sample (``session`` of prompt ``uid``) has its generated tokens recorded as chunks, each its own records
(:func:`~.records.chunk_key`: token ids, logprobs, weight versions), appended once and never rewritten, and a
``done`` record once its last chunk is in. The ledger actor runs :func:`stage` and writes its result in one
fenced transaction (``VerlLedger.record_progress``); it is the file's only writer, so the durable length read
here cannot change before that write.
"""

from __future__ import annotations

from typing import Any

import torch
from kvckpt.integrations.transferqueue.values import decode_value, encode_value, new_write_id
from kvckpt.integrations.verl.errors import ProgressGap
from kvckpt.integrations.verl.records import CHUNK_FIELDS, DONE, PROGRESS, chunk_key, progress_prefix

from kvckpt import ValueStore, write_id_of
from kvckpt.errors import BadArgument, CorruptRecord

_LEVEL = 1
_DTYPES = (torch.int64, torch.float32, torch.int64)


def stage(values: ValueStore, items: list[dict[str, Any]],
          ) -> tuple[list[str], list[bytes], list[str], list[int | ProgressGap]]:
    """The records one flush writes and deletes, and its per-item result.

    Each item is ``{"uid", "session", "start", "tokens", "logprobs", "versions"}`` (a chunk; ``"final": True``
    also marks the sample done) or ``{"uid", "session", "drop": True}`` (the sample's progress is deleted). A
    chunk that does not start where the sample's durable tokens end gets a :class:`ProgressGap` and writes
    nothing. Returns ``(keys, records, deletes, results)``; a result is the durable token count after the item.

    Raises:
        BadArgument: an item's three lists differ in length (the whole flush is refused).
    """
    keys: list[str] = []
    records: list[bytes] = []
    deletes: list[str] = []
    out: list[int | ProgressGap] = []
    lengths: dict[tuple[str, int], int] = {}
    for item in items:
        uid, session = item["uid"], item["session"]
        prefix = progress_prefix(uid, session)
        if item.get("drop"):
            deletes += values.keys(prefix)
            lengths[(uid, session)] = 0
            out.append(0)
            continue
        durable = lengths.get((uid, session))
        durable = durable_length(values, uid, session) if durable is None else durable
        start, columns = item["start"], (item["tokens"], item["logprobs"], item["versions"])
        if len({len(c) for c in columns}) != 1:
            raise BadArgument(f"verl ledger: progress chunk of {uid}/{session} has {[len(c) for c in columns]} "
                              "tokens, logprobs and versions; they must match")
        if start != durable:
            out.append(ProgressGap(f"verl ledger: a progress chunk of {uid}/{session} starts at token {start}, "
                                   f"but {durable} tokens are durable"))
            continue
        for name, column, dtype in zip(CHUNK_FIELDS, columns, _DTYPES, strict=True):
            if not column:
                break  # an empty last flush only marks the sample done
            key = chunk_key(uid, session, start, name)
            keys.append(key)
            records.append(encode_value(key, torch.tensor(column, dtype=dtype), new_write_id(), _LEVEL))
        if item.get("final"):
            keys.append(prefix + DONE)
            records.append(encode_value(prefix + DONE, {}, new_write_id(), _LEVEL))
        lengths[(uid, session)] = start + len(columns[0])
        out.append(lengths[(uid, session)])
    return keys, records, deletes, out


def read(values: ValueStore, uid: str, session: int) -> dict[str, Any] | None:
    """The durable progress of one sample: ``{"tokens", "logprobs", "versions"}`` (lists, in token order) and
    ``"done"``, or ``None`` if none is recorded.

    Raises:
        CorruptRecord: the chunks are not contiguous from token 0.
    """
    keys = values.keys(progress_prefix(uid, session))
    if not keys:
        return None
    columns: dict[str, list[Any]] = {name: [] for name in CHUNK_FIELDS}
    done = False
    for key, raw in zip(keys, values.get(keys), strict=True):
        tail = key.rsplit("/", 2)
        if tail[-1] == DONE:
            done = True
            continue
        start, name = int(tail[-2]), tail[-1]
        if len(columns[name]) != start:
            raise CorruptRecord(f"verl ledger: the progress of {uid}/{session} has a gap at token {start}")
        columns[name] += decode_value(key, raw, write_id_of(raw, key)).tolist()
    return {"tokens": columns["t"], "logprobs": columns["l"], "versions": columns["v"], "done": done}


def stale(values: ValueStore, keep_uids: set[str]) -> list[str]:
    """The progress records of every prompt not in ``keep_uids`` (a restart's in-flight prompts): what a restart
    deletes, so a sample that will never resume (its prompt finished, failed or was dropped) leaves nothing."""
    return [k for k in values.keys(PROGRESS) if k[len(PROGRESS):].split("/", 1)[0] not in keep_uids]


def of_prompts(values: ValueStore, uids: list[str]) -> list[str]:
    """Every progress record of every sample of the prompts ``uids``: what the write that ends their groups (verl's
    ``finished`` / ``failure`` status) deletes in the same transaction."""
    return [key for uid in dict.fromkeys(uids) for key in values.keys(f"{PROGRESS}{uid}/")]


def durable_length(values: ValueStore, uid: str, session: int) -> int:
    """How many of the sample's tokens are durable (its last chunk's start plus its length)."""
    chunks = [k for k in values.keys(progress_prefix(uid, session)) if k.endswith("/t")]
    if not chunks:
        return 0
    raw = values.get([chunks[-1]])[0]
    return int(chunks[-1].rsplit("/", 2)[-2]) + len(decode_value(chunks[-1], raw, write_id_of(raw, chunks[-1])))
