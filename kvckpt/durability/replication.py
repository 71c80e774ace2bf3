"""Snapshot catch-up of a standby, and the comparison of two replicas (docs/replication.md).

* :func:`snapshot_for_standby` takes a snapshot of a replicated primary through the one checkpoint
  primitive (:func:`~kvckpt.durability.checkpoint.snapshot_to_file`): its stamp transaction writes
  nothing and returns the log's last sequence ``S``, so the file is exactly the state after record
  ``S``; producers keep writing while it is copied.
* :func:`install_standby` installs such a file as a standby through the one restore primitive
  (:func:`~kvckpt.durability.checkpoint.install_checkpoint`: a private copy, checked, renamed): the
  copy's structure is proven before it is mapped, its replication state must be a primary's, its
  log records are dropped and it becomes a standby at ``S`` in the primary's epoch. The primary then
  ships from ``S + 1``.
* :func:`compare_replicas` says whether two stores hold the same state: the digest of every table
  but the log (whose bookkeeping differs between the roles by design), each read from one
  snapshot, and the sequence each is at (``kvckpt verify --against``).
"""

from __future__ import annotations

import os
from typing import Any

from kvckpt.durability.checkpoint import CheckpointHandle, install_checkpoint, snapshot_to_file
from kvckpt.durability.safe_open import open_readonly
from kvckpt.errors import BadArgument, FormatError
from kvckpt.storage.layout import ONE_TREE_TABLES
from kvckpt.storage.replica import make_standby
from kvckpt.storage.replog import PRIMARY, ReplicationLog, read_log, read_state
from kvckpt.storage.store import Store, Txn
from kvckpt.tables.digest import table_digests

#: The tables whose contents replicas must agree on: all but the log and its state.
REPLICATED_TABLES = tuple(t for t in ONE_TREE_TABLES if t != "replog")


def snapshot_for_standby(store: Store, dest: str | os.PathLike[str], *, background: bool = True) -> CheckpointHandle:
    """Write the primary ``store``'s state to ``dest`` for a standby to install; the handle's
    ``trainer_version`` is the log sequence the snapshot holds exactly.

    Raises:
        BadArgument: ``store`` is not a replicated primary. CheckpointError: as
            :func:`~kvckpt.durability.checkpoint.snapshot_to_file`.
    """
    log = store.replication
    if log is None or log.role != PRIMARY:
        raise BadArgument(f"{store.path!r} is not a replicated primary; enable replication on it first")
    return snapshot_to_file(store, dest, lambda txn, base: log.last, background=background)


def install_standby(snapshot_file: str, standby_path: str) -> int:
    """Install ``snapshot_file`` (from :func:`snapshot_for_standby`, possibly shipped from another
    node: untrusted) at ``standby_path`` as a standby; returns the sequence it holds.
    ``standby_path`` must not be open (it is replaced whole).

    Raises:
        FormatError: the file is damaged or not a replicated primary's snapshot. RecoveryError:
            copying failed. ``standby_path`` is untouched whenever this raises.
    """
    def check(tmp: str) -> int:
        with open_readonly(tmp, name=snapshot_file) as proven:  # proven before liblmdb maps it writable
            state = proven.read(read_state)
        if state is None or state.get("role") != PRIMARY or type(state.get("epoch")) is not int:
            raise FormatError(f"{snapshot_file!r} is not a snapshot of a replicated primary (its replication state "
                              f"is {state!r})")
        with Store(tmp) as store:
            applied = ReplicationLog.load(store).last
            make_standby(store, applied, state["epoch"])
        return applied

    return install_checkpoint(snapshot_file, os.path.abspath(standby_path), check)


def replica_state(txn: Txn) -> dict[str, Any]:
    """``{"role", "epoch", "sequence", "digests"}`` of the store ``txn`` reads: the sequence it is
    at (a primary's last record, a standby's applied one; 0 if not replicated) and its tables' digests."""
    state, _, last = read_log(txn)
    return {"role": state and state["role"], "epoch": state and state["epoch"], "sequence": last,
            "digests": table_digests(txn, REPLICATED_TABLES)}


def compare_replicas(path: str, other: str) -> dict[str, Any]:
    """Whether the stores at ``path`` and ``other`` hold the same state: each one's
    :func:`replica_state` and ``same_sequence``, ``differing`` (the tables whose digests differ)
    and ``equal`` (same sequence and no table differs). Both are opened read-only (a live writer
    may hold either; each is read from one snapshot)."""
    states = []
    for p in (path, other):
        with open_readonly(p) as store:
            states.append(store.read(replica_state))
    a, b = states
    differing = [t for t in REPLICATED_TABLES if a["digests"][t] != b["digests"][t]]
    same = a["sequence"] == b["sequence"]
    return {"path": path, "other": other, "this": a, "that": b, "same_sequence": same, "differing": differing,
            "equal": same and not differing}
