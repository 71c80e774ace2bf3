"""The ``meta`` table's records: their keys, and the state record every transition updates.

``meta/state`` holds the cursors (``dispatch_index``, ``trainer_version``, ``weight_version``), the
sequence and admission counters, the counts of in-flight, ready and claimed groups, the
checkpoint bookkeeping (``durable``, ``drop_floor``), the current ``timeline`` and the counters
users graph. It is one JSON record so a transition reads and writes it once.
"""

from __future__ import annotations

import uuid
from typing import Any

#: The buffer's persisted :class:`~kvckpt.transitions.config.BufferConfig`.
CONFIG_KEY = b"config"
#: Cursors, counts and counters (see the module docstring).
STATE_KEY = b"state"
#: The dataloader state stored with the last admission (a codec record of raw bytes).
DATALOADER_KEY = b"dataloader"
#: Prompts aborted per target step: ``{"step": count}``.
SHORTFALL_KEY = b"shortfall"
#: The last checkpoint stamp (checkpoint id, trainer version, trainer state).
STAMP_KEY = b"checkpoint"
#: Field name -> the shape the store pinned at the field's first commit.
SHAPES_KEY = b"shapes"
#: The store's format record (written by :class:`~kvckpt.storage.store.Store`).
FORMAT_KEY = b"format"
KNOWN_META_KEYS = frozenset({FORMAT_KEY, CONFIG_KEY, STATE_KEY, DATALOADER_KEY, SHORTFALL_KEY, STAMP_KEY, SHAPES_KEY})

COUNTERS = ("admitted", "committed", "samples_committed", "selected", "consumed", "evicted", "aborted",
            "redispatched", "raw_bytes", "stored_bytes")


def new_timeline() -> str:
    """A fresh random timeline id: one per create, restore and recovery (see :class:`~kvckpt.Lease`)."""
    return uuid.uuid4().hex


def new_state() -> dict[str, Any]:
    """The state record of an empty buffer, on a fresh timeline."""
    return {"dispatch_index": -1, "trainer_version": 0, "weight_version": 0, "admissions": 0, "seq": 0,
            "inflight": 0, "ready": 0, "claimed": 0, "durable": [], "drop_floor": 0,
            "timeline": new_timeline(), "counters": dict.fromkeys(COUNTERS, 0)}
