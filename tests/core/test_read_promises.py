"""``read_batch``'s row checks, one deterministic test aimed at each promise (issue 35), each killed
by a named mutation of ``scripts/mutation_check.py``:

* a row whose payload names another index of the same group is refused, also when the group digest
  was recomputed to match the edited rows: the identity check, not the digest, catches it
  (``read-skips-row-index-identity``);
* rows decode within the store's limits including its pinned shapes: an undeclared row field
  larger than ``max_tokens`` but within its pin reads back (``read-limits-ignore-pins``), one
  element past the pin is refused (``limits-row-pin-scaled-by-max-tokens``).

Stored bytes are edited with raw LMDB (``tests/_crafted.py``), the digests made to agree.
"""

from __future__ import annotations

import _crafted
import numpy as np
import pytest
import torch

from kvckpt import BufferConfig, CorruptRecord, InvariantViolation, Prompt, ReplayBuffer
from kvckpt.storage import codec, keys

SCHEMA = {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}


def _claimed_group(path: str, schema, rows) -> str:
    """One committed group of ``rows``, claimed by the current step; returns its id."""
    with ReplayBuffer.create(path, BufferConfig(group_size=len(rows), schema=schema,
                                                max_buffered_rollouts=4)) as buf:
        [lease] = buf.admit([Prompt(0)])
        buf.commit_group(lease, rows)
        assert buf.select(1).group_ids == [lease.group_id]
        assert len(buf.read_batch([lease.group_id], layout="list").rows) == len(rows)  # reads before the edit
        return lease.group_id


def _edit_rows(path: str, gid: str, change) -> None:
    """``change(edit, row_key)`` edits the rows; the group's digest is recomputed from what is stored."""
    edit = _crafted._Edit(path)
    change(edit, lambda i: keys.row_key(gid, i))
    edit.refresh_digest(gid, edit.doc("groups", gid.encode()))
    edit.close()


def _swap(edit, key):
    first, second = edit.get("rows", key(0)), edit.get("rows", key(1))
    edit.put("rows", key(0), second)
    edit.put("rows", key(1), first)


def _duplicate(edit, key):
    edit.put("rows", key(1), edit.get("rows", key(0)))


# -- 9. the identity check, not the digest ---------------------------------------------------------------

@pytest.mark.parametrize("change", [_swap, _duplicate], ids=["swapped", "duplicated"])
def test_a_row_naming_another_index_of_its_group_is_refused_even_with_a_matching_digest(tmp_path, change):
    path = str(tmp_path / "buf.kv")
    rows = [{"input_ids": torch.tensor([1, 2, 3]) + i, "total_reward": torch.tensor(float(i))} for i in range(3)]
    gid = _claimed_group(path, SCHEMA, rows)
    _edit_rows(path, gid, change)
    with ReplayBuffer.open(path) as buf:
        with pytest.raises(InvariantViolation) as error:
            buf.read_batch([gid], layout="list")
        first = 0 if change is _swap else 1  # the first row read that names another index
        assert f"row {keys.row_id(gid, first)} holds the payload of {gid!r} row {1 - first}" in str(error.value)


# -- 10. the limits follow the pinned shapes -------------------------------------------------------------------

PINNED = {"fields": {"input_ids": ("int64", "token"), "embedding": ("float32", "row")}, "max_tokens": 4}


def _pinned_rows():
    """Rows whose undeclared row field ``embedding`` has 10 elements, more than ``max_tokens`` 4:
    the first commit pins its shape ``[10]``."""
    return [{"input_ids": torch.tensor([1, 2]), "embedding": torch.arange(10, dtype=torch.float32) + i}
            for i in range(2)]


def test_a_row_field_larger_than_max_tokens_within_its_pin_reads_back(tmp_path):
    path = str(tmp_path / "buf.kv")
    gid = _claimed_group(path, PINNED, _pinned_rows())
    with ReplayBuffer.open(path) as buf:
        assert buf.read_batch([gid]).tensors["embedding"].shape == (2, 10)
        batch = buf.read_batch([gid], layout="list")
        assert [r["embedding"].tolist() for r in batch.rows] == [r["embedding"].tolist() for r in _pinned_rows()]


def test_a_row_field_one_element_past_its_pin_is_refused(tmp_path):
    path = str(tmp_path / "buf.kv")
    gid = _claimed_group(path, PINNED, _pinned_rows())

    def grow(edit, key):  # row 1's embedding gets an eleventh element, its checksum valid
        record = codec.decode(edit.get("rows", key(1)))
        arrays = {**record.arrays, "embedding": np.arange(11, dtype=np.float32)}
        edit.put("rows", key(1), codec.encode(arrays, record.meta))

    _edit_rows(path, gid, grow)
    with ReplayBuffer.open(path) as buf:
        with pytest.raises(CorruptRecord) as error:
            buf.read_batch([gid], layout="list")
        assert error.value.key == f"rows/{keys.row_id(gid, 1)}"
