"""The buffer conformance suite (kvckpt.testing.buffer_conformance) on the surfaces other than
ReplayBuffer itself (tests/test_buffer_stateful.py runs that one): the asyncio facade through a
synchronous shim, and the reference trainer's in-memory buffer. Each surface's missing capabilities
are declared with their reason; the Ray actor's run is in tests/test_ray_conformance.py.

CI runs derandomized profiles: the same examples every run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from kvckpt.testing.buffer_conformance import ASYNC_SURFACE, BufferSurface, run_buffer_conformance

SAMPLERS = ["in_order", "weight_fifo", "windowed", "ready_first"]
#: Smaller than the buffer's own profile: the facade adds only its event loop hop to each call.
SMALL = settings(max_examples=20, stateful_step_count=40, deadline=None, database=None, derandomize=True,
                 print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_the_async_facade_conforms(sampler: str) -> None:
    run_buffer_conformance(ASYNC_SURFACE, sampler, SMALL)


def test_an_unknown_capability_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown capabilities"):
        BufferSurface("typo", create=lambda path, config: None, lacks={"durablity": "spelt wrong"})
