"""The verl ledger's campaign side (:mod:`kvckpt.integrations.verl.campaign`) whose first child in a run leaves what a
power cut during the ledger's creation can leave: a durable 0-byte ``verl.kv`` and no acknowledgement. The next
child runs the real side on the same run, which opens only if the campaign dropped that file between the cuts (the
side's ``tidy``); tests/integrations/verl/test_verl_powercut.py. A module of its own: a child imports a side by name."""

from __future__ import annotations

import os
from typing import Any

from kvckpt.integrations.verl import campaign

from kvckpt.storage.store import fsync_dir, fsync_file
from kvckpt.testing.campaigns.sides import Side

_MARK = "interrupted-create"


def _start(run: str, log: Any, seed: int) -> None:
    mark = os.path.join(run, _MARK)
    if os.path.exists(mark):
        campaign.start(run, log, seed)
        return
    for path in (os.path.join(run, campaign.LEDGER_FILE), mark):
        open(path, "wb").close()
        fsync_file(path)
    fsync_dir(run)


#: The side: an interrupted creation first, then the verl side, with the verl side's check and tidy.
SIDE = Side(_start, campaign.check, campaign.tidy)
