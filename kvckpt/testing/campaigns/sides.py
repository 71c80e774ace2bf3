"""Workloads beside the buffer's that the crash and power-cut campaigns also run and check: the public hook an
integration plugs its own store into (``run_crash_campaign(..., sides=["pkg.module"])``,
``python -m kvckpt.testing.campaigns.campaign --side pkg.module``; ``run_powercut_campaign(..., sides=[...])``,
``python -m kvckpt.testing.campaigns.powercut --side pkg.module``).

A side is named by its module, so every child (forked from the fork server or a fresh interpreter)
imports it itself; the module defines ``SIDE``, a :class:`Side`. kvckpt never imports an integration:
the integration names its module to the campaign.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Side:
    """One side workload.

    ``start(run, log, seed)`` runs in the child before the buffer's workload: it opens its store in the
    run directory ``run`` and starts a daemon thread that appends each acknowledged operation to ``log``
    (``op``: the kind the report counts). ``check(run, ops, scratch, bad)`` runs in the parent after each
    kill, or in a fresh process on the image each power cut left: it reports every broken promise to
    ``bad`` and returns how many checkpoint files it loaded. It writes nothing under ``run`` (a power-cut
    image is where the next cut's filesystem starts): what it must open for writing, it opens as a copy
    in ``scratch``.

    ``tidy(run, ops)`` (optional) runs between two power cuts, after the check passed: it deletes from the
    image what no acknowledged operation of ``ops`` covers and the next start could not open (a store
    whose creation a cut interrupted), as the campaign drops a run whose create was not acknowledged.
    """

    start: Callable[[str, Any, int], None]
    check: Callable[[str, list[dict[str, Any]], str, Callable[[str], None]], int]
    tidy: Callable[[str, list[dict[str, Any]]], None] | None = None


def load_side(module: str) -> Side:
    """The :class:`Side` the module ``module`` defines as ``SIDE``.

    Raises:
        TypeError: the module defines no ``SIDE``, or it is not a :class:`Side`.
    """
    side = getattr(importlib.import_module(module), "SIDE", None)
    if not isinstance(side, Side):
        raise TypeError(f"campaign side {module!r} defines no SIDE (a kvckpt.testing.campaigns.sides.Side)")
    return side
