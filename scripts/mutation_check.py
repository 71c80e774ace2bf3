"""Apply named mutations (plausible bugs) to a scratch copy of the tree and show which tests kill them.

A mutation is ``(name, file, old text, new text, tests)``: ``old`` must occur in ``file`` exactly
``count`` times (default 1; ``None``: at least once), every occurrence is replaced by ``new``, and
the named tests (pytest node ids or files) run against the copy. The outcome is

* ``killed``: the tests failed on the mutant (pytest exit status 1);
* ``survived``: the tests passed on it: the net has a hole (aimed tests that were skipped beside
  the ones that passed are named in the detail);
* ``not run``: every aimed test was skipped (a peer this interpreter lacks: NeMo-Gym, vLLM's server
  without ``KVCKPT_VLLM_PYTHON``...), so the mutant was not tried; the detail is pytest's skip reason;
* ``error``: pytest could not run them (collection error, timeout, no test collected...);
* ``n/a``: ``old`` does not occur ``count`` times (the code changed: update the mutation).

The tree is never touched: the copy is the work tree's tracked and unignored files (or a
commit, ``--rev``) under a temporary directory. Tests run there with ``PYTHONPATH`` set to the
copy, and before any test runs the script checks that ``kvckpt`` (and the module of every
mutated file) imports from the copy, not from an editable install of the original tree. The
unmutated copy must pass every named test first (the baseline), or nothing is reported.

Usage::

    .venv/bin/python scripts/mutation_check.py                      # the built-in list
    .venv/bin/python scripts/mutation_check.py --only redispatch-keeps-attempt
    .venv/bin/python scripts/mutation_check.py --mutations my.json  # a JSON list of mutation objects
    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py --require-all      # a mutation not run fails too
    # the verl adapter's mutations, whose tests run in .venv-verl only:
    .venv-verl/bin/python scripts/mutation_check.py --python "$PWD/.venv-verl/bin/python" --mutations M.json
    # with M.json = scripts/mutations_verl.json

A JSON mutation object has the keys ``name``, ``file``, ``old``, ``new``, ``tests`` and optionally
``count``, for example::

    [{"name": "fence-ignores-timeline", "file": "kvckpt/buffer.py",
      "old": "if lease.timeline != timeline:", "new": "if False:", "tests": ["tests/core/test_fencing.py"]}]

The exit status is 0 if every mutation was killed or not run (1 if one survived, errored or is
``n/a``; with ``--require-all`` also if one was not run; 2 if the baseline fails). ``--root DIR``
mutates another git work tree than this one (the checker's own test uses a tiny one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NET = "tests/core/test_net.py"
LAZY = "tests/core/test_lazy_rows.py"
STRUCTURE = "tests/durability/test_structure.py"
RAY_STEP = "tests/integrations/ray/test_ray_progress_step.py"
PARK = ('                calls["step_calls_parked"] += 1\n                try:\n'
        "                    await asyncio.wait_for(order.ready.wait_for(lambda: ")
#: Folders the build maps into the ``kvckpt`` package (pyproject's ``package-dir``).
MAPPED = {"integrations": "kvckpt/integrations", "reference": "kvckpt/reference", "tools": "kvckpt/tools"}


@dataclass(frozen=True)
class Mutation:
    """One plausible bug: replace ``old`` (``count`` occurrences) by ``new`` in ``file``; ``tests``
    must fail on the result."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    count: int | None = 1

    @classmethod
    def from_dict(cls, doc: dict) -> Mutation:
        """Build from a JSON object with the field names (``tests`` a list)."""
        return cls(doc["name"], doc["file"], doc["old"], doc["new"], tuple(doc["tests"]), doc.get("count", 1))


@dataclass
class Outcome:
    """What running a mutation's tests on its mutant gave."""

    mutation: Mutation
    verdict: str
    seconds: float = 0.0
    detail: str = ""
    failed: list[str] = field(default_factory=list)


#: The bugs issue 16 lists as caught only by chance before ``tests/core/test_net.py``, and the lazy row
#: checks on read that restore relies on (issue 28).
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("row-prefix-without-separator", "kvckpt/storage/keys.py",
             'return group_key(group_id) + b"\\x00"', "return group_key(group_id)",
             (f"{NET}::test_operations_on_a_group_leave_groups_whose_ids_extend_its_id_untouched",)),
    Mutation("checkpoint-copies-live-state", "kvckpt/storage/store.py",
             "compact=True, txn=txn.raw)", "compact=True)",
             (f"{NET}::test_a_commit_after_the_stamp_stays_out_of_the_checkpoint",
              "tests/core/test_store.py::test_copy_snapshot_is_a_consistent_point_in_time"), count=None),
    Mutation("checkpoint-snapshot-taken-at-copy-time", "kvckpt/durability/checkpoint.py",
             "store.copy_snapshot(fd, snapshot.txn)",
             "store.read(lambda live: store.copy_snapshot(fd, live))",
             (f"{NET}::test_a_commit_after_the_stamp_stays_out_of_the_checkpoint",), count=None),
    Mutation("checkpoint-page-copy-takes-live-meta", "kvckpt/storage/store.py",
             "os.pwrite(fd, _twin_metas(snapshot.metas, psize), 0)",
             'os.pwrite(fd, _twin_metas(open(self.path, "rb").read(2 * psize), psize), 0)',
             (f"{NET}::test_a_commit_after_the_stamp_stays_out_of_the_checkpoint",
              "tests/core/test_store.py::test_copy_pinned_is_the_pinned_state_page_for_page_whatever_commits_after_it")),
    Mutation("checkpoint-page-copy-keeps-the-older-meta", "kvckpt/storage/store.py",
             "os.pwrite(fd, _twin_metas(snapshot.metas, psize), 0)", "os.pwrite(fd, snapshot.metas, 0)",
             ("tests/durability/test_checkpoint_meta_damage.py",)),
    Mutation("checkpoint-keeps-unused-bytes", "kvckpt/durability/checkpoint.py",
             "            self.zeroed += os.pwrite(self.fd, self.zeros[:min(ZERO_CHUNK, offset + length - pos)]"
             ", pos)\n",
             "            self.zeroed += min(ZERO_CHUNK, offset + length - pos)\n",
             ("tests/durability/test_checkpoint_free_pages.py",)),
    Mutation("checkpoint-without-reservation", "kvckpt/durability/checkpoint.py",
             "        reservation = _reserve(partial, dest)\n",
             "        reservation = os.open(partial, os.O_RDWR | os.O_CREAT, FILE_MODE)\n",
             ("tests/core/test_value_store.py::test_a_value_store_checkpoint_takes_the_reservation_first",)),
    Mutation("value-store-checkpoint-keeps-unused-bytes", "kvckpt/durability/checkpoint.py",
             "            self.zeroed += os.pwrite(self.fd, self.zeros[:min(ZERO_CHUNK, offset + length - pos)]"
             ", pos)\n",
             "            self.zeroed += min(ZERO_CHUNK, offset + length - pos)\n",
             ("tests/core/test_value_store.py::test_a_value_store_checkpoint_is_a_page_copy_that_carries_nothing_but_its"
              "_snapshot",)),
    Mutation("value-store-write-skips-its-fence", "kvckpt/values/records.py",
             "    check_fence(txn, path, fence)\n    for key in deletes:", "    for key in deletes:",
             ("tests/core/test_value_store.py::test_a_fenced_write_is_refused_inside_its_transaction_and_leaves_everything",)),
    # run with --python .venv-verl/bin/python (the verl ledger's tests need verl)
    Mutation("verl-ledger-write-unfenced", "integrations/verl/ledger.py",
             "self._values.write(keys, values, deletes, fence=(RUN_KEY, token))",
             "self._values.write(keys, values, deletes, fence=None)",
             ("tests/integrations/verl/test_verl_resume.py::test_a_superseded_run_can_neither_checkpoint_nor_load_nor_resume",)),
    Mutation("value-store-clear-ignores-write-id", "kvckpt/values/records.py",
             "if raw is None or (wid is not None and write_id_of(raw, key) != wid):", "if raw is None:",
             ("tests/campaigns/test_campaign.py::test_a_short_campaign_crashes_the_value_store_beside_the_buffer",)),
    Mutation("async-facade-loses-claim", "kvckpt/buffer/aio.py",
             '_install(AsyncReplayBuffer, offered_by("async", GENERATED))',
             '_install(AsyncReplayBuffer, [r for r in offered_by("async", GENERATED) if r.name != "claim"])',
             ("tests/core/test_surfaces.py::test_every_surface_offers_every_operation_as_its_row_says",)),
    Mutation("ray-actor-reshapes-release-claims", "integrations/ray/actor.py",
             "        for p in reference.parameters.values()]",
             "        for p in reference.parameters.values()"
             " if not (name == 'release_claims' and p.name == 'group_ids')]"
             " + ([inspect.Parameter('groups', inspect.Parameter.POSITIONAL_OR_KEYWORD)] if name == 'release_claims'"
             " else [])",
             ("tests/core/test_surfaces.py::test_every_surface_offers_every_operation_as_its_row_says",)),
    Mutation("finish-step-two-transactions", "kvckpt/buffer/replay_buffer.py",
             "        return self._write(lambda t: training.finish_step(t, self.config, weight_version))\n",
             "        version = self._write(lambda t: training.finish_step(t, self.config, weight_version))\n"
             '        self._write(lambda t: t.put_state({**t.state(), "trainer_version": version}))\n'
             "        return version\n",
             (f"{NET}::test_every_transition_is_one_write_transaction",)),
    Mutation("redispatch-keeps-attempt", "kvckpt/transitions/inflight.py",
             '"attempt": entry.attempt + 1,', '"attempt": entry.attempt,',
             (f"{NET}::test_redispatch_fences_the_previous_lease",)),
    Mutation("recover-keeps-weight-version", "kvckpt/durability/recovery.py",
             '        st["weight_version"] = target\n', "",
             (f"{NET}::test_recover_rolls_the_weight_version_back_with_the_trainer",)),
    # restore() does not read rows (issue 28): read_batch's checks are the only ones before training
    Mutation("read-skips-group-digest", "kvckpt/buffer/batch.py", "    check_group_rows(infos, raw)\n", "",
             (f"{LAZY}::test_a_crafted_row_fails_at_read_and_verify_deep_and_the_trainer_goes_on"
              "[changed-under-valid-checksum]",)),
    Mutation("read-skips-schema-check", "kvckpt/buffer/batch.py", "            schema.check_record(record, where)\n",
             "            pass\n",
             (f"{LAZY}::test_a_crafted_row_fails_at_read_and_verify_deep_and_the_trainer_goes_on[wrong-dtype]",)),
    # restore's structure check is the fast proof (issue 28): what it skips, liblmdb trusts
    Mutation("structure-skips-overflow-length", "kvckpt/durability/structure.py",
             "        _need(bool(np.all(_u16(h, 12) + (_u16(h, 14) << 16) == need)))\n", "",
             (f"{STRUCTURE}::test_every_crafted_file_the_fast_proof_accepts_lmdb_verify_accepts",)),
    Mutation("structure-skips-tiling", "kvckpt/durability/structure.py",
             "        _need(bool(np.all(starts[1:] == ends[:-1])))\n", "",
             (f"{STRUCTURE}::test_no_damaged_page_is_proven_sound_unless_lmdb_verify_accepts_it",)),
    Mutation("structure-skips-separator-bounds", "kvckpt/durability/structure.py",
             "                _need(not n or ((low is None", "                bool(not n or ((low is None",
             ("tests/durability/test_corruption_fuzz.py::test_a_damaged_branch_separator_is_refused",)),
    Mutation("restore-names-private-copy", "kvckpt/durability/checkpoint.py",
             "            _name_user_file(exc, tmp, checkpoint_file)\n", "            pass\n",
             (f"{STRUCTURE}::test_restore_refuses_a_bad_page_before_liblmdb_maps_it_naming_the_file_passed"
              "[foreign-lmdb]",)),
)

#: The mechanisms issue 29 found no test aimed at (each killed by one deterministic test).
MUTATIONS += (
    Mutation("group-commit-acks-before-durable", "kvckpt/storage/group_commit.py",
             "        fns = [p.fn for p in batch]\n",
             "        def acked(p):\n"
             "            def run(txn):\n"
             "                result = p.fn(txn)\n"
             "                with self._lock:\n"
             "                    p.result, p.done = result, True\n"
             "                    self._wake_done()\n"
             "                return result\n"
             "            return run\n"
             "        fns = [acked(p) for p in batch]\n",
             ("tests/core/test_group_commit.py::"
              "test_inside_a_batch_nothing_acknowledged_is_missing_from_another_process_snapshot",)),
    Mutation("format3-suffixes-swapped", "kvckpt/storage/layout.py",
             'SUFFIXES = {"groups": b"\\x00", "ledger": b"\\x01",',
             'SUFFIXES = {"groups": b"\\x01", "ledger": b"\\x00",', ("tests/durability/test_format_pinned.py",)),
    Mutation("sparse-check-disabled", "kvckpt/durability/safe_open.py",
             "    if holes > max(MAX_HOLE_BYTES, used // 4):", "    if False:",
             ("tests/durability/test_sparse_refusal.py",)),
    Mutation("makedirs-skips-parent-fsync", "kvckpt/storage/store.py",
             "        fsync_dir(os.path.dirname(directory))\n", "",
             ("tests/campaigns/test_powercut.py::test_a_new_store_in_new_directories_survives_a_power_cut",)),
)

#: Issue 35: one realistic slip per promise of token progress, the lazy row checks, verify's new
#: checks and the TRL queue, each killed by the deterministic test aimed at that promise.
PROGRESS, PROMISES = "kvckpt/transitions/progress.py", "tests/core/test_progress_promises.py"
VERIFY, VERIFY_TESTS = "kvckpt/durability/verify.py", "tests/durability/test_verify_progress.py"
READS = "tests/core/test_read_promises.py"
MUTATIONS += (
    Mutation("progress-future-reads-weights-only", "kvckpt/transitions/progress_step.py",
             'newest = max(st["trainer_version"], st["weight_version"])', 'newest = st["weight_version"]',
             (f"{PROMISES}::test_rollout_weights_behind_the_trainer_a_chunk_up_to_the_trainer_version_is_not_future",)),
    Mutation("progress-oldest-is-first-chunk", PROGRESS, "    return int(versions.min()), int(versions.max())\n",
             "    return int(versions[0]), int(versions.max())\n",
             (f"{PROMISES}::test_start_weight_is_the_oldest_when_the_rollout_weights_go_down_mid_sample",)),
    Mutation("abort-drops-the-entrys-fork", "kvckpt/transitions/inflight.py",
             "reason=reason, timeline=entry.timeline, lineage_fork=entry.lineage_fork,\n",
             "reason=reason, timeline=entry.timeline,\n",
             (f"{PROMISES}::test_an_aborted_forked_entry_keeps_its_fork_in_the_tombstone",)),
    Mutation("commit-forgets-sibling-token-weight", "kvckpt/transitions/commit.py",
             "oldest = [w for w in (entry.token_weight, *(lo for", "oldest = [w for w in (None, *(lo for",
             (f"{PROMISES}::test_a_sibling_commits_oldest_tokens_are_not_forgotten_by_the_next_commit",)),
    Mutation("progress-bound-off-by-one", PROGRESS, "    if start + len(ids) > schema.max_tokens:\n",
             "    if start + len(ids) >= schema.max_tokens:\n",
             (f"{PROMISES}::test_a_prefix_of_exactly_max_tokens_is_accepted_and_one_more_token_is_refused",)),
    Mutation("progress-read-skips-identity", PROGRESS,
             '    if (meta.get("group_id"), meta.get("index"), meta.get("start")) != (group_id, index, start) \\\n'
             "            or type(length) is not int",
             "    if type(length) is not int",
             (f"{PROMISES}::test_a_chunk_stored_under_another_key_is_corrupt_on_the_live_read_path",)),
    Mutation("progress-length-skips-identity", PROGRESS,
             '            or (meta.get("group_id"), meta.get("index"), meta.get("start")) != (group_id, index, start):',
             '            or meta.get("start") != start:',
             (f"{PROMISES}::test_a_chunk_stored_under_another_key_is_corrupt_on_the_live_read_path[another-sample]",)),
    Mutation("progress-delete-index-0-is-the-group", "kvckpt/tables/access.py",
             "        prefix = keys.row_prefix(group_id) if index is None else keys.row_key(group_id, index)\n"
             '        return self.txn.delete_prefix("progress", prefix)\n',
             "        prefix = keys.row_prefix(group_id) if not index else keys.row_key(group_id, index)\n"
             '        return self.txn.delete_prefix("progress", prefix)\n',
             (f"{PROMISES}::test_committing_one_sample_leaves_every_siblings_progress_as_it_was",)),
    Mutation("verify-orphan-skips-committed-sibling", VERIFY,
             'if entry is None or index >= entry["group_size"] or index in entry["siblings"]:',
             'if entry is None or index >= entry["group_size"]:',
             (f"{VERIFY_TESTS}::test_progress_of_a_committed_sibling_is_orphan_progress",)),
    Mutation("verify-progress-reports-only-gaps", VERIFY, "        if ends.get((gid, index), 0) != start:\n",
             "        if ends.get((gid, index), 0) < start:\n",
             (f"{VERIFY_TESTS}::test_overlapping_chunks_are_reported",)),
    Mutation("progress-read-skips-contiguity", PROGRESS, '        if r.meta["start"] != end:\n',
             '        if r.meta["start"] > end:\n',
             (f"{VERIFY_TESTS}::test_no_reader_takes_an_overlap_for_a_prefix",)),
    Mutation("verify-state-fields-optional", VERIFY,
             'if not _check_ints(state, "meta/state", _STATE_INTS, report, required=True):',
             'if not _check_ints(state, "meta/state", _STATE_INTS, report, required=False):',
             (f"{VERIFY_TESTS}::test_a_dropped_or_mistyped_state_field_is_malformed_in_verify_and_refused_by_restore",)),
    Mutation("read-skips-row-index-identity", "kvckpt/buffer/batch.py",
             'if record.meta.get("group_id") != gid or record.meta.get("index") != index:',
             'if record.meta.get("group_id") != gid:',
             (f"{READS}::test_a_row_naming_another_index_of_its_group_is_refused_even_with_a_matching_digest",)),
    Mutation("read-limits-ignore-pins", "kvckpt/buffer/batch.py", "        limits = schema.limits(pins)\n",
             "        limits = schema.limits()\n",
             (f"{READS}::test_a_row_field_larger_than_max_tokens_within_its_pin_reads_back",)),
    Mutation("limits-row-pin-scaled-by-max-tokens", "kvckpt/storage/schema.py",
             "count = self.max_tokens if shape is None else prod(shape)",
             "count = self.max_tokens * prod(shape or ())",
             (f"{READS}::test_a_row_field_one_element_past_its_pin_is_refused",)),
    Mutation("trl-queue-evicts-at-the-bound", "integrations/trl/queue.py",
             "if self._clock.staleness(info.lineage_weight) > self._clock.max_staleness:",
             "if self._clock.staleness(info.lineage_weight) >= self._clock.max_staleness:",
             ("tests/integrations/trl/test_trl_queue_staleness.py",)),
    Mutation("trl-staleness-rounds-down", "integrations/trl/queue.py",
             "return max(0, math.ceil(behind / self.weight_sync_steps))",
             "return max(0, behind // self.weight_sync_steps)",
             ("tests/integrations/trl/test_trl_queue_staleness.py",)),
)


FLEET = "tests/integrations/ray/test_ray_fleet.py"
#: A fleet streaming progress through the buffer actor on a multi-node Ray cluster (issue 36): what
#: a rollout node's, the store actor's and the owner node's death may not cost, each on a real cluster.
MUTATIONS += (
    Mutation("step-resend-of-landed-chunk-refused", "kvckpt/transitions/progress_step.py",
             "            if same_chunk(rows, s, c):\n                continue",
             "            if False:\n                continue", ("tests/core/test_progress_step.py",)),
    Mutation("progress-retry-of-landed-chunk-refused", "kvckpt/transitions/progress_step.py",
             "            if same_chunk(rows, s, c):\n                continue",
             "            if False:\n                continue",
             ("tests/core/test_progress.py::test_chunks_append_a_retry_is_a_noop_and_a_conflict_or_gap_is_refused",)),
    Mutation("fleet-restart-leaves-leases-valid", "kvckpt/durability/recovery.py",
             '{**entry.to_dict(), "attempt": entry.attempt + 1,\n'
             '                                            "timeline": st["timeline"], **stamps})',
             "{**entry.to_dict(), **stamps})",
             (f"{FLEET}::test_the_store_actor_killed_mid_stream_loses_nothing_acknowledged_and_applies_nothing_twice",)),
    Mutation("fleet-progress-unfenced", "kvckpt/transitions/progress.py",
             '    fence(lease, store_id, entry.timeline, entry.attempt, "in flight", _WHAT)\n'
             "    check_against_entry(lease, entry, _WHAT)\n", "",
             (f"{FLEET}::test_a_rollout_node_killed_mid_stream_loses_at_most_one_interval",)),
    Mutation("fleet-actor-progress-empty", "integrations/ray/actor.py",
             "        return progress_to_dict(await self._abuf.progress(group_id))\n",
             "        return progress_to_dict({})\n",
             (f"{FLEET}::test_a_rollout_node_killed_mid_stream_loses_at_most_one_interval",)),
    Mutation("fleet-client-escapes-unschedulable-owner", "integrations/ray/client.py",
             "        except (RayActorError, ActorUnschedulableError, GetTimeoutError):\n",
             "        except (RayActorError, GetTimeoutError):\n",
             (f"{FLEET}::test_the_owners_node_dies_and_another_node_restores_what_inspect_counted",)),
    Mutation("fleet-inspect-counts-chunk-lengths-only", "tools/inspect.py",
             '            tokens += int.from_bytes(key[-8:], "big") + length\n', "            tokens += length\n",
             (f"{FLEET}::test_the_owners_node_dies_and_another_node_restores_what_inspect_counted",)),
)

#: Issue 40: the demo parks its rollout mid-way through long completions, scored answer by answer.
_DEMO = "tests/trainer/test_functional_recovery.py::"
MUTATIONS += (
    Mutation("demo-parks-before-mid-way", "reference/demo.py",
             "max(s.generated for s in mine) >= self.park_tokens", "True",
             (f"{_DEMO}test_the_demo_parks_its_rollout_mid_way_through_generation",)),
    Mutation("repeat-reward-ignores-extra-words", "kvckpt/testing/fixtures/tiny_model.py",
             "        if len(words) > self.repeat:\n            return 0.0\n", "",
             (f"{_DEMO}test_the_default_demo_generates_long_completions_with_progress_well_inside_them",)),
)

#: Stamps after a rollback (issue 39): each rule of the version tree, killed by an aimed test.
LINEAGE = "tests/core/test_lineage.py"
TRL_STAMPS = "tests/integrations/trl/test_trl_stamps.py"
MUTATIONS += (
    Mutation("recovery-keeps-destroyed-stamp", "kvckpt/durability/recovery.py",
             '        return {"start_weight": version, "lineage_fork": None, "lineage_newest": None}\n',
             "        return {}\n", (LINEAGE,)),
    Mutation("lineage-weight-ignores-fork", "kvckpt/tables/records.py",
             "    if lineage_fork is None:\n        return start_weight\n",
             "    if True:\n        return start_weight\n", (LINEAGE,)),
    Mutation("recovery-forks-no-ready-group", "kvckpt/durability/recovery.py",
             "        plan.groups_on_destroyed_lineage = _fork_ready(t, target) if rollback else 0\n",
             "        plan.groups_on_destroyed_lineage = 0\n", (LINEAGE,)),
    Mutation("entry-fork-never-moves-down", "kvckpt/durability/recovery.py",
             '    return {"lineage_fork": version if entry.lineage_fork is None else min(entry.lineage_fork, version),',
             '    return {"lineage_fork": version if entry.lineage_fork is None else entry.lineage_fork,', (LINEAGE,)),
    Mutation("commit-drops-entry-fork", "kvckpt/transitions/commit.py",
             "timeline=entry.timeline, lineage_fork=entry.lineage_fork,\n", "timeline=entry.timeline,\n", (LINEAGE,)),
    Mutation("verify-allows-fork-at-stamp", "kvckpt/durability/verify.py",
             "    if fork is not None and fork >= (start if newest is None else newest):", "    if False:",
             ("tests/durability/test_corruption_fuzz.py::test_verifier_flags_each_inconsistency",)),
    Mutation("verify-indexes-the-stamp", "kvckpt/durability/verify.py",
             "    return lineage_weight(start, fork, newest)", "    return start",
             ("tests/durability/test_corruption_fuzz.py::test_verifier_flags_each_inconsistency",)),
    Mutation("redispatch-restamps-forked-entry", "kvckpt/transitions/inflight.py",
             "if start_weight is None or entry.lineage_fork is not None", "if start_weight is None", (LINEAGE,)),
    Mutation("trl-queue-reads-step-numbers", "integrations/trl/queue.py",
             "self._clock.staleness(info.lineage_weight) >", "self._clock.staleness(info.start_weight) >",
             (f"{TRL_STAMPS}::test_a_kill_inside_trls_save_then_a_resume_from_the_previous_checkpoint_stamps_the_"
              "resumed_weights",)),
    Mutation("trl-presave-crash-refused", "integrations/trl/callback.py",
             "            plan = buffer.recover(resume_version=0)\n",
             '            raise RecoveryError("a crash before the first save")\n',
             (f"{TRL_STAMPS}::test_a_crash_before_the_first_save_recovers_the_live_store_at_step_0",)),
    Mutation("trl-presave-ignores-config", "integrations/trl/callback.py", "    if differ:\n", "    if False:\n",
             (f"{TRL_STAMPS}::test_a_crash_before_the_first_save_recovers_the_live_store_at_step_0",)),
)

TRL_SERVER = "tests/integrations/trl/test_trl_server_request.py"
TRL_SERVER_CRASH = ("tests/integrations/trl/test_trl_server.py::"
                    "test_kill_mid_generation_resumes_each_sample_from_its_durable_prefix",)
#: TRL's vLLM-server path (issue 39): TRL's own request, streamed; a TRL row held against its
#: durable prefix; a redispatched sample resumed from prompt + prefix with the remaining budget.
MUTATIONS += (
    Mutation("trl-server-request-drops-token-ids", "integrations/trl/server.py",
             '"n": 1, "return_token_ids": True,', '"n": 1,',
             (f"{TRL_SERVER}::test_the_request_is_trls_own_streamed",)),
    Mutation("trl-server-event-logprobs-unchecked", "integrations/trl/server.py",
             "    if len(lps) != len(ids):\n", "    if False:\n",
             (f"{TRL_SERVER}::test_stream_events_are_read_as_vllm_writes_them",)),
    Mutation("progress-ignores-completion-mask", "kvckpt/transitions/progress.py",
             'MASK_FIELDS = ("token_mask", "completion_mask")', 'MASK_FIELDS = ("token_mask",)',
             (f"{TRL_SERVER}::test_a_trl_row_is_held_against_its_durable_prefix_by_its_completion_mask",)),
    # run with --python "$PWD/.venv-vllm/bin/python" and KVCKPT_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" (the
    # copy has no .venv-vllm: without it the server test skips and every mutant survives)
    Mutation("trl-server-resume-drops-prefix", "integrations/trl/server.py",
             "self.payload(seq.prompt_ids + seq.prefix_ids + tuple(new[i]), left, temperature)",
             "self.payload(seq.prompt_ids + tuple(new[i]), left, temperature)", TRL_SERVER_CRASH),
    Mutation("trl-server-resume-full-budget", "integrations/trl/server.py",
             "self.payload(seq.prompt_ids + seq.prefix_ids + tuple(new[i]), left, temperature)",
             "self.payload(seq.prompt_ids + seq.prefix_ids + tuple(new[i]), max_tokens, temperature)",
             TRL_SERVER_CRASH),
    Mutation("trl-worker-ignores-prefixes", "integrations/vllm/stream.py",
             "    return sink.progress(lease) if lease.attempt > 0 else {}", "    return {}", TRL_SERVER_CRASH),
)

BACKGROUND = "tests/integrations/vllm/test_progress_background.py"
#: The recorder's background flusher (issue 39, the TRL server path): tokens that arrive during a
#: flush coalesce into the next one; generation's end (and an abort's tail) is durable before the
#: commit; a fenced flush stops its lease; a failed flush reaches the stream's caller.
MUTATIONS += (
    Mutation("progress-flush-drops-coalesced-tokens", "integrations/common/progress.py",
             "                del t.ids[:n], t.logprobs[:n], t.versions[:n]\n",
             "                t.ids, t.logprobs, t.versions = [], [], []\n",
             (f"{BACKGROUND}::test_tokens_that_arrive_during_a_flush_coalesce_into_the_next_one",)),
    Mutation("progress-close-stops-before-due-chunks", "integrations/common/progress.py",
             "                self._kicked = False\n",
             "                if self._closing is not None:\n                    return\n"
             "                self._kicked = False\n",
             (f"{BACKGROUND}::test_close_writes_a_chunk_that_fell_due_after_the_last_step",)),
    Mutation("progress-abort-tail-not-written", "integrations/common/progress.py",
             "self._due(self.clock(), self._closing is True)", "self._due(self.clock(), False)",
             (f"{BACKGROUND}::test_an_aborted_stream_makes_its_tail_durable_first",)),
    Mutation("stream-leases-abort-skips-close", "integrations/vllm/worker.py",
             "            recorder.close(tail=True)\n", "            pass\n",
             (f"{BACKGROUND}::test_an_aborted_stream_makes_its_tail_durable_first",)),
    Mutation("stream-leases-returns-before-close", "integrations/vllm/worker.py",
             "    recorder.close()\n", "",
             (f"{BACKGROUND}::test_a_failed_flush_stops_every_sequence_and_stream_leases_raises_it",)),
    Mutation("progress-fenced-flush-keeps-generating", "integrations/common/progress.py",
             "            return {i for i, t in enumerate(self.tails) if t.refused is not None}",
             "            return set()",
             (f"{BACKGROUND}::test_a_fenced_flush_stops_the_lease_and_writes_nothing_more",)),
)

STEP = "tests/core/test_progress_step.py"
#: The progress step message (issue 36): retry dedupe, the per-sequence checks, per-sequence isolation.
MUTATIONS += (
    Mutation("step-retry-not-recognised-under-a-fenced-lease", "kvckpt/transitions/progress_step.py",
             "        if not isinstance(exc, ForeignLease) and s.chunks and all(", "        if False and all(",
             (f"{STEP}::test_a_resent_message_returns_the_same_results_after_the_owner_restarts",)),
    Mutation("step-retry-takes-other-bytes-for-a-replay", "kvckpt/transitions/progress_step.py",
             "same_chunk(rows, s, c) for c in s.chunks)",
             "rows.progress_chunk_of(s.row, c.start) is not None for c in s.chunks)",
             (f"{STEP}::test_a_resent_message_returns_the_same_results_after_the_owner_restarts",)),
    Mutation("step-offsets-end-unchecked", "kvckpt/transitions/progress_step.py",
             " or (i == n - 1 and b != total)", "",
             (f"{STEP}::test_a_token_array_longer_than_the_offsets_say_refuses_the_last_sequence_only",)),
    Mutation("step-offsets-overlap-unchecked", "kvckpt/transitions/progress_step.py",
             "bad = b <= a or a < ended or ", "bad = b <= a or ",
             (f"{STEP}::test_offsets_that_do_not_add_up_refuse_only_their_sequences",)),
    Mutation("step-max-tokens-unchecked", "kvckpt/transitions/progress_step.py",
             "elif bad or start + b - a > max_tokens or ", "elif bad or ",
             (f"{STEP}::test_a_chunk_past_max_tokens_is_refused_and_the_others_land",)),
    Mutation("step-one-refusal-stops-the-message", "kvckpt/transitions/progress_step.py",
             "        except KvckptError as exc:\n            out.append(exc)\n    return out\n",
             "        except KvckptError:\n            raise\n    return out\n",
             (f"{STEP}::test_the_transactions_refusals_are_per_sequence_too",
              f"{STEP}::test_a_lease_of_another_timeline_is_refused_and_the_other_sequences_land")),
    Mutation("step-durable-length-fast-path-trusts-any-last-chunk", "kvckpt/transitions/progress_step.py",
             "            if codec.meta_begins(value, meta_head(",
             "            if True or codec.meta_begins(value, meta_head(",
             (f"{STEP}::test_the_transactions_refusals_are_per_sequence_too",)),
    Mutation("step-fencing-judged-once-per-group-not-per-lease", "kvckpt/transitions/progress_step.py",
             "    held = id(s.lease)", "    held = gid",
             (f"{STEP}::test_fencing_is_judged_per_lease_and_a_committed_row_per_sequence",)),
    Mutation("step-committed-row-unchecked-after-the-leases-first-sequence", "kvckpt/transitions/progress_step.py",
             "        if s.index in entries[gid].siblings:", "        if False:",
             (f"{STEP}::test_fencing_is_judged_per_lease_and_a_committed_row_per_sequence",)),
    Mutation("vllm-bench-owner-acknowledges-without-recording", "benchmarks/vllm_progress_cost.py",
             "results = buf.record_progress_steps(frames) if buf is not None else", "results =",
             ("tests/tools/test_vllm_progress_cost.py",)),
    Mutation("step-stored-checksum-skips-the-body", "kvckpt/storage/codec.py",
             "        crc = zlib.crc32(data, crc)\n", "        pass\n",
             (f"{STEP}::test_encode_stored_is_byte_equal_to_encode_at_level_0",)),
    Mutation("step-message-lengths-unchecked", "kvckpt/storage/progress_message.py",
             "any(len(arrays[k]) != t for k in per_token)", "False",
             (f"{STEP}::test_a_malformed_message_is_refused_whole_and_writes_nothing",)),
    Mutation("step-client-resends-to-the-wrong-method", "integrations/ray/client.py",
             "                call.result = self._remote(call)",
             "                call.result = self.actor.commit_many.remote(call.payload)",
             ("tests/integrations/ray/test_ray_progress_step.py::test_a_killed_owner_keeps_each_acknowledged_sequence_once_and_a_resend"
              "_returns_the_same",)),
    Mutation("ray-step-order-tag-ignored", "integrations/ray/actor.py",
             "        if client is None:\n            return await self._abuf.record_progress_steps(",
             "        if True:\n            return await self._abuf.record_progress_steps(",
             (f"{RAY_STEP}::test_a_clients_later_step_that_arrives_first_waits_for_the_earlier_one",)),
    Mutation("ray-step-order-resend-waits-for-its-turn", "integrations/ray/actor.py",
             "            if seq > order.expected:\n" + PARK + "seq <= order.expected)",
             "            if seq != order.expected:\n" + PARK + "seq == order.expected)",
             (f"{RAY_STEP}::test_a_resend_below_the_expected_number_goes_at_once_and_is_answered_as_the_first_try",)),
    Mutation("ray-step-order-ignores-the-callers-oldest", "integrations/ray/actor.py",
             "            order.expected = max(order.expected, oldest)\n", "",
             (f"{RAY_STEP}::test_the_oldest_unacknowledged_call_is_where_a_caller_resumes",)),
    Mutation("ray-step-order-wait-expiry-not-caught", "integrations/ray/actor.py",
             "                except asyncio.TimeoutError:  # a predecessor was lost",
             "                except ZeroDivisionError:  # a predecessor was lost",
             (f"{RAY_STEP}::test_a_lost_predecessor_holds_a_call_back_only_for_the_bounded_wait_then_the_gap_is_refused",)),
    Mutation("ray-step-client-sends-no-order-tag", "integrations/ray/client.py",
             'if method == "record_progress_steps":  # tagged', "if False:  # tagged",
             (f"{RAY_STEP}::test_the_client_tags_each_progress_call_with_its_number_and_its_oldest_unacknowledged_one",)),
    Mutation("ray-step-client-oldest-is-the-call-itself", "integrations/ray/client.py",
             "oldest = min([call.seq] + [c.seq for c in self._in_flight if c.seq is not None])",
             "oldest = call.seq",
             (f"{RAY_STEP}::test_the_client_tags_each_progress_call_with_its_number_and_its_oldest_unacknowledged_one",)),
)


LAYERS_TEST = "tests/tools/test_layers.py"
#: The integrations' boundary (issue 37): only kvckpt's public API, however the import is spelt.
MUTATIONS += (
    Mutation("boundary-takes-any-kvckpt-module-as-public", "scripts/layers.py",
             'return len(head) > 1 and head[0] == "kvckpt" and head[1] in exports', "return True",
             (f"{LAYERS_TEST}::test_an_integration_reaching_past_the_public_api_is_caught",)),
    Mutation("boundary-ignores-dotted-imports", "scripts/layers.py",
             "for chain, line in module.dotted if not _public(chain, exports, module.name)]",
             "for chain, line in module.dotted if False]",
             (f"{LAYERS_TEST}::test_an_integration_reaching_past_the_public_api_is_caught",)),
)

CONFIGS = "tests/integrations/common/test_integration_configs.py"
#: The integrations' one config loader (issue 37): unknown keys refused, only the peer's own keys let through.
MUTATIONS += (
    Mutation("config-loader-ignores-unknown-keys", "integrations/common/config.py",
             "    check_keys(doc, fields, where)\n", "",
             (f"{CONFIGS}::test_transferqueue_refuses_an_unknown_key_in_its_client_and_its_bootstrap",
              f"{CONFIGS}::test_the_reference_trainer_refuses_an_unknown_key_naming_its_section_and_file")),
    Mutation("config-tq-lets-any-key-through", "integrations/transferqueue/client.py",
             "ignore=PEER_KEYS)", "ignore=config)",
             (f"{CONFIGS}::test_transferqueue_refuses_an_unknown_key_in_its_client_and_its_bootstrap",)),
    Mutation("config-nemo-rl-unchecked", "integrations/nemo_rl/config.py",
             "    check_keys(config, KNOWN_KEYS, where)\n", "",
             (f"{CONFIGS}::test_nemo_rl_refuses_an_unknown_key_naming_its_section_and_file",)),
)
# issue 48: one registry of store kinds, one durable write, stores created whole, the boundary over tools and
# benchmarks, the buffer's surfaces from one operation table
KINDS_TEST = "tests/tools/test_store_kinds.py"
CREATE_TEST = "tests/campaigns/test_interrupted_create.py"
MUTATIONS += (
    Mutation("store-kinds-ignore-markers", "kvckpt/durability/kinds.py",
             "if kind.name not in _FALLBACK and kind.marked(txn):", "if False:",
             (f"{KINDS_TEST}::test_a_third_kind_is_one_registration",)),
    Mutation("buffer-created-in-place", "kvckpt/buffer/replay_buffer.py",
             'with durable_replace(path, exclusive=True, leftovers=("-lock",)) as tmp, \\\n'
             "                    Store(tmp, create=True, **kwargs) as new:",
             "with Store(path, create=True, **kwargs) as new:",
             (f"{CREATE_TEST}::test_an_interrupted_replay_buffer_create_leaves_a_store_or_nothing",)),
    Mutation("value-store-created-in-place", "kvckpt/buffer/values.py",
             'durable_replace(path, exclusive=True, leftovers=("-lock",)) as tmp, Store(tmp, create=True) as new:',
             "Store(path, create=True) as new:",
             (f"{CREATE_TEST}::test_an_interrupted_value_store_create_leaves_a_store_or_nothing",)),
    Mutation("boundary-stops-at-integrations", "scripts/layers.py",
             'CONSUMERS = ("kvckpt.integrations", "kvckpt.reference", "kvckpt.tools", "benchmarks")',
             'CONSUMERS = ("kvckpt.integrations", "kvckpt.reference")',
             (f"{LAYERS_TEST}::test_a_tool_or_benchmark_reaching_below_its_face_is_caught",)),
    Mutation("tools-face-open-to-everyone", "scripts/layers.py",
             'FACES = {"kvckpt.tooling": ("kvckpt.tools", "benchmarks")}',
             'FACES = {"kvckpt.tooling": ("kvckpt", "benchmarks")}',
             (f"{LAYERS_TEST}::test_a_tool_or_benchmark_reaching_below_its_face_is_caught",)),
    Mutation("trl-changed-default-silent", "integrations/trl/worker.py",
             "            warnings.warn(DEFAULT_BACKEND_CHANGED, FutureWarning, stacklevel=2)\n", "",
             ("tests/integrations/trl/test_trl_default_backend.py::"
              "test_leaving_the_backend_out_warns_that_its_default_changed",)),
    Mutation("citations-skip-globs", "tests/tools/test_doc_citations.py",
             'CITATION = re.compile(r"\\btests/(?P<file>[a-z0-9_*]+(?:/[a-z0-9_*]+)*',
             'CITATION = re.compile(r"\\btests/(?P<file>[a-z0-9_]+(?:/[a-z0-9_]+)*',
             ("tests/tools/test_doc_citations.py::test_the_check_fails_on_a_missing_file_and_a_missing_name",)),
)

# issue 46: the destroyed-lineage rule inside every window; aimed tests for the promises of issues 36-39.
WINDOWS = "tests/core/test_lineage_windows.py"
MUTATIONS += (
    Mutation("window-floor-clamped-at-zero", "kvckpt/samplers/base.py",
             "    return current - window\n", "    return max(0, current - window)\n",
             (f"{WINDOWS}::test_a_rollback_to_zero_keeps_forked_groups_inside_the_window",)),
    Mutation("plain-recover-destroys-weights", "kvckpt/durability/recovery.py",
             "        rollback = resume_version is not None", "        rollback = True",
             (f"{WINDOWS}::test_only_a_resume_version_destroys_weights",)),
    Mutation("ready-fork-overwritten-by-a-newer-recovery", "kvckpt/durability/recovery.py",
             "            fork = version if group.lineage_fork is None else min(group.lineage_fork, version)\n",
             "            fork = version\n",
             (f"{WINDOWS}::test_groups_on_destroyed_lineage_counts_every_stamp_newer_than_the_resume_version",)),
    Mutation("step-message-checksum-unchecked", "kvckpt/storage/codec.py",
             '    if zlib.crc32(buf[8:]) != crc:\n        raise CorruptRecord(key, "checksum mismatch")\n', "",
             (f"{STEP}::test_a_malformed_message_is_refused_whole_and_writes_nothing",)),
    Mutation("client-batches-nothing", "integrations/ray/client.py",
             "            if len(self._pending) >= self.batch_groups:\n",
             "            if True:\n",
             ("tests/integrations/ray/test_ray.py::test_producers_encode_at_the_edge_and_the_actor_only_checks",)),
    Mutation("value-store-load-skips-the-copys-check", "kvckpt/buffer/values.py",
             "                return install_checkpoint(source, self.path, check)",
             "                return install_checkpoint(source, self.path, lambda copy: {})",
             ("tests/core/test_value_store_load.py",)),
    Mutation("client-future-result-does-not-drive", "integrations/ray/client.py",
             "        if not self.done():\n            self._drive(self)\n        return super().result(timeout)",
             "        return super().result(timeout)",
             ("tests/integrations/ray/test_ray_client_future.py::"
              "test_a_queued_progress_step_completes_when_waited_on_without_flush",)),
    Mutation("client-future-drive-leaves-its-step-queued", "integrations/ray/client.py",
             "            if any(f is future for _, f in self._pending_steps):\n"
             "                self._send_steps()\n", "",
             ("tests/integrations/ray/test_ray_client_future.py::"
              "test_a_queued_progress_step_completes_when_waited_on_without_flush",)),
)

# issue 45: one producer-side recorder (integrations/common/progress.py), one wire form, drain on preemption
DRAIN = "tests/integrations/vllm/test_progress_drain.py"
MUTATIONS += (
    Mutation("recorder-backlog-unbounded", "integrations/common/progress.py",
             "and unrecorded >= tail.every and unrecorded + incoming > BACKLOG * tail.every",
             "and unrecorded >= tail.every and False",
             (f"{BACKGROUND}::test_backpressure_waits_for_the_flush_and_drops_nothing",)),
    Mutation("drain-leaves-the-short-tail", "integrations/common/progress.py",
             "        tail = tail or self._draining\n", "",
             (f"{DRAIN}::test_a_drain_in_synchronous_mode_writes_a_tail_short_of_an_interval",
              f"{DRAIN}::test_sigterm_mid_generation_then_sigkill_leaves_no_token_to_regenerate")),
    Mutation("drain-keeps-generating", "integrations/common/progress.py",
             "            if self.error is not None or self._draining:", "            if self.error is not None:",
             (f"{DRAIN}::test_a_drain_past_its_deadline_stops_and_counts_the_tail_not_made_durable",)),
    Mutation("sigterm-drains-nothing", "integrations/common/progress.py",
             "        reports = drain_all(grace)\n", "        reports = [r.drain(0.0) for r in ()]\n",
             (f"{DRAIN}::test_sigterm_mid_generation_then_sigkill_leaves_no_token_to_regenerate",)),
    Mutation("progress-many-resend-refused-as-stale", "kvckpt/transitions/progress_step.py",
             "                same_chunk(rows, s, c) for c in s.chunks):",
             "                same_chunk(rows, s, c) for c in s.chunks) and False:",
             ("tests/core/test_progress.py::test_a_resend_of_record_progress_many_items_is_answered_as_a_step_messages_resend",)),
    Mutation("progress-many-retry-answers-the-durable-length", "kvckpt/transitions/progress_step.py",
             "            if same_chunk(rows, s, c):\n                continue",
             "            if same_chunk(rows, s, c):\n                return length",
             ("tests/core/test_progress.py::test_chunks_append_a_retry_is_a_noop_and_a_conflict_or_gap_is_refused",)),
)

# issue 47: NeMo-RL's in-flight tokens (the engine proxy's splice, the sequence key's propagation, the re-issue).
# The aimed tests share one fixture (three fresh processes, about 1.5 minutes here).
NEMO_RL_CRASH = "tests/integrations/nemo_rl/test_nemo_rl_progress_crash.py"
NEMO_RL_LAUNCHER = "tests/integrations/nemo_rl/test_nemo_rl_engine.py"
MUTATIONS += (
    Mutation("nemo-rl-proxy-splice-drops-the-prefix", "integrations/nemo_rl/engine.py",
             "whole = dataclasses.replace(c, token_ids=list(ids),",
             "whole = dataclasses.replace(c, token_ids=list(c.token_ids),",
             (f"{NEMO_RL_CRASH}::test_what_nemo_rl_commits_equals_an_uninterrupted_run_bit_for_bit",)),
    Mutation("nemo-rl-key-not-propagated", "integrations/nemo_rl/engine.py",
             "                data[KEY] = [", "                _unsent = [",
             (f"{NEMO_RL_CRASH}::test_inflight_tokens_survive_and_resume_with_at_most_one_interval_regenerated",)),
    Mutation("nemo-rl-reissue-forgets-the-group", "integrations/nemo_rl/reissue.py",
             "group_id=lease.group_id,\n", "group_id=None,\n",
             (f"{NEMO_RL_CRASH}::test_each_recovered_prompt_is_reissued_once_and_a_zombie_is_refused",)),
    Mutation("nemo-rl-reserve-leaves-the-prompt-anonymous", "integrations/nemo_rl/adapter.py",
             "bound = bound_dispatch() if group_id is None and prompt_idx is None else None",
             "bound = None",
             (f"{NEMO_RL_CRASH}::test_each_recovered_prompt_is_reissued_once_and_a_zombie_is_refused",)),
    Mutation("nemo-rl-launcher-drops-progress", "integrations/nemo_rl/swap.py",
             "    if cfg.progress_every_tokens:\n        install_progress()",
             "    if False:\n        install_progress()",
             (f"{NEMO_RL_LAUNCHER}::test_the_launcher_makes_nemo_rl_build_kvckpts_worker_and_key_its_rollouts",)),
    # NeMo-Gym's token store, killed by Gym's own conformance suite: run with --python "$PWD/.venv-gym/bin/python"
    Mutation("gym-drop-ignores-the-version", "integrations/nemo_gym/store.py",
             'or state["version"] != version:', "or False:",
             ("tests/integrations/nemo_gym/test_nemo_gym_store.py::test_gyms_own_conformance_suite_passes_all_ten_checks",)),
    Mutation("gym-conflicting-reput-accepted", "integrations/nemo_gym/store.py",
             'if known[1] == digest:', "if True:",
             ("tests/integrations/nemo_gym/test_nemo_gym_store.py::test_gyms_own_conformance_suite_passes_all_ten_checks",)),
)

# issue 44: the replication log (captured at the Txn layer, in the transaction), the standby's apply
REPLOG = "tests/core/test_replication_log.py"
REPLICA = "tests/core/test_replica.py"
STANDBY_TEST = "tests/durability/test_standby.py"
MUTATIONS += (
    Mutation("replog-append-skipped", "kvckpt/storage/replog.py", "        if ops:\n            bookkeeping(txn)\n",
             "        if False:\n            bookkeeping(txn)\n",
             (f"{REPLOG}::test_every_write_transaction_appends_one_record_that_replays_to_the_same_state",)),
    Mutation("replog-capture-misses-deletes", "kvckpt/storage/txn.py",
             "        if self.capture is not None and found:\n", "        if False:\n",
             (f"{REPLOG}::test_every_write_transaction_appends_one_record_that_replays_to_the_same_state",)),
    Mutation("replog-refused-child-stays-in-the-record", "kvckpt/storage/store.py",
             "                        del txn.capture[mark:]\n", "                        pass\n",
             (f"{REPLOG}::test_a_refused_item_of_a_group_commit_leaves_nothing_in_the_batch_record",)),
    Mutation("replog-empty-transaction-logged", "kvckpt/storage/replog.py",
             "        if ops:\n            bookkeeping(txn)\n",
             "        if ops is not None:\n            bookkeeping(txn)\n",
             (f"{REPLOG}::test_every_write_transaction_appends_one_record_that_replays_to_the_same_state",)),
    Mutation("replog-bound-ignored", "kvckpt/storage/replog.py",
             "            while seq - first + 1 > self.max_records:\n", "            while False:\n",
             (f"{REPLOG}::test_past_its_bound_the_log_drops_its_oldest_record_and_marks_the_standby_for_a_snapshot",)),
    Mutation("replog-reopen-forgets-the-log", "kvckpt/storage/store.py",
             "                self.replication = ReplicationLog.load(self)\n", "",
             (f"{REPLOG}::test_a_reopened_primary_keeps_logging_from_its_last_sequence_in_a_fresh_process",)),
    Mutation("replica-resend-applied-again", "kvckpt/storage/replica.py",
             "        if decoded[-1].seq <= applied:\n", "        if False:\n",
             (f"{REPLICA}::test_a_resend_is_answered_not_reapplied_and_an_overlap_applies_only_what_is_new",)),
    Mutation("replica-epoch-unchecked", "kvckpt/storage/replica.py",
             "        if decoded[0].epoch < epoch:\n", "        if False:\n",
             (f"{REPLICA}::test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing[older-epoch]",)),
    Mutation("replica-store-id-unchecked", "kvckpt/storage/replica.py",
             "        if rec.store != log.tag:\n", "        if False:\n",
             (f"{REPLICA}::test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing[another-stores-id]",)),
    Mutation("replica-gap-after-applied-accepted", "kvckpt/storage/replica.py",
             "        if decoded[0].seq > applied + 1:\n", "        if False:\n",
             (f"{REPLICA}::test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing[gap-after-applied]",)),
    Mutation("replica-repeat-unchecked", "kvckpt/storage/replica.py",
             "    if len(set(seqs)) != len(seqs):\n", "    if False:\n",
             (f"{REPLICA}::test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing[repeated-sequence]",)),
    Mutation("replica-record-checksum-unchecked", "kvckpt/storage/replog.py",
             "    if zlib.crc32(body) != _CRC.unpack_from(data, len(body))[0]:\n", "    if False:\n",
             (f"{REPLICA}::test_a_bad_batch_is_refused_with_its_own_error_and_applies_nothing[corrupted-record]",)),
    Mutation("replica-applied-not-recorded", "kvckpt/storage/replica.py",
             "        log.stage(txn, last=decoded[-1].seq, epoch=decoded[-1].epoch)\n", "",
             (f"{REPLICA}::test_a_standby_applies_shipped_batches_to_the_primarys_exact_state_durably[value-store]",)),
    Mutation("replica-standby-accepts-writes", "kvckpt/storage/replog.py",
             "        if ops and self.role != PRIMARY:\n", "        if False:\n",
             (f"{REPLICA}::test_a_standby_refuses_writes_and_a_primary_refuses_batches",)),
    Mutation("standby-installed-one-record-ahead", "kvckpt/durability/replication.py",
             "            applied = ReplicationLog.load(store).last\n",
             "            applied = ReplicationLog.load(store).last + 1\n",
             (f"{STANDBY_TEST}::test_a_new_standby_catches_up_from_a_snapshot_taken_while_producers_write[value-store]",)),
    Mutation("standby-install-keeps-the-primary-role", "kvckpt/durability/replication.py",
             "            make_standby(store, applied, state[\"epoch\"])\n", "",
             (f"{STANDBY_TEST}::test_a_new_standby_catches_up_from_a_snapshot_taken_while_producers_write[value-store]",)),
    Mutation("standby-install-takes-any-file", "kvckpt/durability/replication.py",
             "        if state is None or state.get(\"role\") != PRIMARY",
             "        if False and state.get(\"role\") != PRIMARY",
             (f"{STANDBY_TEST}::test_install_refuses_a_file_that_is_not_a_replicated_primarys_snapshot",)),
    Mutation("verify-against-ignores-the-sequence", "kvckpt/durability/replication.py",
             "\"equal\": same and not differing}", "\"equal\": not differing}",
             (f"{STANDBY_TEST}::test_verify_against_refuses_equal_tables_at_different_sequences",)),
    Mutation("promote-keeps-the-epoch", "kvckpt/storage/replica.py",
             "        epoch = state[\"epoch\"] + 1\n", "        epoch = state[\"epoch\"]\n",
             (f"{STANDBY_TEST}::test_promotion_takes_a_new_epoch_recovers_as_a_restart_and_refuses_the_old_primary",)),
    Mutation("promote-skips-recovery", "kvckpt/buffer/standby.py",
             "        return buffer, buffer.recover(resume_version)\n",
             "        return buffer, RecoveryPlan(resume_version=buffer.state()[\"trainer_version\"])\n",
             (f"{STANDBY_TEST}::test_promotion_takes_a_new_epoch_recovers_as_a_restart_and_refuses_the_old_primary",)),
    Mutation("inspect-hides-replication", "tools/inspect.py",
             "            out[\"replication\"] = replog.describe(txn)", "            out[\"replication\"] = None",
             (f"{STANDBY_TEST}::test_inspect_shows_the_epoch_the_sequences_the_lag_and_a_standby_dropped_to_a_snapshot",)),
    Mutation("replog-record-drops-the-last-operation", "kvckpt/storage/replog.py",
             "            txn.put(\"replog\", record_key(seq), encode_record(self.epoch, seq, self.tag, ops))\n",
             "            txn.put(\"replog\", record_key(seq), encode_record(self.epoch, seq, self.tag, ops[:-1]))\n",
             ("tests/campaigns/test_replication_kills.py::"
              "test_a_primary_killed_mid_write_keeps_a_log_that_replays_to_its_state",)),
)

# issue 44 (this session): the Ray standby actor, the shipper, the acknowledgement levels, fencing, failover
RAY_REPL = "tests/integrations/ray/test_ray_replication.py"
RAY_FAILOVER = "tests/integrations/ray/test_ray_failover.py"
SHIP = "integrations/ray/replication.py"
MUTATIONS += (
    Mutation("ray-remote-level-does-not-wait", SHIP,
             "            return\n        await self.wait_acked(seq)\n",
             "            return\n",
             (f"{RAY_REPL}::test_a_remote_level_answers_only_after_the_standby_applied",)),
    Mutation("ray-generated-write-not-replicated", "integrations/ray/actor.py",
             "    return mark_generated(_replicated(method) if row.writes else method)",
             "    return mark_generated(method)",
             (f"{RAY_REPL}::test_a_remote_level_answers_only_after_the_standby_applied",)),
    Mutation("ray-async-lag-unbounded", SHIP,
             "and self.lag()[\"lag_s\"] > self.config.max_lag_s:", "and False:",
             (f"{RAY_REPL}::test_async_holds_writes_while_the_connected_standby_lags_past_the_bound",)),
    Mutation("ray-promoted-standby-does-not-fence", SHIP,
             "    return isinstance(exc, (NotStandby, StaleEpoch))", "    return False",
             (f"{RAY_REPL}::test_a_standby_that_was_promoted_fences_the_primary",)),
    Mutation("ray-new-standby-gets-no-snapshot", SHIP,
             "            if status is None or status[\"store_tag\"] != mine[\"store_tag\"]:",
             "            if False:",
             (f"{RAY_REPL}::test_a_replaced_standby_and_a_restored_primary_each_start_from_a_snapshot",)),
    Mutation("restore-keeps-the-replication-history", "kvckpt/durability/checkpoint.py",
             "        ReplicationLog.restart_history(store)\n", "",
             (f"{STANDBY_TEST}::test_a_standby_refuses_the_log_of_a_restored_primary",
              f"{RAY_REPL}::test_a_replaced_standby_and_a_restored_primary_each_start_from_a_snapshot")),
    Mutation("ray-promoted-standby-still-takes-the-log", "integrations/ray/actor.py",
             "        self._side = None\n        self.promoted_from", "        self.promoted_from",
             (f"{RAY_REPL}::test_promotion_fences_the_old_primary_and_the_client_fails_over",)),
    Mutation("ray-client-no-failover-on-refusal", "integrations/ray/client.py",
             "self._find_primary(self.restart_timeout) if isinstance", "False if isinstance",
             (f"{RAY_REPL}::test_promotion_fences_the_old_primary_and_the_client_fails_over",)),
    Mutation("ray-client-no-failover-on-death", "integrations/ray/client.py",
             "            if self._find_primary(0.0):\n", "            if False:\n",
             (f"{RAY_FAILOVER}::test_remote_durable_loses_nothing_acknowledged_when_the_owners_node_and_disk_die",)),
    Mutation("ray-no-auto-promotion", SHIP,
             "    return any(n[\"NodeID\"] == node_id and n[\"Alive\"] for n in ray.nodes())", "    return True",
             (f"{RAY_FAILOVER}::test_remote_durable_loses_nothing_acknowledged_when_the_owners_node_and_disk_die",)),
)

# issue 44 (this session, h44v16): the value store's standby (its load's new history, its promotion, its writes
# under the level on Ray, the promoted one refusing the old primary) and the kill campaign's replicated side
VS_STANDBY = "tests/durability/test_value_store_standby.py"
RAY_VS = "tests/integrations/ray/test_ray_value_store_standby.py"
REPL_CAMPAIGN = "tests/campaigns/test_replicated_campaign.py"
MUTATIONS += (
    Mutation("value-store-load-keeps-the-replication-history", "kvckpt/buffer/values.py",
             "                ReplicationLog.restart_history(store)\n", "                pass\n",
             (f"{VS_STANDBY}::test_a_load_starts_a_new_history_the_old_standby_refuses_and_a_new_snapshot_serves",)),
    Mutation("value-store-standby-resend-applied-again", "kvckpt/storage/replica.py",
             "        if decoded[-1].seq <= applied:\n", "        if False:\n",
             (f"{VS_STANDBY}::test_each_write_of_the_value_store_is_one_record_and_the_standby_ends_equal",)),
    Mutation("value-store-promote-keeps-the-epoch", "kvckpt/storage/replica.py",
             "        epoch = state[\"epoch\"] + 1\n", "        epoch = state[\"epoch\"]\n",
             (f"{VS_STANDBY}::test_promotion_takes_a_new_epoch_and_the_old_primary_is_refused",)),
    Mutation("value-store-promote-skips-the-kind-check", "kvckpt/buffer/standby.py",
             "        if store.read(value_records.kind_of) is None:\n", "        if False:\n",
             (f"{VS_STANDBY}::test_promoting_another_kinds_standby_as_a_value_store_changes_nothing",)),
    Mutation("buffer-promote-skips-the-kind-check", "kvckpt/buffer/standby.py",
             "        if store.read(value_records.kind_of) is not None:\n", "        if False:\n",
             (f"{VS_STANDBY}::test_promoting_a_value_stores_standby_as_a_replay_buffer_changes_nothing",)),
    Mutation("memory-buffer-numbers-missing-rows-from-zero", "kvckpt/testing/fixtures/memory_buffer.py",
             "self._commit(lease, rows_by_index(lease, rows, self.config.group_size), end_weight",
             "self._commit(lease, sorted(rows.items()) if isinstance(rows, Mapping) else list(enumerate(rows)), "
             "end_weight",
             ("tests/core/test_buffer_conformance.py::test_a_list_of_the_missing_rows_is_committed_as_those_rows",)),
    Mutation("restore-ignores-readers-sharing-the-lock-file", "kvckpt/durability/checkpoint.py",
             "    users = lock_file_users(live_path)\n", "    users = []\n",
             ("tests/durability/test_io_faults.py::"
              "test_a_restore_refuses_a_live_store_a_reader_in_another_process_still_shares",)),
    Mutation("value-store-replica-write-not-acknowledged", "integrations/ray/values.py",
             "            self._run(shipper.after_write())\n", "            shipper.written()\n",
             (f"{RAY_VS}::test_a_remote_level_put_answers_only_once_the_standby_applied_it",)),
    Mutation("value-store-promoted-standby-still-takes-the-log", "integrations/ray/values.py",
             "        self._side = None\n        return {**(replication_status",
             "        return {**(replication_status",
             (f"{RAY_VS}::test_promotion_keeps_every_acknowledged_put_and_the_revived_old_primary_is_fenced",)),
    Mutation("value-store-replica-log-not-enabled", "integrations/ray/values.py",
             "            enable_replication(values)\n", "            pass\n",
             (f"{RAY_VS}::test_a_remote_level_put_answers_only_once_the_standby_applied_it",)),
    Mutation("replicated-campaign-standby-equality-unchecked", "kvckpt/testing/campaigns/replicated.py",
             "    if standby != model(seed, applied):\n", "    if False:\n",
             (f"{REPL_CAMPAIGN}::test_the_check_finds_a_standby_whose_state_is_not_the_primarys_at_its_sequence",)),
    Mutation("replicated-campaign-remote-loss-unchecked", "kvckpt/testing/campaigns/replicated.py",
             "    if level == REMOTE_DURABLE and applied < acked:\n", "    if False:\n",
             (f"{REPL_CAMPAIGN}::test_the_check_passes_a_standby_behind_at_async_and_fails_it_at_remote_durable",)),
)

TRL_SAVE_KILL = ("tests/integrations/trl/test_trl_server.py::"
                 "test_a_kill_inside_trls_first_save_sets_the_partial_checkpoint_aside_and_costs_one_interval",)
# issue 49: TRL's server path under kills: a partial checkpoint set aside (not refused), one interval
# regenerated on the defaults (the background recorder's backlog), each token stamped with the weights that
# made it when a weight sync lands mid-stream. Run with --python "$PWD/.venv-vllm/bin/python"
# and KVCKPT_VLLM_PYTHON="$PWD/.venv-vllm/bin/python" (the copy has no .venv-vllm: the server tests skip otherwise).
TRL_SYNC_KILL = ("tests/integrations/trl/test_trl_server.py::"
                 "test_a_weight_sync_mid_stream_stamps_each_token_with_the_weights_that_made_it",)
MUTATIONS += (
    Mutation("trl-partial-checkpoint-not-set-aside", "integrations/trl/callback.py",
             '        if not missing or (keep and path == os.path.join(output_dir, f"checkpoint-{keep}")):\n',
             "        if True:\n", TRL_SAVE_KILL),
    Mutation("trl-partial-checkpoint-counted-as-complete", "integrations/trl/callback.py",
             "for path, missing in _checkpoints(output_dir).items() if not missing]",
             "for path, missing in _checkpoints(output_dir).items() if True]", TRL_SAVE_KILL),
    Mutation("progress-backlog-four-intervals", "integrations/common/progress.py", "BACKLOG = 1\n", "BACKLOG = 4\n",
             TRL_SAVE_KILL),
    Mutation("trl-server-keeps-tokens-read-after-the-pause", "integrations/trl/server.py",
             "                    if epochs is not None and asked[i][0] != epochs.epoch:\n"
             "                        cancel[i].set()",
             "                    if False:\n                        cancel[i].set()", TRL_SYNC_KILL),
    Mutation("progress-chunk-stamped-with-the-dispatch-weights", "integrations/vllm/stream.py",
             "[int(version[0]) if version else self.version]", "[self.version]", TRL_SYNC_KILL),
    Mutation("trl-group-end-stamped-with-the-dispatch-weights", "integrations/trl/worker.py",
             "end_weight=newest)", "end_weight=weights)", TRL_SYNC_KILL),
    Mutation("trl-own-transfer-built-with-default-timeout", "integrations/trl/sync.py",
             "        weight_sync_timeout=args.weight_sync_timeout)", "        )",
             ("tests/integrations/trl/test_trl_server.py::"
              "test_the_server_path_builds_trls_own_weight_transfer_as_trl_does",)),
)

# issue 45 (this session): one progress rule set for both store kinds; the value store's progress
# (ValueStore.record_progress, the verl ledger's), killed by the value store's own test (no verl needed).
VALUE_PROGRESS = ("tests/core/test_value_store.py::"
                  "test_value_store_progress_is_the_buffers_transition_inside_one_fenced_transaction",)
MUTATIONS += (
    Mutation("value-progress-max-tokens-unchecked", "kvckpt/transitions/progress_values.py",
             "        if start + len(ids) > max_tokens:", "        if False:", VALUE_PROGRESS),
    Mutation("value-progress-one-chunk-for-all-versions", "kvckpt/transitions/progress_values.py",
             "    runs = [0, *(np.flatnonzero(np.diff(vs)) + 1).tolist(), len(ids)] if len(ids) else []",
             "    runs = [0, len(ids)] if len(ids) else []", VALUE_PROGRESS),
    Mutation("value-progress-fenced-call-drops", "kvckpt/buffer/values.py",
             "            if fenced is None:\n                for gone in drop:",
             "            if True:\n                for gone in drop:", VALUE_PROGRESS),
    Mutation("value-progress-fenced-call-marks", "kvckpt/buffer/values.py",
             "            if fenced is None and then is not None:", "            if then is not None:", VALUE_PROGRESS),
    Mutation("value-progress-unfenced", "kvckpt/buffer/values.py",
             "                records.check_fence(txn, self.path, fence)\n            except FencedWrite",
             "                pass\n            except FencedWrite", VALUE_PROGRESS),
    Mutation("value-progress-stray-key-taken-for-a-chunk", "kvckpt/values/records.py",
             "    if len(tail) != 10 or not tail.isdigit():", "    if False:", VALUE_PROGRESS),
    Mutation("value-progress-fenced-resend-refused", "kvckpt/transitions/progress_step.py",
             "        if not isinstance(exc, ForeignLease) and s.chunks and all(", "        if False and all(",
             VALUE_PROGRESS),
)

# issue 48 (this session): the typed operation table; the facade's and the actor's methods made from it, the wire's
# codecs, one scenario per operation on every surface.
SURFACE_TESTS = "tests/core/test_surfaces.py"
SCENARIO_TESTS = "tests/core/test_buffer_conformance.py"
RAY_SCENARIOS = "tests/integrations/ray/test_ray_conformance.py"
MUTATIONS += (
    Mutation("table-calls-every-method-generated", "kvckpt/buffer/surface.py",
             '    return bool(getattr(member, "__kvckpt_generated__", False))',
             "    return callable(member)",
             (f"{SURFACE_TESTS}::test_every_surface_offers_every_operation_as_its_row_says",)),
    Mutation("generated-method-loses-its-type-hints", "kvckpt/buffer/aio.py",
             "    method.__wrapped__ = reference  # type: ignore[attr-defined]"
             "  # typing.get_type_hints reads its module\n",
             "",
             (f"{SURFACE_TESTS}::test_a_generated_method_has_replay_buffers_signature_hints_and_summary",)),
    Mutation("generated-facade-method-runs-another-operation", "kvckpt/buffer/aio.py",
             "            return await run(getattr(self.buffer, name), *args, **kwargs)",
             "            return await run(getattr(self.buffer, 'ledger' if name == 'state' else name),"
             " *args, **kwargs)",
             (f"{SCENARIO_TESTS}::test_every_operation_runs_its_scenario_on_every_surface_that_offers_it",)),
    Mutation("scenario-skips-an-offered-operation", "kvckpt/testing/conformance/scenarios.py",
             "        offer, why = offered(surface, row.name)\n",
             "        offer, why = offered(surface, row.name)\n        offer = offer and row.name != 'claim'\n",
             (f"{SCENARIO_TESTS}::test_every_operation_runs_its_scenario_on_every_surface_that_offers_it",)),
    Mutation("actor-result-not-through-its-codec", "integrations/ray/actor.py",
             "        return result.to_wire(await getattr(self._abuf, name)(**arguments))",
             "        return await getattr(self._abuf, name)(**arguments)",
             (f"{RAY_SCENARIOS}::test_every_operation_runs_its_scenario_through_the_actor_and_its_client",)),
    Mutation("wire-ids-codec-drops-the-filter", "integrations/ray/wire.py",
             '    "ids?": Codec(_optional(list), _optional(list), "Iterable[str] | None"),',
             '    "ids?": Codec(_optional(list), lambda ids: None, "Iterable[str] | None"),',
             (f"{RAY_SCENARIOS}::test_every_operation_runs_its_scenario_through_the_actor_and_its_client",)),
    Mutation("refused-admission-wakes-itself", "kvckpt/buffer/aio.py",
             "                admitted = await self._run(fn, *args, timeout=0, **kwargs)",
             "                admitted = await self._write(fn, *args, timeout=0, **kwargs)",
             ("tests/core/test_aio.py::test_a_waiting_admission_sleeps_until_a_write_lands",)),
    Mutation("powercut-tidy-skips-the-sides", "kvckpt/testing/campaigns/powercut.py",
             "            tidy(os.path.join(image, timeline), ops)", "            pass",
             ("tests/campaigns/test_sides.py::"
              "test_between_power_cuts_the_image_is_tidied_by_the_campaign_and_by_each_side",)),
)


# issue 45 (this session): lease holders (leases_held_by, redispatch_held_by), TRL's SIGTERM drain,
# BufferClient.record_progress_many's message built in the producer.
HOLDERS = "tests/core/test_lease_holders.py"
MANY_MESSAGE = (f"{RAY_STEP}::test_record_progress_many_sends_one_message_built_here_and_its_resend_after_a_"
                "restart_is_exactly_once")
HOLDERS_RESTART = f"{HOLDERS}::test_a_dead_nodes_leases_are_listed_and_redispatched_in_one_call_across_restarts"
MUTATIONS += (
    Mutation("admit-records-no-holder", "kvckpt/transitions/admission.py", "                            holder=holder)",
             "                            holder=None)", (HOLDERS_RESTART,)),
    Mutation("held-by-lists-every-lease", "kvckpt/transitions/inflight.py",
             "    return [e.lease(store_id) for e in t.entries() if e.holder == holder]",
             "    return [e.lease(store_id) for e in t.entries()]", (HOLDERS_RESTART,)),
    Mutation("redispatch-held-by-takes-every-lease", "kvckpt/transitions/inflight.py",
             "for e in t.entries() if e.holder == holder]\n    t.put_state(st)",
             "for e in t.entries()]\n    t.put_state(st)", (HOLDERS_RESTART,)),
    Mutation("redispatch-keeps-the-old-holder", "kvckpt/transitions/inflight.py",
             '"timeline": st["timeline"], "holder": holder,', '"timeline": st["timeline"],', (HOLDERS_RESTART,)),
    Mutation("redispatch-held-by-does-not-fence", "kvckpt/transitions/inflight.py",
             '**entry.to_dict(), "attempt": entry.attempt + 1,', '**entry.to_dict(), "attempt": entry.attempt,',
             (HOLDERS_RESTART,)),
    Mutation("recovery-drops-the-holder", "kvckpt/durability/recovery.py",
             '"timeline": st["timeline"], **stamps})', '"timeline": st["timeline"], "holder": None, **stamps})',
             (HOLDERS_RESTART,)),
    Mutation("holder-written-when-none", "kvckpt/tables/records.py",
             '_OMITTED_WHEN_NONE = frozenset({"lineage_fork", "lineage_newest", "holder"})',
             '_OMITTED_WHEN_NONE = frozenset({"lineage_fork", "lineage_newest"})',
             (f"{HOLDERS}::test_an_entry_without_a_holder_is_the_bytes_an_older_kvckpt_wrote",)),
    Mutation("verify-ignores-a-holder-of-another-type", "kvckpt/durability/verify.py",
             'if ledger and not isinstance(doc.get("holder", ""), str):', "if False:",
             (f"{HOLDERS}::test_a_holder_that_is_not_a_string_is_malformed",)),
    Mutation("memory-buffer-held-by-ignores-holder", "kvckpt/testing/fixtures/memory_buffer.py",
             "                    if e.holder == holder]\n\n    def redispatch_held_by",
             "                    ]\n\n    def redispatch_held_by",
             (f"{HOLDERS}::test_every_surface_records_and_answers_holders_alike",)),
    Mutation("client-many-ships-items-to-the-owner", "integrations/ray/client.py",
             "        out: list[Any] = [None] * len(items)\n        by_fields",
             "        return ray.get(self.actor.record_progress_many.remote([{**to_wire(dict(i)), \"lease\": "
             "_lease_dict(i[\"lease\"])} for i in items]))\n"
             "        out: list[Any] = [None] * len(items)\n        by_fields", (MANY_MESSAGE,)),
    Mutation("client-many-refuses-the-message-for-one-item", "integrations/ray/client.py",
             "        except KvckptError:\n            for n in ns:",
             "        except KvckptError:\n            raise\n            for n in ns:", (MANY_MESSAGE,)),
    Mutation("actor-redispatch-held-by-drops-the-new-holder", "integrations/ray/actor.py",
             '        del arguments["self"]\n',
             '        del arguments["self"]\n'
             '        if name == "redispatch_held_by":\n            arguments.pop("to", None)\n',
             ("tests/integrations/ray/test_ray_conformance.py"
              "::test_every_operation_runs_its_scenario_through_the_actor_and_its_client",)),
    Mutation("trl-worker-admits-without-its-holder", "integrations/trl/worker.py",
             "weight_version=self.clock.weights_step, holder=self.holder)",
             "weight_version=self.clock.weights_step)",
             ("tests/integrations/trl/test_trl_drain.py",)),
    Mutation("trl-worker-installs-no-sigterm-drain", "integrations/trl/worker.py",
             "            drain_on_sigterm(drain_seconds)\n", "            pass\n",
             ("tests/integrations/trl/test_trl_drain.py",)),
)

# issue 49 (this session): the destroyed-lineage decision for a record whose tokens span a weight sync: its
# newest token's version (lineage_newest) decides the fork and enters the lineage weight min(start, 2f - newest).
SPAN = "tests/core/test_lineage_span.py"
SPAN_FORKED = (f"{SPAN}::test_a_group_spanning_the_sync_is_forked_at_the_resume_version",)
MUTATIONS += (
    Mutation("lineage-fork-decided-from-start-only", "kvckpt/durability/recovery.py",
             "        if group.newest_weight > version:\n", "        if group.start_weight > version:\n", SPAN_FORKED),
    Mutation("lineage-weight-ignores-newest", "kvckpt/tables/records.py",
             "    newest = start_weight if lineage_newest is None else lineage_newest\n", "    newest = start_weight\n",
             (f"{SPAN}::test_the_staleness_is_the_tree_distance_of_the_newest_token",)),
    Mutation("inflight-fork-ignores-durable-progress", "kvckpt/durability/recovery.py",
             "        newest = max(newest, durable)\n", "        pass\n", SPAN_FORKED),
    Mutation("commit-newest-ignores-end-weight", "kvckpt/transitions/commit.py",
             " + ([] if end_weight is None else [int(end_weight)])", "", SPAN_FORKED),
    Mutation("commit-newest-ignores-consumed-chunks", "kvckpt/transitions/commit.py",
             "[hi for _, hi in spans] + ", "", SPAN_FORKED),
    Mutation("forked-commit-raises-newest", "kvckpt/transitions/commit.py",
             "    if entry.lineage_fork is not None:\n        return entry.newest_weight\n", "",
             (f"{SPAN}::test_a_forked_entry_commits_with_the_newest_its_fork_froze",)),
    Mutation("verify-ignores-lineage-newest", "kvckpt/durability/verify.py",
             "    return lineage_weight(start, fork, newest)", "    return lineage_weight(start, fork)",
             ("tests/durability/test_corruption_fuzz.py::test_verifier_flags_each_inconsistency",)),
    Mutation("verify-allows-newest-at-stamp", "kvckpt/durability/verify.py",
             "    if newest is not None and newest <= start:", "    if False:",
             ("tests/durability/test_corruption_fuzz.py::test_verifier_flags_each_inconsistency",)),
)

# issue 44 (this session, h44b16): the async bound's hold reported and applied to answers too, each write's
# acknowledgement lag measured, a promoted standby shipping to its own successor
RAY_LEVELS = "tests/integrations/ray/test_ray_replication_levels.py"
MUTATIONS += (
    Mutation("ray-async-hold-not-reported", SHIP,
             "                    self.held_writes += 1\n", "",
             (f"{RAY_LEVELS}::test_async_answers_at_once_measures_the_lag_and_holds_writes_past_the_bound",)),
    Mutation("ray-async-answer-not-held", SHIP,
             "            await self._hold()\n            return\n", "            return\n",
             (f"{RAY_LEVELS}::test_async_holds_the_answer_of_a_write_in_progress_once_the_lag_passes_the_bound",)),
    Mutation("ray-ack-lag-not-measured", SHIP,
             "            self._lags.append(now - self._written.popleft()[1])",
             "            self._written.popleft()",
             (f"{RAY_LEVELS}::test_async_answers_at_once_measures_the_lag_and_holds_writes_past_the_bound",)),
    Mutation("ray-promoted-standby-ships-to-no-successor", "integrations/ray/actor.py",
             "        self._replicate(self._successor)\n", "",
             (f"{RAY_LEVELS}::test_a_promoted_standby_ships_to_its_successor_and_a_second_failover_loses_nothing",)),
    Mutation("ray-standby-forgets-its-successor", "integrations/ray/actor.py",
             "                self._successor = replication  # what it ships to once promoted\n", "",
             (f"{RAY_LEVELS}::test_a_promoted_standby_ships_to_its_successor_and_a_second_failover_loses_nothing",)),
)

# issue 45 (this session): the correctness remainder (h45r16). The verl ledger's reads inside its write transactions,
# its FutureVersion, the reference RayWorker's holder and TRL's drains live here; the verl-venv ones are in
# scripts/mutations_verl.json. A value-store chunk re-encoded by `compact --level` is judged by its content.
RAY_FLEET_HOLDERS = "tests/trainer/test_trainer.py::test_ray_hosted_buffer_and_workers"
TRL_PAST_DEADLINE = ("tests/integrations/trl/test_trl_drain.py::test_a_sigterm_drain_past_its_deadline_stops_and_says_"
                     "how_many_tail_tokens_were_not_made_durable")
MUTATIONS += (
    Mutation("progress-resend-compares-bytes-only", "kvckpt/transitions/progress_step.py",
             "    if stored == value:\n        return True\n    name =",
             "    if True:\n        return stored == value\n    name =",
             ("tests/core/test_value_store.py::test_a_resend_after_compact_level_gets_its_first_answer",)),
    Mutation("reference-rayworker-has-no-holder", "reference/grpo.py",
             "        self.holder: str = holder or ray.get(self.actor.__ray_call__.remote(_name_after_its_actor))",
             "        self.holder: str | None = holder", (RAY_FLEET_HOLDERS,)),
    Mutation("reference-rayworkers-named-after-their-node", "reference/grpo.py",
             '    worker.holder = holder_name("actor")', "    worker.holder = holder_name()", (RAY_FLEET_HOLDERS,)),
    Mutation("sigterm-drain-says-nothing", "integrations/common/progress.py",
             "        _log.log(logging.INFO if all(r.in_time for r in reports) else logging.WARNING, "
             "drain_summary(reports))\n", "", (TRL_PAST_DEADLINE,)),
    Mutation("drain-counts-no-undurable-tail", "integrations/common/progress.py",
             "sum(len(t.ids) for t in left_over),", "0,", (TRL_PAST_DEADLINE,)),
    Mutation("server-sigterm-drains-nothing", "integrations/common/progress.py",
             "        reports = drain_all(grace)\n", "        reports = [r.drain(0.0) for r in ()]\n",
             ("tests/integrations/trl/test_trl_server_drain.py",)),
)

# issue 45 (this session, h45p16): the owner's progress path made cheaper: the message's plain arrays are
# read-only views into its immutable bytes (codec.decode_views), and each sequence's row key is built from
# its lease's prefix, built once per message.
MUTATIONS += (
    Mutation("step-message-views-a-mutable-buffer", "kvckpt/storage/progress_message.py",
             "        value = value if type(value) is bytes else bytes(value)\n", "",
             (f"{STEP}::test_a_message_in_a_mutable_buffer_is_decoded_from_a_copy",)),
    Mutation("decode-views-takes-a-mutable-buffer", "kvckpt/storage/codec.py",
             "    if type(value) is not bytes:\n        raise BadArgument(f\"decode_views needs", "    if False:\n"
             "        raise BadArgument(f\"decode_views needs",
             ("tests/core/test_codec.py::test_decode_views_checks_what_decode_checks_and_aliases_only_immutable_bytes",)),
    Mutation("decode-views-skips-the-transforms", "kvckpt/storage/codec.py",
             "        if begins is not None and not spec.transforms and spec.dtype not in TEXT_DTYPES:",
             "        if begins is not None and spec.dtype not in TEXT_DTYPES:",
             ("tests/core/test_codec.py::test_decode_views_checks_what_decode_checks_and_aliases_only_immutable_bytes",
              f"{STEP}::test_a_messages_chunks_are_the_records_record_progress_stores")),
    Mutation("step-row-key-of-the-first-lease", "kvckpt/transitions/progress_step.py",
             "gid_json[at], rows[at] + index.to_bytes(4, \"big\"), version, lease.group_id))",
             "gid_json[at], rows[0] + index.to_bytes(4, \"big\"), version, lease.group_id))",
             (f"{STEP}::test_each_sequence_lands_under_its_own_leases_row",)),
)

# issue 45 (seventeenth session, in-process): the group committer's preparer role (one waiting caller prepares
# every queued raw item while the batch before is written; a writer takes only the prepared head of the queue) and
# its targeted wakeups (a caller is woken when its items are done, or to take a free role).
GROUP_COMMIT = "tests/core/test_group_commit.py"
MUTATIONS += (
    Mutation("group-commit-two-preparers-at-once", "kvckpt/storage/group_commit.py",
             "        return not self._preparing and self._raw > 0\n", "        return self._raw > 0\n",
             (f"{GROUP_COMMIT}::test_one_waiting_caller_prepares_every_queued_item_while_the_batch_before_is_written",)),
    Mutation("group-commit-writer-passes-an-item-being-prepared", "kvckpt/storage/group_commit.py",
             "        batch, self._queue = self._queue[:n], self._queue[n:]\n",
             "        batch = [p for p in self._queue if p.stage == _READY][:self.max_batch]\n"
             "        self._queue = [p for p in self._queue if p not in batch]\n",
             (f"{GROUP_COMMIT}::test_a_writer_never_passes_an_item_still_being_prepared",)),
    Mutation("group-commit-free-role-handed-to-nobody", "kvckpt/storage/group_commit.py",
             "        if self._idle and (self._may_prepare() or self._may_write()):\n",
             "        if False:\n",
             (f"{GROUP_COMMIT}::test_a_writer_never_passes_an_item_still_being_prepared",)),
    Mutation("group-commit-prepare-refusal-left-in-the-queue", "kvckpt/storage/group_commit.py",
             "                p.result = exc\n                refused.append(p)\n", "                p.result = exc\n",
             (f"{GROUP_COMMIT}::test_what_prepare_raises_is_a_refusal_of_its_item_or_raised_to_its_caller",)),
    Mutation("group-commit-prepare-failure-returned-not-raised", "kvckpt/storage/group_commit.py",
             "            if p.raises:\n", "            if False:\n",
             (f"{GROUP_COMMIT}::test_what_prepare_raises_is_a_refusal_of_its_item_or_raised_to_its_caller",)),
    # Store.write_each runs a batch in the durable transaction itself; a refusal after writes reruns it nested
    Mutation("write-each-keeps-a-refusals-writes", "kvckpt/storage/store.py",
             "                    if txn.writes != before:", "                    if False:",
             (f"{GROUP_COMMIT}::test_a_batch_runs_in_one_transaction_and_a_refusal_after_writes_makes_it_run_again_nested",)),
    Mutation("write-each-always-nested", "kvckpt/storage/store.py",
             "            return self.write(flat)\n", "            raise _Replay\n",
             (f"{GROUP_COMMIT}::test_a_batch_runs_in_one_transaction_and_a_refusal_after_writes_makes_it_run_again_nested",)),
    # the edge encoder keeps each Lease object's document (by the object, never a dict's)
    Mutation("encoder-lease-docs-by-id-alone", "kvckpt/storage/progress_message.py",
             "            if known is None or known[0] is not lease:\n", "            if known is None:\n",
             (f"{STEP}::test_the_encoder_keeps_a_leases_document_by_object_and_never_a_dicts",)),
    Mutation("encoder-keeps-a-dict-leases-document", "kvckpt/storage/progress_message.py",
             "    return params is not None and params.frozen and hasattr(value, \"to_dict\")\n",
             "    return True\n",
             (f"{STEP}::test_the_encoder_keeps_a_leases_document_by_object_and_never_a_dicts",)),
    Mutation("txn-delete-not-counted-as-a-write", "kvckpt/storage/txn.py",
             "        self.writes += 1\n        found = self.raw.delete(", "        found = self.raw.delete(",
             (f"{GROUP_COMMIT}::test_a_batch_runs_in_one_transaction_and_a_refusal_after_writes_makes_it_run_again_nested",)),
)

# issue 49 (this session): the verl side's cover, which makes the kill campaign's coverage of every ledger call kind
# hold on every timeline (a run's first child acknowledges every kind before it says it is ready). Run with
# --python "$PWD/.venv-verl/bin/python".
MUTATIONS += (
    Mutation("verl-campaign-start-skips-the-cover", "integrations/verl/campaign.py",
             "    writer.restart()\n    writer.cover()\n", "    writer.restart()\n",
             ("tests/integrations/verl/test_verl_campaign.py::"
              "test_a_runs_first_child_acknowledges_every_kind_before_its_start_returns",)),
)


# issue 45 (seventeenth session, vllm): the vLLM backend's streaming requests ask only for what a row keeps (no
# per-step text, the sampled token's logprob only), and ``min_tokens`` (a fixed amount of work for the on/off
# benchmark) reaches every request, capped and counted with the prefix. Run with --python "$PWD/.venv-vllm/bin/python"
# (the test skips without vLLM: every mutant is then reported "not run").
VLLM_REQUESTS = ("tests/integrations/vllm/test_worker.py::"
                 "test_vllm_requests_ask_for_what_the_rows_keep_and_min_tokens_fixes_the_length",)
MUTATIONS += (
    Mutation("vllm-stream-detokenizes-every-step", "integrations/vllm/backends.py",
             "detokenize=False, output_kind=RequestOutputKind.DELTA", "output_kind=RequestOutputKind.DELTA",
             VLLM_REQUESTS),
    Mutation("vllm-stream-asks-for-top-logprobs", "integrations/vllm/backends.py",
             "SamplingParams(n=1, logprobs=0,", "SamplingParams(n=1, logprobs=1,", VLLM_REQUESTS),
    Mutation("vllm-stream-min-tokens-ignores-the-prefix", "integrations/vllm/backends.py",
             "max(0, self.min_tokens - len(seq.prefix_ids))", "self.min_tokens", VLLM_REQUESTS),
    Mutation("vllm-generate-min-tokens-uncapped", "integrations/vllm/backends.py",
             "min_tokens=min(self.min_tokens, max_tokens)", "min_tokens=self.min_tokens", VLLM_REQUESTS),
    Mutation("vllm-generate-drops-min-tokens", "integrations/vllm/backends.py",
             "min_tokens=min(self.min_tokens, max_tokens)", "min_tokens=0", VLLM_REQUESTS),
)


def copy_tree(dest: Path, rev: str | None, root: Path = ROOT) -> None:
    """Put ``root``'s work tree's tracked and unignored files (or commit ``rev``) under ``dest``, and
    map ``integrations``/``reference``/``tools`` into the package the way the build does."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], check=True, capture_output=True).stdout
        for name in filter(None, listed.decode().split("\0")):
            source = root / name
            if source.is_file():  # a tracked file deleted in the work tree is skipped
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)
    for folder, inside in MAPPED.items():
        if (dest / folder).is_dir() and not (dest / inside).exists():
            (dest / inside).symlink_to(Path("..") / folder)


def module_of(file: str) -> str | None:
    """The import name of a library file, or ``None`` for tests, scripts and non-Python files."""
    path = Path(file)
    if path.suffix != ".py":
        return None
    top = path.parts[0]
    if top == "kvckpt":
        parts = list(path.with_suffix("").parts)
    elif top in MAPPED:
        parts = ["kvckpt", *path.with_suffix("").parts]
    else:
        return None
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports(python: str, copy: Path, files: list[str]) -> None:
    """Refuse to go on unless ``kvckpt`` and every mutated module import from ``copy``. A mutated module that
    does not import with ``python`` at all (an integration whose peer it lacks: ``PeerMissing``) is named and
    passed over: it is found through ``kvckpt``'s own path, and its tests skip (the mutation is ``not run``)."""
    modules = sorted({"kvckpt", *filter(None, map(module_of, files))})
    code = ("import importlib, os, sys\n"
            f"root = os.path.realpath({str(copy)!r})\n"
            f"for name in {modules!r}:\n"
            "    try:\n"
            "        where = os.path.realpath(importlib.import_module(name).__file__)\n"
            "    except Exception as exc:\n"
            "        if name == 'kvckpt':\n"
            "            raise\n"
            "        print(f'import check: {name} does not import here ({type(exc).__name__}: {exc})')\n"
            "        continue\n"
            "    if not where.startswith(root + os.sep):\n"
            "        sys.exit(f'{name} imports from {where}, not from the copy {root}')\n")
    done = subprocess.run([python, "-c", code], cwd=copy, env=environment(copy), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"mutation_check: {done.stderr.strip() or done.stdout.strip()}")
    if done.stdout.strip():
        print(done.stdout.strip())


def run_tests(python: str, copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """Run ``tests`` in ``copy``; the pytest exit status (``None`` on timeout) and its output."""
    command = [python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(command, cwd=copy, env=environment(copy), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f}s"
    return done.returncode, done.stdout + done.stderr


def failed_tests(output: str) -> list[str]:
    """The failed test functions of a pytest output, parametrizations folded: ``test_x[a,b]``."""
    cases: dict[str, list[str]] = {}
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            test = line.split()[1].split("::")[-1]
            name, _, case = test.partition("[")
            cases.setdefault(name, []).extend([case.rstrip("]")] if case else [])
    return [f"{name}[{','.join(ids)}]" if ids else name for name, ids in cases.items()]


def counts(output: str) -> dict[str, int]:
    """pytest's closing tally (``3 passed, 2 skipped in 1.0s``) as ``{"passed": 3, "skipped": 2}``."""
    for line in reversed(output.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b", line)
        if found and " in " in line:
            return {("error" if what == "errors" else what): int(n) for n, what in found}
    return {}


def skip_reasons(output: str) -> list[str]:
    """The distinct reasons of pytest's ``SKIPPED [n] where: reason`` lines (``-rs``), in order."""
    reasons = [line.split(": ", 1)[-1].strip() for line in output.splitlines() if line.startswith("SKIPPED ")]
    return list(dict.fromkeys(reasons))


def skipped_at_import(python: str, copy: Path, tests: tuple[str, ...], timeout: float) -> dict[str, str]:
    """The targets of ``tests`` whose file (or folder) collects nothing because it skips at import (a module-level
    ``importorskip`` of a peer this interpreter lacks), each with pytest's reason. pytest refuses a node id into
    such a file ("found no collectors"), so these are not passed to it."""
    files = tuple(dict.fromkeys(t.split("::")[0] for t in tests))
    status, output = run_tests(python, copy, ("--collect-only", *files), timeout)
    collected = {line.split("::")[0] for line in output.splitlines()
                 if "::" in line and not line.startswith(("SKIPPED", "ERROR", "FAILED"))}
    found = [re.match(r"SKIPPED \[\d+\] (.+?):\d+: (.*)$", line) for line in output.splitlines()]
    reasons = {m[1]: m[2].strip() for m in found if m}
    if status not in (0, 5) or not reasons:
        return {}  # a collection error: the runs themselves report it
    out = {}
    for file in files:
        if not any(c == file or c.startswith(file.rstrip("/") + "/") for c in collected):
            out[file] = reasons.get(file) or "; ".join(dict.fromkeys(reasons.values()))
    return {t: out[t.split("::")[0]] for t in tests if t.split("::")[0] in out}


def verdict_of(status: int | None, output: str, elsewhere: list[str] = ()) -> tuple[str, str]:
    """``(verdict, detail)`` of one mutant's pytest run: killed, survived, not run or error (see the module
    docstring); ``elsewhere``: the reasons of aimed targets skipped at import, not passed to pytest (``status``
    ``None`` and no output when none was left). A run whose every aimed test was skipped tried nothing: it is
    ``not run``, never ``survived``."""
    tally = counts(output)
    reasons = list(dict.fromkeys([*elsewhere, *skip_reasons(output)]))
    skipped = "; ".join(reasons) or "skipped"
    if status == 1:
        return "killed", ""
    if (status == 0 or not output) and reasons and not tally.get("passed") and not tally.get("xpassed"):
        return "not run", skipped
    if status == 0:
        return "survived", f"aimed test(s) skipped: {skipped}" if reasons else ""
    return "error", output.strip().splitlines()[-1] if output.strip() else f"status {status}"


def apply(copy: Path, mutation: Mutation) -> str | None:
    """Write the mutant into ``copy``; returns the original text, or ``None`` if ``old`` does not
    occur ``count`` times."""
    path = copy / mutation.file
    if not path.is_file():
        return None
    original = path.read_text()
    found = original.count(mutation.old)
    if not found or (mutation.count is not None and found != mutation.count):
        return None
    path.write_text(original.replace(mutation.old, mutation.new))
    return original


def check(mutations: list[Mutation], *, python: str, rev: str | None, timeout: float,
          keep: bool = False, show: bool = False, root: Path = ROOT) -> list[Outcome] | None:
    """Run every mutation against one scratch copy of ``root`` (restored after each); ``None`` if the
    unmutated copy already fails the named tests."""
    copy = Path(tempfile.mkdtemp(prefix="kvckpt-mut-"))
    try:
        copy_tree(copy, rev, root)
        check_imports(python, copy, [m.file for m in mutations])
        every_test = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        skips = skipped_at_import(python, copy, every_test, timeout)
        runnable = tuple(t for t in every_test if t not in skips)
        status, output = run_tests(python, copy, runnable, timeout) if runnable else (0, "")
        if status != 0:
            print(f"baseline: the unmutated copy fails its tests (status {status}):\n{output[-3000:]}")
            return None
        reasons = "; ".join(dict.fromkeys([*skips.values(), *skip_reasons(output)]))
        print(f"baseline: {len(every_test)} test target(s) pass on the unmutated copy ({copy})"
              + (f"; {len(skips)} skipped at import, {counts(output).get('skipped', 0)} test(s) skipped: {reasons}"
                 if reasons else ""))
        outcomes = []
        for mutation in mutations:
            original = apply(copy, mutation)
            if original is None:
                times = mutation.count or "at least 1"
                detail = f"old text not found {times} time(s) in {mutation.file}"
                outcomes.append(Outcome(mutation, "n/a", detail=detail))
                continue
            t0 = time.monotonic()
            aimed = tuple(t for t in mutation.tests if t not in skips)
            try:
                status, output = run_tests(python, copy, aimed, timeout) if aimed else (None, "")
            finally:
                (copy / mutation.file).write_text(original)
            verdict, detail = verdict_of(status, output, [skips[t] for t in mutation.tests if t in skips])
            outcomes.append(Outcome(mutation, verdict, time.monotonic() - t0, detail, failed_tests(output)))
            print(f"  {mutation.name}: {verdict}" + (f" ({detail})" if verdict == "not run" else ""), flush=True)
            if show:
                summary = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
                print("\n".join(f"    {line}" for line in summary or output.splitlines()[-5:]))
        return outcomes
    finally:
        if keep:
            print(f"scratch copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


#: Every verdict, in the order the table's closing tally counts them.
VERDICTS = ("killed", "survived", "not run", "error", "n/a")


def passed(outcomes: list[Outcome], *, require_all: bool = False) -> bool:
    """Whether the run passes: every mutation killed, or not run (its aimed tests all skipped) unless
    ``require_all``. A survivor, an error or an ``n/a`` fails it."""
    return all(o.verdict == "killed" or (o.verdict == "not run" and not require_all) for o in outcomes)


def table(outcomes: list[Outcome]) -> str:
    """The killed/survived table, one mutation a line, with the test that killed it."""
    width = max(len(o.mutation.name) for o in outcomes)
    lines = [f"{'mutation':<{width}}  verdict   seconds  killed by / detail"]
    for o in outcomes:
        why = ", ".join(o.failed) if o.verdict == "killed" else o.detail
        lines.append(f"{o.mutation.name:<{width}}  {o.verdict:<8}  {o.seconds:7.1f}  {why}")
    tally = {v: sum(o.verdict == v for o in outcomes) for v in VERDICTS}
    lines.append(", ".join(f"{n} {v}" for v, n in tally.items()))
    return "\n".join(lines)


# issue 47 (this session): progress from NeMo-RL's Ray generation workers (the launcher's worker class, the key's
# progress settings, the desk in the store's process). The Ray crash test's fixture runs three fresh processes with
# a fresh Ray each (about 3 minutes here).
NEMO_RL_RAY = "tests/integrations/nemo_rl/test_nemo_rl_ray_crash.py"
MUTATIONS += (
    Mutation("nemo-rl-worker-class-not-resolved", "integrations/nemo_rl/remote.py",
             "return WORKER_FQN if chosen == NEMO_RL_WORKER_FQN else chosen", "return chosen",
             (f"{NEMO_RL_LAUNCHER}::test_the_launcher_makes_nemo_rl_build_kvckpts_worker_and_key_its_rollouts",)),
    Mutation("nemo-rl-key-carries-no-progress-settings", "integrations/nemo_rl/engine.py",
             '**({} if self.settings is None else {"progress": dict(self.settings())})', "**{}",
             (f"{NEMO_RL_RAY}::test_the_ray_worker_recorded_through_the_desk_and_durable_covers_what_was_acknowledged",)),
    Mutation("nemo-rl-later-turn-keyed", "integrations/nemo_rl/engine.py",
             "            if calls == 0:  # a later turn", "            if True:  # a later turn",
             (f"{NEMO_RL_LAUNCHER}::test_a_samples_first_turn_is_keyed_with_the_progress_settings_and_a_later_turn"
              "_passes_through",)),
    Mutation("nemo-rl-desk-reads-no-prefix", "integrations/nemo_rl/remote.py",
             "value = progress_to_dict(self.core.progress(payload))", "value = {}",
             (f"{NEMO_RL_RAY}::test_the_ray_worker_recorded_through_the_desk_and_durable_covers_what_was_acknowledged",)),
    # issue 45 (seventeenth session, lead): a resumed request's prefix read off the worker's event loop
    Mutation("nemo-rl-prefix-read-on-the-loop", "integrations/nemo_rl/engine.py",
             "durable = (await asyncio.to_thread(prefixes, self.sink, lease)).get(index)",
             "durable = prefixes(self.sink, lease).get(index)",
             (f"{NEMO_RL_LAUNCHER}::test_a_resumed_requests_prefix_read_leaves_the_event_loop_free",)),
    Mutation("vllm-worker-progress-by-actor-calls", "integrations/vllm/worker.py",
             "BufferClient(actor, batch_groups=1, max_in_flight=1, channel=channel)",
             "BufferClient(actor, batch_groups=1, max_in_flight=1)",
             ("tests/integrations/ray/test_ray.py::test_a_streaming_worker_records_progress_through_the_actor_and_resumes"
              "_from_it",)),
)

# issue 45 (seventeenth session, channel): the direct progress channel into the buffer actor (h45c17): the token,
# the frame limit, one record call per round, closed by restore, not offered on a replicated primary, the link's
# in-order resend and hand-back, the error wire's classes.
CHANNEL = "tests/integrations/ray/test_ray_channel.py"
MUTATIONS += (
    Mutation("channel-skips-the-token-check", "integrations/ray/channel.py",
             "elif hmac.compare_digest(body, self.token.encode()):", "elif True:",
             (f"{CHANNEL}::test_a_wrong_token_is_closed_and_writes_nothing",)),
    Mutation("channel-frame-limit-unchecked", "integrations/ray/channel.py",
             "            if length > limit:\n", "            if False:\n",
             (f"{CHANNEL}::test_a_frame_past_the_limit_is_refused_and_its_connection_closed",)),
    Mutation("channel-records-each-frame-alone", "integrations/ray/channel.py",
             "results = self._record([body for _, _, body in frames])",
             "results = [r for _, _, body in frames for r in self._record([body])]",
             (f"{CHANNEL}::test_one_round_records_every_connections_frames_in_one_call",)),
    Mutation("channel-survives-a-restore", "integrations/ray/actor.py",
             "        await self._close_channel()\n        await self._abuf.close()",
             "        await self._abuf.close()",
             (f"{CHANNEL}::test_a_restore_closes_the_channel_and_the_next_has_a_new_token",)),
    Mutation("channel-never-offered-after-a-promotion", "integrations/ray/actor.py",
             "if self._side is not None or self._shipper is not None:",
             "if self._side is not None or self._shipper is not None or self.promoted_at is not None:",
             (f"{CHANNEL}::test_a_promoted_standby_without_a_successor_offers_a_channel",)),
    Mutation("channel-offered-on-a-replicated-primary", "integrations/ray/actor.py",
             "if self._side is not None or self._shipper is not None:", "if self._side is not None:",
             (f"{CHANNEL}::test_a_replicated_actor_offers_no_channel_and_the_client_uses_actor_calls",)),
    Mutation("channel-link-resends-only-the-newest", "integrations/ray/channel_link.py",
             "self._write([(seq, m) for seq, m, _ in self._unanswered])",
             "self._write([(seq, m) for seq, m, _ in list(self._unanswered)[-1:]])",
             (f"{CHANNEL}::test_a_killed_owner_with_frames_unanswered_gets_them_again_exactly_once",)),
    Mutation("channel-future-does-not-drive-the-link", "integrations/ray/client.py",
             "            if self._link is not None and self._link.holds(future):",
             "            if False:",
             (f"{CHANNEL}::test_a_channel_future_completes_when_waited_on_and_record_progress_many_goes_over_the_channel",)),
    Mutation("channel-link-hands-back-nothing", "integrations/ray/channel_link.py",
             "raise ChannelGone([(m, f) for _, m, f in self._unanswered])", "raise ChannelGone([])",
             (f"{CHANNEL}::test_a_link_whose_actor_stops_offering_the_channel_hands_back_what_is_unanswered",)),
    Mutation("error-wire-loses-the-class", "kvckpt/errors.py",
             "    if isinstance(cls, type) and issubclass(cls, KvckptError):", "    if False:",
             (f"{CHANNEL}::test_every_kvckpt_error_crosses_the_reply_wire_as_its_own_class",
              f"{CHANNEL}::test_the_channel_answers_as_the_actor_calls_do")),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutations", type=Path, help="a JSON file with a list of mutation objects "
                        "(instead of the built-in list)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--rev", help="mutate this commit instead of the work tree")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (default 600)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument("--show", action="store_true", help="print why each mutant's tests failed")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--require-all", action="store_true", help="fail when a mutation was not run (every "
                        "test aimed at it skipped); by default it is reported and counted, not failed")
    parser.add_argument("--root", type=Path, default=ROOT, help="the git work tree to mutate (default: this one)")
    args = parser.parse_args(argv)
    mutations = list(MUTATIONS)
    if args.mutations:
        mutations = [Mutation.from_dict(doc) for doc in json.loads(args.mutations.read_text())]
    if args.only:
        unknown = set(args.only) - {m.name for m in mutations}
        if unknown:
            parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
        mutations = [m for m in mutations if m.name in args.only]
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.file}  tests: {' '.join(m.tests)}")
        return 0
    outcomes = check(mutations, python=args.python, rev=args.rev, timeout=args.timeout, keep=args.keep,
                     show=args.show, root=args.root.resolve())
    if outcomes is None:
        return 2
    print(table(outcomes))
    return 0 if passed(outcomes, require_all=args.require_all) else 1


if __name__ == "__main__":
    sys.exit(main())
