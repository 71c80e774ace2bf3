"""Every surface of the buffer offers ReplayBuffer's operations as the operation table
(kvckpt.buffer.surface.TABLE) says: made from the table, written by hand with the same parameter names, shaped
differently or absent, each difference with its reason in the row. A new ReplayBuffer method without a row, a
surface that loses or reshapes an operation, a row that says a surface differs when it no longer does, a
hand-written method where the table says generated (or the reverse), and a codec the wire lacks all fail."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvckpt import AsyncReplayBuffer, ReplayBuffer
from kvckpt.buffer.surface import DIFFERS, GENERATED, HAND, OPERATIONS, SURFACES, TABLE, is_generated, shape


def _members(cls: type) -> dict[str, Any]:
    return {name: inspect.getattr_static(cls, name) if isinstance(inspect.getattr_static(cls, name), property)
            else getattr(cls, name) for name in dir(cls) if not name.startswith("_")}


def _surfaces() -> dict[str, type]:
    from kvckpt.integrations.ray.actor import BufferActor
    from kvckpt.integrations.ray.client import BufferClient

    from kvckpt.testing.fixtures.memory_buffer import MemoryReplayBuffer

    return {"async": AsyncReplayBuffer, "actor": BufferActor.__ray_actor_class__, "client": BufferClient,
            "memory": MemoryReplayBuffer}


def test_the_table_is_replay_buffers_public_surface() -> None:
    public = {name for name in vars(ReplayBuffer) if not name.startswith("_")}
    assert public == set(OPERATIONS) and len(OPERATIONS) == len(set(OPERATIONS)), public ^ set(OPERATIONS)
    assert [row.name for row in TABLE] == list(OPERATIONS)


@pytest.mark.parametrize("surface", SURFACES)
def test_every_surface_offers_every_operation_as_its_row_says(surface: str) -> None:
    cls, reference = _surfaces()[surface], _members(ReplayBuffer)
    members = _members(cls)
    wrong = {}
    for row in TABLE:
        offer, member = row.on(surface), members.get(row.name)
        if not offer.offered:
            found = "absent" if member is None else "offered"
        elif member is None:
            found = "absent"
        elif shape(member) != shape(reference[row.name]):
            found = DIFFERS
        else:
            found = GENERATED if is_generated(member) else HAND
        if found != offer.how:
            wrong[row.name] = (offer.how, found, shape(reference[row.name]), None if member is None else shape(member))
    assert wrong == {}, f"{surface}: operation -> (the table says, the surface has, ReplayBuffer's shape, its shape)"


def test_every_codec_the_table_names_is_on_the_wire() -> None:
    pytest.importorskip("ray")
    from kvckpt.integrations.ray.wire import CODECS, LOCAL

    named = {row.result for row in TABLE} | {codec for row in TABLE for codec in row.args.values()}
    assert named - set(CODECS) - LOCAL == set()
    on_the_actor = {row.result for row in TABLE if row.on("actor").offered}
    assert on_the_actor & LOCAL == set(), "a result that cannot cross the wire on an operation the actor offers"


def test_a_generated_method_has_replay_buffers_signature_hints_and_summary() -> None:
    import typing

    from kvckpt.integrations.ray.actor import BufferActor

    method = AsyncReplayBuffer.commit_encoded
    assert inspect.signature(method) == inspect.signature(ReplayBuffer.commit_encoded)
    assert typing.get_type_hints(method) == typing.get_type_hints(ReplayBuffer.commit_encoded)
    assert method.__doc__.startswith("Commit rows a producer encoded itself")
    assert "kvckpt.ReplayBuffer.commit_encoded" in method.__doc__
    remote = BufferActor.__ray_actor_class__.commit_group
    assert shape(remote) == shape(ReplayBuffer.commit_group) and "lease" in remote.__doc__


def test_claim_and_release_claims_run_through_the_async_facade(tmp_path: Any) -> None:
    import asyncio

    import torch

    from kvckpt import BufferConfig

    async def run() -> None:
        cfg = BufferConfig(group_size=1, schema={"x": ("float32", "row")}, sampler={"name": "in_order"},
                           max_buffered_rollouts=4, groups_per_step=1)
        abuf = await AsyncReplayBuffer.create(str(tmp_path / "live.kv"), cfg)
        try:
            [lease] = await abuf.admit([0])
            await abuf.commit_group(lease, [{"x": torch.tensor(1.0)}])
            claimed = await abuf.claim([lease.group_id])
            assert claimed.group_ids == [lease.group_id]
            assert await abuf.release_claims([lease.group_id]) == [lease.group_id]
            assert (await abuf.select(1, 1)).group_ids == [lease.group_id]  # ready again
        finally:
            await abuf.close()

    asyncio.run(run())
