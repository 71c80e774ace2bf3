"""Groups whose tokens span a weight sync, after a rollback past the sync (issue 49).

A group's tokens can be made by two weights: its first by the weights of version 1, its last by
version 2 after a sync landed mid-stream (TRL's server worker stamps ``start_weight`` 1 and
``end_weight`` 2; its durable progress chunks say 1, then 2). ``recover(resume_version=1)``
destroys the weights of version 2, so such a group holds tokens of a destroyed lineage: it is
forked at 1 and its staleness is its stalest token's, the version-tree distance of its newest
token, ``(2 - 1) + (current - 1)``, not ``current - 1`` as its stamp alone would say.

The world is restarted between the steps: a producer process builds each store (one per sampler)
and dies by SIGKILL right after its last acknowledgement; a fresh process recovers to version 1,
reads what every sampler's window, ``evict()`` and ``abort_stale_inflight()`` decide at versions
1, 2 and 3, and closes cleanly; a third fresh process verifies the stores and reads the stamps
again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import _golden
import pytest
from _cli import kv

from kvckpt import GroupInfo, LedgerEntry, ReplayBuffer
from kvckpt.storage import codec, keys
from tests._fresh import run_fresh

W = 2
SAMPLERS = {"windowed": {"max_staleness_versions": W}, "weight_fifo": {"max_staleness_versions": W},
            "ready_first": {"max_staleness_versions": W}, "in_order": {"max_lookahead_versions": W}}

BUILD = """
def row(tokens, versions):
    n = len(tokens)
    return {"input_ids": torch.tensor([101, *tokens]), "generation_logprobs": torch.full((1 + n,), -0.5),
            "token_mask": torch.tensor([0] + [1] * n), "token_versions": torch.tensor([-1, *versions])}
for name, keys in ARGS["samplers"].items():
    buf = ReplayBuffer.create(f"{ARGS['dir']}/{name}.kv", BufferConfig(
        group_size=1, max_buffered_rollouts=16, sampler={"name": name, **keys},
        schema={"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
                "token_mask": ("int64", "token"), "token_versions": ("int64", "token")}))
    buf.finish_step()  # trainer and weights at version 1
    names = ["plain", "tail", "chunks", "default", "inflight", "inflight1"]
    lease = dict(zip(names, buf.admit([Prompt(i, group_id=gid) for i, gid in enumerate(names)], weight_version=1,
                                      timeout=10)))
    for gid in ("chunks", "inflight", "inflight1"):  # two durable tokens of the weights of version 1
        buf.record_progress(lease[gid], 0, start=0, tokens=[7, 8], logprobs=[-0.5, -0.5], weight_version=1)
    buf.commit_group(lease["plain"], [row([5, 6], [1, 1])], end_weight=1)  # every token by weights 1
    buf.finish_step()  # the sync: weights 2
    for gid in ("chunks", "inflight"):  # the stream goes on with the weights of version 2
        buf.record_progress(lease[gid], 0, start=2, tokens=[9], logprobs=[-0.5], weight_version=2)
    buf.commit_group(lease["chunks"], [row([7, 8, 9], [1, 1, 2])])  # its versions told only by its chunks
    buf.commit_group(lease["tail"], [row([5, 6], [1, 2])], end_weight=2)  # TRL's: its tail's told by end_weight
    buf.commit_group(lease["default"], [row([5, 6], [1, 1])])  # end_weight left to the store: not a token's
    buf.finish_step()  # the trainer reaches version 3, then the kill: the run resumes from checkpoint-1
    buf.close()
print(json.dumps({"built": True}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

RECOVER = """
from kvckpt.samplers import BufferView
def row(tokens, versions):
    n = len(tokens)
    return {"input_ids": torch.tensor([101, *tokens]), "generation_logprobs": torch.full((1 + n,), -0.5),
            "token_mask": torch.tensor([0] + [1] * n), "token_versions": torch.tensor([-1, *versions])}
def stamps(buf):
    return {r.group_id: [r.start_weight, r.lineage_newest, r.lineage_fork, r.lineage_weight]
            for r in [*buf.groups(["ready"]), *buf.ledger()]}
out = {}
for name in ARGS["samplers"]:
    buf = ReplayBuffer.open(f"{ARGS['dir']}/{name}.kv")
    plan = buf.recover(resume_version=1)
    out[name] = {"plan": plan.groups_on_destroyed_lineage, "stamps": stamps(buf), "versions": {}}
    for _ in range(3):  # versions 1, 2, 3 of the resumed run
        cur = buf.trainer_version
        eligible = buf.store.read(lambda t: list(buf.sampler.eligible(BufferView(t), cur)))
        out[name]["versions"][cur] = {
            "staleness": {r.group_id: cur - r.lineage_weight for r in [*buf.groups(["ready"]), *buf.ledger()]},
            "eligible": eligible, "evicted": buf.evict(), "aborted": buf.abort_stale_inflight()}
        buf.finish_step()
    if name == "ready_first":  # the forked in-flight prompt finishes with the weights of version 4 (trained anew)
        [lease] = [lease for lease in plan.leases if lease.group_id == "inflight"]
        buf.commit_group(lease, [row([7, 8, 9, 10], [1, 1, 2, 4])], end_weight=4)
        [done] = [g for g in buf.groups() if g.group_id == "inflight"]
        out[name]["committed"] = [done.start_weight, done.end_weight, done.lineage_newest, done.lineage_fork,
                                  buf.trainer_version - done.lineage_weight]
    buf.close()
print(json.dumps(out), flush=True)
"""

REOPEN = """
out = {}
for name in ARGS["samplers"]:
    with ReplayBuffer.open(f"{ARGS['dir']}/{name}.kv", readonly=True) as buf:
        out[name] = {"ok": buf.store.read(check).ok,
                     "records": {r.group_id: [r.state, r.start_weight, r.end_weight, r.lineage_newest, r.lineage_fork]
                                 for r in buf.groups()},
                     "ledger": {e.group_id: [e.start_weight, e.lineage_newest, e.lineage_fork] for e in buf.ledger()}}
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every sampler's store built by a killed process, recovered to 1 by a fresh one, reopened by a third."""
    directory = str(tmp_path_factory.mktemp("lineage-span"))
    built = run_fresh(BUILD, dir=directory, samplers=SAMPLERS)
    assert built["rc"] == -9 and built["out"] == {"built": True}, built["err"]
    got = run_fresh(RECOVER, dir=directory, samplers=SAMPLERS)
    assert got["rc"] == 0, got["err"]
    again = run_fresh(REOPEN, dir=directory, samplers=SAMPLERS)
    assert again["rc"] == 0, again["err"]
    inspected = {"json": json.loads(kv("inspect", "--json", f"{directory}/ready_first.kv").stdout),
                 "text": kv("inspect", f"{directory}/ready_first.kv").stdout}
    return {"recover": got["out"], "reopen": again["out"], "inspect": inspected}


# start_weight, lineage_newest, lineage_fork, lineage weight right after recover(resume_version=1)
STAMPS = {
    "plain": [1, None, None, 1],  # no token past the fork: untouched
    "default": [1, None, None, 1],  # end_weight 2 is the store's version at commit, not a token's: untouched
    "tail": [1, 2, 1, 0],  # end_weight 2 given by the producer: min(1, 2 * 1 - 2)
    "chunks": [1, 2, 1, 0],  # a consumed chunk of version 2
    "inflight": [1, 2, 1, 0],  # in flight, durable chunks of versions 1 and 2
    "inflight1": [1, None, None, 1],  # in flight, durable tokens of version 1 only: untouched
}
SPANNING = {"tail", "chunks", "inflight"}


def test_a_group_spanning_the_sync_is_forked_at_the_resume_version(runs):
    """Each record with a token newer than the resume version is forked there, with its newest
    token's version kept beside the stamp, and counted in ``groups_on_destroyed_lineage``."""
    for name in SAMPLERS:
        got = runs["recover"][name]
        assert got["stamps"] == STAMPS, name
        assert got["plan"] == len(SPANNING)


def test_the_staleness_is_the_tree_distance_of_the_newest_token(runs):
    """At version ``c`` a spanning record is ``(2 - 1) + (c - 1) = c`` versions stale (its token of
    the destroyed weights 2), the others ``c - 1``; every sampler reads the same figure."""
    for name in SAMPLERS:
        for cur, got in runs["recover"][name]["versions"].items():
            cur = int(cur)
            expected = {gid: cur if gid in SPANNING else cur - 1 for gid in STAMPS}
            assert got["staleness"] == {gid: d for gid, d in expected.items() if gid in got["staleness"]}, (name, cur)


def test_a_spanning_group_is_selectable_exactly_while_its_distance_is_within_each_bound(runs):
    """windowed and weight_fifo keep a ready record while its staleness is <= W (2) and evict it
    after; windowed aborts an in-flight one past W; ready_first bounds nothing; in_order reads no
    weights. With ``start_weight`` alone the spanning groups would read one version fresher and
    survive version 3."""
    ready = ["plain", "tail", "chunks", "default"]
    for name in ("windowed", "weight_fifo"):
        versions = runs["recover"][name]["versions"]
        assert [versions[v]["evicted"] for v in ("1", "2", "3")] == [[], [], ["tail", "chunks"]], name
        aborted = [versions[v]["aborted"] for v in ("1", "2", "3")]
        assert aborted == ([[], [], ["inflight"]] if name == "windowed" else [[], [], []]), name
    windowed = runs["recover"]["windowed"]["versions"]
    assert windowed["1"]["eligible"] == windowed["2"]["eligible"] == ready
    assert windowed["3"]["eligible"] == ["plain", "default"]
    # weight_fifo: the stalest in-window lineage weight first; in flight at 0, "inflight" holds
    # back the younger weights until it commits or leaves the window.
    fifo = runs["recover"]["weight_fifo"]["versions"]
    assert fifo["1"]["eligible"] == fifo["2"]["eligible"] == ["tail", "chunks"]
    assert fifo["3"]["eligible"] == ["plain", "default"]
    first = runs["recover"]["ready_first"]["versions"]
    assert all(first[v]["eligible"] == ready and first[v]["evicted"] == first[v]["aborted"] == []
               for v in ("1", "2", "3"))
    in_order = runs["recover"]["in_order"]["versions"]
    assert all(in_order[v]["aborted"] == [] for v in ("1", "2", "3"))


def test_a_forked_entry_commits_with_the_newest_its_fork_froze(runs):
    """A forked in-flight prompt finished after the resume by the weights of version 4 (trained
    anew, not the destroyed 2 nor a token of its lineage) keeps ``lineage_newest`` 2: its stalest
    token is still the destroyed 2, ``(2 - 1) + (4 - 1) = 4`` versions from version 4."""
    assert runs["recover"]["ready_first"]["committed"] == [1, 4, 2, 1, 4]


def test_the_fork_is_durable_and_verifies_in_a_fresh_process(runs):
    """A third process reads the same stamps from each store after the clean close, and
    verification holds every weight index against the new lineage weight. ``end_weight`` is the
    commit's as before (the store's version when not given)."""
    expected = {"plain": [1, 1, None, None], "tail": [1, 2, 2, 1], "chunks": [1, 2, 2, 1],
                "default": [1, 2, None, None]}
    evicted = {"windowed": {"tail", "chunks"}, "weight_fifo": {"tail", "chunks"}, "ready_first": set(),
               "in_order": set(expected)}  # in_order: every group stamped for a step before version 3
    for name in SAMPLERS:
        got = runs["reopen"][name]
        assert got["ok"], name
        done = {"windowed": {"inflight": ["aborted", 1, -1, 2, 1]},  # the tombstone keeps both
                "ready_first": {"inflight": ["ready", 1, 4, 2, 1]}}.get(name, {})  # committed after the resume
        assert got["records"] == {**{gid: ["evicted" if gid in evicted[name] else "ready", *stamps]
                                     for gid, stamps in expected.items()}, **done}, name
        assert got["ledger"] == {**({} if done else {"inflight": [1, 2, 1]}), "inflight1": [1, None, None]}, name


def test_inspect_reports_the_destroyed_lineage(runs):
    """``kvckpt inspect`` counts the held records on a destroyed lineage and those spanning a sync,
    with the lowest lineage weight (the same rule as the samplers'): the ready_first store holds
    tail, chunks and the committed inflight, forked at 1 with newest 2 (lineage weight 0)."""
    assert runs["inspect"]["json"]["lineage"] == {"forked": 3, "spanning": 3, "lowest": 0}
    assert "lineage  3 held on a destroyed lineage (lowest lineage weight 0), 3 spanning a weight sync" \
        in runs["inspect"]["text"]


def test_records_without_the_field_keep_their_bytes(tmp_path):
    """The golden format-3 file (written before ``lineage_newest`` existed): each group and ledger
    record reads with no newest version (its lineage weight its stamp) and writes back without the
    key, and a rollback that forks nothing of it leaves its ready groups' bytes as they were."""
    path = str(tmp_path / _golden.FILE)
    shutil.copyfile(Path(_golden.HERE) / _golden.FILE, path)

    def raw(buf: ReplayBuffer, table: str) -> dict[bytes, bytes]:
        return buf.store.read(lambda t: dict(t.iter_prefix(table, b"")))

    with ReplayBuffer.open(path, readonly=True) as ro:
        groups, ledger = raw(ro, "groups"), raw(ro, "ledger")
        assert groups and ledger
        for table, cls in ((groups, GroupInfo), (ledger, LedgerEntry)):
            for value in table.values():
                doc = codec.decode_meta(value, "golden record")
                record = cls.from_dict(doc)
                assert record.lineage_newest is None and record.lineage_weight == record.start_weight
                written = json.loads(json.dumps(record.to_dict()))  # what a write of it stores: no lineage_newest key
                assert "lineage_newest" not in written and {k: written[k] for k in doc} == doc
        version, ready = ro.trainer_version, [g.group_id for g in ro.groups(["ready"])]
    with ReplayBuffer.open(path) as buf:
        plan = buf.recover(resume_version=version)
        after = raw(buf, "groups")
    assert ready and plan.groups_on_destroyed_lineage == 0
    assert all(after[keys.group_key(gid)] == groups[keys.group_key(gid)] for gid in ready)
