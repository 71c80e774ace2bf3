"""The verl ledger with a standby ledger actor (issue 44: the value store's side; docs/replication.md, "The value
store on Ray"), on a real loopback Ray: the primary ledger actor ships its log to the standby actor, the driver
streams verl's calls (puts, token progress, clears) as verl's processes make them, and the primary dies
mid-stream.

* ``remote_durable``, the primary's directory deleted with it (the node's disk is gone): after
  ``promote`` every put the primary acknowledged is on the promoted standby byte for byte, every
  acknowledged progress prefix is durable there, every acknowledged clear stuck, and the promoted ledger
  takes verl's next calls under the same run token.
* ``remote_apply``: a checkpoint and a load through the primary (a new history: the standby takes a
  snapshot) leave both files equal at the same sequence (``verify --against``); then the primary is killed
  and the standby promoted, and the old primary restarted on its old file acknowledges nothing: its put
  is refused with ``NotPrimary`` and is not on the promoted ledger.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest

kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: loopback
ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from kvckpt.integrations.transferqueue.values import encode_value, new_write_id  # noqa: E402
from kvckpt.integrations.verl.ledger import VerlLedgerActor  # noqa: E402
from kvckpt.integrations.verl.records import FIELD, record_key  # noqa: E402

from kvckpt import ValueStore  # noqa: E402
from kvckpt.durability.replication import compare_replicas  # noqa: E402
from kvckpt.errors import NotPrimary  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.ray]


@pytest.fixture
def local_ray(tmp_path):
    kray.init_local_ray(num_cpus=4, object_store_memory=128 << 20, namespace="verl-standby", address="local")
    try:
        yield tmp_path
    finally:
        ray.shutdown()


def start_pair(tmp_path, ack: str):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    standby = VerlLedgerActor.options(name="ledger-standby", max_restarts=0).remote(
        str(tmp_path / "b" / "ledger.kv"), standby=True)
    primary = VerlLedgerActor.options(name="ledger-primary", max_restarts=0).remote(
        str(tmp_path / "a" / "ledger.kv"), replication={"standby": "ledger-standby", "ack": ack})
    return primary, standby


def item(i: int) -> tuple[str, bytes]:
    key = record_key("train", f"{i}_0", FIELD, "responses")
    return key, encode_value(key, {"tokens": list(range(i % 7 + 1))}, new_write_id(), 1)


def chunk(i: int, start: int, n: int) -> dict:
    return {"uid": f"u{i}", "session": 0, "start": start, "tokens": list(range(start, start + n)),
            "logprobs": [0.5] * n, "versions": [1] * n}


class Stream:
    """verl's calls on the primary ledger from a thread, each remembered once acknowledged."""

    def __init__(self, ledger, token: str) -> None:
        self.ledger, self.token = ledger, token
        self.puts: dict[str, bytes] = {}
        self.progress: dict[str, int] = {}
        self.cleared: list[str] = []
        self.clearing: str | None = None  # a clear in flight: it may or may not have landed when the primary died
        self.acked = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        try:
            while True:
                key, value = item(i)
                ray.get(self.ledger.put.remote(self.token, [key], [value]))
                self.puts[key] = value
                start = self.progress.get(f"u{i // 3}", 0)
                assert ray.get(self.ledger.record_progress.remote(self.token, [chunk(i // 3, start, 4)])) == [start + 4]
                self.progress[f"u{i // 3}"] = start + 4
                if i % 5 == 4:  # a plain clear of an earlier put (no checkpoint yet: deleted)
                    gone = self.clearing = item(i - 4)[0]
                    ray.get(self.ledger.clear.remote(self.token, "train", [gone.split("/")[2]]))
                    self.cleared.append(gone)
                    self.puts.pop(gone)
                    self.clearing = None
                self.acked += 1
                i += 1
        except BaseException as exc:  # the primary died: the call in flight is unacknowledged
            self.error = exc


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_remote_durable_the_primarys_node_and_disk_die_mid_stream_and_the_promoted_ledger_holds_every_ack(local_ray):
    tmp_path = local_ray
    primary, standby = start_pair(tmp_path, "remote_durable")
    token = ray.get(primary.open_run.remote())["token"]
    stream = Stream(primary, token)
    stream.thread.start()
    wait_for(lambda: stream.acked >= 12 or stream.error is not None, "12 acknowledged rounds")
    ray.kill(primary, no_restart=True)  # mid-stream: a call is in flight
    stream.thread.join(60)
    assert isinstance(stream.error, ray.exceptions.RayError), stream.error
    shutil.rmtree(tmp_path / "a")  # the node's disk is gone with it
    puts, progress, cleared = dict(stream.puts), dict(stream.progress), list(stream.cleared)
    if stream.clearing is not None:  # its clear was unacknowledged: landed or not, either is correct
        puts.pop(stream.clearing)
    status = ray.get(standby.promote.remote())
    assert status["role"] == "primary" and status["epoch"] == 2 and status["promoted_from"] == status["last"]
    for uid, durable in progress.items():
        held = ray.get(standby.progress.remote(uid, 0))
        assert held is not None and held["tokens"][:durable] == list(range(durable)), uid
    # verl's next calls land on the promoted ledger under the same run token
    key, value = item(10_000)
    ray.get(standby.put.remote(token, [key], [value]))
    puts[key] = value
    ray.get(standby.close.remote())
    values = ValueStore(str(tmp_path / "b" / "ledger.kv"))
    assert values.get(list(puts)) == list(puts.values())  # every acknowledged put, byte for byte
    assert values.get(cleared) == [None] * len(cleared)  # every acknowledged clear stuck
    values.close()
    assert len(puts) >= 10 and cleared


def test_remote_apply_a_load_reships_a_snapshot_and_the_revived_old_primary_acknowledges_nothing(local_ray):
    tmp_path = local_ray
    primary, standby = start_pair(tmp_path, "remote_apply")
    token = ray.get(primary.open_run.remote())["token"]
    for i in range(5):
        key, value = item(i)
        ray.get(primary.put.remote(token, [key], [value]))
    dest = str(tmp_path / "ckpt" / "ledger.kv")
    stamp = ray.get(primary.checkpoint.remote(token, dest, 1))
    ray.get(primary.retain.remote(token, {}))  # the live store no longer descends: the load copies the file in
    assert ray.get(primary.load.remote(dest, stamp["checkpoint_id"], token)) is True
    key, value = item(5)
    ray.get(primary.put.remote(token, [key], [value]))  # acknowledged: the standby applied it
    mine = ray.get(primary.replica_status.remote())
    theirs = ray.get(standby.replica_status.remote())
    assert mine["snapshots"] == 1 and theirs["store_tag"] == mine["store_tag"]  # the load's new history, shipped
    assert theirs["applied"] == mine["last"] == mine["acked"]
    report = compare_replicas(str(tmp_path / "a" / "ledger.kv"), str(tmp_path / "b" / "ledger.kv"))
    assert report["equal"], report
    ray.kill(primary, no_restart=True)
    ray.get(standby.promote.remote())
    # the old primary comes back on its old file (a healed partition) with its old config
    revived = VerlLedgerActor.options(name="ledger-revived", max_restarts=0).remote(
        str(tmp_path / "a" / "ledger.kv"), replication={"standby": "ledger-standby", "ack": "remote_apply"})
    late, late_value = item(99)
    with pytest.raises(NotPrimary):
        ray.get(revived.put.remote(token, [late], [late_value]))
    with pytest.raises(NotPrimary):  # and everything after
        ray.get(revived.put.remote(token, [late], [late_value]))
    assert ray.get(revived.replica_status.remote())["fenced"] is not None
    ray.get(standby.close.remote())
    values = ValueStore(str(tmp_path / "b" / "ledger.kv"))
    assert values.get([late, key]) == [None, value]
    values.close()
