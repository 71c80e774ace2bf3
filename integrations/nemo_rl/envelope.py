"""The small, tensor-free dict ``TQReplayBuffer.state_dict`` returns and ``load_state_dict`` checks.

NeMo-RL saves it as ``replay_buffer.pt``; it names a kvckpt checkpoint file and lists the groups
that file makes ready again, without any row payload, so it loads with
``torch.load(weights_only=True)``:

``backend`` (``"kvckpt"``), ``schema_version``, ``partition_id``, ``saved_capacity``,
``trainer_version``, ``dispatch_index``, ``checkpoint_file``, ``checkpoint_id`` and ``groups``:
per group ``group_id``, ``start_weight``, ``end_weight``, ``target_step``, ``sample_ids`` and
``sequence_lengths`` (one per row, as the group's ``KVBatchMeta`` carries them).
It is untrusted input when read back: :func:`check` refuses anything malformed with a
:class:`~kvckpt.errors.BadArgument` (a ``ValueError``, as NeMo-RL raises) before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvckpt import CLAIMED, READY, CheckpointResult, ReplayBuffer, row_id
from kvckpt.errors import BadArgument

#: The envelope's version (2: groups carry ``sequence_lengths``).
SCHEMA_VERSION = 2
REQUIRED = ("backend", "schema_version", "partition_id", "saved_capacity", "checkpoint_file", "checkpoint_id",
            "groups")
GROUP_KEYS = ("group_id", "start_weight", "end_weight", "target_step", "sample_ids", "sequence_lengths")


def build(snapshot: ReplayBuffer, result: CheckpointResult, partition_id: str, saved_capacity: int) -> dict[str, Any]:
    """The envelope of the checkpoint ``result``, read from ``snapshot`` (that file, opened
    read-only): the groups ready once it is restored, i.e. ready or claimed by its step (a
    restore undoes those claims)."""
    groups = [{"group_id": g.group_id, "start_weight": g.start_weight, "end_weight": g.end_weight,
               "target_step": g.target_step, "sample_ids": [row_id(g.group_id, i) for i in range(g.group_size)],
               "sequence_lengths": _lengths(snapshot, g.group_id)}
              for g in snapshot.groups([READY, CLAIMED])]
    return {"backend": "kvckpt", "schema_version": SCHEMA_VERSION, "partition_id": partition_id,
            "saved_capacity": int(saved_capacity), "trainer_version": result.trainer_version,
            "dispatch_index": snapshot.state()["dispatch_index"], "checkpoint_file": result.path,
            "checkpoint_id": result.checkpoint_id, "groups": groups}


def _lengths(snapshot: ReplayBuffer, group_id: str) -> list[int]:
    """Each row's ``input_lengths`` (else its first token field's length; 0 without either)."""
    schema = snapshot.schema
    name = "input_lengths" if "input_lengths" in schema.fields else (schema.token_fields or [None])[0]
    if name is None:
        return [0] * snapshot.group(group_id).group_size
    rows = snapshot.read_batch([group_id], fields=[name], layout="list").rows
    return [int(row[name]) if name == "input_lengths" else len(row[name]) for row in rows]


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
        missing = sorted(set(GROUP_KEYS) - set(doc)) if isinstance(doc, Mapping) else list(GROUP_KEYS)
        if missing:
            raise BadArgument(f"replay buffer checkpoint group missing keys: {missing}")
        if not isinstance(doc["sample_ids"], list) or not isinstance(doc["sequence_lengths"], list):
            raise BadArgument(f"replay buffer checkpoint group {doc['group_id']!r}: sample_ids and sequence_lengths "
                              "must be lists")
        if len(doc["sample_ids"]) != group_size or len(doc["sequence_lengths"]) != group_size:
            raise BadArgument(f"replay buffer checkpoint group {doc['group_id']!r} is misaligned: "
                              f"{len(doc['sample_ids'])} sample_ids and {len(doc['sequence_lengths'])} "
                              f"sequence_lengths, expected_group_size={group_size}")
        for sid in doc["sample_ids"]:
            if sid in seen:
                raise BadArgument(f"replay buffer checkpoint has duplicate sample_id: {sid!r}")
            seen.add(sid)
