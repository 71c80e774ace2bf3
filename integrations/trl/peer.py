"""Where TRL (and transformers' ``TrainerCallback``) come from, with a one-line kvckpt error naming the
install when they are missing."""

from __future__ import annotations

import importlib
from typing import Any

from kvckpt import KvckptError

INSTALL = "pip install 'kvckpt[trl]' (TRL 1.16.0, Python >= 3.11)"


class TrlMissing(KvckptError):
    """TRL (``trl.experimental.async_grpo``) or transformers is not importable here."""


def peer_attr(module: str, name: str) -> Any:
    """``module.name``, imported now.

    Raises:
        TrlMissing: the module cannot be imported; the message names the install.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise TrlMissing(f"the TRL integration needs {module}: {INSTALL} ({exc})") from exc
