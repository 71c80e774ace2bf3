"""Damage a store file the structure check cannot see (found by the corruption fuzz soak)."""

from __future__ import annotations

from pathlib import Path

from kvckpt.storage.layout import split, stored_key

PAGE = 4096


def raise_rows_separators(path: Path) -> set[bytes]:
    """Raise the second separator key of each branch page of the ``rows`` B-tree by one in its
    last byte: the page stays sorted and LMDB's structure check passes, iteration still finds every
    row, but a lookup of the child's first key is routed to its left sibling and misses. Every
    such page is changed, the tree's and any stale copy among a page copy's free pages."""
    data = bytearray(path.read_bytes())
    keys = set()
    for off in range(2 * PAGE, len(data), PAGE):
        flags = int.from_bytes(data[off + 10:off + 12], "little")
        lower = int.from_bytes(data[off + 12:off + 14], "little")
        if not flags & 0x01 or (lower - 16) // 2 < 3:  # a branch page with at least three children
            continue
        node = off + int.from_bytes(data[off + 18:off + 20], "little")
        ksize = int.from_bytes(data[node + 6:node + 8], "little")
        key = bytes(data[node + 8:node + 8 + ksize])
        if ksize > 5 and key[-5] == 0 and key.startswith(stored_key("rows", b"a0-p")) and key[-1] < 0xFF:
            data[node + 8 + ksize - 1] += 1
            keys.add(split(key)[1])  # the row's key, as the verifier names it
    assert keys, "no branch page of the rows table found"
    path.write_bytes(bytes(data))
    return keys
