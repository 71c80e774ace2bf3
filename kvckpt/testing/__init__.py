"""Test harnesses that ship with kvckpt (like ``zarr.testing``), by kind. Nothing below this layer
imports them (docs/architecture.md: ``testing`` is layer 9); they may use any layer below, and many
do (a campaign crafts damaged files, a conformance suite compares the store byte for byte), so they
are the library's own tests of itself, public for users to run on theirs.

* :mod:`kvckpt.testing.campaigns`: the crash campaigns: the SIGKILL and power-cut campaigns, the
  corruption fuzzer, the workload they crash and its history checker, and the FUSE file system that
  cuts the power (``python -m kvckpt.testing.campaigns.campaign``).
* :mod:`kvckpt.testing.conformance`: the conformance suites a surface of the buffer or a custom
  sampler runs from its own tests: the buffer state machine and one scenario per operation
  (:mod:`~kvckpt.testing.conformance.buffer`, :mod:`~kvckpt.testing.conformance.scenarios`), and the
  sampler contract (:mod:`~kvckpt.testing.conformance.samplers`, also importable as
  ``kvckpt.testing.conformance``).
* :mod:`kvckpt.testing.fixtures`: what tests, benchmarks and the reference trainer stand up: the
  in-memory replay buffer (the reference trainer's ``memory`` backend and the conformance suite's
  double), the tiny model and its addition task, the vLLM server of the TRL tests.
"""
