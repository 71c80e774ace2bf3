"""Damaged checkpoint files: every case ends in a specific kvckpt error or in identical data.

The fuzz campaign (:func:`kvckpt.testing.campaigns.fuzz.run_fuzz_campaign`) damages valid checkpoints 1,000 ways
and restores each in long-lived worker processes; the other tests pin the pieces it relies on: the
deep verifier flags each kind of inconsistency by its code, :mod:`kvckpt.durability.safe_open` survives every
damaged page in-process, and the trusted path reports damaged pages instead of leaking raw LMDB
errors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _damage import raise_rows_separators

from kvckpt import (
    CorruptRecord,
    FormatError,
    KvckptError,
    Prompt,
    RecoveryError,
    ReplayBuffer,
    VerificationFailed,
    check,
    restore,
)
from kvckpt.durability.safe_open import check_structure, verify_path, verify_untrusted
from kvckpt.storage import codec, keys
from kvckpt.storage.store import Txn
from kvckpt.tables.access import Tables
from kvckpt.tables.digest import group_digest, row_digest
from kvckpt.tables.records import GroupInfo, LedgerEntry
from kvckpt.testing.campaigns.fuzz import build_base, build_foreign, run_fuzz_campaign
from kvckpt.testing.campaigns.workload import make_row, workload_config

PAGE = 4096


def test_fuzz_campaign_1000_cases_end_in_an_error_or_identical_data(tmp_path: Path) -> None:
    result = run_fuzz_campaign(1000, seed=0, workers=2, directory=str(tmp_path))
    print(result.summary())  # the figures docs/reliability.md quotes (pytest -s)
    assert result.violations == []
    assert result.cases == 1000
    assert result.detected + result.harmless == 1000
    # rows are checked where they are read: damage to a row is detected by the read of its group
    assert set(result.errors) <= {"FormatError", "VerificationFailed", "RecoveryError", "CorruptRecord",
                                  "CorruptRecord (at read)", "InvariantViolation (at read)"}
    # Damage that always breaks the file is always detected; appended bytes never matter.
    for kind in ("foreign", "random", "random-body", "truncate"):
        assert set(result.by_kind[kind]) == {"detected"}, (kind, result.by_kind[kind])
    # A checkpoint's page copy keeps the snapshot's free pages: zeroing one of those is harmless
    # (identical data restored); zeroing any other page is detected.
    assert result.by_kind["zero-page"]["detected"] > result.by_kind["zero-page"].get("harmless", 0)
    assert set(result.by_kind["append"]) == {"harmless"}
    assert result.by_kind["flip-data"]["detected"] > 0 and result.by_kind["flip-data"].get("violation", 0) == 0


# -- the deep verifier, one invariant at a time ---------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Any:
    """A windowed buffer holding every state: consumed g0, claimed g1, ready g2 and g3, a ledger
    entry g4 with one sibling, aborted g5, and an evicted group (start weight 0, the others 2)."""
    buf = ReplayBuffer.create(str(tmp_path / "live.kv"), workload_config(
        {"name": "windowed", "max_staleness_versions": 1}, capacity=16))
    buf.finish_step()
    buf.finish_step()  # at step 2, so that a group of weight 0 can fall out of the window
    leases = buf.admit([Prompt(i) for i in range(6)], dataloader_state=b"6", weight_version=2)
    for lease in leases[:4]:
        buf.commit_group(lease, [make_row(lease.group_id, i) for i in range(lease.group_size)])
    buf.commit_sample(leases[4], 0, make_row(leases[4].group_id, 0))
    buf.abort(leases[5].group_id, "test")
    [old] = buf.admit([Prompt(6)], dataloader_state=b"7", weight_version=0)
    buf.commit_group(old, [make_row(old.group_id, i) for i in range(old.group_size)])
    buf.select(1, 1)
    buf.finish_step()
    buf.select(1, 1)
    assert buf.evict() == [old.group_id]
    states = {g.group_id: g.state for g in buf.groups()}
    assert states == {"a0-p0": "consumed", "a0-p1": "claimed", "a0-p2": "ready", "a0-p3": "ready",
                      "a0-p5": "aborted", "a1-p0": "evicted"}
    assert buf.store.read(lambda t: check(t, deep=True)).ok
    yield buf
    buf.close()


def _doc(txn: Txn, table: str, gid: str, **changes: Any) -> None:
    txn.put_json(table, keys.group_key(gid), {**txn.get_json(table, keys.group_key(gid)), **changes})


def _move_row(txn: Txn) -> None:
    value = txn.get("rows", keys.row_key("a0-p2", 0))
    txn.delete("rows", keys.row_key("a0-p2", 0))
    txn.put("rows", keys.group_key("a0-p2") + b"\x01" + (0).to_bytes(4, "big"), value)


def _flip_dataloader(txn: Txn) -> None:
    value = bytearray(txn.get("meta", b"dataloader"))
    value[-1] ^= 1
    txn.put("meta", b"dataloader", bytes(value))


def _drop_group(txn: Txn) -> None:
    txn.delete("groups", keys.group_key("a0-p5"))


def _drop_field(txn: Txn) -> None:
    doc = txn.get_json("groups", keys.group_key("a0-p2"))
    del doc["start_weight"]
    txn.put_json("groups", keys.group_key("a0-p2"), doc)


TAMPERING: dict[str, tuple[Callable[[Txn], None], bool, set[str]]] = {
    # name: (tampering, deep, the exact problem codes the verifier must report)
    "row key without its NUL separator": (_move_row, False, {"row-key", "row-set"}),
    "unknown meta key": (lambda t: t.put_json("meta", b"dataloadfr", {}), False, {"unknown-meta"}),
    "damaged dataloader state": (_flip_dataloader, False, {"corrupt-record"}),
    "group digest not the rows' digest": (lambda t: _doc(t, "groups", "a0-p2", digest="0" * 16), True, {"digest"}),
    "sibling digest not the row's": (lambda t: _doc(t, "ledger", "a0-p4", digests={"0": "0" * 16}), True, {"digest"}),
    "digests for rows never committed": (lambda t: _doc(t, "ledger", "a0-p4", digests={}), False, {"digest"}),
    "unknown ledger phase": (lambda t: _doc(t, "ledger", "a0-p4", phase="reserved"), False, {"phase"}),
    "evicted group claiming rows": (lambda t: _doc(t, "groups", "a1-p0", rows_stored=True), False,
                                    {"row-set", "rows-state"}),
    "claim of a past step": (lambda t: _doc(t, "groups", "a0-p1", claimed_step=0), False, {"step", "index"}),
    "consumption in the current step": (lambda t: _doc(t, "groups", "a0-p0", consumed_step=3), False,
                                        {"step", "index"}),
    "a prompt neither a group nor in the ledger": (_drop_group, False, {"accounting", "counter"}),
    "shortfall the aborts do not explain": (lambda t: t.put_json("meta", b"shortfall", {"3": 1}), False,
                                            {"shortfall"}),
    "record with a valid checksum but a missing field": (_drop_field, False, {"malformed"}),
    # issue 39: a fork is set only below the stamp, and the weight indexes key on the lineage weight
    "a lineage fork not below the stamp": (lambda t: _doc(t, "groups", "a0-p2", lineage_fork=2), False,
                                          {"malformed"}),
    "a fork the weight index does not follow": (lambda t: _doc(t, "groups", "a0-p2", lineage_fork=1), False,
                                                {"index"}),
    "an in-flight fork the weight index does not follow": (lambda t: _doc(t, "ledger", "a0-p4", lineage_fork=1),
                                                           False, {"index"}),
    # issue 49: a newest version only above the stamp, a fork only below it, and the weight indexes
    # key on min(stamp, 2 * fork - newest)
    "a newest version not above the stamp": (lambda t: _doc(t, "groups", "a0-p2", lineage_newest=2), False,
                                             {"malformed"}),
    "a fork not below the newest version": (lambda t: _doc(t, "groups", "a0-p2", lineage_fork=3, lineage_newest=3),
                                            False, {"malformed"}),
    "a newest version the forked weight index does not follow": (lambda t: _newest_after_fork(t, "groups"), False,
                                                                  {"index"}),
    "an in-flight newest version the weight index does not follow": (lambda t: _newest_after_fork(t, "ledger"),
                                                                     False, {"index"}),
}


def _newest_after_fork(txn: Txn, table: str) -> None:
    """Fork a record at 1 below its stamp 2 as a recovery does (its weight index moves to 2 * 1 - 2),
    then give it a newer token (3) the index does not follow (it should move to 2 * 1 - 3)."""
    t = Tables(txn)
    if table == "groups":
        group = t.group("a0-p2")
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "lineage_fork": 1}), was=group)
        _doc(txn, "groups", "a0-p2", lineage_newest=3)
    else:
        entry = t.entry("a0-p4")
        t.replace_entry(LedgerEntry.from_dict({**entry.to_dict(), "lineage_fork": 1}), was=entry)
        _doc(txn, "ledger", "a0-p4", lineage_newest=3)


@pytest.mark.parametrize("name", list(TAMPERING))
def test_verifier_flags_each_inconsistency(store: ReplayBuffer, name: str) -> None:
    tamper, deep, codes = TAMPERING[name]
    store.store.write(tamper)
    report = store.store.read(lambda t: check(t, deep=deep))
    assert {p.code for p in report.problems} == codes, report.problems
    if deep:  # the digests bind rows only when the rows are read
        assert store.store.read(lambda t: check(t, deep=False)).ok


def test_a_damaged_row_fails_where_it_is_read(store: ReplayBuffer, tmp_path: Path) -> None:
    """restore() reads no row: a flipped byte in one is refused by the read of its group (the
    other groups read), and by ``restore(deep=True)`` up front."""
    def damage(txn: Txn) -> None:
        value = bytearray(txn.get("rows", keys.row_key("a0-p3", 1)))
        value[len(value) // 2] ^= 0x10
        txn.put("rows", keys.row_key("a0-p3", 1), bytes(value))

    store.store.write(damage)
    store.checkpoint(str(tmp_path / "ckpt.kvckpt"), background=False).wait()
    with pytest.raises(RecoveryError, match=r"corrupt-record\] rows/a0-p3_g1: checksum mismatch"):
        restore(str(tmp_path / "ckpt.kvckpt"), str(tmp_path / "restored.kv"), deep=True)
    assert not (tmp_path / "restored.kv").exists()
    restored, _ = restore(str(tmp_path / "ckpt.kvckpt"), str(tmp_path / "restored.kv"))
    with restored:
        with pytest.raises(CorruptRecord, match="rows/a0-p3_g1"):
            restored.read_batch(["a0-p3"])
        assert len(restored.read_batch(["a0-p2"], layout="list").rows) == 4


def test_a_row_that_passes_its_checksum_but_not_the_schema(store: ReplayBuffer, tmp_path: Path) -> None:
    """A default restore checksums rows and checks group digests without decoding them: a
    well-formed row of the wrong shape whose group digest was forged to match is refused when it
    is read, never returned; ``deep=True`` refuses it up front."""
    forged = codec.encode({"input_ids": np.zeros(3, dtype=np.float32)}, {"group_id": "a0-p3", "index": 1})

    def forge(t: Txn) -> None:
        t.put("rows", keys.row_key("a0-p3", 1), forged)
        values = [v for _, v in t.iter_prefix("rows", keys.row_prefix("a0-p3"))]
        _doc(t, "groups", "a0-p3", digest=group_digest(row_digest(v) for v in values))
    store.store.write(forge)
    ckpt = str(tmp_path / "ckpt.kvckpt")
    store.checkpoint(ckpt, background=False).wait()
    with pytest.raises(VerificationFailed, match=r"\[schema\] rows/a0-p3_g1") as caught:
        restore(ckpt, str(tmp_path / "deep.kv"), deep=True)
    assert [p.code for p in caught.value.problems] == ["schema"]
    restored, _ = restore(ckpt, str(tmp_path / "restored.kv"))
    try:
        with pytest.raises(KvckptError, match="a0-p3"):
            restored.read_batch(["a0-p3"])
        assert restored.read_batch(["a0-p2"]).lengths.numel() == 4  # the other groups still read
    finally:
        restored.close()


def test_a_damaged_branch_separator_is_refused(tmp_path: Path) -> None:
    """Found by the 10,000-case soak (3 cases): a flipped byte in a branch page's separator key
    passed every check, and the restored store silently lost rows to lookups."""
    buf = ReplayBuffer.create(str(tmp_path / "live.kv"), workload_config({"name": "windowed"}, capacity=400))
    for lease in buf.admit([Prompt(i) for i in range(300)]):
        buf.commit_group(lease, [make_row(lease.group_id, i) for i in range(lease.group_size)])
    ckpt = tmp_path / "ckpt.kvckpt"
    buf.checkpoint(str(ckpt), background=False).wait()
    buf.close()
    keys = raise_rows_separators(ckpt)
    check_structure(str(ckpt))  # LMDB's own structure check does not see it
    with pytest.raises(VerificationFailed, match=r"\[unreachable\] rows/") as caught:
        restore(str(ckpt), str(tmp_path / "restored.kv"))
    assert {f"rows/{key!r}" for key in keys} & {p.key for p in caught.value.problems}
    assert not (tmp_path / "restored.kv").exists()


# -- safe_open and the trusted path on damaged pages ----------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("base") / "base.kvckpt"
    build_base(str(path), large=False)
    return path.read_bytes()


def _zeroed(base: bytes, page: int) -> bytes:
    return base[:page * PAGE] + bytes(PAGE) + base[(page + 1) * PAGE:]


def test_safe_open_survives_every_zeroed_page_in_process(base: bytes, tmp_path: Path) -> None:
    assert len(base) % PAGE == 0 and len(base) // PAGE > 8
    path = tmp_path / "case.kvckpt"
    for page in range(len(base) // PAGE):
        path.write_bytes(_zeroed(base, page))
        with pytest.raises(FormatError):
            check_structure(str(path))
        report = verify_untrusted(str(path))
        assert [p.code for p in report.problems] == ["structure"], (page, report.problems)


def test_verify_path_refuses_every_damaged_page_before_liblmdb_maps_it(base: bytes, tmp_path: Path) -> None:
    """verify_path (``kvckpt verify``) goes through safe_open.open_readonly: a file with any page
    zeroed is refused by the structure check with one ``open`` problem, in this very process (it
    used to open it through liblmdb, which may abort or leak lmdb errors on such a file)."""
    path = tmp_path / "case.kvckpt"
    for page in range(2, len(base) // PAGE):
        path.write_bytes(_zeroed(base, page))
        report = verify_path(str(path))
        assert [p.code for p in report.problems] == ["open"], (page, report.problems)
        assert "structural verification" in report.problems[0].message or "damaged" in report.problems[0].message


def test_verify_untrusted_in_a_child_process(base: bytes, tmp_path: Path) -> None:
    good, bad = tmp_path / "good.kvckpt", tmp_path / "bad.kvckpt"
    good.write_bytes(base)
    bad.write_bytes(_zeroed(base, 3))
    report = verify_untrusted(str(good), timeout=120)
    assert report.ok and (report.counts["groups"], report.counts["ledger"]) == (11, 7)
    assert [p.code for p in verify_untrusted(str(bad), timeout=120).problems] == ["structure"]
    assert [p.code for p in verify_untrusted(str(good), timeout=0.001).problems] == ["timeout"]


def test_foreign_lmdb_files_are_refused_by_name(tmp_path: Path) -> None:
    other, same_tables, future = build_foreign(str(tmp_path))
    with pytest.raises(FormatError, match="not a kvckpt store"):
        restore(other, str(tmp_path / "a.kv"))
    with pytest.raises(FormatError, match="no format record"):
        restore(same_tables, str(tmp_path / "b.kv"))
    with pytest.raises(FormatError, match="format version 99"):
        restore(future, str(tmp_path / "c.kv"))
    with pytest.raises(FormatError, match="not a regular file"):
        restore(str(tmp_path), str(tmp_path / "d.kv"))
