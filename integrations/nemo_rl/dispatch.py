"""Which prompt, and which sequence, the code running now works for: what NeMo-RL's own calls do not carry.

NeMo-RL's ``RolloutManager.generate_and_push`` calls ``reserve(weight_version=, target_step=)`` with no prompt
identity and no group id, and its vLLM worker makes a random request id per request. Both facts travel here as
context variables of the asyncio task running NeMo-RL's code (a task copies them into the tasks it starts, so
``run_rollout``'s per-sample tasks see them):

* :func:`dispatching` binds the prompt (``prompt_idx``, ``task_name``) and, for a re-issue after a restart, its
  recovered ``group_id``: ``TQReplayBuffer.reserve`` called with neither reads it, so the entry is not anonymous
  (a restart can re-issue it) and a re-issue takes its own recovered lease;
* :func:`bind_lease` is what ``reserve`` then binds: the lease of the attempt, which the engine proxy's
  sequence key carries (:mod:`.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from kvckpt import Lease


@dataclass(frozen=True)
class Dispatch:
    """One prompt being generated: its dataset index and task, and the group id it must keep (a re-issue)."""

    prompt_idx: int
    task_name: str
    group_id: str | None = None


_DISPATCH: ContextVar[Dispatch | None] = ContextVar("kvckpt_nemo_rl_dispatch", default=None)
_LEASE: ContextVar[Lease | None] = ContextVar("kvckpt_nemo_rl_lease", default=None)


@contextlib.contextmanager
def dispatching(input_sample: Mapping[str, Any], group_id: str | None = None) -> Iterator[Dispatch]:
    """Bind NeMo-RL's ``DatumSpec`` (its ``idx`` and ``task_name``) and optionally a recovered ``group_id``
    for the ``reserve`` calls made inside the block (and the tasks it starts)."""
    bound = Dispatch(int(input_sample["idx"]), str(input_sample.get("task_name") or "default"), group_id)
    token, lease_token = _DISPATCH.set(bound), _LEASE.set(None)
    try:
        yield bound
    finally:
        _LEASE.reset(lease_token)
        _DISPATCH.reset(token)


def bound_dispatch() -> Dispatch | None:
    """The prompt :func:`dispatching` bound for the running task, if any."""
    return _DISPATCH.get()


def bind_lease(lease: Lease) -> None:
    """Bind the attempt ``reserve`` just opened, inside a :func:`dispatching` block, for the rest of that block
    in the running task (and the tasks it starts)."""
    if _DISPATCH.get() is not None:
        _LEASE.set(lease)


def bound_lease() -> Lease | None:
    """The attempt ``reserve`` bound in the running task, if any."""
    return _LEASE.get()
