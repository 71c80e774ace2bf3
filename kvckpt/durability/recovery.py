"""Recovery: reconcile a store to the trainer version a run resumes from, and fence old workers.

Both recovery modes end here:

* **from a checkpoint file** (:func:`kvckpt.restore`): the file is copied to the live
  path, opened through a fresh handle and recovered to the version stamped in it;
* **from the live store** after a crash: the live file (durable on every commit) is opened and
  recovered to the version of the model checkpoint the trainer resumes from.

:func:`recover_store` is one write transaction that (the buffer's :meth:`~kvckpt.ReplayBuffer.recover`
and :func:`kvckpt.recover` call it)

1. verifies the store (:func:`kvckpt.durability.verify.check`) and refuses to go on if anything is
   wrong; unless told otherwise it first proves the tree pages of the store's file with
   :func:`kvckpt.durability.structure.proven_keys`, takes the rows' keys from that proof, and
   looks every key up only when the proof fails;
2. returns every group claimed or consumed at a step ``>= resume_version`` to ``ready`` (its
   stamps untouched), since the model that trained on it is lost;
3. sets ``trainer_version`` to ``resume_version`` (and, given a ``resume_version``, the rollout
   weight version too);
4. optionally switches sampler or capacity, re-stamping and re-checking what that needs;
5. starts a new *timeline* (a fresh random id), moves every ledger entry onto it with its
   ``attempt`` bumped (and its stamps made true of the weights that generate it, step 6) and
   returns their leases: each in-flight prompt is redispatched exactly
   once, at its saved ``target_step``, without a new admission, and any worker that outlived the
   crash is fenced (its commits raise ``AbandonedTimeline``) — even one leased by an earlier
   restore of the same checkpoint file, whose attempts equal the new ones;
6. given a ``resume_version`` (a rollback: the run continues from that version's weights),
   keeps every stamp the weights that generated it (the rule every sampler and adapter reads
   through :func:`kvckpt.tables.records.lineage_weight`, docs/recovery.md "Stamps after a
   rollback"): a ready group with a token newer than ``resume_version`` (its newest version,
   ``lineage_newest``, else its stamp: its tokens can span a weight sync) holds work of weights this
   recovery destroyed, so it gets ``lineage_fork = resume_version`` (its staleness is then its
   newest token's ``(v - resume) + (current - resume)``, the distance in the version tree, or its
   stamp's if that is larger); an in-flight prompt stamped after ``resume_version`` that kept
   nothing is stamped ``resume_version`` (the resumed weights regenerate it), one that kept
   siblings or token progress newer than ``resume_version`` is forked like a ready group.
   The fork is written in this same transaction, on the records themselves, so it is as durable
   as the rollback and a later recovery to an older version lowers it. Without a ``resume_version``
   (the trainer lives on: a restarted store actor, a crashed producer) no weights were destroyed:
   no stamp is forked or restamped and the rollout weight version stays, even where a stamp is
   ahead of the store's trainer version (NeMo-RL reserves with weights its trainer has not yet
   reported to the store).

Groups committed after the checkpoint are kept; finished siblings of partial groups are kept
(``siblings_reused``), and so is the durable token progress of every sample still missing
(``progress_samples``, ``progress_tokens``): a new attempt reads it with
:meth:`~kvckpt.ReplayBuffer.progress` and continues from it. Restore never applies staleness: the first ``evict`` does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvckpt.durability.structure import proven_keys
from kvckpt.durability.verify import check
from kvckpt.errors import RecoveryError, VerificationFailed
from kvckpt.samplers import create_sampler
from kvckpt.storage.store import Store, Txn
from kvckpt.tables import meta
from kvckpt.tables.access import Tables
from kvckpt.tables.records import CLAIMED, READY, GroupInfo, Lease, LedgerEntry
from kvckpt.transitions.config import BufferConfig
from kvckpt.transitions.progress import durable_length, durable_newest

log = logging.getLogger("kvckpt.recovery")


@dataclass
class RecoveryPlan:
    """What a trainer does next after recovery, with NeMo-RL's telemetry names.

    ``leases`` are the in-flight prompts to redispatch, each once, in dispatch order;
    ``progress_samples`` of their samples have durable token progress, ``progress_tokens`` tokens
    in all (read each with :meth:`~kvckpt.ReplayBuffer.progress`). ``prompts_restamped`` of them
    were stamped with weights newer than ``resume_version`` and kept nothing: their stamp is now
    ``resume_version``, the weights that generate them. ``groups_on_destroyed_lineage`` counts the
    ready groups and in-flight prompts (with kept work) with a token newer than ``resume_version``
    (whatever their stamp): their
    ``lineage_fork`` is set (or, forked at an older version by an earlier recovery, kept), so
    staleness counts the distance in the version tree; 0 for a plain ``recover()``.
    ``trainer_state`` is the JSON the trainer stamped into the checkpoint at ``resume_version``
    (``None`` when the store's last stamp is at another version, or for a live store never
    checkpointed); ``dataloader_state`` is the state stored with the last admission:
    resume the dataloader from it, not from an older copy, or prompts are served twice.
    """

    resume_version: int
    leases: list[Lease] = field(default_factory=list)
    groups_complete_restored: int = 0
    groups_unfinished_found: int = 0
    groups_redispatched: int = 0
    groups_returned_to_ready: int = 0
    siblings_reused: int = 0
    siblings_rerun: int = 0
    prompts_restamped: int = 0
    groups_on_destroyed_lineage: int = 0
    progress_samples: int = 0
    progress_tokens: int = 0
    dispatch_index: int = -1
    trainer_state: dict[str, Any] | None = None
    dataloader_state: bytes | None = None
    checkpoint_id: str | None = None
    timeline: str = ""
    changes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """The telemetry as a flat JSON-able dict (no leases, no state blobs)."""
        return {"resume_version": self.resume_version, "groups_complete_restored": self.groups_complete_restored,
                "groups_unfinished_found": self.groups_unfinished_found,
                "groups_redispatched": self.groups_redispatched,
                "groups_returned_to_ready": self.groups_returned_to_ready,
                "siblings_reused": self.siblings_reused, "siblings_rerun": self.siblings_rerun,
                "prompts_restamped": self.prompts_restamped,
                "groups_on_destroyed_lineage": self.groups_on_destroyed_lineage,
                "progress_samples": self.progress_samples, "progress_tokens": self.progress_tokens,
                "dispatch_index": self.dispatch_index, "checkpoint_id": self.checkpoint_id,
                "timeline": self.timeline,
                "changes": list(self.changes), **{f"{k}_seconds": v for k, v in self.timings.items()}}


def recover_store(store: Store, config: BufferConfig, resume_version: int | None = None, *, sampler: Any = None,
                  max_buffered_rollouts: int | None = None, checksums: bool = False,
                  deep: bool = False, lookups: bool | None = None,
                  proven_rows: list[bytes] | None = None) -> tuple[RecoveryPlan, BufferConfig]:
    """Reconcile ``store`` to ``resume_version`` in one transaction and plan the redispatch.

    Args:
        store: an open, writable store (a fresh handle after a crash or a restore) whose buffer
            config is ``config``.
        resume_version: the trainer version of the model checkpoint the run resumes from (the
            number of finished steps it contains): every stamp newer than it names weights the
            resumed run does not have (step 6). Defaults to the store's ``trainer_version`` with
            the trainer alive: only the interrupted step's claims are undone, no stamp is forked
            or restamped and the rollout weight version stays.
        sampler: switch to another sampler (config dict or name). Groups lacking the stamps it
            needs are stamped (``in_order``: ``groups_per_step`` per step from ``resume_version``).
        max_buffered_rollouts: switch capacity (checked against the sampler and the groups held).
        checksums, deep: how much of the row payloads the verification reads first (see
            :func:`kvckpt.durability.verify.check`). Defaults to neither: a live store's rows were checksummed
            when written and are verified again whenever they are read.
        lookups: look every key up (:func:`kvckpt.durability.verify.check`). True: always.
            False: never, for a file the caller proved with
            :func:`kvckpt.durability.structure.is_sound` (restore's copy). Defaults to None: prove
            the tree of the file the store has open (:meth:`~kvckpt.storage.store.Store.data_fd`,
            not its path) with ``is_sound(headers=False)`` inside the recovery transaction (it
            reads the branch and leaf pages, no row's page; ``plan.timings``'s ``structure``),
            take the rows' keys from that proof, and look every key up and iterate the rows only
            when it is not proven (a damaged page, or a format-1/2 file of named tables).
        proven_rows: with ``lookups=False``, the stored keys of the rows range as the caller's proof
            of this very file read them (restore's copy:
            :func:`kvckpt.durability.safe_open.prove_structure`); the verification takes them
            instead of iterating the rows (which on a cold page cache reads a page of every row).

    Returns:
        The plan, and the config now in force (``config`` itself unless switched).

    Raises:
        VerificationFailed (a RecoveryError): the store fails verification.
        RecoveryError: ``resume_version`` is ahead of the store or older than consumed rows still
            kept; more ready groups than the capacity.
    """
    t0 = time.perf_counter()
    new_config = config
    if sampler is not None or max_buffered_rollouts is not None:
        new_config = BufferConfig.from_dict({
            **config.to_dict(),
            "sampler": create_sampler(sampler).config() if sampler is not None else config.sampler.config(),
            "max_buffered_rollouts": max_buffered_rollouts or config.max_buffered_rollouts})
    timings: dict[str, float] = {}

    def txn_fn(txn: Txn) -> RecoveryPlan:
        look, stored_rows = lookups, proven_rows
        if look is None:
            # The proof runs inside this write transaction, so with the store's writer lock held
            # (kvckpt's flock keeps out every other writable handle, Store.write's lock every
            # other thread, liblmdb's writer mutex the rest) and before this transaction writes
            # anything: no commit can land between the proof and ``check``, so the pages it
            # proves are exactly the committed snapshot that ``check`` and recovery read. It
            # stands in for the lookups only, so it reads what they read, the tree pages, not
            # the header of every row's first page (the live file was never structure-checked
            # before liblmdb mapped it: it is the store's own, crash-consistent file). The row
            # keys it read are the snapshot's, so the verifier takes them instead of iterating
            # the rows (which on a cold cache reads a page of every row). It reads the file
            # through the handle's own descriptor, never by path: a file renamed over the path
            # since the store was opened is not the one liblmdb reads, and proving it would
            # skip the lookups of this one.
            ts = time.perf_counter()
            stored_rows = proven_keys(store.data_fd(), txn.layout.region("rows", b"")[1], headers=False)
            look = stored_rows is None
            timings["structure"] = time.perf_counter() - ts
        row_keys = None if stored_rows is None else [txn.layout.logical("rows", key) for key in stored_rows]
        tv = time.perf_counter()
        report = check(txn, checksums=checksums, deep=deep, lookups=look, row_keys=row_keys)
        timings["validate"] = time.perf_counter() - tv
        if not report.ok:
            raise VerificationFailed(repr(store.path), report.problems)
        t = Tables(txn)
        st = t.state()
        target = st["trainer_version"] if resume_version is None else int(resume_version)
        rollback = resume_version is not None  # the run continues from ``target``'s weights
        if target > st["trainer_version"]:
            raise RecoveryError(f"cannot resume at version {target}: the store has only reached "
                                f"{st['trainer_version']} (is this the right store for that model checkpoint?)")
        if target < st["drop_floor"]:
            raise RecoveryError(f"cannot resume at version {target}: rows consumed before version "
                                f"{st['drop_floor']} were dropped after later checkpoints; resume from a "
                                f"checkpoint at version >= {st['drop_floor']}")
        plan = RecoveryPlan(resume_version=target)
        plan.groups_returned_to_ready = _return_to_ready(t, st, target)
        plan.groups_on_destroyed_lineage = _fork_ready(t, target) if rollback else 0
        st["trainer_version"] = target
        if rollback:
            st["weight_version"] = target
        # Checkpoints past the resume point belong to the abandoned run: they must not count
        # towards ``durable_checkpoints`` (nor hide the resumed run's own checkpoints).
        st["durable"] = [v for v in st["durable"] if v <= target]
        if new_config is not config:
            plan.changes = _switch_config(t, st, config, new_config, target)
        if st["ready"] > new_config.max_buffered_rollouts:
            if max_buffered_rollouts is not None:
                raise RecoveryError(f"{st['ready']} ready groups exceed the requested max_buffered_rollouts "
                                    f"{new_config.max_buffered_rollouts}; choose a larger capacity")
            plan.changes.append(f"{st['ready']} ready groups exceed max_buffered_rollouts "
                                f"{new_config.max_buffered_rollouts}: admission waits until training drains them")
        entries = t.entries()
        st["timeline"] = plan.timeline = meta.new_timeline()
        for entry in entries:
            missing = entry.lease(store.store_id).missing
            lengths = [durable_length(t, entry.group_id, index) for index in missing]
            stamps = _restamp(entry, target, kept=bool(entry.siblings) or any(lengths),
                              durable=durable_newest(t, entry.group_id) if any(lengths) else None) if rollback else {}
            plan.prompts_restamped += "start_weight" in stamps
            plan.groups_on_destroyed_lineage += stamps.get("lineage_fork") is not None
            bumped = LedgerEntry.from_dict({**entry.to_dict(), "attempt": entry.attempt + 1,
                                            "timeline": st["timeline"], **stamps})
            t.replace_entry(bumped, was=entry)
            plan.leases.append(bumped.lease(store.store_id))
            plan.siblings_reused += len(entry.siblings)
            plan.siblings_rerun += len(missing)
            plan.progress_samples += sum(length > 0 for length in lengths)
            plan.progress_tokens += sum(lengths)
        plan.groups_unfinished_found = plan.groups_redispatched = len(entries)
        plan.groups_complete_restored = st["ready"]
        plan.dispatch_index = st["dispatch_index"]
        st["counters"]["redispatched"] += len(entries)
        t.put_state(st)
        stamp = t.stamp()
        if stamp is not None and stamp.get("trainer_version") == target:
            plan.trainer_state = stamp.get("trainer_state")
            plan.checkpoint_id = stamp.get("checkpoint_id")
        elif stamp is not None:
            plan.changes.append(f"the last checkpoint stamp (version {stamp.get('trainer_version')}) is not the "
                                f"resume version {target}: its trainer_state is not returned")
        plan.dataloader_state = t.dataloader_state()
        return plan

    plan = store.write(txn_fn)
    plan.timings.update(timings, recover=time.perf_counter() - t0)
    log.info("%s: recovered to trainer version %d on timeline %s: %d prompts to redispatch (%d siblings reused), "
             "%d groups returned to ready, %d ready in all, %d prompts restamped, %d groups on a destroyed lineage%s",
             store.path, plan.resume_version, plan.timeline, plan.groups_redispatched, plan.siblings_reused,
             plan.groups_returned_to_ready, plan.groups_complete_restored, plan.prompts_restamped,
             plan.groups_on_destroyed_lineage, "".join(f"; {c}" for c in plan.changes))
    return plan, new_config


def _return_to_ready(t: Tables, st: dict[str, Any], version: int) -> int:
    moved = 0
    for state_name, gid in t.held_since(version):
        group = t.group(gid)
        if group is None or group.state != state_name:
            raise RecoveryError(f"the {state_name} index points to {gid!r}, which is not {state_name}")
        t.put_group(GroupInfo.from_dict({**group.to_dict(), "state": READY, "claimed_step": None,
                                         "consumed_step": None}), was=group)
        st["ready"] += 1
        if state_name == CLAIMED:
            st["claimed"] -= 1
        moved += 1
    return moved


def _fork_ready(t: Tables, version: int) -> int:
    """Every ready group with a token newer than ``version`` (its newest weight version,
    ``lineage_newest`` or else ``start_weight``) holds work of weights the rollback to ``version``
    destroyed: its ``lineage_fork`` becomes ``version`` (or stays lower); returns how many."""
    forked = 0
    for group in t.resolve(t.ready_ids()):
        if group.newest_weight > version:
            fork = version if group.lineage_fork is None else min(group.lineage_fork, version)
            t.put_group(GroupInfo.from_dict({**group.to_dict(), "lineage_fork": fork}), was=group)
            forked += 1
    return forked


def _restamp(entry: LedgerEntry, version: int, kept: bool, durable: int | None) -> dict[str, Any]:
    """The stamps of an in-flight prompt redispatched by a recovery to ``version``; ``durable`` is
    the newest weight version of its durable token progress (``None`` without any).

    A stamp newer than ``version`` names weights the rollback destroyed. With nothing kept (no
    committed sibling, no durable token), every row is generated after the recovery, by the
    resumed weights: the stamp becomes ``version``. Kept work newer than ``version`` (its newest:
    the entry's ``lineage_newest``, its stamp, its durable tokens'; a forked entry's newest stays
    the one its fork froze) was generated by the destroyed weights: the stamps stay, its
    ``lineage_fork`` becomes ``version`` (or stays lower) and ``lineage_newest`` that newest, so the
    finished group's staleness counts the destroyed branch. Anything else is left as it is.
    """
    if entry.start_weight > version and not kept:
        return {"start_weight": version, "lineage_fork": None, "lineage_newest": None}
    newest = entry.newest_weight
    if entry.lineage_fork is None and durable is not None:
        newest = max(newest, durable)
    if newest <= version:
        return {}
    return {"lineage_fork": version if entry.lineage_fork is None else min(entry.lineage_fork, version),
            "lineage_newest": newest if newest > entry.start_weight else None}


def _switch_config(t: Tables, st: dict[str, Any], old: BufferConfig, config: BufferConfig, version: int) -> list[str]:
    changes = []
    if old.sampler.config() != config.sampler.config():
        changes.append(f"sampler {old.sampler.config()} -> {config.sampler.config()}")
    if old.max_buffered_rollouts != config.max_buffered_rollouts:
        changes.append(f"max_buffered_rollouts {old.max_buffered_rollouts} -> {config.max_buffered_rollouts}")
    if config.sampler.stamps_target_step:
        # Unstamped ready and in-flight groups get consecutive steps in dispatch order,
        # groups_per_step each: a step stamped with more groups than it trains would leave the
        # surplus behind the cursor, where the first evict discards generated work.
        ready = [g for g in t.resolve(t.ready_ids()) if g.target_step is None]
        inflight = [e for e in t.entries() if e.target_step is None]
        order = sorted([*ready, *inflight], key=lambda record: record.seq)
        steps = {record.group_id: version + i // config.groups_per_step for i, record in enumerate(order)}
        for group in ready:
            t.put_group(GroupInfo.from_dict({**group.to_dict(), "target_step": steps[group.group_id]}), was=group)
        for entry in inflight:
            t.replace_entry(LedgerEntry.from_dict({**entry.to_dict(), "target_step": steps[entry.group_id]}),
                            was=entry)
        if order:
            last = version + (len(order) - 1) // config.groups_per_step
            st["dispatch_index"] = max(st["dispatch_index"], last)
            changes.append(f"stamped {len(ready)} ready groups and {len(inflight)} in-flight prompts with target "
                           f"steps {version}..{last} ({config.groups_per_step} per step, in dispatch order)")
    if config.sampler.gate_window is not None and st["dispatch_index"] < version - 1:
        changes.append(f"dispatch_index {st['dispatch_index']} -> {version - 1} (gated sampler)")
        st["dispatch_index"] = version - 1
    t.put_config(config.to_dict())
    return changes
