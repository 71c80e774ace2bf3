"""The TRL server path's parts that need no server: the request is TRL's own, the stream events
are read as vLLM writes them, and a TRL row is held against its durable prefix by its
``completion_mask``.

The full path (a real vLLM server, a real AsyncGRPOTrainer killed mid-generation) is
tests/integrations/trl/test_trl_server.py, in ``.venv-vllm``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from kvckpt.integrations.trl.server import ServerGenerationError, VLLMServerBackend, _event

from kvckpt import BufferConfig, Prompt, ReplayBuffer
from kvckpt.errors import BadArgument

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed")


@pytest.mark.trl
@needs_trl
def test_the_request_is_trls_own_streamed(model_path):
    """TRL's ``_AsyncRolloutLoop._generate_one_turn`` builds its ``/v1/completions`` body; the
    backend's is the same body (its sampling fields from the same config), plus ``stream``."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    sent = []

    async def retry(factory, **_):
        return await factory()

    async def post(path, payload, timeout):
        sent.append((path, payload))
        return {"choices": [{"token_ids": [], "logprobs": {"token_logprobs": []}}]}

    loop = SimpleNamespace(_request_model=model_path, max_tokens=7, temperature=0.5, top_p=0.9, top_k=5,
                           repetition_penalty=1.1, min_p=0.05, request_timeout=30, _retry=retry, _post=post)
    asyncio.run(_AsyncRolloutLoop._generate_one_turn(loop, [1, 2, 3]))
    ((path, trl_body),) = sent
    ours = VLLMServerBackend(model_path, server_url="http://127.0.0.1:1/", sampling={
        "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "min_p": 0.05, "unrelated": 1}).payload([1, 2, 3], 7, 0.5)
    assert path == "/v1/completions"
    assert ours.pop("stream") is True
    assert set(ours) == set(trl_body)
    assert {k: v for k, v in ours.items() if k != "seed"} == {k: v for k, v in trl_body.items() if k != "seed"}


def test_stream_events_are_read_as_vllm_writes_them():
    """A streamed completion chunk gives its token ids and logprobs; other lines give nothing; a
    chunk whose ids and logprobs disagree, or text without ids, is refused."""
    chunk = {"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
                          "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["a", "b"]}}]}
    assert _event(b"data: " + json.dumps(chunk).encode()) == ([5, 6], [-0.5, -0.25])
    assert _event(b"data: [DONE]") is None
    assert _event(b"") is None
    assert _event(b'data: {"choices": [{"text": "", "token_ids": null}]}') is None
    with pytest.raises(ServerGenerationError, match="without token_ids"):
        _event(b'data: {"choices": [{"text": "x"}]}')
    with pytest.raises(ServerGenerationError, match="2 token ids with 1 logprobs"):
        _event(b'data: {"choices": [{"text": "x", "token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]}')


def test_a_trl_row_is_held_against_its_durable_prefix_by_its_completion_mask(tmp_path):
    """A TRL row is prompt + completion with ``completion_mask``: its commit is checked against
    the completion part (accepted when it begins with the durable prefix, refused otherwise)."""
    from kvckpt.integrations.trl.worker import trl_schema

    config = BufferConfig(group_size=1, schema=trl_schema(), max_buffered_rollouts=4)
    prompt, completion = [7, 8, 9], [1, 2, 3, 4]

    def row(done):
        return {"input_ids": torch.tensor(prompt + done), "completion_mask": torch.tensor([0] * 3 + [1] * len(done)),
                "old_log_probs": torch.zeros(3 + len(done)), "advantage": torch.tensor(0.0),
                "reward": torch.tensor(1.0)}

    with ReplayBuffer.create(str(tmp_path / "buf.kv"), config) as buf:
        good, bad = buf.admit([Prompt(0), Prompt(1)])
        for lease in (good, bad):
            (result,) = buf.record_progress_many([{"lease": lease, "index": 0, "start": 0,
                                                   "tokens": torch.tensor(completion[:2]),
                                                   "logprobs": torch.zeros(2), "weight_version": 0}])
            assert result == 2
        with pytest.raises(BadArgument, match="does not begin with the sample's durable prefix"):
            buf.commit_group(bad, [row([1, 9, 3, 4])])
        assert buf.commit_group(good, [row(completion)]).ready
