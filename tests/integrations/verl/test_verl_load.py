"""verl's ``tq.load_checkpoint`` through the kvckpt ledger: the checkpoint's state plus what finished since.

verl 0.9.1's ``_load_checkpoint`` (``trainer_base.py``, step 5) calls
``tq.load_checkpoint(global_step_N/transfer_queue)`` after a restart; verl's own TransferQueue then holds
exactly what the checkpoint held. The kvckpt ledger keeps more and loses nothing: every group the checkpoint
held that the live ledger no longer holds (cleared or evicted after the save) comes back as the checkpoint
held it, every group the live ledger holds keeps its live records (trajectories finished since), and a group
is never a mixture of the two moments. Groups sampling takes out after the checkpoint (trained, or evicted as
stale against weights the load rolls back) are marked, not deleted, and come back too. Each test writes the
killed run in a child process that is SIGKILLed, then restarts the world in this one (a fresh ``VerlLedger``
on the file) and asserts what the trainer does next.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from kvckpt.integrations.verl.ledger import VerlLedger
from kvckpt.integrations.verl.mirror import LEDGER_FILE

from kvckpt.errors import KvckptError

pytestmark = pytest.mark.verl

# The killed run, as the mirror records verl's async traffic (tags only: the ledger stores fields the same way).
# Checkpoint at step 2, then steps 3 and 4, then SIGKILL. Each group's story is in its uid.
_KILLED_RUN = r"""
import json, sys, time
from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
from kvckpt.integrations.verl.ledger import VerlLedger
from kvckpt.integrations.verl.records import TAG, record_key

path, checkpoint, out = sys.argv[1:4]
P = "train"
ledger = VerlLedger(path)
token = ledger.open_run()["token"]

def put(*entries):
    keys, values = [], []
    for key, tag in entries:
        for name, value in tag.items():
            keys.append(record_key(P, key, TAG, name))
            values.append(encode_value(keys[-1], value, new_write_id(), 1))
    ledger.put(token, keys, values)

def prompt(uid, status, step):
    return (uid, {"is_prompt": True, "status": status, "global_steps": step})

def trajectory(key, step):
    return (key, {"is_prompt": False, "seq_len": 3, "global_steps": step})

def dispatch(uids, step, fetched):
    keys, values = [], []
    for uid in uids:
        for name, value in prompt(uid, "pending", step)[1].items():
            keys.append(record_key(P, uid, TAG, name))
            values.append(encode_value(keys[-1], value, new_write_id(), 1))
    ledger.set_cursor(token, {"fetched": fetched}, keys, values)

def sample(uids, step):  # verl's sample: its kv_clear of the taken groups, made under the step
    ledger.clear(token, P, [k for u in uids for k in (u, f"{u}_0_0")], consumed_step=step)

ledger.checkpoint(token, checkpoint + ".first", 0)  # a first checkpoint: sampled groups are marked from now on
dispatch(["kept", "wiped", "evicted", "trained", "inflight", "regen", "still"], 1, 7)
put(prompt("kept", "finished", 1), trajectory("kept_0_0", 1), prompt("wiped", "finished", 1),
    trajectory("wiped_0_0", 1), prompt("evicted", "finished", 1), trajectory("evicted_0_0", 1),
    prompt("trained", "finished", 1), trajectory("trained_0_0", 1), trajectory("inflight_0_0", 1),
    prompt("regen", "running", 1), trajectory("regen_0_1", 1))
sample(["trained"], 2)  # trained by step 2: the step-2 weights hold it
stamp = ledger.checkpoint(token, checkpoint, 2)
# after the checkpoint
ledger.clear(token, P, ["wiped", "wiped_0_0"])  # a clear made after the save (verl's tests wipe the partition)
sample(["evicted"], 4)  # evicted as stale at step 4, against weights the load rolls back
put(trajectory("inflight_1_0", 3), prompt("inflight", "finished", 1))  # finished since
ledger.clear(token, P, ["regen_0_1"])  # re-issued: its partial trajectory cleared, then finished anew
put(prompt("regen", "pending", 3), trajectory("regen_0_0", 3), prompt("regen", "finished", 3))
dispatch(["late", "lateevicted"], 3, 9)
put(prompt("late", "finished", 3), trajectory("late_0_0", 3), prompt("lateevicted", "finished", 3),
    trajectory("lateevicted_0_0", 3))
sample(["lateevicted"], 4)
with open(out, "w") as f:
    json.dump({"checkpoint_id": stamp["checkpoint_id"], "cursor": ledger.snapshot()["cursor"]}, f)
time.sleep(3600)
"""


def _run_and_kill(tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    """The killed run: a child process writing the ledger, SIGKILLed once it reports."""
    live, checkpoint, out = tmp_path / "live.kv", tmp_path / "global_step_2" / LEDGER_FILE, tmp_path / "run.json"
    checkpoint.parent.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(live), str(checkpoint), str(out)],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or not out.read_text():
            assert child.poll() is None, "the killed run's process ended early"
            assert time.monotonic() < deadline, "the killed run did not report"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return str(live), str(checkpoint), json.loads(out.read_text())


def _groups(items: dict[str, Any]) -> dict[str, set[str]]:
    groups: dict[str, set[str]] = {}
    for key in items:
        groups.setdefault(key.split("_", 1)[0], set()).add(key)
    return groups


def test_load_gives_the_checkpoint_plus_what_finished_since(tmp_path: Path) -> None:
    """After a SIGKILL, a fresh ledger loading the step-2 checkpoint (as ``tq.load_checkpoint`` does, then
    ``resume`` at step 2) holds: the checkpoint's groups the live ledger had lost (``wiped``: a clear after the
    save; ``evicted``: evicted as stale at step 4), each as the checkpoint held it; the live version of every
    group it holds (``inflight`` finished since, ``regen`` re-issued and finished anew, without the partial
    trajectory the checkpoint held); groups dispatched after it (``late``, and ``lateevicted``, evicted at step
    4 and given back); and not ``trained``, which the step-2 weights hold. No group is both held and consumed,
    the dispatch cursor is the last dispatch (so nothing dispatched is fetched again), and only ``still``
    (in flight then and now) is re-issued."""
    live, checkpoint, run = _run_and_kill(tmp_path)
    ledger = VerlLedger(live)
    try:
        token = ledger.open_run()["token"]
        assert ledger.load(checkpoint, run["checkpoint_id"], token) is False  # merged, not copied in
        view = ledger.resume(token, 2)
        items = view["items"]["train"]
        groups = _groups(items)
        assert groups == {"kept": {"kept", "kept_0_0"}, "wiped": {"wiped", "wiped_0_0"},
                          "evicted": {"evicted", "evicted_0_0"}, "inflight": {"inflight", "inflight_0_0",
                                                                             "inflight_1_0"},
                          "regen": {"regen", "regen_0_0"}, "still": {"still"},
                          "late": {"late", "late_0_0"}, "lateevicted": {"lateevicted", "lateevicted_0_0"}}
        status = {uid: items[uid]["tags"]["status"] for uid in groups}
        assert status == {"kept": "finished", "wiped": "finished", "evicted": "finished", "inflight": "finished",
                          "regen": "finished", "still": "pending", "late": "finished", "lateevicted": "finished"}
        assert items["regen"]["tags"]["global_steps"] == 3  # the live group's tags, not the checkpoint's
        assert ledger.snapshot()["consumed"] == {}  # every mark settled: none left beside a held group
        assert view["cursor"] == run["cursor"] == {"fetched": 9}
        inflight = [uid for uid, s in status.items() if s in ("pending", "running")]
        assert inflight == ["still"]  # what _reissue_inflight_prompts re-issues next
    finally:
        ledger.close()


def test_a_second_load_of_the_same_checkpoint_changes_nothing(tmp_path: Path) -> None:
    """Loading the same checkpoint again (a second restart before the next checkpoint) puts nothing back twice:
    the groups are those of the first load, record for record."""
    live, checkpoint, run = _run_and_kill(tmp_path)
    ledger = VerlLedger(live)
    try:
        token = ledger.open_run()["token"]
        ledger.load(checkpoint, run["checkpoint_id"], token)
        first = ledger.resume(token, 2)
        token = ledger.open_run()["token"]
        ledger.load(checkpoint, run["checkpoint_id"], token)
        assert ledger.resume(token, 2) == first
    finally:
        ledger.close()


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_damaged_or_foreign_checkpoint_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """The checkpoint file is untrusted: a file whose stamp is not the manifest's, one with a damaged page and
    one that is not a kvckpt file are each refused with a kvckpt error naming the file, and the live ledger is
    byte for byte what it was (nothing merged)."""
    live, checkpoint, run = _run_and_kill(tmp_path)
    ledger = VerlLedger(live)
    try:
        token = ledger.open_run()["token"]
        data = Path(checkpoint).read_bytes()
        damaged, foreign = tmp_path / "damaged.kv", tmp_path / "foreign.kv"
        damaged.write_bytes(data[:4096] + bytes(len(data) - 8192) + data[-4096:])
        foreign.write_bytes(b"not a checkpoint" * 512)
        before = ledger.snapshot()
        cases = ((checkpoint, "another-id", "stamp"), (str(damaged), run["checkpoint_id"], "damaged.kv"),
                 (str(foreign), run["checkpoint_id"], "foreign.kv"))
        for source, checkpoint_id, named in cases:
            digest = _digest(live)
            with pytest.raises(KvckptError, match=named):
                ledger.load(source, checkpoint_id, token)
            assert _digest(live) == digest and ledger.snapshot() == before
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]  # the private copies are gone
    finally:
        ledger.close()


def test_groups_that_sampling_evicts_after_a_checkpoint_come_back_on_its_load(tmp_path: Path) -> None:
    """Through verl's own ``ReplayBufferAsync.sample`` (``colocate_async``, ``drop``, threshold 1) with the kvckpt
    buffer: after the ledger's checkpoint of step 3, a stale group (dispatched at step 0) and two fresh ones
    finish; ``sample`` at step 5 evicts the stale one and takes the two fresh ones. Each is marked consumed by
    step 5 (the trajectories by the trainer's clear after training, with their prompt's step), not deleted, and
    ``tq.load_checkpoint`` of the step-3 checkpoint (the trainer rolled back to step 3)
    gives all three back to TransferQueue, finished, with their trajectories: the stale group's eviction was
    judged against step-5 weights the load destroyed, and verl's buffer judges it again at the resumed step."""
    import ray
    import torch
    import transfer_queue as tq
    from _verl_support import transferqueue
    from kvckpt.integrations.verl import KvckptReplayBufferAsync

    actor, partition = f"kvckpt_verl_load_{os.getpid()}", "train"
    with transferqueue("kvckpt-verl-load", actor):
        rb = KvckptReplayBufferAsync(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=1,
                                     max_off_policy_strategy="drop", poll_interval=0.05,
                                     sampler_kwargs={"kvckpt": {"path": str(tmp_path / "ledger.kv"),
                                                                "actor_name": actor}})
        checkpoint = str(tmp_path / "global_step_3" / "transfer_queue")
        tq.save_checkpoint(checkpoint, metadata={"global_steps": 3})
        for uid, step in (("stale", 0), ("freshone", 5), ("freshtwo", 5)):
            tq.kv_put(key=f"{uid}_0_0", partition_id=partition, fields={"input_ids": torch.tensor([1, 2, 3])},
                      tag={"is_prompt": False, "seq_len": 3, "global_steps": step})
            tq.kv_put(key=uid, partition_id=partition, tag={"is_prompt": True, "status": "finished",
                                                             "global_steps": step})
        batch, metrics = rb.sample(global_steps=5, partition_id=partition, batch_size=2)
        assert {key.split("_")[0] for key in batch.keys} == {"freshone", "freshtwo"}
        assert metrics["training/off_policy/evicted_samples"] == 1
        tq.kv_clear(keys=list(batch.keys), partition_id=partition)  # the trainer's clear of what it trained on
        taken = {f"{uid}{suffix}": 5 for uid in ("stale", "freshone", "freshtwo") for suffix in ("", "_0_0")}
        assert ray.get(rb.ledger.snapshot.remote())["consumed"] == {partition: taken}
        assert tq.kv_list(partition_id=partition).get(partition, {}) == {}
        tq.load_checkpoint(checkpoint)
        listed = tq.kv_list(partition_id=partition)[partition]
        assert set(listed) == set(taken)
        assert {uid: listed[uid]["status"] for uid in ("stale", "freshone", "freshtwo")} == dict.fromkeys(
            ("stale", "freshone", "freshtwo"), "finished")


def test_a_checkpoint_copies_beside_other_calls_and_purges_between_them(tmp_path: Path) -> None:
    """The ledger's checkpoint runs in its own Ray concurrency group, beside the default group's calls. Its
    snapshot copy must not wait for them (puts land while it copies), and its step record and purge (one write
    transaction, its reads inside it) must not run beside a load, which swaps the file. The test holds the
    ledger's mutex, as a load (a default-group call) does: the copy lands, then the checkpoint waits for the
    mutex (a lock that says when another thread waits for it) and has written no step record; without the
    mutex it finishes without ever waiting, and a copy that waits for the mutex waits before its file exists."""
    import threading

    class WatchedLock:
        def __init__(self) -> None:
            self.lock, self.waited = threading.Lock(), threading.Event()

        def __enter__(self) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.waited.set()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    ledger = VerlLedger(str(tmp_path / "live.kv"))
    token = ledger.open_run()["token"]
    dest = str(tmp_path / "ckpt" / LEDGER_FILE)
    done: list[Any] = []
    ledger._mutex = watched = WatchedLock()  # type: ignore[assignment]
    worker = threading.Thread(target=lambda: done.append(ledger.checkpoint(token, dest, 3)), daemon=True)
    with watched.lock:  # a call of the default group (a load swapping the file)
        worker.start()
        hang = time.monotonic() + 600  # a hang guard only: the outcome does not depend on timing
        while worker.is_alive() and not watched.waited.wait(0.01) and time.monotonic() < hang:
            pass
        assert watched.waited.is_set(), "the step record and purge ran without waiting for the mutex"
        assert os.path.exists(dest), "the snapshot copy waited for another call"
        assert ledger.info()["checkpoint_step"] is None, "the purge ran beside a default-group call"
    worker.join(60)
    assert done and ledger.info()["checkpoint_step"] == 3
    ledger.close()
