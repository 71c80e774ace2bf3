"""The rollout worker: rows it commits, logprobs it stores, refusals it reports, weights it takes.

Real generation on the tiny model (built at run time, no hub), real LMDB stores. The
transformers backend runs in the main environment; the vLLM tests (marker ``vllm``) run inside
``.venv-vllm`` (``scripts/setup_peer_env.sh vllm``) and skip where vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch
from kvckpt.integrations.vllm import DEFAULT_SCHEMA, AdditionTask, RolloutWorker
from kvckpt.integrations.vllm.worker import TOKEN_VERSIONS

from kvckpt import BufferConfig, ReplayBuffer, StaleAttempt

GROUP = 4


@pytest.fixture(scope="module")
def hf_worker(model_path: str) -> RolloutWorker:
    return RolloutWorker(model_path, backend="transformers", max_tokens=5, seed=1)


def _buffer(tmp_path, name: str = "buf.kv") -> ReplayBuffer:
    return ReplayBuffer.create(str(tmp_path / name), BufferConfig(
        group_size=GROUP, schema=DEFAULT_SCHEMA, sampler="ready_first", max_buffered_rollouts=8))


def _reference_model(model_path: str, state: dict | None = None) -> torch.nn.Module:
    """A fresh transformers copy of the policy (optionally with ``state`` loaded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _teacher_forced_logprobs(model: torch.nn.Module, sample) -> torch.Tensor:
    """The completion tokens' logprobs recomputed by teacher forcing: what the engine must report."""
    ids = torch.tensor([list(sample.prompt_ids) + list(sample.completion_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(sample.prompt_ids) - 1:]


def _check_committed_group(buf: ReplayBuffer, worker: RolloutWorker, model_path: str, backend_tol: float) -> None:
    leases = buf.admit([3, 17], holder=worker.holder)  # the trainer admits for the worker, by its name
    assert worker.holder == f"{socket.gethostname()}:{os.getpid()}" and buf.leases_held_by(worker.holder) == leases
    samples, version = worker.generate(leases)
    assert version == worker.weight_version == 0
    assert [len(g) for g in samples] == [GROUP, GROUP]
    for lease, group in zip(leases, samples, strict=True):
        assert worker.commit(buf, lease, worker.rows(lease, group), version).ready
    batch = buf.read_batch(leases_ids := [lease.group_id for lease in leases], layout="list")
    assert batch.group_ids == [g for g in leases_ids for _ in range(GROUP)]
    task, reference = AdditionTask(), _reference_model(model_path)
    for n, row in enumerate(batch.rows):
        lease, sample = leases[n // GROUP], samples[n // GROUP][n % GROUP]
        prompt = worker.prompt_ids(lease)
        assert list(sample.prompt_ids) == prompt
        plen, clen = len(prompt), len(sample.completion_ids)
        assert 1 <= clen <= worker.max_tokens
        assert set(row) == set(DEFAULT_SCHEMA)
        assert row["input_ids"].tolist() == prompt + list(sample.completion_ids)
        assert row["input_lengths"].item() == plen + clen
        assert row["token_mask"].tolist() == [0] * plen + [1] * clen
        assert row["sample_mask"].item() == 1.0
        assert row["total_reward"].item() == task.reward(lease.prompt_idx, sample.text)
        # Stored generation logprobs are exactly what the engine reported (float32)...
        assert row["generation_logprobs"][:plen].tolist() == [0.0] * plen
        assert row["generation_logprobs"][plen:].tolist() == torch.tensor(sample.logprobs, dtype=torch.float32).tolist()
        # ...and the engine reported the generating policy's logprobs of the sampled tokens.
        expected = _teacher_forced_logprobs(reference, sample)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=backend_tol)
        if sample.finish_reason == "stop":
            assert sample.completion_ids[-1] == worker.tokenizer.eos_token_id
        else:
            assert clen == worker.max_tokens


def test_transformers_worker_commits_well_formed_groups(tmp_path, hf_worker, model_path):
    with _buffer(tmp_path) as buf:
        _check_committed_group(buf, hf_worker, model_path, backend_tol=1e-4)
        assert buf.stats()["committed"] == 2


def test_commit_per_sample_and_regenerate_only_missing_siblings(tmp_path, model_path):
    worker = RolloutWorker(model_path, max_tokens=3, commit="sample", seed=2)
    path = str(tmp_path / "buf.kv")
    with _buffer(tmp_path) as buf:
        [lease] = buf.admit([5])
        samples, _ = worker.generate([lease])
        rows = worker.rows(lease, samples[0])
        for index in (0, 1):
            assert not buf.commit_sample(lease, index, rows[index]).ready
    with ReplayBuffer.open(path) as buf:  # a crash: siblings 0 and 1 are kept, 2 and 3 redispatched
        [again] = buf.recover().leases
        assert again.missing == (2, 3) and again.attempt == 1
        [result] = worker.run(buf, [again])
        assert result.ready and result.rows_written == 1  # the last commit_sample wrote one row
        assert buf.stats()["samples_committed"] == 4
        stored = buf.read_batch([lease.group_id], layout="list").rows
        assert [r["input_ids"].tolist() for r in stored[:2]] == [rows[i]["input_ids"].tolist() for i in (0, 1)]
        assert [r["token_mask"].sum().item() >= 1 for r in stored] == [True] * GROUP


def test_run_reports_a_fenced_lease_and_writes_nothing(tmp_path, hf_worker):
    path = str(tmp_path / "buf.kv")
    with _buffer(tmp_path) as buf:
        old = buf.admit([1, 2])
    with ReplayBuffer.open(path) as buf:
        fresh = buf.recover().leases
        results = hf_worker.run(buf, [old[0], fresh[1]])
        assert isinstance(results[0], StaleAttempt)
        assert results[1].ready
        assert [e.group_id for e in buf.ledger()] == [old[0].group_id]
        assert buf.stats()["committed"] == 1


def test_the_commits_of_one_engine_call_share_one_durable_transaction(tmp_path, hf_worker):
    with _buffer(tmp_path) as buf:
        leases = buf.admit([4, 5, 6])
        before = dict(buf.committer.stats)
        results = hf_worker.run(buf, leases)
        assert [r.ready for r in results] == [True] * 3
        assert buf.committer.stats["transactions"] - before["transactions"] == 1
        assert buf.committer.stats["transitions"] - before["transitions"] == 3
        assert buf.stats()["committed"] == 3 and buf.ledger() == []


def test_new_weights_reach_generation(tmp_path, model_path):
    worker = RolloutWorker(model_path, max_tokens=4, seed=3)
    state = {k: v.clone() for k, v in worker.backend.model.state_dict().items()}
    torch.manual_seed(7)
    state = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    worker.load_weights(state, version=5)
    assert worker.weight_version == 5
    with _buffer(tmp_path) as buf:
        [lease] = buf.admit([9], weight_version=worker.weight_version)
        [result] = worker.run(buf, [lease])
        assert result.ready and buf.group(lease.group_id).end_weight == 5
        [row] = buf.read_batch([lease.group_id], layout="list").rows[:1]
    samples, _ = worker.generate([lease])
    expected = _teacher_forced_logprobs(_reference_model(model_path, state), samples[0][0])
    assert torch.allclose(torch.tensor(samples[0][0].logprobs), expected, atol=1e-4)
    assert row["generation_logprobs"].shape == row["input_ids"].shape


HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (run in .venv-vllm: scripts/setup_peer_env.sh vllm)")
def test_vllm_worker_commits_engine_logprobs_and_takes_weights(tmp_path, model_path):
    worker = RolloutWorker(model_path, backend="vllm", max_tokens=5, seed=1)
    with _buffer(tmp_path) as buf:
        _check_committed_group(buf, worker, model_path, backend_tol=1e-3)
    state = _reference_model(model_path).state_dict()
    torch.manual_seed(11)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    worker.load_weights(state, version=1)
    with _buffer(tmp_path, "after.kv") as buf:
        [lease] = buf.admit([4], weight_version=worker.weight_version)
        samples, version = worker.generate([lease])
        assert version == 1
        reference = _reference_model(model_path, state)
        for sample in samples[0]:
            expected = _teacher_forced_logprobs(reference, sample)
            assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-3)
        assert worker.commit(buf, lease, worker.rows(lease, samples[0]), version).ready


# -- bit-exact resume from durable progress ---------------------------------------------------------
RESUME_SCHEMA = {**DEFAULT_SCHEMA, TOKEN_VERSIONS: ("int64", "token")}
#: Prompts (prompt_idx of AdditionTask) whose greedy completions under the (random-weight) tiny
#: model change token at or after the durable prefix (960 x 8 then 102 x 8; 385 x 10 then 365 x 6),
#: so a resume that dropped or misplaced the prefix would differ, with no end-of-text within
#: RESUME_MAX_TOKENS and no near-tie: see MIN_MARGIN. Chosen by scanning prompts 0-39.
RESUME_PROMPTS = [10, 26]
RESUME_GROUP, RESUME_MAX_TOKENS, RESUME_EVERY, RESUME_KILL_AT = 2, 16, 4, 10
#: The smallest gap between the top-1 and top-2 logits, at every greedy step of the reference
#: completions, that the test requires (asserted). float32 recomputation of the same prefix in
#: another batch shape or another process moves logits by ~1e-5 here (the logprobs are asserted
#: to agree to 1e-4), so a gap of MIN_MARGIN can never flip a greedy choice.
MIN_MARGIN = 1e-2
_KILLED_CHILD = """
import os, signal, sys
from kvckpt import ReplayBuffer
from kvckpt.integrations.vllm import RolloutWorker
path, model, backend, every, kill_at, max_tokens = sys.argv[1:4] + [int(a) for a in sys.argv[4:7]]
prompts = [int(p) for p in sys.argv[7].split(",")]
options = {"step_tokens": 1} if backend == "transformers" else {}
buf = ReplayBuffer.open(path)
worker = RolloutWorker(model, backend=backend, max_tokens=max_tokens, temperature=0.0, progress_every_tokens=every,
                       fields=buf.schema.fields, backend_options=options)

def kill(states):
    if states[0].generated >= kill_at:  # after this step's appends: the tokens past the last one die
        os.kill(os.getpid(), signal.SIGKILL)

worker.run(buf, buf.admit(prompts), after_step=kill)
raise SystemExit("not killed")
"""


def _greedy_margins(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """The top-1 minus top-2 logit at every completion position, by teacher forcing."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        top = model(ids).logits[0, len(prompt) - 1:-1].float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _check_bit_exact_resume(tmp_path, model_path: str, backend: str, **options) -> None:
    """Greedy: a run SIGKILLed at token RESUME_KILL_AT (a fresh process), resumed in this process
    from its durable prefix (the last multiple of RESUME_EVERY), commits exactly the tokens of an
    uninterrupted run; the resumed worker generated only the tokens past the prefix, and the
    prefix's tokens, logprobs and versions in the row are the recorded ones."""
    import subprocess
    import sys

    worker = RolloutWorker(model_path, backend=backend, max_tokens=RESUME_MAX_TOKENS, temperature=0.0,
                           progress_every_tokens=RESUME_EVERY, fields=RESUME_SCHEMA, backend_options=options)
    config = BufferConfig(group_size=RESUME_GROUP, schema=RESUME_SCHEMA, max_buffered_rollouts=4)
    with ReplayBuffer.create(str(tmp_path / "reference.kv"), config) as buf:
        leases = buf.admit(RESUME_PROMPTS)
        assert all(r.ready for r in worker.run(buf, leases))
        reference = buf.read_batch([lease.group_id for lease in leases], layout="list").rows
    policy, durable = _reference_model(model_path), RESUME_KILL_AT // RESUME_EVERY * RESUME_EVERY
    for lease_no in range(len(RESUME_PROMPTS)):
        row = reference[lease_no * RESUME_GROUP]
        plen = int((row["token_mask"] == 0).sum())
        completion = row["input_ids"][plen:].tolist()
        assert len(completion) == RESUME_MAX_TOKENS and worker.tokenizer.eos_token_id not in completion
        # what a resume from the prompt alone (the prefix lost) would produce differs:
        assert completion[durable:] != completion[:RESUME_MAX_TOKENS - durable]
        assert min(_greedy_margins(policy, row["input_ids"][:plen].tolist(), completion)) >= MIN_MARGIN

    path = str(tmp_path / "killed.kv")
    ReplayBuffer.create(path, config).close()
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, path, model_path, backend, str(RESUME_EVERY),
                            str(RESUME_KILL_AT), str(RESUME_MAX_TOKENS), ",".join(map(str, RESUME_PROMPTS))],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == -9, child.stderr[-2000:]
    before = dict(worker.progress_stats)
    with ReplayBuffer.open(path) as buf:  # fresh handle, after the kill
        leases = buf.recover().leases
        recorded = {lease.group_id: buf.progress(lease) for lease in leases}
        assert [sorted((i, p.length) for i, p in recorded[lease.group_id].items()) for lease in leases] == \
            [[(i, durable) for i in range(RESUME_GROUP)]] * len(leases)
        assert all(r.ready for r in worker.run(buf, leases))
        resumed = buf.read_batch([lease.group_id for lease in leases], layout="list").rows
        assert all(buf.progress(lease) == {} for lease in leases)  # the commit deleted the prefixes
    rows = len(RESUME_PROMPTS) * RESUME_GROUP
    assert worker.progress_stats["tokens_resumed"] - before["tokens_resumed"] == rows * durable
    generated = worker.progress_stats["tokens_generated"] - before["tokens_generated"]
    assert generated == rows * (RESUME_MAX_TOKENS - durable)
    for n, (want, got) in enumerate(zip(reference, resumed, strict=True)):
        assert got["input_ids"].tolist() == want["input_ids"].tolist()  # bit-exact
        assert got["token_versions"].tolist() == want["token_versions"].tolist()
        plen = int((got["token_mask"] == 0).sum())
        prefix = recorded[leases[n // RESUME_GROUP].group_id][n % RESUME_GROUP]
        assert got["generation_logprobs"][plen:plen + durable].tolist() == prefix.logprobs.tolist()
        assert torch.allclose(got["generation_logprobs"], want["generation_logprobs"], atol=1e-4)


def test_transformers_resume_from_durable_progress_is_bit_exact(tmp_path, model_path):
    _check_bit_exact_resume(tmp_path, model_path, "transformers", step_tokens=1)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (run in .venv-vllm: bash scripts/setup_peer_env.sh vllm)")
def test_vllm_resume_from_durable_progress_is_bit_exact(tmp_path, model_path):
    _check_bit_exact_resume(tmp_path, model_path, "vllm")


# -- the engine requests of generate and stream (issue 45, seventeenth session) ---------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (run in .venv-vllm: bash scripts/setup_peer_env.sh vllm)")
def test_vllm_requests_ask_for_what_the_rows_keep_and_min_tokens_fixes_the_length(model_path):
    """``min_tokens`` reaches every engine request, capped at the tokens left and counted with a durable
    prefix, so ``min_tokens=max_tokens`` makes every completion exactly ``max_tokens`` long (the benchmark's
    fixed work); ``stream``'s requests ask for no per-step text and only the sampled token's logprob, and its
    samples still carry the generating policy's logprobs and their decoded text. The requests are read from the
    real engine's ``add_request`` (a spy that calls it)."""
    from kvckpt.integrations.vllm.backends import VLLMBackend
    from kvckpt.integrations.vllm.stream import Continuation

    backend = VLLMBackend(model_path, seed=1, min_tokens=16)  # more than any max_tokens below: capped
    engine, asked = backend.llm.llm_engine, []
    add_request = engine.add_request

    def spy(request_id, prompt, params, *args, **kwargs):
        asked.append((len(prompt["prompt_token_ids"]), params.n, params.max_tokens, params.min_tokens,
                      params.logprobs, params.detokenize))
        return add_request(request_id, prompt, params, *args, **kwargs)

    engine.add_request = spy
    prompt = backend.tokenizer.encode("12+34=")
    [group] = backend.generate([prompt], [3], 12, 1.0)
    assert [len(s.completion_ids) for s in group] == [12, 12, 12]
    assert asked == [(len(prompt), 3, 12, 12, 1, True)]

    asked.clear()
    first = group[0]
    prefix = Continuation(tuple(prompt), first.completion_ids[:5], first.logprobs[:5], (0,) * 5)
    fresh, resumed = backend.stream([Continuation(tuple(prompt)), prefix], 12, 1.0)
    assert [len(fresh.completion_ids), len(resumed.completion_ids)] == [12, 12]
    assert resumed.completion_ids[:5] == first.completion_ids[:5]
    backend.min_tokens = 8  # counted with the prefix: 3 more tokens at least, of the 7 left
    backend.stream([prefix], 12, 1.0)
    assert asked == [(len(prompt), 1, 12, 12, 0, False), (len(prompt) + 5, 1, 7, 7, 0, False),
                     (len(prompt) + 5, 1, 7, 3, 0, False)]

    reference = _reference_model(model_path)
    for sample in (fresh, resumed):
        assert sample.text == backend.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        expected = _teacher_forced_logprobs(reference, sample)
        assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-3)
