"""The name a producer gives the leases it holds (``admit(..., holder=...)``), when it is given none.

A lease records its holder so a trainer can ask the store what a dead producer or node held
(:meth:`kvckpt.ReplayBuffer.leases_held_by`) and redispatch it in one call
(:meth:`kvckpt.ReplayBuffer.redispatch_held_by`). A Ray producer names its node or actor instead
(:func:`kvckpt.integrations.ray.client.holder_name`).
"""

from __future__ import annotations

import os
import socket


def default_holder() -> str:
    """``host:pid`` of this process: what dies with it."""
    return f"{socket.gethostname()}:{os.getpid()}"
