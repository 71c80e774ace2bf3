"""Test harnesses that ship with kvckpt (like ``zarr.testing``): nothing here is imported by the
library itself, and the harness uses only kvckpt's public API (``from kvckpt import ...``,
``kvckpt.storage``, ``kvckpt.tables.records``, :func:`kvckpt.durability.safe_open.verify_untrusted`).

* :mod:`kvckpt.testing.campaign`: the command line, ``python -m kvckpt.testing.campaign [--kills N |
  fuzz --cases N | powercut --cuts N]``.
* :mod:`kvckpt.testing.workload`: the mixed workload the kill and power-cut campaigns crash (every
  commit path, the trainer loop, background checkpoints) and its log of acknowledged operations.
* :mod:`kvckpt.testing.history`: the checker: the store kept every acknowledged operation,
  exactly-once prompts, every row is its producer's.
* :mod:`kvckpt.testing.kill`: the SIGKILL crash campaign.
* :mod:`kvckpt.testing.sides`: the hook an integration plugs its own store's workload and checker into the
  kill campaign with (``--side MODULE``); the verl ledger's is ``kvckpt.integrations.verl.campaign``.
* :mod:`kvckpt.testing.fuzz`: the corruption fuzzing of checkpoint files.
* :mod:`kvckpt.testing.powerfs`: a FUSE filesystem that forgets what was not synced when the power
  is cut (Linux, ``/dev/fuse``, ``fusermount3`` and the ``mfusepy`` package).
* :mod:`kvckpt.testing.powercut`: the power-loss campaign that runs the workload on it;
  :mod:`kvckpt.testing.image_check` checks the image that survives.
* :mod:`kvckpt.testing.harness`: what the campaigns share (scratch directory, cycle loop, fork
  server, reporting).
* :mod:`kvckpt.testing.buffer_conformance`: the buffer state machine against a pure-Python model, run
  on any surface of the buffer (:class:`~kvckpt.testing.buffer_conformance.BufferSurface`: a factory and
  the capabilities it lacks, each with its reason).
* :mod:`kvckpt.testing.conformance`: the sampler contract as plain functions a custom sampler's
  own tests call (:func:`~kvckpt.testing.conformance.assert_sampler_conforms`).
"""
