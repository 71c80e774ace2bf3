"""The NeMo-RL engine proxy's and re-issue's refusals and pass-through, in process (the crash test is
test_nemo_rl_progress_crash.py): the interval key's check, an unwrapped rollout manager, a request with no key."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from _nemo_rl import SAMPLERS, store_config
from kvckpt.integrations.nemo_rl import parse_config
from kvckpt.integrations.nemo_rl.engine import ProgressEngine
from kvckpt.integrations.nemo_rl.reissue import install_generate_and_push, reissue_inflight

from kvckpt.errors import BadArgument


@pytest.mark.parametrize("every", [-1, True, 2.5, "8"])
def test_progress_every_tokens_is_refused_unless_a_non_negative_integer(tmp_path: Any, every: Any) -> None:
    config = {**store_config(str(tmp_path / "r.kv"), SAMPLERS["windowed"]), "progress_every_tokens": every}
    with pytest.raises(BadArgument, match="progress_every_tokens must be an integer >= 0"):
        parse_config(config)
    assert parse_config({**config, "progress_every_tokens": 8}).progress_every_tokens == 8
    assert parse_config(store_config(str(tmp_path / "r.kv"), SAMPLERS["windowed"])).progress_every_tokens == 0


def test_reissue_refuses_a_rollout_manager_whose_generate_and_push_is_not_wrapped() -> None:
    class Manager:
        async def generate_and_push(self, input_sample: Any, **kwargs: Any) -> str:
            return "committed"

    with pytest.raises(BadArgument, match="is not wrapped"):
        asyncio.run(reissue_inflight(Manager(), object(), lambda lease: {}))
    install_generate_and_push(Manager)
    wrapped = Manager.generate_and_push
    install_generate_and_push(Manager)  # idempotent
    assert Manager.generate_and_push is wrapped


@dataclass
class _Out:
    outputs: list[Any] = field(default_factory=list)


class _Engine:
    def __init__(self) -> None:
        self.outputs = [_Out(["a"]), _Out(["b"])]
        self.calls: list[tuple[Any, Any, str]] = []

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str) -> Any:
        self.calls.append((prompt, sampling_params, request_id))
        for out in self.outputs:
            yield out


def test_a_request_without_a_sequence_key_passes_through_untouched() -> None:
    engine = _Engine()
    proxy = ProgressEngine(engine, sink=None, every_tokens=8, eos=None)
    prompt, params = {"prompt_token_ids": [1, 2]}, object()

    async def collect() -> list[Any]:
        return [out async for out in proxy.generate(prompt, params, "r1")]

    assert asyncio.run(collect()) == engine.outputs  # the engine's own objects, not copies
    assert engine.calls == [(prompt, params, "r1")]
    assert proxy.stats == {"requests": 0, "generated": 0, "resumed": 0, "refused": 0}


def test_the_launcher_refuses_progress_it_cannot_attach(tmp_path: Any) -> None:
    """``install()`` cannot reach NeMo-RL's Ray generation workers: a progress interval in its config is
    refused, before NeMo-RL is needed, instead of being silently dropped."""
    from kvckpt.integrations.nemo_rl.swap import install

    config = {"async_rl": {"replay_buffer": {**store_config(str(tmp_path / "r.kv"), SAMPLERS["windowed"]),
                                             "progress_every_tokens": 8}}}
    with pytest.raises(BadArgument, match="does not yet attach the engine proxy"):
        install(config)
