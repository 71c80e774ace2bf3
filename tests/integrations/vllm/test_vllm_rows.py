"""rows_from_vllm: vLLM RequestOutputs -> rows that commit to a real store and read back.

The outputs are built from vLLM's own output classes where vLLM is installed (``.venv-vllm``);
elsewhere from plain objects with the same attributes, which is all ``rows_from_vllm`` reads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvckpt.integrations.vllm import DEFAULT_SCHEMA, TEXT_FIELDS, rows_from_vllm

from kvckpt import ReplayBuffer
from kvckpt.errors import BadArgument

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@dataclass
class _Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _Completion:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None = "stop"


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[Any]
    finished: bool = True


def _classes(real: bool) -> tuple[Any, Any, Any]:
    if not real:
        return _Request, _Completion, _Logprob
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput, CompletionOutput, Logprob


def make_outputs(real: bool = False) -> list[Any]:
    """Two prompts, two completions each; logprob dicts hold the sampled token and one other (logprobs=1)."""
    request, completion, logprob = _classes(real)
    out = []
    for i, prompt in enumerate(["1+1=", "2+2="]):
        completions = []
        for j in range(2):
            tokens = [10 + i, 20 + j, 2][: 2 + j]
            steps = [{tok: logprob(-0.25 * (k + 1), rank=1), 999: logprob(-7.0, rank=2)}
                     for k, tok in enumerate(tokens)]
            completions.append(completion(index=j, text=f"{i + 1}{j}", token_ids=tokens,
                                          cumulative_logprob=None, logprobs=steps, finish_reason="stop"))
        out.append(request(request_id=f"r{i}", prompt=prompt, prompt_token_ids=[1, 2, 3 + i],
                           prompt_logprobs=None, outputs=completions, finished=True))
    return out


def test_rows_carry_tokens_logprobs_masks_and_text():
    groups = rows_from_vllm(make_outputs(), reward=lambda req, c: float(c.text == "20"))
    assert [len(g) for g in groups] == [2, 2]
    row = groups[1][0]
    assert row["input_ids"].tolist() == [1, 2, 4, 11, 20]
    assert row["generation_logprobs"].tolist() == [0.0, 0.0, 0.0, -0.25, -0.5]
    assert row["token_mask"].tolist() == [0, 0, 0, 1, 1] and row["input_lengths"].item() == 5
    assert row["total_reward"].item() == 1.0 and groups[0][0]["total_reward"].item() == 0.0
    assert row["prompt_text"] == "2+2=" and row["completion_text"] == "20"
    assert set(row) == set(DEFAULT_SCHEMA) | set(TEXT_FIELDS)
    only = rows_from_vllm(make_outputs(), fields=["input_ids"])
    assert set(only[0][1]) == {"input_ids"}
    assert "total_reward" not in rows_from_vllm(make_outputs())[0][0]


@pytest.mark.parametrize("damage", ["no logprobs", "short logprobs", "sampled token missing", "no prompt ids"])
def test_unusable_outputs_are_bad_arguments(damage):
    outputs = make_outputs()
    completion = outputs[1].outputs[1]
    if damage == "no logprobs":
        completion.logprobs = None
        match = "request output 1 \\(r1\\) completion 1 has no logprobs: sample with SamplingParams\\(logprobs=0\\)"
    elif damage == "short logprobs":
        completion.logprobs = completion.logprobs[:-1]
        match = "has 3 tokens but 2 logprob positions"
    elif damage == "sampled token missing":
        completion.logprobs[2] = {999: _Logprob(-1.0)}
        match = "position 2 has no logprob for its sampled token 2"
    else:
        outputs[1].prompt_token_ids = None
        match = "request output 1 has no prompt_token_ids"
    with pytest.raises(BadArgument, match=match):
        rows_from_vllm(outputs)


def test_rows_commit_with_text_fields_and_read_back(tmp_path):
    from kvckpt import BufferConfig

    schema = {**DEFAULT_SCHEMA, "prompt_text": ("str", "row"), "completion_text": ("str", "row")}
    path = str(tmp_path / "buf.kv")
    with ReplayBuffer.create(path, BufferConfig(group_size=2, schema=schema)) as buf:
        leases = buf.admit([0, 1])
        groups = rows_from_vllm(make_outputs(), reward=lambda req, c: 0.5, fields=buf.schema.fields)
        assert all(buf.commit_group(lease, group).ready for lease, group in zip(leases, groups, strict=True))
    with ReplayBuffer.open(path) as fresh:
        batch = fresh.read_batch([leases[0].group_id, leases[1].group_id])
    assert batch.tensors["prompt_text"] == ["1+1=", "1+1=", "2+2=", "2+2="]
    assert batch.tensors["completion_text"] == ["10", "11", "20", "21"]
    assert batch.tensors["generation_logprobs"].dtype == torch.float32
    assert batch.tensors["input_ids"][3].tolist() == [1, 2, 4, 11, 21, 2]


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here (it is in .venv-vllm)")
def test_real_vllm_output_classes():
    fake, real = rows_from_vllm(make_outputs(real=False)), rows_from_vllm(make_outputs(real=True))
    for group_a, group_b in zip(fake, real, strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
