"""The small, tensor-free dict ``TQReplayBuffer.state_dict`` returns and ``load_state_dict`` checks.

NeMo-RL saves it as ``replay_buffer.pt``; it names a kvckpt checkpoint file and lists the groups
that file makes ready again, without any row payload, so it loads with
``torch.load(weights_only=True)``:

``backend`` (``"kvckpt"``), ``schema_version``, ``partition_id``, ``saved_capacity``,
``trainer_version``, ``dispatch_index``, ``checkpoint_file``, ``checkpoint_id`` and ``groups``:
per group ``group_id``, ``start_weight``, ``end_weight``, ``target_step``, ``sample_ids``.
It is untrusted input when read back: :func:`check` refuses anything malformed with a
:class:`~kvckpt.errors.BadArgument` (a ``ValueError``, as NeMo-RL raises) before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvckpt import CheckpointResult, ReplayBuffer
from kvckpt.errors import BadArgument
from kvckpt.storage import keys
from kvckpt.tables.records import CLAIMED, READY

#: The envelope's version.
SCHEMA_VERSION = 1
REQUIRED = ("backend", "schema_version", "partition_id", "saved_capacity", "checkpoint_file", "checkpoint_id",
            "groups")
GROUP_KEYS = ("group_id", "start_weight", "end_weight", "target_step", "sample_ids")


def build(snapshot: ReplayBuffer, result: CheckpointResult, partition_id: str, saved_capacity: int) -> dict[str, Any]:
    """The envelope of the checkpoint ``result``, read from ``snapshot`` (that file, opened
    read-only): the groups ready once it is restored, i.e. ready or claimed by its step (a
    restore undoes those claims)."""
    groups = [{"group_id": g.group_id, "start_weight": g.start_weight, "end_weight": g.end_weight,
               "target_step": g.target_step, "sample_ids": [keys.row_id(g.group_id, i) for i in range(g.group_size)]}
              for g in snapshot.groups([READY, CLAIMED])]
    return {"backend": "kvckpt", "schema_version": SCHEMA_VERSION, "partition_id": partition_id,
            "saved_capacity": int(saved_capacity), "trainer_version": result.trainer_version,
            "dispatch_index": snapshot.state()["dispatch_index"], "checkpoint_file": result.path,
            "checkpoint_id": result.checkpoint_id, "groups": groups}


def check(state: Any, partition_id: str, group_size: int) -> None:
    """Refuse a malformed envelope, another backend's, another partition's, a wrong group size or
    duplicate sample ids.

    Raises:
        BadArgument: naming the first problem.
    """
    if not isinstance(state, Mapping):
        raise BadArgument(f"replay buffer checkpoint must be a dict, got {type(state).__name__}")
    missing = sorted(set(REQUIRED) - set(state))
    if missing:
        raise BadArgument(f"replay buffer checkpoint missing required keys: {missing}")
    if state["backend"] != "kvckpt" or state["schema_version"] != SCHEMA_VERSION:
        raise BadArgument(f"replay buffer checkpoint of backend {state['backend']!r} schema "
                          f"{state['schema_version']!r}; this is kvckpt schema {SCHEMA_VERSION}")
    if state["partition_id"] != partition_id:
        raise BadArgument(f"replay buffer checkpoint partition_id mismatch: checkpoint={state['partition_id']!r}, "
                          f"expected={partition_id!r}")
    if not isinstance(state["groups"], list) or not isinstance(state["checkpoint_file"], str):
        raise BadArgument("replay buffer checkpoint groups must be a list and checkpoint_file a path")
    seen: set[str] = set()
    for doc in state["groups"]:
        if not isinstance(doc, Mapping) or set(GROUP_KEYS) - set(doc) or not isinstance(doc["sample_ids"], list):
            raise BadArgument(f"replay buffer checkpoint group is malformed (needs {list(GROUP_KEYS)}): {doc!r:.200}")
        if len(doc["sample_ids"]) != group_size:
            raise BadArgument(f"replay buffer checkpoint group {doc['group_id']!r} has {len(doc['sample_ids'])} "
                              f"rows, expected_group_size={group_size}")
        for sid in doc["sample_ids"]:
            if sid in seen:
                raise BadArgument(f"replay buffer checkpoint has duplicate sample_id: {sid!r}")
            seen.add(sid)
