"""Layer 5, durability: verification, the untrusted-file open, checkpoint stamping and copying,
restore of a checkpoint file, recovery, and the format upgrade.

Works on a :class:`~kvckpt.storage.store.Store` through :mod:`kvckpt.tables`; never touches the
buffer facade (:mod:`kvckpt.buffer`), which sits above it.
"""
