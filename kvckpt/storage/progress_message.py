"""One engine step's token progress from one producer, as one checksummed message (the wire form).

A rollout engine step advances many sequences at once. :class:`ProgressEncoder` packs that step,
at the producer (the edge, like :class:`~kvckpt.storage.encoding.RowEncoder` does for rows), into
one :class:`ProgressMessage`: one kvckpt record (:mod:`kvckpt.storage.codec`: magic, crc32 of
everything after it, a JSON header, raw little-endian fields; uncompressed) holding, for ``n``
sequences and ``T`` tokens in all:

========================  =========  =======================================================
field                     dtype      shape and meaning
========================  =========  =======================================================
``tokens``                int64      ``[T]``: every sequence's new tokens, concatenated
``logprobs``              float32    ``[T]``: their logprobs
``offsets``               int64      ``[n + 1]``: sequence ``i``'s tokens are
                                     ``tokens[offsets[i]:offsets[i + 1]]``
``indices``               int64      ``[n]``: each sequence's row index in its group
``starts``                int64      ``[n]``: where each chunk begins in its sequence's completion
``lease_of``              int64      ``[n]``: each sequence's lease, a position in ``meta.leases``
``versions``              int64      ``[n]`` (one weight version per sequence) **or**
``token_versions``        int64      ``[T]`` (one per token; exactly one of the two is present)
``f.<name>``              schema's   ``[T, ...]``: a per-token generation field of the schema
========================  =========  =======================================================

and the header's meta ``{"kind": KIND, "leases": [Lease.to_dict(), ...]}`` (each distinct lease
once). :func:`decode_message` is the owner's side: it verifies the checksum and the message's
structure (field names, dtypes, the lengths the parallel arrays must share) and hands back
:class:`DecodedMessage` without trusting anything else; what can be wrong with one sequence
(its offsets, index, start, lease) is checked per sequence by
:mod:`kvckpt.transitions.progress_step`, so one bad sequence never stops the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvckpt.errors import BadArgument, CorruptRecord, MalformedMessage, SchemaMismatch
from kvckpt.storage import codec
from kvckpt.storage.casts import cast
from kvckpt.storage.codec import TEXT_DTYPES
from kvckpt.storage.schema import RowSchema

#: The message's ``meta.kind``: what it is and the version of its layout.
KIND = "kvckpt.progress-step/1"
#: Prefix of a per-token generation field's name in the message (and in a stored chunk).
FIELD_PREFIX = "f."
#: The fields every message has (``versions`` or ``token_versions`` besides).
_PER_TOKEN = {"tokens": "int64", "logprobs": "float32"}
_PER_SEQUENCE = {"indices": "int64", "starts": "int64", "lease_of": "int64"}
#: Row fields a per-token generation field may not be (they are held against the prefix instead).
_NOT_FIELDS = ("input_ids", "token_versions")
#: Most sequences one message may carry (a header of leases beyond this is refused, bounded memory).
MAX_SEQUENCES = 1 << 16


@dataclass(frozen=True)
class ProgressMessage:
    """One engine step's progress, encoded and checksummed: the bytes travel as they are
    (``bytes(message)``), and ``ProgressMessage(value)`` wraps bytes received. The same bytes sent
    twice (a retry) are the same message."""

    value: bytes

    def __bytes__(self) -> bytes:
        return self.value


@dataclass(frozen=True)
class DecodedMessage:
    """A message whose checksum and structure the owner verified; nothing per sequence is
    checked yet. ``versions`` is per sequence or ``None`` (then ``token_versions`` is per token);
    ``fields`` maps a schema field name to its ``[T, ...]`` array, in message order."""

    leases: list[dict[str, Any]]
    tokens: np.ndarray
    logprobs: np.ndarray
    offsets: np.ndarray
    indices: np.ndarray
    starts: np.ndarray
    lease_of: np.ndarray
    versions: np.ndarray | None
    token_versions: np.ndarray | None
    fields: dict[str, np.ndarray]
    field_dtypes: dict[str, str]

    def __len__(self) -> int:
        return len(self.indices)


class ProgressEncoder:
    """Build :class:`ProgressMessage` objects for one store (its schema), at the producer.

    Build it from the store's config anywhere (:meth:`from_config`, e.g. with a buffer actor's
    ``info()["config"]``) or take the store's own (:meth:`kvckpt.ReplayBuffer.progress_encoder`).
    It casts and packs; it does not judge a sequence (that is the owner's job, per sequence).
    """

    def __init__(self, schema: RowSchema) -> None:
        self.schema = schema
        #: Each Lease object's document and canonical JSON (a producer sends the same leases step after
        #: step), by the object's id (the entry holds the object, so its id is not reused): built
        #: once, not per message. Bounded; shared by the threads that use the encoder.
        self._docs: dict[int, tuple[Any, str, dict[str, Any]]] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ProgressEncoder:
        """From a buffer config dict (``BufferConfig.to_dict()``)."""
        schema = config["schema"]
        return cls(schema if isinstance(schema, RowSchema) else RowSchema.from_dict(schema))

    def encode(self, leases: Sequence[Any], indices: Any, starts: Any, tokens: Any, logprobs: Any, offsets: Any,
               *, versions: Any = None, token_versions: Any = None, lease_of: Any = None,
               fields: Mapping[str, Any] | None = None) -> ProgressMessage:
        """The columnar form: ``n`` sequences over one token array.

        Args:
            leases: one lease per sequence (``Lease`` or its ``to_dict()``), or, with ``lease_of``,
                the distinct leases that ``lease_of`` points into.
            indices, starts: per sequence, the row index in the group and where the chunk begins.
            tokens, logprobs: ``[T]`` each, every sequence's chunk concatenated.
            offsets: ``[n + 1]``, sequence ``i``'s chunk is ``tokens[offsets[i]:offsets[i + 1]]``.
            versions: ``[n]`` (or one int for all): the weight version of each sequence's chunk.
            token_versions: ``[T]``: the weight version of each token, instead of ``versions``.
            lease_of: ``[n]``: positions in ``leases``. Defaults to one lease per sequence.
            fields: per-token generation fields of the schema, ``[T, ...]`` each.

        Raises:
            BadArgument: neither or both of ``versions`` and ``token_versions``, a field that is not
                a per-token generation field of the schema, a lease that is not one.
            SchemaMismatch: arrays that are not 1-D or whose lengths disagree (``logprobs``,
                ``token_versions`` and fields with ``tokens``; ``indices``, ``starts``,
                ``lease_of`` and ``versions`` with ``offsets``), a lossy cast.
        """
        where = "progress message"
        docs, index_of = _lease_docs(leases, self._docs)
        offsets = _column(offsets, "offsets", where)
        n = len(offsets) - 1
        if n < 0:
            raise SchemaMismatch(f"{where}: offsets needs n + 1 entries for n sequences, got none")
        if lease_of is None:
            lease_of = index_of if len(index_of) == n else None
            if lease_of is None:
                raise SchemaMismatch(f"{where}: {len(leases)} leases for {n} sequences (pass lease_of to share them)")
        arrays: dict[str, Any] = {"tokens": _column(tokens, "tokens", where),
                                  "logprobs": _column(logprobs, "logprobs", where, "float32"), "offsets": offsets}
        if not isinstance(versions, (list, tuple, np.ndarray)) and versions is not None and not hasattr(versions,
                                                                                                        "shape"):
            versions = [versions] * n
        for name, value in (("indices", indices), ("starts", starts), ("lease_of", lease_of), ("versions", versions)):
            if value is not None:
                arrays[name] = _column(value, name, where)
                if len(arrays[name]) != n:
                    raise SchemaMismatch(f"{where}: {name} has {len(arrays[name])} entries for {n} sequences")
        if (versions is None) == (token_versions is None):
            raise BadArgument(f"{where}: give exactly one of versions (per sequence) and token_versions (per token)")
        if token_versions is not None:
            arrays["token_versions"] = _column(token_versions, "token_versions", where)
        t = len(arrays["tokens"])
        for name in ("logprobs", "token_versions"):
            if name in arrays and len(arrays[name]) != t:
                raise SchemaMismatch(f"{where}: {len(arrays[name])} {name} for {t} tokens")
        dtypes = {}
        for name, value in (fields or {}).items():
            dtype = self._field_dtype(name, where)
            arr = cast(value, dtype, where, name)
            if arr.ndim < 1 or arr.shape[0] != t:
                raise SchemaMismatch(f"{where}: field {name!r} has shape {list(arr.shape)}, not {t} tokens long")
            arrays[FIELD_PREFIX + name] = arr
            dtypes[FIELD_PREFIX + name] = dtype
        return ProgressMessage(codec.encode(arrays, {"kind": KIND, "leases": docs}, level=0, dtypes=dtypes))

    def encode_items(self, items: Sequence[Mapping[str, Any]]) -> ProgressMessage:
        """The same message from :meth:`kvckpt.ReplayBuffer.record_progress_many`'s items (``lease``,
        ``index``, ``start``, ``tokens``, ``logprobs``, ``weight_version``, optionally ``fields``):
        the drop-in for a producer that builds per-sequence items today. Every item must carry the
        same per-token fields.

        Raises:
            BadArgument: an item lacks a key, or items carry different fields.
            SchemaMismatch: as :meth:`encode`.
        """
        where = "progress message"
        try:
            toks = [_column(i["tokens"], "tokens", where) for i in items]
            lps = [_column(i["logprobs"], "logprobs", where, "float32") for i in items]
            names = [tuple(i.get("fields") or ()) for i in items]
            if len(set(names)) > 1:
                raise BadArgument(f"{where}: every item must carry the same per-token fields, got {sorted(set(names))}")
            fields = {name: _concat([i["fields"][name] for i in items]) for name in (names[0] if names else ())}
            lengths = [len(x) for x in toks]
            return self.encode([i["lease"] for i in items], [i["index"] for i in items], [i["start"] for i in items],
                               _concat(toks, np.int64), _concat(lps, np.float32),
                               np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]),
                               versions=[i["weight_version"] for i in items], fields=fields)
        except KeyError as exc:
            raise BadArgument(f"a progress item needs lease, index, start, tokens, logprobs and weight_version: "
                              f"{exc!r}") from None

    def _field_dtype(self, name: str, where: str) -> str:
        spec = self.schema.fields.get(name)
        if spec is None or spec.kind != "token" or spec.dtype in TEXT_DTYPES or name in _NOT_FIELDS:
            raise BadArgument(f"{where}: {name!r} is not a per-token generation field of the schema (its token "
                              f"fields other than {_NOT_FIELDS})")
        return spec.dtype


def decode_message(schema: RowSchema, message: ProgressMessage | bytes | bytearray | memoryview) -> DecodedMessage:
    """Verify a message's checksum and structure, as its owner must before anything else.

    Raises:
        MalformedMessage: not bytes, a checksum that fails, a record that is not a progress
            message, a missing or mistyped field, arrays whose lengths disagree, a field that is not
            a per-token generation field of the schema, more than :data:`MAX_SEQUENCES` sequences.
            Nothing of the message is written then.
    """
    value = message.value if isinstance(message, ProgressMessage) else message
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"a progress message is bytes, got {type(value).__name__}")
    try:
        # stored uncompressed: it decodes to at most its own size (8x for bit-packed bool fields); its
        # plain arrays are views into the (immutable) bytes, which the owner only slices and re-encodes
        value = value if type(value) is bytes else bytes(value)
        record = codec.decode_views(value, "progress message", limits=codec.Limits(max_bytes=8 * len(value)))
    except CorruptRecord as exc:
        raise MalformedMessage(f"progress message refused: {exc.reason}; nothing of it was written") from None
    meta, arrays, dtypes = record.meta, record.arrays, record.dtypes
    leases = meta.get("leases")
    if meta.get("kind") != KIND or not isinstance(leases, list) or not all(isinstance(d, dict) for d in leases):
        raise MalformedMessage(f"not a progress message of kind {KIND!r} (meta {meta!r:.200}); "
                               "nothing of it was written")
    wanted = {**_PER_TOKEN, **_PER_SEQUENCE, "offsets": "int64", "versions": "int64", "token_versions": "int64"}
    for name, array in arrays.items():
        dtype = dtypes[name]
        if name.startswith(FIELD_PREFIX):
            spec = schema.fields.get(name[len(FIELD_PREFIX):])
            ok = spec is not None and spec.kind == "token" and spec.dtype == dtype and spec.dtype not in TEXT_DTYPES \
                and name[len(FIELD_PREFIX):] not in _NOT_FIELDS and array.ndim == 1 + len(spec.shape or ())
        else:
            ok = wanted.get(name) == dtype and getattr(array, "ndim", 0) == 1
        if not ok:
            raise MalformedMessage(f"progress message refused: field {name!r} ({dtype}, shape "
                                   f"{list(getattr(array, 'shape', ()))}) is not one a progress message holds; "
                                   "nothing of it was written")
    lacking = [n for n in (*_PER_TOKEN, *_PER_SEQUENCE, "offsets") if n not in arrays]
    if lacking or ("versions" in arrays) == ("token_versions" in arrays):
        what = ", ".join(lacking) or "exactly one of versions and token_versions"
        raise MalformedMessage(f"progress message refused: it lacks {what}; nothing of it was written")
    t, n = len(arrays["tokens"]), len(arrays["offsets"]) - 1
    per_token = [k for k in arrays if k in _PER_TOKEN or k == "token_versions" or k.startswith(FIELD_PREFIX)]
    per_seq = [k for k in arrays if k in _PER_SEQUENCE or k == "versions"]
    if n < 0 or n > MAX_SEQUENCES or any(len(arrays[k]) != t for k in per_token) \
            or any(len(arrays[k]) != n for k in per_seq):
        raise MalformedMessage(f"progress message refused: its arrays disagree in length ("
                               f"{ {k: len(v) for k, v in arrays.items()} }); nothing of it was written")
    return DecodedMessage(leases, arrays["tokens"], arrays["logprobs"], arrays["offsets"], arrays["indices"],
                          arrays["starts"], arrays["lease_of"], arrays.get("versions"), arrays.get("token_versions"),
                          {k[len(FIELD_PREFIX):]: v for k, v in arrays.items() if k.startswith(FIELD_PREFIX)},
                          {k[len(FIELD_PREFIX):]: dtypes[k] for k in arrays if k.startswith(FIELD_PREFIX)})


#: At most this many leases' documents are kept by one encoder (then it starts afresh).
LEASE_DOCS_KEPT = 4096


def _lease_docs(leases: Sequence[Any], cache: dict[int, tuple[Any, str, dict[str, Any]]] | None = None,
                ) -> tuple[list[dict[str, Any]], list[int]]:
    """The distinct leases as dicts, and each given lease's position among them. ``cache`` keeps a
    :class:`~kvckpt.Lease`'s (a frozen record: its document cannot change) canonical JSON and document
    across calls, by object; a dict lease is not kept."""
    docs: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    by_object: dict[int, int] = {}  # the same object again (a group's samples): no second to_dict
    index_of = []
    for lease in leases:
        at = by_object.get(id(lease))
        if at is None:
            kept = cache is not None and _frozen(lease)
            known = cache.get(id(lease)) if kept else None
            if known is None or known[0] is not lease:
                doc = lease.to_dict() if hasattr(lease, "to_dict") else lease
                if not isinstance(doc, Mapping):
                    raise BadArgument(f"a progress message's lease is a Lease or its to_dict(), got "
                                      f"{type(lease).__name__}")
                known = lease, codec.json_text(_sorted(doc)), doc  # every field: leases differing in any travel apart
                if kept:
                    if len(cache) >= LEASE_DOCS_KEPT:
                        cache.clear()
                    cache[id(lease)] = known
            _, key, doc = known
            at = seen.setdefault(key, len(docs))
            if at == len(docs):
                docs.append(dict(doc))
            by_object[id(lease)] = at
        index_of.append(at)
    return docs, index_of


def _frozen(value: Any) -> bool:
    """Whether ``value`` is a frozen dataclass with ``to_dict`` (a :class:`~kvckpt.Lease`)."""
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen and hasattr(value, "to_dict")


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    return list(value) if isinstance(value, tuple) else value


def _column(value: Any, name: str, where: str, dtype: str = "int64") -> np.ndarray:
    arr = cast(value, dtype, where, name)
    if arr.ndim != 1:
        raise SchemaMismatch(f"{where}: {name} is 1-D, got shape {list(arr.shape)}")
    return arr


def _concat(parts: list[Any], dtype: Any = None) -> np.ndarray:
    arrays = [np.asarray(p.detach().cpu() if hasattr(p, "detach") else p) for p in parts]
    if not arrays:
        return np.zeros(0, dtype or np.int64)
    return np.concatenate(arrays) if dtype is None else np.concatenate(arrays).astype(dtype, copy=False)
