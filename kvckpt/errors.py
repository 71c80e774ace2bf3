"""Every error kvckpt raises on purpose.

All of them derive from :class:`KvckptError`, so ``except KvckptError`` catches anything the
library reports deliberately. Where the meaning matches a builtin, the class also derives from it
(a missing store is a ``FileNotFoundError``, a bad argument a ``ValueError``). Each message names
what was wrong and what to do about it; ``lmdb.Error`` is translated at the store boundary and
never escapes unwrapped from a public call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class KvckptError(Exception):
    """Base class of every error kvckpt raises deliberately."""


class StoreNotFound(KvckptError, FileNotFoundError):
    """The store file does not exist and ``create`` was not requested."""


class StoreLocked(KvckptError):
    """Another handle (this process or another) holds the store open for writing.

    LMDB allows one writer per environment; kvckpt enforces it with an exclusive ``flock`` on the
    data file so a second writer is refused instead of queueing or corrupting.
    """


class ReadOnlyStore(KvckptError, PermissionError):
    """A write was attempted through a handle opened with ``readonly=True``."""


class FormatError(KvckptError):
    """The file is not a kvckpt store of a version this code reads (foreign, truncated or newer)."""


class CorruptRecord(KvckptError):
    """A stored value failed its checksum or does not parse; the key names the damaged record."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(
            f"corrupt record {key!r}: {reason}. The store or checkpoint is damaged; "
            "restore from another checkpoint (run `kvckpt verify` to list every damaged key)."
        )

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Exceptions cross process boundaries (Ray actors, executors) by pickling; the default
        # reduce would call __init__ with the formatted message alone and fail.
        return (type(self), (self.key, self.reason))


class InvariantViolation(KvckptError):
    """The store's records disagree with each other (e.g. a prompt both committed and in flight)."""


class DiskFull(KvckptError, OSError):
    """The filesystem ran out of space; the failed transaction wrote nothing."""


class ResourceLimit(KvckptError, OSError):
    """A process limit stopped kvckpt: the address space for the memory map (``ulimit -v``) or the
    number of open files (``ulimit -n``). Nothing was written; the message says which limit."""


class BadArgument(KvckptError, ValueError):
    """An argument is invalid (wrong group size, schema mismatch, unknown sampler, ...)."""


class SchemaMismatch(BadArgument):
    """Rows do not match the schema the store was configured with."""


class ProgressGap(BadArgument):
    """A token-progress chunk starts past the end of its sample's durable prefix (it would leave a gap);
    nothing of it was written. The message names the sample, the chunk's start and the durable length."""


class CapacityError(BadArgument):
    """The buffer capacity would deadlock the sampler, or admitting would exceed it."""


class LeaseError(KvckptError):
    """Base class of commits refused because of their lease; the refused commit wrote nothing."""


class UnknownGroup(LeaseError, KeyError):
    """The lease names a group that is neither in flight nor committed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StaleAttempt(LeaseError):
    """The lease is fenced: its store id, timeline or attempt is not the group's current one.

    ``differs`` names which of the three (``"store_id"``, ``"timeline"`` or ``"attempt"``); the
    subclasses :class:`ForeignLease` and :class:`AbandonedTimeline` say the same in their type.
    """

    differs = "attempt"


class ForeignLease(StaleAttempt):
    """The lease was issued by another store (or an older kvckpt that issued no store id)."""

    differs = "store_id"


class AbandonedTimeline(StaleAttempt):
    """The lease belongs to a timeline the store has left: a restore or recovery came after it."""

    differs = "timeline"


class FencedWrite(StaleAttempt):
    """A value-store write was refused inside its transaction, before anything changed: the fence
    record under ``key`` was written by ``found``, not by the ``expected`` identity the writer holds
    (a restart replaced the writer's run)."""

    def __init__(self, path: str, key: str, expected: str, found: str | None) -> None:
        self.path, self.key, self.expected, self.found = path, key, expected, found
        super().__init__(f"value store {path!r}: a write fenced by {key!r} = {expected!r} refused; the record "
                         f"was written by {found!r}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str | None]]:
        return (type(self), (self.path, self.key, self.expected, self.found))


class LeaseMismatch(LeaseError, BadArgument):
    """The lease disagrees with its ledger entry about the group (size, prompt, stamps).

    The ledger entry is the only authority; ``field`` names the first field that differs.
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class DuplicateCommit(LeaseError):
    """The group is already committed with different content by the same or another attempt."""


class SampleCommitted(DuplicateCommit):
    """Token progress was recorded for a sample whose row is already committed (its progress was
    consumed by that commit); nothing was written."""


class FutureVersion(BadArgument):
    """Token progress claims a weight version newer than any the buffer has reached (the trainer's
    and the rollout weight version); nothing was written."""


class MalformedMessage(BadArgument):
    """A progress step message as a whole is refused: its checksum fails, or it is not a message
    kvckpt's :class:`~kvckpt.storage.progress_message.ProgressEncoder` builds (a missing or mistyped
    field, arrays whose lengths disagree); nothing of it was written."""


class BadOffsets(BadArgument):
    """One sequence of a progress step message is refused because its slice of the message's token
    array is ambiguous: its offsets do not add up (empty, backwards, overlapping another sequence,
    past the array), or tokens lie before the first sequence or after the last; nothing of that
    sequence was written, the others of the message are unaffected."""


class GateTimeout(KvckptError, TimeoutError):
    """Admission waited ``timeout`` seconds and the sampler's gate (or capacity) stayed closed."""


class NotSelectable(KvckptError):
    """A group id passed to a batch read is not claimed or retained in this store."""


class CheckpointError(KvckptError):
    """A checkpoint could not be written; the destination was left untouched."""


class RecoveryError(KvckptError):
    """A store or checkpoint cannot be restored as asked (the message says which rule failed)."""


class VerificationFailed(RecoveryError):
    """The verifier found problems in a store or checkpoint, so it was not recovered or restored.

    ``subject`` names what was checked; ``problems`` lists every finding
    (:class:`kvckpt.durability.verify.Problem`: a stable code, the key, a sentence); the message quotes the
    first ten.
    """

    def __init__(self, subject: str, problems: Sequence[Any]) -> None:
        self.subject = subject
        self.problems = list(problems)
        shown = "; ".join(str(p) for p in self.problems[:10])
        more = f" (and {len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        super().__init__(f"{subject} failed verification, refusing to recover: {shown}{more}")

    def __reduce__(self) -> tuple[type, tuple[str, list[Any]]]:
        return (type(self), (self.subject, self.problems))


class ReplicationError(KvckptError):
    """A replication operation was refused (docs/replication.md); the subclasses say why. Whatever
    was refused applied nothing."""


class NotPrimary(ReplicationError):
    """A write reached a standby's store other than through an applied log batch; a standby changes
    only by applying its primary's log (or by :func:`promote`)."""


class NotStandby(ReplicationError):
    """A log batch was shipped to a store that is not a standby (a primary, or a promoted standby:
    the sender is an old primary, and nothing it ships is applied)."""


class CorruptLogRecord(ReplicationError):
    """A shipped log record failed its checksum or does not parse (damaged in transit or crafted)."""


class ForeignStore(ReplicationError):
    """A shipped log record names another store's id: the batch belongs to another primary."""


class StaleEpoch(ReplicationError):
    """A shipped log record carries an epoch older than the standby's: it comes from a primary
    that has since been replaced by a promotion (a revived old primary is refused here)."""


class RepeatedSequence(ReplicationError):
    """A shipped batch holds the same sequence number twice."""


class LogGap(ReplicationError):
    """A shipped batch skips a sequence number, inside itself or after what the standby applied;
    or the primary's log no longer holds the records a standby needs (it must catch up from a
    snapshot)."""


class ChannelError(KvckptError):
    """A producer's direct progress channel into the buffer actor's process refused a frame or was
    lost for good (docs/ray.md, "The direct progress channel"): a frame past the channel's length
    limit, a connection the buffer actor never came back to. Whatever the refusal names was not
    written."""


def error_to_wire(exc: BaseException) -> tuple[str, str]:
    """An error as what crosses a non-pickle wire: its class name and its message
    (:func:`error_from_wire` rebuilds it)."""
    return type(exc).__name__, str(exc)


def error_from_wire(name: str, message: str) -> KvckptError:
    """The kvckpt error ``name`` (a class of this module) carrying ``message``, as
    :func:`error_to_wire` sent it: the same class, so ``except StaleAttempt`` catches it as it
    would the original. Attributes a class's own ``__init__`` sets (``CorruptRecord.key``,
    ``LeaseMismatch.field``, ...) do not travel; the message names them. A name that is not a
    kvckpt error (a crafted or foreign reply, a bug's exception) comes back as a plain
    :class:`KvckptError` whose message starts with that name."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, KvckptError):
        exc = cls.__new__(cls, message)  # BaseException.__new__ sets args; the class's __init__ is skipped
        exc.args = (message,)
        return exc
    return KvckptError(f"{name}: {message}")
