"""Key encodings of the buffer's tables: fixed-width big-endian so byte order is numeric order.

Group ids are UTF-8 strings without NUL (at most :data:`MAX_GROUP_ID_BYTES` bytes, so row and
index keys stay under LMDB's 511-byte limit). Signed integers (weights, steps) are offset by
2**63 so negative values sort first.
"""

from __future__ import annotations

from kvckpt.errors import BadArgument

MAX_GROUP_ID_BYTES = 400
_OFFSET = 1 << 63

# Prefixes of the ``index`` table; every index value is the group id it points to.
READY_BY_SEQ = b"rs"  # + seq                  ready groups in dispatch order
READY_BY_WEIGHT = b"rw"  # + start_weight + seq  ready groups by weight version
READY_BY_TARGET = b"rt"  # + target_step + seq   ready groups stamped with a target step
PENDING_BY_WEIGHT = b"pw"  # + start_weight + seq  ledger entries (in flight) by weight version
CLAIMED_BY_STEP = b"cl"  # + step + seq          groups claimed by a training step
CONSUMED_BY_STEP = b"co"  # + step + seq         consumed groups whose rows are still stored


def u64(value: int) -> bytes:
    """Unsigned 64-bit big-endian."""
    return value.to_bytes(8, "big")


def i64(value: int) -> bytes:
    """Signed 64-bit, offset so byte order equals numeric order."""
    return (value + _OFFSET).to_bytes(8, "big")


def from_i64(raw: bytes) -> int:
    """Inverse of :func:`i64`."""
    return int.from_bytes(raw, "big") - _OFFSET


def group_key(group_id: str) -> bytes:
    """The key of a group (in ``groups`` and ``ledger``), validating the id."""
    if not isinstance(group_id, str) or not group_id:
        raise BadArgument(f"group id must be a non-empty string, got {group_id!r}")
    raw = group_id.encode()
    if b"\x00" in raw or len(raw) > MAX_GROUP_ID_BYTES:
        raise BadArgument(f"group id {group_id!r} must be at most {MAX_GROUP_ID_BYTES} UTF-8 bytes "
                          "without NUL")
    return raw


def row_prefix(group_id: str) -> bytes:
    """Prefix of every row key of a group."""
    return group_key(group_id) + b"\x00"


def row_key(group_id: str, index: int) -> bytes:
    """Key of row ``index`` of a group in the ``rows`` table."""
    return row_prefix(group_id) + index.to_bytes(4, "big")


def progress_key(group_id: str, index: int, start: int) -> bytes:
    """Key of the progress chunk of row ``index`` of a group that begins at token ``start``: the
    row's key, then ``start`` (so a sample's chunks sort by position, after its group's)."""
    return chunk_key(row_key(group_id, index), start)


def chunk_key(row: bytes, start: int) -> bytes:
    """:func:`progress_key` from the row's key (:func:`row_key`), for a caller that built it once."""
    return row + u64(start)


def row_id(group_id: str, index: int) -> str:
    """The NeMo-RL style row identity ``{group_id}_g{index}``."""
    return f"{group_id}_g{index}"


def index_key(prefix: bytes, number: int | None, seq: int) -> bytes:
    """An index key: ``prefix``, then the signed ``number`` (if any), then the sequence number."""
    middle = b"" if number is None else i64(number)
    return prefix + middle + u64(seq)
