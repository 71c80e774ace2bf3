"""kvckpt as a TransferQueue storage backend (``backend.storage_backend: kvckpt``).

Install with ``pip install 'kvckpt[tq]'`` (TransferQueue 0.1.11). TransferQueue finds storage
plugins through class-level registries, not entry points. Importing this package registers:

* ``StorageManagerFactory["kvckpt"]`` -> :class:`KvckptStorageManager`,
* ``StorageClientFactory["KvckptStorageClient"]`` -> :class:`KvckptStorageClient`,
* ``StorageBootstrapProvider["kvckpt"]`` -> :func:`start_value_store`.

Import it in the process whose ``tq.init(config)`` names the backend. Every process that joins
afterwards with ``tq.init()`` (Ray workers included) needs no import: the config TransferQueue
hands it carries a :class:`PluginRef`, and receiving it registers the backend there.

Examples:
    >>> import kvckpt.integrations.transferqueue  # doctest: +SKIP
    >>> import transfer_queue as tq  # doctest: +SKIP
    >>> tq.init({"backend": {"storage_backend": "kvckpt",
    ...                      "kvckpt": {"path": "/local/tq_values.kv"}}})  # doctest: +SKIP

See ``docs/integrations.md`` for what the backend makes crash-consistent and what it does not.
"""

from kvckpt.integrations.common import require_peer

require_peer("transfer_queue", integration="kvckpt.integrations.transferqueue", install="pip install 'kvckpt[tq]'")

from kvckpt.integrations.transferqueue.backend import (  # noqa: E402  (after the peer check)
    BACKEND_NAME,
    KvckptStorageManager,
    PluginRef,
    start_value_store,
    stop_value_store,
)
from kvckpt.integrations.transferqueue.client import CLIENT_NAME, BackendSettings, KvckptStorageClient  # noqa: E402
from kvckpt.integrations.transferqueue.errors import ValueMissing, WriteIdentityMismatch  # noqa: E402
from kvckpt.integrations.transferqueue.owner import CHECKPOINT_FILE, ValueStoreActor  # noqa: E402

from kvckpt import ValueStore  # noqa: E402

__all__ = [
    "BACKEND_NAME", "CHECKPOINT_FILE", "CLIENT_NAME", "BackendSettings", "KvckptStorageClient",
    "KvckptStorageManager", "PluginRef", "ValueMissing", "ValueStore", "ValueStoreActor", "WriteIdentityMismatch",
    "start_value_store", "stop_value_store",
]
