"""The one "the peer is not installed" check every integration uses.

An integration imports its peer (TransferQueue, Ray, vLLM, NeMo-RL, ...) through
:func:`require_peer`; when the peer is missing the user gets :class:`PeerMissing`, one line naming
the integration and the exact command that installs what it needs, instead of a bare
``ModuleNotFoundError`` from deep inside an import chain.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvckpt.errors import KvckptError


class PeerMissing(KvckptError, ModuleNotFoundError):
    """An integration's peer package cannot be imported; the message names the integration, the
    package and the command that installs it. ``name`` is the missing module (as Python's own
    ``ModuleNotFoundError`` sets it), so ``except ImportError`` still catches it."""


def peer_missing(module: str, *, integration: str, install: str, cause: BaseException | None = None) -> PeerMissing:
    """The :class:`PeerMissing` to raise when ``module`` is absent (for checks that look a module
    up without importing it). ``cause``, an import's own error, is appended when it is not the
    plain absence of ``module`` or of a package above it (e.g. the peer is installed but one of
    its dependencies is not)."""
    message = f"{integration} needs {module}: {install}"
    absent = isinstance(cause, ModuleNotFoundError) and cause.name is not None \
        and (module == cause.name or module.startswith(cause.name + "."))
    if cause is not None and not absent:
        message += " (importing it failed: " + " ".join(str(cause).split()) + ")"
    return PeerMissing(message, name=module)


def require_peer(module: str, *, integration: str, install: str) -> ModuleType:
    """Import and return ``module``, the peer package (or one of its modules) ``integration`` drives.

    Args:
        module: the import name, e.g. ``"transfer_queue"`` or ``"nemo_rl.algorithms.single_controller"``.
        integration: who needs it, e.g. ``"kvckpt.integrations.transferqueue"``.
        install: the exact command that installs it, e.g. ``"pip install 'kvckpt[tq]'"``.

    Raises:
        PeerMissing: the import fails; one line, ``"<integration> needs <module>: <install>"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise peer_missing(module, integration=integration, install=install, cause=exc) from None
