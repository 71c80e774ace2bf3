"""verl's TransferQueue calls, each mirrored into the verl ledger before TransferQueue sees it.

verl's trainer, its V1 replay buffer and its agent-loop workers all call TransferQueue's module
functions (``tq.kv_batch_put``, ``tq.async_kv_put``, ``tq.kv_clear``, ``tq.save_checkpoint``, ...).
:func:`install` replaces those functions in this process with wrappers that first write the call's
effect to the ledger as one transaction, refused for a process of an earlier run, and only then
make TransferQueue's own call. So the ledger is never behind TransferQueue: whatever a worker saw
acknowledged is in the file, and a refused write reaches neither. The put that ends a prompt's group (its
``finished`` / ``failure`` status, :data:`ENDED`) also deletes its samples' token progress, in that transaction.

Worker processes join by configuration: :func:`publish` puts a :class:`MirrorRef` in the config
TransferQueue's controller hands every process that calls ``tq.init()`` (verl's
``AgentLoopWorkerTQ`` does in its constructor); unpickling it installs the wrappers there with
the run token of the run that started that worker.

``tq.save_checkpoint(dir)`` writes the ledger as one file, ``dir/kvckpt_verl.kv``, with a small JSON
manifest beside it; ``tq.load_checkpoint(dir)`` makes the ledger that checkpoint plus what finished
since (:meth:`VerlLedger.load`) and fills TransferQueue from the ledger.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import ray
import transfer_queue as tq
from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
from kvckpt.integrations.verl.ledger import CHECKPOINT_GROUP
from kvckpt.integrations.verl.records import FIELD, TAG, record_key, rows_of, state_from_json, state_to_json
from omegaconf import flag_override, open_dict

from kvckpt import write_durably
from kvckpt.errors import CheckpointError

#: The ledger file inside verl's ``global_step_N/transfer_queue`` directory, and its manifest.
LEDGER_FILE = "kvckpt_verl.kv"
MANIFEST_FILE = "kvckpt_verl.json"
#: The Ray namespace of the ledger actor.
NAMESPACE = "kvckpt"
#: zstd level of mirrored values.
_LEVEL = 1
#: TransferQueue's functions the mirror replaces.
_WRAPPED = ("kv_put", "kv_batch_put", "kv_clear", "kv_list", "async_kv_put", "async_kv_batch_put",
            "async_kv_clear", "save_checkpoint", "load_checkpoint")
#: The statuses verl's ``AgentLoopWorkerTQ._run_prompt`` ends a prompt's group with, once every sample settled (a
#: trajectory's own tag says ``success``): the put carrying one deletes the group's token progress.
ENDED = ("finished", "failure")
#: TransferQueue's own functions, captured before the first install.
RAW: dict[str, Callable[..., Any]] = {}


class Mirror:
    """This process's mirror: the ledger actor (looked up by name on first use) and the run token.

    ``cursor`` (the trainer process only) returns the dataloader state to record with each dispatch;
    ``restore_cursor`` is handed a resumed dataloader state once, on the first ``kv_list`` after a resume.
    """

    def __init__(self, actor_name: str, token: str, *, cursor: Callable[[], Any] | None = None,
                 restore_cursor: Callable[[Any], None] | None = None) -> None:
        self.actor_name, self.token = actor_name, token
        self.cursor, self.restore_cursor = cursor, restore_cursor
        self.pending_cursor: Any = None
        self.partitions: set[str] = set()
        self._actor: Any = None
        self._consuming = threading.local()

    @property
    def actor(self) -> Any:
        """The ledger actor's handle."""
        if self._actor is None:
            self._actor = ray.get_actor(self.actor_name, namespace=NAMESPACE)
        return self._actor

    @contextlib.contextmanager
    def consuming(self, step: int | None) -> Iterator[None]:
        """Within it, this thread's ``kv_clear`` marks the keys consumed by training step ``step`` (nested
        uses restore the outer step on exit)."""
        outer = getattr(self._consuming, "step", None)
        self._consuming.step = step
        try:
            yield
        finally:
            self._consuming.step = outer

    # -- what each call becomes --------------------------------------------------------------------
    def _put_call(self, keys: list[str], partition_id: str, fields: Any, tags: list[dict] | None,
                  single: bool) -> Any:
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(tags)} tags")
        rows = rows_of(fields, len(keys), single=single)
        write_id = new_write_id()
        ledger_keys, values = [], []
        for i, key in enumerate(keys):
            for kind, entries in ((TAG, (tags or [{}] * len(keys))[i] or {}), (FIELD, rows[i])):
                for name, value in entries.items():
                    ledger_key = record_key(partition_id, key, kind, name)
                    ledger_keys.append(ledger_key)
                    values.append(encode_value(ledger_key, value, write_id, _LEVEL))
        self.partitions.add(partition_id)
        dispatch = self.cursor is not None and tags and all(
            t.get("is_prompt") and t.get("status") == "pending" for t in tags)
        state = self.cursor() if dispatch else None
        if state is not None:
            return self.actor.set_cursor.remote(self.token, state_to_json(state), ledger_keys, values)
        ended = [key for key, tag in zip(keys, tags, strict=True) if (tag or {}).get("status") in ENDED] if tags else []
        return self.actor.put.remote(self.token, ledger_keys, values, ended)

    def _clear_call(self, keys: list[str] | str, partition_id: str) -> Any:
        keys = [keys] if isinstance(keys, str) else list(keys)
        return self.actor.clear.remote(self.token, partition_id, keys, getattr(self._consuming, "step", None))

    # -- the wrappers ------------------------------------------------------------------------------
    def kv_put(self, key: str, partition_id: str, fields: Any = None, tag: dict | None = None,
               data_parser: Any = None) -> Any:
        """``tq.kv_put``: the ledger first (one transaction), then TransferQueue."""
        ray.get(self._put_call([key], partition_id, fields, None if tag is None else [tag], single=True))
        return RAW["kv_put"](key=key, partition_id=partition_id, fields=fields, tag=tag, data_parser=data_parser)

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None, tags: list[dict] | None = None,
                     data_parser: Any = None) -> Any:
        """``tq.kv_batch_put``: the ledger first (one transaction), then TransferQueue."""
        ray.get(self._put_call(list(keys), partition_id, fields, tags, single=False))
        return RAW["kv_batch_put"](keys=keys, partition_id=partition_id, fields=fields, tags=tags,
                                   data_parser=data_parser)

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> Any:
        """``tq.kv_clear``: the ledger first (one transaction), then TransferQueue."""
        ray.get(self._clear_call(keys, partition_id))
        return RAW["kv_clear"](keys=keys, partition_id=partition_id)

    async def async_kv_put(self, key: str, partition_id: str, fields: Any = None, tag: dict | None = None,
                           data_parser: Any = None) -> Any:
        """``tq.async_kv_put``: the ledger first (one transaction), then TransferQueue."""
        await self._put_call([key], partition_id, fields, None if tag is None else [tag], single=True)
        return await RAW["async_kv_put"](key=key, partition_id=partition_id, fields=fields, tag=tag,
                                         data_parser=data_parser)

    async def async_kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None,
                                 tags: list[dict] | None = None, data_parser: Any = None) -> Any:
        """``tq.async_kv_batch_put``: the ledger first (one transaction), then TransferQueue."""
        await self._put_call(list(keys), partition_id, fields, tags, single=False)
        return await RAW["async_kv_batch_put"](keys=keys, partition_id=partition_id, fields=fields, tags=tags,
                                               data_parser=data_parser)

    async def async_kv_clear(self, keys: list[str] | str, partition_id: str) -> Any:
        """``tq.async_kv_clear``: the ledger first (one transaction), then TransferQueue."""
        await self._clear_call(keys, partition_id)
        return await RAW["async_kv_clear"](keys=keys, partition_id=partition_id)

    def kv_list(self, partition_id: str | None = None) -> Any:
        """``tq.kv_list``; the first call after a resume first restores the dataloader position."""
        if self.pending_cursor is not None and self.restore_cursor is not None:
            state, self.pending_cursor = self.pending_cursor, None
            self.restore_cursor(state_from_json(state))
        return RAW["kv_list"](partition_id=partition_id)

    def save_checkpoint(self, checkpoint_dir: str | os.PathLike[str], *, include_storage: bool = True,
                        metadata: dict[str, Any] | None = None) -> None:
        """verl's ``tq.save_checkpoint``: the ledger as one file plus its manifest (``include_storage`` is moot).

        Raises:
            StaleRun: this process's run was replaced; nothing is written, the directory included.
        """
        step = int((metadata or {}).get("global_steps", 0))
        checkpoint_dir = os.fspath(checkpoint_dir)
        # the actor creates the directory once the run token passed: a stale run's call leaves no trace
        checkpoint = self.actor.checkpoint.options(concurrency_group=CHECKPOINT_GROUP)  # puts land while it copies
        stamp = ray.get(checkpoint.remote(self.token, os.path.join(checkpoint_dir, LEDGER_FILE), step))
        manifest = {"checkpoint_id": stamp["checkpoint_id"], "global_steps": step, "metadata": metadata or {}}
        write_durably(os.path.join(checkpoint_dir, MANIFEST_FILE), json.dumps(manifest).encode())

    def load_checkpoint(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        """verl's ``tq.load_checkpoint``: the ledger becomes that checkpoint, TransferQueue is refilled.

        Raises:
            StaleRun: this process's run was replaced; neither the ledger nor TransferQueue changes.
        """
        checkpoint_dir = os.fspath(checkpoint_dir)
        manifest = read_manifest(checkpoint_dir)
        ray.get(self.actor.load.remote(os.path.join(checkpoint_dir, LEDGER_FILE), manifest["checkpoint_id"],
                                       self.token))
        self.refill(ray.get(self.actor.resume.remote(self.token, manifest["global_steps"])))

    # -- restart -----------------------------------------------------------------------------------
    def refill(self, view: dict[str, Any]) -> int:
        """Make TransferQueue hold exactly the ledger's items (``VerlLedger.resume``'s view), through
        TransferQueue's own calls, unmirrored; remember its dataloader state. Returns the key count."""
        partitions = self.partitions | set(view["items"])
        for partition_id in partitions:
            listed = (RAW["kv_list"](partition_id=partition_id) or {}).get(partition_id, {})
            if listed:
                RAW["kv_clear"](keys=list(listed), partition_id=partition_id)
        count = 0
        for partition_id, items in view["items"].items():
            for key, item in items.items():
                fields, tags = item["fields"], item["tags"]
                if fields or tags:
                    RAW["kv_put"](key=key, partition_id=partition_id, fields=fields or None, tag=tags or None)
                    count += 1
        self.partitions = partitions
        self.pending_cursor = view.get("cursor")
        return count


def read_manifest(checkpoint_dir: str) -> dict[str, Any]:
    """The manifest :meth:`Mirror.save_checkpoint` wrote (untrusted: its two fields are type-checked).

    Raises:
        FileNotFoundError: no ledger checkpoint in ``checkpoint_dir``.
        CheckpointError: the manifest is not one.
    """
    path = os.path.join(checkpoint_dir, MANIFEST_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(checkpoint_dir, LEDGER_FILE)):
        raise FileNotFoundError(f"no kvckpt verl ledger checkpoint in {checkpoint_dir!r} (expected {LEDGER_FILE} "
                                f"and {MANIFEST_FILE}; was it saved with the kvckpt replay buffer installed?)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read(1 << 20))
        cid, step = manifest["checkpoint_id"], manifest["global_steps"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path!r} is not a kvckpt verl ledger manifest: {exc}") from None
    if not isinstance(cid, str) or type(step) is not int or step < 0:
        raise CheckpointError(f"{path!r}: checkpoint_id must be a string and global_steps an integer >= 0")
    return manifest


_ACTIVE: Mirror | None = None


def install(mirror: Mirror) -> Mirror:
    """Route this process's TransferQueue calls through ``mirror`` (replacing an earlier mirror)."""
    global _ACTIVE
    for name in _WRAPPED:
        RAW.setdefault(name, getattr(tq, name))
        setattr(tq, name, getattr(mirror, name))
    _ACTIVE = mirror
    return mirror


def uninstall() -> None:
    """Give TransferQueue its own functions back in this process."""
    global _ACTIVE
    for name, fn in RAW.items():
        setattr(tq, name, fn)
    _ACTIVE = None


def active() -> Mirror | None:
    """The mirror installed in this process, if any."""
    return _ACTIVE


class MirrorRef:
    """A run's mirror, carried to every process that joins TransferQueue (see the module docstring).

    Unpickling it installs a :class:`Mirror` with the run token it was made with, unless this process
    already mirrors a run (a worker keeps the run it joined, so after a restart its writes are
    refused). It makes no Ray call while being unpickled (the actor is looked up on first use).
    """

    __slots__ = ("actor_name", "token")

    def __init__(self, actor_name: str, token: str) -> None:
        self.actor_name, self.token = actor_name, token

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (join, (self.actor_name, self.token))


def join(actor_name: str, token: str) -> MirrorRef:
    """What unpickling a :class:`MirrorRef` runs: mirror this process's calls for run ``token``."""
    if _ACTIVE is None:  # a process mirrors the run it joined first; the trainer's own mirror is never replaced
        install(Mirror(actor_name, token))
    return MirrorRef(actor_name, token)


#: The key of the TransferQueue config that carries the :class:`MirrorRef`.
CONFIG_KEY = "kvckpt_verl"


def publish(ref: MirrorRef) -> None:
    """Put ``ref`` into the config TransferQueue's controller hands every joining process."""
    controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    conf = ray.get(controller.get_config.remote())
    with flag_override(conf, "allow_objects", True), open_dict(conf):
        conf[CONFIG_KEY] = ref
    ray.get(controller.store_config.remote(conf))
