"""kvckpt: a crash-consistent replay buffer and checkpoint store for async RL post-training.

The public API is re-exported here; the packages below are layers, each importing only the ones
before it (docs/architecture.md): :mod:`kvckpt.storage`, :mod:`kvckpt.tables`,
:mod:`kvckpt.samplers`, :mod:`kvckpt.transitions`, :mod:`kvckpt.durability`, :mod:`kvckpt.buffer`,
then the operations tools (:mod:`kvckpt.tools`), the harnesses (:mod:`kvckpt.testing`) and the
integrations (:mod:`kvckpt.integrations`).

Buffer rows, group metadata, the ledger of in-flight prompts and every cursor live in one LMDB
file; every state transition is one durable write transaction; a checkpoint is one stamp
transaction plus a background copy to one file; restore opens a fresh handle on a copy.
"""

from kvckpt.buffer import Batch, BufferConfig, ReplayBuffer, checkpoint, recover, restore
from kvckpt.buffer.aio import AsyncReplayBuffer
from kvckpt.buffer.values import ValueStore
from kvckpt.durability.checkpoint import CheckpointHandle, CheckpointResult, keep_latest, read_stamp
from kvckpt.durability.recovery import RecoveryPlan
from kvckpt.durability.safe_open import verify_path
from kvckpt.durability.verify import Report, check
from kvckpt.errors import (
    AbandonedTimeline,
    BadArgument,
    BadOffsets,
    CapacityError,
    CheckpointError,
    CorruptRecord,
    DiskFull,
    DuplicateCommit,
    FencedWrite,
    ForeignLease,
    FormatError,
    FutureVersion,
    GateTimeout,
    InvariantViolation,
    KvckptError,
    LeaseError,
    LeaseMismatch,
    MalformedMessage,
    NotSelectable,
    ReadOnlyStore,
    RecoveryError,
    SampleCommitted,
    SchemaMismatch,
    StaleAttempt,
    StoreLocked,
    StoreNotFound,
    UnknownGroup,
    VerificationFailed,
)
from kvckpt.samplers import Sampler, create_sampler, register
from kvckpt.storage.progress_message import ProgressEncoder, ProgressMessage
from kvckpt.storage.schema import Field, RowSchema, split_padded
from kvckpt.storage.store import Store
from kvckpt.tables.records import CommitResult, GroupInfo, Lease, LedgerEntry, Progress, Prompt, Selection

__version__ = "0.1.0"

__all__ = [
    "AbandonedTimeline", "AsyncReplayBuffer", "BadArgument", "BadOffsets", "Batch", "BufferConfig",
    "CapacityError",
    "CheckpointError", "CheckpointHandle", "CheckpointResult", "CommitResult", "CorruptRecord", "DiskFull",
    "DuplicateCommit", "FencedWrite", "Field", "ForeignLease", "FormatError", "FutureVersion", "GateTimeout",
    "GroupInfo", "InvariantViolation", "KvckptError", "Lease", "LeaseError", "LeaseMismatch", "LedgerEntry",
    "MalformedMessage", "NotSelectable", "Progress", "ProgressEncoder", "ProgressMessage", "Prompt",
    "ReadOnlyStore", "RecoveryError", "RecoveryPlan", "ReplayBuffer",
    "Report", "RowSchema", "SampleCommitted", "Sampler", "SchemaMismatch", "Selection", "StaleAttempt",
    "Store", "StoreLocked", "StoreNotFound", "UnknownGroup", "ValueStore", "VerificationFailed", "check",
    "checkpoint",
    "create_sampler", "keep_latest", "read_stamp", "recover", "register", "restore", "split_padded",
    "verify_path",
]
