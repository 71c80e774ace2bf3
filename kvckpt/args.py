"""Argument checks at the public API's edge: each raises :class:`~kvckpt.errors.BadArgument`
naming the argument, the value and the rule, before anything is read or written."""

from __future__ import annotations

import math
from typing import Any

from kvckpt.errors import BadArgument

#: Longest group id or task name accepted: row keys (``{group_id}\\0`` + index) stay far below
#: LMDB's 511-byte key limit.
MAX_ID_CHARS = 200
#: Weight versions and steps are stored as signed 64-bit keys in the indexes.
MAX_INT = (1 << 63) - 1


def integer(name: str, value: Any, *, minimum: int | None = 0) -> int:
    """``value`` as an ``int`` if it is one (not a bool, not a float) within ``minimum..MAX_INT``."""
    if isinstance(value, bool) or (not isinstance(value, int) and not _is_numpy_int(value)):
        raise BadArgument(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise BadArgument(f"{name} must be >= {minimum}, got {value}")
    if abs(value) > MAX_INT:
        raise BadArgument(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value


def optional_integer(name: str, value: Any, *, minimum: int | None = 0) -> int | None:
    """:func:`integer`, or ``None`` passed through."""
    return None if value is None else integer(name, value, minimum=minimum)


def identifier(name: str, value: Any) -> str:
    """A non-empty ``str`` of at most :data:`MAX_ID_CHARS` characters without NUL or control characters."""
    if not isinstance(value, str):
        raise BadArgument(f"{name} must be a string, got {value!r} ({type(value).__name__})")
    if not value or len(value) > MAX_ID_CHARS:
        raise BadArgument(f"{name} must have 1..{MAX_ID_CHARS} characters, got {len(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise BadArgument(f"{name} must not contain control characters, got {value!r}")
    return value


def timeout(name: str, value: Any) -> float | None:
    """A number of seconds >= 0 (``math.inf``: forever), or ``None`` (the default applies)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise BadArgument(f"{name} must be a number of seconds >= 0 (math.inf: forever) or None, got {value!r}")
    return float(value)


def _is_numpy_int(value: Any) -> bool:
    import numpy as np

    return isinstance(value, np.integer)
