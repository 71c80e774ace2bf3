"""A conformance suite for samplers: the contract of :class:`kvckpt.Sampler`, checked on a real store.

A custom sampler (see :mod:`kvckpt.samplers.base`) runs it from its own tests::

    from kvckpt.testing.conformance.samplers import assert_sampler_conforms

    def test_my_sampler_conforms(tmp_path):
        assert_sampler_conforms(MySampler(window=2), str(tmp_path))

Each check is also a plain function (:data:`CHECKS`, each ``check(sampler, directory) -> list[str]``,
empty when it holds) to parametrize over. They drive a real :class:`~kvckpt.ReplayBuffer` through a
seeded scenario (admissions, commits, selections, finished steps, evictions, aborts; some prompts
left in flight) and, at every step, query the sampler on a read-only view of the store at the
trainer's version and a few versions ahead:

* :func:`check_config_round_trip`: ``config()`` names the sampler, ``create_sampler(config())`` gives
  an equal config, and a store created with it reopens (a fresh handle) with the same config;
* :func:`check_view_read_only`: the sampler keeps no handle (no view, transaction, store or buffer
  among its attributes) and answers on a read-only transaction without writing;
* :func:`check_selects_ready_only`: ``eligible`` and ``select`` yield ready groups only, each once;
  ``select`` honours ``min_groups``/``max_groups`` and refuses ``min > max``; the buffer's own
  ``select`` claims only groups that were ready;
* :func:`check_evict_abort_consistent`: ``evictable`` yields ready groups none of which is eligible
  at that version or any later one checked, ``inflight_to_abort`` yields exactly the in-flight groups
  for which ``should_abort_inflight`` holds, and ``window``/``gate_window`` are integers >= 0
  (``gate_window`` may be ``None``);
* :func:`check_capacity_refuses_deadlock`: ``required_buffer_capacity`` is at least a step's
  groups, ``check_capacity`` refuses with :class:`~kvckpt.errors.CapacityError` exactly below it
  (and so does creating a store), and at exactly that capacity a synchronous rollout pump trains
  every step without getting stuck.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

from kvckpt import (
    BadArgument,
    BufferConfig,
    CapacityError,
    GateTimeout,
    KvckptError,
    Prompt,
    ReplayBuffer,
    Sampler,
    Store,
    UnknownGroup,
    create_sampler,
)
from kvckpt.samplers import BufferView
from kvckpt.storage.store import Txn
from kvckpt.testing.campaigns.workload import SCHEMA, make_row

_GROUP_SIZE = 2
GROUPS_PER_STEP = 2
_STEPS = 10


def _config(sampler: Sampler, capacity: int | None = None) -> BufferConfig:
    need = sampler.required_buffer_capacity(GROUPS_PER_STEP)
    return BufferConfig(group_size=_GROUP_SIZE, schema=SCHEMA, sampler=sampler, groups_per_step=GROUPS_PER_STEP,
                        max_buffered_rollouts=max(64, need) if capacity is None else capacity, wait_timeout=0)


def _commit(buf: ReplayBuffer, lease: Any) -> None:
    with contextlib.suppress(UnknownGroup):  # aborted meanwhile
        buf.commit_group(lease, {i: make_row(lease.group_id, i) for i in lease.missing})


def _admit(buf: ReplayBuffer, cursor: int) -> list[Any]:
    """Admit one step's prompts when the gate and the capacity allow it, else nothing."""
    if not buf.admissible(GROUPS_PER_STEP):
        return []
    with contextlib.suppress(GateTimeout):
        return buf.admit([Prompt(cursor + j) for j in range(GROUPS_PER_STEP)],
                         dataloader_state=str(cursor + GROUPS_PER_STEP).encode(), timeout=0)
    return []


def scenario(sampler: Sampler, path: str, seed: int = 0) -> Iterator[ReplayBuffer]:
    """A store at ``path`` under ``sampler``, driven through a seeded run; yields the buffer after
    every step (groups ready, claimed, consumed, evicted and aborted, prompts left in flight)."""
    rng = random.Random(seed)
    with ReplayBuffer.create(path, _config(sampler)) as buf:
        cursor = 0
        for step in range(_STEPS):
            leases = _admit(buf, cursor)
            cursor += len(leases)
            for lease in leases:
                if rng.random() < 0.75:  # the rest stay in flight
                    _commit(buf, lease)
            if step % 4 == 3 and (entries := buf.ledger()):
                buf.abort(rng.choice(entries).group_id, "conformance")
            yield buf
            if rng.random() < 0.6:
                buf.select(1, GROUPS_PER_STEP)
            buf.finish_step()
            if step % 3 == 2:
                buf.evict()
            buf.abort_stale_inflight()
        yield buf


def _versions(sampler: Sampler, current: int) -> list[int]:
    return sorted({current, current + 1, current + 2, current + sampler.window + 1})


def _views(sampler: Sampler, directory: str) -> Iterator[tuple[ReplayBuffer, BufferView, int]]:
    """(buffer, read-only view, version) at every step of the scenario and version checked."""
    for buf in scenario(sampler, os.path.join(directory, "conformance.kv")):
        with buf.store.reader() as txn:
            view = BufferView(txn)
            for current in _versions(sampler, buf.trainer_version):
                yield buf, view, current


def _behaviour(sampler: Sampler) -> tuple[Any, ...]:
    """What a sampler is, beyond its config: its class, windows and attributes."""
    return type(sampler).__name__, sampler.window, sampler.gate_window, sampler.stamps_target_step, vars(sampler)


def check_config_round_trip(sampler: Sampler, directory: str) -> list[str]:
    """``config()`` names the sampler and re-creates it; a store created with it reopens with it."""
    found = []
    config = sampler.config()
    if config.get("name") != sampler.name:
        found.append(f"config() names {config.get('name')!r}, the sampler is {sampler.name!r}")
    try:
        again = create_sampler(config)
    except KvckptError as exc:
        return [*found, f"create_sampler(config()) refused {config!r} (is the class registered with "
                        f"kvckpt.samplers.register?): {exc}"]
    if again.config() != config:
        found.append(f"create_sampler(config()) gives config {again.config()!r}, not {config!r}")
    if _behaviour(again) != _behaviour(sampler):
        found.append(f"create_sampler(config()) gives another sampler: {_behaviour(again)} instead of "
                     f"{_behaviour(sampler)} (config() leaves out a constructor argument?)")
    path = os.path.join(directory, "round-trip.kv")
    ReplayBuffer.create(path, _config(sampler)).close()
    with ReplayBuffer.open(path) as buf:
        if buf.sampler.config() != config or _behaviour(buf.sampler) != _behaviour(sampler):
            found.append(f"a reopened store's sampler is {_behaviour(buf.sampler)}, not {_behaviour(sampler)}")
    return found


def check_view_read_only(sampler: Sampler, directory: str) -> list[str]:
    """The sampler keeps no handle and answers every query on a read-only transaction."""
    found = []
    for _buf, view, current in _views(sampler, directory):
        try:
            list(sampler.eligible(view, current))
            list(sampler.evictable(view, current))
            list(sampler.inflight_to_abort(view, current))
            sampler.select(view, current, 1, GROUPS_PER_STEP)
        except Exception as exc:  # a write through a read-only transaction lands here too
            found.append(f"at version {current}: a query on a read-only view raised {type(exc).__name__}: {exc}")
        handles = (BufferView, Txn, Store, ReplayBuffer)
        held = [name for name, value in vars(sampler).items() if isinstance(value, handles)]
        if held:
            found.append(f"the sampler keeps a handle after a query: attribute(s) {held}")
        if found:
            return found
    return found


def check_selects_ready_only(sampler: Sampler, directory: str) -> list[str]:
    """``eligible`` and ``select`` yield ready groups only, each once, within ``min``/``max``."""
    found = []
    for buf, view, current in _views(sampler, directory):
        ready = {g.group_id for g in buf.groups(["ready"])}
        eligible = list(sampler.eligible(view, current))
        if set(eligible) - ready:
            found.append(f"at version {current}: eligible yields groups that are not ready: "
                         f"{sorted(set(eligible) - ready)[:5]}")
        if len(eligible) != len(set(eligible)):
            found.append(f"at version {current}: eligible yields a group twice: {eligible}")
        for lo, hi in ((1, 1), (1, GROUPS_PER_STEP), (GROUPS_PER_STEP, GROUPS_PER_STEP), (len(ready) + 1,) * 2):
            chosen = sampler.select(view, current, lo, hi)
            if (chosen and not lo <= len(chosen) <= hi) or len(chosen) != len(set(chosen)) or set(chosen) - ready:
                found.append(f"at version {current}: select(min={lo}, max={hi}) returned {chosen} "
                             f"(ready: {sorted(ready)})")
        try:
            sampler.select(view, current, 2, 1)
            found.append("select(min_groups=2, max_groups=1) did not refuse")
        except BadArgument:
            pass
        if found:
            return found
    for buf in scenario(sampler, os.path.join(directory, "claims.kv"), seed=1):
        ready = {g.group_id for g in buf.groups(["ready"])}
        claimed = buf.select(1, GROUPS_PER_STEP).group_ids
        if set(claimed) - ready:
            return [f"the buffer's select under this sampler claimed groups that were not ready: "
                    f"{sorted(set(claimed) - ready)}"]
    return found


def check_evict_abort_consistent(sampler: Sampler, directory: str) -> list[str]:
    """``evictable`` never names a group the sampler could still select; ``inflight_to_abort``
    agrees with ``should_abort_inflight``; the windows are integers >= 0."""
    found = []
    for name in ("window", "gate_window"):
        value = getattr(sampler, name)
        if not (value is None and name == "gate_window") and not (isinstance(value, int) and value >= 0):
            found.append(f"{name} is {value!r}, not an integer >= 0")
    for buf, view, current in _views(sampler, directory):
        ready = {g.group_id for g in buf.groups(["ready"])}
        evictable = set(sampler.evictable(view, current))
        if evictable - ready:
            found.append(f"at version {current}: evictable yields groups that are not ready: "
                         f"{sorted(evictable - ready)[:5]}")
        for later in _versions(sampler, current):
            if selectable := evictable & set(sampler.eligible(view, later)):
                found.append(f"evictable at version {current} but eligible at {later}: {sorted(selectable)[:5]}")
        expected = {e.group_id for e in buf.ledger() if sampler.should_abort_inflight(e.lineage_weight, current)}
        got = list(sampler.inflight_to_abort(view, current))
        if set(got) != expected or len(got) != len(set(got)):
            found.append(f"at version {current}: inflight_to_abort yields {sorted(got)}, but should_abort_inflight "
                         f"holds for the in-flight groups {sorted(expected)}")
        if found:
            return found
    return found


def check_capacity_refuses_deadlock(sampler: Sampler, directory: str) -> list[str]:
    """The capacity check refuses exactly below ``required_buffer_capacity``, and at that capacity a
    synchronous pump (admit when allowed, commit everything, train a full step) never gets stuck."""
    need = sampler.required_buffer_capacity(GROUPS_PER_STEP)
    found = []
    if need < GROUPS_PER_STEP:
        found.append(f"required_buffer_capacity({GROUPS_PER_STEP}) is {need}: a step's groups do not fit")
    for capacity, refused in ((need, False), (need - 1, True)):
        try:
            sampler.check_capacity(capacity, GROUPS_PER_STEP)
            ok = not refused
        except CapacityError:
            ok = refused
        if not ok:
            found.append(f"check_capacity({capacity}, {GROUPS_PER_STEP}) {'passed' if refused else 'refused'}, "
                         f"required_buffer_capacity is {need}")
    if need > 1:
        try:
            _config(sampler, capacity=need - 1)
            found.append(f"a store with capacity {need - 1} < {need} was accepted")
        except CapacityError:
            pass
    try:
        sampler.required_buffer_capacity(0)
        found.append("required_buffer_capacity(0) did not refuse")
    except BadArgument:
        pass
    if need >= 1:
        found.extend(_pump(sampler, need, os.path.join(directory, "pump.kv")))
    return found


def _pump(sampler: Sampler, capacity: int, path: str) -> list[str]:
    """Train ``_STEPS`` full steps at ``capacity``; a round that admits, selects, evicts and aborts
    nothing is a deadlock."""
    with ReplayBuffer.create(path, _config(sampler, capacity)) as buf:
        cursor = 0
        for step in range(_STEPS):
            for _round in range(4 * (sampler.window + 2)):
                leases = _admit(buf, cursor)
                cursor += len(leases)
                for lease in leases:
                    _commit(buf, lease)
                if buf.select(GROUPS_PER_STEP, GROUPS_PER_STEP):
                    buf.finish_step()
                    break
                if not (leases or buf.evict() or buf.abort_stale_inflight()):
                    buf.finish_step()  # the trainer moves on without a batch (NeMo-RL skips a step)
            else:
                return [f"deadlock at capacity {capacity}: step {step} never got {GROUPS_PER_STEP} groups "
                        f"(stats {buf.stats()})"]
    return []


#: Every check of the suite, in the order :func:`assert_sampler_conforms` runs them.
CHECKS: tuple[Callable[[Sampler, str], list[str]], ...] = (
    check_config_round_trip, check_view_read_only, check_selects_ready_only, check_evict_abort_consistent,
    check_capacity_refuses_deadlock)


def run_sampler_conformance(sampler: Sampler, directory: str) -> list[str]:
    """Every failure of ``sampler`` against :data:`CHECKS` (each in its own subdirectory of
    ``directory``), as ``"check_name: message"``; empty when it conforms. A check that raises (the
    buffer refusing what the sampler chose, e.g. :class:`~kvckpt.errors.InvariantViolation` for a
    group that is not ready) counts as that check's failure."""
    found = []
    for check in CHECKS:
        sub = os.path.join(directory, check.__name__)
        os.makedirs(sub, exist_ok=True)
        try:
            found.extend(f"{check.__name__}: {message}" for message in check(sampler, sub))
        except Exception as exc:
            found.append(f"{check.__name__}: raised {type(exc).__name__}: {exc}")
    return found


def assert_sampler_conforms(sampler: Sampler, directory: str) -> None:
    """Raise ``AssertionError`` listing every failure of :func:`run_sampler_conformance`."""
    found = run_sampler_conformance(sampler, directory)
    assert not found, f"{sampler!r} breaks the sampler contract:\n" + "\n".join(found)
