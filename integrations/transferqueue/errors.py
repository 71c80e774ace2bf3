"""The two refusals of the TransferQueue backend, both raised on ``get`` before any value is returned."""

from __future__ import annotations

from kvckpt.errors import KvckptError


class ValueMissing(KvckptError, KeyError):
    """TransferQueue asked for a key the kvckpt store does not hold (never written, or cleared)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"TransferQueue key {key!r} is not in the kvckpt store: it was never put, or it was "
                         "cleared. The controller's metadata and the store disagree (a controller checkpoint "
                         "restored without its storage checkpoint?)")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.key,))


class WriteIdentityMismatch(KvckptError, LookupError):
    """The stored bytes of a key were written by another put than the one TransferQueue's metadata names.

    TransferQueue reuses freed global indexes, so ``"{index}@{field}"`` is not a stable identity:
    the bytes under it may belong to a later (or earlier) sample than the caller's metadata. Every
    put stamps its values with a write identity that TransferQueue keeps as per-key backend
    metadata; ``get`` refuses bytes whose identity differs instead of serving another sample's data.
    """

    def __init__(self, key: str, expected: str | None, found: str | None) -> None:
        self.key = key
        self.expected = expected
        self.found = found
        super().__init__(
            f"TransferQueue key {key!r}: the store holds the value of write {found!r}, but the caller's metadata "
            f"names write {expected!r}. The global index was recycled (or the controller and the storage were "
            "restored from different checkpoints); refusing to serve another sample's bytes")

    def __reduce__(self) -> tuple[type, tuple[str, str | None, str | None]]:
        return (type(self), (self.key, self.expected, self.found))
