"""Test-only fault injection for the reference trainer: hooks passed in, never read from the environment.

The trainer calls ``hooks.at(point, **info)`` at named points of its loop,
``hooks.before_commit(lease)`` right before each rollout commit and
``hooks.after_generation_step(states)`` after each engine step of a streaming worker. Production runs pass nothing
and get :class:`Hooks`, whose methods do nothing. Tests pass one of the classes below, or run the
trainer as a program that crashes in a fresh process::

    python -m kvckpt.reference.grpo CONFIG.yaml --crash-at after_finish_step:5

Points, in the order one step meets them (``step`` is the trainer version the point belongs to):

==========================  =====================================================================
``after_admit``             the rollout pump admitted a batch (its leases are in the ledger)
``after_commit``            a worker committed the leases of one batch
``after_select``            the train pump claimed this step's groups
``after_optimizer_step``    the policy was updated; the buffer does not know yet
``after_finish_step``       ``finish_step`` is durable (the step's groups are consumed)
``after_model_save``        ``step_N/model.pt`` is complete; the buffer is not stamped yet
``after_checkpoint``        ``step_N/`` is complete (model and buffer file)
==========================  =====================================================================
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvckpt.integrations.vllm.stream import SequenceState

from kvckpt import Lease

POINTS = ("after_admit", "after_commit", "after_select", "after_optimizer_step", "after_finish_step",
          "after_model_save", "after_checkpoint")


class Hooks:
    """The no-op hooks a production run gets."""

    def at(self, point: str, **info: Any) -> None:
        """Called at each named point (see the module docstring)."""

    def before_commit(self, lease: Lease) -> None:
        """Called by the rollout pump right before ``lease``'s rows are committed."""

    def after_generation_step(self, states: Sequence[SequenceState]) -> None:
        """Called by a streaming worker after each engine step's progress appends, with every
        sequence's :class:`~kvckpt.integrations.vllm.stream.SequenceState` (in-process workers)."""


class CrashAt(Hooks):
    """Kill this process with ``SIGKILL`` at the ``count``-th arrival at ``point`` (no cleanup,
    no ``finally``, no flush: exactly what a machine failure leaves behind).

    Args:
        point: one of :data:`POINTS`.
        count: which arrival kills. Defaults to 1.
    """

    def __init__(self, point: str, count: int = 1) -> None:
        if point not in POINTS:
            raise ValueError(f"unknown point {point!r}; choose one of {POINTS}")
        self.point, self.count = point, count
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def at(self, point: str, **info: Any) -> None:
        with self._lock:
            self._seen[point] += 1
            hit = point == self.point and self._seen[point] == self.count
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)


class ParkRollout(Hooks):
    """Hold the commit of one rollout until :meth:`release` (the others go on).

    The first lease whose ``prompt_idx`` is ``prompt_idx`` (or the first lease at all, if
    ``None``) is parked: its worker blocks before committing, so the prompt stays in flight while
    training continues around it.
    """

    def __init__(self, prompt_idx: int | None = None) -> None:
        self.prompt_idx = prompt_idx
        self.parked = threading.Event()
        self._release = threading.Event()
        self._taken = False
        self._lock = threading.Lock()
        self.lease: Lease | None = None

    def before_commit(self, lease: Lease) -> None:
        with self._lock:
            mine = not self._taken and self.prompt_idx in (None, lease.prompt_idx)
            if mine:
                self._taken, self.lease = True, lease
        if mine:
            self.parked.set()
            self._release.wait()

    def release(self) -> None:
        """Let the parked commit go on."""
        self._release.set()
