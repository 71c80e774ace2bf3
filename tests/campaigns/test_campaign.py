"""The crash campaign: SIGKILL a live workload again and again; every acknowledged operation stays.

The 200-kill run is the CI proof (``python -m kvckpt.testing.campaigns.campaign --kills 5000`` is the soak); the other
tests show the checker can fail, that a torn log line is cut, and what a trainer does next after a
kill, in a fresh process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvckpt import CommitResult, Prompt, ReplayBuffer, ValueStore
from kvckpt.testing.campaigns.history import check_history, holdings
from kvckpt.testing.campaigns.kill import Chain, run_child, run_crash_campaign
from kvckpt.testing.campaigns.values_workload import KINDS as VALUE_KINDS
from kvckpt.testing.campaigns.values_workload import VALUES_FILE, check_values, value_of
from kvckpt.testing.campaigns.workload import (
    COMMIT_PATHS,
    REFUSALS,
    SAMPLERS,
    OpLog,
    Workload,
    make_row,
    read_log,
    workload_config,
)


def test_200_kills_break_no_promise(tmp_path: Path) -> None:
    result = run_crash_campaign(200, seed=1, directory=str(tmp_path))
    print(result.summary())  # the figures docs/reliability.md quotes (pytest -s)
    assert result.violations == []
    assert result.kills == 200
    assert result.operations_checked > 2 * result.kills
    assert 100 < result.recoveries < 200  # the parent recovers after about 70% of the kills
    assert result.checkpoints_restored > 0 and result.checkpoints_verified >= result.checkpoints_restored
    assert all(result.commit_paths.get(path, 0) > 0 for path in (*COMMIT_PATHS, "refused")), result.commit_paths
    kinds = result.operation_kinds
    assert min(kinds.get(k, 0) for k in ("admit", "commit", "progress", "select", "finish")) > 0, kinds
    assert min(kinds.get(k, 0) for k in VALUE_KINDS) > 0, kinds  # the value store beside the buffer


def test_the_history_check_catches_every_kind_of_lie(tmp_path: Path) -> None:
    with ReplayBuffer.create(str(tmp_path / "live.kv"), workload_config(SAMPLERS[2])) as buf:
        leases = buf.admit([Prompt(0), Prompt(1)], dataloader_state=b"2")
        buf.commit_group(leases[0], [make_row(leases[0].group_id, i) for i in range(4)])
        buf.commit_sample(leases[1], 0, make_row(leases[1].group_id, 0))
        row = make_row(leases[1].group_id, 1)
        buf.record_progress(leases[1], 1, start=0, tokens=row["input_ids"][:2], logprobs=row["logprobs"][:2],
                            weight_version=0)
        digest = buf.group("a0-p0").digest
        truth = [{"op": "admit", "gids": ["a0-p0", "a0-p1"], "idx": [0, 1], "cursor": 2},
                 {"op": "commit", "gid": "a0-p0", "index": None, "ready": True, "digest": digest},
                 {"op": "commit", "gid": "a0-p1", "index": 0, "ready": False, "digest": None},
                 {"op": "progress", "gid": "a0-p1", "index": 1, "end": 2, "via": "one"}]
        assert check_history(truth, holdings(buf)) == []
        lies = [{"op": "admit", "gids": ["a9-p0"], "idx": [9], "cursor": 10},
                {"op": "commit", "gid": "a0-p0", "index": None, "ready": True, "digest": "0" * 16},
                {"op": "commit", "gid": "a0-p1", "index": 1, "ready": False, "digest": None},
                {"op": "progress", "gid": "a0-p1", "index": 1, "end": 3, "via": "many"},
                {"op": "progress", "gid": "a9-p0", "index": 0, "end": 1, "via": "many"},
                {"op": "evict", "gids": ["a0-p0"]},
                {"op": "abort", "gid": "a0-p1"},
                {"op": "finish", "version": 1},
                {"op": "violation", "what": "checkpoint failed"}]
        found = check_history(lies, holdings(buf))
    assert [f.split(" ")[0:3] for f in found] == [
        ["admitted", "prompt", "9"], ["dataloader", "cursor", "2"], ["acknowledged", "commit", "of"],
        ["acknowledged", "sample", "a0-p1_g1"], ["acknowledged", "progress", "of"], ["acknowledged", "progress", "of"],
        ["acknowledged", "eviction", "of"], ["acknowledged", "abort", "of"],
        ["trainer_version", "0", "is"], ["the", "workload", "reported:"]]


def test_a_short_campaign_crashes_the_value_store_beside_the_buffer(tmp_path: Path) -> None:
    """CI's cheap slice for the value store: every acknowledged value-store operation survives the kills,
    and its checkpoints load."""
    result = run_crash_campaign(6, seed=5, chain=6, directory=str(tmp_path))
    assert result.violations == []
    kinds = result.operation_kinds
    assert kinds.get("vstart") == 6 and min(kinds.get(k, 0) for k in ("vput", "vclear")) > 0, kinds


def test_the_value_store_check_catches_every_kind_of_lie(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    store = ValueStore(str(run / VALUES_FILE))
    store.put(["k00", "k01"], [value_of("k00", "w1"), value_of("k01", "w1")])
    store.checkpoint(str(run / "ckpt" / "values-000000.kv"))
    store.put(["k01"], [value_of("k01", "x")[:-1] + b"?"])  # not the bytes of its write (and a bad checksum)
    store.close()
    truth = [{"op": "vstart", "state": {}}, {"op": "vintent", "puts": {"k00": "w1", "k01": "w1"}, "deletes": []},
             {"op": "vput"}]
    lies = [{"op": "vintent", "puts": {"k02": "w2"}, "deletes": []}, {"op": "vput"},  # acknowledged, not there
            {"op": "vckpt", "path": "values-000000.kv", "id": "another", "state": {"k00": "w1"}},
            {"op": "vckpt", "path": "values-000001.kv", "id": "gone", "state": {}}]
    found: list[str] = []
    check_values(str(run), truth + lies, str(tmp_path), found.append)
    assert [f.split(" ")[:3] for f in found] == [
        ["value", "store:", "[corrupt-record]"], ["the", "value", "store"], ["the", "value", "under"],
        ["value", "checkpoint", "values-000000.kv"], ["value", "checkpoint", "values-000000.kv"],
        ["acknowledged", "value", "checkpoint"]], found


def test_a_torn_last_log_line_is_cut_off(tmp_path: Path) -> None:
    path = str(tmp_path / "ops.jsonl")
    log = OpLog(path)
    log.append(op="finish", version=1)
    with open(path, "ab") as f:
        f.write(b'{"op":"fin')
    assert read_log(path) == [{"op": "finish", "version": 1}]
    log.append(op="finish", version=2)
    assert read_log(path) == [{"op": "finish", "version": 1}, {"op": "finish", "version": 2}]


def test_after_the_kills_a_fresh_trainer_redispatches_once_and_selects_everything(tmp_path: Path) -> None:
    result = run_crash_campaign(3, seed=3, chain=3, directory=str(tmp_path))  # seed 3: ready_first
    assert result.violations == []
    store = tmp_path / "chain-00000" / "live.kv"
    code = textwrap.dedent(f"""
        import json
        from kvckpt import ReplayBuffer
        from kvckpt.testing.campaigns.workload import make_row
        buf = ReplayBuffer.open({str(store)!r})
        assert buf.sampler.name == "ready_first"
        plan = buf.recover()
        for lease in plan.leases:
            buf.commit_group(lease, {{i: make_row(lease.group_id, i) for i in lease.missing}})
        version = buf.trainer_version
        expected = [g.group_id for g in buf.groups(["ready"]) if g.start_weight <= version]
        print(json.dumps({{"leases": [lease.group_id for lease in plan.leases], "ledger": len(buf.ledger()),
                          "expected": expected, "selected": buf.select(1, 10_000).group_ids,
                          "prompts": sorted(g.prompt_idx for g in buf.groups()),
                          "cursor": int(buf.dataloader_state() or b"0")}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["leases"]) == len(set(out["leases"]))
    assert out["ledger"] == 0
    assert set(out["leases"]) <= set(out["expected"])
    assert out["selected"] == out["expected"] and out["selected"]
    assert out["prompts"] == list(range(out["cursor"]))


def test_command_line_prints_the_summary(tmp_path: Path) -> None:
    kill = subprocess.run([sys.executable, "-m", "kvckpt.testing.campaigns.campaign", "--kills", "2",
                           "--dir", str(tmp_path / "k")],
                          capture_output=True, text=True, timeout=300)
    assert kill.returncode == 0, kill.stderr
    assert kill.stdout.startswith("crash campaign: kills 2, operations checked ")
    assert "violations found 0" in kill.stdout
    fuzz = subprocess.run([sys.executable, "-m", "kvckpt.testing.campaigns.campaign", "fuzz", "--cases", "10",
                           "--workers", "1",
                           "--dir",
                           str(tmp_path / "f")], capture_output=True, text=True, timeout=300)
    assert fuzz.returncode == 0, fuzz.stderr
    assert fuzz.stdout.startswith("fuzz: cases 10, corruptions detected ")
    assert "violations found 0" in fuzz.stdout


class _AtOnce(random.Random):
    """An rng whose every draw is 0: the campaign's kill lands at once, before the child runs."""

    def random(self) -> float:
        return 0.0


@pytest.mark.parametrize("fresh", [False, True])
def test_a_kill_before_the_child_runs_a_line(tmp_path: Path, fresh: bool) -> None:
    """Regression: a kill that beat the forked child to creating its stderr file crashed the parent."""
    chain = Chain.start(str(tmp_path / "chain"), SAMPLERS[0])
    assert run_child(chain, 1, _AtOnce(), 0.5, fresh) == (-signal.SIGKILL, "")



class _ListLog:
    """The workload's log, kept in memory."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []

    def append(self, **op: Any) -> None:
        self.ops.append(op)


class _Rigged(random.Random):
    """Draws ``how`` for the refused item, the first lease as its victim, and raw (or encoded) rows."""

    def __init__(self, how: str, encoded: bool) -> None:
        super().__init__(0)
        self.how, self.encoded = how, encoded

    def choice(self, seq: Any) -> Any:
        return self.how

    def randrange(self, *args: Any) -> int:
        return 0

    def random(self) -> float:
        return 0.9 if self.encoded else 0.0


class _AppliesEverything:
    """A broken store: its commit_many acknowledges every item, the one it had to refuse too."""

    def __init__(self, buf: ReplayBuffer) -> None:
        self.config = buf.config

    def commit_many(self, items: list[dict[str, Any]]) -> list[CommitResult]:
        return [CommitResult(item["lease"].group_id, ready=False) for item in items]


@pytest.mark.parametrize("encoded", [False, True], ids=["rows", "encoded"])
@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_a_commit_many_batch_acknowledges_each_item_and_refuses_the_wrong_one(tmp_path: Path, how: str,
                                                                              encoded: bool) -> None:
    with ReplayBuffer.create(str(tmp_path / "live.kv"), workload_config(SAMPLERS[2])) as buf:
        leases = buf.admit([Prompt(0), Prompt(1)], dataloader_state=b"2")
        log = _ListLog()
        Workload(buf, log, str(tmp_path), seed=0).commit_many(leases, _Rigged(how, encoded))
        assert [(op["op"], op.get("via")) for op in log.ops].count(("commit", "many")) == 2, log.ops
        [refused] = [op for op in log.ops if op["op"] == "refused"]
        assert refused["error"] == {"foreign": "ForeignLease", "duplicate": "DuplicateCommit"}[how]
        admitted = {"op": "admit", "gids": [lease.group_id for lease in leases], "idx": [0, 1], "cursor": 2}
        assert check_history([admitted, *log.ops], holdings(buf)) == []
        broken = _ListLog()
        more = buf.admit([Prompt(2), Prompt(3)], dataloader_state=b"4")
        Workload(_AppliesEverything(buf), broken, str(tmp_path), seed=0).commit_many(more, _Rigged(how, encoded))
    assert [op["what"].split(":")[0] for op in broken.ops if op["op"] == "violation"] == [
        f"commit_many applied the {how} item of {more[0].group_id!r}"]


def test_the_campaign_runs_where_mfusepy_is_installed_but_finds_no_libfuse(tmp_path: Path) -> None:
    """The fork server preloads mfusepy for the power-cut children, and a preload may only fail with
    ImportError; mfusepy raises OSError where it finds no libfuse (here: its own
    ``FUSE_LIBRARY_NAME`` naming a library that does not exist), which killed the server and so
    every kill cycle. The kill campaign needs no FUSE: it runs, in a fresh interpreter."""
    if importlib.util.find_spec("mfusepy") is None:  # find it without importing it (that raises here)
        pytest.skip("mfusepy is not installed")
    code = textwrap.dedent("""
        import sys
        from kvckpt.testing.campaigns.kill import run_crash_campaign
        result = run_crash_campaign(2, seed=1, directory=sys.argv[1])
        print(result.summary())
        sys.exit(1 if result.violations else 0)
    """)
    env = {**os.environ, "FUSE_LIBRARY_NAME": "kvckpt-no-such-fuse-library"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "campaign")], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "kills 2" in done.stdout and "violations found 0" in done.stdout, done.stdout


def test_a_value_store_that_does_not_open_is_reported_with_what_was_acknowledged(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / VALUES_FILE).write_bytes(b"")  # what LMDB without fsync can leave after a power cut
    found: list[str] = []
    ops = [{"op": "vstart", "state": {}}, {"op": "vintent", "puts": {"k00": "w"}, "deletes": []}, {"op": "vput"}]
    assert check_values(str(tmp_path), ops, str(tmp_path), found.append) == 0
    assert len(found) == 1 and found[0].startswith("the value store does not open (1 acknowledged value operations)")
