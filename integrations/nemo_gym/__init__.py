"""NeMo-Gym's token capture on a kvckpt store: Gym's ``TokenSink``, ``TokenSource`` and lineage resolver.

NeMo-Gym (0.7.0) selects where its training-token records go by configuration
(``token_id_capture.sink`` and ``lineage_store``, each ``module:Class`` with ``*_kwargs``):

.. code-block:: yaml

    token_id_capture:
      enabled: true
      sink: kvckpt.integrations.nemo_gym:KvckptTokenStore
      sink_kwargs: {path: /local_nvme/run42/gym_tokens.kv}
      lineage_store: kvckpt.integrations.nemo_gym:KvckptLineageStore
      lineage_store_kwargs: {path: /local_nvme/run42/gym_tokens.kv}

Every record of every rollout lives in that one file, each change one fsync'd LMDB transaction
(no per-rollout files). The store passes Gym's own ``run_conformance`` unmodified
(``tests/integrations/nemo_gym/test_nemo_gym_store.py``, in ``.venv-gym``). ``docs/integrations.md``
(NeMo-RL, "NeMo-Gym's token records") says what it guarantees and what it does not.
"""

from kvckpt.integrations.common import require_peer

require_peer("nemo_gym", integration="kvckpt.integrations.nemo_gym",
             install="pip install 'kvckpt[gym]' (NeMo-Gym 0.7.0; its own venv: bash scripts/setup_peer_env.sh gym)")

from kvckpt.integrations.nemo_gym.store import KvckptLineageStore, KvckptTokenStore  # noqa: E402  (after the check)

__all__ = ["KvckptLineageStore", "KvckptTokenStore"]
