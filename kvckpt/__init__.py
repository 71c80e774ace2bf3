"""kvckpt: a crash-consistent replay buffer and checkpoint store for async RL post-training.

The public API is re-exported here; the packages below are layers, each importing only the ones
before it (docs/architecture.md): :mod:`kvckpt.storage`, :mod:`kvckpt.tables`,
:mod:`kvckpt.samplers`, :mod:`kvckpt.transitions`, :mod:`kvckpt.durability`, :mod:`kvckpt.buffer`,
then the operations tools (:mod:`kvckpt.tools`), the harnesses (:mod:`kvckpt.testing`) and the
integrations (:mod:`kvckpt.integrations`) and the reference trainer (:mod:`kvckpt.reference`).

Buffer rows, group metadata, the ledger of in-flight prompts and every cursor live in one LMDB
file; every state transition is one durable write transaction; a checkpoint is one stamp
transaction plus a background copy to one file; restore opens a fresh handle on a copy.

What is exported here (``__all__``), with :mod:`kvckpt.errors`, :mod:`kvckpt.samplers` and
:mod:`kvckpt.testing`, is the public API, the only part of kvckpt that integrations import
(docs/architecture.md, "The public API"; ``tests/tools/test_layers.py`` holds them to it). Besides the
buffer, it holds what an adapter storing its own files needs: the durable-directory helpers
(:func:`makedirs_durable`, :func:`fsync_dir`, :func:`fsync_file`), the record codec
(:mod:`codec <kvckpt.storage.codec>`, docs/format.md) and the value-record helper :func:`write_id_of`,
the group states, the sample-id spelling :func:`row_id`, and the row encoder producers use.
"""

from kvckpt.buffer import Batch, BufferConfig, ReplayBuffer, checkpoint, recover, restore
from kvckpt.buffer.aio import DEFAULT_WORKERS, AsyncReplayBuffer
from kvckpt.buffer.batch import assemble_batch
from kvckpt.buffer.standby import (
    Standby,
    enable_replication,
    log_since,
    promote,
    promote_value_store,
    replication_status,
    snapshot_for_standby,
    trim_log,
)
from kvckpt.buffer.values import ValueStore, ValueView
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
    ProgressGap,
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
from kvckpt.metrics import MetricsHook, sink_from_config
from kvckpt.samplers import Sampler, create_sampler, register
from kvckpt.storage import codec
from kvckpt.storage.encoding import RowEncoder
from kvckpt.storage.keys import row_id
from kvckpt.storage.progress_message import ProgressEncoder, ProgressMessage
from kvckpt.storage.replace import durable_replace, write_durably
from kvckpt.storage.schema import Field, RowSchema, split_padded
from kvckpt.storage.store import Store, fsync_dir, fsync_file, makedirs_durable
from kvckpt.tables.records import (
    ABORTED,
    CLAIMED,
    CONSUMED,
    EVICTED,
    READY,
    Admission,
    CommitResult,
    GroupInfo,
    Lease,
    LedgerEntry,
    Progress,
    Prompt,
    Selection,
)
from kvckpt.values.records import write_id_of

__version__ = "0.2.0"  # semantic versioning, CHANGELOG.md

__all__ = [
    "ABORTED", "CLAIMED", "CONSUMED", "DEFAULT_WORKERS", "EVICTED", "READY",
    "AbandonedTimeline", "Admission", "AsyncReplayBuffer", "BadArgument", "BadOffsets", "Batch", "BufferConfig",
    "CapacityError",
    "CheckpointError", "CheckpointHandle", "CheckpointResult", "CommitResult", "CorruptRecord", "DiskFull",
    "DuplicateCommit", "FencedWrite", "Field", "ForeignLease", "FormatError", "FutureVersion", "GateTimeout",
    "GroupInfo", "InvariantViolation", "KvckptError", "Lease", "LeaseError", "LeaseMismatch", "LedgerEntry",
    "MalformedMessage", "MetricsHook", "NotSelectable", "Progress", "ProgressEncoder", "ProgressGap", "ProgressMessage",
    "Prompt",
    "ReadOnlyStore", "RecoveryError", "RecoveryPlan", "ReplayBuffer",
    "Report", "RowEncoder", "RowSchema", "SampleCommitted", "Sampler", "SchemaMismatch", "Selection", "StaleAttempt",
    "Standby",
    "Store", "StoreLocked", "StoreNotFound", "UnknownGroup", "ValueStore", "ValueView", "VerificationFailed",
    "assemble_batch",
    "check", "checkpoint", "codec", "create_sampler", "durable_replace",
    "enable_replication", "fsync_dir", "fsync_file", "keep_latest", "log_since",
    "makedirs_durable", "promote", "promote_value_store", "read_stamp", "recover", "register", "replication_status",
    "restore", "row_id",
    "sink_from_config", "snapshot_for_standby", "split_padded", "trim_log",
    "verify_path", "write_durably", "write_id_of",
]
