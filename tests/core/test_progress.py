"""Token progress (issue 25): append semantics, fencing from every abandoned timeline and stale
attempt, resume through recover / restore / redispatch in a fresh process, the checkpoint cut,
hostile input (each refusal a specific error that writes nothing, proven by ``refused``), the
commit's prefix check and what the committed row and group record keep.

Recovery cases restart the world: the producer runs in a child process that records progress
and dies by SIGKILL right after its last acknowledgement; the trainer's side opens the file in a
fresh process and asserts what a resumed attempt does next.
"""

from __future__ import annotations

import os

import lmdb
import pytest
import torch
from _buffers import refused
from _fresh import run_fresh

from kvckpt import (
    AbandonedTimeline,
    BadArgument,
    BufferConfig,
    DuplicateCommit,
    ForeignLease,
    FutureVersion,
    LeaseMismatch,
    Prompt,
    ReplayBuffer,
    SampleCommitted,
    SchemaMismatch,
    StaleAttempt,
    UnknownGroup,
    check,
    restore,
)
from kvckpt.storage import codec
from kvckpt.storage.layout import stored_key

#: The vLLM worker's row fields plus the per-token weight versions (docs/recovery.md, "Progress").
PSCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
           "token_mask": ("int64", "token"), "token_versions": ("int64", "token"), "total_reward": ("float32", "row")}
PROMPT = [101, 102, 103]


def make(tmp_path, name="buf.kv", **config) -> ReplayBuffer:
    config.setdefault("schema", PSCHEMA)
    config.setdefault("max_buffered_rollouts", 8)
    return ReplayBuffer.create(str(tmp_path / name), BufferConfig(group_size=2, **config))


def row(completion, versions=None, reward=1.0):
    """A row as the vLLM worker builds it: prompt + completion, the mask on the completion."""
    n = len(completion)
    versions = [0] * n if versions is None else list(versions)
    return {"input_ids": torch.tensor(PROMPT + list(completion)),
            "generation_logprobs": torch.tensor([0.0] * len(PROMPT) + [-0.5] * n),
            "token_mask": torch.tensor([0] * len(PROMPT) + [1] * n),
            "token_versions": torch.tensor([-1] * len(PROMPT) + versions),
            "total_reward": torch.tensor(reward)}


def chunk(buf, lease, index, start, tokens, version=0, **kw):
    return buf.record_progress(lease, index, start=start, tokens=tokens,
                               logprobs=[-0.25 * (start + i) for i in range(len(tokens))], weight_version=version, **kw)


def prefix(buf, lease, index=0):
    got = buf.progress(lease).get(index)
    return None if got is None else (got.tokens.tolist(), got.versions.tolist())


# -- append, retry, conflict ------------------------------------------------------------------------

def test_chunks_append_a_retry_is_a_noop_and_a_conflict_or_gap_is_refused(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    assert buf.progress(lease) == {}
    assert chunk(buf, lease, 0, 0, [5, 6, 7]) == 3
    assert chunk(buf, lease, 0, 3, [8]) == 4
    assert chunk(buf, lease, 0, 0, [5, 6, 7]) == 3  # a retry after a lost acknowledgement: its first answer
    assert chunk(buf, lease, 1, 0, [9]) == 1
    refused(buf, DuplicateCommit, chunk, buf, lease, 0, 0, [5, 6, 0])  # other tokens at a covered position
    refused(buf, DuplicateCommit, chunk, buf, lease, 0, 1, [6, 7])  # inside a recorded chunk
    error = refused(buf, BadArgument, chunk, buf, lease, 0, 5, [1])
    assert "the next chunk starts at 4 (a gap)" in str(error)
    got = buf.progress(lease.group_id)
    assert sorted(got) == [0, 1] and got[0].length == 4 and got[0].tokens.tolist() == [5, 6, 7, 8]
    assert got[0].logprobs.tolist() == [0.0, -0.25, -0.5, -0.75] and got[0].versions.tolist() == [0] * 4
    assert (got[0].tokens.dtype, got[0].logprobs.dtype, got[0].versions.dtype) == (torch.int64, torch.float32,
                                                                                    torch.int64)
    assert buf.store.read(check).ok


def test_a_resend_of_record_progress_many_items_is_answered_as_a_step_messages_resend(tmp_path):
    """Items are one step message (the one wire form): their resend after the store's restart (which fences every
    lease: a new timeline) gets the first answer and writes nothing, exactly as the message's own resend does; a
    chunk that had not landed is refused as fenced."""
    path = str(tmp_path / "buf.kv")
    with make(tmp_path) as buf:
        [lease] = buf.admit([Prompt(0)])
        items = [{"lease": lease, "index": i, "start": 0, "tokens": [5 + i, 6], "logprobs": [-1.0, -1.0],
                  "weight_version": 0} for i in (0, 1)]
        first = buf.record_progress_many(items)
        message = buf.progress_encoder().encode_items(items)
    assert first == [2, 2]
    with ReplayBuffer.open(path) as buf:  # the owner restarted: recovery moved every lease to a new timeline
        buf.recover(0)
        assert buf.record_progress_many(items) == first == buf.record_progress_step(message)
        unlanded = buf.record_progress_many([{**items[0], "start": 2, "tokens": [7]} | {"logprobs": [-1.0]}])
        assert isinstance(unlanded[0], AbandonedTimeline)
        assert [p.tokens.tolist() for _, p in sorted(buf.progress(lease.group_id).items())] == [[5, 6], [6, 6]]


def test_record_progress_many_is_one_transaction_of_independent_transitions(tmp_path):
    buf = make(tmp_path)
    leases = buf.admit([Prompt(0), Prompt(1)])
    before = buf.committer.stats["transactions"]
    items = [{"lease": leases[0], "index": 0, "start": 0, "tokens": [1, 2], "logprobs": [-1.0, -1.0],
              "weight_version": 0},
             {"lease": leases[1], "index": 1, "start": 3, "tokens": [1], "logprobs": [-1.0], "weight_version": 0},
             {"lease": leases[1], "index": 0, "start": 0, "tokens": [4], "logprobs": [-1.0, -2.0],
              "weight_version": 0},
             {"lease": leases[1], "index": 0},
             {"lease": leases[1], "index": 1, "start": 0, "tokens": [3], "logprobs": [-1.0], "weight_version": 0}]
    results = buf.record_progress_many(items)
    assert results[0] == 2 and results[4] == 1
    assert isinstance(results[1], BadArgument) and "gap" in str(results[1])
    assert isinstance(results[2], SchemaMismatch) and isinstance(results[3], BadArgument)
    assert buf.committer.stats["transactions"] == before + 1
    assert prefix(buf, leases[0]) == ([1, 2], [0, 0]) and prefix(buf, leases[1], 1) == ([3], [0])
    assert prefix(buf, leases[1], 0) is None


def test_generation_fields_ride_with_the_chunk(tmp_path):
    buf = make(tmp_path, schema={**PSCHEMA, "routed_experts": ("int32", "token", (2,))})
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6], fields={"routed_experts": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)})
    chunk(buf, lease, 0, 2, [7], fields={"routed_experts": torch.tensor([[5, 6]], dtype=torch.int32)})
    got = buf.progress(lease)[0]
    assert got.fields["routed_experts"].tolist() == [[1, 2], [3, 4], [5, 6]]
    refused(buf, SchemaMismatch, chunk, buf, lease, 0, 3, [8], fields={"routed_experts": torch.zeros(2, 2)})
    refused(buf, BadArgument, chunk, buf, lease, 0, 3, [8], fields={"total_reward": torch.zeros(1)})
    refused(buf, BadArgument, chunk, buf, lease, 0, 3, [8], fields={"token_versions": torch.zeros(1)})


# -- hostile input ---------------------------------------------------------------------------------------

def test_hostile_chunks_are_each_refused_with_a_specific_error_and_write_nothing(tmp_path):
    buf = make(tmp_path, schema={"fields": PSCHEMA, "max_tokens": 9})
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1, 2, 3, 4, 5, 6])
    error = refused(buf, SchemaMismatch, chunk, buf, lease, 0, 6, [7, 8, 9, 10])
    assert "prefix 10 tokens long, over the schema's max_tokens 9" in str(error)
    error = refused(buf, SchemaMismatch, buf.record_progress, lease, 0, start=6, tokens=[7, 8], logprobs=[-1.0],
                    weight_version=0)
    assert "2 tokens but 1 logprobs" in str(error)
    error = refused(buf, FutureVersion, chunk, buf, lease, 0, 6, [7], version=1)
    assert "weight version 1 is from the future" in str(error)
    refused(buf, SchemaMismatch, buf.record_progress, lease, 0, start=6, tokens=[0.5], logprobs=[-1.0],
            weight_version=0)
    refused(buf, BadArgument, chunk, buf, lease, 0, 6, [])
    refused(buf, BadArgument, chunk, buf, lease, 2, 0, [1])  # no row 2 in a group of 2
    refused(buf, BadArgument, chunk, buf, lease, 0, -1, [1])
    buf.commit_sample(lease, 0, row([1, 2, 3, 4, 5, 6]))
    error = refused(buf, SampleCommitted, chunk, buf, lease, 0, 6, [7])
    assert "is already committed" in str(error) and isinstance(error, DuplicateCommit)
    buf.commit_sample(lease, 1, row([9]))
    refused(buf, SampleCommitted, chunk, buf, lease, 1, 1, [7])  # the whole group is committed
    assert buf.store.read(check).ok


def test_a_weight_version_is_future_only_past_both_the_trainer_and_the_rollout_version(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    buf.finish_step(weight_version=3)  # the rollout weights run ahead of the trainer version (1)
    assert chunk(buf, lease, 0, 0, [1], version=3) == 1
    refused(buf, FutureVersion, chunk, buf, lease, 0, 1, [2], version=4)


def test_an_aborted_or_unknown_group_takes_no_progress_and_abort_deletes_it(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1, 2])
    buf.abort(lease.group_id, "test")
    assert buf.progress(lease) == {} and buf.store.read(check).ok
    refused(buf, UnknownGroup, chunk, buf, lease, 0, 2, [3])


# -- fencing -----------------------------------------------------------------------------------------------

def test_appends_are_fenced_like_commits(tmp_path):
    buf, other = make(tmp_path), make(tmp_path, "other.kv")
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1, 2])
    [foreign] = other.admit([Prompt(0, group_id=lease.group_id)])
    assert refused(buf, ForeignLease, chunk, buf, foreign, 0, 2, [3]).differs == "store_id"
    wrong = type(lease).from_dict({**lease.to_dict(), "start_weight": 5})
    assert refused(buf, LeaseMismatch, chunk, buf, wrong, 0, 2, [3]).field == "start_weight"
    new = buf.redispatch(lease.group_id)
    error = refused(buf, StaleAttempt, chunk, buf, lease, 0, 2, [3])
    assert error.differs == "attempt" and "progress of group" in str(error)
    assert buf.progress(new)[0].length == 2 and chunk(buf, new, 0, 2, [3]) == 3  # the new attempt continues
    plan = buf.recover()
    for zombie in (lease, new):
        assert refused(buf, AbandonedTimeline, chunk, buf, zombie, 0, 3, [4]).differs == "timeline"
    [resumed] = plan.leases
    assert (plan.progress_samples, plan.progress_tokens) == (1, 3)
    assert chunk(buf, resumed, 0, 3, [4]) == 4
    buf.commit_group(resumed, [row([1, 2, 3, 4, 5]), row([7])])
    for zombie in (lease, new):  # after the commit, a zombie is still told it is fenced
        refused(buf, AbandonedTimeline, chunk, buf, zombie, 0, 4, [5])
    refused(buf, SampleCommitted, chunk, buf, resumed, 0, 4, [5])


# -- the commit's check and what the row keeps ---------------------------------------------------------

def test_a_row_that_contradicts_its_durable_prefix_is_refused_naming_the_sample(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6, 7])
    sample = f"{lease.group_id}_g0"
    for bad in (row([5, 9, 7, 8]), row([5, 6])):
        error = refused(buf, BadArgument, buf.commit_group, lease, [bad, row([1])])
        assert f"commit of {sample} refused: the row's completion does not begin" in str(error)
        refused(buf, BadArgument, buf.commit_sample, lease, 0, bad)
        enc = buf.row_encoder().encode(lease, {0: bad})
        refused(buf, BadArgument, buf.commit_encoded, lease, enc, whole=False)
    error = refused(buf, BadArgument, buf.commit_sample, lease, 0, row([5, 6, 7, 8], versions=[0, 1, 0, 0]))
    assert "token_versions differ from the weight versions" in str(error)
    [result] = buf.commit_many([{"lease": lease, "index": 0, "rows": row([5, 0, 7])}])
    assert isinstance(result, BadArgument)
    assert prefix(buf, lease) == ([5, 6, 7], [0, 0, 0])
    assert buf.commit_sample(lease, 0, row([5, 6, 7, 8])).rows_written == 1
    assert buf.progress(lease) == {} and buf.store.read(check).ok


def test_the_group_stamp_is_the_oldest_tokens_weight_and_the_row_keeps_each_tokens(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6], version=0)
    for _ in range(2):
        buf.finish_step()
    new = buf.redispatch(lease.group_id, start_weight=2)  # the rest is generated with weights 2
    chunk(buf, new, 0, 2, [7], version=2)
    assert prefix(buf, new) == ([5, 6, 7], [0, 0, 2])
    buf.commit_sample(new, 0, row([5, 6, 7, 8], versions=[0, 0, 2, 2]))
    buf.commit_sample(new, 1, row([1], versions=[2]))
    group = buf.group(lease.group_id)
    assert group.start_weight == 0 and group.end_weight == 2
    buf.select(1)
    batch = buf.read_batch([lease.group_id], layout="list")
    assert batch.rows[0]["token_versions"].tolist() == [-1, -1, -1, 0, 0, 2, 2]


# -- resume in a fresh process ------------------------------------------------------------------------------

PRODUCER = """
    buf = ReplayBuffer.open(ARGS["path"])
    lease = Lease.from_dict(ARGS["lease"])
    acked = 0
    for start in range(0, ARGS["tokens"], 2):
        acked = buf.record_progress(lease, 0, start=start, tokens=[start, start + 1], logprobs=[-0.5, -0.5],
                                    weight_version=0)
        if acked >= ARGS["kill_at"]:
            print(json.dumps({"acked": acked}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_producer(tmp_path, kill_at=6):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    path = buf.path
    buf.close()
    got = run_fresh(PRODUCER, path=path, lease=lease.to_dict(), tokens=20, kill_at=kill_at)
    assert got["rc"] == -9 and got["out"] == {"acked": kill_at}, got["err"]
    return path, lease


RESUME = """
    buf = ReplayBuffer.open(ARGS["path"])
    old = Lease.from_dict(ARGS["lease"])
    plan = buf.recover()
    [lease] = plan.leases
    got = buf.progress(lease)[0]
    try:
        buf.record_progress(old, 0, start=got.length, tokens=[99], logprobs=[0.0], weight_version=0)
        zombie = "accepted"
    except KvckptError as exc:
        zombie = type(exc).__name__
    nxt = buf.record_progress(lease, 0, start=got.length, tokens=[got.length], logprobs=[-0.5], weight_version=0)
    done = list(range(nxt))
    def row(c):
        return {"input_ids": torch.tensor([101] + c), "generation_logprobs": torch.zeros(1 + len(c)),
                "token_mask": torch.tensor([0] + [1] * len(c)), "token_versions": torch.tensor([-1] + [0] * len(c)),
                "total_reward": torch.tensor(1.0)}
    result = buf.commit_group(lease, [row(done), row([1])])
    print(json.dumps({"tokens": got.tokens.tolist(), "versions": got.versions.tolist(), "zombie": zombie,
                      "next": nxt, "ready": result.ready, "after": len(buf.progress(lease)),
                      "plan": [plan.progress_samples, plan.progress_tokens], "ok": buf.store.read(check).ok}))
"""


def test_a_killed_producers_acknowledged_prefix_resumes_after_recover_in_a_fresh_process(tmp_path):
    path, lease = killed_producer(tmp_path)
    got = run_fresh(RESUME, path=path, lease=lease.to_dict())
    assert got["rc"] == 0, got["err"]
    assert got["out"] == {"tokens": list(range(6)), "versions": [0] * 6, "zombie": "AbandonedTimeline", "next": 7,
                          "ready": True, "after": 0, "plan": [1, 6], "ok": True}


def test_restore_under_another_sampler_and_capacity_keeps_progress_at_the_checkpoint_cut(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1, 2])
    chunk(buf, lease, 1, 0, [3])
    ckpt = str(tmp_path / "c.kvckpt")
    buf.checkpoint(ckpt, background=False)
    chunk(buf, lease, 0, 2, [4])  # after the cut: not in the checkpoint
    buf.close()
    code = """
        buf, plan = restore(ARGS["ckpt"], ARGS["live"], sampler="ready_first", max_buffered_rollouts=4)
        [lease] = plan.leases
        got = buf.progress(lease)
        print(json.dumps({"p": {i: p.tokens.tolist() for i, p in got.items()}, "sampler": buf.sampler.name,
                          "cap": buf.config.max_buffered_rollouts, "plan": [plan.progress_samples,
                                                                           plan.progress_tokens]}))
    """
    got = run_fresh(code, ckpt=ckpt, live=str(tmp_path / "restored.kv"))
    assert got["rc"] == 0, got["err"]
    assert got["out"] == {"p": {"0": [1, 2], "1": [3]}, "sampler": "ready_first", "cap": 4, "plan": [2, 3]}
    restored = ReplayBuffer.open(str(tmp_path / "restored.kv"))
    try:
        refused(restored, AbandonedTimeline, chunk, restored, lease, 0, 2, [4])
    finally:
        restored.close()


def test_restoring_the_same_checkpoint_twice_fences_the_first_restores_appends(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1])
    ckpt, live = str(tmp_path / "c.kvckpt"), str(tmp_path / "live.kv")
    buf.checkpoint(ckpt, background=False)
    buf.close()
    first, plan1 = restore(ckpt, live)
    first.close()
    second, plan2 = restore(ckpt, live, overwrite=True)
    try:
        [zombie], [legit] = plan1.leases, plan2.leases
        assert zombie.attempt == legit.attempt
        refused(second, AbandonedTimeline, chunk, second, zombie, 0, 1, [2])
        assert chunk(second, legit, 0, 1, [2]) == 2
    finally:
        second.close()


# -- the store ------------------------------------------------------------------------------------------------

def chunk_value(group_id, index, start):
    return codec.encode({"tokens": torch.tensor([1]).numpy(), "logprobs": torch.tensor([0.0]).numpy()},
                        {"group_id": group_id, "index": index, "start": start, "length": 1, "version": 0}, level=0)


@pytest.mark.parametrize("deep", [False, True])
def test_verify_reports_progress_without_a_live_sample_and_a_gap(tmp_path, deep):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [1, 2])
    buf.close()
    env = lmdb.open(str(tmp_path / "buf.kv"), subdir=False, lock=False)
    with env.begin(write=True) as txn:  # a chunk of row 1 at start 5 (a gap), and one of a group nobody owns
        gid = lease.group_id.encode()
        txn.put(stored_key("progress", gid + b"\0" + (1).to_bytes(4, "big") + (5).to_bytes(8, "big")),
                chunk_value(lease.group_id, 1, 5))
        txn.put(stored_key("progress", b"ghost\0" + bytes(12)), chunk_value("ghost", 0, 0))
    env.close()
    with ReplayBuffer.open(str(tmp_path / "buf.kv"), readonly=True) as ro:
        problems = ro.store.read(lambda t: check(t, deep=deep)).problems
    assert sorted((p.code, p.key) for p in problems) == [
        ("orphan-progress", "progress/ghost_g0@0"), ("progress", f"progress/{lease.group_id}_g1@5")]


def test_a_format_3_store_opens_and_a_writable_open_marks_it_format_4(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    buf.close()
    path = str(tmp_path / "buf.kv")
    env = lmdb.open(path, subdir=False, lock=False)
    with env.begin(write=True) as txn:
        info = codec.decode_meta(txn.get(stored_key("meta", b"format")))
        txn.put(stored_key("meta", b"format"), codec.encode_json({**info, "version": 3}))
    env.close()
    with ReplayBuffer.open(path, readonly=True) as ro:
        assert ro.store.info["version"] == 3 and ro.progress(lease) == {}
    with ReplayBuffer.open(path) as rw:
        assert (rw.store.info["version"], rw.store.info["upgraded_from"]) == (4, 3)
        assert chunk(rw, lease, 0, 0, [1]) == 1


def test_a_format_2_store_reads_as_having_no_progress(tmp_path):
    from _old_format import rewrite_as_named_tables

    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    buf.close()
    path = str(tmp_path / "buf.kv")
    rewrite_as_named_tables(path, 2)
    with ReplayBuffer.open(path, readonly=True) as ro:
        assert ro.progress(lease) == {} and ro.store.read(check).ok
    assert os.path.exists(path)
