"""What every integration shares: the peer-missing error and the config loader.

* :func:`require_peer` / :class:`PeerMissing`: import the peer package an integration drives, or
  fail with one line naming the integration and the install command.
* :func:`load_config` / :func:`check_keys`: a YAML file or a dict section into a dataclass,
  unknown keys refused by name.
* :func:`default_holder`: the lease holder name a producer gives when it is given none.

The lease wire format the trainers share is :meth:`kvckpt.Lease.to_dict` /
:meth:`kvckpt.Lease.from_dict`; peer virtual environments are built by ``scripts/setup_peer_env.sh``.
"""

from kvckpt.integrations.common.config import check_keys, load_config, read_document
from kvckpt.integrations.common.holder import default_holder
from kvckpt.integrations.common.peer import PeerMissing, peer_missing, require_peer

__all__ = ["PeerMissing", "check_keys", "default_holder", "load_config", "peer_missing", "read_document",
           "require_peer"]
