"""The replay buffer's public operations, declared once.

:data:`OPERATIONS` names every public operation of :class:`~kvckpt.ReplayBuffer`, the one
definition of what the buffer offers. Every other surface of the buffer (:class:`~kvckpt.AsyncReplayBuffer`,
the Ray actor ``kvckpt.integrations.ray.BufferActor`` and its producer client ``BufferClient``, the
reference trainer's in-memory buffer) offers each operation with the same parameter names, or
declares why not; ``tests/core/test_surfaces.py`` fails on any operation missing or shaped differently
that is not declared, and on a declared difference that no longer exists. :func:`shape` is what
"the same parameters" means.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

#: ReplayBuffer's public operations: constructors, transitions, reads, waits and checkpoints.
OPERATIONS = (
    "create", "open", "close", "path",
    "admissible", "admit", "advance_dispatch", "redispatch", "leases_held_by", "redispatch_held_by", "abort",
    "abort_stale_inflight",
    "commit_group", "commit_sample", "commit_encoded", "commit_many", "row_encoder",
    "record_progress", "record_progress_many", "progress_encoder", "record_progress_step", "record_progress_steps",
    "progress",
    "select", "claim", "release_claims", "read_batch", "finish_step", "evict", "promote_ready_group",
    "count_for_target_step", "batch_shortfall", "trainer_version", "state", "stats", "group", "groups", "ledger",
    "dataloader_state", "wait_for_change", "checkpoint", "recover",
)
#: Parameters a transport adds to every method and no caller passes (Ray's tracing context).
_TRANSPORT_PARAMETERS = frozenset({"self", "cls", "_ray_trace_ctx"})


def shape(member: Callable[..., Any] | property) -> tuple[str, ...]:
    """The parameter names of an operation in order (``*name`` / ``**name`` for variadic ones), without
    ``self`` and transport parameters; ``("<property>",)`` for a property. Whether a parameter is
    keyword-only is not part of it: a Ray actor's methods take every argument by keyword too."""
    if isinstance(member, property):
        return ("<property>",)
    marks = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(marks.get(p.kind, "") + p.name for p in inspect.signature(member).parameters.values()
                 if p.name not in _TRANSPORT_PARAMETERS)
