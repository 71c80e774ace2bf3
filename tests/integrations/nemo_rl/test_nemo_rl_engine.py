"""The NeMo-RL engine proxy's and re-issue's refusals and pass-through, in process (the crash test is
test_nemo_rl_progress_crash.py): the interval key's check, an unwrapped rollout manager, a request with no key."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from _nemo_rl import SAMPLERS, store_config
from kvckpt.integrations.nemo_rl import parse_config
from kvckpt.integrations.nemo_rl.engine import ProgressEngine, sequence
from kvckpt.integrations.nemo_rl.reissue import install_generate_and_push, reissue_inflight
from kvckpt.integrations.vllm import DEFAULT_SCHEMA

from kvckpt import Lease, ProgressEncoder
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
    assert proxy.stats == {"requests": 0, "generated": 0, "resumed": 0, "refused": 0, "loop_s": 0.0}


def _stand_in(monkeypatch: pytest.MonkeyPatch, name: str, **members: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(members)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_the_launcher_makes_nemo_rl_build_kvckpts_worker_and_key_its_rollouts(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``install()`` with ``progress_every_tokens`` (against stand-ins of the NeMo-RL names it changes, 7ea279ab):
    ``VllmGeneration``'s worker class resolves to kvckpt's, which NeMo-RL's registry gives NeMo-RL's worker
    environment, and ``RolloutManager.generate_and_push`` is wrapped (it starts the desk and keys the rollouts)."""
    from kvckpt.integrations.nemo_rl.remote import NEMO_RL_WORKER_FQN, WORKER_FQN
    from kvckpt.integrations.nemo_rl.swap import install

    class RolloutManager:
        async def generate_and_push(self, input_sample: Any, **kwargs: Any) -> str:
            return "committed"

    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.generation", "nemo_rl.models.generation.vllm",
                 "nemo_rl.distributed", "nemo_rl.experience", "nemo_rl.algorithms",
                 "nemo_rl.algorithms.single_controller_utils"):
        _stand_in(monkeypatch, name)
    quant = "nemo_rl.modelopt.Quant"
    def resolve(default: str, cfg: dict) -> str:  # NeMo-RL's: its ModelOpt worker when quant_cfg is set
        return default if cfg.get("quant_cfg") is None else quant

    generation = _stand_in(monkeypatch, "nemo_rl.models.generation.vllm.vllm_generation",
                           resolve_generation_worker_cls=resolve)
    registry = _stand_in(monkeypatch, "nemo_rl.distributed.ray_actor_environment_registry",
                         ACTOR_ENVIRONMENT_REGISTRY={NEMO_RL_WORKER_FQN: "uv run --extra vllm"})
    _stand_in(monkeypatch, "nemo_rl.experience.rollout_manager", RolloutManager=RolloutManager)
    _stand_in(monkeypatch, "nemo_rl.algorithms.single_controller_utils.setup", TQReplayBuffer=None,
              build_data_plane_client=lambda *a, **k: None)
    _stand_in(monkeypatch, "nemo_rl.algorithms.single_controller", create_sampler=lambda buffer, cfg: None)
    config = {"async_rl": {"replay_buffer": {**store_config(str(tmp_path / "r.kv"), SAMPLERS["windowed"]),
                                             "progress_every_tokens": 8}}}
    assert install(config).progress_every_tokens == 8
    resolve = generation.resolve_generation_worker_cls
    assert resolve(NEMO_RL_WORKER_FQN, {}) == WORKER_FQN  # what VllmGeneration hands RayWorkerBuilder
    assert resolve(NEMO_RL_WORKER_FQN, {"quant_cfg": {}}) == quant  # NeMo-RL's other choices stay its own
    assert registry.ACTOR_ENVIRONMENT_REGISTRY[WORKER_FQN] == "uv run --extra vllm"
    assert getattr(RolloutManager.generate_and_push, "kvckpt_original", None) is not None
    install(config)  # idempotent
    assert generation.resolve_generation_worker_cls is resolve


def test_a_samples_first_turn_is_keyed_with_the_progress_settings_and_a_later_turn_passes_through() -> None:
    """Multi-turn (docs/integrations.md, NeMo-RL, "Not covered"): a sample's later turn is another sequence whose
    prompt holds the environment's reply, which the store does not keep, so only each task's first call is keyed."""
    from kvckpt.integrations.nemo_rl.dispatch import bind_lease, dispatching
    from kvckpt.integrations.nemo_rl.engine import KEY, KeyedGeneration

    seen: list[Any] = []

    class Generation:
        async def generate_async(self, data: Any, greedy: bool = False) -> Any:
            seen.append(data.get(KEY))
            yield 0, {}

    keyed = KeyedGeneration(Generation(), lambda: {"desk": "d", "every": 8})
    lease = Lease("g1", 0, 2, None, 0, 5, "math", "a1")

    async def sample() -> None:
        for _turn in range(2):
            async for _ in keyed.generate_async({"input_ids": None}):
                pass

    async def rollout() -> None:
        with dispatching({"idx": 5, "task_name": "math"}):
            bind_lease(lease)
            await asyncio.gather(asyncio.ensure_future(sample()), asyncio.ensure_future(sample()))

    asyncio.run(rollout())
    firsts = [k for k in seen if k is not None]
    assert [k[0]["index"] for k in firsts] == [0, 1] and len(seen) == 4  # two samples, two turns each
    assert all(k[0]["progress"] == {"desk": "d", "every": 8} and k[0]["lease"]["group_id"] == "g1" for k in firsts)
    assert [k is None for k in seen] == [False, True, False, True]  # each sample's second turn carries no key


def test_a_resumed_requests_prefix_read_leaves_the_event_loop_free() -> None:
    """A resumed request's durable prefix is read off the event loop (on a Ray worker it is a blocking call to the
    store's owner): another coroutine of the worker's loop runs while the read waits."""
    loop_ran = threading.Event()

    class Sink:
        saw_loop: bool | None = None

        def progress_encoder(self) -> ProgressEncoder:
            return ProgressEncoder(DEFAULT_SCHEMA)

        def progress(self, lease: Lease) -> dict[int, Any]:
            self.saw_loop = loop_ran.wait(timeout=30)  # on the loop's own thread: never set until it returns
            return {}

    sink = Sink()
    proxy = ProgressEngine(_Engine(), sink=sink, every_tokens=8, eos=None)
    lease = Lease("g1", 1, 2, None, 0, 5, "math", "a1")  # attempt 1: a later attempt reads its durable prefix

    async def other() -> None:
        loop_ran.set()

    async def main() -> list[Any]:
        with sequence(lease, 0):
            outputs, _ = await asyncio.gather(collect(), other())
        proxy.close()
        return outputs

    async def collect() -> list[Any]:
        params = types.SimpleNamespace(max_tokens=0, logprobs=None)  # the prefix is complete: no engine request
        return [out async for out in proxy.generate({"prompt_token_ids": [1, 2]}, params, "r1")]

    outputs = asyncio.run(main())
    assert sink.saw_loop is True, "the prefix read held the event loop"
    assert [o.outputs[0].token_ids for o in outputs] == [[]]
