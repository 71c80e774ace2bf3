"""``KvckptStorageClient``: TransferQueue's ``StorageKVClient`` over a kvckpt value store.

Every TransferQueue process that uses the ``kvckpt`` backend builds one of these (through
:class:`~kvckpt.integrations.transferqueue.backend.KvckptStorageManager`). Values are encoded and
checksummed here, in the putting process, and verified here again in the getting process; the
owner (:mod:`.owner`) only moves the bytes in and out of one file.

* ``put(keys, values)`` stamps the batch with one fresh write identity, writes it in one durable
  transaction, and returns the identity once per key; TransferQueue keeps it as each key's
  ``custom_backend_meta``.
* ``get(keys, ..., custom_backend_meta)`` refuses (:class:`~.errors.WriteIdentityMismatch`) a
  value whose identity is not the one the caller's metadata names, and refuses
  (:class:`~.errors.ValueMissing`) an absent key, before returning anything.
* ``clear(keys, custom_backend_meta)`` deletes only values whose identity matches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from kvckpt.integrations.common import load_config
from kvckpt.integrations.transferqueue.errors import ValueMissing
from kvckpt.integrations.transferqueue.owner import CHECKPOINT_FILE, CHECKPOINT_GROUP
from kvckpt.integrations.transferqueue.values import decode_value, encode_value, new_write_id
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient

from kvckpt import ValueStore, codec
from kvckpt.errors import BadArgument

CLIENT_NAME = "KvckptStorageClient"
#: Ray namespace of the owner actor (TransferQueue's own actors live there too).
NAMESPACE = "transfer_queue"
OWNERS = ("actor", "process")
#: Keys of the ``backend.kvckpt`` section that are not kvckpt's: TransferQueue's ``client_name`` (the
#: storage manager sets it) and the bootstrap's ``plugin`` (:class:`~.backend.PluginRef`).
PEER_KEYS = ("client_name", "plugin")


@dataclass(frozen=True)
class BackendSettings:
    """The ``backend.kvckpt`` config section.

    Args:
        path: the live store file (made absolute by ``tq.init``'s bootstrap). Required.
        owner: ``"actor"`` (a Ray actor owns the file and every process reaches it) or
            ``"process"`` (the one process using TransferQueue opens the file itself; a second
            process is refused with ``StoreLocked``). Defaults to ``"actor"``.
        actor_name: the owner actor's name in the ``transfer_queue`` namespace. Defaults to
            ``"KvckptValueStore"``.
        compression_level: zstd level of stored values, 0 for none. Defaults to 0: TransferQueue
            values are short-lived, and level 1 costs more put time than it saves in bytes moved.
    """

    path: str = ""  # required: the default only lets __post_init__ say so in its own words
    owner: str = "actor"
    actor_name: str = "KvckptValueStore"
    compression_level: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise BadArgument("the kvckpt TransferQueue backend needs backend.kvckpt.path (the store file)")
        if self.owner not in OWNERS:
            raise BadArgument(f"backend.kvckpt.owner must be one of {OWNERS}, got {self.owner!r}")
        if not isinstance(self.actor_name, str) or not self.actor_name:
            raise BadArgument(f"backend.kvckpt.actor_name must be a non-empty string, got {self.actor_name!r}")
        if (not isinstance(self.compression_level, int) or isinstance(self.compression_level, bool)
                or not 0 <= self.compression_level <= codec.MAX_LEVEL):
            raise BadArgument(f"backend.kvckpt.compression_level must be 0..{codec.MAX_LEVEL}, "
                              f"got {self.compression_level!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> BackendSettings:
        """Read the section through the integrations' one loader
        (:func:`~kvckpt.integrations.common.load_config`); of the keys TransferQueue itself writes
        there, only :data:`PEER_KEYS` are let through.

        Raises:
            BadArgument: an unknown key (named with ``backend.kvckpt``), no ``path``, an unknown
                ``owner`` or a bad ``compression_level``.
        """
        return load_config(cls, config, within="backend.kvckpt", origin="the TransferQueue config", ignore=PEER_KEYS)


@StorageClientFactory.register(CLIENT_NAME)
class KvckptStorageClient(StorageKVClient):
    """TransferQueue's KV client for the kvckpt backend (see the module docstring).

    Args:
        config: the ``backend.kvckpt`` section (:class:`BackendSettings`).
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(dict(config))
        self.settings = BackendSettings.from_config(config)
        self._remote = self.settings.owner == "actor"
        self._owner: Any = (ray.get_actor(self.settings.actor_name, namespace=NAMESPACE) if self._remote
                            else ValueStore(self.settings.path))

    def _call(self, method: str, *args: Any, group: str | None = None) -> Any:
        if self._remote:
            call = getattr(self._owner, method)
            return ray.get((call if group is None else call.options(concurrency_group=group)).remote(*args))
        return getattr(self._owner, method)(*args)

    def put(self, keys: list[str], values: list[Any]) -> list[str]:
        """Write ``values`` under ``keys`` in one durable transaction; returns each key's write identity.

        Raises:
            BadArgument: a value is neither a storable array nor JSON-serialisable (nothing written).
        """
        if len(keys) != len(values):
            raise BadArgument(f"{len(keys)} keys but {len(values)} values")
        write_id = new_write_id()
        level = self.settings.compression_level
        encoded = [encode_value(key, value, write_id, level) for key, value in zip(keys, values, strict=True)]
        self._call("put", list(keys), encoded)
        return [write_id] * len(keys)

    def get(self, keys: list[str], shapes: Any = None, dtypes: Any = None,
            custom_backend_meta: Sequence[str | None] | None = None) -> list[Any]:
        """The values of ``keys``, each verified against the write identity the caller's metadata names.

        Raises:
            ValueMissing: a key is absent.
            WriteIdentityMismatch: a key holds the bytes of another put (a recycled index).
            CorruptRecord: a value failed its checksum.
        """
        expected = list(custom_backend_meta) if custom_backend_meta is not None else [None] * len(keys)
        if len(expected) != len(keys):
            raise BadArgument(f"{len(keys)} keys but {len(expected)} write identities")
        raws = self._call("get", list(keys))
        values = []
        for key, raw, write_id in zip(keys, raws, expected, strict=True):
            if raw is None:
                raise ValueMissing(key)
            values.append(decode_value(key, raw, write_id))
        return values

    def clear(self, keys: list[str], custom_backend_meta: Sequence[str | None] | None = None) -> int:
        """Delete ``keys`` whose stored identity matches ``custom_backend_meta``; returns how many."""
        ids = list(custom_backend_meta) if custom_backend_meta is not None else None
        return self._call("clear", list(keys), ids)

    def checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Write the store's values to ``checkpoint_dir``/:data:`CHECKPOINT_FILE`; returns the stamp."""
        return self._call("checkpoint", f"{checkpoint_dir}/{CHECKPOINT_FILE}", group=CHECKPOINT_GROUP)

    def load(self, checkpoint_dir: str) -> dict[str, Any]:
        """Replace the live values with ``checkpoint_dir``/:data:`CHECKPOINT_FILE`; returns its stamp."""
        return self._call("load", f"{checkpoint_dir}/{CHECKPOINT_FILE}")

    def count(self) -> int:
        """How many values the store holds."""
        return self._call("count")

    def close(self) -> None:
        """Close an in-process store (the actor outlives its clients). Idempotent."""
        if not self._remote:
            self._owner.close()
