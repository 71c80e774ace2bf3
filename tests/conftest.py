"""Shared fixtures: ``buffer_factory``, real buffers on real LMDB files under ``tmp_path``; the tiny
model (``tiny_model_cache``, ``model_path``) that the trainer, vLLM and TRL tests generate with;
``ray_local``, one loopback-only Ray per test module (the Ray and TransferQueue tests).

The Ray fixtures live here, not in tests/integrations/conftest.py: a conftest there would put
tests/integrations on ``sys.path``, where its sub-folders (``verl``, ``vllm``, ...) would shadow the
peers' packages that the tests import or skip on. A module that requests ``ray_local`` names its
Ray in a module-level ``RAY_LOCAL`` dict, the keywords of
:func:`kvckpt.integrations.ray.init_local_ray` (``namespace`` included); Ray is imported only when a
test asks for it (after kvckpt's Ray integration, which keeps it on loopback).

Helpers (schema, rows, dumps, refusals) live in tests/_buffers.py; no test imports this file.
"""

from __future__ import annotations

import sys
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


@pytest.fixture(scope="module")
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's cache directory (``ensure_tiny_model``'s parent, a trainer config's
    ``model.cache_dir``), the model built in it: one per test session, shared by its modules."""
    from kvckpt.integrations.vllm import ensure_tiny_model

    path = str(tmp_path_factory.getbasetemp() / "tiny-model")
    ensure_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def model_path(tiny_model_cache: str) -> str:
    """The tiny model's own directory (config, safetensors weights, tokenizer) in ``tiny_model_cache``."""
    from kvckpt.integrations.vllm import ensure_tiny_model

    return ensure_tiny_model(tiny_model_cache)


@pytest.fixture(scope="module")
def ray_teardown() -> Iterator[None]:
    """Shuts Ray down after the module's last test, whoever started it (``ray_local`` or a cluster)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None:
        ray.shutdown()


@pytest.fixture
def ray_local(request: pytest.FixtureRequest, ray_teardown: None) -> str:
    """The module's single-node loopback Ray, started as its ``RAY_LOCAL`` says; its GCS address.

    Started on first use and kept for the module's later tests; started again if a test shut it
    down or another module left its own session (another namespace) running; shut down after the
    module's last test (``ray_teardown``).
    """
    kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: keeps Ray on loopback
    ray = pytest.importorskip("ray")
    settings = request.module.RAY_LOCAL
    if ray.is_initialized() and ray.get_runtime_context().namespace != settings["namespace"]:
        ray.shutdown()
    if not ray.is_initialized():
        kray.init_local_ray(**settings)
    return ray.get_runtime_context().gcs_address
