"""Shared test fixtures: a tiny row schema, a deterministic row factory and a buffer factory.

Import the helpers directly (``from conftest import SCHEMA, make_row, make_group, dump_store``)
and request the ``buffer_factory`` fixture for real buffers on real LMDB files under ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvckpt import BufferConfig, ReplayBuffer
from kvckpt.storage.layout import ONE_TREE_TABLES

#: The smallest schema that exercises both field kinds and two dtypes.
SCHEMA: dict[str, tuple[str, str]] = {
    "input_ids": ("int64", "token"),
    "generation_logprobs": ("float32", "token"),
    "total_reward": ("float32", "row"),
}


def make_row(length: int, seed: int) -> dict[str, torch.Tensor]:
    """One row of :data:`SCHEMA` with ``length`` tokens; equal ``(length, seed)`` give equal rows."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (length,), generator=gen, dtype=torch.int64),
        "generation_logprobs": -torch.rand(length, generator=gen, dtype=torch.float32),
        "total_reward": torch.rand((), generator=gen, dtype=torch.float32),
    }


def make_group(group_size: int, seed: int, length: int = 4) -> list[dict[str, torch.Tensor]]:
    """``group_size`` rows of distinct lengths (``length + i``), all derived from ``seed``."""
    return [make_row(length + i, seed * 1000 + i) for i in range(group_size)]


def dump_store(buf: ReplayBuffer) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every key and value of every table, from one snapshot: compare two dumps to prove that a
    refused operation wrote nothing."""
    return buf.store.read(lambda t: {name: list(t.iter_prefix(name, b"")) for name in ONE_TREE_TABLES})


def refused(buf: ReplayBuffer, error: type[Exception], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Exception:
    """Run ``fn``, expect ``error``, and prove the store is byte-for-byte unchanged; the error."""
    before = dump_store(buf)
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    assert dump_store(buf) == before
    return info.value


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
