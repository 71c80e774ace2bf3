"""Layer 1, storage: the LMDB environment and its transactions, the key encodings, the record codec,
the row schema and its casts, edge encoding of rows, and the group committer.

Knows nothing about prompts, leases or samplers; imports only :mod:`kvckpt.errors` and
:mod:`kvckpt.args` from the rest of kvckpt.
"""
