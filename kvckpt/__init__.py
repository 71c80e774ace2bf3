"""kvckpt: a crash-consistent replay buffer and checkpoint store for async RL post-training.

Buffer rows, group metadata, the ledger of in-flight prompts and every cursor live in one LMDB
file; every state transition is one durable write transaction; a checkpoint is one stamp
transaction plus a background copy to one file; restore opens a fresh handle on a copy.
"""

from kvckpt.aio import AsyncReplayBuffer
from kvckpt.buffer import Batch, BufferConfig, ReplayBuffer
from kvckpt.durability.checkpoint import (
    CheckpointHandle,
    CheckpointResult,
    checkpoint,
    keep_latest,
    read_stamp,
    restore,
)
from kvckpt.durability.recovery import RecoveryPlan, recover
from kvckpt.durability.verify import Report, check, verify_path
from kvckpt.errors import (
    AbandonedTimeline,
    BadArgument,
    CapacityError,
    CheckpointError,
    CorruptRecord,
    DiskFull,
    DuplicateCommit,
    ForeignLease,
    FormatError,
    GateTimeout,
    InvariantViolation,
    KvckptError,
    LeaseError,
    LeaseMismatch,
    NotSelectable,
    ReadOnlyStore,
    RecoveryError,
    SchemaMismatch,
    StaleAttempt,
    StoreLocked,
    StoreNotFound,
    UnknownGroup,
    VerificationFailed,
)
from kvckpt.samplers import Sampler, create_sampler, register
from kvckpt.storage.schema import Field, RowSchema, split_padded
from kvckpt.storage.store import Store
from kvckpt.tables.records import CommitResult, GroupInfo, Lease, LedgerEntry, Prompt, Selection

__version__ = "0.1.0"

__all__ = [
    "AbandonedTimeline", "AsyncReplayBuffer", "BadArgument", "Batch", "BufferConfig", "CapacityError",
    "CheckpointError", "CheckpointHandle", "CheckpointResult", "CommitResult", "CorruptRecord", "DiskFull",
    "DuplicateCommit", "Field", "ForeignLease", "FormatError", "GateTimeout", "GroupInfo", "InvariantViolation",
    "KvckptError", "Lease", "LeaseError", "LeaseMismatch", "LedgerEntry", "NotSelectable", "Prompt",
    "ReadOnlyStore", "RecoveryError", "RecoveryPlan", "ReplayBuffer", "Report", "RowSchema", "Sampler",
    "SchemaMismatch", "Selection", "StaleAttempt", "Store", "StoreLocked", "StoreNotFound", "UnknownGroup",
    "VerificationFailed", "check", "checkpoint", "create_sampler", "keep_latest", "read_stamp", "recover",
    "register", "restore", "split_padded", "verify_path",
]
