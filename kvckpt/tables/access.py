"""Typed access to the buffer's tables inside one transaction: the one place that knows which key
holds which record, with index maintenance done where a record changes.

A :class:`Tables` wraps one :class:`~kvckpt.storage.store.Txn`. Writes go through it so a group's
or a ledger entry's index entries can never drift from the record: :meth:`Tables.put_group`
takes the record as it was and as it becomes, and moves exactly the index entries that differ;
:meth:`Tables.add_entry`, :meth:`Tables.replace_entry` and :meth:`Tables.remove_entry` do the
same for the ledger. Nothing here commits: the caller's transaction is the transition.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvckpt.errors import InvariantViolation
from kvckpt.storage import codec, keys
from kvckpt.storage.store import Txn
from kvckpt.tables import meta
from kvckpt.tables.indexes import key_of_entry, keys_of_group
from kvckpt.tables.records import CLAIMED, CONSUMED, GroupInfo, LedgerEntry


class Tables:
    """The buffer's records in one transaction (read-only when the transaction is)."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn

    # -- meta ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The state record (a fresh dict the caller may change and :meth:`put_state` back).

        Raises:
            InvariantViolation: the store has no state record.
        """
        st = self.txn.get_json("meta", meta.STATE_KEY)
        if st is None:
            raise InvariantViolation("meta/state is missing")
        return st

    def put_state(self, st: dict[str, Any]) -> None:
        """Write the state record."""
        self.txn.put_json("meta", meta.STATE_KEY, st)

    def config(self) -> dict[str, Any] | None:
        """The persisted buffer config (its JSON form), or ``None`` in a store without one."""
        return self.txn.get_json("meta", meta.CONFIG_KEY)

    def put_config(self, doc: dict[str, Any]) -> None:
        """Write the buffer config's JSON form."""
        self.txn.put_json("meta", meta.CONFIG_KEY, doc)

    def shortfall(self) -> dict[str, int]:
        """Prompts aborted per target step (``{"step": count}``)."""
        return self.txn.get_json("meta", meta.SHORTFALL_KEY) or {}

    def put_shortfall(self, doc: dict[str, int]) -> None:
        """Write the shortfall record."""
        self.txn.put_json("meta", meta.SHORTFALL_KEY, doc)

    def shape_pins(self) -> dict[str, Any]:
        """The shapes pinned per field (``{}`` before the first commit, or if the record is not a dict)."""
        pins = self.txn.get_json("meta", meta.SHAPES_KEY) or {}
        return pins if isinstance(pins, dict) else {}

    def put_shape_pins(self, pins: dict[str, Any]) -> None:
        """Write the shape pins."""
        self.txn.put_json("meta", meta.SHAPES_KEY, pins)

    def dataloader_state(self) -> bytes | None:
        """The dataloader state stored with the last admission, or ``None``."""
        value = self.txn.get("meta", meta.DATALOADER_KEY)
        return None if value is None else codec.decode(value, "meta/dataloader").arrays["state"].tobytes()

    def put_dataloader_state(self, dataloader_state: bytes | None) -> None:
        """Store the dataloader state (``None`` keeps the stored one)."""
        if dataloader_state is not None:
            self.txn.put("meta", meta.DATALOADER_KEY, codec.encode(
                {"state": np.frombuffer(bytes(dataloader_state), np.uint8)}, level=0))

    def stamp(self) -> dict[str, Any] | None:
        """The last checkpoint stamp, or ``None``."""
        return self.txn.get_json("meta", meta.STAMP_KEY)

    def put_stamp(self, doc: dict[str, Any]) -> None:
        """Write the checkpoint stamp."""
        self.txn.put_json("meta", meta.STAMP_KEY, doc)

    # -- groups ----------------------------------------------------------------------------------
    def group(self, group_id: str) -> GroupInfo | None:
        """A group's record (any state), or ``None``."""
        doc = self.txn.get_json("groups", keys.group_key(group_id))
        return None if doc is None else GroupInfo.from_dict(doc)

    def groups(self) -> list[GroupInfo]:
        """Every group record, in key order."""
        return [GroupInfo.from_dict(codec.decode_meta(v, f"groups/{k!r}"))
                for k, v in self.txn.iter_prefix("groups", b"")]

    def resolve(self, group_ids: Iterable[str]) -> list[GroupInfo]:
        """The records of groups an index named.

        Raises:
            InvariantViolation: an index names a group without a record.
        """
        found = []
        for gid in group_ids:
            group = self.group(gid)
            if group is None:
                raise InvariantViolation(f"index points to group {gid!r}, which has no record")
            found.append(group)
        return found

    def put_group(self, group: GroupInfo, *, was: GroupInfo | None = None) -> None:
        """Write ``group``'s record; its index entries move from those ``was`` owned to those it owns.

        Raises:
            InvariantViolation: an index entry ``was`` owns is missing.
        """
        old = keys_of_group(was) if was is not None else []
        new = keys_of_group(group)
        for key in old:
            if key not in new and not self.txn.delete("index", key):
                raise InvariantViolation(f"index entry {key[:2].decode()} of group {group.group_id!r} is missing")
        gid = group.group_id.encode()
        for key in new:
            if key not in old:
                self.txn.put("index", key, gid)
        self.txn.put_json("groups", keys.group_key(group.group_id), group.to_dict())

    def in_use(self, group_id: str) -> bool:
        """Whether ``group_id`` names a ledger entry or a group record."""
        gkey = keys.group_key(group_id)
        return self.txn.get("ledger", gkey) is not None or self.txn.get("groups", gkey) is not None

    # -- ledger ----------------------------------------------------------------------------------
    def entry(self, group_id: str) -> LedgerEntry | None:
        """The ledger entry of an in-flight prompt, or ``None``."""
        doc = self.txn.get_json("ledger", keys.group_key(group_id))
        return None if doc is None else LedgerEntry.from_dict(doc)

    def entries(self) -> list[LedgerEntry]:
        """Every ledger entry, in dispatch order."""
        found = [LedgerEntry.from_dict(codec.decode_meta(v, f"ledger/{k!r}"))
                 for k, v in self.txn.iter_prefix("ledger", b"")]
        return sorted(found, key=lambda e: e.seq)

    def add_entry(self, entry: LedgerEntry) -> None:
        """Write a new ledger entry and its index entry."""
        self.txn.put_json("ledger", keys.group_key(entry.group_id), entry.to_dict())
        self.txn.put("index", key_of_entry(entry), entry.group_id.encode())

    def replace_entry(self, entry: LedgerEntry, *, was: LedgerEntry) -> None:
        """Rewrite a ledger entry; its index entry follows a changed ``start_weight``."""
        if key_of_entry(was) != key_of_entry(entry):
            self.txn.delete("index", key_of_entry(was))
            self.txn.put("index", key_of_entry(entry), entry.group_id.encode())
        self.txn.put_json("ledger", keys.group_key(entry.group_id), entry.to_dict())

    def remove_entry(self, entry: LedgerEntry) -> None:
        """Delete a ledger entry and its index entry (its rows stay; see :meth:`delete_rows`)."""
        self.txn.delete("ledger", keys.group_key(entry.group_id))
        self.txn.delete("index", key_of_entry(entry))

    # -- rows ------------------------------------------------------------------------------------
    def row(self, group_id: str, index: int) -> bytes | None:
        """One stored row payload, or ``None``."""
        return self.txn.get("rows", keys.row_key(group_id, index))

    def put_row(self, group_id: str, index: int, value: bytes) -> None:
        """Store one row payload."""
        self.txn.put("rows", keys.row_key(group_id, index), value)

    def rows(self, group_id: str) -> Iterator[tuple[int, bytes]]:
        """``(row index, payload)`` of every stored row of a group, by index."""
        for key, value in self.txn.iter_prefix("rows", keys.row_prefix(group_id)):
            yield int.from_bytes(key[-4:], "big"), value

    def delete_rows(self, group_id: str) -> int:
        """Delete every stored row of a group; returns how many there were."""
        return self.txn.delete_prefix("rows", keys.row_prefix(group_id))

    # -- token progress (format 4) -------------------------------------------------------------------
    def progress_chunks(self, group_id: str, index: int | None = None) -> Iterator[tuple[int, int, bytes]]:
        """``(row index, start, stored chunk)`` of every progress chunk of a group (or of its row
        ``index``), by row index, then position."""
        prefix = keys.row_prefix(group_id) if index is None else keys.row_key(group_id, index)
        for key, value in self.txn.iter_prefix("progress", prefix):
            yield int.from_bytes(key[-12:-8], "big"), int.from_bytes(key[-8:], "big"), value

    def last_progress_chunk(self, group_id: str, index: int) -> tuple[int, bytes] | None:
        """``(start, stored chunk)`` of the last progress chunk of a sample, or ``None``."""
        return self.last_progress_chunk_of(keys.row_key(group_id, index))

    def last_progress_chunk_of(self, row: bytes) -> tuple[int, bytes] | None:
        """:meth:`last_progress_chunk` of the sample whose row key (``keys.row_key``) is ``row``."""
        found = self.txn.last("progress", row)
        return None if found is None else (int.from_bytes(found[0][-8:], "big"), found[1])

    def progress_chunk(self, group_id: str, index: int, start: int) -> bytes | None:
        """The progress chunk of a sample that begins at token ``start``, or ``None``."""
        return self.progress_chunk_of(keys.row_key(group_id, index), start)

    def progress_chunk_of(self, row: bytes, start: int) -> bytes | None:
        """:meth:`progress_chunk` of the sample whose row key (``keys.row_key``) is ``row``."""
        return self.txn.get("progress", keys.chunk_key(row, start))

    def put_progress_chunk(self, group_id: str, index: int, start: int, value: bytes) -> None:
        """Store one progress chunk."""
        self.put_progress_chunk_of(keys.row_key(group_id, index), start, value)

    def put_progress_chunk_of(self, row: bytes, start: int, value: bytes) -> None:
        """:meth:`put_progress_chunk` of the sample whose row key (``keys.row_key``) is ``row``."""
        self.txn.put("progress", keys.chunk_key(row, start), value)

    def delete_progress(self, group_id: str, index: int | None = None) -> int:
        """Delete the progress of a group (or of its row ``index``); returns how many chunks there were."""
        prefix = keys.row_prefix(group_id) if index is None else keys.row_key(group_id, index)
        return self.txn.delete_prefix("progress", prefix)

    # -- index queries the transitions need (samplers use :class:`~kvckpt.tables.view.BufferView`) -
    def claimed_at(self, step: int) -> list[str]:
        """Groups claimed by training step ``step``, in dispatch order."""
        prefix = keys.CLAIMED_BY_STEP + keys.i64(step)
        return [gid.decode() for _, gid in self.txn.iter_prefix("index", prefix)]

    def consumed_before(self, step: int) -> list[str]:
        """Consumed groups with rows still stored, consumed at a step ``< step``."""
        stop = keys.CONSUMED_BY_STEP + keys.i64(step)
        return [gid.decode() for key, gid in self.txn.iter_prefix("index", keys.CONSUMED_BY_STEP) if key < stop]

    def held_since(self, step: int) -> list[tuple[str, str]]:
        """``(state, group id)`` of groups claimed or consumed (rows stored) at a step ``>= step``."""
        found = []
        for prefix, state in ((keys.CLAIMED_BY_STEP, CLAIMED), (keys.CONSUMED_BY_STEP, CONSUMED)):
            start = prefix + keys.i64(step)
            found += [(state, gid.decode()) for _, gid in self.txn.iter_prefix("index", prefix, start)]
        return found

    def ready_ids(self) -> list[str]:
        """Every ready group, in dispatch order."""
        return [gid.decode() for _, gid in self.txn.iter_prefix("index", keys.READY_BY_SEQ)]

    def latest_target(self) -> tuple[int, str] | None:
        """``(target_step, group id)`` of the ready group with the largest target step, or ``None``."""
        found = self.txn.last("index", keys.READY_BY_TARGET)
        if found is None:
            return None
        key, gid = found
        return keys.from_i64(key[len(keys.READY_BY_TARGET):len(keys.READY_BY_TARGET) + 8]), gid.decode()
