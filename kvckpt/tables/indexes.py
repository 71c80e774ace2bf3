"""Which ``index`` entries a record owns: the one definition the writer and the verifier share.

Every index value is the group id it points to; keys sort by number, then by ``seq`` (dispatch
order). A group record owns, by state:

* ``ready``: ``READY_BY_SEQ``, ``READY_BY_WEIGHT`` (its lineage weight) and, when stamped,
  ``READY_BY_TARGET`` (its ``target_step``);
* ``claimed``: ``CLAIMED_BY_STEP`` at its ``claimed_step``;
* ``consumed`` with rows still stored: ``CONSUMED_BY_STEP`` at its ``consumed_step``;
* anything else: nothing.

A ledger entry owns ``PENDING_BY_WEIGHT`` at its lineage weight.

The weight indexes key on the *lineage weight* (:func:`kvckpt.tables.records.lineage_weight`):
``start_weight`` itself for a record on the trained lineage (every record before a recovery
rolled the weights back, so formats 1 to 4 index as they always did), ``2f - start_weight`` for
one a recovery to version ``f`` left on a destroyed lineage. Every sampler's window reads these
indexes, so each one counts a destroyed lineage's staleness as the distance in the version tree.
"""

from __future__ import annotations

from kvckpt.storage import keys
from kvckpt.tables.records import CLAIMED, CONSUMED, READY, GroupInfo, LedgerEntry


def group_index_keys(state: str, seq: int, start_weight: int, target_step: int | None = None,
                     claimed_step: int | None = None, consumed_step: int | None = None,
                     rows_stored: bool = True) -> list[bytes]:
    """The index keys a group record with these fields owns (plain values, so the verifier can ask
    about records it has not trusted yet; ``start_weight`` is the record's lineage weight)."""
    if state == READY:
        owned = [keys.index_key(keys.READY_BY_SEQ, None, seq), keys.index_key(keys.READY_BY_WEIGHT, start_weight, seq)]
        if target_step is not None:
            owned.append(keys.index_key(keys.READY_BY_TARGET, target_step, seq))
        return owned
    if state == CLAIMED:
        return [keys.index_key(keys.CLAIMED_BY_STEP, claimed_step, seq)]
    if state == CONSUMED and rows_stored:
        return [keys.index_key(keys.CONSUMED_BY_STEP, consumed_step, seq)]
    return []


def entry_index_key(start_weight: int, seq: int) -> bytes:
    """The index key a ledger entry with these fields owns (plain values, for the verifier too;
    ``start_weight`` is the entry's lineage weight)."""
    return keys.index_key(keys.PENDING_BY_WEIGHT, start_weight, seq)


def keys_of_group(group: GroupInfo) -> list[bytes]:
    """The index keys ``group`` owns."""
    return group_index_keys(group.state, group.seq, group.lineage_weight, group.target_step, group.claimed_step,
                            group.consumed_step, group.rows_stored)


def key_of_entry(entry: LedgerEntry) -> bytes:
    """The index key a ledger entry owns."""
    return entry_index_key(entry.lineage_weight, entry.seq)
