"""verl V1's replay buffer with every finished trajectory in one crash-consistent kvckpt file.

Select it in verl's config (``trainer.v1.sampler.custom_sampler``)::

    trainer.v1.sampler.custom_sampler.path=pkg://kvckpt.integrations.verl
    trainer.v1.sampler.custom_sampler.name=KvckptReplayBufferAsync   # KvckptReplayBuffer for trainer_mode=sync
    +trainer.v1.sampler.sampler_kwargs.kvckpt.path=/local_nvme/run42/verl_ledger.kv

Install with ``pip install 'verl[verl-core]==0.9.1'`` next to kvckpt (its own virtual environment:
verl pins ``tensordict<=0.10`` and ``transformers<5.11``). See docs/integrations.md, "verl V1".

The names are loaded on first use: the ledger actor's process imports :mod:`.ledger` only, never
verl's trainer (whose import takes tens of seconds).
"""

import importlib
import importlib.util
from typing import Any

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("transfer_queue") is None:
    raise ModuleNotFoundError("kvckpt.integrations.verl needs verl 0.9.1 with TransferQueue: "
                              "pip install 'verl[verl-core]==0.9.1' 'transferqueue==0.1.11'", name="verl")

_WHERE = {
    "KvckptReplayBuffer": "buffer", "KvckptReplayBufferAsync": "buffer", "LedgerSettings": "config",
    "StaleRun": "errors", "VerlLedger": "ledger", "VerlLedgerActor": "ledger", "ledger_actor": "ledger",
    "LEDGER_FILE": "mirror", "MANIFEST_FILE": "mirror", "Mirror": "mirror", "MirrorRef": "mirror",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
