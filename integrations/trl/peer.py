"""TRL's and transformers' classes this integration uses, imported through ``require_peer`` (a missing
one is ``PeerMissing`` naming ``pip install 'kvckpt[trl]'``)."""

from __future__ import annotations

from kvckpt.integrations.common import require_peer

INTEGRATION = "kvckpt.integrations.trl"
INSTALL = "pip install 'kvckpt[trl]'"


def rollout_sample_class() -> type:
    """TRL's ``RolloutSample`` dataclass.

    Raises:
        PeerMissing: TRL is not installed; the message names the install.
    """
    return require_peer("trl.experimental.async_grpo.async_rollout_worker", integration=INTEGRATION,
                        install=INSTALL).RolloutSample


def trainer_callback_class() -> type:
    """transformers' ``TrainerCallback``.

    Raises:
        PeerMissing: transformers is not installed; the message names the install.
    """
    return require_peer("transformers", integration=INTEGRATION, install=INSTALL).TrainerCallback
