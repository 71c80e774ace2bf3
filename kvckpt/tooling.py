"""The tools' face: the file-level parts of kvckpt that the tools (``tools/``, ``kvckpt.tools``) and the
benchmarks (``benchmarks/``) build on, named once.

The tools read and write store files below the buffer (a snapshot's tables, the record codec, the store
kinds' hooks, the digests, the untrusted-file open) and the benchmarks measure those parts one at a time;
neither may reach a module below this face or a private name (``scripts/layers.py``'s ``boundary`` rule,
``tests/tools/test_layers.py``). What they need beside :mod:`kvckpt`'s public API is re-exported here;
integrations keep to the public API and never import this module. Each name keeps the guarantees its
home module's docstring states.
"""

from __future__ import annotations

from kvckpt.durability import kinds
from kvckpt.durability.replication import compare_replicas
from kvckpt.durability.safe_open import check_header, copy_used, open_readonly
from kvckpt.durability.structure import is_sound
from kvckpt.storage import keys, replog
from kvckpt.storage.encoding import check_encoded
from kvckpt.storage.group_commit import GroupCommitter
from kvckpt.storage.layout import stored_key
from kvckpt.storage.store import Txn, writer_active
from kvckpt.tables import meta
from kvckpt.tables.digest import check_group_digest, group_digest, row_digest
from kvckpt.tables.meta import CONFIG_KEY, DATALOADER_KEY, SHORTFALL_KEY, STAMP_KEY, STATE_KEY
from kvckpt.tables.records import GROUP_STATES, lineage_weight
from kvckpt.values import records as value_records

__all__ = [
    "CONFIG_KEY", "DATALOADER_KEY", "GROUP_STATES", "SHORTFALL_KEY", "STAMP_KEY", "STATE_KEY", "GroupCommitter",
    "Txn", "check_encoded", "check_group_digest", "check_header", "compare_replicas", "copy_used", "group_digest",
    "is_sound", "keys", "kinds", "lineage_weight", "meta", "open_readonly", "replog", "row_digest", "stored_key",
    "value_records", "writer_active",
]
