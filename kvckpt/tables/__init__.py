"""Layer 2, tables: the one place that knows the key layout. Value records (groups, ledger
entries, leases), typed access to every table inside a transaction with index maintenance done
where a record changes, the state record, and the digests.

Imports only :mod:`kvckpt.storage` (and the shared leaves :mod:`kvckpt.errors`, :mod:`kvckpt.args`).
"""
