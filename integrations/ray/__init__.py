"""kvckpt on Ray: the buffer as an actor, a pipelined producer client, a loopback-only Ray start.

Install with ``pip install 'kvckpt[ray]'``. Importing this package sets
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and ``RAY_USAGE_STATS_ENABLED=0`` unless they are set
already (Ray on loopback only, no usage reporting); import it before ``ray`` so the first takes
effect in this process too (:func:`init_local_ray` applies it either way).

* :class:`BufferActor` / :func:`start_buffer_actor`: the process that owns the store.
* :class:`BufferClient`: producers batch several groups per call and keep several calls in
  flight; retries after an actor restart are idempotent.
* :func:`batch_from_dict`, :func:`plan_from_dict`: rebuild kvckpt objects from actor replies.
* :func:`holder_name`: the lease holder name of a Ray process (its node or actor id).
"""

import os

from kvckpt.integrations.common import require_peer

#: Environment every Ray process of a kvckpt deployment gets unless already set: Ray on loopback
#: only (ray reads the first one once, when it is imported) and no usage reporting.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
for _key, _value in LOOPBACK_ENV.items():
    os.environ.setdefault(_key, _value)

require_peer("ray", integration="kvckpt.integrations.ray", install="pip install 'kvckpt[ray]'")

from kvckpt.integrations.ray.actor import (  # noqa: E402  (after the environment is set)
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    BufferActor,
    init_local_ray,
    keep_ray_on_loopback,
    start_buffer_actor,
    to_wire,
)
from kvckpt.integrations.ray.client import (  # noqa: E402
    BufferClient,
    batch_from_dict,
    holder_name,
    plan_from_dict,
    progress_from_dict,
    wait_for_actor,
)

__all__ = [
    "DEFAULT_NAME", "DEFAULT_NAMESPACE", "LOOPBACK_ENV", "BufferActor", "BufferClient", "batch_from_dict",
    "holder_name", "init_local_ray", "keep_ray_on_loopback", "plan_from_dict", "progress_from_dict",
    "start_buffer_actor", "to_wire", "wait_for_actor",
]
