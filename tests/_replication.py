"""Shared helpers of the replication tests (issue 44): the file's state without its log, the log's
records, a replay of them, and a buffer workload that writes and deletes through every transition."""

from __future__ import annotations

from _buffers import make_group

from kvckpt import Prompt
from kvckpt.storage import replog
from kvckpt.storage.store import Store


def main_db(store: Store) -> dict[bytes, bytes]:
    """Every stored key of the file but the log's own table, from one snapshot."""
    def read(txn):
        return {k: v for k, v in txn.raw.cursor(db=txn.layout.main).iternext() if k[:1] != b"l"}
    return store.read(read)


def records(store: Store) -> list[replog.LogRecord]:
    """The decoded log records the file keeps, in order."""
    return [replog.decode_record(v) for _, v in
            store.read(lambda t: list(t.iter_prefix("replog", replog.RECORD_PREFIX)))]


def replay(base: dict[bytes, bytes], recs: list[replog.LogRecord]) -> dict[bytes, bytes]:
    """``base`` with every record's operations applied in order (what a standby does)."""
    state = dict(base)
    for rec in recs:
        for key, value in rec.ops:
            if value is None:
                del state[key]
            else:
                state[key] = value
    return state


def drive_buffer(buf) -> None:
    """Admission, commits (one by group commit with a refusal), a claim, a finished step, a checkpoint
    stamp and a release: every kind of transition writes and deletes."""
    leases = buf.admit([Prompt(prompt_idx=i) for i in range(4)])
    buf.commit_group(leases[0], make_group(2, 0))
    results = buf.commit_many([{"lease": leases[1], "rows": make_group(2, 1)},
                               {"lease": leases[0], "rows": make_group(2, 9)},  # refused: already committed
                               {"lease": leases[2], "rows": make_group(2, 2)}])
    assert [type(r).__name__ for r in results] == ["CommitResult", "DuplicateCommit", "CommitResult"]
    buf.redispatch(leases[3].group_id)
    assert len(buf.select(1, 2).group_ids) == 2
    buf.finish_step()
    buf.evict()
