"""The verl ledger's part of the kill campaign: a side workload (:mod:`kvckpt.testing.campaigns.sides`) that drives a
:class:`~.ledger.VerlLedger` (``verl.kv`` in the run directory) the way verl's trainer and rollout servers do, and
the checker of what it logged. Run it with ``run_crash_campaign(..., sides=[__name__])`` or
``python -m kvckpt.testing.campaigns.campaign --kills N --side kvckpt.integrations.verl.campaign``.

Each child restarts the run as verl does (``lrun`` :meth:`~.ledger.VerlLedger.open_run`, ``lresume``
:meth:`~.ledger.VerlLedger.resume`, ``lsettle`` :meth:`~.ledger.VerlLedger.settle_progress` keeping the prompts in
flight), then draws operations: ``lcursor`` (a dispatch: a prompt record and the dataloader cursor),
``lprog`` (a flush of token progress of an in-flight prompt, or the drop of a finished one's), ``lput`` (a prompt's
group finished: its trajectories, the put that ends it deleting its token progress in that transaction),
``lclear`` (a clear without a step), ``lconsume`` (a clear by a training step: marked once the ledger has a
checkpoint), ``lckpt`` (a checkpoint, then the purge of the marks it covers) and
``lstale`` (a put of a replaced run, which must be refused). The writer keeps a model of what the ledger must hold
(:func:`state_of`'s shape) and logs it before each call (``lintent``) and with each acknowledgement, so the checker
compares the file after a kill with the last acknowledged state, or that plus the call in flight: nothing lost,
nothing doubled. After a restart's settle, a prompt is a finished group or in flight (has progress), never both.
A run's first child makes every kind of call once before its start returns (:meth:`LedgerWriter.cover`), so the
kills a campaign aims after the child's readiness find every kind acknowledged, however slow the machine.
:meth:`~.ledger.VerlLedger.load` is left out: it replaces the live file, which the checker reads as the chain's truth.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import random
import shutil
from collections.abc import Callable
from typing import Any

from kvckpt.integrations.transferqueue.values import encode_value, new_write_id
from kvckpt.integrations.verl.errors import StaleRun
from kvckpt.integrations.verl.ledger import VerlLedger
from kvckpt.integrations.verl.records import FIELD, TAG, record_key

from kvckpt import KvckptError, ValueStore, fsync_dir, keep_latest
from kvckpt.testing.campaigns.harness import start_writer
from kvckpt.testing.campaigns.sides import Side

LEDGER_FILE = "verl.kv"
CHECKPOINT_GLOB = "verl-*.kv"
PARTITION = "train"
SESSIONS = (0, 1)
#: The kinds of acknowledged ledger operations a campaign counts.
KINDS = ("lrun", "lresume", "lsettle", "lcursor", "lprog", "lput", "lclear", "lconsume", "lckpt", "lstale")
_DRAWN = ("lcursor", "lprog", "lput", "lclear", "lconsume", "lckpt", "lstale")
_WEIGHTS = (0.2, 0.3, 0.15, 0.08, 0.12, 0.07, 0.08)
_MAX_PROMPTS = 12  # prompts alive at once: the model and each logged state stay small
#: The calls :meth:`LedgerWriter.cover` makes, in order, each acknowledged: every drawn kind (a dispatch, a progress
#: flush, the put that ends it, a clear of it, a second finished prompt consumed, a checkpoint, a replaced run's put).
COVER = ("lcursor", "lprog", "lput", "lclear", "lcursor", "lput", "lconsume", "lckpt", "lstale")
#: The file (in the run directory) written once a child's :meth:`LedgerWriter.cover` was acknowledged whole.
COVERED = "verl-covered"


def _uids(state: dict[str, Any]) -> list[str]:
    return sorted({k.split("_", 1)[0] for k in state["items"]} | {k.split("_", 1)[0] for k in state["consumed"]}
                  | {p.split("/", 1)[0] for p in state["progress"]})


def item_of(key: str) -> dict[str, Any]:
    """The records the workload puts under ``key``: a prompt's status tag, or a trajectory's response field (a pure
    function of the key, so the model knows what a consumed key brings back when a restart returns it)."""
    if "_" in key:
        return {"tags": {}, "fields": {"responses": {"k": key}}}
    return {"tags": {"status": {"s": "pending"}}, "fields": {}}


def state_of(ledger: VerlLedger) -> dict[str, Any]:
    """What ``ledger`` holds, as the model keeps it: ``items`` and ``consumed`` (its snapshot), ``cursor``,
    ``checkpoint`` (the last checkpoint's step) and ``progress`` (``{"uid/session": [tokens, done]}`` of every
    prompt the cursor dispatched)."""
    snap = ledger.snapshot()
    progress = {}
    for uid in (f"u{n:05d}" for n in range((snap["cursor"] or {}).get("next", 0))):
        for session in SESSIONS:
            held = ledger.progress(uid, session)
            if held is not None:
                progress[f"{uid}/{session}"] = [len(held["tokens"]), bool(held["done"])]
    return {"items": snap["items"].get(PARTITION, {}), "consumed": snap["consumed"].get(PARTITION, {}),
            "cursor": snap["cursor"], "checkpoint": ledger.info()["checkpoint_step"], "progress": progress}


def _finished(state: dict[str, Any], uid: str) -> bool:
    return any(k.startswith(f"{uid}_") for k in (*state["items"], *state["consumed"]))


def both(state: dict[str, Any]) -> list[str]:
    """The prompts that are a finished group and have token progress too (after a settle: none may)."""
    return [uid for uid in _uids(state) if _finished(state, uid)
            and any(p.startswith(f"{uid}/") for p in state["progress"])]


class LedgerWriter:
    """The ledger's writer thread of one campaign child (see the module docstring)."""

    def __init__(self, run: str, log: Any, seed: int) -> None:
        self.ledger = VerlLedger(os.path.join(run, LEDGER_FILE))
        self.ckdir, self.log, self.rng = os.path.join(run, "ckpt"), log, random.Random(seed)
        self.model = state_of(self.ledger)
        self.log.append(op="lstart", state=self.model)
        self.stale: list[str] = []  # tokens of runs this child replaced
        self.token = ""
        self.step_no = (self.model["checkpoint"] or 0) + 1

    def _call(self, kind: str, after: dict[str, Any], call: Callable[[], Any], **extra: Any) -> Any:
        """Log the state ``after`` as the intent, make the call, adopt it, log the acknowledgement."""
        self.log.append(op="lintent", state=after)
        out = call()
        self.model = after
        self.log.append(op=kind, state=after, **extra)
        return out

    def restart(self) -> None:
        """What verl's trainer does at a restart: a new run, resume from the last checkpoint, settle progress."""
        self.token = self.ledger.open_run()["token"]
        self.log.append(op="lrun", state=self.model)
        after = copy.deepcopy(self.model)
        step = after["checkpoint"] or 0
        for key, mark in list(after["consumed"].items()):
            del after["consumed"][key]
            if mark > step:
                after["items"][key] = item_of(key)
        self._call("lresume", after, lambda: self.ledger.resume(self.token))
        inflight = [u for u in _uids(self.model) if not _finished(self.model, u)]
        after = copy.deepcopy(self.model)
        after["progress"] = {p: v for p, v in after["progress"].items() if p.split("/", 1)[0] in inflight}
        self._call("lsettle", after, lambda: self.ledger.settle_progress(self.token, inflight))
        if both(self.model):
            self.log.append(op="violation", what=f"prompts {both(self.model)} are a group and in flight after a settle")

    def step(self, kind: str | None = None) -> bool:
        """One operation of ``kind``, drawn at random when None; returns whether a call of it was acknowledged
        (False: the model offered none, e.g. a clear with no finished prompt)."""
        rng, model = self.rng, self.model
        kind = kind or rng.choices(_DRAWN, _WEIGHTS)[0]
        after = copy.deepcopy(model)
        uids = _uids(model)
        inflight = [u for u in uids if u in model["items"] and not _finished(model, u)]
        finished = [u for u in uids if _finished(model, u) and u not in model["consumed"]]
        if kind == "lcursor" and len(uids) < _MAX_PROMPTS:
            n = (model["cursor"] or {}).get("next", 0)
            uid = f"u{n:05d}"
            key = record_key(PARTITION, uid, TAG, "status")
            after["items"][uid] = item_of(uid)
            after["cursor"] = {"next": n + 1}
            self._call(kind, after, lambda: self.ledger.set_cursor(
                self.token, {"next": n + 1}, [key], [encode_value(key, {"s": "pending"}, new_write_id(), 1)]))
            return True
        elif kind == "lprog" and (inflight or model["progress"]):
            if inflight and (rng.random() < 0.8 or not model["progress"]):
                uid, session = rng.choice(inflight), rng.choice(SESSIONS)
                start, done = after["progress"].get(f"{uid}/{session}", [0, False])
                if done:
                    return False
                count, final = rng.randint(1, 4), rng.random() < 0.2
                item = {"uid": uid, "session": session, "start": start, "tokens": list(range(start, start + count)),
                        "logprobs": [-0.5] * count, "versions": [self.step_no] * count, "final": final}
                after["progress"][f"{uid}/{session}"] = [start + count, final]
            else:
                path = rng.choice(sorted(model["progress"]))
                uid, session = path.split("/")
                item = {"uid": uid, "session": int(session), "drop": True}
                del after["progress"][path]
            self._call(kind, after, lambda: self.ledger.record_progress(self.token, [item]))
            return True
        elif kind == "lput" and inflight:
            uid, keys, values = rng.choice(inflight), [], []
            for session in SESSIONS:
                trajectory = f"{uid}_{session}_0"
                keys.append(record_key(PARTITION, trajectory, FIELD, "responses"))
                values.append(encode_value(keys[-1], {"k": trajectory}, new_write_id(), 1))
                after["items"][trajectory] = item_of(trajectory)
            # the put that ends the group deletes its samples' token progress in the same transaction
            after["progress"] = {p: v for p, v in after["progress"].items() if p.split("/", 1)[0] != uid}
            self._call(kind, after, lambda: self.ledger.put(self.token, keys, values, ended=[uid]))
            return True
        elif kind in ("lclear", "lconsume") and finished:
            uid = rng.choice(finished)
            keys = [k for k in model["items"] if k.split("_", 1)[0] == uid]
            step = self.step_no if kind == "lconsume" else None
            for key in keys:
                after["items"].pop(key)
                if step is not None and model["checkpoint"] is not None:
                    after["consumed"][key] = step
            self._call(kind, after, lambda: self.ledger.clear(self.token, PARTITION, keys, consumed_step=step))
            return True
        elif kind == "lckpt":
            self._checkpoint(after)
            return True
        elif kind == "lstale":  # a new run mid-stream (another trainer took over): the old token is fenced
            self.stale.append(self.token)
            self.token = self.ledger.open_run()["token"]
            self.log.append(op="lrun", state=self.model)
            try:
                self.ledger.put(rng.choice(self.stale), [record_key(PARTITION, "zombie", TAG, "status")],
                                [encode_value(record_key(PARTITION, "zombie", TAG, "status"), 1, "zombie", 1)])
                self.log.append(op="violation", what="a ledger put of a replaced run was applied")
            except StaleRun:
                self.log.append(op="lstale")
            return True
        return False

    def cover(self) -> None:
        """Every kind of drawn call, each acknowledged, in an order that makes each possible (:data:`COVER`);
        raises :class:`RuntimeError` if the model offers one none in 100 tries (it always does: the ones
        before it make it possible)."""
        for kind in COVER:
            for _ in range(100):
                if self.step(kind):
                    break
            else:
                raise RuntimeError(f"the verl campaign's writer could not make a {kind} call on {self.model}")

    def _checkpoint(self, after: dict[str, Any]) -> None:
        numbers = [int(os.path.basename(p)[5:-3]) for p in glob.glob(os.path.join(self.ckdir, CHECKPOINT_GLOB))]
        name = f"verl-{max(numbers, default=-1) + 1:06d}.kv"
        step, held = self.step_no, copy.deepcopy(self.model)  # the copy holds the ledger before its step record
        for key, mark in list(after["consumed"].items()):
            if mark <= step:
                del after["consumed"][key]
        after["checkpoint"] = step
        self.step_no += 1
        stamp = self._call("lckpt", after, lambda: self.ledger.checkpoint(
            self.token, os.path.join(self.ckdir, name), step), path=name, held=held)
        self.log.append(op="lckptid", path=name, id=stamp["checkpoint_id"])
        keep_latest(self.ckdir, CHECKPOINT_GLOB, keep=2)


def start(run: str, log: Any, seed: int) -> None:
    """Open the run's ledger and start its writer on a daemon thread: the restart, then operations until the
    process dies (:func:`~kvckpt.testing.campaigns.harness.start_writer`).

    In a run whose log has not yet acknowledged every kind (no :data:`COVERED` file in ``run``), the restart and
    :meth:`LedgerWriter.cover` run here first, before the child's buffer workload starts and says it is ready, so
    a kill that waits for readiness comes after every kind was acknowledged; then the file is written. A kill
    during start-up may cut the cover: the next child of the run covers again. So every run a child reached
    readiness in has acknowledged every kind, however slowly the children run between kills."""
    writer = LedgerWriter(run, log, seed)
    covered = os.path.join(run, COVERED)
    if os.path.exists(covered):
        start_writer("kvckpt-campaign-verl", writer.step, writer.rng, first=writer.restart)
        return
    writer.restart()
    writer.cover()
    with open(covered, "wb") as fh:
        os.fsync(fh.fileno())
    fsync_dir(run)
    start_writer("kvckpt-campaign-verl", writer.step, writer.rng)


def check(run: str, ops: list[dict[str, Any]], scratch: str, bad: Callable[[str], None]) -> int:
    """Check the run's ledger and its checkpoints against the logged ``ops``; returns how many checkpoints loaded.

    Every ``lstart`` (what a child found) and the file now hold the last acknowledged state or that plus the call
    in flight; the last acknowledged checkpoint exists, every checkpoint under a final name loads, and an
    acknowledged one holds what the ledger held when it was taken."""
    ours = [op for op in ops if op["op"] in ("lstart", "lintent", *KINDS)]
    if not ours:
        return 0  # the crash came before the writer opened its ledger
    acked: dict[str, Any] | None = None
    pending: dict[str, Any] | None = None
    for op in ours:
        if op["op"] == "lstart":
            if acked is not None and op["state"] not in (acked, pending):
                bad(f"the verl ledger a child opened differs from what was acknowledged: {_diff(op['state'], acked)}")
            acked, pending = op["state"], None
        elif op["op"] == "lintent":
            pending = op["state"]
        elif "state" in op:
            acked, pending = op["state"], None
            if op["op"] == "lsettle" and both(acked):
                bad(f"after a restart's settle, prompts {both(acked)} are a finished group and in flight")
    live = os.path.join(run, LEDGER_FILE)
    acknowledged = sum(op["op"] in KINDS for op in ours)  # without one, a cut may have beaten the creation
    if not os.path.isfile(live):
        if acknowledged:
            bad(f"the verl ledger {LEDGER_FILE} is gone after {acknowledged} acknowledged ledger operations")
        return _check_checkpoints(run, ops, scratch, bad)
    # A VerlLedger opens its file for writing (and would create a missing one); the file under ``run`` is a
    # power-cut campaign's surviving image, which the next cut's filesystem starts from, so it must stay what the
    # cut left: read a copy in ``scratch`` (the store's one file; the copy brings no lock file).
    copy = os.path.join(scratch, "verl-live-copy.kv")
    shutil.copyfile(live, copy)
    try:
        ledger = VerlLedger(copy)
    except KvckptError as exc:
        if acknowledged:
            bad(f"the verl ledger {LEDGER_FILE} does not open after {acknowledged} acknowledged ledger operations: "
                f"{type(exc).__name__}: {exc}")
        return _check_checkpoints(run, ops, scratch, bad)
    try:
        now = state_of(ledger)
    finally:
        ledger.close()
    if now not in (acked, pending):
        bad(f"the verl ledger holds what was not acknowledged: {_diff(now, acked)}")
    return _check_checkpoints(run, ops, scratch, bad)


def _check_checkpoints(run: str, ops: list[dict[str, Any]], scratch: str, bad: Callable[[str], None]) -> int:
    held = {op["path"]: op["held"] for op in ops if op["op"] == "lckpt"}
    ids = {op["path"]: op["id"] for op in ops if op["op"] == "lckptid"}
    files = sorted(glob.glob(os.path.join(run, "ckpt", CHECKPOINT_GLOB)))
    last = [op["path"] for op in ops if op["op"] == "lckpt"][-1:]  # the newest name: keep_latest never deletes it
    if last and last[0] not in {os.path.basename(p) for p in files}:
        bad(f"acknowledged verl checkpoint {last[0]} is missing")
    loads = 0
    for path in files:
        name, target = os.path.basename(path), os.path.join(scratch, "verl-loaded.kv")
        store = ValueStore(target)
        try:
            stamp = store.load(path)
        except KvckptError as exc:
            bad(f"verl checkpoint {name} under a final name does not load: {type(exc).__name__}: {exc}")
            continue
        finally:
            store.close()
        loads += 1
        if name in ids and stamp["checkpoint_id"] != ids[name]:
            bad(f"verl checkpoint {name} holds stamp {stamp['checkpoint_id']}, not the acknowledged one")
        if name in held:
            ledger = VerlLedger(target)
            try:
                got = state_of(ledger)
            finally:
                ledger.close()
            if got != held[name]:
                bad(f"verl checkpoint {name} holds {_diff(got, held[name])}")
    return loads


def _diff(got: dict[str, Any], want: dict[str, Any] | None) -> str:
    want = want or {}
    parts = []
    for part in ("items", "consumed", "cursor", "checkpoint", "progress"):
        a, b = got.get(part), want.get(part)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:4]
                parts.append(f"{part} " + ", ".join(f"{k}: {a.get(k)} (acknowledged {b.get(k)})" for k in keys))
            else:
                parts.append(f"{part} {a} (acknowledged {b})")
    return "; ".join(parts) or "the same"


def tidy(run: str, ops: list[dict[str, Any]]) -> None:
    """Between power cuts: delete a ledger no child acknowledged opening (no ``lstart``). It holds no promise,
    and a cut during its creation can leave a file no open accepts (the run directory's entry made durable, by
    another file's directory fsync or a ``random`` cut, before the ledger's first pages: a 0-byte file, refused as
    truncated); the campaign drops it as it drops a run whose create was not acknowledged."""
    if not any(op["op"] == "lstart" for op in ops):
        for path in (os.path.join(run, LEDGER_FILE), os.path.join(run, LEDGER_FILE) + "-lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


#: The side workload the kill and power-cut campaigns run (:mod:`kvckpt.testing.campaigns.sides`).
SIDE = Side(start, check, tidy)
