"""Waits are bounded by default and say what they wait for; the library logs what an operator needs
(waits, fencing refusals, recoveries) on its own loggers and installs no handler (issue 18.5)."""

from __future__ import annotations

import logging
import math

import pytest
from _buffers import make_group

from kvckpt import BadArgument, BufferConfig, GateTimeout, Prompt, ReplayBuffer
from kvckpt.buffer import replay_buffer as buffer_module


def test_admit_waits_at_most_the_configured_timeout_and_logs_while_waiting(buffer_factory, caplog, monkeypatch):
    monkeypatch.setattr(buffer_module, "WAIT_LOG_SECONDS", 0.05)
    buf = buffer_factory({"name": "in_order", "max_lookahead_versions": 0}, wait_timeout=0.3)
    buf.admit([0])  # dispatch_index 0 = trainer_version 0 + window 0: the gate is now closed
    with caplog.at_level(logging.WARNING, logger="kvckpt.buffer"), pytest.raises(GateTimeout, match="gate closed"):
        buf.admit([1])  # no timeout given: the config's applies
    assert any("admission has waited" in r.getMessage() and "gate closed" in r.getMessage() for r in caplog.records)
    reopened_config = ReplayBuffer.open(buf.path, readonly=True)
    assert reopened_config.config.wait_timeout == 0.3  # persisted with the store
    reopened_config.close()
    with pytest.raises(GateTimeout):
        buf.admit([1], timeout=0)


def test_the_default_wait_is_bounded_and_forever_must_be_asked_for():
    assert BufferConfig(group_size=1, schema={"r": ("float32", "row")}).wait_timeout == 600.0
    assert BufferConfig(group_size=1, schema={"r": ("float32", "row")}, wait_timeout=None).wait_timeout is None
    with pytest.raises(BadArgument, match="None waits forever"):
        BufferConfig(group_size=1, schema={"r": ("float32", "row")}, wait_timeout=math.inf)
    with pytest.raises(BadArgument, match="wait_timeout"):
        BufferConfig(group_size=1, schema={"r": ("float32", "row")}, wait_timeout=-1)


def test_math_inf_waits_until_the_gate_opens(buffer_factory):
    import threading

    buf = buffer_factory({"name": "in_order", "max_lookahead_versions": 0}, wait_timeout=0)
    [lease] = buf.admit([0])
    buf.commit_group(lease, make_group(2, 1))
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(buf.admit([1], timeout=math.inf)))
    waiter.start()
    buf.select(1)
    buf.finish_step()  # opens the gate
    waiter.join(timeout=60)
    assert len(got) == 1 and got[0][0].target_step == 1


def test_fencing_refusals_and_recoveries_are_logged(buffer_factory, caplog):
    buf = buffer_factory()
    [lease] = buf.admit([Prompt(prompt_idx=0)])
    with caplog.at_level(logging.INFO, logger="kvckpt"):
        plan = buf.recover()
        with pytest.raises(Exception, match="timeline"):
            buf.commit_group(lease, make_group(2, 1))
    messages = [r.getMessage() for r in caplog.records]
    assert any("recovered to trainer version 0" in m and plan.timeline in m for m in messages)
    assert any("fenced a commit of group" in m and "timeline differs" in m for m in messages)
    assert not logging.getLogger("kvckpt").handlers  # a library installs no handler
