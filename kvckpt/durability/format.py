"""A store's buffer config as the facade opens it, and the in-place upgrade of older formats."""

from __future__ import annotations

from kvckpt.errors import BadArgument, FormatError, KvckptError
from kvckpt.storage.store import FORMAT_VERSION, Store, Txn
from kvckpt.tables import meta
from kvckpt.tables.access import Tables
from kvckpt.tables.records import LedgerEntry
from kvckpt.transitions.config import BufferConfig


def buffer_config(store: Store) -> BufferConfig:
    """The buffer config persisted in ``store``; a format-1 or format-2 store open for writing is
    upgraded to the current format first (:func:`upgrade`).

    Raises:
        BadArgument: the store has no buffer config (it was not made by ``ReplayBuffer.create``).
        FormatError: the config passes its checksum but is not one kvckpt writes (damaged or crafted).
    """
    doc = store.read(lambda txn: Tables(txn).config())
    if doc is None:
        raise BadArgument(f"{store.path!r} is a kvckpt store without a replay buffer config; "
                          "create it with ReplayBuffer.create")
    try:
        if store.info.get("version") != FORMAT_VERSION and not store.readonly:
            upgrade(store)
        return BufferConfig.from_dict(doc)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
        if isinstance(exc, KvckptError):
            raise
        raise malformed_config(store.path, exc) from None


def malformed_config(path: str, exc: Exception) -> FormatError:
    """The error for a ``meta/config`` that passes its checksum but is not one kvckpt writes."""
    return FormatError(f"{path!r}: meta/config passes its checksum but is not a config kvckpt writes "
                       f"({type(exc).__name__}: {str(exc)[:200]}); the file is damaged or crafted")


def upgrade(store: Store) -> None:
    """Upgrade an older store in place: a format-1 or format-2 store's tables move into the one-tree
    layout (:meth:`~kvckpt.storage.store.Store.upgrade_layout`), and for format 1 its leases are
    fenced (:func:`fence_v1_leases`) in the transaction that switches the layout; a format-3 store
    (the same layout, no progress records yet) only gets its format record rewritten
    (:meth:`~kvckpt.storage.store.Store.upgrade_record`)."""
    if not store.upgrade_layout(prepare=fence_v1_leases if store.info.get("version") == 1 else None):
        store.upgrade_record()


def fence_v1_leases(txn: Txn) -> None:
    """Give a format-1 store a timeline and move every ledger entry onto it with its attempt
    bumped, so leases a version-1 kvckpt issued (which carry no store id or timeline) are fenced
    rather than trusted."""
    t = Tables(txn)
    st = t.state()
    st["timeline"] = meta.new_timeline()
    for entry in t.entries():
        t.replace_entry(LedgerEntry.from_dict(
            {**entry.to_dict(), "attempt": entry.attempt + 1, "timeline": st["timeline"]}), was=entry)
    t.put_state(st)
