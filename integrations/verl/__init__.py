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

from kvckpt.integrations.common.peer import peer_missing


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ValueError:  # sys.modules holds None for it: blocked
        return True


for _peer in ("verl", "transfer_queue"):  # looked up, not imported: verl's import takes tens of seconds
    if _absent(_peer):
        raise peer_missing(_peer, integration="kvckpt.integrations.verl",
                           install="pip install 'kvckpt[verl]' (verl 0.9.1 with TransferQueue 0.1.11; "
                                   "its own venv: bash scripts/setup_peer_env.sh verl)")

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
