"""Shared fixtures: ``buffer_factory``, real buffers on real LMDB files under ``tmp_path``.

Helpers (schema, rows, dumps, refusals) live in tests/_buffers.py; no test imports this file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _buffers import SCHEMA

from kvckpt import BufferConfig, ReplayBuffer


@pytest.fixture
def buffer_factory(tmp_path: Any) -> Iterator[Callable[..., ReplayBuffer]]:
    """A factory of fresh buffers on real files under ``tmp_path``; every one is closed afterwards.

    Call it as ``buffer_factory(sampler="in_order", group_size=2, capacity=8, **config)``; extra
    keywords go to :class:`~kvckpt.BufferConfig` (``groups_per_step``, ``retain_consumed``,
    ``durable_checkpoints``, ``schema``...). ``name`` picks the file name (default ``bufN.kv``).
    """
    made: list[ReplayBuffer] = []

    def make(sampler: Any = "in_order", group_size: int = 2, capacity: int = 8, *, name: str | None = None,
             **config: Any) -> ReplayBuffer:
        config.setdefault("schema", SCHEMA)
        path = str(tmp_path / (name or f"buf{len(made)}.kv"))
        buf = ReplayBuffer.create(path, BufferConfig(group_size=group_size, sampler=sampler,
                                                     max_buffered_rollouts=capacity, **config))
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()
