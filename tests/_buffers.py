"""Shared test helpers: a tiny row schema, a deterministic row factory, store dumps and refusals.

Import them directly (``from _buffers import SCHEMA, make_row, make_group, dump_store, refused``); tests/
is on ``sys.path`` (pyproject's pytest ``pythonpath``). The schema, rows and dumps are the buffer
conformance suite's (:mod:`kvckpt.testing.conformance.buffer`), so the suite and the tests build the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from kvckpt import ReplayBuffer
from kvckpt.testing.conformance.buffer import SCHEMA, dump_store, make_row

if TYPE_CHECKING:  # no torch at import: tests/conftest.py loads this in .venv-gym too
    import torch

__all__ = ["SCHEMA", "dump_store", "make_group", "make_row", "refused", "until"]


def make_group(group_size: int, seed: int, length: int = 4) -> list[dict[str, torch.Tensor]]:
    """``group_size`` rows of distinct lengths (``length + i``), all derived from ``seed``."""
    return [make_row(length + i, seed * 1000 + i) for i in range(group_size)]


def refused(buf: ReplayBuffer, error: type[Exception], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Exception:
    """Run ``fn``, expect ``error``, and prove the store is byte-for-byte unchanged; the error."""
    before = dump_store(buf)
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert dump_store(buf) == before
    return info.value


def until(probe: Callable[[], Any], what: str, timeout: float = 120) -> Any:
    """Poll ``probe()`` until it returns something true and return it (a deadline, never a timing
    assertion: ``what`` is the failure message once ``timeout`` seconds have passed)."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value
