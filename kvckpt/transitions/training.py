"""The training side's transitions: select a batch (or claim named groups, or release claims),
finish a step, evict, re-stamp (promote)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvckpt.errors import BadArgument, InvariantViolation
from kvckpt.tables.access import Tables
from kvckpt.tables.records import CLAIMED, CONSUMED, EVICTED, READY, GroupInfo, Selection
from kvckpt.tables.view import BufferView
from kvckpt.transitions.config import BufferConfig


def select(t: Tables, config: BufferConfig, min_groups: int, max_groups: int) -> Selection:
    """Claim the sampler's choice of ready groups for the current step (nothing, below ``min_groups``).

    Raises:
        InvariantViolation: the sampler chose a group that is not ready.
    """
    st = t.state()
    chosen = t.resolve(config.sampler.select(BufferView(t.txn), st["trainer_version"], min_groups, max_groups))
    for group in chosen:
        if group.state != READY:
            raise InvariantViolation(f"sampler chose group {group.group_id!r} in state {group.state}")
    return _claim(t, st, chosen)


def claim(t: Tables, group_ids: Iterable[str]) -> Selection:
    """Claim exactly the named ready groups for the current step (a caller's choice instead of the
    sampler's), all or none.

    Raises:
        BadArgument: a named group is not ready (nothing is claimed then).
    """
    chosen = []
    for gid in dict.fromkeys(group_ids):
        group = t.group(gid)
        if group is None or group.state != READY:
            raise BadArgument(f"group {gid!r} is {'unknown' if group is None else group.state}, not ready: only "
                              "ready groups can be claimed; nothing was claimed")
        chosen.append(group)
    return _claim(t, t.state(), chosen)


def _claim(t: Tables, st: dict[str, Any], ready: list[GroupInfo]) -> Selection:
    """Ready groups -> claimed by the current step, with the counts (``st`` is the state record)."""
    step = st["trainer_version"]
    claimed = []
    for group in ready:
        new = GroupInfo.from_dict({**group.to_dict(), "state": CLAIMED, "claimed_step": step})
        t.put_group(new, was=group)
        claimed.append(new)
    if claimed:
        st["ready"] -= len(claimed)
        st["claimed"] += len(claimed)
        st["counters"]["selected"] += len(claimed)
        t.put_state(st)
    return Selection(step, tuple(claimed))


def release(t: Tables, group_ids: Iterable[str]) -> list[str]:
    """Hand claims of the current step back: the named claimed groups -> ready, stamps untouched
    (the rollback of a batch that was claimed but never trained), all or none.

    Raises:
        BadArgument: a named group is not claimed by the current step (nothing is released then).
    """
    st = t.state()
    gids = list(dict.fromkeys(group_ids))
    for gid in gids:
        group = t.group(gid)
        if group is None or group.state != CLAIMED or group.claimed_step != st["trainer_version"]:
            where = "unknown" if group is None else f"{group.state} (claimed_step {group.claimed_step})"
            raise BadArgument(f"group {gid!r} is {where}, not claimed by the current step "
                              f"{st['trainer_version']}; nothing was released")
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "state": READY, "claimed_step": None}), was=group)
    if gids:
        st["ready"] += len(gids)
        st["claimed"] -= len(gids)
        t.put_state(st)
    return gids


def finish_step(t: Tables, config: BufferConfig, weight_version: int | None) -> int:
    """Claimed -> consumed, ``trainer_version`` + 1, the rollout weight follows (or is
    ``weight_version``), and rows no longer needed by a kept checkpoint are dropped; returns the new
    trainer version."""
    st = t.state()
    step = st["trainer_version"]
    gids = t.claimed_at(step)
    for group in t.resolve(gids):
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "state": CONSUMED, "consumed_step": step}), was=group)
    st["claimed"] -= len(gids)
    st["counters"]["consumed"] += len(gids)
    st["trainer_version"] = step + 1
    st["weight_version"] = step + 1 if weight_version is None else int(weight_version)
    _drop_consumed(t, config, st)
    t.put_state(st)
    return st["trainer_version"]


def _drop_consumed(t: Tables, config: BufferConfig, st: dict[str, Any]) -> None:
    """Drop rows of groups consumed before the oldest kept durable checkpoint."""
    if config.retain_consumed or len(st["durable"]) < config.durable_checkpoints:
        return
    floor = st["durable"][-config.durable_checkpoints]
    if floor <= st["drop_floor"]:
        return
    for group in t.resolve(t.consumed_before(floor)):
        t.delete_rows(group.group_id)
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "rows_stored": False}), was=group)
    st["drop_floor"] = floor


def evict(t: Tables, config: BufferConfig, group_ids: Iterable[str] | None) -> list[str]:
    """Ready groups -> evicted, rows deleted: the sampler's out-of-window choice, or exactly
    ``group_ids`` (a deliberate discard).

    Raises:
        BadArgument: a named group is not ready (nothing is evicted then).
    """
    st = t.state()
    if group_ids is None:
        gids = list(config.sampler.evictable(BufferView(t.txn), st["trainer_version"]))
        reason = f"outside {config.sampler.name} window at version {st['trainer_version']}"
    else:
        gids, reason = list(dict.fromkeys(group_ids)), "discarded by the caller"
        for gid in gids:
            group = t.group(gid)
            if group is None or group.state != READY:
                raise BadArgument(f"group {gid!r} is {'unknown' if group is None else group.state}, "
                                  "not ready: only ready groups can be evicted")
    for group in t.resolve(gids):
        t.delete_rows(group.group_id)
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "state": EVICTED, "rows_stored": False,
                                         "reason": reason}), was=group)
    if gids:
        st["ready"] -= len(gids)
        st["counters"]["evicted"] += len(gids)
        t.put_state(st)
    return gids


def promote(t: Tables, to_target_step: int) -> int | None:
    """Re-stamp the ready group with the largest later ``target_step`` onto ``to_target_step``;
    returns the lender's step, or ``None`` if no later ready group exists."""
    latest = t.latest_target()
    if latest is None or latest[0] <= to_target_step:
        return None
    lender, gid = latest
    [group] = t.resolve([gid])
    t.put_group(GroupInfo.from_dict({**group.to_dict(), "target_step": int(to_target_step)}), was=group)
    return lender
