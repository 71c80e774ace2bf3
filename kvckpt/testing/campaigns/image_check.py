"""The power-cut campaign's checker (:func:`check_image`): what must hold on the disk image that
survived a power cut, checked in a fresh process (:func:`checker`).

The store exists and verifies (:func:`kvckpt.check`, ``deep=True``), every acknowledged operation
survives (:func:`kvckpt.testing.campaigns.history.check_history`), exactly-once holds, every stored row is the
row its producer generated, an acknowledged restore survived, the acknowledged checkpoint exists,
and *every* file under a checkpoint name restores, verifies and agrees with the live store; the
value store beside it holds what its acknowledged writes left and its checkpoints load
(:func:`kvckpt.testing.campaigns.values_workload.check_values`); each side workload's check
(:mod:`kvckpt.testing.campaigns.sides`) passes on the image.

Nothing here writes to the image: the next cut's filesystem starts from it. The buffer and the value
store open read-only; a side whose check must open its store for writing does so on a copy in ``scratch``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import traceback
from collections.abc import Sequence
from typing import Any

from kvckpt import KvckptError, ReplayBuffer, restore
from kvckpt.testing.campaigns.history import check_buffer, check_history, compare_checkpoint
from kvckpt.testing.campaigns.sides import load_side
from kvckpt.testing.campaigns.values_workload import check_values
from kvckpt.testing.campaigns.workload import CHECKPOINT_GLOB


def check_image(image: str, timeline: str, ops: list[dict[str, Any]], scratch: str,
                restored_before: dict[str, str] | None = None, rows_seen: set[bytes] | None = None,
                sides: Sequence[str] = ()) -> dict[str, Any]:
    """Check the surviving ``image`` of run ``timeline`` against the acknowledged ``ops`` (and each side
    workload of ``sides`` against them with its own check).

    ``restored_before`` maps checkpoint names to the digests of bytes that restored cleanly at an
    earlier cut; a file still holding those bytes is not restored again (same bytes, same outcome).
    ``rows_seen`` holds digests of (key, value) rows already compared with their producer's row.
    Returns ``{"operations_checked", "checkpoints_restored", "violations", "restored", "rows_seen"}``
    (the last two: what to pass next time)."""
    restored_ok = dict(restored_before or {})
    seen = set(rows_seen or ())
    found: list[str] = []
    bad = found.append
    restored = 0
    run = os.path.join(image, timeline)
    live_path = os.path.join(run, "live.kv")
    if not os.path.exists(live_path):
        return {"operations_checked": len(ops), "checkpoints_restored": 0, "restored": restored_ok,
                "rows_seen": seen, "violations": [
            f"the store {timeline}/live.kv is gone after the power cut ({len(ops)} acknowledged operations "
            f"lost; its directory holds {sorted(os.listdir(run)) if os.path.isdir(run) else 'nothing'})"]}
    try:
        buf = ReplayBuffer.open(live_path, readonly=True)
    except KvckptError as exc:
        return {"operations_checked": len(ops), "checkpoints_restored": 0, "restored": restored_ok,
                "rows_seen": seen, "violations": [f"the store {timeline}/live.kv does not open after the power cut "
                                                  f"({len(ops)} acknowledged operations): {type(exc).__name__}: {exc}"]}
    try:
        snap = check_buffer(buf, "live store", bad, seen)
    finally:
        buf.close()
    found.extend(check_history(ops, snap))
    for op in ops:
        if op["op"] == "restored" and (snap.cursor < op["cursor"] or snap.state["trainer_version"] < op["version"]):
            bad(f"the acknowledged restore of {op['source']} (cursor {op['cursor']}, version {op['version']}) did "
                f"not survive: cursor {snap.cursor}, version {snap.state['trainer_version']}")
    files = sorted(glob.glob(os.path.join(run, "ckpt", CHECKPOINT_GLOB)))
    logged = [op["path"] for op in ops if op["op"] == "ckpt"]
    if logged and os.path.basename(logged[-1]) not in {os.path.basename(f) for f in files}:
        bad(f"acknowledged checkpoint {os.path.basename(logged[-1])} is missing")
    for path in files:
        name = f"{timeline}/ckpt/{os.path.basename(path)}"
        with open(path, "rb") as f:
            digest = hashlib.blake2b(f.read()).hexdigest()
        if restored_ok.get(name) == digest:
            continue
        try:
            rbuf, _ = restore(path, os.path.join(scratch, "restored.kv"), overwrite=True)
        except Exception as exc:
            bad(f"checkpoint {name} under a final name does not restore: {type(exc).__name__}: {exc}")
            continue
        try:
            compare_checkpoint(check_buffer(rbuf, f"restored {name}", bad, seen, deep=False), snap, name, bad)
        finally:
            rbuf.close()
        restored += 1
        restored_ok[name] = digest
    restored += check_values(run, ops, scratch, bad)  # at most two files: loaded at every cut
    for side in sides:
        restored += load_side(side).check(run, ops, scratch, bad)
    return {"operations_checked": len(ops), "checkpoints_restored": restored, "violations": found,
            "restored": restored_ok, "rows_seen": seen}


def checker(image: str, timeline: str, ops: list[dict[str, Any]], scratch: str, restored_before: dict[str, str],
            rows_seen: set[bytes], sides: Sequence[str], conn: Any) -> None:
    """:func:`check_image` in a process of its own: sends its outcome (or the checker's crash, as a
    violation) down ``conn``."""
    try:
        conn.send(check_image(image, timeline, ops, scratch, restored_before, rows_seen, sides))
    except BaseException as exc:
        conn.send({"operations_checked": 0, "checkpoints_restored": 0, "restored": restored_before,
                   "rows_seen": rows_seen, "violations": [
            f"the checker raised {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"]})
