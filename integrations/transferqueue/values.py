"""TransferQueue values <-> kvckpt records, each stamped with its key and its write identity.

A TransferQueue value is one field of one sample: a tensor (a row of a dense field, or one
component of a jagged field) or a plain Python value (a ``NonTensorStack`` element). It is stored
as one :mod:`kvckpt.codec` record:

* a tensor (or numpy array) as the record's single field ``v``; ``meta["t"]`` says which type to
  hand back (``"torch"`` or ``"numpy"``);
* a non-tensor value as JSON in ``meta["v"]`` with ``meta["t"] = "json"``: strings, numbers,
  booleans, ``None``, lists and string-keyed dicts of those. Anything else is refused (kvckpt
  never pickles), and tuples come back as lists.

Every record's ``meta`` also carries ``k`` (the TransferQueue key) and ``w`` (the write identity of
the put that wrote it). :func:`decode_value` verifies the checksum, then that both match what the
caller expects, before returning anything.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvckpt import codec
from kvckpt.errors import BadArgument

from .errors import WriteIdentityMismatch

#: Prefix of every TransferQueue key in the store's ``rows`` table.
KEY_PREFIX = b"tq/"


def new_write_id() -> str:
    """A fresh write identity: 64 random bits as hex, unique across puts, processes and restores."""
    return uuid.uuid4().hex[:16]


def store_key(key: str) -> bytes:
    """The LMDB key of a TransferQueue key (``"{global_index}@{field}"``)."""
    if not isinstance(key, str) or not key:
        raise BadArgument(f"TransferQueue keys are non-empty strings, got {key!r}")
    return KEY_PREFIX + key.encode()


def encode_value(key: str, value: Any, write_id: str, level: int) -> bytes:
    """One value as a checksummed record stamped with ``key`` and ``write_id``.

    Raises:
        BadArgument: the value is neither an array of a storable dtype nor JSON-serialisable.
    """
    meta: dict[str, Any] = {"k": key, "w": write_id}
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        return codec.encode({"v": value}, {**meta, "t": "torch"}, level)
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return codec.encode({"v": value}, {**meta, "t": "numpy"}, level)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"TransferQueue value of {key!r} is a {type(value).__name__}, which the kvckpt backend "
                          f"cannot store without pickling ({exc}); store tensors, or JSON-able values") from None
    return codec.encode_json({**meta, "t": "json", "v": value})


def decode_value(key: str, raw: bytes, expected_write_id: str | None) -> Any:
    """Verify a stored record and return its value.

    Raises:
        CorruptRecord: checksum or structure failure.
        WriteIdentityMismatch: the record was written by another put than ``expected_write_id``,
            or holds another key's value.
    """
    record = codec.decode(raw, f"rows/{key}")
    meta = record.meta
    if meta.get("k") != key or meta.get("w") != expected_write_id:
        raise WriteIdentityMismatch(key, expected_write_id, meta.get("w"))
    if meta.get("t") == "json":
        return meta.get("v")
    if meta.get("t") == "numpy":
        return record.arrays["v"]
    return record.tensors()["v"]


def write_id_of(raw: bytes, key: str) -> str | None:
    """The write identity stamped in a stored record (its checksum verified)."""
    return codec.decode_meta(raw, f"rows/{key}").get("w")
