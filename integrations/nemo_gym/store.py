"""Gym's token records in one kvckpt value store: the sink, the source and the lineage resolver over it.

Layout (one value store file, every key under ``gym/``): a rollout ``r`` has a state record ``gym/r/state``
(a JSON object: ``version``, ``frozen``, ``snapshot_id``, ``incomplete``, ``retired``, ``next``, ``calls``:
model call id -> ``[sequence number, digest of the canonical entry]``, ``intents``: call ids ``begin_call``
recorded) and one record per committed entry, ``gym/r/e/<sequence number>``, holding the entry's canonical JSON
(``TokenEntry.model_dump(mode="json")``, keys sorted) byte for byte. Every operation reads the state and writes
the new state with what it adds or removes in **one** durable transaction (``ValueStore.write``), so a crash
leaves either all of an operation or none of it, and a returned ``put`` survives kill -9 and power loss.

What each call guarantees (Gym's protocol, ``nemo_gym.token_id_capture.protocols``):

* ``put``: the same call id with the same bytes is a no-op; with other bytes it marks the rollout incomplete
  (one transaction) and raises :class:`~kvckpt.errors.BadArgument`; after ``freeze`` or ``drop`` it raises
  :class:`~kvckpt.errors.BadArgument` and writes nothing (a hard fence).
* ``mark_incomplete`` succeeds after ``freeze`` and moves the version (so a stale ``drop`` fails); refused
  only on a retired rollout.
* ``freeze`` is idempotent: the first one stamps a snapshot id and moves the version, later ones return the
  same snapshot; a recorded intent without its entry makes the snapshot incomplete.
* ``drop`` deletes the entries only if the snapshot id and version are the current ones, keeping a retired
  tombstone so a late writer of the same attempt is still refused.

One process owns the file (kvckpt's writer lock), so the sink, the source and the resolver of one path in one
process share one open store; fresh client objects see every write at once. ``is_process_shared`` is
``False``: Gym's multi-worker model server (``num_workers > 1``) is refused by Gym itself, as for any
resolver that is not shared across processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import uuid
from typing import Any

from nemo_gym.token_id_capture.lineage import IncrementalLineageStore
from nemo_gym.token_id_capture.protocols import TokenCaptureSnapshot
from nemo_gym.token_id_capture.records import TokenEntry

from kvckpt import ValueStore, codec
from kvckpt.errors import BadArgument, CorruptRecord

_LEVEL = 1


_OPEN_LOCK = threading.Lock()
#: One open value store per path in this process: (store, its write lock, how many clients hold it).
_OPEN: dict[str, tuple[ValueStore, threading.Lock, list[int]]] = {}


def _acquire(path: str) -> tuple[str, ValueStore, threading.Lock]:
    path = os.path.abspath(path)
    with _OPEN_LOCK:
        if path not in _OPEN:
            _OPEN[path] = (ValueStore(path), threading.Lock(), [0])
        values, write_lock, users = _OPEN[path]
        users[0] += 1
        return path, values, write_lock


def _release(path: str) -> None:
    with _OPEN_LOCK:
        values, _, users = _OPEN[path]
        users[0] -= 1
        if users[0] == 0:
            del _OPEN[path]
            values.close()


def _key(rollout_id: str, part: str) -> str:
    return f"gym/{rollout_id}/{part}"


def _encode(key: str, payload: bytes) -> bytes:
    return codec.encode({"v": payload}, {"k": key}, _LEVEL)


def _decode(key: str, raw: bytes) -> bytes:
    record = codec.decode(raw, f"rows/{key}")
    if record.meta.get("k") != key or not isinstance(record.arrays.get("v"), bytes):
        raise CorruptRecord(f"rows/{key}", "not a NeMo-Gym token record of this key")
    return record.arrays["v"]


def _canonical(entry: TokenEntry) -> bytes:
    return json.dumps(entry.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


class _Client:
    """What the sink, the source and the resolver share: the open store and the rollout state's reads."""

    def __init__(self, path: str) -> None:
        self._path, self._values, self._write_lock = _acquire(path)
        self._closed = False

    def _state(self, rollout_id: str) -> dict[str, Any]:
        key = _key(rollout_id, "state")
        raw = self._values.get([key])[0]
        if raw is None:
            return {"version": 0, "frozen": False, "snapshot_id": "", "incomplete": False, "retired": False,
                    "next": 0, "calls": {}, "intents": []}
        return json.loads(_decode(key, raw))

    def _commit(self, rollout_id: str, state: dict[str, Any], puts: dict[str, bytes] | None = None,
                deletes: list[str] | None = None) -> None:
        """The state and what the operation adds or removes, in one durable transaction."""
        records = {_key(rollout_id, "state"): json.dumps(state, sort_keys=True).encode(), **(puts or {})}
        self._values.write(list(records), [_encode(k, v) for k, v in records.items()], deletes or [])

    def _entries(self, rollout_id: str, numbers: list[int]) -> list[TokenEntry]:
        keys = [_key(rollout_id, f"e/{n:010d}") for n in numbers]
        raws = self._values.get(keys)
        missing = [k for k, raw in zip(keys, raws, strict=True) if raw is None]
        if missing:
            raise CorruptRecord(f"rows/{missing[0]}", "a committed NeMo-Gym entry is missing from the store")
        return [TokenEntry.model_validate(json.loads(_decode(k, raw))) for k, raw in zip(keys, raws, strict=True)]

    async def close(self) -> None:
        """Release this client's share of the store (idempotent). Nothing is buffered: writes are durable."""
        if not self._closed:
            self._closed = True
            _release(self._path)


def _refuse_if_fenced(state: dict[str, Any], rollout_id: str, what: str) -> None:
    if state["retired"] or state["frozen"]:
        raise BadArgument(f"NeMo-Gym token store: {what} of rollout {rollout_id!r} refused: it is already "
                          f"{'retired' if state['retired'] else 'frozen'}")


class KvckptTokenStore(_Client):
    """Gym's ``TokenSink`` (with the ``begin_call`` extension) and ``TokenSource`` on one kvckpt store file.

    Args:
        path: the value store file (created if missing); Gym builds it from ``sink_kwargs``.
    """

    async def put(self, entry: TokenEntry) -> None:
        """Store one entry durably before returning (see the module docstring for retries and fences)."""
        await asyncio.to_thread(self._put, entry)

    def _put(self, entry: TokenEntry) -> None:
        rid, payload = entry.rollout_id, _canonical(entry)
        digest = hashlib.sha256(payload).hexdigest()
        with self._write_lock:
            state = self._state(rid)
            _refuse_if_fenced(state, rid, f"a put of call {entry.model_call_id!r}")
            known = state["calls"].get(entry.model_call_id)
            if known is not None:
                if known[1] == digest:
                    return
                state["incomplete"], state["version"] = True, state["version"] + 1
                self._commit(rid, state)
                raise BadArgument(f"NeMo-Gym token store: call {entry.model_call_id!r} of rollout {rid!r} was put "
                                  "again with a different payload; the rollout is marked incomplete")
            number = state["next"]
            state["calls"][entry.model_call_id] = [number, digest]
            state["next"], state["version"] = number + 1, state["version"] + 1
            self._commit(rid, state, {_key(rid, f"e/{number:010d}"): payload})

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Durably mark the rollout incomplete and move its version (allowed after ``freeze``)."""
        await asyncio.to_thread(self._mark_incomplete, rollout_id)

    def _mark_incomplete(self, rollout_id: str) -> None:
        with self._write_lock:
            state = self._state(rollout_id)
            if state["retired"]:
                raise BadArgument(f"NeMo-Gym token store: rollout {rollout_id!r} is retired")
            state["incomplete"], state["version"] = True, state["version"] + 1
            self._commit(rollout_id, state)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Durably record that a call is about to be dispatched: without its entry, ``freeze`` is incomplete."""
        await asyncio.to_thread(self._begin_call, rollout_id, model_call_id)

    def _begin_call(self, rollout_id: str, model_call_id: str) -> None:
        with self._write_lock:
            state = self._state(rollout_id)
            _refuse_if_fenced(state, rollout_id, f"begin_call of {model_call_id!r}")
            state["intents"].append(model_call_id)
            self._commit(rollout_id, state)

    async def freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        """Freeze the rollout (idempotent) and return its snapshot."""
        return await asyncio.to_thread(self._freeze, rollout_id)

    def _freeze(self, rollout_id: str) -> TokenCaptureSnapshot:
        with self._write_lock:
            state = self._state(rollout_id)
            if state["retired"]:
                raise BadArgument(f"NeMo-Gym token store: rollout {rollout_id!r} is retired")
            if not state["frozen"]:
                state["frozen"], state["snapshot_id"] = True, uuid.uuid4().hex
                state["version"] += 1
                self._commit(rollout_id, state)
        entries = tuple(self._entries(rollout_id, sorted(n for n, _ in state["calls"].values())))
        dangling = set(state["intents"]) - set(state["calls"])
        return TokenCaptureSnapshot(rollout_id=rollout_id, entries=entries,
                                    incomplete=bool(state["incomplete"] or dangling),
                                    snapshot_id=state["snapshot_id"], version=state["version"])

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly the consumed snapshot; ``False`` (nothing changed) if the state moved since."""
        return await asyncio.to_thread(self._drop, rollout_id, snapshot_id, version)

    def _drop(self, rollout_id: str, snapshot_id: str, version: int) -> bool:
        with self._write_lock:
            state = self._state(rollout_id)
            if not state["frozen"] or state["retired"] or state["snapshot_id"] != snapshot_id \
                    or state["version"] != version:
                return False
            gone = [_key(rollout_id, f"e/{n:010d}") for n, _ in state["calls"].values()]
            state.update(retired=True, calls={}, intents=[])
            self._commit(rollout_id, state, deletes=gone)
            return True


class KvckptLineageStore(_Client, IncrementalLineageStore):
    """Gym's request-time lineage resolver over the entries a :class:`KvckptTokenStore` committed.

    Gym's own matcher, index and digest checks (``IncrementalLineageStore``) run over the store's entries in
    commit order; a resolver built before a put sees it at its next ``resolve``.

    Args:
        path: the same value store file as the sink's (``lineage_store_kwargs``).
    """

    def __init__(self, path: str, *, max_cached_rollouts: int = 65536, max_cached_tokens: int = 8_000_000) -> None:
        _Client.__init__(self, path)
        IncrementalLineageStore.__init__(self, max_cached_rollouts=max_cached_rollouts,
                                         max_cached_tokens=max_cached_tokens)

    def _fetch_new_entries(self, rollout_id: str, cursor: Any) -> tuple[list[tuple[TokenEntry, Any]], Any]:
        state = self._state(rollout_id)
        if cursor is not None and (cursor > state["next"] or state["retired"]):
            raise IncrementalLineageStore.CursorReset()  # the base class refetches from the start
        if state["retired"]:
            return [], state["next"]
        start = 0 if cursor is None else cursor
        numbers = sorted(n for n, _ in state["calls"].values() if n >= start)
        return list(zip(self._entries(rollout_id, numbers), numbers, strict=True)), state["next"]

    def _load_entry(self, rollout_id: str, ref: Any) -> TokenEntry:
        return self._entries(rollout_id, [ref])[0]

    def is_process_shared(self) -> bool:
        """``False``: one process owns the file (see the module docstring)."""
        return False

    async def close(self) -> None:
        """Drop the resolver's caches and release its share of the store (idempotent)."""
        await IncrementalLineageStore.close(self)
        await _Client.close(self)
