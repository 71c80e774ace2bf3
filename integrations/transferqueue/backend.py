"""The ``kvckpt`` storage backend of TransferQueue: manager and bootstrap, in TQ's own registries.

Select it with ``backend.storage_backend: kvckpt`` and a ``backend.kvckpt`` section
(:class:`~.client.BackendSettings`). TransferQueue has no plugin entry points; it looks backends
up in in-process registries. The process whose ``tq.init(config)`` names the backend imports
:mod:`kvckpt.integrations.transferqueue` (that registers the names below); every process that
joins later with ``tq.init()`` (Ray workers, other drivers) registers them by itself, through
the :class:`PluginRef` the bootstrap puts in the config TransferQueue ships it.

* :class:`KvckptStorageManager` (``StorageManagerFactory`` name ``kvckpt``): TransferQueue's
  ``KVStorageManager`` with :class:`~.client.KvckptStorageClient`; its ``save_checkpoint`` /
  ``load_checkpoint`` write and read one kvckpt store file in the checkpoint directory instead of
  pickling every buffered byte.
* :func:`start_value_store` (``StorageBootstrapProvider`` name ``kvckpt``): run once by the first
  ``tq.init``; makes the store path absolute for every process and, with ``owner: actor``,
  starts the owner actor on the calling node (LMDB wants a local disk).

What this makes crash-consistent, and what not: each put batch is one durable transaction and a
storage checkpoint is one consistent snapshot file. TransferQueue's *controller* state (which
global indexes exist, their production and consumption status, the key mapping, sampler state)
lives in the controller actor's memory and is saved only by ``tq.save_checkpoint``, separately and
not atomically with the storage. The write identities close that gap for reads: a controller
state paired with values from another moment is refused key by key, never served.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import ray
from kvckpt.integrations.transferqueue.client import CLIENT_NAME, NAMESPACE, BackendSettings, KvckptStorageClient
from kvckpt.integrations.transferqueue.owner import ValueStoreActor
from omegaconf import DictConfig, OmegaConf, flag_override
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory

from kvckpt.errors import BadArgument

#: The name of the backend in ``backend.storage_backend`` and of its config section.
BACKEND_NAME = "kvckpt"


def _plain(config: Mapping[str, Any] | DictConfig | None) -> dict[str, Any]:
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    return dict(config or {})


@StorageManagerFactory.register(BACKEND_NAME)
class KvckptStorageManager(KVStorageManager):
    """TransferQueue's storage manager for the ``kvckpt`` backend (see the module docstring).

    Args:
        controller_info: the TransferQueue controller's ZMQ address (TransferQueue passes it).
        config: the ``backend.kvckpt`` section.
        zmq_context: accepted and ignored, as by every KV backend.

    Raises:
        BadArgument: the section names another KV client, or is invalid.
    """

    storage_client: KvckptStorageClient

    def __init__(self, controller_info: Any, config: Mapping[str, Any], zmq_context: Any = None) -> None:
        section = _plain(config)
        if section.get("client_name") not in (None, CLIENT_NAME):
            raise BadArgument(f"the kvckpt backend uses {CLIENT_NAME}, not {section.get('client_name')!r}")
        super().__init__(controller_info, {**section, "client_name": CLIENT_NAME}, zmq_context=zmq_context)

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Write every stored value to one kvckpt file in ``checkpoint_dir`` (stamp, snapshot copy,
        fsync, rename); TransferQueue writes its controller state beside it."""
        await asyncio.get_running_loop().run_in_executor(None, self.storage_client.checkpoint, str(checkpoint_dir))

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Replace the live values with the file :meth:`save_checkpoint` wrote (validated first).

        Run it before any data operation, as ``tq.load_checkpoint`` does.
        """
        await asyncio.get_running_loop().run_in_executor(None, self.storage_client.load, str(checkpoint_dir))

    def close(self) -> None:
        """Close the client's store (in-process owner) and TransferQueue's sockets."""
        client = getattr(self, "storage_client", None)
        if client is not None:
            client.close()
        super().close()


class PluginRef:
    """The backend's registration, carried to every process that joins TransferQueue.

    :func:`start_value_store` stores one in ``backend.kvckpt.plugin``. TransferQueue hands its
    config (pickled by Ray) to every process that calls ``tq.init()`` after the first, before it
    looks the backend up; unpickling a ``PluginRef`` imports this module, and so registers the
    ``kvckpt`` names in that process. It holds no data and has no other effect.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (PluginRef, ())

    def __repr__(self) -> str:
        return "PluginRef(kvckpt.integrations.transferqueue)"


@StorageBootstrapProvider.register_provider(BACKEND_NAME)
def start_value_store(conf: DictConfig) -> dict[str, Any]:
    """TransferQueue's start-up hook for the ``kvckpt`` backend (run by the first ``tq.init``).

    Rewrites ``backend.kvckpt.path`` as an absolute path (every process reads the same file), puts
    a :class:`PluginRef` in ``backend.kvckpt.plugin`` (every joining process registers the backend
    when it receives the config) and, for ``owner: actor``, starts the owner actor pinned to this
    node, or reuses a live one serving the same path.

    Raises:
        BadArgument: the section is invalid, or an actor of that name serves another file.
        StoreLocked / FormatError: the file is held by another writer, or is not a value store.
    """
    section = conf.backend[conf.backend.storage_backend]
    settings = BackendSettings.from_config(_plain(section))
    path = os.path.abspath(settings.path)
    section.path = path
    with flag_override(section, "allow_objects", True):  # tq.init's config allows objects; a bare one may not
        section.plugin = PluginRef()
    if settings.owner == "process":
        return {"owner": "process", "path": path}
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ValueStoreActor.options(name=settings.actor_name, namespace=NAMESPACE, get_if_exists=True,
                                    scheduling_strategy=node).remote(path)
    served = ray.get(actor.info.remote())["path"]
    if served != path:
        raise BadArgument(f"the Ray actor {settings.actor_name!r} already serves {served!r}, not {path!r}; "
                          "give this TransferQueue another backend.kvckpt.actor_name, or stop that actor")
    return {"owner": "actor", "path": path, "actor": actor}


def stop_value_store(actor_name: str = BackendSettings.actor_name) -> bool:
    """Stop the owner actor (``tq.close`` leaves it running); returns whether one was running.

    Its store file stays on disk: every returned put in it is durable.
    """
    try:
        actor = ray.get_actor(actor_name, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.get(actor.close.remote())
    ray.kill(actor)
    return True
