"""The switch that runs verl's own V1 test files, unmodified, against verl's buffer or the kvckpt one.

A pytest plugin (``-p _verl_switch``, with ``tests/`` on ``sys.path``), loaded by
``scripts/verl_own_tests.py`` around verl's ``tests/trainer/ppo/v1`` files. ``--verl-buffer=verl``
runs them as verl does; ``--verl-buffer=kvckpt`` selects the kvckpt buffer the way a user selects it:
``trainer.v1.sampler.custom_sampler`` names ``pkg://kvckpt.integrations.verl`` and the class for the
trainer mode, and ``trainer.v1.sampler.sampler_kwargs.kvckpt`` names the ledger. Where verl's tests
go through the trainer (``PPOTrainer._build_replay_buffer``) that is the config they build, written
into before verl's own method runs; where they construct ``ReplayBuffer`` / ``ReplayBufferAsync``
themselves (``test_replay_buffer_on_cpu.py``), what verl's ``load_extern_type`` loads from that config
builds it instead (an instance of verl's own class, the ledger attached), with the ledger section added to
the ``sampler_kwargs`` they pass; and
a test that makes TransferQueue calls with no buffer at all (``test_reissue_inflight_on_cpu.py``)
runs after a trainer built one, as a verl trainer builds its buffer before its first call.

Both modes run on one loopback Ray with 8 logical CPUs (TransferQueue's default actors hang ``tq.init``
with 3 on a 2-core machine; verl's ``tq_init`` fixtures reuse it), and both get the one shim verl's test
files need against the 0.9.1 wheel: ``trainer_base._tq_supports_checkpoint`` (newer than 0.9.1, read at
import by ``test_reissue_inflight_on_cpu.py``) is set to TransferQueue's capability when verl lacks it,
so the file is collected and only the tests of that guard meet 0.9.1's missing guard.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import pytest

KVCKPT_PATH = "pkg://kvckpt.integrations.verl"
_ACTOR = f"kvckpt_verl_own_{uuid.uuid4().hex[:8]}"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--verl-buffer``: whose buffer verl's tests run against."""
    parser.addoption("--verl-buffer", choices=("verl", "kvckpt"), default="verl",
                     help="run verl's V1 tests against verl's own buffer or the kvckpt one (via custom_sampler)")


def pytest_configure(config: pytest.Config) -> None:
    """Ray on loopback, the 0.9.1 shim, and in kvckpt mode the user's configuration switch."""
    import transfer_queue as tq
    from kvckpt.integrations.ray import init_local_ray
    from verl.trainer.ppo.v1 import trainer_base

    init_local_ray(num_cpus=8, object_store_memory=256 << 20, namespace="kvckpt-verl-own", address="local")
    if not hasattr(trainer_base, "_tq_supports_checkpoint"):
        trainer_base._tq_supports_checkpoint = lambda: hasattr(tq, "save_checkpoint") and hasattr(tq, "load_checkpoint")
    if config.getoption("--verl-buffer") == "kvckpt":
        ledger = config.rootpath / f"kvckpt_ledger_{uuid.uuid4().hex[:8]}.kv"
        config.pluginmanager.register(_KvckptSwitch(str(ledger)), "kvckpt_switch")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The mirror removed, the ledger actor stopped, Ray shut down."""
    import ray

    if config.pluginmanager.has_plugin("kvckpt_switch"):
        from kvckpt.integrations.verl.mirror import NAMESPACE, uninstall

        uninstall()
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(_ACTOR, namespace=NAMESPACE))
    ray.shutdown()


def _user_sampler_config(sampler: Any, trainer_mode: str, ledger: str) -> None:
    """What a user writes under ``trainer.v1.sampler`` to select the kvckpt buffer (docs/integrations.md)."""
    from omegaconf import open_dict

    with open_dict(sampler):
        sampler.custom_sampler = {"path": KVCKPT_PATH,
                                  "name": "KvckptReplayBuffer" if trainer_mode == "sync" else "KvckptReplayBufferAsync"}
        kwargs = sampler.get("sampler_kwargs") or {}
        sampler.sampler_kwargs = {**kwargs, "kvckpt": {"path": ledger, "actor_name": _ACTOR}}


class _KvckptSwitch:
    """The kvckpt mode: every buffer verl's tests build is the kvckpt one, configured as a user does."""

    def __init__(self, ledger: str) -> None:
        self.ledger = ledger

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        own_build = PPOTrainer._build_replay_buffer
        ledger = self.ledger

        def build(trainer: PPOTrainer) -> Any:
            sampler = trainer.config.trainer.v1.sampler
            if not (sampler.get("custom_sampler") or {}).get("path"):  # a test's own custom sampler stays its own
                import transfer_queue as tq

                _user_sampler_config(sampler, trainer.trainer_mode, ledger)
                tq.init()  # verl's trainer joins TransferQueue before it builds its buffer
            return own_build(trainer)

        PPOTrainer._build_replay_buffer = build

    @pytest.fixture(autouse=True)
    def _kvckpt_buffer(self, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
        module = request.module
        if hasattr(module, "_make_rb"):  # test_replay_buffer_on_cpu.py constructs verl's classes itself
            monkeypatch.setattr(module, "ReplayBuffer", self._configured("sync"))
            monkeypatch.setattr(module, "ReplayBufferAsync", self._configured("colocate_async"))
        elif "tq_init" in request.fixturenames:  # TransferQueue calls with no buffer: a trainer built one first
            request.getfixturevalue("tq_init")
            self._build_async_buffer()

    def _configured(self, trainer_mode: str) -> Any:
        """What verl's ``load_extern_type`` loads from the user's config, called with its ledger section added to
        the ``sampler_kwargs`` the caller passes."""
        from omegaconf import OmegaConf
        from verl.utils.import_utils import load_extern_type

        config = OmegaConf.create({"sampler_kwargs": {}})
        _user_sampler_config(config, trainer_mode, self.ledger)
        build = load_extern_type(config.custom_sampler.path, config.custom_sampler.name)
        section = config.sampler_kwargs

        def configured(*args: Any, sampler_kwargs: Any = None, **kwargs: Any) -> Any:
            return build(*args, sampler_kwargs={**(sampler_kwargs or {}), **section}, **kwargs)

        return configured

    def _build_async_buffer(self) -> None:
        from omegaconf import OmegaConf
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        class Trainer(PPOTrainer):
            def on_step_end(self) -> None:
                pass

            def on_sample_end(self) -> None:
                pass

        trainer = Trainer.__new__(Trainer)
        trainer.trainer_mode = "colocate_async"
        trainer.config = OmegaConf.create({
            "algorithm": {}, "data": {"train_batch_size": 1},
            "trainer": {"resume_mode": "disable", "v1": {"colocate_async": {}, "sampler": {
                "custom_sampler": None, "max_off_policy_threshold": None, "max_off_policy_strategy": "drop",
                "sampler_kwargs": {}}}}})
        trainer._build_replay_buffer()
