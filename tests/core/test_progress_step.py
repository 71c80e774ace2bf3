"""The progress step message (issue 36): one engine step's progress from one producer, columnar and
checksummed at the edge, each sequence its own transition.

What is held: the stored chunks are the format-4 records ``record_progress`` writes, byte for
byte; each refusal is one sequence's, with its specific error, while the other sequences of the
same message land; a malformed message is refused whole and writes nothing; and a message resent
after its first try landed, across a restart of the owner (a fresh process that reopens and
recovers the store, as the Ray actor does), returns the same result per sequence and writes
nothing, while a sequence whose first try did not land is refused as fenced.
"""

from __future__ import annotations

import json
import signal
import struct
import zlib

import numpy as np
import pytest
import torch
from _buffers import dump_store, refused
from _fresh import run_fresh  # a fresh interpreter, its last stdout line JSON

from kvckpt import (
    AbandonedTimeline,
    BadArgument,
    BadOffsets,
    BufferConfig,
    CorruptRecord,
    DuplicateCommit,
    LeaseMismatch,
    MalformedMessage,
    ProgressEncoder,
    ReplayBuffer,
    SampleCommitted,
    SchemaMismatch,
    StaleAttempt,
    check,
)
from kvckpt.storage import codec, keys
from kvckpt.storage.progress_message import decode_message
from kvckpt.transitions import progress

SCHEMA = {"input_ids": ("int64", "token"), "token_mask": ("int64", "token"),
          "spec_accepted": ("bool", "token"), "hidden": ("float32", "token", [2])}
MAX_TOKENS = 64


def make(tmp_path, name="buf.kv") -> ReplayBuffer:
    return ReplayBuffer.create(str(tmp_path / name), BufferConfig(
        group_size=4, schema={"fields": SCHEMA, "max_tokens": MAX_TOKENS}, max_buffered_rollouts=8))


def step(enc: ProgressEncoder, leases, indices, starts, lengths, *, versions=0, extra_tokens=0, offsets=None,
         **kw):
    """A message of ``len(indices)`` sequences; sequence ``i``'s tokens are ``100 * i + start + k``."""
    toks = [np.arange(s, s + n) + 100 * i for i, (s, n) in enumerate(zip(starts, lengths, strict=True))]
    tokens = np.concatenate([*toks, np.full(extra_tokens, 7)]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]) if offsets is None else offsets
    return enc.encode(leases, indices, starts, tokens, -tokens.astype(np.float32) / 1000, offsets, versions=versions,
                      **kw)


def tokens_of(buf, lease) -> dict[int, list[int]]:
    return {i: p.tokens.tolist() for i, p in buf.progress(lease).items()}


# -- the stored records ---------------------------------------------------------------------------------------

def test_encode_stored_is_byte_equal_to_encode_at_level_0():
    fields = [("tokens", "int64", np.arange(5, dtype=np.int64)), ("f.acc", "bool", np.array([1, 0, 1, 1, 0], bool)),
              ("f.h\u00e9", "float32", np.ones((5, 2), np.float32)), ("empty", "int64", np.zeros(0, np.int64))]
    meta = {"group_id": "g\u00e9-\"x\"", "index": 3, "start": 10, "length": 5, "version": -2}
    want = codec.encode({n: a for n, _, a in fields}, meta, level=0, dtypes={n: d for n, d, _ in fields})
    assert codec.encode_stored(fields, codec.json_text(meta)) == want
    with pytest.raises(BadArgument):
        codec.encode_stored([("tokens", "int64", np.arange(3, dtype=np.int32))], "{}")


def test_a_messages_chunks_are_the_records_record_progress_stores(tmp_path):
    """Same chunk through both APIs -> the same bytes, so a retry through either is recognised."""
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    fields = {"spec_accepted": [True, False, True], "hidden": torch.ones(3, 2)}
    msg = buf.progress_encoder().encode([lease], [1], [0], [5, 6, 7], [-0.5, -0.25, -1.0], [0, 3], versions=[0],
                                        fields=fields)
    assert buf.record_progress_step(msg) == [3]
    [(_, _, value)] = buf.store.read(lambda txn: list(progress_chunks(txn, lease.group_id)))
    chunk = progress.encode_chunk(buf.schema, lease, 1, 0, [5, 6, 7], [-0.5, -0.25, -1.0], 0, fields)
    assert bytes(value) == chunk.value
    before = dump_store(buf)
    assert buf.record_progress(lease, 1, start=0, tokens=[5, 6, 7], logprobs=[-0.5, -0.25, -1.0],
                               weight_version=0, fields=fields) == 3  # the other API's retry: a no-op
    assert dump_store(buf) == before
    got = buf.progress(lease)[1]
    assert got.fields["spec_accepted"].tolist() == [True, False, True] and got.fields["hidden"].shape == (3, 2)


def test_a_message_in_a_mutable_buffer_is_decoded_from_a_copy(tmp_path):
    """The owner reads a message's arrays as views into its bytes; bytes the caller could still change
    (a bytearray, a memoryview of one) are copied first, so the chunks stored are the checksummed ones."""
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    value = step(buf.progress_encoder(), [lease, lease], [0, 1], [0, 0], [3, 2]).value
    for given in (bytearray(value), memoryview(bytearray(value))):
        msg = decode_message(buf.schema, given)
        assert not np.shares_memory(msg.tokens, np.frombuffer(given, np.uint8))
        given[len(value) - 1] ^= 1  # the caller reuses its buffer: what was decoded does not change
        assert msg.logprobs.tolist() == decode_message(buf.schema, value).logprobs.tolist()
    assert buf.record_progress_step(bytearray(value)) == [3, 2]
    assert tokens_of(buf, lease) == {0: [0, 1, 2], 1: [100, 101]}


def test_each_sequence_lands_under_its_own_leases_row(tmp_path):
    """A message of several groups' sequences (the owner builds each lease's row-key prefix once per
    message): every chunk is stored under its own group and row, and nothing under another's."""
    buf = make(tmp_path)
    a, b = buf.admit([0, 1])
    msg = step(buf.progress_encoder(), [a, b, a, b], [0, 0, 2, 3], [0, 0, 0, 0], [1, 2, 3, 4])
    assert buf.record_progress_step(msg) == [1, 2, 3, 4]
    assert tokens_of(buf, a) == {0: [0], 2: [200, 201, 202]}
    assert tokens_of(buf, b) == {0: [100, 101], 3: [300, 301, 302, 303]}


def test_items_and_columns_build_the_same_message(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    enc = buf.progress_encoder()
    items = [{"lease": lease, "index": i, "start": 0, "tokens": [i, i + 1], "logprobs": [-0.5, -0.5],
              "weight_version": 0} for i in range(3)]
    columns = enc.encode([lease] * 3, [0, 1, 2], [0, 0, 0], [0, 1, 1, 2, 2, 3], [-0.5] * 6, [0, 2, 4, 6], versions=0)
    assert enc.encode_items(items) == columns
    assert len(decode_message(buf.schema, columns).leases) == 1  # the shared lease travels once
    assert buf.record_progress_step(columns) == [2, 2, 2]


def test_per_token_versions_split_a_sequence_into_contiguous_chunks_that_verify(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    buf.finish_step(weight_version=3)
    enc = buf.progress_encoder()
    msg = enc.encode([lease, lease], [0, 1], [0, 0], np.arange(7), np.zeros(7), [0, 4, 7],
                     token_versions=[1, 1, 2, 2, 3, 3, 3])
    assert buf.record_progress_step(msg) == [4, 3]
    got = buf.progress(lease)
    assert got[0].versions.tolist() == [1, 1, 2, 2] and got[1].versions.tolist() == [3, 3, 3]
    assert [start for _, start, _ in buf.store.read(lambda txn: list(progress_chunks(txn, lease.group_id)))] == \
        [0, 2, 0]  # sample 0 holds two chunks (versions 1 and 2), sample 1 one
    assert buf.record_progress_step(msg) == [4, 3]  # the retry of both runs: a no-op
    assert buf.store.read(check).ok


def progress_chunks(txn, group_id):
    from kvckpt.tables.access import Tables

    return Tables(txn).progress_chunks(group_id)


# -- refusals: one sequence each, the others land -------------------------------------------------------------

def test_a_lease_of_another_timeline_is_refused_and_the_other_sequences_land(tmp_path):
    buf = make(tmp_path)
    old = buf.admit([0, 1])
    plan = buf.recover()  # a new timeline: the leases issued before it are a zombie's
    new = {lease.group_id: lease for lease in plan.leases}
    enc = buf.progress_encoder()
    msg = step(enc, [new[old[0].group_id], old[1], new[old[0].group_id]], [0, 0, 1], [0, 0, 0], [3, 3, 3])
    got = buf.record_progress_step(msg)
    assert got[0] == 3 and got[2] == 3 and isinstance(got[1], AbandonedTimeline)
    assert "timeline" in str(got[1])
    assert tokens_of(buf, old[0].group_id) == {0: [0, 1, 2], 1: [200, 201, 202]}
    assert tokens_of(buf, old[1].group_id) == {}


@pytest.mark.parametrize("offsets, landed, why", [
    ([0, 2, 1, 6], {0: [0, 1]}, ["", "empty or backwards", "overlap an earlier sequence"]),
    ([0, 2, 9, 6], {0: [0, 1]}, ["", "leave the message's token array", "empty or backwards"]),
    ([1, 2, 4, 6], {1: [100, 101], 2: [200, 201]}, ["belong to no sequence", "", ""]),
], ids=["backwards", "past-the-array", "tokens-before-the-first"])
def test_offsets_that_do_not_add_up_refuse_only_their_sequences(tmp_path, offsets, landed, why):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    tokens = [0, 1, 100, 101, 200, 201]
    msg = buf.progress_encoder().encode([lease] * 3, [0, 1, 2], [0, 0, 0], tokens, np.zeros(6), offsets, versions=0)
    got = buf.record_progress_step(msg)
    for result, reason in zip(got, why, strict=True):
        if reason:
            assert isinstance(result, BadOffsets) and reason in str(result), result
        else:
            assert result == 2
    assert tokens_of(buf, lease) == landed


def test_a_token_array_longer_than_the_offsets_say_refuses_the_last_sequence_only(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    msg = step(buf.progress_encoder(), [lease] * 2, [0, 1], [0, 0], [3, 2], extra_tokens=4)
    got = buf.record_progress_step(msg)
    assert got[0] == 3 and isinstance(got[1], BadOffsets)
    assert "holds 9 tokens but the offsets end at 5" in str(got[1])
    assert tokens_of(buf, lease) == {0: [0, 1, 2]}


def test_a_chunk_past_max_tokens_is_refused_and_the_others_land(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    msg = step(buf.progress_encoder(), [lease] * 3, [0, 1, 2], [0, MAX_TOKENS - 2, 0], [2, 3, 2])
    got = buf.record_progress_step(msg)
    assert got[0] == 2 and got[2] == 2 and isinstance(got[1], SchemaMismatch)
    assert f"{MAX_TOKENS + 1} tokens long, over the schema's max_tokens {MAX_TOKENS}" in str(got[1])
    assert tokens_of(buf, lease) == {0: [0, 1], 2: [200, 201]}


def test_the_transactions_refusals_are_per_sequence_too(tmp_path):
    """A gap, a conflict, a wrong index and a lease of another group size in one message."""
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    enc = buf.progress_encoder()
    assert buf.record_progress_step(step(enc, [lease], [0], [0], [2])) == [2]
    wrong_size = {**lease.to_dict(), "group_size": 2}
    msg = step(enc, [lease, lease, lease, wrong_size, lease, lease], [0, 1, 9, 2, 3, 0], [1, 5, 0, 0, 0, 4],
               [2, 1, 1, 1, 1, 1])
    got = buf.record_progress_step(msg)
    assert isinstance(got[0], DuplicateCommit) and "other content" in str(got[0])
    assert isinstance(got[1], BadArgument) and "(a gap)" in str(got[1])
    assert isinstance(got[2], BadArgument) and "outside the group" in str(got[2])
    assert isinstance(got[3], LeaseMismatch)
    assert got[4] == 1
    assert isinstance(got[5], BadArgument) and "durable prefix is 2 tokens long" in str(got[5])  # a gap after a chunk
    assert tokens_of(buf, lease) == {0: [0, 1], 3: [400]}


def test_fencing_is_judged_per_lease_and_a_committed_row_per_sequence(tmp_path):
    """One group's sequences under two leases (a redispatch fenced the first) and a row committed
    since: the owner judges the fencing once per lease of the message, so the fenced lease's
    sequence and the committed row's are refused while the new lease's others land."""
    buf = make(tmp_path)
    [old] = buf.admit([0])
    new = buf.redispatch(old.group_id)
    buf.commit_sample(new, 2, {"input_ids": torch.tensor([1, 2]), "token_mask": torch.tensor([0, 1]),
                               "spec_accepted": torch.tensor([False, True]), "hidden": torch.zeros(2, 2)})
    got = buf.record_progress_step(step(buf.progress_encoder(), [new, old, new, new], [0, 1, 2, 3], [0] * 4, [2] * 4))
    assert got[0] == 2 and got[3] == 2, got
    assert isinstance(got[1], StaleAttempt) and "attempt 0" in str(got[1]), got[1]
    assert isinstance(got[2], SampleCommitted) and "already committed" in str(got[2]), got[2]
    assert tokens_of(buf, new) == {0: [0, 1], 3: [300, 301]}


def test_a_malformed_message_is_refused_whole_and_writes_nothing(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    value = step(buf.progress_encoder(), [lease], [0], [0], [3]).value
    flipped = bytearray(value)
    flipped[-1] ^= 1
    error = refused(buf, MalformedMessage, buf.record_progress_step, bytes(flipped))
    assert "checksum mismatch" in str(error)
    # a record that passes its checksum but is not a message: a row, a message lacking offsets
    refused(buf, MalformedMessage, buf.record_progress_step, codec.encode({"tokens": np.arange(3)}, {"kind": "x"}))
    record = codec.decode(value)
    del record.arrays["offsets"]
    lacking = codec.encode(record.arrays, record.meta, level=0)
    assert "offsets" in str(refused(buf, MalformedMessage, buf.record_progress_step, lacking))
    record = codec.decode(value)
    record.arrays["logprobs"] = record.arrays["logprobs"][:2]
    short = codec.encode(record.arrays, record.meta, level=0)
    assert "disagree in length" in str(refused(buf, MalformedMessage, buf.record_progress_step, short))
    refused(buf, MalformedMessage, buf.record_progress_step, "not bytes")
    [result] = buf.record_progress_steps([bytes(flipped)])  # in a batch: refused in its slot
    assert isinstance(result, MalformedMessage)
    result, landed = buf.record_progress_steps([bytes(flipped), value])  # ... and its neighbour lands
    assert isinstance(result, MalformedMessage) and landed == [3]


def test_the_encoder_keeps_a_leases_document_by_object_and_never_a_dicts(tmp_path):
    """Issue 45: the encoder builds a Lease's document once and keeps it by that very object (a frozen record);
    another object, even one whose id a kept entry names, gets its own; a dict lease is read every time."""
    buf = make(tmp_path)
    a, b = buf.admit([0, 1])
    enc = buf.progress_encoder()

    def lease_sent(lease) -> dict:
        return decode_message(buf.schema, step(enc, [lease], [0], [0], [3]).value).leases[0]

    def doc_of(lease) -> dict:
        return json.loads(json.dumps(lease.to_dict()))  # as the message carries it (tuples as lists)

    assert lease_sent(a) == doc_of(a) and lease_sent(a) == doc_of(a)
    assert step(enc, [a], [0], [0], [3]).value == step(buf.progress_encoder(), [a], [0], [0], [3]).value
    enc._docs[id(b)] = enc._docs[id(a)]  # an entry under b's id that is not b (as if a's id were reused)
    assert lease_sent(b) == doc_of(b)
    doc = b.to_dict()
    assert lease_sent(doc) == doc_of(b)
    doc["attempt"] += 1  # the same dict object, changed: sent as it is now, apart from b
    both = decode_message(buf.schema, step(enc, [b, doc], [0, 1], [0, 0], [3, 3]).value)
    assert [both.leases[i]["attempt"] for i in both.lease_of.tolist()] == [b.attempt, b.attempt + 1]


def test_the_edge_encoder_refuses_what_cannot_be_a_message(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    enc = buf.progress_encoder()
    with pytest.raises(BadArgument, match="exactly one of versions"):
        enc.encode([lease], [0], [0], [1], [0.0], [0, 1])
    with pytest.raises(SchemaMismatch, match="logprobs for 2 tokens"):
        enc.encode([lease], [0], [0], [1, 2], [0.0], [0, 2], versions=0)
    with pytest.raises(BadArgument, match="not a per-token generation field"):
        enc.encode([lease], [0], [0], [1], [0.0], [0, 1], versions=0, fields={"input_ids": [1]})
    with pytest.raises(SchemaMismatch):  # a lossy cast: float tokens
        enc.encode([lease], [0], [0], [1.5], [0.0], [0, 1], versions=0)


# -- exactly once across a restart of the owner -----------------------------------------------------------------

OWNER = """
    buf = ReplayBuffer.open(ARGS["path"])
    results = buf.record_progress_step(bytes.fromhex(ARGS["message"]))
    print(json.dumps([r if isinstance(r, int) else type(r).__name__ for r in results]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the owner dies right after the acknowledgement
"""

RESTARTED = """
    buf = ReplayBuffer.open(ARGS["path"])
    buf.recover()  # what a restarted Ray actor runs: every lease moves to a new timeline
    out = []
    for message in ARGS["messages"]:
        results = buf.record_progress_step(bytes.fromhex(message))
        out.append([r if isinstance(r, int) else type(r).__name__ for r in results])
    print(json.dumps({"results": out, "ok": buf.store.read(check).ok,
                      "tokens": {g: {i: p.tokens.tolist() for i, p in buf.progress(g).items()}
                                 for g in ARGS["groups"]}}))
"""


def test_a_resent_message_returns_the_same_results_after_the_owner_restarts(tmp_path):
    buf = make(tmp_path)
    leases = buf.admit([0, 1])
    enc = buf.progress_encoder()
    landed = step(enc, [leases[0], leases[0], leases[1]], [0, 1, 0], [0, 0, 0], [3, 2, 4])
    buf.record_progress_step(step(enc, [leases[1]], [1], [0], [2]))  # sample (1, 1) has 2 tokens before
    lost = step(enc, [leases[1], leases[1]], [1, 2], [2, 0], [2, 1])  # never reaches the owner
    conflicting = enc.encode([leases[0]], [0], [0], [5, 5, 5], np.zeros(3), [0, 3], versions=0)
    path = buf.path
    buf.close()
    first = run_fresh(OWNER, path=path, message=landed.value.hex())
    assert first["rc"] == -signal.SIGKILL and first["out"] == [3, 2, 4], first["err"]

    groups = [lease.group_id for lease in leases]
    again = run_fresh(RESTARTED, path=path, groups=groups,
                      messages=[landed.value.hex(), lost.value.hex(), conflicting.value.hex()])
    assert again["rc"] == 0, again["err"]
    assert again["out"]["results"] == [
        [3, 2, 4],  # the same result per sequence, though every lease was fenced by the recovery
        ["AbandonedTimeline", "AbandonedTimeline"],  # its first try never landed: fenced
        ["AbandonedTimeline"],  # other bytes at a covered position are never taken for a retry
    ]
    assert again["out"]["tokens"] == {groups[0]: {"0": [0, 1, 2], "1": [100, 101]},
                                      groups[1]: {"0": [200, 201, 202, 203], "1": [0, 1]}}
    assert again["out"]["ok"]


def test_a_resent_message_with_a_live_lease_is_a_noop_and_changed_bytes_are_refused(tmp_path):
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    enc = buf.progress_encoder()
    msg = step(enc, [lease, lease], [0, 1], [0, 0], [3, 2])
    assert buf.record_progress_step(msg) == [3, 2]
    assert buf.record_progress_step(step(enc, [lease], [0], [3], [1])) == [4]
    before = dump_store(buf)
    assert buf.record_progress_step(msg) == [3, 2]  # where the chunk ends, as the first try said
    assert dump_store(buf) == before
    tokens = np.array([9, 9, 9, 100, 101])  # sequence 0 changed, sequence 1 as before
    other = enc.encode([lease, lease], [0, 1], [0, 0], tokens, -tokens / 1000, [0, 3, 5], versions=0)
    got = buf.record_progress_step(other)
    assert isinstance(got[0], DuplicateCommit) and got[1] == 2


def test_the_durable_length_is_read_without_a_json_parse_only_from_a_header_kvckpt_writes(tmp_path):
    value = codec.encode({"tokens": np.arange(3)}, {"group_id": "g", "index": 1, "start": 4, "length": 3,
                                                     "version": 0}, level=0)
    assert codec.meta_begins(value, '{"group_id":"g","index":1,"start":4,"length":3,"version":')
    assert not codec.meta_begins(value, '{"group_id":"g","index":1,"start":4,"length":31,"version":')
    with pytest.raises(CorruptRecord, match="checksum"):
        codec.meta_begins(value[:-1] + b"?", "{")
    # a last chunk whose header is laid out otherwise (valid JSON, valid checksum) is parsed instead
    buf = make(tmp_path)
    [lease] = buf.admit([0])
    enc = buf.progress_encoder()
    assert buf.record_progress_step(step(enc, [lease], [0], [0], [2])) == [2]
    key = keys.progress_key(lease.group_id, 0, 0)
    stored = bytes(buf.store.read(lambda txn: txn.get("progress", key)))
    head = len(stored) - 2 * 12  # 2 tokens: 16 bytes of ids, 8 of logprobs
    record = codec.decode(stored)
    spaced = json.dumps({"z": 0, "raw": 24, "meta": record.meta, "fields": [
        ["tokens", "int64", [2], [], 16], ["logprobs", "float32", [2], [], 8]]}).encode()
    tail = struct.pack("<I", len(spaced)) + spaced + stored[head:]
    buf.store.write(lambda txn: txn.put("progress", key, struct.pack("<4sI", codec.MAGIC, zlib.crc32(tail)) + tail))
    assert buf.record_progress_step(step(enc, [lease], [0], [2], [1])) == [3]
    assert buf.progress(lease)[0].tokens.tolist() == [0, 1, 2]
