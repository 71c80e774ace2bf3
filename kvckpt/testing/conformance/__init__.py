"""The conformance suites: what a surface of the buffer or a custom sampler runs from its own tests.

* :mod:`~kvckpt.testing.conformance.buffer`: the buffer state machine against a pure-Python model, run on any
  surface of the buffer (:class:`~kvckpt.testing.conformance.buffer.BufferSurface`: a factory, the
  capabilities it lacks with their reasons, and the columns of the operation table it offers).
* :mod:`~kvckpt.testing.conformance.scenarios`: one explicit scenario per operation of the operation table,
  run on every surface that offers it.
* :mod:`~kvckpt.testing.conformance.samplers`: the sampler contract as plain functions a custom sampler's own
  tests call (:func:`~kvckpt.testing.conformance.samplers.assert_sampler_conforms`); its names are
  importable from this package too (``from kvckpt.testing.conformance import assert_sampler_conforms``).
"""

from kvckpt.testing.conformance.samplers import (
    CHECKS,
    assert_sampler_conforms,
    check_capacity_refuses_deadlock,
    check_config_round_trip,
    check_evict_abort_consistent,
    check_selects_ready_only,
    check_view_read_only,
    run_sampler_conformance,
)

__all__ = ["CHECKS", "assert_sampler_conforms", "check_capacity_refuses_deadlock", "check_config_round_trip",
           "check_evict_abort_consistent", "check_selects_ready_only", "check_view_read_only",
           "run_sampler_conformance"]
