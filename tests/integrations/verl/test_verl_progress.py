"""The verl rollout server's token progress recorder (``ServerProgress``) against a real ledger file, in-process.

The recorder is what ``KvckptHttpServer`` runs from verl's streaming loop
(tests/integrations/verl/test_verl_stream_crash.py drives it through verl's own server and client); here each
guarantee is checked alone: one ledger call per flush across requests, nothing dropped when the ledger is slow
(coalesced, then waited for), a request's tail durable before it returns, each token's own weight version, a stale
run's flushes refused and counted, a gap refused.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _paths import ROOT

pytestmark = pytest.mark.verl
pytest.importorskip("verl")  # runs in .venv-verl (scripts/peer_envs/verl.txt)

from kvckpt.integrations.verl.config import LedgerSettings  # noqa: E402
from kvckpt.integrations.verl.errors import ProgressGap, StaleRun  # noqa: E402
from kvckpt.integrations.verl.ledger import VerlLedger  # noqa: E402
from kvckpt.integrations.verl.progress import BACKLOG, SampleKey, ServerProgress  # noqa: E402

from kvckpt.errors import BadArgument  # noqa: E402

EVERY = 4


class LedgerSink:
    """``VerlLedger.record_progress`` awaited, optionally held at a gate (a slow ledger), calls counted."""

    def __init__(self, ledger: VerlLedger) -> None:
        self.ledger, self.calls = ledger, []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, run: str, items: list[dict[str, Any]]) -> list[Any]:
        await self.gate.wait()
        self.calls.append([(i["uid"], i["session"], i["start"], len(i["tokens"])) for i in items])
        return self.ledger.record_progress(run, items)


def _ledger(tmp_path: Path) -> tuple[VerlLedger, str]:
    ledger = VerlLedger(str(tmp_path / "ledger.kv"))
    return ledger, ledger.open_run()["token"]


def _key(token: str, uid: str, session: int = 0, every: int = EVERY) -> SampleKey:
    return SampleKey("kvckpt_verl_ledger", token, uid, session, prompt_len=3, every=every)


async def _settle(progress: ServerProgress) -> None:
    await progress.idle()


def test_due_samples_of_all_requests_go_in_one_ledger_call(tmp_path: Path) -> None:
    ledger, token = _ledger(tmp_path)
    sink = LedgerSink(ledger)

    async def run() -> None:
        progress = ServerProgress(sink)
        samples = [progress.open(_key(token, f"u{i}"), 3) for i in range(4)]
        for n in range(1, EVERY + 1):  # one engine step: every request gains a token, then the flusher runs
            for s in samples:
                await progress.observe(s, list(range(n)), [-0.5] * n, 7)
        await _settle(progress)
        assert progress.stats["calls"] == 1 and progress.stats["chunks"] == 4

    asyncio.run(run())
    assert len(sink.calls) == 1
    for i in range(4):
        assert ledger.progress(f"u{i}", 0) == {"tokens": [0, 1, 2, 3], "logprobs": [-0.5] * 4, "versions": [7] * 4,
                                               "done": False}


def test_a_slow_ledger_coalesces_then_waits_and_drops_nothing(tmp_path: Path) -> None:
    ledger, token = _ledger(tmp_path)
    sink = LedgerSink(ledger)
    total = (BACKLOG + 3) * EVERY

    async def run() -> None:
        progress = ServerProgress(sink)
        sample = progress.open(_key(token, "u"), 3)
        sink.gate.clear()  # the ledger is behind: the first flush hangs
        streamed = 0

        async def stream() -> None:
            nonlocal streamed
            for n in range(1, total + 1):  # one engine step per token
                await progress.observe(sample, list(range(n)), [0.0] * n, n)
                streamed = n
                await asyncio.sleep(0)

        task = asyncio.ensure_future(stream())
        for _ in range(200):
            await asyncio.sleep(0)
        # the first chunk is in flight; the stream waits once the sample holds BACKLOG intervals unrecorded (the
        # one in flight included): nothing is dropped
        assert not task.done() and streamed == BACKLOG * EVERY and progress.stats["waits"] == 1
        sink.gate.set()
        await task
        await progress.close(sample, final=True)

    asyncio.run(run())
    got = ledger.progress("u", 0)
    assert got["tokens"] == list(range(total)) and got["versions"] == list(range(1, total + 1)) and got["done"]
    # what arrived during the held flush is coalesced into the next chunk (with BACKLOG 1 nothing can arrive: the
    # stream waits at once, and the next chunk is a plain interval)
    assert [c[0][2:] for c in sink.calls][:2] == [(0, EVERY), (EVERY, max(BACKLOG - 1, 1) * EVERY)]


def test_close_makes_an_aborted_requests_tail_durable_before_it_returns(tmp_path: Path) -> None:
    ledger, token = _ledger(tmp_path)

    async def run() -> None:
        progress = ServerProgress(LedgerSink(ledger))
        sample = progress.open(_key(token, "u"), 3 + 2)  # a resumed request: 2 tokens of the sample were sent back
        ledger.record_progress(token, [{"uid": "u", "session": 0, "start": 0, "tokens": [9, 9], "logprobs": [0, 0],
                                        "versions": [0, 0]}])
        await progress.observe(sample, [5, 6, 7], [-1.0, -2.0, -3.0], 1)  # fewer than EVERY: not due
        assert ledger.progress("u", 0)["tokens"] == [9, 9]
        await progress.close(sample, final=False)  # the weight-sync abort
        assert ledger.progress("u", 0) == {"tokens": [9, 9, 5, 6, 7], "logprobs": [0, 0, -1.0, -2.0, -3.0],
                                           "versions": [0, 0, 1, 1, 1], "done": False}

    asyncio.run(run())


def test_a_drain_past_its_deadline_stops_the_servers_samples_and_counts_the_tail_not_made_durable(
        tmp_path: Path) -> None:
    """The rollout server's recorder drained (a preemption notice: ``drain_all``, as ``drain_on_sigterm`` runs it)
    while the ledger does not answer: the drain returns at its deadline, stops every sample and says how many
    tail tokens it did not make durable; once the ledger answers, the flush that was in flight lands, once."""
    import time

    ledger, token = _ledger(tmp_path)
    sink = LedgerSink(ledger)

    async def run() -> None:
        progress = ServerProgress(sink)
        sample = progress.open(_key(token, "u"), 3)
        await progress.observe(sample, list(range(EVERY)), [0.0] * EVERY, 1)
        await _settle(progress)  # one interval durable
        sink.gate.clear()  # the ledger stops answering
        await progress.observe(sample, list(range(EVERY + 3)), [0.0] * (EVERY + 3), 1)  # a tail of 3, not due
        report = await asyncio.to_thread(progress.recorder.drain, time.monotonic() + 0.05)
        assert not report.in_time and (report.drained, report.undrained, report.tokens_not_durable) == (0, 1, 3)
        assert progress.recorder.stopped() == {0} and ledger.progress("u", 0)["tokens"] == list(range(EVERY))
        sink.gate.set()
        await _settle(progress)

    asyncio.run(run())
    assert ledger.progress("u", 0)["tokens"] == list(range(EVERY + 3))


def test_each_token_keeps_the_version_that_made_it(tmp_path: Path) -> None:
    ledger, token = _ledger(tmp_path)

    async def run() -> None:
        progress = ServerProgress(LedgerSink(ledger))
        sample = progress.open(_key(token, "u", every=100), 3)
        await progress.observe(sample, [1, 2], None, 3)
        await progress.observe(sample, [1, 2, 3], None, 4)  # new weights arrived between the two outputs
        await progress.close(sample, final=True)

    asyncio.run(run())
    assert ledger.progress("u", 0)["versions"] == [3, 3, 4]


def test_a_zombie_of_a_replaced_run_writes_nothing_and_is_counted(tmp_path: Path) -> None:
    ledger, old = _ledger(tmp_path)
    ledger.open_run()  # the restart

    async def run() -> tuple[dict[str, int], Any]:
        progress = ServerProgress(LedgerSink(ledger))
        sample = progress.open(_key(old, "u"), 3)
        for n in range(1, 3 * EVERY + 1):
            await progress.observe(sample, list(range(n)), None, 0)
            await asyncio.sleep(0)
        await progress.close(sample, final=True)
        return progress.stats, sample.refused

    stats, refused = asyncio.run(run())
    assert ledger.progress("u", 0) is None
    # refused per chunk, as the buffer refuses a fenced lease's (not the whole call)
    assert isinstance(refused, StaleRun) and refused.run == old
    assert stats["chunks"] == 0 and stats["refused_calls"] == 0 and stats["refused_tokens"] == 3 * EVERY


def test_a_chunk_that_does_not_start_at_the_durable_end_is_refused(tmp_path: Path) -> None:
    ledger, token = _ledger(tmp_path)
    chunk = {"uid": "u", "session": 1, "tokens": [1], "logprobs": [0.0], "versions": [0]}
    assert ledger.record_progress(token, [{**chunk, "start": 0}, {**chunk, "uid": "v", "start": 0}]) == [1, 1]
    results = ledger.record_progress(token, [{**chunk, "start": 2}, {**chunk, "uid": "v", "start": 1}])
    assert isinstance(results[0], ProgressGap) and results[1] == 2
    assert ledger.progress("u", 1)["tokens"] == [1] and ledger.progress("v", 1)["tokens"] == [1, 1]
    assert ledger.record_progress(token, [{"uid": "u", "session": 1, "drop": True}]) == [0]
    assert ledger.progress("u", 1) is None


def test_the_interval_is_one_key_of_sampler_kwargs_kvckpt() -> None:
    assert LedgerSettings.from_sampler_kwargs({"kvckpt": {"path": "/x"}}).progress_every_tokens == 256
    assert LedgerSettings.from_sampler_kwargs({"kvckpt": {"path": "/x", "progress_every_tokens": 64}}
                                              ).progress_every_tokens == 64
    with pytest.raises(BadArgument, match="progress_every_tokens"):
        LedgerSettings.from_sampler_kwargs({"kvckpt": {"path": "/x", "progress_every_tokens": "64"}})


def test_the_documented_agent_loop_configuration_selects_kvckpts_agent_loop() -> None:
    """docs/integrations.md's two blocks: the interval parses, the agent-loop file's target is kvckpt's loop, which
    verl's own registry knows by the name ``default_agent_loop`` gives."""
    import importlib
    import re

    import yaml

    text = (ROOT / "docs" / "integrations.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kvckpt_single_turn" in b]
    config, registration = blocks
    name = config["actor_rollout_ref"]["rollout"]["agent"]["default_agent_loop"]
    settings = LedgerSettings.from_sampler_kwargs(config["trainer"]["v1"]["sampler"]["sampler_kwargs"])
    assert settings.progress_every_tokens == 256
    module, cls = registration[0]["_target_"].rsplit(".", 1)
    client = importlib.import_module(module)
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    assert registration[0]["name"] == name == client.AGENT_LOOP
    assert _agent_loop_registry[name]["_target_"] == registration[0]["_target_"]
    assert issubclass(getattr(client, cls), SingleTurnAgentLoop)


def test_a_restart_keeps_progress_only_of_the_prompts_it_reissues(tmp_path: Path) -> None:
    from kvckpt.integrations.verl.errors import StaleRun

    ledger, old = _ledger(tmp_path)
    chunk = {"session": 0, "start": 0, "tokens": [1, 2], "logprobs": [0.0, 0.0], "versions": [0, 0]}
    ledger.record_progress(old, [{**chunk, "uid": "kept"}, {**chunk, "uid": "done"}, {**chunk, "uid": "kept",
                                                                                       "session": 1}])
    token = ledger.open_run()["token"]
    with pytest.raises(StaleRun):
        ledger.settle_progress(old, ["kept"])
    assert ledger.settle_progress(token, ["kept"]) == 1  # the finished prompt's chunk: one record
    assert ledger.progress("done", 0) is None
    assert ledger.progress("kept", 0)["tokens"] == [1, 2] and ledger.progress("kept", 1)["tokens"] == [1, 2]


def test_the_put_that_ends_a_group_drops_its_samples_progress_in_its_own_transaction(tmp_path: Path) -> None:
    """``VerlLedger.put``'s ``ended``: the group's status and the deletion of its samples' progress are one write
    transaction (a refused put does neither); a trajectory's put, and every other prompt's progress, keep it."""
    from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
    from kvckpt.integrations.verl.errors import StaleRun
    from kvckpt.integrations.verl.records import TAG, record_key

    ledger, old = _ledger(tmp_path)
    chunk = {"start": 0, "tokens": [1, 2], "logprobs": [0.0, 0.0], "versions": [0, 0], "final": True}
    ledger.record_progress(old, [{**chunk, "uid": u, "session": s} for u in ("u", "u2") for s in (0, 1)])

    def status(uid: str, value: str) -> tuple[list[str], list[bytes]]:
        key = record_key("train", uid, TAG, "status")
        return [key], [encode_value(key, value, new_write_id(), 1)]

    ledger.put(old, *status("u_0_0", "success"))  # a trajectory stored: its sample's progress stays
    assert ledger.progress("u", 0)["done"]
    token = ledger.open_run()["token"]
    with pytest.raises(StaleRun):
        ledger.put(old, *status("u", "finished"), ended=["u"])
    assert ledger.progress("u", 0)["done"] and ledger.snapshot()["items"] == {"train": {"u_0_0": {
        "tags": {"status": "success"}, "fields": {}}}}
    ledger.put(token, *status("u", "finished"), ended=["u"])
    assert ledger.progress("u", 0) is None and ledger.progress("u", 1) is None
    assert ledger.progress("u2", 0)["tokens"] == [1, 2] and ledger.progress("u2", 1)["done"]
    assert ledger.snapshot()["items"]["train"]["u"] == {"tags": {"status": "finished"}, "fields": {}}


def test_the_put_that_ends_a_group_is_one_lmdb_commit_with_its_progress_deletion(tmp_path: Path) -> None:
    """The ending put's status and the deletion of its samples' progress are ONE write transaction, counted on
    the ledger file itself (LMDB's last transaction id): a put that deleted the progress in a second
    transaction, or not at all, leaves a moment (a kill) where the group has ended and its progress is still
    there, or the reverse. A put that ends nothing is one commit too."""
    from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
    from kvckpt.integrations.verl.records import TAG, record_key

    ledger, token = _ledger(tmp_path)
    env = ledger._values._store.env  # the ledger's own LMDB environment: its commits are what is counted
    chunk = {"start": 0, "tokens": [1, 2, 3], "logprobs": [0.0] * 3, "versions": [0] * 3}
    ledger.record_progress(token, [{**chunk, "uid": "u", "session": s} for s in (0, 1)])
    key = record_key("train", "u", TAG, "status")

    def commits(ended: list[str] | None) -> int:
        before = env.info()["last_txnid"]
        ledger.put(token, [key], [encode_value(key, "finished" if ended else "running", new_write_id(), 1)],
                   ended=ended)
        return env.info()["last_txnid"] - before

    assert commits(None) == 1 and ledger.progress("u", 0)["tokens"] == [1, 2, 3]
    assert commits(["u"]) == 1
    assert ledger.progress("u", 0) is None and ledger.progress("u", 1) is None
    assert ledger.snapshot()["items"]["train"]["u"] == {"tags": {"status": "finished"}, "fields": {}}


def test_an_ending_put_and_a_settle_read_what_they_delete_inside_their_write_transaction(tmp_path: Path,
                                                                                        monkeypatch: Any) -> None:
    """``put(ended=...)`` and ``settle_progress`` list the progress they delete inside their one write transaction,
    not before it, so neither relies on the ledger's mutex: a chunk that lands after the call began and before its
    transaction opens (a writer the mutex does not hold out: here the ledger's own value store, called at that
    moment) is deleted with the rest. A listing taken before the transaction misses it, and a finished group's
    progress (or a prompt no restart reissues) would outlive it."""
    from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
    from kvckpt.integrations.verl.records import PROGRESS, TAG, record_key

    ledger, token = _ledger(tmp_path)
    chunk = {"start": 0, "tokens": [1, 2], "logprobs": [0.0, 0.0], "versions": [0, 0]}
    ledger.record_progress(token, [{**chunk, "uid": u, "session": 0} for u in ("u", "gone", "kept")])
    store, pending = ledger._values, []
    write = store._store.write

    def late_writer_then(fn: Any) -> Any:  # every LMDB write transaction of the ledger file opens here
        while pending:
            uid, session = pending.pop()
            store.record_progress([{"group": uid, "index": session, **chunk}], max_tokens=ledger.max_tokens,
                                  prefix=PROGRESS)
        return write(fn)

    monkeypatch.setattr(store._store, "write", late_writer_then)
    key = record_key("train", "u", TAG, "status")
    pending.append(("u", 1))
    ledger.put(token, [key], [encode_value(key, "finished", new_write_id(), 1)], ended=["u"])
    assert not pending and ledger.progress("u", 0) is None and ledger.progress("u", 1) is None
    pending.append(("gone", 1))
    assert ledger.settle_progress(token, ["kept"]) == 2
    assert not pending and ledger.progress("gone", 0) is None and ledger.progress("gone", 1) is None
    assert ledger.progress("kept", 0)["tokens"] == [1, 2]


def test_progress_newer_than_the_trainers_step_is_refused_as_the_buffer_refuses_it(tmp_path: Path) -> None:
    """The trainer's step (``trainer_step``, verl's ``global_steps`` reported before each sample; a restart's
    ``resume`` drops it) is the newest weight version a token may carry, read inside the progress transaction: a
    later one is :class:`kvckpt.errors.FutureVersion`, the buffer's class, raised by the core rule; nothing of the
    chunk is written. While no step is reported (a new ledger, a restart before its first sample) no version is
    checked."""
    from kvckpt.errors import FutureVersion

    ledger, token = _ledger(tmp_path)

    def record(start: int, versions: list[int], uid: str = "g") -> Any:
        return ledger.record_progress(token, [{"uid": uid, "session": 0, "start": start, "tokens": [7] * len(versions),
                                               "logprobs": [-0.5] * len(versions), "versions": versions}])[0]

    assert record(0, [5]) == 1  # no step reported yet
    ledger.trainer_step(token, 2)
    refused = record(0, [1, 3], uid="h")
    assert isinstance(refused, FutureVersion) and "the trainer is at step 2" in str(refused)
    assert ledger.progress("h", 0) is None
    assert record(0, [1, 2], uid="h") == 2
    ledger.trainer_step(token, 1)  # (a trainer's step only goes up within a run; the rule reads what it holds)
    assert isinstance(record(2, [2], uid="h"), FutureVersion) and record(2, [1], uid="h") == 3
    ledger.resume(token, 0)  # a restart: the resumed trainer reports its step again at its first sample
    assert record(3, [4], uid="h") == 4
    current = ledger.open_run()["token"]  # a restart: the old run's token is stale
    with pytest.raises(StaleRun):
        ledger.trainer_step(token, 9)
    with pytest.raises(BadArgument):
        ledger.trainer_step(current, -1)


# -- one rule set: the ledger's progress is the replay buffer's (issue 45) -----------------------------------------
class _BufferKind:
    """The replay buffer's progress (``record_progress_many`` items) of one group; fenced by a redispatch."""

    def __init__(self, tmp_path: Path, max_tokens: int) -> None:
        from kvckpt import BufferConfig, Prompt, ReplayBuffer

        self.buf = ReplayBuffer.create(str(tmp_path / "buf.kv"), BufferConfig(
            group_size=2, max_buffered_rollouts=4, schema={"fields": {"input_ids": ("int64", "token")},
                                                           "max_tokens": max_tokens}))
        [self.lease] = self.buf.admit([Prompt(0)])

    def record(self, index: int, start: int, tokens: list[int], version: int = 0) -> Any:
        return self.buf.record_progress_many([{"lease": self.lease, "index": index, "start": start, "tokens": tokens,
                                               "logprobs": [-0.5] * len(tokens), "weight_version": version}])[0]

    def fence(self) -> None:
        self.buf.redispatch(self.lease.group_id)

    def tokens(self, index: int) -> list[int]:
        held = self.buf.progress(self.lease.group_id).get(index)
        return [] if held is None else held.tokens.tolist()


class _LedgerKind:
    """The verl ledger's progress of one prompt; fenced by a restart's new run."""

    def __init__(self, tmp_path: Path, max_tokens: int) -> None:
        self.ledger = VerlLedger(str(tmp_path / "ledger.kv"), max_tokens=max_tokens)
        self.token = self.ledger.open_run()["token"]
        self.ledger.trainer_step(self.token, 0)  # the trainer's version, as a new buffer's

    def record(self, index: int, start: int, tokens: list[int], version: int = 0) -> Any:
        return self.ledger.record_progress(self.token, [{"uid": "g", "session": index, "start": start, "tokens": tokens,
                                                         "logprobs": [-0.5] * len(tokens),
                                                         "versions": [version] * len(tokens)}])[0]

    def fence(self) -> None:
        self.ledger.open_run()

    def tokens(self, index: int) -> list[int]:
        return (self.ledger.progress("g", index) or {"tokens": []})["tokens"]


#: ``(what, fence first, index, start, tokens, the answer: the durable length or the refusal's class[, the tokens'
#: weight version, 0 by default])``, in order, with max_tokens 8.
RULES = [
    ("the first chunk", False, 0, 0, [1, 2, 3], 3),
    ("its resend", False, 0, 0, [1, 2, 3], 3),
    ("a gap", False, 0, 5, [6], "ProgressGap"),
    ("other tokens where some are durable", False, 0, 2, [9, 4], "DuplicateCommit"),
    ("a chunk past max_tokens", False, 0, 3, [4, 5, 6, 7, 8, 9], "SchemaMismatch"),
    ("the next chunk", False, 0, 3, [4], 4),
    ("another sample", False, 1, 0, [7], 1),
    ("a chunk of a weight version after the trainer's", False, 0, 4, [5], "FutureVersion", 1),
    ("a fenced writer's resend of a landed chunk", True, 0, 3, [4], 4),
    ("a fenced writer's new chunk", False, 0, 4, [5], "StaleAttempt"),
    ("a fenced writer's new sample", False, 1, 1, [8], "StaleAttempt"),
]


@pytest.mark.parametrize("kind", [_BufferKind, _LedgerKind], ids=["buffer", "ledger"])
def test_the_ledgers_progress_is_refused_and_answered_exactly_as_the_buffers(tmp_path: Path, kind: Any) -> None:
    """The same cases against both store kinds, in order, each answer the same: a gap, other tokens at a durable
    position, a chunk past max_tokens (each refused, nothing written), a resend (the first answer, even from a
    fenced writer), a fenced writer's new chunk (a StaleAttempt: the ledger's StaleRun is one)."""
    import kvckpt.errors as errors

    store = kind(tmp_path, max_tokens=8)
    for what, fence, index, start, tokens, want, *version in RULES:
        if fence:
            store.fence()
        got = store.record(index, start, tokens, *version)
        if isinstance(want, int):
            assert got == want, what
        else:
            assert isinstance(got, getattr(errors, want)), (what, got)
    assert (store.tokens(0), store.tokens(1)) == ([1, 2, 3, 4], [7])


GOLDEN = ROOT / "tests" / "golden" / "verl-ledger-progress1.kvckpt"


def _as_read(progress: dict[str, Any] | None) -> Any:
    """A ledger's progress as the golden file's JSON holds it (NaN logprobs as "nan")."""
    if progress is None:
        return None
    return {**progress, "logprobs": ["nan" if x != x else x for x in progress["logprobs"]]}


def test_a_format_1_ledger_opens_and_reads_as_before(tmp_path: Path) -> None:
    """``tests/golden/verl-ledger-progress1.kvckpt`` was written by kvckpt main 9ba6a5c's ledger (its own progress
    records, format 1: three records per chunk, a per-token version change inside a chunk, an empty final flush, a
    NaN logprob); ``.json`` is what that ledger read back. Opened now, it reads the same, holds format 2 only (the
    other records untouched), takes the next chunk at its durable end, and reopens unchanged."""
    from kvckpt import ValueStore

    golden = json.loads(GOLDEN.with_suffix(".json").read_text())
    path = tmp_path / "ledger.kv"
    shutil.copyfile(GOLDEN, path)
    ledger = VerlLedger(str(path))
    for name, want in golden["progress"].items():
        uid, session = name.split("/")
        assert _as_read(ledger.progress(uid, int(session))) == want, name
    token = ledger.open_run()["token"]
    assert ledger.record_progress(token, [{"uid": "u1", "session": 0, "start": 5, "tokens": [16], "logprobs": [0.0],
                                           "versions": [5]}]) == [6]
    ledger.close()
    values = ValueStore(str(path))
    keys = values.keys()
    values.close()
    assert [k for k in golden["keys"] if not k.startswith("verl/progress/")] == \
        [k for k in keys if not k.startswith("verl/progress/")]
    assert sorted(k for k in keys if k.startswith("verl/progress/")) == [
        "verl/progress/u1/0/0000000000", "verl/progress/u1/0/0000000002", "verl/progress/u1/0/0000000004",
        "verl/progress/u1/0/0000000005", "verl/progress/u1/1.done", "verl/progress/u1/1/0000000000",
        "verl/progress/u1/1/0000000002", "verl/progress/u2/0.done", "verl/progress/u2/0/0000000000"]
    reopened = VerlLedger(str(path))
    assert reopened.progress("u1", 0)["tokens"] == [11, 12, 13, 14, 15, 16]
    assert _as_read(reopened.progress("u1", 1)) == golden["progress"]["u1/1"]
    reopened.close()


def test_a_format_1_ledger_the_buffers_rules_refuse_is_not_opened_and_not_changed(tmp_path: Path) -> None:
    """The upgrade is one transaction: a format-1 sample longer than ``max_tokens`` refuses the open with a
    FormatError naming the problem, and the file keeps every format-1 record (it opens with a larger limit)."""
    from kvckpt.errors import FormatError

    path = tmp_path / "ledger.kv"
    shutil.copyfile(GOLDEN, path)
    with pytest.raises(FormatError, match="max_tokens 4"):
        VerlLedger(str(path), max_tokens=4)
    ledger = VerlLedger(str(path))
    assert ledger.progress("u1", 0)["tokens"] == [11, 12, 13, 14, 15]
    ledger.close()


def test_a_zombies_drop_and_final_mark_are_refused_and_change_nothing(tmp_path: Path) -> None:
    """A replaced run's call is refused item by item (``StaleRun``) and writes nothing: not its drop, not its done
    mark; a final chunk the rules refuse (a gap) marks nothing done either."""
    ledger, old = _ledger(tmp_path)
    chunk = {"session": 0, "start": 0, "tokens": [1, 2], "logprobs": [0.0, 0.0], "versions": [0, 0]}
    assert ledger.record_progress(old, [{**chunk, "uid": "u"}, {**chunk, "uid": "x", "start": 3, "final": True}]
                                  )[0] == 2
    assert ledger.progress("x", 0) is None
    ledger.open_run()
    out = ledger.record_progress(old, [{"uid": "u", "session": 0, "drop": True}, {**chunk, "uid": "w", "final": True}])
    assert all(isinstance(r, StaleRun) and r.run == old for r in out)
    assert ledger.progress("u", 0)["tokens"] == [1, 2] and ledger.progress("w", 0) is None


def test_a_format_1_checkpoint_loaded_into_a_ledger_reads_as_before(tmp_path: Path) -> None:
    """A checkpoint an older kvckpt's ledger wrote (format 1, stamped) that ``load`` copies in is upgraded too."""
    from kvckpt import ValueStore

    old = tmp_path / "old.kv"
    shutil.copyfile(GOLDEN, old)
    values = ValueStore(str(old))  # the value store itself: no upgrade, the checkpoint keeps format 1
    stamp = values.checkpoint(str(tmp_path / "ckpt.kv"))
    values.close()
    ledger, token = _ledger(tmp_path)
    assert ledger.load(str(tmp_path / "ckpt.kv"), stamp["checkpoint_id"], token) is True
    golden = json.loads(GOLDEN.with_suffix(".json").read_text())
    for name, want in golden["progress"].items():
        uid, session = name.split("/")
        assert _as_read(ledger.progress(uid, int(session))) == want, name
    assert ledger.record_progress(token, [{"uid": "u1", "session": 0, "start": 5, "tokens": [16], "logprobs": [0.0],
                                           "versions": [5]}]) == [6]
    ledger.close()
