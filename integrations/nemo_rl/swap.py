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

from kvckpt.integrations.nemo_rl.adapter import TQReplayBuffer
from kvckpt.integrations.nemo_rl.config import AdapterConfig, configure
from kvckpt.integrations.nemo_rl.dataplane import KvckptDataPlane
from kvckpt.integrations.nemo_rl.hooks import install_sampler_factory, nemo_rl_modules

from kvckpt.errors import BadArgument


def install(config: Any) -> AdapterConfig:
    """Select the kvckpt backend in this process's NeMo-RL (see the module docstring); returns the
    parsed store config. Idempotent.

    Raises:
        BadArgument: ``config`` has no valid ``async_rl.replay_buffer`` section, or it sets
            ``progress_every_tokens``: this launcher does not yet put the engine proxy into NeMo-RL's Ray
            generation workers, and a key that turned nothing on would let a user believe in-flight tokens
            were durable (docs/integrations.md, NeMo-RL, "In-flight tokens"). PeerMissing: NeMo-RL is not importable.
    """
    cfg = configure(config)
    if cfg.progress_every_tokens:
        raise BadArgument(
            f"async_rl.replay_buffer.progress_every_tokens is {cfg.progress_every_tokens}, but install() does not "
            "yet attach the engine proxy inside NeMo-RL's Ray generation workers, so no token would be recorded: "
            "call kvckpt.integrations.nemo_rl.engine.attach (with install_worker and install_generate_and_push) "
            "in the processes that generate, or set it to 0 here")
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
