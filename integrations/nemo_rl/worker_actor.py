"""NeMo-RL's async vLLM worker as the Ray actor class NeMo-RL builds, with kvckpt's key handling installed.

Imported by class path (:data:`~.remote.WORKER_FQN`) in the process where NeMo-RL's ``RayWorkerBuilder`` creates
its generation workers, after :func:`~.swap.install` pointed ``VllmGeneration`` at it. The class is NeMo-RL's own
``VllmAsyncGenerationWorkerImpl``, every method unchanged, except ``generate_async``, wrapped by
:func:`~.engine.install_worker` before Ray captures the actor's methods: a request whose ``data`` carries a
sequence key with ``progress`` settings attaches the engine proxy to ``self.llm`` (writing through the buffer's Ray
client, :mod:`.remote`) and records the sequence; a request without one is NeMo-RL's, untouched. Importing it
needs NeMo-RL (and, where the worker runs, vLLM).
"""

from __future__ import annotations

import ray
from kvckpt.integrations.common import require_peer
from kvckpt.integrations.nemo_rl.engine import install_worker
from kvckpt.integrations.nemo_rl.hooks import INSTALL_HINT, INTEGRATION

_worker = require_peer("nemo_rl.models.generation.vllm.vllm_worker_async", integration=INTEGRATION,
                       install=INSTALL_HINT)


class VllmAsyncGenerationWorkerImpl(_worker.VllmAsyncGenerationWorkerImpl):
    """NeMo-RL's worker; ``generate_async`` takes kvckpt's sequence key out of ``data`` (module docstring)."""


install_worker(VllmAsyncGenerationWorkerImpl)

#: The actor class, with the options NeMo-RL's own carries (its ``_default_options``: the nsight runtime env).
VllmAsyncGenerationWorker = ray.remote(**getattr(_worker.VllmAsyncGenerationWorker, "_default_options", {}))(
    VllmAsyncGenerationWorkerImpl)
