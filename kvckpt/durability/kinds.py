"""The store kinds, registered once: what marks a file as each kind, and each kind's hooks.

A kvckpt store file is one of several kinds: a replay buffer, a value store (:mod:`kvckpt.values`),
or one a program registers. Every place that treats kinds differently asks :func:`kind_of` for the
snapshot's :class:`StoreKind` and calls its hook: verification (:func:`kvckpt.durability.verify.check`,
the ``verify`` hook) and the tools (``kvckpt inspect``, ``compact --level`` and ``export``: the
``inspect``, ``compact`` and ``export`` hooks). A new kind is one :func:`register` call with its
marker test and its hooks; nothing else dispatches on a marker.

The two built-in kinds are registered by :mod:`kvckpt.durability.verify` (their ``verify`` hooks live
there and in :mod:`kvckpt.values.records`) and the tools attach their own hooks to them
(:func:`attach`) when they are imported. A kind without a tool's hook is refused by that tool with a
:class:`~kvckpt.errors.BadArgument` naming the kind.

Hook signatures (``txn`` is one read snapshot, a :class:`~kvckpt.storage.txn.Txn`):

* ``marked(txn) -> bool``: the file carries this kind's marker;
* ``verify(txn, report, options)``: add findings to the verifier's report (:class:`VerifyOptions`);
* ``inspect(txn, ledger_limit, progress) -> dict``: ``kvckpt inspect``'s description of the store;
* ``compact(store, level, result, progress)``: re-encode every stored payload of a private copy at
  ``level`` (``kvckpt compact --level``), counting into ``result``;
* ``export(txn, path, job) -> result``: stream the store's rows to an export job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvckpt.errors import BadArgument
from kvckpt.storage.txn import Txn

#: The hooks a tool may attach to a kind (and a tool looks up with :meth:`StoreKind.hook`).
TOOL_HOOKS = ("inspect", "compact", "export")


@dataclass(frozen=True)
class VerifyOptions:
    """How deep a ``verify`` hook checks (see :func:`kvckpt.durability.verify.check`)."""

    deep: bool = False
    checksums: bool = False
    row_keys: list[bytes] | None = None
    progress: Callable[[int], None] | None = None


@dataclass(frozen=True)
class StoreKind:
    """One store kind: its name (``inspect``'s ``kind``), a sentence saying what it is, the test of its
    marker, and its hooks (see the module docstring); a tool hook left ``None`` means that tool refuses it."""

    name: str
    description: str
    marked: Callable[[Txn], bool]
    verify: Callable[[Txn, Any, VerifyOptions], None]
    inspect: Callable[..., dict[str, Any]] | None = None
    compact: Callable[..., None] | None = None
    export: Callable[..., Any] | None = None

    def hook(self, tool: str, path: str) -> Callable[..., Any]:
        """The hook ``tool`` (one of :data:`TOOL_HOOKS`) calls for this kind.

        Raises:
            BadArgument: the kind has no such hook; the message names the file and the kind.
        """
        found = getattr(self, tool)
        if found is None:
            raise BadArgument(f"{path!r} is {self.description}: `kvckpt {tool}` does not read a {self.name!r} store "
                              f"(`kvckpt inspect` describes it)")
        return found


_KINDS: dict[str, StoreKind] = {}
#: The kind of a file that carries no registered marker (the replay buffer, whose checks then say what is missing).
_FALLBACK: list[str] = []


def register(kind: StoreKind, *, fallback: bool = False) -> StoreKind:
    """Register ``kind`` (replacing one of the same name); with ``fallback``, it is the kind of a file
    no other kind's marker claims. Returns ``kind``."""
    _KINDS[kind.name] = kind
    if fallback:
        _FALLBACK[:] = [kind.name]
    return kind


def unregister(name: str) -> None:
    """Forget the kind ``name`` (a test's toy kind); the fallback cannot be forgotten.

    Raises:
        BadArgument: ``name`` is the fallback kind.
    """
    if name in _FALLBACK:
        raise BadArgument(f"the fallback store kind {name!r} cannot be unregistered")
    _KINDS.pop(name, None)


def attach(name: str, **hooks: Callable[..., Any]) -> StoreKind:
    """Give the registered kind ``name`` a tool's hooks (keywords of :data:`TOOL_HOOKS`); returns the kind.

    Raises:
        BadArgument: no kind ``name`` is registered, or a keyword is not a tool hook.
    """
    unknown = set(hooks) - set(TOOL_HOOKS)
    if unknown or name not in _KINDS:
        raise BadArgument(f"cannot attach {sorted(hooks)} to store kind {name!r} "
                          f"(kinds: {sorted(_KINDS)}; hooks: {TOOL_HOOKS})")
    _KINDS[name] = dataclasses.replace(_KINDS[name], **hooks)
    return _KINDS[name]


def kinds() -> tuple[StoreKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())


def kind_of(txn: Txn) -> StoreKind:
    """The kind of the store ``txn`` reads: the first registered kind whose marker it carries, else the fallback.

    Raises:
        BadArgument: nothing claims the file and no fallback is registered (kvckpt.durability.verify not imported).
    """
    for kind in _KINDS.values():
        if kind.name not in _FALLBACK and kind.marked(txn):
            return kind
    if not _FALLBACK:
        raise BadArgument("no store kind is registered (import kvckpt first)")
    return _KINDS[_FALLBACK[0]]
