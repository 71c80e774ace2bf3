"""Token progress on the value store: the buffer's rules (:func:`kvckpt.transitions.progress_step.append`)
over the value store's chunks (:class:`kvckpt.values.records.ValueChunks`).

A value store has no leases, no ledger entries and no schema. Its fence is a record (the value store's
``fence``: the writer's identity must be the one that wrote it, checked inside the write transaction) and
its ``max_tokens`` is its caller's. Everything else is the buffer's, byte for byte: a sample (``index`` of
``group_id``) holds its chunks under :func:`~kvckpt.values.records.progress_row` of a caller's prefix, one
record per run of one weight version, encoded as the buffer encodes a chunk (the same header, with the
value key ``k`` every value-store record names); a chunk must start at the durable length (a gap is
:class:`~kvckpt.errors.ProgressGap`), a covered position must hold the identical bytes (else
:class:`~kvckpt.errors.DuplicateCommit`), the prefix stays within ``max_tokens``
(:class:`~kvckpt.errors.SchemaMismatch`), and a fenced writer's resend whose bytes landed gets its first
answer. ``ValueStore.record_progress`` runs :func:`record` in one write transaction.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvckpt import args
from kvckpt.errors import BadArgument, KvckptError, SchemaMismatch
from kvckpt.storage import codec, keys
from kvckpt.storage.casts import cast
from kvckpt.transitions import progress
from kvckpt.transitions.progress_step import StepChunk, StepSequence, append, meta_head, too_long
from kvckpt.values.records import ValueChunks, chunk_key, progress_row


def sequence(prefix: str, item: Mapping[str, Any], max_tokens: int) -> StepSequence | KvckptError:
    """Judge and encode one item ``{"group", "index", "start", "tokens", "logprobs", "versions"}`` (``versions``:
    one weight version per token) outside the transaction: its :class:`StepSequence`, or the error refusing it.
    An item of no tokens is kept (it writes nothing; :func:`append` holds its start to the durable length).

    Refusals: BadArgument (a malformed item), SchemaMismatch (lengths that differ, a lossy cast, a prefix past
    ``max_tokens``).
    """
    try:
        group_id, index = item["group"], args.integer("index", item["index"])
        start = args.integer("start", item["start"])
        row = progress_row(prefix, group_id, index)
        where = f"progress of {keys.row_id(group_id, index)} at token {start}"
        ids, lps, vs = (cast(_typed(item[name], dtype), dtype, where, name)
                        for name, dtype in (("tokens", "int64"), ("logprobs", "float32"), ("versions", "int64")))
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 for a in (ids, lps, vs)) or \
                not len(ids) == len(lps) == len(vs):
            raise SchemaMismatch(f"{where}: tokens, logprobs and versions are 1-D of one length, got "
                                 f"{[np.shape(a) for a in (ids, lps, vs)]}; nothing was written")
        if start + len(ids) > max_tokens:
            raise too_long(where, len(ids), start, max_tokens)
    except KeyError as exc:
        return BadArgument(f"a progress item needs group, index, start, tokens, logprobs and versions: {exc!r}")
    except KvckptError as exc:
        return exc
    assert isinstance(ids, np.ndarray) and isinstance(lps, np.ndarray) and isinstance(vs, np.ndarray)
    gid_json = codec.json_text(group_id)
    runs = [0, *(np.flatnonzero(np.diff(vs)) + 1).tolist(), len(ids)] if len(ids) else []
    chunks = []
    for a, b in itertools.pairwise(runs):
        version, at = int(vs[a]), start + a
        meta = f"{meta_head(gid_json, index, at, b - a)}{version},\"k\":{codec.json_text(chunk_key(row, at))}}}"
        chunks.append(StepChunk(at, b - a, version,
                                codec.encode_stored([("tokens", "int64", ids[a:b]), ("logprobs", "float32", lps[a:b])],
                                                    meta)))
    newest = max((c.version for c in chunks), default=0)
    return StepSequence(None, index, start + len(ids), tuple(chunks), gid_json, row.encode(), newest, group_id)


def _typed(column: Any, dtype: str) -> Any:
    """An empty column as an empty array of ``dtype`` (an empty list would be read as float64)."""
    return np.empty(0, dtype) if len(column) == 0 else column


def record(rows: ValueChunks, sequences: Sequence[StepSequence | KvckptError],
           holds: Callable[[], None], newest: int | None = None, versions: str = "") -> list[int | KvckptError]:
    """The transitions of one call, inside its write transaction: per sequence the end of its durable chunk
    (the same on a resend of a landed one) or the error refusing it (nothing of it written). ``holds()``
    raises the fence's refusal (a :class:`~kvckpt.errors.StaleAttempt`); a chunk of a weight version after
    ``newest`` (``None``: not checked; ``versions`` says what it is) is refused ``FutureVersion``, by
    :func:`~kvckpt.transitions.progress_step.append`, the buffer's rule."""
    out: list[int | KvckptError] = []
    for s in sequences:
        if isinstance(s, KvckptError):
            out.append(s)
            continue
        try:
            out.append(append(rows, s, holds, newest, versions))
        except KvckptError as exc:
            out.append(exc)
    return out


def read(rows: ValueChunks, prefix: str, group_id: str, index: int,
         max_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A sample's durable prefix: its tokens, logprobs and per-token weight versions, or ``None`` without one.

    Raises:
        CorruptRecord: a chunk is damaged or names another sample or position, or the chunks leave a gap or
            overlap.
    """
    row = progress_row(prefix, group_id, index)
    limits = progress.bare_chunk_limits(max_tokens)
    chunks = [progress.decode_chunk_within(limits, group_id, index, start, value)
              for start, value in rows.chunks(row.encode())]
    if not chunks:
        return None
    progress.check_contiguous(group_id, index, chunks)
    return (np.concatenate([c.arrays["tokens"] for c in chunks]),
            np.concatenate([c.arrays["logprobs"] for c in chunks]),
            np.concatenate([np.full(c.meta["length"], c.meta["version"], np.int64) for c in chunks]))
