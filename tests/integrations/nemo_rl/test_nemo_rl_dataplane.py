"""NeMo-RL's controller data plane (``get_samples`` / ``put_samples`` / ``clear_samples``) over the
kvckpt store, driven as NeMo-RL's SingleController drives it (main, ``7ea279ab``):
``_call_dp(method, **kwargs)``, the advantage stage's read / compute / put-back under the same
``sample_ids``, the trainer's read of ``meta.with_fields(["advantages"])``, then ``clear_samples``
after the chunk. The code is this project's own; the call shapes and keywords are NeMo-RL's.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch
from _buffers import dump_store
from _paths import child_env
from kvckpt.integrations.nemo_rl import KvckptDataPlane, TQReplayBuffer, configure, create_sampler
from tensordict import TensorDict

from kvckpt.errors import BadArgument, NotSelectable, SchemaMismatch

N = 2  # rows per group
GRPO = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"), "token_mask": ("int64", "token"),
        "sample_mask": ("float32", "row"), "total_reward": ("float32", "row"), "input_lengths": ("int64", "row")}
SAMPLER = {"name": "in_order", "max_lookahead_versions": 1}
ADV_INPUTS = ["prompt_ids_for_adv", "total_reward", "token_mask", "sample_mask"]  # AdvantageConfig's defaults


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def call_dp(client: Any, method_name: str, **kwargs: Any) -> Any:
    """The controller's ``_call_dp``: a method, a Ray actor's method, or a coroutine."""
    method = getattr(client, method_name)
    remote = getattr(method, "remote", None)
    if remote is not None:
        return await remote(**kwargs)
    result = method(**kwargs)
    return await result if asyncio.iscoroutine(result) else result


def rows(prompt: int, rewards: tuple[float, ...]) -> dict[str, torch.Tensor]:
    """A committed group: prompt ``[1, prompt]`` then an answer of 2 + i tokens per row."""
    seqs = [torch.tensor([1, prompt] + [7] * (2 + i)) for i in range(N)]
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.nn.functional.pad(s, (0, width - len(s))) for s in seqs])
    mask = torch.stack([torch.tensor([0, 0] + [1] * (len(s) - 2) + [0] * (width - len(s))) for s in seqs])
    return {"input_ids": ids, "token_mask": mask, "generation_logprobs": torch.full(ids.shape, -0.5),
            "input_lengths": torch.tensor([len(s) for s in seqs]), "total_reward": torch.tensor(rewards),
            "sample_mask": torch.ones(N)}


def padded(value: torch.Tensor) -> torch.Tensor:
    """The controller's ``tensor_field``: nested columns padded with zeros."""
    return torch.nested.to_padded_tensor(value, padding=0) if value.is_nested else value


def fields_for_put(meta: Any, fields: dict[str, torch.Tensor]) -> TensorDict:
    """The controller's packing: token-wide values cut to each row's length and nested."""
    lengths = list(meta.sequence_lengths)
    packed = {name: torch.nested.as_nested_tensor([v[i, :lengths[i]] for i in range(meta.size)], layout=torch.jagged)
              if v.dim() >= 2 and v.shape[1] == max(lengths) else v for name, v in fields.items()}
    return TensorDict(packed, batch_size=[meta.size])


async def advantage_stage(dp: Any, meta: Any) -> tuple[Any, torch.Tensor]:
    """The controller's ``_advantage_stage`` with a GRPO leave-nothing-out baseline per prompt."""
    data = await call_dp(dp, "get_samples", sample_ids=meta.sample_ids, partition_id=meta.partition_id,
                         select_fields=ADV_INPUTS)
    prompt_ids, rewards = padded(data["prompt_ids_for_adv"]), data["total_reward"].float()
    mask = padded(data["token_mask"]).float() * data["sample_mask"].float().unsqueeze(-1)
    _, prompt_of = torch.unique(prompt_ids, dim=0, return_inverse=True)
    baseline = torch.stack([rewards[prompt_of == p].mean() for p in prompt_of])
    advantages = (rewards - baseline).unsqueeze(-1) * mask
    await call_dp(dp, "put_samples", sample_ids=meta.sample_ids, partition_id=meta.partition_id,
                  fields=fields_for_put(meta, {"advantages": advantages}))
    return meta.with_fields(["advantages"]), advantages


def controller(tmp_path: Any, dp: KvckptDataPlane | None = None) -> tuple[TQReplayBuffer, Any, KvckptDataPlane]:
    """setup.py's order: the data-plane client first, then the buffer over it, then the sampler."""
    configure({"backend": "kvckpt", "path": str(tmp_path / "replay.kv"), "num_generations_per_prompt": N,
               "num_prompts_per_step": 2, "max_buffered_rollouts": 4, "sampler": SAMPLER, "schema": GRPO})
    dp = dp or KvckptDataPlane()
    buf = TQReplayBuffer(dp, partition_id="rollout_data", pad_value_dict={"token_ids": 0, "input_ids": 0})
    sampler = create_sampler(buf, SAMPLER)
    sampler.set_dispatch_index(0)
    return buf, sampler, dp


def one_step_selected(buf: TQReplayBuffer, sampler: Any) -> Any:
    """Admit a batch, commit two groups (prompts 5 and 6), select them for step 0."""
    target = run(sampler.admit(trainer_version_fn=lambda: 0))
    for prompt, rewards in ((5, (1.0, 0.0)), (6, (2.0, 4.0))):
        gid = buf.reserve(weight_version=0, target_step=target, prompt_idx=prompt)
        run(buf.commit(gid, rows(prompt, rewards), start_weight_version=0, end_weight_version=0))
    meta, n = run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
    assert n == 2
    return meta


def test_the_train_pump_reads_puts_advantages_trains_and_clears_without_writing_the_store(tmp_path: Any) -> None:
    buf, sampler, dp = controller(tmp_path)
    with buf:
        meta = one_step_selected(buf, sampler)
        before = dump_store(buf.core)
        train_meta, advantages = run(advantage_stage(dp, meta))
        assert advantages[:, 2:].tolist() == [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]
        assert list(train_meta.fields)[-1] == "advantages" and train_meta.sample_ids == meta.sample_ids
        # the trainer's read: derived advantages beside the committed rows, one TensorDict
        got = dp.get_data(train_meta, select_fields=["input_ids", "advantages", "prompt_ids_for_adv"])
        assert isinstance(got, TensorDict) and got.batch_size == torch.Size([4])
        assert padded(got["advantages"]).tolist() == advantages.tolist()
        assert padded(got["input_ids"])[0].tolist() == [1, 5, 7, 7, 0]
        assert got["prompt_ids_for_adv"].tolist() == [[1, 5], [1, 5], [1, 6], [1, 6]]
        run(call_dp(dp, "clear_samples", sample_ids=list(train_meta.sample_ids), partition_id="rollout_data"))
        assert dump_store(buf.core) == before  # no data-plane call is a state transition
        with pytest.raises(NotSelectable, match="cleared by clear_samples"):
            dp.get_samples(list(meta.sample_ids), "rollout_data", ["input_ids"])
        # the next sampler call with the trainer's next version closes the step: claimed -> consumed
        run(sampler.evict(current_train_weight=1))
        assert {buf.core.group(g).state for g in meta.group_ids} == {"consumed"}
        with pytest.raises(NotSelectable):
            dp.get_samples(list(meta.sample_ids), "rollout_data", ["input_ids"])


def test_a_put_sample_mask_shadows_the_committed_one_which_stays_as_committed(tmp_path: Any) -> None:
    buf, sampler, dp = controller(tmp_path)
    with buf:
        meta = one_step_selected(buf, sampler)
        masked = torch.tensor([1.0, 0.0, 1.0, 1.0])
        dp.put_samples(list(meta.sample_ids), "rollout_data", fields=TensorDict({"sample_mask": masked}, [4]))
        assert dp.get_samples(list(meta.sample_ids), "rollout_data", ["sample_mask"])["sample_mask"].tolist() == \
            masked.tolist()
        stored = buf.core.read_batch(list(meta.group_ids), fields=["sample_mask"]).tensors["sample_mask"]
        assert stored.tolist() == [1.0] * 4


def test_derived_values_do_not_survive_a_restart_or_a_recovery(tmp_path: Any) -> None:
    """Advantages belong to the claim they were computed for: after a restart (fresh objects) or a
    recovery of the same handle the claim is undone and the controller must compute them again."""
    buf, sampler, dp = controller(tmp_path)
    meta = one_step_selected(buf, sampler)
    run(advantage_stage(dp, meta))
    buf.recover(0)  # the same handle and client: a new timeline, the claims back to ready
    again, _ = run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
    assert again.sample_ids == meta.sample_ids
    with pytest.raises(BadArgument, match="neither in the store's schema"):
        dp.get_samples(list(again.sample_ids), "rollout_data", ["advantages"])
    buf.close()
    buf, sampler, dp = controller(tmp_path)  # a restart: fresh buffer, sampler and client
    with buf:
        fresh, n = run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
        assert n == 2 and fresh.sample_ids == meta.sample_ids
        with pytest.raises(BadArgument, match="neither in the store's schema"):
            dp.get_samples(list(fresh.sample_ids), "rollout_data", ["advantages"])
        _, advantages = run(advantage_stage(dp, fresh))
        assert padded(dp.get_samples(list(fresh.sample_ids), "rollout_data", ["advantages"])["advantages"]).tolist() \
            == advantages.tolist()


def test_calls_that_would_break_a_guarantee_are_refused_naming_why(tmp_path: Any) -> None:
    buf, sampler, dp = controller(tmp_path)
    with buf:
        target = run(sampler.admit(trainer_version_fn=lambda: 0))
        gid = buf.reserve(weight_version=0, target_step=target, prompt_idx=1)
        ready = list(run(buf.commit(gid, rows(1, (0.0, 1.0)), start_weight_version=0, end_weight_version=0)).sample_ids)
        before = dump_store(buf.core)
        adv = TensorDict({"advantages": torch.zeros(N)}, [N])
        cases = [
            (lambda: dp.put_samples(ready, "other", fields=adv), BadArgument, "not this buffer's 'rollout_data'"),
            (lambda: dp.put_samples(ready, "rollout_data", fields=adv), BadArgument, r"not a row of a group claimed"),
            (lambda: dp.put_samples(["no-row-suffix"], "rollout_data", fields=adv), BadArgument, "is not of the form"),
            (lambda: dp.put_samples(ready, "rollout_data", fields={"advantages": [0.0, 1.0]}), SchemaMismatch,
             "not a tensor"),
            (lambda: dp.put_samples(ready, "rollout_data", fields={"advantages": torch.zeros(N + 1)}), SchemaMismatch,
             "3 rows for 2 sample_ids"),
            (lambda: dp.clear_samples(ready, "rollout_data"), BadArgument, "ready in the buffer"),
            (lambda: dp.get_samples(ready, "rollout_data", ["advantages"]), BadArgument, "neither in the store's"),
        ]
        for call, exc, message in cases:
            with pytest.raises(exc, match=message):
                call()
        assert dump_store(buf.core) == before
        assert dp.get_samples(ready, "rollout_data", ["total_reward"])["total_reward"].tolist() == [0.0, 1.0]
        assert dp.get_samples([], "rollout_data", ["total_reward"]).batch_size == torch.Size([0])
    with pytest.raises(BadArgument, match="not bound"):
        KvckptDataPlane().get_samples(ready, "rollout_data", ["total_reward"])


class InnerClient:
    """NeMo-RL's own data-plane client's place (its trainer workers read there): records the rows
    put into it; ``failures`` put calls raise first, as a TransferQueue put that fails does."""

    def __init__(self, failures: int = 0) -> None:
        self.rows: dict[str, set[str]] = {}
        self.failures = failures

    def put_samples(self, sample_ids: list[str], partition_id: str, fields: Any = None, tags: Any = None) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the data plane's storage unit went away")
        for sid in sample_ids:
            self.rows.setdefault(sid, set()).update(fields.keys())

    def clear_samples(self, sample_ids: list[str] | None, partition_id: str) -> None:
        for sid in sample_ids or list(self.rows):
            self.rows.pop(sid, None)

    def published(self) -> dict[str, set[str]]:
        return self.rows


class AsyncInnerClient(InnerClient):
    """NeMo-RL's async client: every call is a coroutine, done only once awaited."""

    async def put_samples(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().put_samples(*args, **kwargs)

    async def clear_samples(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        await asyncio.sleep(0)
        super().clear_samples(*args, **kwargs)


def two_ready(buf: TQReplayBuffer, sampler: Any) -> list[str]:
    target = run(sampler.admit(trainer_version_fn=lambda: 0))
    gids = []
    for prompt, rewards in ((5, (1.0, 0.0)), (6, (2.0, 4.0))):
        gid = buf.reserve(weight_version=0, target_step=target, prompt_idx=prompt)
        run(buf.commit(gid, rows(prompt, rewards), start_weight_version=0, end_weight_version=0))
        gids.append(gid)
    return gids


@pytest.mark.parametrize("how", ["select", "remove"])
def test_a_failed_publish_returns_the_claims_so_the_next_step_cannot_consume_untrained_groups(
        tmp_path: Any, how: str) -> None:
    """NeMo-RL's train pump: select (or a sampler's remove(..., remove_in_dp=False)), publish to
    its own data plane; that put fails once. The claim is undone, the retry trains the same
    groups, and only the trained ones are consumed when the trainer's version moves on."""
    buf, sampler, _ = controller(tmp_path, KvckptDataPlane(inner=InnerClient(failures=1)))
    with buf:
        gids = two_ready(buf, sampler)
        take = (lambda: sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2)) \
            if how == "select" else (lambda: buf.remove([0, 1], remove_in_dp=False))
        with pytest.raises(ConnectionError, match="went away"):
            run(take())
        assert [buf.core.group(g).state for g in gids] == ["ready", "ready"] and buf.size() == 2
        assert buf.dp_client.inner.rows == {}
        run(take())
        assert sorted(buf.dp_client.inner.rows) == sorted(f"{g}_g{i}" for g in gids for i in range(N))
        run(sampler.evict(current_train_weight=1))  # the trainer's next version closes step 0
        assert [buf.core.group(g).state for g in gids] == ["consumed", "consumed"]


def test_a_failed_publish_after_a_finished_step_consumes_nothing(tmp_path: Any) -> None:
    """The failure is at the publish of step 1's batch: step 0's groups stay consumed, step 1's
    go back to ready and stay there across the trainer's own finish_train_step."""
    buf, sampler, dp = controller(tmp_path, KvckptDataPlane(inner=InnerClient()))
    with buf:
        run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))  # nothing yet
        first = two_ready(buf, sampler)
        run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
        target = run(sampler.admit(trainer_version_fn=lambda: 1))
        second = []
        for prompt in (7, 8):
            gid = buf.reserve(weight_version=1, target_step=target, prompt_idx=prompt)
            run(buf.commit(gid, rows(prompt, (0.0, 1.0)), start_weight_version=1, end_weight_version=1))
            second.append(gid)
        dp.inner.failures = 1
        with pytest.raises(ConnectionError):
            run(sampler.select(current_train_weight=1, min_prompt_groups=2, max_prompt_groups=2))
        assert [buf.core.group(g).state for g in first] == ["consumed", "consumed"]
        assert [buf.core.group(g).state for g in second] == ["ready", "ready"]
        buf.finish_train_step()
        assert [buf.core.group(g).state for g in second] == ["ready", "ready"]


def test_an_async_inner_client_has_each_call_done_when_the_controller_s_await_returns(tmp_path: Any,
                                                                                      recwarn: Any) -> None:
    """select publishes and awaits; the controller's ``_call_dp`` put / clear await what is passed on."""
    buf, sampler, dp = controller(tmp_path, KvckptDataPlane(inner=AsyncInnerClient()))
    with buf:
        meta = one_step_selected(buf, sampler)
        assert sorted(dp.inner.rows) == sorted(meta.sample_ids)
        assert dp.inner.rows[meta.sample_ids[0]] == set(GRPO)
        run(advantage_stage(dp, meta))
        assert dp.inner.rows[meta.sample_ids[0]] == {*GRPO, "advantages"}
        run(call_dp(dp, "clear_samples", sample_ids=list(meta.sample_ids), partition_id="rollout_data"))
        assert dp.inner.rows == {}
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_a_ray_actor_inner_client_has_the_batch_when_select_returns(tmp_path: Any) -> None:
    """NeMo-RL's data-plane client as a Ray actor handle (loopback Ray): select calls it through
    ``.remote`` and waits for the reference; a failing actor call undoes the claim."""
    kray = pytest.importorskip("kvckpt.integrations.ray")
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        kray.init_local_ray(num_cpus=2, object_store_memory=128 << 20, namespace="kvckpt-nemo-rl",
                            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                                [os.path.dirname(__file__), child_env()["PYTHONPATH"]])}})
    try:
        inner = ray.remote(num_cpus=0)(InnerClient).remote(failures=1)
        buf, sampler, _ = controller(tmp_path, KvckptDataPlane(inner=inner))
        with buf:
            gids = two_ready(buf, sampler)
            with pytest.raises(ray.exceptions.RayTaskError, match="went away"):
                run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
            assert [buf.core.group(g).state for g in gids] == ["ready", "ready"]
            meta, _ = run(sampler.select(current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2))
            assert sorted(ray.get(inner.published.remote())) == sorted(meta.sample_ids)
    finally:
        ray.shutdown()
