"""The verl ledger's campaign side (:mod:`kvckpt.integrations.verl.campaign`) with its durability broken on purpose:
the ledger's LMDB environment opens without ``sync``/``metasync`` (the buffer's and the value store's keep theirs), so
a power cut loses acknowledged ledger calls and the side's own check must say so
(tests/integrations/verl/test_verl_powercut.py). A module of its own: a campaign child imports a side by name."""

from __future__ import annotations

from typing import Any

import lmdb
from kvckpt.integrations.verl import campaign

from kvckpt.testing.campaigns.sides import Side


def _start(run: str, log: Any, seed: int) -> None:
    real_open = lmdb.open

    def open_without_sync(*args: Any, **kwargs: Any) -> Any:
        return real_open(*args, **{**kwargs, "sync": False, "metasync": False})

    lmdb.open = open_without_sync
    try:
        campaign.start(run, log, seed)  # opens the ledger's one environment before it returns
    finally:
        lmdb.open = real_open


#: The broken side: the verl side's writer on an unsynced ledger, checked by the verl side's own check.
SIDE = Side(_start, campaign.check)
