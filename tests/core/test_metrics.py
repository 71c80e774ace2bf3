"""kvckpt.metrics: what a hook passes on from a real store's stats(), and the ready sinks' calls."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvckpt import BufferConfig, ReplayBuffer
from kvckpt.errors import BadArgument
from kvckpt.metrics import MetricsHook, flatten, logging_sink, sink_from_config, tensorboard_sink, wandb_sink


class ScalarWriter:
    """Records ``add_scalar`` calls, the part of TensorBoard's ``SummaryWriter`` the sink uses."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append((tag, value, step))


class Run:
    """Records ``log`` calls, the part of a W&B run the sink uses."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((metrics, step))


def test_flatten_keeps_numbers_only_and_joins_nested_names() -> None:
    doc = {"a": 1, "b": 2.5, "ok": True, "name": "x", "list": [1, 2], "none": None,
           "nested": {"c": np.float32(0.5), "d": torch.tensor(3), "e": {"f": np.int64(7)}}, "arr": np.zeros(2)}
    assert flatten(doc, "p/") == {"p/a": 1.0, "p/b": 2.5, "p/ok": 1.0, "p/nested/c": 0.5, "p/nested/d": 3.0,
                                  "p/nested/e/f": 7.0}


def test_a_hook_feeds_a_real_stores_counters_to_tensorboard_and_wandb(tmp_path) -> None:
    writer, run = ScalarWriter(), Run()
    tb, wb = MetricsHook(tensorboard_sink(writer)), MetricsHook(wandb_sink(run), prefix="buf/", every=2)
    buf = ReplayBuffer.create(str(tmp_path / "b.kv"), BufferConfig(
        group_size=1, schema={"input_ids": ("int64", "token")}, max_buffered_rollouts=2))
    for step in range(3):
        [lease] = buf.admit([step])
        buf.commit_group(lease, [{"input_ids": torch.arange(3)}])
        buf.select(1, 1)
        buf.finish_step()
        tb(buf.stats(), step, {"loss": 0.1 * step})
        wb(buf.stats(), step)
    buf.close()
    committed = [(value, step) for tag, value, step in writer.calls if tag == "kvckpt/committed"]
    assert committed == [(1.0, 0), (2.0, 1), (3.0, 2)]
    assert ("train/loss", 0.2, 2) in [(t, round(v, 6), s) for t, v, s in writer.calls]
    assert [step for _, step in run.calls] == [0, 2]  # every=2
    assert run.calls[1][0]["buf/trainer_version"] == 3.0 and "buf/file_bytes" in run.calls[1][0]


def test_a_failing_sink_is_logged_once_and_never_breaks_training(caplog) -> None:
    def broken(metrics, step):
        raise OSError("disk full")

    hook = MetricsHook(broken)
    with caplog.at_level(logging.WARNING, logger="kvckpt.metrics"):
        assert hook({"x": 1}, 0) == {"kvckpt/x": 1.0}
        hook({"x": 2}, 1)
    assert [r.name for r in caplog.records] == ["kvckpt.metrics"]
    with pytest.raises(OSError, match="disk full"):
        MetricsHook(broken, raise_errors=True)({"x": 1}, 0)


def test_logging_sink_and_configured_sinks(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvckpt.metrics"):
        MetricsHook(logging_sink())({"ready": 2, "claimed": 0}, 4)
    assert caplog.records[-1].getMessage() == "step 4: kvckpt/ready=2 kvckpt/claimed=0"
    assert sink_from_config() is None
    with pytest.raises(BadArgument, match="every must be >= 1"):
        MetricsHook(print, every=0)
    assert logging.getLogger("kvckpt.metrics").handlers == []
