"""Transitions of in-flight prompts: hand one to a new attempt, or give up on some."""

from __future__ import annotations

from kvckpt.errors import UnknownGroup
from kvckpt.tables.access import Tables
from kvckpt.tables.records import ABORTED, GroupInfo, Lease, LedgerEntry
from kvckpt.tables.view import BufferView
from kvckpt.transitions.config import BufferConfig


def redispatch(t: Tables, store_id: str, group_id: str, start_weight: int | None, holder: str | None = None) -> Lease:
    """The entry's ``attempt`` + 1 on the current timeline (fencing the old lease), ``holder`` as
    its holder (``None``: none recorded) and, if given, a new ``start_weight``; committed siblings
    are kept. Returns the new lease. An entry a recovery
    forked (``lineage_fork``: it kept work of weights the rollback destroyed) keeps its stamp:
    that work is its stalest part, and a stamp at or below the fork would break the lineage rule.

    Raises:
        UnknownGroup: no ledger entry for ``group_id``.
    """
    entry = t.entry(group_id)
    if entry is None:
        raise UnknownGroup(f"group {group_id!r} is not in flight; nothing to redispatch")
    st = t.state()
    lease = _bump(t, st, store_id, entry, start_weight, holder)
    t.put_state(st)
    return lease


def held_by(t: Tables, store_id: str, holder: str) -> list[Lease]:
    """The current lease of every in-flight prompt whose entry records ``holder``, in dispatch order."""
    return [e.lease(store_id) for e in t.entries() if e.holder == holder]


def redispatch_held_by(t: Tables, store_id: str, holder: str, to: str | None, start_weight: int | None) -> list[Lease]:
    """:func:`redispatch` of every in-flight prompt ``holder`` holds, to the holder ``to``: the new
    leases, in dispatch order (none if it holds nothing)."""
    st = t.state()
    leases = [_bump(t, st, store_id, e, start_weight, to) for e in t.entries() if e.holder == holder]
    t.put_state(st)
    return leases


def _bump(t: Tables, st: dict, store_id: str, entry: LedgerEntry, start_weight: int | None,
          holder: str | None) -> Lease:
    """One entry's redispatch (``st`` is put by the caller)."""
    new = LedgerEntry.from_dict({
        **entry.to_dict(), "attempt": entry.attempt + 1, "timeline": st["timeline"], "holder": holder,
        "start_weight": entry.start_weight if start_weight is None or entry.lineage_fork is not None
        else start_weight})
    t.replace_entry(new, was=entry)
    st["counters"]["redispatched"] += 1
    return new.lease(store_id)


def abort(t: Tables, group_ids: list[str], reason: str) -> None:
    """Ledger entries -> aborted tombstones with ``reason`` (keeping the entry's stamp and
    ``lineage_fork``), their partial rows and token progress deleted, and
    ``batch_shortfall[target_step]`` credited.

    Raises:
        UnknownGroup: a group is not in flight.
    """
    st = t.state()
    shortfall = t.shortfall()
    for gid in group_ids:
        entry = t.entry(gid)
        if entry is None:
            raise UnknownGroup(f"group {gid!r} is not in flight; nothing to abort")
        t.remove_entry(entry)
        t.delete_rows(gid)
        t.delete_progress(gid)
        t.put_group(GroupInfo(
            gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size,
            ABORTED, entry.start_weight, -1, entry.target_step, entry.attempt, "", rows_stored=False,
            reason=reason, timeline=entry.timeline, lineage_fork=entry.lineage_fork))
        if entry.target_step is not None:
            shortfall[str(entry.target_step)] = shortfall.get(str(entry.target_step), 0) + 1
    st["inflight"] -= len(group_ids)
    st["counters"]["aborted"] += len(group_ids)
    t.put_shortfall(shortfall)
    t.put_state(st)


def abort_stale(t: Tables, config: BufferConfig) -> list[str]:
    """Abort every in-flight prompt the sampler says is useless now; returns their ids."""
    st = t.state()
    gids = list(config.sampler.inflight_to_abort(BufferView(t.txn), st["trainer_version"]))
    if gids:
        abort(t, gids, f"stale at version {st['trainer_version']}")
    return gids
