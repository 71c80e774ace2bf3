"""Fencing: whether a lease may still commit.

A commit is accepted only when the lease's store id, timeline and attempt are exactly those of
the group's ledger entry (or, for a retried commit, of the committed group), and when its
description of the group (size, prompt, stamps) is the ledger entry's: the entry is the only
authority. Each refusal names what differs (``StaleAttempt.differs``).
"""

from __future__ import annotations

from typing import Any

from kvckpt.errors import AbandonedTimeline, BadArgument, ForeignLease, LeaseMismatch, StaleAttempt
from kvckpt.tables.records import Lease, LedgerEntry

#: The lease fields the ledger entry is the authority on.
LEASE_AUTHORITY = ("group_size", "prompt_idx", "task_name", "admission_id", "target_step", "start_weight")


def check_lease(lease: Any, group_size: int) -> None:
    """What can be refused before encoding: not a lease, or a group size the store does not have."""
    if not isinstance(lease, Lease):
        raise BadArgument(f"commits take a Lease (from admit, redispatch or a recovery plan; Lease.from_dict "
                          f"for one sent over the wire), got {type(lease).__name__}")
    if lease.group_size != group_size:
        raise LeaseMismatch(f"commit of group {lease.group_id!r} refused: the lease says group_size="
                            f"{lease.group_size!r} but this store's groups have {group_size} rows; "
                            "nothing was written", "group_size")


def fence(lease: Lease, store_id: str, timeline: str, attempt: int, where: str, what: str = "commit") -> None:
    """Refuse ``lease`` unless its store id, timeline and attempt are exactly the current ones
    (``what`` names the refused operation in the message)."""
    gid = lease.group_id
    if lease.store_id != store_id:
        issued = f"store {lease.store_id}" if lease.store_id else "a kvckpt that issued no store id"
        raise ForeignLease(f"{what} of group {gid!r} refused: the lease was issued by {issued}, not by this "
                           f"store ({store_id}); nothing was written")
    if lease.timeline != timeline:
        raise AbandonedTimeline(
            f"{what} of group {gid!r} refused: the lease belongs to timeline {lease.timeline or '(none)'}, but the "
            f"group is {where} on timeline {timeline} (a restore or recovery came after the lease was issued: "
            "this worker is a zombie); nothing was written")
    if lease.attempt != attempt:
        older = "older than" if lease.attempt < attempt else "newer than"
        raise StaleAttempt(f"{what} of group {gid!r} under attempt {lease.attempt} refused: it is {older} the "
                           f"current attempt {attempt} (the lease was fenced by a redispatch); nothing was written")


def check_against_entry(lease: Lease, entry: LedgerEntry, what: str = "commit") -> None:
    """Refuse a lease whose description of the group differs from its ledger entry's."""
    for name in LEASE_AUTHORITY:
        if getattr(lease, name) != getattr(entry, name):
            raise LeaseMismatch(f"{what} of group {lease.group_id!r} refused: the lease says {name}="
                                f"{getattr(lease, name)!r} but the ledger entry holds {getattr(entry, name)!r}; "
                                "nothing was written", name)
