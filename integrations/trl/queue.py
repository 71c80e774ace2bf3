"""The ``rollout_buffer`` TRL's trainer drains: rows read from the kvckpt store, never a memory queue.

TRL's ``RolloutQueueDataset`` calls ``rollout_buffer.get(timeout=...)`` for one sample at a time
and ``qsize()`` for its metrics (trl/experimental/async_grpo/async_grpo_trainer.py,
``RolloutQueueDataset.__iter__``). :class:`BufferQueue` answers ``get`` from the ready groups of
the store in dispatch order, a whole group's rows one after another. A group is only *served*
then: it stays ``ready`` in the store, because the trainer's dataloader reads ahead of the step
that trains it. :meth:`BufferQueue.close_step` claims exactly the groups a finished optimizer
step trained and closes the kvckpt step, so a crash at any point leaves every served but
untrained group ready for the resumed run.

Staleness is TRL's rule, ``trainer_version - sample.model_version > max_staleness``, counted in
weight syncs. kvckpt stamps each group with the optimizer step of the weights that generated it
(``start_weight``), so the rule reads ``ceil((weights_step - start_weight) / weight_sync_steps) >
max_staleness``; a group failing it is evicted (one transaction) when it is reached, and the next
one is served. The ``model_version`` a served sample carries is the trainer's version less that
staleness, so TRL's own check (which runs again on every sample) agrees and never drops one.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvckpt import ReplayBuffer
from kvckpt.errors import InvariantViolation


@dataclass
class _Served:
    group_id: str
    rows: int


@dataclass
class VersionClock:
    """Maps TRL's model versions (one per weight sync) to the optimizer step of the weights.

    ``pending_step`` is the step whose weights the next ``update_model_version`` publishes; the
    callback sets it at train begin (the resumed step) and at every step end.
    """

    weight_sync_steps: int = 1
    max_staleness: int = 4
    pending_step: int = 0
    version: int = 0
    weights_step: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def publish(self, model_version: int) -> None:
        """TRL announced ``model_version``: the weights of ``pending_step`` are live."""
        with self._lock:
            self.version, self.weights_step = int(model_version), self.pending_step

    def staleness(self, start_weight: int) -> int:
        """TRL's staleness (weight syncs behind) of rows generated with the weights of ``start_weight``."""
        with self._lock:
            behind = self.weights_step - int(start_weight)
        return max(0, math.ceil(behind / self.weight_sync_steps))

    def sample_version(self, start_weight: int) -> int:
        """The ``model_version`` to stamp on a served row, so TRL computes the same staleness."""
        return self.version - self.staleness(start_weight)


class BufferQueue:
    """TRL's ``rollout_buffer`` over a kvckpt store: ``get(timeout)`` and ``qsize()``.

    Guarantees: rows are served whole group by whole group in dispatch order; a group is never
    served twice by one process; a stale group is evicted in its own transaction when reached and
    never blocks the groups behind it; nothing is claimed until :meth:`close_step` is told a step
    trained it.

    Args:
        make_sample: ``(group_info, rows, model_version) -> list`` of TRL ``RolloutSample``s.
        clock: the shared :class:`VersionClock`.
    """

    def __init__(self, make_sample: Any, clock: VersionClock) -> None:
        self._make_sample = make_sample
        self._clock = clock
        self._buffer: ReplayBuffer | None = None
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        self._served: list[_Served] = []
        self._served_ids: set[str] = set()
        self._trained_rows = 0
        self.evicted = 0

    def attach(self, buffer: ReplayBuffer) -> None:
        """Serve from ``buffer`` (after it was opened, recovered or restored); forgets what was served."""
        with self._lock:
            self._buffer = buffer
            self._pending, self._served, self._served_ids, self._trained_rows = [], [], set(), 0

    def _next_group(self) -> list[Any] | None:
        buffer = self._buffer
        if buffer is None:
            return None
        stale = []
        chosen = None
        for info in buffer.groups(["ready"]):
            if info.group_id in self._served_ids:
                continue
            if self._clock.staleness(info.start_weight) > self._clock.max_staleness:
                stale.append(info.group_id)
                continue
            chosen = info
            break
        if stale:
            buffer.evict(stale)
            self.evicted += len(stale)
        if chosen is None:
            return None
        rows = buffer.read_batch([chosen.group_id], layout="list").rows
        self._served.append(_Served(chosen.group_id, len(rows)))
        self._served_ids.add(chosen.group_id)
        return list(self._make_sample(chosen, rows, self._clock.sample_version(chosen.start_weight)))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next row as a TRL ``RolloutSample``, waiting up to ``timeout`` seconds.

        Raises:
            queue.Empty: nothing servable arrived in time (TRL then calls ``check_health``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    self._pending = self._next_group() or []
                if self._pending:
                    sample = self._pending.pop(0)
                    sample.enqueued_at = time.time()
                    return sample
                buffer = self._buffer
            left = None if deadline is None else deadline - time.monotonic()
            if not block or (left is not None and left <= 0):
                raise queue.Empty
            if buffer is None:
                time.sleep(min(0.05, left if left is not None else 0.05))
            else:
                buffer.wait_for_change(min(0.25, left) if left is not None else 0.25)

    def get_nowait(self) -> Any:
        """``get(block=False)``."""
        return self.get(block=False)

    def qsize(self) -> int:
        """Rows ready to serve: those of the group being served plus every unserved ready group's."""
        with self._lock:
            buffer, pending, served = self._buffer, len(self._pending), set(self._served_ids)
        if buffer is None:
            return pending
        return pending + sum(g.group_size for g in buffer.groups(["ready"]) if g.group_id not in served)

    def empty(self) -> bool:
        """Whether :meth:`qsize` is 0."""
        return self.qsize() == 0

    def close_step(self, trained_rows: int) -> list[str]:
        """A step trained the next ``trained_rows`` served rows: claim their groups and close the
        kvckpt step (``claim`` then ``finish_step``, one transaction each).

        Returns:
            The group ids the step trained.

        Raises:
            InvariantViolation: the rows end inside a group (the step size is not a multiple of the
                group size) or more rows were trained than were served.
        """
        with self._lock:
            buffer = self._buffer
            target = self._trained_rows + int(trained_rows)
            done, rows = [], self._trained_rows
            while self._served and rows < target:
                head = self._served.pop(0)
                rows += head.rows
                done.append(head.group_id)
            if rows != target:
                raise InvariantViolation(
                    f"a step trained {trained_rows} rows, which ends inside a group or past the "
                    f"{rows - self._trained_rows} rows served: samples per step must be a multiple of num_generations")
            self._trained_rows = target
            self._served_ids.difference_update(done)
        if buffer is None:
            raise InvariantViolation("close_step before the store was opened (on_train_begin did not run)")
        if done:
            buffer.claim(done)
        buffer.finish_step()
        return done
