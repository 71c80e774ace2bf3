"""SIGKILL of a replicated primary mid-write and of a standby mid-apply (issue 44; docs/replication.md).

After each kill the world restarts (a fresh handle in this process, the killed one a separate
process): the primary's log replayed onto the state it started from is exactly its state (the
record is in the state's transaction), with no gap and nothing acknowledged missing; the standby
holds exactly the primary's state at its applied sequence, and catching up from there ends equal.
Whatever instant the kill lands at, these must hold: the kill points vary, the assertions do not.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from _replication import main_db, records, replay

from kvckpt.storage import replog
from kvckpt.storage.replica import apply_batch, make_standby
from kvckpt.storage.store import Store

_WRITER = r"""
import random, sys
from kvckpt.storage.store import Store
rng = random.Random(int(sys.argv[2]))
with Store(sys.argv[1]) as store:
    while True:
        def txn(t):
            for _ in range(rng.randint(1, 6)):
                key = b"k%d" % rng.randint(0, 40)
                if rng.random() < 0.3:
                    t.delete("rows", key)
                else:
                    t.put("rows", key, rng.randbytes(rng.randint(1, 3000)))
        store.write(txn)
        print(store.replication.last, flush=True)
"""

_APPLIER = r"""
import sys
from kvckpt.storage.replica import apply_batch
from kvckpt.storage.store import Store
with Store(sys.argv[1], readonly=True) as primary, Store(sys.argv[2]) as standby:
    def batch(t, after):
        return [v for _, v in t.iter_prefix("replog", b"r", b"r" + (after + 1).to_bytes(8, "big"))][:3]
    applied = standby.replication.last
    while records := primary.read(lambda t: batch(t, applied)):
        applied = apply_batch(standby, records)
        print(applied, flush=True)
"""


def run_until_killed(code: str, args: list[str], lines: int, extra: float) -> list[int]:
    """Run ``code``, SIGKILL it once it printed ``lines`` lines and ``extra`` seconds more passed;
    every integer it printed (what it had acknowledged)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    acked = []
    while len(acked) < lines:
        line = proc.stdout.readline()
        if not line:
            break
        acked.append(int(line))
    time.sleep(extra)
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    return acked + [int(x) for x in rest.split()]


@pytest.mark.parametrize("seed", range(3))
def test_a_primary_killed_mid_write_keeps_a_log_that_replays_to_its_state(tmp_path, seed):
    path = str(tmp_path / "p.kv")
    with Store(path, create=True) as store:
        replog.ReplicationLog.enable(store)
        base = main_db(store)
    acked = run_until_killed(_WRITER, [path, str(seed)], 20 + 15 * seed, 0.01 * seed)
    assert len(acked) >= 20
    with Store(path) as store:
        recs = records(store)
        assert [r.seq for r in recs] == list(range(1, len(recs) + 1))
        assert recs[-1].seq >= acked[-1]  # nothing acknowledged is missing from the log
        assert replay(base, recs) == main_db(store)
        store.write(lambda t: t.put("rows", b"after", b"restart"))  # the log goes on without a gap
        assert store.replication.last == len(recs) + 1


@pytest.mark.parametrize("seed", range(3))
def test_a_standby_killed_mid_apply_holds_the_primarys_state_at_its_applied_sequence(tmp_path, seed):
    primary_path, standby_path = str(tmp_path / "p.kv"), str(tmp_path / "s.kv")
    with Store(primary_path, create=True) as store:
        replog.ReplicationLog.enable(store)
        base = main_db(store)
        with store.reader() as txn:
            store.copy_snapshot(standby_path, txn)
    with Store(standby_path) as standby:
        make_standby(standby, 0, 1)
    run_until_killed(_WRITER, [primary_path, str(100 + seed)], 120, 0)  # a log of 120+ records
    acked = run_until_killed(_APPLIER, [primary_path, standby_path], 5 + 5 * seed, 0.005 * seed)
    with Store(primary_path) as primary, Store(standby_path) as standby:
        recs = records(primary)
        applied = standby.replication.last
        assert applied >= acked[-1]  # nothing acknowledged is lost
        assert main_db(standby) == replay(base, recs[:applied])
        while batch := primary.replication.read_since(standby.replication.last, 16):
            apply_batch(standby, batch)
        assert main_db(standby) == main_db(primary)
