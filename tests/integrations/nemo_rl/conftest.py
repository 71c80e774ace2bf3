"""Shared fixture of the NeMo-RL tests: ``make``, adapters built as NeMo-RL's setup.py builds them.

Helpers (records, configs, samplers) live in tests/_nemo_rl.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _nemo_rl import SAMPLERS, store_config
from kvckpt.integrations.nemo_rl import TQReplayBuffer, configure


@pytest.fixture
def make(tmp_path: Any) -> Iterator[Callable[..., TQReplayBuffer]]:
    """``make(sampler, **store_config keywords) -> TQReplayBuffer`` on a fresh store file under
    ``tmp_path``, configured and constructed as NeMo-RL's setup.py and tests do; all closed afterwards."""
    made: list[TQReplayBuffer] = []

    def factory(sampler: Any = SAMPLERS["windowed"], **kwargs: Any) -> TQReplayBuffer:
        configure(store_config(str(tmp_path / f"replay{len(made)}.kv"), sampler, **kwargs))
        buf = TQReplayBuffer(object(), partition_id="rollout_data", pad_value_dict={"token_ids": 0},
                             require_routed_experts=False)
        made.append(buf)
        return buf

    yield factory
    for buf in made:
        buf.close()
