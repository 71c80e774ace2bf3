"""TRL's AsyncGRPOTrainer through kvckpt's worker on TRL's own vLLM-server path, killed mid-generation.

A real vLLM OpenAI-compatible server (vLLM's CPU build, ``.venv-vllm``) on 127.0.0.1; the trainer
(tests/integrations/trl/trl_server_run.py) runs in a fresh process per run, with TRL beside vLLM in ``.venv-vllm``
(scripts/peer_envs/vllm.txt). Its NCCL weight transfer is the only TRL call stood in
(tests/integrations/trl/trl_cpu.py: ``ServerWeightTransferOnCPU``). Completions are 64 tokens, greedy, with progress
every 8 tokens.

Run 1 is SIGKILLed mid-stream once checkpoint-1 is complete; run 2 resumes from the last complete
checkpoint with TRL's ``resume_from_checkpoint``. The reference is each interrupted prompt generated
uninterrupted by the same server with the same request (greedy: ``top_k=1``); the server runs one
sequence per engine step, so a logprob never depends on what else was batched with it. Skipped where TRL,
vLLM or ``.venv-vllm`` is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvckpt import ReplayBuffer
from kvckpt.testing.fixtures.vllm_server import VLLMServer, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.trl,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed"),
              pytest.mark.skipif(vllm_python() is None,
                                 reason="no .venv-vllm for the server (bash scripts/setup_peer_env.sh vllm)")]

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_server_run.py")
EVERY, MAX_TOKENS, MAX_STEPS = 8, 64, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvckpt.integrations.vllm import ensure_tiny_model

    work = tmp_path_factory.mktemp("trl-server")
    model = ensure_tiny_model(str(work / "model"))
    with VLLMServer(model, str(work / "server.log"), max_num_seqs=1) as srv:  # logprobs compared bit for bit
        yield model, srv


def _run(workdir, model, srv, *, kill_after_step=0, resume=None, **probes):
    cfg = {"workdir": str(workdir), "model": model, "server": srv.url, "max_steps": MAX_STEPS, "save_steps": 1,
           "every": EVERY, "max_tokens": MAX_TOKENS, "kill_after_step": kill_after_step, "resume": resume,
           "log": str(workdir / "log.jsonl"), **probes}
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, RUN, json.dumps(cfg)], capture_output=True, text=True, timeout=600,
                          env=env)


def _events(workdir):
    with open(workdir / "log.jsonl") as fh:
        return [json.loads(line) for line in fh]


def _last_complete_checkpoint(workdir):
    """The newest ``checkpoint-N`` both TRL (``trainer_state.json``) and kvckpt finished writing."""
    out = workdir / "out"
    done = [p for p in out.glob("checkpoint-*")
            if (p / "trainer_state.json").is_file() and (p / "kvckpt_buffer.kvckpt").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]))


def _completions_by_prompt(store):
    """prompt_idx -> the committed completions of its group (token ids and their logprobs)."""
    out = {}
    with ReplayBuffer.open(str(store), readonly=True) as buf:
        for info in buf.groups(["ready", "claimed", "consumed"]):
            rows = buf.read_batch([info.group_id], layout="list").rows
            masks = [row["completion_mask"].bool() for row in rows]
            out[info.prompt_idx] = [(row["input_ids"][m].tolist(), row["old_log_probs"][m].tolist())
                                    for row, m in zip(rows, masks, strict=True)]
    return out


def _uninterrupted(model, srv, prompt_idx):
    """The prompt's completion from the same server, same request, in one uninterrupted stream."""
    from kvckpt.integrations.trl.server import VLLMServerBackend
    from kvckpt.integrations.vllm import AdditionTask, Continuation

    backend = VLLMServerBackend(model, server_url=srv.url, sampling={"top_k": 1})
    ids = backend.tokenizer(AdditionTask().prompt(prompt_idx), add_special_tokens=False)["input_ids"]
    (sample,) = backend.stream([Continuation(tuple(ids))], MAX_TOKENS, 1.0)
    return list(sample.completion_ids), list(sample.logprobs)


def test_kill_mid_generation_resumes_each_sample_from_its_durable_prefix(tmp_path, server):
    model, srv = server
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    first = _run(crashed, model, srv, kill_after_step=1)
    assert first.returncode == -9, first.stderr[-3000:] + srv.tail()
    (killed,) = [e for e in _events(crashed) if "killed" in e]
    in_flight = killed["in_flight"]
    second = _run(crashed, model, srv, resume=str(_last_complete_checkpoint(crashed)))
    assert second.returncode == 0, second.stderr[-3000:]
    (done,) = [e for e in _events(crashed) if "done" in e]

    generated = sum(s["generated"] for s in in_flight)
    durable = sum(s["durable"] for s in in_flight)
    # Every sample of the batch in flight kept its durable prefix through the recovery, and the
    # resumed run read each prefix once and continued from it.
    assert done["plan"]["progress_tokens"] == durable > 0
    assert done["stats"]["tokens_resumed"] == durable
    # What the crash cost: the tokens generated since each sample's last record, under one
    # interval per sequence in flight.
    regenerated = generated - durable
    assert all(s["generated"] - s["durable"] < EVERY for s in in_flight)
    assert regenerated < EVERY * len(in_flight)
    # Greedy: every completion of the interrupted prompts, durable prefix and resumed tail, is
    # bit-exact (tokens and logprobs) against the same prompt generated uninterrupted.
    got = _completions_by_prompt(crashed / "buffer.kv")
    compared = sorted({s["prompt_idx"] for s in in_flight})
    assert set(compared) <= set(got), (compared, sorted(got))
    for prompt_idx in compared:
        expected = _uninterrupted(model, srv, prompt_idx)
        assert len(expected[0]) == MAX_TOKENS
        assert got[prompt_idx] == [expected] * len(got[prompt_idx]), prompt_idx
    print(json.dumps({"sequences_in_flight": len(in_flight), "tokens_in_flight": generated, "durable": durable,
                      "resumed": done["stats"]["tokens_resumed"], "regenerated": regenerated,
                      "interval": EVERY, "prompts_compared": len(compared)}))


def test_a_kill_inside_trls_first_save_sets_the_partial_checkpoint_aside_and_costs_one_interval(tmp_path, server):
    """Issue 49, on the worker's defaults (no ``after_step``): SIGKILL inside TRL's first save
    (``checkpoint-1`` holds the model only) while a progress flush is held (a stalled disk) and the
    stream's reader has to wait for it. The restart (no checkpoint to resume from: step 0) sets the
    partial ``checkpoint-1`` aside, says so, recovers the live store at version 0 and trains to the
    end; every sequence in flight regenerated at most one interval, and the interrupted prompt's
    completions are bit-exact against it generated uninterrupted."""
    model, srv = server
    first = _run(tmp_path, model, srv, kill_in_save=1)
    assert first.returncode == -9, first.stderr[-3000:] + srv.tail()
    (killed,) = [e for e in _events(tmp_path) if "killed_in_save" in e]
    in_flight = killed["in_flight"]
    partial = tmp_path / "out" / "checkpoint-1"
    assert not (partial / "trainer_state.json").exists() and not (partial / "kvckpt_buffer.kvckpt").exists()
    kept = sorted(p.name for p in partial.iterdir())
    assert kept, "TRL's save wrote nothing before the kill"
    with ReplayBuffer.open(str(tmp_path / "buffer.kv"), readonly=True) as buf:
        ledger = buf.ledger()
        durable_at_kill = {(e.group_id, i): p.length for e in ledger
                           for i, p in buf.progress(e.group_id).items()}
    assert {s["group"] for s in in_flight} <= {e.group_id for e in ledger}
    # What the store holds is what the recorder had acknowledged: the held flush never landed.
    assert {(s["group"], s["index"]): s["durable"] for s in in_flight if s["durable"]} == durable_at_kill

    second = _run(tmp_path, model, srv)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "is a partial checkpoint" in second.stderr and "partial-checkpoint-1" in second.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "partial-checkpoint-1").iterdir()) == kept  # set aside whole
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").is_file()  # the restart's own
    (done,) = [e for e in _events(tmp_path) if "done" in e]
    assert done["done"] == MAX_STEPS and done["plan"]["resume_version"] == 0
    assert done["plan"]["groups_redispatched"] == len(ledger)
    durable = sum(s["durable"] for s in in_flight)
    assert done["plan"]["progress_tokens"] == sum(durable_at_kill.values()) == durable > 0
    assert done["stats"]["tokens_resumed"] == durable
    # The promise on the defaults: a kill costs a sequence at most one interval (one token per event).
    regenerated = [s["generated"] - s["durable"] for s in in_flight]
    assert max(regenerated) <= EVERY
    got = _completions_by_prompt(tmp_path / "buffer.kv")
    compared = sorted({s["prompt_idx"] for s in in_flight})
    for prompt_idx in compared:
        expected = _uninterrupted(model, srv, prompt_idx)
        assert got[prompt_idx] == [expected] * len(got[prompt_idx]), prompt_idx
    print(json.dumps({"kill": "inside TRL's first save", "sequences_in_flight": len(in_flight),
                      "tokens_in_flight": sum(s["generated"] for s in in_flight), "durable": durable,
                      "regenerated_per_sequence": regenerated, "interval": EVERY, "prompts_bit_exact": len(compared),
                      "set_aside": kept}))


def test_a_weight_sync_mid_stream_stamps_each_token_with_the_weights_that_made_it(tmp_path, server):
    """Issue 49: TRL's weight sync after step 2 lands while a sample streams (the stream's reader is
    held in a batch dispatched on the weights of step 1, at a step where a sample has a durable chunk
    of them and at least an interval of its budget left, so on every timeline that sample straddles the
    sync) and really changes the server's weights (a reload between TRL's pause and resume, to a marker
    model that generates one token only). SIGKILL once the held sample's own chunk of the new weights is
    durable. Each durable token's version is the weights that made it: version 1 on exactly the tokens
    the startup weights generate uninterrupted, version 2 on marker tokens only. A resume from
    checkpoint-1 (destroying the weights of step 2) keeps them, and the group's stamps are its oldest
    and newest tokens' versions."""
    import numpy as np

    sys.path.insert(0, os.path.dirname(RUN))
    from trl_cpu import marker_model, reload_server_weights

    model, srv = server
    marker = marker_model(model, str(tmp_path / "marker"))
    try:
        reload_server_weights(srv.url, marker)
        marks = set(_uninterrupted(model, srv, 0)[0])
    finally:
        reload_server_weights(srv.url, model)
    assert len(marks) == 1  # the marker's one token
    (mark,) = marks
    synced = 2  # TRL's third sync (cold, after step 1, after step 2) sends the weights of step 2: the marker's
    try:
        first = _run(tmp_path, model, srv, sync_mid_stream_at=synced, reload={"3": marker})
        assert first.returncode == -9, first.stderr[-3000:] + srv.tail()
        (killed,) = [e for e in _events(tmp_path) if "killed_after_sync" in e]
        with ReplayBuffer.open(str(tmp_path / "buffer.kv"), readonly=True) as buf:
            kept = [(e.group_id, e.prompt_idx, i, p.tokens.tolist(), p.versions.tolist())
                    for e in buf.ledger() for i, p in buf.progress(e.group_id).items()]
        second = _run(tmp_path, model, srv, resume=str(tmp_path / "out" / "checkpoint-1"), reload={"1": model})
        assert second.returncode == 0, second.stderr[-3000:]
    finally:
        reload_server_weights(srv.url, model)  # the module's other tests need the startup weights
    groups_kept: dict[str, set[int]] = {}
    for gid, prompt_idx, _, tokens, versions in kept:
        versions, tokens = np.array(versions), np.array(tokens)
        assert (np.diff(versions) >= 0).all() and set(versions.tolist()) <= {synced - 1, synced}
        assert set(tokens[versions == synced].tolist()) <= {mark}  # the new weights' tokens are the marker's
        old = tokens[versions == synced - 1].tolist()
        expected, _ = _uninterrupted(model, srv, prompt_idx)
        assert old == expected[:len(old)]  # the old weights' tokens are the startup weights', in order
        groups_kept.setdefault(gid, set()).update(versions.tolist())
    straddled = [gid for gid, versions in groups_kept.items() if versions == {synced - 1, synced}]
    # the held sample was mid-stream at the sync: its durable chunks hold tokens of both weights, in order
    held = tuple(killed["held"])
    (held_versions,) = [versions for gid, _, i, _, versions in kept if (gid, i) == held]
    assert set(held_versions) == {synced - 1, synced}, (held, kept)
    assert held[0] in straddled, kept
    with ReplayBuffer.open(str(tmp_path / "buffer.kv"), readonly=True) as buf:
        groups = {g.group_id: g for g in buf.groups()}
    for gid in straddled:  # committed by the resumed run: its oldest token is of step 1, its newest of step 2
        assert (groups[gid].start_weight, groups[gid].end_weight) == (synced - 1, synced)
        # The resume from checkpoint-1 destroyed the weights of step 2, which made its newest tokens (issue 49):
        # forked at 1, its staleness that token's tree distance, (2 - 1) + (current - 1), lineage weight 0.
        assert (groups[gid].lineage_fork, groups[gid].lineage_newest, groups[gid].lineage_weight) == \
            (synced - 1, synced, 2 * (synced - 1) - synced)
    print(json.dumps({"kill": "after a weight sync mid-stream", "groups_straddling": len(straddled),
                      "sequences_kept": len(kept),
                      "tokens_old_weights": [int((np.array(k[4]) == synced - 1).sum()) for k in kept],
                      "tokens_new_weights": [int((np.array(k[4]) == synced).sum()) for k in kept],
                      "lineage_fork": [groups[gid].lineage_fork for gid in straddled]}))


def test_the_server_path_builds_trls_own_weight_transfer_as_trl_does(tmp_path):
    """``ServerWeightSync`` without an inner transfer builds TRL's ``WeightTransferClient`` from the
    trainer's model and config exactly as ``AsyncGRPOTrainer.__init__`` would (no server needed)."""
    from types import SimpleNamespace

    from kvckpt.integrations.trl.sync import trl_weight_transfer
    from kvckpt.integrations.vllm import ensure_tiny_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(str(tmp_path / "model")))
    args = SimpleNamespace(vllm_server_base_url="http://127.0.0.1:9/", vllm_server_timeout=3.0, weight_sync_timeout=7)
    client = trl_weight_transfer(model, args)
    assert isinstance(client, WeightTransferClient) and client.weight_sync_timeout == 7
    assert (client.vllm.server_url, client.vllm.server_timeout) == ("http://127.0.0.1:9", 3.0)
    params = list(_iter_vllm_named_params(model))
    assert client._weight_update_info["names"] == [name for name, _ in params]
    assert client._weight_update_info["shapes"] == [list(p.shape) for _, p in params]
    assert set(client._weight_update_info["dtype_names"]) == {"float32"}
