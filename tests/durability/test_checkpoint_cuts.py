"""The cut suite: a checkpoint at every transaction boundary, racing commits, zombies, fail-closed.

NeMo-RL's race suite (replay_semantics.md §E.2) tests 17 cut points of an exclusive-barrier design.
In kvckpt every state transition is one LMDB write transaction and a checkpoint is a snapshot of one
committed state, so the only cut points that exist are the boundaries *between* transactions; this
module checkpoints at each boundary of the admit / commit / commit_sample / select / finish_step /
evict / abort / abort_stale_inflight paths (``WORKLOAD``) and restores every file in one fresh
process. How each §E.2 item maps (E.2-n is the reference's numbering):

====== ======================================================================================
E.2-1  applies: after ``admit-lookahead`` the batch of step 1 is in the ledger (leases at step 1)
       and the next admission gets ``dispatch_index + 1``; the cursor never has to recreate it.
E.2-2  does not apply as a state: fetch and admission are one transaction (the dataloader state
       is written by ``admit``), so a cut "after fetch, before admit" holds the previous
       dataloader state and no ledger entry: the prompt is fetched again (cuts ``empty``, ``admit``).
E.2-3  applies: cut ``admit``, batch admitted, nothing generated, dataloader state past it.
E.2-4  applies: ``test_checkpoint_racing_commits_lands_one_owner_per_prompt``; commits never wait.
E.2-5  cannot happen (a commit deletes the ledger entry in its own transaction); a file crafted
       with both owners is refused (``double-owner``), never repaired by "canonical wins".
E.2-6  applies: every cut; recovery admits nothing (``admitted`` unchanged), keeps the cursor and
       redispatches each ledger entry at its saved ``target_step``.
E.2-7  applies: a ledger entry in an unknown phase is refused (``phase``).
E.2-8  does not apply: there is no RESERVED phase; an admission is atomic, so prompts of one
       batch share one ``admission_id`` and one ``target_step`` from the start.
E.2-9  does not apply (no RESERVED phase); leases come back in dispatch order.
E.2-10 applies: ``test_restore_under_smaller_capacity_...``: unfinished groups need not fit.
E.2-11 does not apply: no spare pool (a replacement is ``abort`` + ``admit``, each one
E.2-12 transaction: the ``abort`` cut shows the tombstone and the shortfall, no lost owner).
E.2-13 does not apply (no reserve pool).
E.2-14 applies: a corrupt ledger record (checksum) is refused.
E.2-15 does not apply: no sidecars, one file; a truncated file is refused instead.
E.2-16 do not apply: kvckpt stores the prompt's identity (``prompt_idx``, ``task_name``);
E.2-17 rebuilding the prompt from the dataset is the trainer's job.
====== ======================================================================================
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading

import lmdb
import pytest
from _scenarios import (
    SCENARIOS,
    Driver,
    N,
    build_scenario,
    file_sha256,
    make_row,
    new_buffer,
    run_fresh,
    saved_view,
)

from kvckpt import CheckpointError, Prompt
from kvckpt.storage import codec
from kvckpt.storage.store import FORMAT_VERSION, Store
from kvckpt.tables.records import GroupInfo, LedgerEntry

CUT_SAMPLERS = ("in_order", "windowed")
#: (label, trainer_version, in_order dispatch_index, dataloader state) of every cut, in order.
WORKLOAD = (
    ("empty", 0, -1, None),
    ("admit", 0, 0, "after=g02"),
    ("admit-lookahead", 0, 1, "after=g06"),
    ("commit-group", 0, 1, "after=g06"),
    ("commit-sample", 0, 1, "after=g06"),
    ("commit-sample-completes", 0, 1, "after=g06"),
    ("commit-next-batch", 0, 1, "after=g06"),
    ("select", 0, 1, "after=g06"),
    ("finish", 1, 1, "after=g06"),
    ("admit-after-finish", 1, 2, "after=g09"),
    ("abort", 1, 2, "after=g09"),
    ("commit-completes-step-1", 1, 2, "after=g09"),
    ("select-short", 1, 2, "after=g09"),
    ("finish-short", 2, 2, "after=g09"),
    ("select-streaming", 2, 2, "after=g09"),
    ("finish-streaming", 3, 2, "after=g09"),
    ("commit-late", 3, 2, "after=g09"),
    ("evict", 3, 2, "after=g09"),
    ("abort-stale-inflight", 3, 2, "after=g09"),
)
LABELS = [label for label, *_ in WORKLOAD]


def run_workload(directory: str, sampler: str) -> list[dict]:
    """Drive one buffer through ``WORKLOAD``, checkpointing after every transaction."""
    cuts: list[dict] = []
    with new_buffer(os.path.join(directory, "live-src"), sampler, lag=1) as buf:
        d = Driver(buf)

        def cut(label: str) -> None:
            path = os.path.join(directory, f"{len(cuts):02d}-{label}.kvckpt")
            view = saved_view(buf)
            buf.checkpoint(path, {"cut": len(cuts), "label": label}).wait()
            zombies = [d.leases[gid].to_dict() for gid in view["ledger"]]
            cuts.append({"label": label, "ckpt": path, "saved": view, "zombies": zombies})

        cut("empty")
        d.admit("g00 g01 g02", target=0)
        cut("admit")
        d.admit("g03 g04 g05 g06", target=1)  # g06 is a straggler that never finishes
        cut("admit-lookahead")
        d.commit("g00")
        cut("commit-group")
        d.commit(["g01"], 1)
        cut("commit-sample")
        buf.commit_sample(d.leases["g01"], 1, make_row("g01", 1))
        cut("commit-sample-completes")
        d.commit("g02")
        d.commit(["g03"], 1)
        cut("commit-next-batch")
        d.select(["g00", "g01", "g02"])
        cut("select")
        buf.finish_step()
        cut("finish")
        d.admit("g07 g08 g09", target=2)
        cut("admit-after-finish")
        buf.abort("g04", "dropped by the trainer")
        cut("abort")
        d.commit("g05")
        buf.commit_sample(d.leases["g03"], 1, make_row("g03", 1))
        cut("commit-completes-step-1")
        d.select(["g03", "g05"])
        cut("select-short")
        buf.finish_step()
        cut("finish-short")
        d.commit("g07 g08")
        d.select(["g07", "g08"])
        cut("select-streaming")
        buf.finish_step()
        cut("finish-streaming")
        d.commit("g09")
        cut("commit-late")
        assert buf.evict() == ["g09"]
        cut("evict")
        assert buf.abort_stale_inflight() == ([] if sampler == "in_order" else ["g06"])
        cut("abort-stale-inflight")
    return cuts


def run_race(directory: str) -> list[dict]:
    """A producer thread admits and commits without pause while the main thread checkpoints,
    trains and evicts. Returns the checkpoints taken (each after the producer moved on)."""
    buf = new_buffer(os.path.join(directory, "race-src"), {"name": "windowed", "max_staleness_versions": 1},
                     capacity=4096)
    stop = threading.Event()
    progress = threading.Condition()
    done = [0]  # admissions whose admit() has returned
    errors: list[BaseException] = []

    def producer() -> None:
        partial = []  # groups with their first sibling committed, oldest first
        try:
            for i in itertools.count():
                if stop.is_set():
                    return
                [lease] = buf.admit([Prompt(prompt_idx=i, group_id=f"r{i:05d}")],
                                    dataloader_state=f"r:{i + 1}".encode())
                with progress:
                    done[0] += 1
                    progress.notify_all()
                if i % 3 == 0:
                    buf.commit_group(lease, [make_row(lease.group_id, k) for k in range(N)])
                else:
                    buf.commit_sample(lease, 0, make_row(lease.group_id, 0))
                    partial.append(lease)
                if len(partial) > 2:
                    old = partial.pop(0)
                    buf.commit_sample(old, 1, make_row(old.group_id, 1))
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=producer)
    thread.start()
    checkpoints = []
    floor = 0  # admissions the last checkpoint may hold: the returned ones plus the one under way
    try:
        for k in range(8):
            # At least five admissions return after the last checkpoint's stamp before the next one
            # (counted, not a semaphore's tokens: those could be left over from before the stamp,
            # so two checkpoints could hold the same prompts).
            with progress:
                moved_on = progress.wait_for(lambda floor=floor: done[0] >= floor + 5 or errors, timeout=300)
            assert moved_on, "the producer stopped admitting"
            assert not errors, errors
            path = os.path.join(directory, f"race-{k}.kvckpt")
            checkpoints.append({"ckpt": path, "handle": buf.checkpoint(path, {"race": k})})
            with progress:
                floor = done[0] + 1
            buf.select(1, 3)
            buf.finish_step()
            buf.evict()
        for c in checkpoints:
            c.pop("handle").wait()
    finally:
        stop.set()
        thread.join()
        buf.close()
    assert not errors, errors
    return checkpoints


# -- crafted files ---------------------------------------------------------------------------------
def _edit(path: str, fn) -> None:
    """Rewrite records of a *copy* with the raw store API, as a damaged or forged file would be."""
    with Store(path) as store:
        store.write(fn)
    os.unlink(path + "-lock")


def _doc(txn, table: str, key: bytes) -> dict:
    return codec.decode_meta(txn.get(table, key))


def _put_doc(txn, table: str, key: bytes, **changes) -> None:
    txn.put_json(table, key, {**_doc(txn, table, key), **changes})


def _flip_last_byte(txn, table: str, key: bytes) -> None:
    value = bytearray(txn.get(table, key))
    value[-1] ^= 0x5A
    txn.put(table, key, bytes(value))


def _double_owner(txn) -> None:  # g12 is in flight; forge a committed group record for it too
    entry = LedgerEntry.from_dict(_doc(txn, "ledger", b"g12"))
    group = GroupInfo(entry.group_id, entry.prompt_idx, entry.task_name, entry.admission_id, entry.seq, N,
                      "ready", entry.start_weight, 5, entry.target_step, entry.attempt, "", rows_stored=False)
    txn.put_json("groups", b"g12", group.to_dict())


def _cursor_behind(txn) -> None:
    _put_doc(txn, "meta", b"state", dispatch_index=3)


FORGERIES = {
    # name: (edit of a copy of the base checkpoint, error class, text the message must contain)
    "ledger-entry-also-committed": (_double_owner, "VerificationFailed", "[double-owner] g12"),
    "group-missing-a-row": (lambda t: t.delete("rows", b"g13\0" + (1).to_bytes(4, "big")),
                            "VerificationFailed", "[row-set] g13: stored rows [0] != 0..1"),
    "group-with-an-extra-row": (lambda t: t.put("rows", b"g13\0" + (2).to_bytes(4, "big"),
                                                t.get("rows", b"g13\0" + (1).to_bytes(4, "big"))),
                                "VerificationFailed", "[row-set] g13: stored rows [0, 1, 2] != 0..1"),
    "wrong-group-size": (lambda t: _put_doc(t, "groups", b"g13", group_size=3),
                         "VerificationFailed", "[group-size] g13"),
    "cursor-behind-target-step": (_cursor_behind, "VerificationFailed",
                                  "dispatch_index 3 is behind the largest target_step 5"),
    "unknown-ledger-phase": (lambda t: _put_doc(t, "ledger", b"g14", phase="reserved"),
                             "VerificationFailed", "[phase] g14"),
    "group-checksum": (lambda t: _flip_last_byte(t, "groups", b"g13"), "VerificationFailed",
                       "[corrupt-record] groups/g13"),
    "ledger-checksum": (lambda t: _flip_last_byte(t, "ledger", b"g14"), "VerificationFailed",
                        "[corrupt-record] ledger/g14"),
    "stamp-checksum": (lambda t: _flip_last_byte(t, "meta", b"checkpoint"), "CorruptRecord", "meta/checkpoint"),
    "newer-format-version": (lambda t: _put_doc(t, "meta", b"format", version=FORMAT_VERSION + 1), "FormatError",
                             f"format version {FORMAT_VERSION + 1}"),
    # found by the fuzz soak: the error named the temporary copy and said "create it"
    "config-missing": (lambda t: t.delete("meta", b"config"), "FormatError",
                       "forged-config-missing.kvckpt' is a kvckpt store without a replay buffer config"),
}

#: Damaged rows: restore() does not read rows (its cost follows the metadata), so each is refused
#: where it is read: read_batch of its group raises (error class, text), the other groups read.
ROW_FORGERIES = {
    "duplicated-row": (lambda t: t.put("rows", b"g13\0" + (1).to_bytes(4, "big"),
                                       t.get("rows", b"g13\0" + (0).to_bytes(4, "big"))),
                       "CorruptRecord", "groups/g13"),
    "row-checksum": (lambda t: _flip_last_byte(t, "rows", b"g13\0" + (0).to_bytes(4, "big")), "CorruptRecord",
                     "rows/g13_g0"),
}


def capacity_store(directory: str) -> str:
    """windowed, W=0: nine ready groups g00..g08 and two in flight (g09, g10), checkpointed."""
    path = os.path.join(directory, "capacity.kvckpt")
    with new_buffer(os.path.join(directory, "capacity-src"), "windowed", lag=0) as buf:
        d = Driver(buf)
        d.admit([f"g{i:02d}" for i in range(11)])
        d.commit([f"g{i:02d}" for i in range(9)])
        buf.checkpoint(path).wait()
    return path


def forge(directory: str, base: str) -> dict[str, str]:
    """Damaged or forged copies of ``base`` (plus files that are not checkpoints at all)."""
    files = {}
    for name, (edit, _, _) in (FORGERIES | ROW_FORGERIES).items():
        path = os.path.join(directory, f"forged-{name}.kvckpt")
        shutil.copyfile(base, path)
        _edit(path, edit)
        files[name] = path
    files["random-bytes"] = os.path.join(directory, "random.kvckpt")
    with open(files["random-bytes"], "wb") as f:
        f.write(os.urandom(8192))
    files["foreign-lmdb"] = os.path.join(directory, "foreign.mdb")
    with lmdb.open(files["foreign-lmdb"], subdir=False) as env, env.begin(write=True) as txn:
        txn.put(b"model", b"weights")
    files["live-store-never-checkpointed"] = os.path.join(directory, "never.kv")
    with new_buffer(files["live-store-never-checkpointed"], "in_order") as buf:
        buf.admit([Prompt(prompt_idx=1)])
    files["truncated"] = os.path.join(directory, "truncated.kvckpt")
    with open(base, "rb") as src, open(files["truncated"], "wb") as dst:
        dst.write(src.read(os.path.getsize(base) - 4096))
    return files


NOT_CHECKPOINTS = {
    "random-bytes": ("FormatError", "not an LMDB file"),
    "foreign-lmdb": ("FormatError", "not a kvckpt store"),
    "live-store-never-checkpointed": ("RecoveryError", "not a checkpoint"),
    "truncated": ("FormatError", "truncated"),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Builds every file of this module, restores them all in one fresh process."""
    root = str(tmp_path_factory.mktemp("cuts"))
    jobs, index = [], {}

    def add(key, **job):
        index[key] = len(jobs)
        jobs.append({"live": os.path.join(root, f"live-{len(jobs)}.kv"), **job})

    cuts = {}
    for sampler in CUT_SAMPLERS:
        directory = os.path.join(root, sampler)
        os.makedirs(directory)
        cuts[sampler] = run_workload(directory, sampler)
        for c in cuts[sampler]:
            add((sampler, c["label"]), ckpt=c["ckpt"], zombies=c["zombies"], probe=True)
    race = run_race(root)
    for k, c in enumerate(race):
        add(("race", k), ckpt=c["ckpt"])
    build_scenario(root, "in_order", next(sc for sc in SCENARIOS if sc.name == "lag1-next-step-partly-generated"))
    base = os.path.join(root, "lag1-next-step-partly-generated.kvckpt")
    for name, path in forge(root, base).items():
        add(("forged", name), ckpt=path, read=name in ROW_FORGERIES)
    windowed = next(c for c in cuts["windowed"] if c["label"] == "commit-completes-step-1")
    add(("switch", "windowed->in_order"), ckpt=windowed["ckpt"], probe=True, complete=True, evict=True, train=True,
        sampler={"name": "in_order", "max_lookahead_versions": 1})
    add(("switch", "in_order->ready_first"), ckpt=base, train=True, complete=True,
        sampler={"name": "ready_first", "max_staleness_versions": 1})
    capacity = capacity_store(root)
    add(("capacity", "deadlocks-the-sampler"), ckpt=capacity, capacity=2)
    add(("capacity", "below-ready"), ckpt=capacity, capacity=6)
    existing = os.path.join(root, "existing-live.kv")
    with new_buffer(existing, "windowed", lag=0) as buf:
        Driver(buf).admit("g50 g51")
    add(("capacity", "refused-over-existing-live"), ckpt=capacity, capacity=6, overwrite=True,
        live_before=file_sha256(existing))
    jobs[-1]["live"] = existing
    add(("capacity", "unfinished-need-not-fit"), ckpt=capacity, capacity=10, probe=True, train=True)
    results = run_fresh(jobs, root)
    return {"cuts": cuts, "race": race, "jobs": {key: jobs[i] for key, i in index.items()},
            "get": lambda key: results[index[key]]}


def restored(suite, key):
    got = suite["get"](key)
    assert "error" not in got, got
    return got


# -- every transaction boundary --------------------------------------------------------------------
def test_the_workload_cuts_at_every_boundary(suite):
    for sampler in CUT_SAMPLERS:
        assert [c["label"] for c in suite["cuts"][sampler]] == LABELS


@pytest.mark.parametrize("sampler", CUT_SAMPLERS)
@pytest.mark.parametrize(("label", "version", "dispatch", "dataloader"), WORKLOAD, ids=LABELS)
def test_cut_restores_exact_cursors_and_one_owner_per_prompt(suite, sampler, label, version, dispatch, dataloader):
    c = next(c for c in suite["cuts"][sampler] if c["label"] == label)
    saved, got = c["saved"], restored(suite, (sampler, label))
    dispatch = dispatch if sampler == "in_order" else -1
    # cursors: exactly the saved ones
    assert saved["trainer_version"] == got["plan"]["resume_version"] == got["state"]["trainer_version"] == version
    assert saved["dispatch_index"] == got["plan"]["dispatch_index"] == got["state"]["dispatch_index"] == dispatch
    assert saved["dataloader"] == got["dataloader"] == dataloader
    assert got["trainer_state"] == {"cut": LABELS.index(label), "label": label}
    # single owner: every prompt that left the dataloader is a group or a ledger entry, never both
    groups, ledger = set(got["groups"]), set(got["ledger"])
    assert not groups & ledger
    assert groups | ledger == set(saved["groups"]) | set(saved["ledger"])
    assert len(groups) + len(ledger) == saved["admitted"] == got["state"]["counters"]["admitted"]
    # the same records, claims of the interrupted step undone, nothing re-admitted (E.2-6)
    for gid, doc in saved["groups"].items():
        want = dict(doc)
        if want["state"] == "claimed":
            want.update(state="ready", claimed_step=None)
        assert got["groups"][gid] == want, gid
    assert got["plan"]["groups_returned_to_ready"] == sum(d["state"] == "claimed" for d in saved["groups"].values())
    assert got["shortfall"] == saved["shortfall"]
    assert {lease["group_id"] for lease in got["leases"]} == ledger == set(saved["ledger"])
    assert got["plan"]["groups_redispatched"] == len(ledger)
    for lease in got["leases"]:
        before = saved["ledger"][lease["group_id"]]
        assert lease["attempt"] == before["attempt"] + 1
        assert lease["target_step"] == before["target_step"]
        assert lease["missing"] == [i for i in range(N) if i not in before["siblings"]]
    assert got["verify"] == []


@pytest.mark.parametrize("label", LABELS)
def test_next_admission_after_restore_continues_the_cursor(suite, label):
    version, dispatch = next((v, d) for lab, v, d, _ in WORKLOAD if lab == label)
    got = restored(suite, ("in_order", label))
    assert got["probe"] == (dispatch + 1 if dispatch < version + 1 else "GateTimeout")
    assert restored(suite, ("windowed", label))["probe"] is None  # ungated: no stamp, no cursor


def test_e2_1_and_3_the_admitted_batch_is_owned_not_recreated(suite):
    got = restored(suite, ("in_order", "admit-lookahead"))
    assert {lease["group_id"]: lease["target_step"] for lease in got["leases"]} == {
        "g00": 0, "g01": 0, "g02": 0, "g03": 1, "g04": 1, "g05": 1, "g06": 1}
    assert len({lease["admission_id"] for lease in got["leases"] if lease["target_step"] == 1}) == 1
    assert got["dataloader"] == "after=g06" and got["probe"] == "GateTimeout"  # 1 >= 0 + lookahead 1


@pytest.mark.parametrize("sampler", CUT_SAMPLERS)
def test_zombie_commits_after_restore_are_refused_and_write_nothing(suite, sampler):
    seen = 0
    for c in suite["cuts"][sampler]:
        got = restored(suite, (sampler, c["label"]))
        if not c["zombies"]:
            continue
        seen += len(c["zombies"])
        assert got["zombies"] == {"results": ["AbandonedTimeline"] * len(c["zombies"]), "unchanged": True}, c["label"]
    assert seen > 30  # whole-group and one-sibling zombies at most boundaries


# -- racing commits --------------------------------------------------------------------------------
def test_checkpoint_racing_commits_lands_one_owner_per_prompt(suite):
    admitted = []
    for k, _ in enumerate(suite["race"]):
        got = restored(suite, ("race", k))
        count = got["state"]["counters"]["admitted"]
        owners = list(got["groups"]) + list(got["ledger"])
        assert len(owners) == len(set(owners)) == count
        prompts = sorted(doc["prompt_idx"] for doc in [*got["groups"].values(), *got["ledger"].values()])
        assert prompts == list(range(count))
        assert got["dataloader"] == f"r:{count}"  # the cursor names exactly the prompts owned
        assert all(rows["equal"] and len(rows["ids"]) == N for rows in got["rows"].values())
        assert got["verify"] == [] and got["trainer_state"] == {"race": k}
        admitted.append(count)
    assert admitted == sorted(admitted) and len(set(admitted)) == len(admitted)
    assert any(restored(suite, ("race", k))["ledger"] for k in range(len(admitted)))


# -- restoring under another sampler or capacity ---------------------------------------------------
def test_restore_under_another_sampler_restamps_and_reports(suite):
    got = restored(suite, ("switch", "windowed->in_order"))
    assert got["plan"]["changes"] == [
        "sampler {'name': 'windowed', 'max_staleness_versions': 1, 'sample_freshest_first': False} -> "
        "{'name': 'in_order', 'max_lookahead_versions': 1}",
        "stamped 2 ready groups and 4 in-flight prompts with target steps 1..2 (3 per step, in dispatch order)"]
    ready = {gid: doc["target_step"] for gid, doc in got["groups"].items() if doc["state"] == "ready"}
    assert ready == {"g03": 1, "g05": 1}
    assert {lease["group_id"]: lease["target_step"] for lease in got["leases"]} == {
        "g06": 1, "g07": 2, "g08": 2, "g09": 2}
    assert got["state"]["dispatch_index"] == 2 and got["probe"] == "GateTimeout"  # 2 >= version 1 + lookahead 1
    # every generated group is trained, none stranded behind the cursor and evicted
    assert got["evicted"] == []
    assert [step["gids"] for step in got["steps"]] == [["g03", "g05", "g06"], ["g07", "g08", "g09"]]
    assert got["verify"] == []
    other = restored(suite, ("switch", "in_order->ready_first"))
    assert other["plan"]["changes"] == ["sampler {'name': 'in_order', 'max_lookahead_versions': 1} -> "
                                        "{'name': 'ready_first', 'max_staleness_versions': 1}"]
    assert [step["gids"] for step in other["steps"]] == [["g12", "g13", "g14"]]


def test_restore_under_a_capacity_that_deadlocks_the_sampler_is_refused(suite):
    got = suite["get"](("capacity", "deadlocks-the-sampler"))
    assert got["error"] == "CapacityError" and "max_buffered_rollouts=2" in got["message"], got


def test_restore_under_smaller_capacity_than_ready_groups_is_refused(suite):
    got = suite["get"](("capacity", "below-ready"))
    assert got["error"] == "RecoveryError", got
    assert "9 ready groups exceed the requested max_buffered_rollouts 6" in got["message"]


def test_refused_restore_leaves_an_existing_live_store_untouched(suite):
    job = suite["jobs"][("capacity", "refused-over-existing-live")]
    got = suite["get"](("capacity", "refused-over-existing-live"))
    assert got["error"] == "RecoveryError", got
    assert got["live_sha256"] == job["live_before"] is not None  # same bytes: not replaced, not touched


def test_restore_under_smaller_capacity_unfinished_groups_need_not_fit(suite):
    got = restored(suite, ("capacity", "unfinished-need-not-fit"))  # E.2-10: 9 ready + 2 in flight > 10
    assert got["plan"]["changes"] == ["max_buffered_rollouts 64 -> 10"]
    assert (got["state"]["ready"], got["state"]["inflight"]) == (9, 2)
    assert got["probe"] == "GateTimeout"  # capacity is full until training drains it
    assert [step["gids"] for step in got["steps"]] == [["g00", "g01", "g02"]]  # W=0: then out of window


# -- fail closed ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_checkpoint_is_refused_naming_the_problem(suite, name):
    _, error, text = FORGERIES[name]
    got = suite["get"](("forged", name))
    assert got["error"] == error, got
    assert text in got["message"]
    assert got["live_exists"] is False  # the live store is left untouched


@pytest.mark.parametrize("name", list(ROW_FORGERIES))
def test_forged_row_is_refused_where_it_is_read_and_the_other_groups_read(suite, name):
    _, error, text = ROW_FORGERIES[name]
    got = restored(suite, ("forged", name))
    reads = got["read"]
    assert reads["g13"].startswith(f"{error}: ") and text in reads["g13"], reads["g13"]
    others = {gid: outcome for gid, outcome in reads.items() if gid != "g13"}
    assert others and set(others.values()) == {"ok"}, others


@pytest.mark.parametrize("name", list(NOT_CHECKPOINTS))
def test_file_that_is_not_a_checkpoint_is_refused(suite, name):
    error, text = NOT_CHECKPOINTS[name]
    got = suite["get"](("forged", name))
    assert (got["error"], got["live_exists"]) == (error, False), got
    assert text in got["message"]


# -- writing checkpoints ----------------------------------------------------------------------------
def test_checkpoint_to_an_existing_destination_is_refused_before_stamping(tmp_path):
    with new_buffer(str(tmp_path / "live.kv"), "in_order") as buf:
        Driver(buf).admit("g00 g01 g02")
        buf.checkpoint(str(tmp_path / "a.kvckpt")).wait()
        before = buf.store.read(lambda t: t.get("meta", b"checkpoint"))
        with pytest.raises(CheckpointError, match="already exists"):
            buf.checkpoint(str(tmp_path / "a.kvckpt"), {"step": 1})
        assert buf.store.read(lambda t: t.get("meta", b"checkpoint")) == before


def test_a_destination_whose_reservation_cannot_be_made_is_refused_before_stamping(tmp_path):
    # The final name is legal (255 bytes) but its reservation ``<name>.partial`` exceeds NAME_MAX.
    dest = tmp_path / ("x" * 248 + ".kvckpt")
    with new_buffer(str(tmp_path / "live.kv"), "in_order") as buf:
        Driver(buf).admit("g00 g01 g02")
        with pytest.raises(CheckpointError, match="File name too long"):
            buf.checkpoint(str(dest), {"step": 0})
        assert buf.store.read(lambda t: t.get("meta", b"checkpoint")) is None
        assert sorted(os.listdir(tmp_path)) == ["live.kv", "live.kv-lock"]


def test_failed_copy_leaves_no_file_under_the_final_name(tmp_path):
    # A directory under the final name: the reservation and the copy succeed, the rename over it
    # fails after the stamp (a real failure, no mock).
    dest = tmp_path / "d.kvckpt"
    dest.mkdir()
    (dest / "keep").write_text("x")
    with new_buffer(str(tmp_path / "live.kv"), "in_order") as buf:
        Driver(buf).admit("g00 g01 g02")
        handle = buf.checkpoint(str(dest), {"step": 0}, overwrite=True)
        with pytest.raises(CheckpointError, match="directory"):
            handle.wait()
        assert dest.is_dir() and os.listdir(dest) == ["keep"]
        assert sorted(os.listdir(tmp_path)) == ["d.kvckpt", "live.kv", "live.kv-lock"]  # no .partial left
        assert buf.state()["durable"] == []  # a failed copy never counts as a durable checkpoint
        buf.checkpoint(str(tmp_path / "ok.kvckpt")).wait()  # and the buffer carries on


def test_a_second_checkpoint_to_a_name_being_written_is_refused_at_call_time(tmp_path):
    """Issue 20 item 6: the destination is reserved when checkpoint() is called. A checkpoint in
    progress holds ``dest.partial`` locked (here: another open file description, exactly what a
    concurrent checkpoint in another thread or process holds); a second one is refused before it
    stamps anything. Once the lock is gone the leftover reservation is reused."""
    import fcntl

    dest = tmp_path / "same.kvckpt"
    with new_buffer(str(tmp_path / "live.kv"), "in_order") as buf:
        Driver(buf).admit("g00 g01 g02")
        fd = os.open(str(dest) + ".partial", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(CheckpointError, match="still being written"):
                buf.checkpoint(str(dest), {"step": 1})
            assert buf.store.read(lambda t: t.get("meta", b"checkpoint")) is None  # nothing stamped
        finally:
            os.close(fd)  # the holder died: its reservation stays behind, unlocked
        result = buf.checkpoint(str(dest), {"step": 1}).wait()
        assert result.file_bytes > 0 and not os.path.exists(str(dest) + ".partial")
        assert oct(os.stat(dest).st_mode & 0o777) == "0o600"  # checkpoints are owner-only by default
        assert oct(os.stat(buf.path).st_mode & 0o777) == "0o600"  # and so is the store


def test_two_background_checkpoints_to_one_name_never_both_succeed(tmp_path):
    """Without a lock held by the test: two checkpoints to one name back to back. Either the
    second is refused at call time (the first still copies) or it is refused because the first's
    file now exists; it is never silently lost while the durable stamp names it."""
    dest = str(tmp_path / "same.kvckpt")
    with new_buffer(str(tmp_path / "live.kv"), "in_order") as buf:
        Driver(buf).admit("g00 g01 g02")
        first = buf.checkpoint(dest, {"step": 0})
        with pytest.raises(CheckpointError, match=r"still being written|already exists"):
            buf.checkpoint(dest, {"step": 1})
        first.wait()
        stamp = buf.store.read(lambda t: t.get_json("meta", b"checkpoint"))
        assert stamp["checkpoint_id"] == first.checkpoint_id
