"""One explicit scenario per operation of the buffer, run on every surface that offers it.

The state machine of :mod:`kvckpt.testing.conformance.buffer` draws random sequences of the buffer's
main transitions; this module drives *every* row of the operation table
(:data:`kvckpt.buffer.surface.TABLE`) deterministically: :data:`SCENARIOS` holds one scenario per
operation (a fresh buffer, the operation called, its result and its effect checked against what
:class:`~kvckpt.ReplayBuffer` answers), and :func:`run_operation_scenarios` runs them on a
:class:`~kvckpt.testing.conformance.buffer.BufferSurface`. An operation the surface does not offer is
skipped only where the table says so (with its reason); a capability the surface declares it lacks
(``durability``, ``reopen``) is held to its declaration: the operation must refuse with
:class:`NotImplementedError`. A row without a scenario fails the run, so a new operation needs one.

Long (over 400 lines): one short scenario per row of the table (42), in the table's order; split, a
row's scenario would be looked for in two places.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from kvckpt import BufferConfig, MalformedMessage, ProgressEncoder, StaleAttempt
from kvckpt.buffer.surface import TABLE
from kvckpt.durability.safe_open import verify_path
from kvckpt.storage.encoding import RowEncoder
from kvckpt.testing.conformance.buffer import MSCHEMA, BufferSurface, N, row_for

#: Every scenario's buffer: prompts stamped for a step (in_order), three steps of look-ahead, room for four.
CONFIG = BufferConfig(group_size=N, schema=MSCHEMA, sampler={"name": "in_order", "max_lookahead_versions": 3},
                      max_buffered_rollouts=4, groups_per_step=1)
#: The windowed sampler without staleness: what abort_stale_inflight aborts after one step.
WINDOWED = BufferConfig(group_size=N, schema=MSCHEMA, sampler={"name": "windowed", "max_staleness_versions": 0},
                        max_buffered_rollouts=4, groups_per_step=1)


class Scene:
    """One scenario's world: a buffer on ``surface`` in a fresh directory, closed at the end."""

    def __init__(self, surface: BufferSurface, config: BufferConfig = CONFIG) -> None:
        self.surface, self.config = surface, config
        self.dir = tempfile.mkdtemp(prefix="kvckpt-scenario-")
        self.path = os.path.join(self.dir, "live.kv")
        self.buf: Any = surface.create(self.path, config)

    def close(self) -> None:
        if self.buf is not None:
            self.surface.close(self.buf)
            self.buf = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def admit(self, count: int = 1, dataloader_state: bytes | None = None) -> list[Any]:
        return self.buf.admit(list(range(count)), dataloader_state)

    def rows(self, lease: Any, variant: int = 0) -> list[dict[str, Any]]:
        return [row_for(lease.group_id, i, variant) for i in range(N)]

    def ready(self, count: int = 1) -> list[Any]:
        """``count`` prompts admitted and committed whole; their leases."""
        leases = self.admit(count)
        for lease in leases:
            assert self.buf.commit_group(lease, self.rows(lease)).ready
        return leases

    def chunk(self, lease: Any, index: int = 0, start: int = 0, n: int = 2) -> dict[str, Any]:
        """record_progress's keyword arguments for ``n`` tokens of row ``index``'s prefix (version 0)."""
        row = row_for(lease.group_id, index, 0)
        return {"start": start, "tokens": row["input_ids"][start:start + n],
                "logprobs": row["generation_logprobs"][start:start + n], "weight_version": 0}

    def item(self, lease: Any, index: int = 0, **chunk: Any) -> dict[str, Any]:
        return {"lease": lease, "index": index, **(chunk or self.chunk(lease, index))}


def _lacking(scene: Scene, capability: str, call: Callable[[], Any]) -> bool:
    """Whether ``scene``'s surface declares it lacks ``capability``; if so, the call must refuse."""
    if scene.surface.has(capability):
        return False
    try:
        call()
    except NotImplementedError:
        return True
    raise AssertionError(f"{scene.surface.name} declares it lacks {capability}, but the call did not refuse")


# -- constructors and the handle -------------------------------------------------------------------
def create(s: Scene) -> None:
    state = s.buf.state()
    assert (state["trainer_version"], state["dispatch_index"], state["inflight"]) == (0, -1, 0)


def open_(s: Scene) -> None:
    s.admit(1, b"before")
    s.surface.close(s.buf)
    s.buf = None
    s.buf = s.surface.open(s.path)
    assert s.buf.dataloader_state() == b"before" and s.buf.state()["inflight"] == 1


def close(s: Scene) -> None:
    s.admit(1)
    assert s.buf.close() is None
    s.buf = None


def path(s: Scene) -> None:
    assert os.path.abspath(s.buf.path) == os.path.abspath(s.path)


# -- admission -------------------------------------------------------------------------------------
def admissible(s: Scene) -> None:
    assert s.buf.admissible(1) and s.buf.admissible(4)
    s.admit(3)
    assert s.buf.admissible(1) and not s.buf.admissible(2)


def admit(s: Scene) -> None:
    leases = s.admit(2, b"dl")
    assert [(x.group_id, x.attempt, x.target_step, x.missing) for x in leases] == [
        ("a0-p0", 0, 0, tuple(range(N))), ("a0-p1", 0, 0, tuple(range(N)))]
    assert s.buf.state()["counters"]["admitted"] == 2 and s.buf.dataloader_state() == b"dl"


def advance_dispatch(s: Scene) -> None:
    admission = s.buf.advance_dispatch(b"cursor")
    [lease] = s.buf.admit([7], admission=admission)
    assert lease.target_step == 0 and s.buf.state()["dispatch_index"] == 0
    assert s.buf.dataloader_state() == b"cursor"


def redispatch(s: Scene) -> None:
    [old] = s.admit(1)
    new = s.buf.redispatch(old.group_id)
    assert (new.group_id, new.attempt) == (old.group_id, 1)
    try:
        s.buf.commit_group(old, s.rows(old))
        raise AssertionError("the fenced lease committed")
    except StaleAttempt:
        pass
    assert s.buf.commit_group(new, s.rows(new)).ready


def leases_held_by(s: Scene) -> None:
    [mine] = s.buf.admit([0], holder="w1")
    s.buf.admit([1], holder="w2")
    assert [(x.group_id, x.attempt) for x in s.buf.leases_held_by("w1")] == [(mine.group_id, 0)]
    assert s.buf.leases_held_by("nobody") == []


def redispatch_held_by(s: Scene) -> None:
    [old] = s.buf.admit([0], holder="w1")
    [new] = s.buf.redispatch_held_by("w1", to="w2")
    assert (new.group_id, new.attempt) == (old.group_id, 1)
    assert [x.group_id for x in s.buf.leases_held_by("w2")] == [old.group_id] and s.buf.leases_held_by("w1") == []


def abort(s: Scene) -> None:
    [lease] = s.admit(1)
    assert s.buf.abort(lease.group_id, "scenario") is None
    assert s.buf.ledger() == [] and [g.state for g in s.buf.groups()] == ["aborted"]


def abort_stale_inflight(s: Scene) -> None:  # on WINDOWED
    [lease] = s.admit(1)
    assert s.buf.abort_stale_inflight() == []
    s.buf.finish_step()
    assert s.buf.abort_stale_inflight() == [lease.group_id] and s.buf.ledger() == []


# -- commits and progress --------------------------------------------------------------------------
def commit_group(s: Scene) -> None:
    [lease] = s.admit(1)
    first = s.buf.commit_group(lease, s.rows(lease))
    assert (first.ready, first.replayed, first.rows_written) == (True, False, N)
    assert s.buf.commit_group(lease, s.rows(lease)).replayed  # an identical retry writes nothing


def commit_sample(s: Scene) -> None:
    [lease] = s.admit(1)
    assert not s.buf.commit_sample(lease, 0, row_for(lease.group_id, 0, 0)).ready
    assert s.buf.commit_sample(lease, 1, row_for(lease.group_id, 1, 0)).ready
    assert s.buf.state()["counters"]["samples_committed"] == N


def commit_encoded(s: Scene) -> None:
    [lease] = s.admit(1)
    encoded = RowEncoder.from_config(s.config.to_dict()).encode(lease, s.rows(lease))
    result = s.buf.commit_encoded(lease, [row.to_dict() for row in encoded])
    assert (result.ready, result.rows_written) == (True, N)
    [group] = s.buf.groups(["ready"])
    assert group.group_id == lease.group_id


def commit_many(s: Scene) -> None:
    first, second = s.admit(2)
    newer = s.buf.redispatch(second.group_id)
    results = s.buf.commit_many([{"lease": first, "rows": s.rows(first)}, {"lease": second, "rows": s.rows(second)},
                                 {"lease": newer, "index": 0, "rows": row_for(newer.group_id, 0, 0)}])
    assert results[0].ready and isinstance(results[1], StaleAttempt) and not results[2].ready


def row_encoder(s: Scene) -> None:
    [lease] = s.admit(1)
    encoded = s.buf.row_encoder().encode(lease, s.rows(lease))
    assert [row.index for row in encoded] == list(range(N))
    assert s.buf.commit_encoded(lease, encoded).ready


def record_progress(s: Scene) -> None:
    [lease] = s.admit(1)
    assert s.buf.record_progress(lease, 0, **s.chunk(lease)) == 2
    assert s.buf.record_progress(lease, 0, **s.chunk(lease)) == 2  # a retry: its first answer
    assert s.buf.progress(lease.group_id)[0].tokens.tolist() == s.chunk(lease)["tokens"].tolist()


def record_progress_many(s: Scene) -> None:
    [lease] = s.admit(1)
    results = s.buf.record_progress_many([s.item(lease, 0), s.item(lease, 1, **s.chunk(lease, 1, n=3))])
    assert results == [2, 3]
    assert sorted(s.buf.progress(lease.group_id)) == [0, 1]


def progress_encoder(s: Scene) -> None:
    [lease] = s.admit(1)
    message = s.buf.progress_encoder().encode_items([s.item(lease)])
    assert s.buf.record_progress_step(message) == [2]


def record_progress_step(s: Scene) -> None:
    [lease] = s.admit(1)
    message = ProgressEncoder.from_config(s.config.to_dict()).encode_items([s.item(lease)])
    assert s.buf.record_progress_step(message) == [2]
    assert s.buf.record_progress_step(message) == [2]  # the same bytes again: the same answer, nothing written
    assert s.buf.progress(lease.group_id)[0].versions.tolist() == [0, 0]


def record_progress_steps(s: Scene) -> None:
    [lease] = s.admit(1)
    message = ProgressEncoder.from_config(s.config.to_dict()).encode_items([s.item(lease)])
    results = s.buf.record_progress_steps([message, b"not a message"])
    assert results[0] == [2] and isinstance(results[1], MalformedMessage)


def progress(s: Scene) -> None:
    [lease] = s.admit(1)
    assert s.buf.progress(lease.group_id) == {}
    s.buf.record_progress(lease, 1, **s.chunk(lease, 1, n=3))
    found = s.buf.progress(lease.group_id)
    assert list(found) == [1] and found[1].tokens.tolist() == s.chunk(lease, 1, n=3)["tokens"].tolist()


# -- the trainer -----------------------------------------------------------------------------------
def select(s: Scene) -> None:
    [lease] = s.ready(1)
    assert s.buf.select(2, 2).group_ids == []  # fewer than min_groups: nothing claimed
    selection = s.buf.select(1, 1)
    assert (selection.step, selection.group_ids) == (0, [lease.group_id])


def claim(s: Scene) -> None:
    first, second = s.ready(2)
    assert s.buf.claim([second.group_id]).group_ids == [second.group_id]
    assert s.buf.state()["claimed"] == 1 and s.buf.select(1, 2).group_ids == [first.group_id]


def release_claims(s: Scene) -> None:
    [lease] = s.ready(1)
    s.buf.select(1, 1)
    assert s.buf.release_claims([lease.group_id]) == [lease.group_id]
    assert s.buf.state()["claimed"] == 0 and s.buf.select(1, 1).group_ids == [lease.group_id]


def read_batch(s: Scene) -> None:
    [lease] = s.ready(1)
    batch = s.buf.read_batch(s.buf.select(1, 1))
    assert [g.group_id for g in batch.groups] == [lease.group_id] and list(batch.row_indices) == list(range(N))
    assert batch.tensors["input_ids"][1].tolist() == row_for(lease.group_id, 1, 0)["input_ids"].tolist()


def finish_step(s: Scene) -> None:
    s.ready(1)
    s.buf.select(1, 1)
    assert s.buf.finish_step(weight_version=0) == 1
    state = s.buf.state()
    assert (state["trainer_version"], state["weight_version"], state["counters"]["consumed"]) == (1, 0, 1)


def evict(s: Scene) -> None:
    [lease] = s.ready(1)
    assert s.buf.evict() == []
    s.buf.finish_step()
    assert s.buf.evict() == [lease.group_id] and s.buf.groups(["ready"]) == []


def promote_ready_group(s: Scene) -> None:
    s.admit(1)
    [later] = s.ready(1)  # the second admission: stamped for step 1
    assert s.buf.promote_ready_group(1) is None
    assert s.buf.promote_ready_group(0) == 1 and s.buf.group(later.group_id).target_step == 0


def count_for_target_step(s: Scene) -> None:
    s.admit(2)
    s.ready(1)
    assert [s.buf.count_for_target_step(k) for k in (0, 1, 2)] == [2, 1, 0]


def batch_shortfall(s: Scene) -> None:
    assert s.buf.batch_shortfall() == {}
    [lease] = s.admit(1)
    s.buf.abort(lease.group_id, "scenario")
    assert s.buf.batch_shortfall() == {0: 1}


def trainer_version(s: Scene) -> None:
    assert s.buf.trainer_version == 0
    s.buf.finish_step()
    assert s.buf.trainer_version == 1


def state(s: Scene) -> None:
    s.ready(1)
    found = s.buf.state()
    assert (found["ready"], found["counters"]["committed"], found["seq"]) == (1, 1, 1)


def stats(s: Scene) -> None:
    s.ready(1)
    assert isinstance(s.buf.stats(), dict) and s.buf.stats()["committed"] == 1


def group(s: Scene) -> None:
    [lease] = s.ready(1)
    found = s.buf.group(lease.group_id)
    assert (found.group_id, found.state, found.target_step) == (lease.group_id, "ready", 0)
    assert s.buf.group("nobody") is None


def groups(s: Scene) -> None:
    [inflight] = s.admit(1)
    [ready] = s.ready(1)
    s.buf.abort(inflight.group_id, "scenario")
    assert [g.group_id for g in s.buf.groups()] == [inflight.group_id, ready.group_id]
    assert [g.group_id for g in s.buf.groups(["ready"])] == [ready.group_id]


def ledger(s: Scene) -> None:
    leases = s.admit(2)
    s.buf.commit_sample(leases[1], 0, row_for(leases[1].group_id, 0, 0))
    assert [(e.group_id, e.siblings) for e in s.buf.ledger()] == [(leases[0].group_id, ()), (leases[1].group_id, (0,))]


def dataloader_state(s: Scene) -> None:
    assert s.buf.dataloader_state() is None
    s.admit(1, b"cursor-1")
    assert s.buf.dataloader_state() == b"cursor-1"


def wait_for_change(s: Scene) -> None:
    assert s.buf.wait_for_change(0.01) is None  # nothing changes: it returns after the timeout


# -- checkpoints and recovery ----------------------------------------------------------------------
def checkpoint(s: Scene) -> None:
    dest = os.path.join(s.dir, "ckpt.kv")
    if _lacking(s, "durability", lambda: s.buf.checkpoint(dest)):
        return
    s.ready(1)
    result = s.buf.checkpoint(dest, {"step": 0}).wait()
    assert result.trainer_version == 0 and verify_path(dest).ok


def recover(s: Scene) -> None:
    if _lacking(s, "durability", s.buf.recover):
        return
    [lease] = s.admit(1)
    plan = s.buf.recover()
    assert [(x.group_id, x.attempt) for x in plan.leases] == [(lease.group_id, 1)] and plan.resume_version == 0


#: Operation -> its scenario (the function of the operation's name, ``open_`` for ``open``): every row of
#: the table has one.
SCENARIOS: dict[str, Callable[[Scene], None]] = {
    row.name: globals()[row.name if row.name != "open" else "open_"] for row in TABLE
    if (row.name if row.name != "open" else "open_") in globals()}
#: The scenarios that need another buffer than :data:`CONFIG`.
CONFIGS = {"abort_stale_inflight": WINDOWED}


def offered(surface: BufferSurface, name: str) -> tuple[bool, str]:
    """Whether ``surface`` offers operation ``name`` (any of its table columns), and if not, the table's reason."""
    if not surface.offers:
        return True, ""
    row = next(r for r in TABLE if r.name == name)
    offers = [row.on(column) for column in surface.offers]
    if any(o.offered for o in offers):
        return True, ""
    return False, "; ".join(o.why for o in offers)


def run_operation_scenarios(surface: BufferSurface, only: list[str] | None = None) -> dict[str, str]:
    """Run the scenario of every operation of the table (``only``: of these) on ``surface``, each on a
    fresh buffer; fail on the first that disagrees. Returns operation -> ``"driven"`` or
    ``"not offered: <the table's reason>"``."""
    missing = [row.name for row in TABLE if row.name not in SCENARIOS]
    assert not missing, f"operations without a scenario: {missing}"
    outcome: dict[str, str] = {}
    for row in TABLE:
        if only is not None and row.name not in only:
            continue
        offer, why = offered(surface, row.name)
        if not offer:
            outcome[row.name] = f"not offered: {why}"
            continue
        scene = Scene(surface, CONFIGS.get(row.name, CONFIG))
        try:
            SCENARIOS[row.name](scene)
        except Exception as exc:
            raise AssertionError(f"{surface.name}: the scenario of {row.name} failed: {exc!r}") from exc
        finally:
            scene.close()
        outcome[row.name] = "driven"
    return outcome
