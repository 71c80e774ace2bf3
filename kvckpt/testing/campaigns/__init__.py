"""The crash campaigns: what kill -9, a power cut and a damaged file must not break.

* :mod:`~kvckpt.testing.campaigns.campaign`: the command line, ``python -m kvckpt.testing.campaigns.campaign
  [--kills N | fuzz --cases N | powercut --cuts N]``.
* :mod:`~kvckpt.testing.campaigns.workload`: the mixed workload the kill and power-cut campaigns crash (every
  commit path, the trainer loop, background checkpoints) and its log of acknowledged operations;
  :mod:`~kvckpt.testing.campaigns.values_workload`: the value store's writer beside it.
* :mod:`~kvckpt.testing.campaigns.history`: the checker: the store kept every acknowledged operation,
  exactly-once prompts, every row is its producer's.
* :mod:`~kvckpt.testing.campaigns.kill`: the SIGKILL crash campaign.
* :mod:`~kvckpt.testing.campaigns.sides`: the hook an integration plugs its own store's workload and checker into
  the campaigns with (``--side MODULE``); the verl ledger's is ``kvckpt.integrations.verl.campaign``.
* :mod:`~kvckpt.testing.campaigns.fuzz`: the corruption fuzzing of checkpoint files.
* :mod:`~kvckpt.testing.campaigns.powerfs`: a FUSE filesystem that forgets what was not synced when the power
  is cut (Linux, ``/dev/fuse``, ``fusermount3`` and the ``mfusepy`` package).
* :mod:`~kvckpt.testing.campaigns.powercut`: the power-loss campaign that runs the workload on it;
  :mod:`~kvckpt.testing.campaigns.image_check` checks the image that survives.
* :mod:`~kvckpt.testing.campaigns.harness`: what the campaigns share (scratch directory, cycle loop, fork
  server, reporting).
"""
