"""Commits: rows arrive under a lease; the group becomes ready in the transaction that completes it.

:func:`commit` is the whole transition: fence the lease against the ledger entry, hold each row
against its sample's durable token progress and delete that progress
(:func:`kvckpt.transitions.progress.consume`), pin first-seen shapes, put the rows, then either
record the sibling progress in the entry (a partial group) or delete the entry and write the ready
group with its indexes. The group's ``start_weight`` stamp is the oldest of its entry's and of
every consumed progress token's weight version; its ``lineage_newest`` the newest of the entry's,
every consumed progress token's version and an ``end_weight`` passed to the commit (kept only when
newer than the stamp), and it inherits the entry's ``lineage_fork``, whose ``lineage_newest`` a
commit never raises (work done after the fork is on the trained lineage). A
lease with no ledger entry is a retried commit: :func:`replayed` answers it from the committed group without writing.
"""

from __future__ import annotations

from kvckpt.errors import DuplicateCommit, UnknownGroup
from kvckpt.storage import codec, keys
from kvckpt.storage.encoding import CheckedRow
from kvckpt.storage.schema import RowSchema
from kvckpt.tables.access import Tables
from kvckpt.tables.digest import group_digest, row_digest
from kvckpt.tables.records import ABORTED, EVICTED, READY, CommitResult, GroupInfo, Lease, LedgerEntry
from kvckpt.transitions.fencing import check_against_entry, fence
from kvckpt.transitions.progress import consume


def commit(t: Tables, schema: RowSchema, store_id: str, lease: Lease, encoded: list[CheckedRow],
           end_weight: int | None, whole: bool) -> CommitResult:
    """Commit ``encoded`` rows under ``lease``: the whole group (``whole``) or one row at a time.

    Raises:
        StaleAttempt (or a subclass): the lease is fenced. LeaseMismatch: it disagrees with its entry.
        DuplicateCommit: a row or the group is already committed with other content.
        UnknownGroup: the group is neither in flight nor committed.
        SchemaMismatch: a shape differs from the store's pins.
        BadArgument: a row's completion does not begin with its sample's durable token progress.
    """
    gid = lease.group_id
    entry = t.entry(gid)
    digests = {str(r.index): row_digest(r.value) for r in encoded}
    if entry is None:
        return replayed(t, store_id, lease, digests)
    fence(lease, store_id, entry.timeline, entry.attempt, "in flight")
    check_against_entry(lease, entry)
    siblings = set(entry.siblings)
    merged = dict(entry.digests)
    if not whole:
        for r in encoded:
            if r.index in siblings:
                if merged.get(str(r.index)) == digests[str(r.index)]:
                    return CommitResult(gid, ready=False, replayed=True)
                raise DuplicateCommit(f"row {keys.row_id(gid, r.index)} is already committed with other content")
    spans = [span for r in encoded if (span := consume(t, schema, gid, r.index, r.value)) is not None]
    oldest = [w for w in (entry.token_weight, *(lo for lo, _ in spans)) if w is not None]
    token_weight = min(oldest) if oldest else None
    newest = _newest(entry, [hi for _, hi in spans] + ([] if end_weight is None else [int(end_weight)]))
    _pin_shapes(t, schema, encoded)
    st = t.state()
    raw, stored = entry.raw_bytes, entry.stored_bytes
    for r in encoded:
        if r.index in siblings:  # a whole commit regenerated a kept sibling: it replaces it
            old = t.row(gid, r.index)
            raw -= codec.decode(old, f"rows/{keys.row_id(gid, r.index)}").nbytes
            stored -= len(old)
        t.put_row(gid, r.index, r.value)
        raw += r.raw_bytes
        stored += len(r.value)
    st["counters"]["raw_bytes"] += raw - entry.raw_bytes
    st["counters"]["stored_bytes"] += stored - entry.stored_bytes
    merged.update(digests)
    siblings.update(r.index for r in encoded)
    if not whole:
        st["counters"]["samples_committed"] += len(encoded)
    if len(siblings) < entry.group_size:
        t.replace_entry(LedgerEntry.from_dict({
            **entry.to_dict(), "siblings": tuple(sorted(siblings)), "digests": merged,
            "raw_bytes": raw, "stored_bytes": stored, "token_weight": token_weight,
            "lineage_newest": _above(newest, entry.start_weight)}), was=entry)
        t.put_state(st)
        return CommitResult(gid, ready=False, rows_written=len(encoded))
    start = _stamp(entry, token_weight)
    group = GroupInfo(
        gid, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, entry.group_size, READY,
        start, st["weight_version"] if end_weight is None else int(end_weight),
        entry.target_step, entry.attempt, group_digest(merged[str(i)] for i in range(entry.group_size)),
        raw_bytes=raw, stored_bytes=stored, timeline=entry.timeline, lineage_fork=entry.lineage_fork,
        lineage_newest=_above(newest, start))
    t.remove_entry(entry)
    t.put_group(group)
    st["inflight"] -= 1
    st["ready"] += 1
    st["counters"]["committed"] += 1
    t.put_state(st)
    return CommitResult(gid, ready=True, rows_written=len(encoded))


def _stamp(entry: LedgerEntry, token_weight: int | None) -> int:
    """The group's ``start_weight``: the oldest of the entry's stamp and its tokens' versions; an
    entry a recovery forked keeps its stamp (the destroyed weights' work it kept is the stalest)."""
    if token_weight is None or entry.lineage_fork is not None:
        return entry.start_weight
    return min(entry.start_weight, token_weight)


def _newest(entry: LedgerEntry, versions: list[int]) -> int:
    """The newest weight version of the entry's work after a commit that brings ``versions`` (its
    consumed progress's newest and a given ``end_weight``); a forked entry's stays what the fork
    froze (later work is on the trained lineage, whose version numbers say nothing of the destroyed one)."""
    if entry.lineage_fork is not None:
        return entry.newest_weight
    return max([entry.newest_weight, *versions])


def _above(newest: int, start: int) -> int | None:
    """``lineage_newest`` as stored: only when newer than the stamp (else the record keeps its bytes)."""
    return newest if newest > start else None


def replayed(t: Tables, store_id: str, lease: Lease, digests: dict[str, str]) -> CommitResult:
    """A commit whose ledger entry is gone: the same content as the committed group is a replay
    (``replayed=True``, nothing written); anything else is refused."""
    gid = lease.group_id
    group = t.group(gid)
    if group is None:
        raise UnknownGroup(f"group {gid!r} is neither in flight nor committed in this store; nothing was written")
    if group.state in (EVICTED, ABORTED):
        raise UnknownGroup(f"group {gid!r} was {group.state} ({group.reason or 'no reason'}); "
                           "the commit was refused and wrote nothing")
    fence(lease, store_id, group.timeline, group.attempt, f"committed ({group.state})")
    if group.rows_stored:
        stored = {str(index): row_digest(value) for index, value in t.rows(gid)}
        if all(stored.get(i) == d for i, d in digests.items()):
            return CommitResult(gid, ready=True, replayed=True)
    raise DuplicateCommit(f"group {gid!r} is already committed ({group.state}) with other content; "
                          "nothing was written")


def _pin_shapes(t: Tables, schema: RowSchema, encoded: list[CheckedRow]) -> None:
    """Hold the rows' shapes against the store's pins; fields seen for the first time are pinned in
    this same transaction, so the pin and the rows that set it commit together."""
    new = schema.pin(t.shape_pins(), [(r.where, r.shapes) for r in encoded])
    if new is not None:
        t.put_shape_pins(new)
