"""Test harnesses that ship with kvckpt (like ``zarr.testing``): nothing here is imported by the
library itself.

* :mod:`kvckpt.testing.powerfs`: a FUSE filesystem that forgets what was not synced when the power
  is cut (Linux, ``/dev/fuse``, ``fusermount3`` and the ``mfusepy`` package).
* :mod:`kvckpt.testing.powercut`: the power-loss campaign that runs the kvckpt workload on it.
"""
