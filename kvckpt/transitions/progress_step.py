"""A progress step message: one engine step's chunks, each sequence its own transition.

:func:`prepare` runs outside the transaction on a :class:`~kvckpt.storage.progress_message.DecodedMessage`
(checksum and structure already verified): it judges every sequence at once with array
operations (offsets, row index, start, ``max_tokens``, lease documents) and builds the chunk
records exactly as :func:`kvckpt.transitions.progress.encode_chunk` would (the format-4 record
layout, byte for byte: a sequence whose weight version changes inside the step becomes one chunk
per run of one version, contiguous). :func:`record` is the transition function: inside one write
transaction it applies each sequence's chunks as :func:`kvckpt.transitions.progress.record`
applies one, with the same fencing and refusals, reading the state record once and each
group's ledger entry once (no sequence changes either). Each sequence checks everything before
it writes anything, so a refused sequence writes nothing and the others still land.

The rules themselves are :func:`append`, one sequence's transition over either store kind's chunks
(:class:`ChunkRows`): the value store runs it too (:mod:`kvckpt.transitions.progress_values`, the
verl ledger's progress), with its fence record in place of the lease.

Exactly-once across retries: a sequence's result is where its chunk ends (``start + length``).
A sequence whose chunk is already durable with identical bytes at the same start returns that
same result, even when its lease has been fenced since (a recovery after the owner restarted
moves every lease to a new timeline): the identical bytes prove this very append landed, and
nothing is written. A chunk with other bytes at a covered position is refused
(:class:`~kvckpt.errors.DuplicateCommit`), and a fenced lease whose chunk did not land is refused
as fenced (:class:`~kvckpt.errors.AbandonedTimeline`, :class:`~kvckpt.errors.StaleAttempt`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvckpt import args
from kvckpt.errors import (
    BadArgument,
    BadOffsets,
    CorruptRecord,
    DuplicateCommit,
    ForeignLease,
    FutureVersion,
    KvckptError,
    ProgressGap,
    SchemaMismatch,
    StaleAttempt,
)
from kvckpt.storage import codec, keys
from kvckpt.storage.progress_message import FIELD_PREFIX, DecodedMessage
from kvckpt.storage.schema import RowSchema
from kvckpt.tables.access import Tables
from kvckpt.tables.records import Lease
from kvckpt.transitions import progress
from kvckpt.transitions.fencing import check_lease


class StepChunk(NamedTuple):
    """One stored chunk of a sequence: where it starts, its length, weight version and record."""

    start: int
    length: int
    version: int
    value: bytes


class StepSequence(NamedTuple):
    """One sequence of a message, judged and encoded: its lease, row, chunks and result (``end``).
    (A named tuple, not a dataclass: one is built per sequence of every message the owner takes.)"""

    lease: Lease | None  # None on the value store (its fence is a record, not a lease)
    index: int
    end: int
    chunks: tuple[StepChunk, ...]
    gid_json: str  # the group id as the chunk headers' JSON holds it
    row: bytes  # the sample's key (keys.row_key on the buffer), its chunks' keys' prefix
    version: int  # the newest weight version of its chunks
    group_id: str


def prepare(schema: RowSchema, group_size: int, msg: DecodedMessage) -> list[StepSequence | KvckptError]:
    """Judge and encode every sequence of ``msg`` (no transaction needed): per sequence its
    :class:`StepSequence`, or the error that refuses it (nothing of it will be written).

    Refusals, each of one sequence only:
        BadOffsets: its offsets are empty or backwards, overlap an earlier sequence or leave the
            token array; or tokens lie before the first sequence or after the last (then the
            first, or the last, sequence is refused).
        BadArgument: a row index outside the group, a negative start, a lease that is not one.
        LeaseMismatch: a lease of another group size.
        SchemaMismatch: the chunk would make the prefix longer than the schema's ``max_tokens``.
    """
    n, total = len(msg), len(msg.tokens)
    if not n:
        return []
    leases = _leases(msg.leases, group_size)
    gid_json = [codec.json_text(lease.group_id) if isinstance(lease, Lease) else "" for lease in leases]
    # each lease's row-key prefix, built (and its group id checked) once per message, not per sequence
    rows = [keys.row_prefix(lease.group_id) if isinstance(lease, Lease) else b"" for lease in leases]
    plain = not msg.fields  # the common message: tokens and logprobs only
    cuts = None if msg.token_versions is None else np.flatnonzero(np.diff(msg.token_versions)) + 1
    versions = msg.versions.tolist() if cuts is None else None
    offsets, max_tokens = msg.offsets.tolist(), schema.max_tokens
    out: list[StepSequence | KvckptError] = []
    ended = 0  # where the earlier sequences' tokens end
    # one loop of Python ints: a message holds a few sequences, for which numpy's per-call cost is more
    for i, (index, start, at) in enumerate(zip(msg.indices.tolist(), msg.starts.tolist(), msg.lease_of.tolist(),
                                               strict=True)):
        a, b = offsets[i], offsets[i + 1]
        bad = b <= a or a < ended or a < 0 or b > total or (i == 0 and a != 0) or (i == n - 1 and b != total)
        lease = leases[at] if 0 <= at < len(leases) else BadArgument(
            f"sequence {i} of a progress message points at lease {at}, but the message has {len(leases)}; "
            "nothing of it was written")
        if isinstance(lease, KvckptError):
            out.append(lease)
        elif bad or start + b - a > max_tokens or start < 0 or not 0 <= index < group_size:
            out.append(_refusal(schema, lease, i, n, a, b, index, start, ended, total, bad))
        elif cuts is None:  # one weight version per sequence: one chunk
            version = versions[i]
            meta = f"{meta_head(gid_json[at], index, start, b - a)}{version}}}"
            value = codec.encode_stored((("tokens", "int64", msg.tokens[a:b]),
                                         ("logprobs", "float32", msg.logprobs[a:b])), meta) if plain else \
                _chunk(msg, gid_json[at], index, start, a, b, version).value
            out.append(StepSequence(lease, index, start + b - a, (StepChunk(start, b - a, version, value),),
                                    gid_json[at], rows[at] + index.to_bytes(4, "big"), version, lease.group_id))
        else:
            runs = [a, *cuts[np.searchsorted(cuts, a, "right"):np.searchsorted(cuts, b, "left")].tolist(), b]
            chunks = tuple(_chunk(msg, gid_json[at], index, start + x - a, x, y, int(msg.token_versions[x]))
                           for x, y in itertools.pairwise(runs))
            out.append(StepSequence(lease, index, start + b - a, chunks, gid_json[at],
                                    rows[at] + index.to_bytes(4, "big"), max(c.version for c in chunks),
                                    lease.group_id))
        ended = max(ended, b)
    return out


def _refusal(schema: RowSchema, lease: Lease, i: int, n: int, a: int, b: int, index: int, start: int, ended: int,
             total: int, bad_offsets: bool) -> KvckptError:
    """The error that refuses sequence ``i`` (tokens ``a:b`` of the message), in the order checked."""
    where = f"progress of {keys.row_id(lease.group_id, index)} at token {start} (sequence {i} of the message)"
    if bad_offsets:
        return BadOffsets(f"{where} refused: {_offsets_problem(i, n, a, b, ended, total)}; nothing of it was written")
    if not 0 <= index < lease.group_size:
        return BadArgument(f"{where}: row index {index} is outside the group (size {lease.group_size}); "
                           "nothing was written")
    if start < 0:
        return BadArgument(f"{where}: start must be >= 0; nothing was written")
    return too_long(where, b - a, start, schema.max_tokens)


def too_long(where: str, length: int, start: int, max_tokens: int) -> SchemaMismatch:
    """The refusal of a chunk of ``length`` tokens at ``start`` that passes ``max_tokens`` (both store kinds')."""
    return SchemaMismatch(f"{where}: {length} tokens would make the prefix {start + length} tokens long, over the "
                          f"schema's max_tokens {max_tokens}; nothing was written")


def record(t: Tables, store_id: str, sequences: list[StepSequence | KvckptError]) -> list[int | KvckptError]:
    """The transitions of one message: per sequence the end of its durable chunk (``start +
    length``, the same on a retry of a landed message) or the error that refused it. Each
    sequence is checked in full before it writes, so a refusal writes nothing of it.

    Refusals per sequence: those of :func:`kvckpt.transitions.progress.record` (fencing,
    ``UnknownGroup``, ``SampleCommitted``, ``FutureVersion``, a gap, ``DuplicateCommit``).
    """
    out: list[int | KvckptError] = []
    if all(isinstance(s, KvckptError) for s in sequences):
        return list(sequences)
    st = t.state()
    newest = max(st["trainer_version"], st["weight_version"])
    versions = f"the buffer's trainer version is {st['trainer_version']}, its weight version {st['weight_version']}"
    entries: dict[str, Any] = {}
    holding: set[int] = set()  # the message's leases (by id) already found to hold their entry
    for s in sequences:
        if isinstance(s, KvckptError):
            out.append(s)
            continue
        try:
            out.append(_record_one(t, store_id, s, newest, versions, entries, holding))
        except KvckptError as exc:
            out.append(exc)
    return out


def _record_one(t: Tables, store_id: str, s: StepSequence, newest: int, versions: str, entries: dict[str, Any],
                holding: set[int]) -> int:
    gid = s.group_id
    if gid not in entries:
        entries[gid] = t.entry(gid)
    held = id(s.lease)  # the lease object: a message decodes each of its distinct leases once

    def holds() -> None:
        assert s.lease is not None  # a message's sequences carry their lease
        if held not in holding:  # the fencing is the lease's: judged once per lease and message
            progress.check_holds(t, store_id, s.lease, _where(s), entries[gid])
            holding.add(held)
        if s.index in entries[gid].siblings:
            progress.check_row_open(gid, s.index, _where(s), entries[gid])

    return append(t, s, holds, newest, versions)


class ChunkRows(Protocol):
    """The chunks of one store kind, inside one open write transaction: what :func:`append` reads and
    writes. :class:`~kvckpt.tables.access.Tables` is the buffer's; the value store's is
    :class:`~kvckpt.values.records.ValueChunks` (its chunks under a caller's key prefix). ``row`` is a
    sample's key (:attr:`StepSequence.row`)."""

    def last_progress_chunk_of(self, row: bytes) -> tuple[int, bytes] | None:
        """``(start, stored chunk)`` of the sample's last chunk, or ``None``."""

    def progress_chunk_of(self, row: bytes, start: int) -> bytes | None:
        """The sample's chunk that begins at token ``start``, or ``None``."""

    def put_progress_chunk_of(self, row: bytes, start: int, value: bytes) -> None:
        """Store one chunk."""


def append(rows: ChunkRows, s: StepSequence, holds: Callable[[], None], newest: int | None, versions: str = "") -> int:
    """The one rule set of a sequence's progress, for both store kinds, inside the caller's write
    transaction: ``holds()`` (the store kind's fencing: the buffer's lease against its ledger entry, the
    value store's fence record) must pass, else a :class:`~kvckpt.errors.StaleAttempt` refuses it unless
    the identical chunk bytes are already durable (a resend of a landed append gets the first answer);
    then no chunk newer than ``newest`` (``None``: not checked; ``versions`` says what it is), no gap
    after the durable prefix, no other content at a covered position. Checks everything before it
    writes anything. Returns ``s.end``. A sequence without chunks (the value store's empty last flush)
    writes nothing and must start exactly at the durable length.

    Raises:
        StaleAttempt (or a subclass): from ``holds``. FutureVersion, ProgressGap, DuplicateCommit.
    """
    try:
        holds()
    except StaleAttempt as exc:
        if not isinstance(exc, ForeignLease) and s.chunks and all(
                same_chunk(rows, s, c) for c in s.chunks):
            return s.end  # a retry of a message whose first try landed: the identical bytes are durable
        raise
    if newest is not None and s.version > newest:
        raise FutureVersion(f"{_where(s)} refused: weight version {s.version} is from the future ({versions}); "
                            "nothing was written")
    if not s.chunks:
        length = _durable_length(rows, s, s.end)
        if length != s.end:
            raise ProgressGap(f"{_where(s)} refused: the durable prefix is {length} tokens long, so the next chunk "
                              f"starts at {length}; nothing was written")
        return s.end
    length = _durable_length(rows, s, s.chunks[0].start)
    puts = []
    for c in s.chunks:
        if c.start < length:
            if same_chunk(rows, s, c):
                continue  # a retry of an acknowledged chunk
            raise DuplicateCommit(f"{_where(s)} refused: tokens from {c.start} are already recorded with other "
                                  f"content (the durable prefix is {length} tokens); nothing was written")
        if c.start > length:
            raise ProgressGap(f"{_where(s)} refused: the durable prefix is {length} tokens long, so the next chunk "
                              f"starts at {length} (a gap); nothing was written")
        puts.append(c)
        length = c.start + c.length
    for c in puts:
        rows.put_progress_chunk_of(s.row, c.start, c.value)
    return s.end


def same_chunk(rows: ChunkRows, s: StepSequence, c: StepChunk) -> bool:
    """Whether sequence ``s``'s chunk ``c`` is stored: the identical bytes, or the same record in
    another encoding (a chunk ``kvckpt compact --level`` re-encoded: the header's compression and sizes differ,
    its meta, fields, dtypes and array bytes do not), so a resend after a compaction gets its first answer.
    Decodes only when the bytes differ (a refusal's path, or a compacted store's).

    Raises:
        CorruptRecord: the stored chunk fails its checksum or does not decode.
    """
    stored, value = rows.progress_chunk_of(s.row, c.start), c.value
    if stored is None:
        return False
    if stored == value:
        return True
    name = f"progress/{keys.row_id(s.group_id, s.index)}@{c.start}"
    have, want = codec.decode(stored, name), codec.decode(value, name)
    return have.meta == want.meta and have.dtypes == want.dtypes and have.arrays.keys() == want.arrays.keys() and \
        all(_same_array(have.arrays[k], want.arrays[k]) for k in want.arrays)


def _same_array(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaN logprobs included)."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return bool(a == b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _where(s: StepSequence) -> str:
    """How a refusal of sequence ``s`` names it (built only when one is raised)."""
    return f"progress of {keys.row_id(s.group_id, s.index)} at token {s.chunks[0].start if s.chunks else s.end}"


def _durable_length(t: ChunkRows, s: StepSequence, start: int) -> int:
    """:func:`kvckpt.transitions.progress.durable_length`, without parsing the last chunk's header
    in the common case: a chunk kvckpt wrote (checksum verified) that ends exactly at ``start``."""
    last = t.last_progress_chunk_of(s.row)
    if last is None:
        return 0
    at, value = last
    if at < start:
        try:  # the record's name is built only for a refusal (this runs once per appended chunk)
            if codec.meta_begins(value, meta_head(s.gid_json, s.index, at, start - at)):
                return start
        except CorruptRecord as exc:
            raise CorruptRecord(f"progress/{keys.row_id(s.group_id, s.index)}@{at}", exc.reason) from None
    return progress.durable_length_of(last, s.group_id, s.index)


def meta_head(gid_json: str, index: int, start: int, length: int) -> str:
    """A stored chunk's header as ``progress.encode_chunk`` writes it, up to its version: the one spelling
    :func:`_chunk` (and the value store's ``progress_values.sequence``) builds and :func:`_durable_length`
    recognises."""
    return f'{{"group_id":{gid_json},"index":{index},"start":{start},"length":{length},"version":'


def _chunk(msg: DecodedMessage, gid_json: str, index: int, start: int, a: int, b: int, version: int) -> StepChunk:
    """The stored record of tokens ``a:b`` of the message (of weight ``version``), as ``encode_chunk`` builds it."""
    fields = [("tokens", "int64", msg.tokens[a:b]), ("logprobs", "float32", msg.logprobs[a:b])]
    fields += [(FIELD_PREFIX + name, msg.field_dtypes[name], values[a:b]) for name, values in msg.fields.items()]
    # the meta progress.encode_chunk stores, as the header's JSON (ints print as JSON ints)
    meta = f"{meta_head(gid_json, index, start, b - a)}{version}}}"
    return StepChunk(start, b - a, version, codec.encode_stored(fields, meta))


def _leases(docs: list[dict[str, Any]], group_size: int) -> list[Lease | KvckptError]:
    out: list[Lease | KvckptError] = []
    for doc in docs:
        try:
            lease = Lease.from_dict(doc)
            args.identifier("group_id", lease.group_id)
            args.integer("attempt", lease.attempt)
            check_lease(lease, group_size)
            out.append(lease)
        except KvckptError as exc:
            out.append(exc)
        except TypeError as exc:
            out.append(BadArgument(f"a progress message's lease is not one: {exc}; nothing of its sequences was "
                                   "written"))
    return out


def _offsets_problem(i: int, n: int, lo: int, hi: int, ended: int, total: int) -> str:
    """Why sequence ``i``'s offsets ``lo:hi`` are refused, in words."""
    if hi <= lo:
        return f"its offsets {lo}:{hi} do not add up (an empty or backwards range)"
    if lo < 0 or hi > total:
        return f"its offsets {lo}:{hi} leave the message's token array of {total} tokens"
    if lo < ended:
        return f"its offsets {lo}:{hi} overlap an earlier sequence's tokens (which end at {ended})"
    if i == 0 and lo != 0:
        return f"the message's first {lo} tokens belong to no sequence (the offsets start at {lo}, not 0)"
    return (f"the token array holds {total} tokens but the offsets end at {hi}: the last {total - hi} belong to no "
            f"sequence (sequence {i} of {n} is the last)")
