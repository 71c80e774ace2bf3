"""Layer 2, tables (a second store kind beside the replay buffer's tables): the value store's key
layout, format record and transactions (:mod:`kvckpt.values.records`). A value store holds
already-encoded codec records under string keys; :class:`kvckpt.ValueStore` is its facade.

Imports only :mod:`kvckpt.storage`, :mod:`kvckpt.tables.meta` and the shared leaves.
"""
