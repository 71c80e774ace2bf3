"""Token progress, one deterministic test aimed at each promise (issue 35), each killed by a named
mutation of ``scripts/mutation_check.py``:

* a chunk is ``FutureVersion`` only past **both** the trainer and the rollout weight version, also
  when the rollout weights lag the trainer (``progress-future-reads-weights-only``);
* a group's ``start_weight`` is the **oldest** version of its entry's stamp and every consumed
  token, also when versions go down (``progress-oldest-is-first-chunk``,
  ``commit-forgets-sibling-token-weight``); after a recovery that destroyed the weights of a kept
  prefix, oldest is counted in the version tree (issue 39): the stamp stays the destroyed
  weights', forked at the resume version, and an abort's tombstone keeps the fork
  (``abort-drops-the-entrys-fork``);
* a prefix of exactly ``max_tokens`` is accepted, one more token refused (``progress-bound-off-by-one``);
* a chunk read back is checked against its key on the live read path (``progress-read-skips-identity``);
* committing one sample never touches a sibling's progress, whatever its index
  (``progress-delete-index-0-is-the-group``).

Stored bytes are edited with raw LMDB (``tests/_crafted.py``), never through kvckpt's write path.
"""

from __future__ import annotations

import _crafted
import pytest
import torch
from _buffers import refused

from kvckpt import BufferConfig, CorruptRecord, FutureVersion, Prompt, ReplayBuffer, SchemaMismatch, check
from kvckpt.storage import keys
from kvckpt.tables.access import Tables

PSCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
           "token_mask": ("int64", "token"), "token_versions": ("int64", "token"), "total_reward": ("float32", "row")}
PROMPT = [101, 102, 103]


def make(tmp_path, group_size=2, **config) -> ReplayBuffer:
    config.setdefault("schema", PSCHEMA)
    return ReplayBuffer.create(str(tmp_path / "buf.kv"), BufferConfig(group_size=group_size,
                                                                      max_buffered_rollouts=8, **config))


def row(completion, versions):
    """The vLLM worker's row: prompt + completion, the mask and the versions on the completion."""
    n = len(completion)
    return {"input_ids": torch.tensor(PROMPT + list(completion)),
            "generation_logprobs": torch.tensor([0.0] * len(PROMPT) + [-0.5] * n),
            "token_mask": torch.tensor([0] * len(PROMPT) + [1] * n),
            "token_versions": torch.tensor([-1] * len(PROMPT) + list(versions)), "total_reward": torch.tensor(1.0)}


def chunk(buf, lease, index, start, tokens, version=0):
    return buf.record_progress(lease, index, start=start, tokens=tokens, logprobs=[-0.5] * len(tokens),
                               weight_version=version)


def prefixes(buf, lease):
    return {i: (p.tokens.tolist(), p.versions.tolist()) for i, p in buf.progress(lease).items()}


# -- 1. the future is past both versions ------------------------------------------------------------------

def test_rollout_weights_behind_the_trainer_a_chunk_up_to_the_trainer_version_is_not_future(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    for _ in range(3):
        buf.finish_step()
    buf.finish_step(weight_version=1)  # trainer version 4, the rollout weights lag at 1
    assert (buf.trainer_version, buf.state()["weight_version"]) == (4, 1)
    assert chunk(buf, lease, 0, 0, [1], version=1) == 1
    assert chunk(buf, lease, 0, 1, [2], version=3) == 2  # newer than the weights, not than the trainer
    assert chunk(buf, lease, 0, 2, [3], version=4) == 3
    error = refused(buf, FutureVersion, chunk, buf, lease, 0, 3, [4], version=5)
    assert "trainer version is 4, its weight version 1" in str(error)
    assert prefixes(buf, lease) == {0: ([1, 2, 3], [1, 3, 4])}


# -- 2. the oldest version, also when versions go down ------------------------------------------------------

def test_start_weight_is_the_oldest_when_the_rollout_weights_go_down_mid_sample(tmp_path):
    """Admitted at weights 2; sample 0's prefix made by weights 2, then the rollout weights go down
    to 1 (behind the trainer) and the sample continues with them; sample 1's prefix made by
    weights 2 again. The group's stamp is 1: the oldest, the last token of a prefix."""
    buf = make(tmp_path)
    buf.finish_step()
    buf.finish_step()
    [lease] = buf.admit([Prompt(0)])
    assert lease.start_weight == 2
    chunk(buf, lease, 0, 0, [5, 6], version=2)
    buf.finish_step(weight_version=1)  # trainer 3, rollout weights 1
    chunk(buf, lease, 0, 2, [7], version=1)
    chunk(buf, lease, 1, 0, [8, 9], version=2)
    assert prefixes(buf, lease) == {0: ([5, 6, 7], [2, 2, 1]), 1: ([8, 9], [2, 2])}
    buf.commit_sample(lease, 1, row([8, 9, 4], [2, 2, 2]))
    buf.commit_sample(lease, 0, row([5, 6, 7], [2, 2, 1]))
    group = buf.group(lease.group_id)
    assert (group.start_weight, group.lineage_fork) == (1, None)
    assert buf.store.read(check).ok


def test_a_recovery_mid_sample_keeps_the_destroyed_weights_stamp_forked(tmp_path):
    """Sample 0's prefix made by weights 2, then a recovery to version 1 (weights 2 are destroyed:
    never an ancestor of what trains next) and the new attempt continues with weights 1, then 2 of
    the new lineage. The oldest work in the version tree is the destroyed weights' prefix: the
    group keeps stamp 2 forked at 1, lineage weight 0, older than every token made since."""
    buf = make(tmp_path)
    buf.finish_step()
    buf.finish_step()
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6], version=2)
    plan = buf.recover(resume_version=1)  # the weights roll back with the trainer
    assert buf.state()["weight_version"] == 1
    [new] = plan.leases
    chunk(buf, new, 0, 2, [7], version=1)
    buf.finish_step()
    chunk(buf, new, 1, 0, [8, 9], version=2)
    assert prefixes(buf, new) == {0: ([5, 6, 7], [2, 2, 1]), 1: ([8, 9], [2, 2])}
    buf.commit_sample(new, 1, row([8, 9, 4], [2, 2, 2]))
    buf.commit_sample(new, 0, row([5, 6, 7], [2, 2, 1]))
    group = buf.group(lease.group_id)
    assert (group.start_weight, group.lineage_fork, group.lineage_weight) == (2, 1, 0)
    assert buf.store.read(check).ok


def test_an_aborted_forked_entry_keeps_its_fork_in_the_tombstone(tmp_path):
    """A forked entry (kept progress of destroyed weights) that is aborted leaves a tombstone with
    the entry's stamp and fork: the record still says which lineage its stamp is on."""
    buf = make(tmp_path)
    buf.finish_step()
    buf.finish_step()
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6], version=2)
    [new] = buf.recover(resume_version=1).leases
    assert (buf.ledger()[0].start_weight, buf.ledger()[0].lineage_fork) == (2, 1)
    buf.abort(new.group_id, "test")
    group = buf.group(new.group_id)
    assert (group.state, group.start_weight, group.lineage_fork) == ("aborted", 2, 1)
    assert buf.store.read(check).ok


def test_a_sibling_commits_oldest_tokens_are_not_forgotten_by_the_next_commit(tmp_path):
    """Sample 0's prefix (weights 1) is consumed by its own commit; sample 1 commits later without
    progress: the group's stamp still names weights 1, below the entry's stamp 2."""
    buf = make(tmp_path)
    buf.finish_step(weight_version=1)
    buf.finish_step(weight_version=2)
    [lease] = buf.admit([Prompt(0)])
    buf.finish_step(weight_version=1)  # the rollout weights go down (trainer version 3)
    chunk(buf, lease, 0, 0, [5], version=1)
    buf.commit_sample(lease, 0, row([5, 6], [1, 1]))
    buf.commit_sample(lease, 1, row([7], [1]))
    assert (lease.start_weight, buf.group(lease.group_id).start_weight) == (2, 1)


def test_a_prefix_made_by_newer_weights_keeps_the_entrys_older_stamp(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    buf.finish_step(weight_version=3)
    chunk(buf, lease, 0, 0, [5], version=3)
    buf.commit_group(lease, [row([5], [3]), row([6], [3])])
    assert buf.group(lease.group_id).start_weight == 0


# -- 3. the bound is max_tokens, inclusive -------------------------------------------------------------------

def test_a_prefix_of_exactly_max_tokens_is_accepted_and_one_more_token_is_refused(tmp_path):
    schema = {"fields": {"input_ids": ("int64", "token"), "total_reward": ("float32", "row")}, "max_tokens": 6}
    buf = make(tmp_path, schema=schema)  # no token_mask: the whole row is completion
    [lease] = buf.admit([Prompt(0)])
    assert chunk(buf, lease, 0, 0, [1, 2, 3, 4]) == 4
    error = refused(buf, SchemaMismatch, chunk, buf, lease, 0, 4, [5, 6, 7])
    assert "prefix 7 tokens long, over the schema's max_tokens 6" in str(error)
    assert chunk(buf, lease, 0, 4, [5, 6]) == 6
    refused(buf, SchemaMismatch, chunk, buf, lease, 0, 6, [7])
    assert chunk(buf, lease, 1, 0, [1, 2, 3, 4, 5, 6]) == 6  # one chunk of exactly max_tokens
    assert buf.store.read(check).ok
    rows = [{"input_ids": torch.tensor([1, 2, 3, 4, 5, 6]), "total_reward": torch.tensor(1.0)}] * 2
    assert buf.commit_group(lease, rows).ready and buf.progress(lease) == {}


# -- 4. a chunk read back is checked against its key ----------------------------------------------------------

@pytest.mark.parametrize("target", [(1, 0), (0, 2)], ids=["another-sample", "another-start"])
def test_a_chunk_stored_under_another_key_is_corrupt_on_the_live_read_path(tmp_path, target):
    """Sample 0's first chunk copied under the key of another sample (or another start of its
    own): ``progress()`` and the commit's prefix check refuse it as ``CorruptRecord`` naming the key."""
    buf = make(tmp_path)
    [lease] = buf.admit([Prompt(0)])
    chunk(buf, lease, 0, 0, [5, 6])
    if target == (0, 2):
        chunk(buf, lease, 0, 2, [7, 8])
    buf.close()
    edit = _crafted._Edit(str(tmp_path / "buf.kv"))
    gid = lease.group_id
    edit.put("progress", keys.progress_key(gid, *target), edit.get("progress", keys.progress_key(gid, 0, 0)))
    edit.close()
    index, start = target
    name = f"progress/{keys.row_id(gid, index)}@{start}"
    with ReplayBuffer.open(str(tmp_path / "buf.kv")) as buf:
        with pytest.raises(CorruptRecord) as error:
            buf.progress(lease)
        assert error.value.key == name
        completion = [5, 6] if index else [5, 6, 7, 8]
        with pytest.raises(CorruptRecord) as error:
            buf.commit_sample(lease, index, row(completion, [0] * len(completion)))
        assert error.value.key == name
        with pytest.raises(CorruptRecord):  # the next append reads the chunk before it too
            chunk(buf, lease, index, 2 + start, [9])
        assert buf.group(gid) is None and len(buf.store.read(lambda txn: list(Tables(txn).progress_chunks(gid)))) == 2


# -- 5. a commit never touches a sibling's progress ------------------------------------------------------------

@pytest.mark.parametrize("first", [0, 1, 2])
def test_committing_one_sample_leaves_every_siblings_progress_as_it_was(tmp_path, first):
    buf = make(tmp_path, group_size=3)
    [lease] = buf.admit([Prompt(0)])
    made = {i: ([10 * i + 1, 10 * i + 2], [0, 0]) for i in range(3)}
    for i, (tokens, _) in made.items():
        chunk(buf, lease, i, 0, tokens)
    for index in (first, *(i for i in range(3) if i != first)):
        buf.commit_sample(lease, index, row(made.pop(index)[0] + [99], [0, 0, 0]))
        assert prefixes(buf, lease) == made  # the committed sample's prefix is gone, every other one intact
        assert buf.store.read(check).ok
    assert buf.group(lease.group_id).state == "ready"
