"""Token progress: what a sample still being generated has produced so far, durable chunk by chunk.

A producer holding a lease records each new chunk of a sample's completion (tokens, their
logprobs, the weight version that produced them, and any per-token generation fields the schema
declares) in a step message (:mod:`kvckpt.transitions.progress_step`: one transition per sequence,
fenced exactly like a commit, by the rules here) that appends one record under the key
``(group, row index, start)``. A sample's durable prefix is the
concatenation of its chunks; its length is where the next chunk starts.

The commit of the sample's row holds the row against the prefix and deletes it in the same
transaction (:func:`consume`); the abort of its group deletes it too. Recovery, restore and
redispatch keep it: the ledger entry, not the chunk, carries the fencing, so a new attempt
continues from the prefix and the old attempt's appends are refused.

The row fields a commit holds against the prefix (the vLLM worker's rows, NeMo-RL's names):
:data:`TOKENS_FIELD` (prompt + completion), the first of :data:`MASK_FIELDS` the row has (1 on
completion tokens; without one the whole token field is the completion) and, when the schema declares it,
:data:`VERSIONS_FIELD` (the weight version of every completion token).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvckpt import args
from kvckpt.errors import (
    BadArgument,
    CorruptRecord,
    SampleCommitted,
    SchemaMismatch,
    UnknownGroup,
)
from kvckpt.storage import codec, keys
from kvckpt.storage.casts import cast
from kvckpt.storage.codec import TEXT_DTYPES, Limits
from kvckpt.storage.schema import RowSchema
from kvckpt.tables.access import Tables
from kvckpt.tables.records import ABORTED, EVICTED, Lease, LedgerEntry
from kvckpt.transitions.fencing import check_against_entry, fence

#: The row field holding a row's tokens (prompt + completion).
TOKENS_FIELD = "input_ids"
#: The row fields that are non-zero exactly on completion tokens, by name: NeMo-RL's and the vLLM
#: worker's ``token_mask``, TRL's ``completion_mask`` (optional in a schema; the first present is used).
MASK_FIELDS = ("token_mask", "completion_mask")
#: The row field holding each token's weight version (optional in a schema; int64, per token).
VERSIONS_FIELD = "token_versions"
#: Fields of a stored chunk; the schema's generation fields are stored as ``FIELD_PREFIX + name``.
_TOKENS, _LOGPROBS, FIELD_PREFIX = "tokens", "logprobs", "f."
_WHAT = "progress"


@dataclass(frozen=True)
class Chunk:
    """One encoded progress chunk, ready for :func:`record` (built outside the transaction)."""

    lease: Lease
    index: int
    start: int
    length: int
    version: int
    value: bytes


def encode_chunk(schema: RowSchema, lease: Lease, index: Any, start: Any, tokens: Any, logprobs: Any,
                 weight_version: Any, fields: Mapping[str, Any] | None) -> Chunk:
    """Check (:func:`check_chunk`) and encode one chunk as it is stored.

    Raises:
        As :func:`check_chunk`.
    """
    index, start, version, arrays, dtypes = check_chunk(schema, lease, index, start, tokens, logprobs,
                                                        weight_version, fields)
    length = len(arrays[_TOKENS])
    meta = {"group_id": lease.group_id, "index": index, "start": start, "length": length, "version": version}
    return Chunk(lease, index, start, length, version, codec.encode(arrays, meta, level=0, dtypes=dtypes))


def check_chunk(schema: RowSchema, lease: Lease, index: Any, start: Any, tokens: Any, logprobs: Any,
                weight_version: Any, fields: Mapping[str, Any] | None,
                ) -> tuple[int, int, int, dict[str, Any], dict[str, str]]:
    """The checks of one chunk that need no transaction; returns its index, start and weight version, its
    arrays cast to their stored dtypes (``tokens``, ``logprobs``, ``f.<field>``) and the fields' dtypes.

    Raises:
        BadArgument: ``index`` outside the group, a negative ``start``, an empty chunk, a field the
            schema does not declare as a per-token field.
        SchemaMismatch: tokens or logprobs not 1-D or of different lengths, a field of another
            length or trailing shape, a lossy cast, or a prefix longer than the schema's ``max_tokens``.
    """
    index = args.integer("index", index)
    start = args.integer("start", start)
    version = args.integer("weight_version", weight_version, minimum=None)
    gid = lease.group_id
    where = f"progress of {keys.row_id(gid, index)} at token {start}"
    if index >= lease.group_size:
        raise BadArgument(f"{where}: row index {index} is outside the group (size {lease.group_size}); "
                          "nothing was written")
    ids = cast(tokens, "int64", where, "tokens")
    lps = cast(logprobs, "float32", where, "logprobs")
    if ids.ndim != 1 or lps.ndim != 1:
        raise SchemaMismatch(f"{where}: tokens and logprobs are 1-D, got shapes {list(ids.shape)} and "
                             f"{list(lps.shape)}; nothing was written")
    if len(ids) != len(lps):
        raise SchemaMismatch(f"{where}: {len(ids)} tokens but {len(lps)} logprobs; nothing was written")
    if not len(ids):
        raise BadArgument(f"{where}: an empty chunk records nothing; nothing was written")
    if start + len(ids) > schema.max_tokens:
        raise SchemaMismatch(f"{where}: {len(ids)} tokens would make the prefix {start + len(ids)} tokens long, "
                             f"over the schema's max_tokens {schema.max_tokens}; nothing was written")
    arrays: dict[str, Any] = {_TOKENS: ids, _LOGPROBS: lps}
    dtypes: dict[str, str] = {}
    for name, value in (fields or {}).items():
        spec = schema.fields.get(name)
        if spec is None or spec.kind != "token" or spec.dtype in TEXT_DTYPES or name in (TOKENS_FIELD, VERSIONS_FIELD):
            raise BadArgument(f"{where}: {name!r} is not a per-token generation field of the schema (its token "
                              f"fields other than {TOKENS_FIELD!r} and {VERSIONS_FIELD!r}); nothing was written")
        arr = cast(value, spec.dtype, where, name)
        trailing = tuple(spec.shape or ())
        if arr.ndim < 1 or arr.shape[0] != len(ids) or tuple(arr.shape[1:]) != trailing:
            raise SchemaMismatch(f"{where}: field {name!r} has shape {list(arr.shape)}, expected "
                                 f"{[len(ids), *trailing]}; nothing was written")
        arrays[FIELD_PREFIX + name] = arr
        dtypes[FIELD_PREFIX + name] = spec.dtype
    return index, start, version, arrays, dtypes



def check_writable(t: Tables, store_id: str, lease: Lease, index: int, where: str, entry: LedgerEntry | None) -> None:
    """Refuse progress of sample ``index`` under ``lease`` unless the lease holds the group's
    ledger entry (``entry``, read by the caller) and the sample is not committed yet.

    Raises:
        StaleAttempt (or a subclass), LeaseMismatch: the lease is fenced, exactly as a commit's.
        UnknownGroup: the group is neither in flight nor committed (or was aborted or evicted).
        SampleCommitted: the sample's row (or its whole group) is already committed.
    """
    check_holds(t, store_id, lease, where, entry)
    check_row_open(lease.group_id, index, where, entry)


def check_holds(t: Tables, store_id: str, lease: Lease, where: str, entry: LedgerEntry | None) -> None:
    """The part of :func:`check_writable` that is the same for every sample of the group: the
    lease holds ``entry`` (so ``entry`` is not ``None`` when this returns).

    Raises:
        As :func:`check_writable`, except a committed row of an in-flight group.
    """
    gid = lease.group_id
    if entry is None:
        group = t.group(gid)
        if group is None or group.state in (EVICTED, ABORTED):
            state = "neither in flight nor committed" if group is None else group.state
            raise UnknownGroup(f"{where} refused: group {gid!r} is {state}; nothing was written")
        fence(lease, store_id, group.timeline, group.attempt, f"committed ({group.state})", _WHAT)
        raise SampleCommitted(f"{where} refused: group {gid!r} is already committed ({group.state}); "
                              "nothing was written")
    fence(lease, store_id, entry.timeline, entry.attempt, "in flight", _WHAT)
    check_against_entry(lease, entry, _WHAT)


def check_row_open(group_id: str, index: int, where: str, entry: LedgerEntry) -> None:
    """Refuse progress of sample ``index`` of an in-flight group (``entry``) whose row is committed.

    Raises:
        SampleCommitted: the row is already committed.
    """
    if index in entry.siblings:
        raise SampleCommitted(f"{where} refused: row {keys.row_id(group_id, index)} is already committed; "
                              "nothing was written")


def durable_length(t: Tables, group_id: str, index: int) -> int:
    """The length of a sample's durable prefix (0 without progress).

    Raises:
        CorruptRecord: the last chunk's header is not one kvckpt writes or names another key.
    """
    return durable_length_of(t.last_progress_chunk(group_id, index), group_id, index)


def durable_length_of(last: tuple[int, bytes] | None, group_id: str, index: int) -> int:
    """:func:`durable_length` from the sample's last chunk ``(start, stored chunk)`` (``None``: 0), on
    either store kind.

    Raises:
        CorruptRecord: as :func:`durable_length`.
    """
    if last is None:
        return 0
    start, value = last
    meta = codec.decode_meta(value, _key_name(group_id, index, start))
    length = meta.get("length")
    if type(length) is not int or length < 1 or (meta.get("group_id"), meta.get("index"), meta.get("start")) \
            != (group_id, index, start):
        raise CorruptRecord(_key_name(group_id, index, start), f"progress chunk header {meta!r:.200} is not one "
                                                                "kvckpt writes")
    return start + length


def chunk_limits(schema: RowSchema) -> Limits:
    """What decoding one stored chunk may allocate (a chunk never holds more than ``max_tokens``)."""
    caps = {_TOKENS: 8 * schema.max_tokens, _LOGPROBS: 4 * schema.max_tokens}
    row_caps = schema.limits().field_bytes
    caps.update({FIELD_PREFIX + n: row_caps[n] for n, f in schema.fields.items() if f.kind == "token"})
    return Limits(max_bytes=sum(caps.values()), field_bytes=caps)


def bare_chunk_limits(max_tokens: int) -> Limits:
    """:func:`chunk_limits` of a chunk of tokens and logprobs only (a value store's: no schema, no fields)."""
    caps = {_TOKENS: 8 * max_tokens, _LOGPROBS: 4 * max_tokens}
    return Limits(max_bytes=sum(caps.values()), field_bytes=caps)


def decode_chunk(schema: RowSchema, group_id: str, index: int, start: int, value: bytes) -> codec.Record:
    """A stored chunk, checked: its checksum, limits, identity and field lengths.

    Raises:
        CorruptRecord: anything a writer of kvckpt would not have stored.
    """
    return decode_chunk_within(chunk_limits(schema), group_id, index, start, value)


def decode_chunk_within(limits: Limits, group_id: str, index: int, start: int, value: bytes) -> codec.Record:
    """:func:`decode_chunk` under ``limits`` (a value store's chunks: :func:`bare_chunk_limits`).

    Raises:
        As :func:`decode_chunk`.
    """
    name = _key_name(group_id, index, start)
    record = codec.decode(value, name, limits=limits)
    meta, arrays = record.meta, record.arrays
    length = meta.get("length")
    if (meta.get("group_id"), meta.get("index"), meta.get("start")) != (group_id, index, start) \
            or type(length) is not int or type(meta.get("version")) is not int \
            or _TOKENS not in arrays or _LOGPROBS not in arrays \
            or record.dtypes[_TOKENS] != "int64" or record.dtypes[_LOGPROBS] != "float32" \
            or any(getattr(a, "ndim", 0) < 1 or a.shape[0] != length for a in arrays.values()):
        raise CorruptRecord(name, f"not a progress chunk kvckpt writes (header {meta!r:.200})")
    return record


def check_contiguous(group_id: str, index: int, records: list[codec.Record]) -> None:
    """A sample's decoded chunks (by position) tile its prefix from token 0: no gap, no overlap.

    Raises:
        CorruptRecord: a chunk does not start where the one before it ends (only damage stores that:
            :func:`record` appends at the durable length), naming that chunk's key.
    """
    end = 0
    for r in records:
        if r.meta["start"] != end:
            raise CorruptRecord(_key_name(group_id, index, r.meta["start"]),
                                f"the chunk starts at token {r.meta['start']} but the prefix before it ends at {end} "
                                f"({'an overlap' if r.meta['start'] < end else 'a gap'})")
        end += r.meta["length"]


def consume(t: Tables, schema: RowSchema, group_id: str, index: int, row: bytes) -> int | None:
    """Hold a committed row against its sample's durable prefix and delete the prefix (in the
    commit's transaction); returns the oldest weight version of the prefix, or ``None`` without one.

    Raises:
        BadArgument: the row's completion tokens (or its ``token_versions``) do not begin with the
            recorded prefix; the message names the sample.
        CorruptRecord: a stored chunk is damaged, names another key, or the chunks overlap or
            leave a gap.
    """
    chunks = [decode_chunk(schema, group_id, i, start, value) for i, start, value in t.progress_chunks(group_id, index)]
    if not chunks:
        return None
    check_contiguous(group_id, index, chunks)
    sample = keys.row_id(group_id, index)
    tokens = np.concatenate([c.arrays[_TOKENS] for c in chunks])
    versions = np.concatenate([np.full(c.meta["length"], c.meta["version"], np.int64) for c in chunks])
    arrays = codec.decode(row, f"rows/{sample}", limits=schema.limits(t.shape_pins())).arrays
    hold_row_against_prefix(sample, arrays, tokens, versions)
    t.delete_progress(group_id, index)
    return int(versions.min())


def hold_row_against_prefix(sample: str, arrays: Mapping[str, Any], tokens: np.ndarray, versions: np.ndarray) -> None:
    """Refuse a committed row (its decoded ``arrays``) of ``sample`` whose completion tokens (the ones the first of
    :data:`MASK_FIELDS` it has marks) or ``token_versions`` do not begin with the durable prefix's ``tokens`` and
    per-token ``versions``.

    Raises:
        BadArgument: naming the sample and the first completion token that differs.
    """
    if TOKENS_FIELD not in arrays:
        raise BadArgument(f"commit of {sample} refused: the sample has {len(tokens)} tokens of durable progress but "
                          f"the row has no {TOKENS_FIELD!r} to hold them against; nothing was written")
    mask = next((name for name in MASK_FIELDS if name in arrays), None)
    picked = np.asarray(arrays[mask]).reshape(-1) != 0 if mask is not None else slice(None)
    completion = np.asarray(arrays[TOKENS_FIELD])[picked]
    if len(completion) < len(tokens) or not np.array_equal(completion[:len(tokens)], tokens):
        raise BadArgument(f"commit of {sample} refused: the row's completion does not begin with the sample's "
                          f"durable prefix of {len(tokens)} tokens (first difference at completion token "
                          f"{_first_difference(completion, tokens)}); nothing was written")
    if VERSIONS_FIELD in arrays:
        stamped = np.asarray(arrays[VERSIONS_FIELD])[picked][:len(versions)]
        if not np.array_equal(stamped, versions):
            raise BadArgument(f"commit of {sample} refused: the row's {VERSIONS_FIELD} differ from the weight "
                              f"versions recorded with its durable prefix (first difference at completion token "
                              f"{_first_difference(stamped, versions)}); nothing was written")


def _first_difference(have: np.ndarray, want: np.ndarray) -> int:
    n = min(len(have), len(want))
    differ = np.flatnonzero(have[:n] != want[:n])
    return int(differ[0]) if len(differ) else n


def _key_name(group_id: str, index: int, start: int) -> str:
    return f"progress/{keys.row_id(group_id, index)}@{start}"
