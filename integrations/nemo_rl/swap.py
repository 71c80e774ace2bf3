"""Put the kvckpt backend into an imported NeMo-RL: the three names its setup and controller look up.

:func:`install` does, in the calling process: :func:`~.config.configure` the store; NeMo-RL's
``single_controller_utils.setup.TQReplayBuffer`` becomes kvckpt's; its
``build_data_plane_client`` returns NeMo-RL's client wrapped in a
:class:`~.dataplane.KvckptDataPlane` (``inner=`` that client, which NeMo-RL's trainer workers
read); and ``single_controller.create_sampler`` builds kvckpt's sampler for a kvckpt buffer
(NeMo-RL's own otherwise). NeMo-RL ships the buffer to its ``SingleControllerActor`` (another Ray
process): unpickling a kvckpt ``TQReplayBuffer`` there installs the sampler factory
(:mod:`.hooks`), so the actor's ``create_sampler`` is kvckpt's before the actor is constructed.
"""

from __future__ import annotations

from typing import Any

from kvckpt.integrations.common import require_peer
from kvckpt.integrations.nemo_rl.adapter import TQReplayBuffer
from kvckpt.integrations.nemo_rl.config import AdapterConfig, configure
from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.hooks import INSTALL_HINT, INTEGRATION, install_sampler_factory, nemo_rl_modules
from kvckpt.integrations.nemo_rl.reissue import install_generate_and_push
from kvckpt.integrations.nemo_rl.remote import install_worker_class


def install(config: Any) -> AdapterConfig:
    """Select the kvckpt backend in this process's NeMo-RL (see the module docstring); returns the
    parsed store config. Idempotent.

    With ``progress_every_tokens`` set, it also turns token progress on in NeMo-RL's Ray generation workers
    (:func:`install_progress`).

    Raises:
        BadArgument: ``config`` has no valid ``async_rl.replay_buffer`` section. PeerMissing: NeMo-RL is not
            importable.
    """
    cfg = configure(config)
    if cfg.progress_every_tokens:
        install_progress()
    setup, controller = nemo_rl_modules()
    install_sampler_factory(controller)
    build = setup.build_data_plane_client
    if getattr(build, "kvckpt_original", None) is None:
        def wrapped(*args: Any, **kwargs: Any) -> KvckptDataPlane:
            return KvckptDataPlane(inner=build(*args, **kwargs))

        wrapped.kvckpt_original = build  # type: ignore[attr-defined]
        setup.build_data_plane_client = wrapped
    setup.TQReplayBuffer = TQReplayBuffer
    return cfg


#: NeMo-RL's modules the progress wiring changes a name in (``7ea279ab``).
GENERATION_MODULE = "nemo_rl.models.generation.vllm.vllm_generation"
REGISTRY_MODULE = "nemo_rl.distributed.ray_actor_environment_registry"
ROLLOUT_MODULE = "nemo_rl.experience.rollout_manager"


def install_progress() -> None:
    """Token progress in NeMo-RL's Ray generation workers (docs/integrations.md, NeMo-RL, "In-flight tokens"):
    ``VllmGeneration`` builds kvckpt's async worker class (:func:`~.remote.install_worker_class`, NeMo-RL's
    registry giving it NeMo-RL's worker environment), and ``RolloutManager.generate_and_push`` is wrapped
    (:func:`~.reissue.install_generate_and_push`): in the process that owns the store its first call starts the
    desk the workers write to and keys the manager's ``policy_generation``. Idempotent.

    Raises:
        PeerMissing: NeMo-RL's generation, registry or rollout module is not importable.
    """
    generation, registry, rollout = (require_peer(name, integration=INTEGRATION, install=INSTALL_HINT)
                                     for name in (GENERATION_MODULE, REGISTRY_MODULE, ROLLOUT_MODULE))
    install_worker_class(generation, registry.ACTOR_ENVIRONMENT_REGISTRY)
    install_generate_and_push(rollout.RolloutManager)
