"""docs/ray.md's statements about the actor's surface, held to the code (issue 46)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")
ray = pytest.importorskip("ray")

DOC = Path(__file__).resolve().parents[3] / "docs" / "ray.md"


def documented_methods() -> set[str]:
    """The names in the "Every method is one buffer operation" bullet."""
    text = DOC.read_text()
    start = text.index("**Every method is one buffer operation**")
    bullet = text[start:text.index("\n- ", start)]
    return set(re.findall(r"`([a-z_]+)`", bullet.split("(`tests/")[0])) - {"lease"}


def actor_methods() -> set[str]:
    cls = kray.BufferActor.__ray_actor_class__
    return {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_the_documented_method_list_is_the_actors():
    assert documented_methods() == actor_methods()


def test_progress_takes_a_group_id_and_the_client_either():
    cls = kray.BufferActor.__ray_actor_class__
    assert [p for p in inspect.signature(cls.progress).parameters if not p.startswith("_")] == ["self", "group_id"]
    assert list(inspect.signature(kray.BufferClient.progress).parameters) == ["self", "lease_or_group_id"]
