"""The checker of the kill and power-cut campaigns: what a store holds, whether it kept every
promise of the acknowledged operations a :mod:`~kvckpt.testing.campaigns.workload` logged, and whether a
restored checkpoint agrees with the live store.

* :func:`check_buffer`: the store verifies (:func:`kvckpt.check`), the prompts held are exactly
  ``0 .. cursor-1``, each once (a committed group or a ledger entry, never both), and every stored
  row is byte-for-byte the row its producer generated (:func:`~kvckpt.testing.campaigns.workload.make_row`);
* :func:`check_history`: every acknowledged admission, commit (by any of the
  :data:`~kvckpt.testing.campaigns.workload.COMMIT_PATHS`), token-progress chunk (present after the cut: the
  sample's durable prefix is at least as long, unless the sample was committed or its group
  aborted since), selection, finished step, eviction and abort is reflected by the store; every
  durable prefix is its row's own first tokens and logprobs (:func:`check_buffer`);
* :func:`compare_checkpoint`: what a checkpoint holds as committed is committed live.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvckpt import ReplayBuffer, check
from kvckpt.storage import codec
from kvckpt.tables.records import ABORTED, CLAIMED, CONSUMED, EVICTED, READY
from kvckpt.testing.campaigns.harness import Findings
from kvckpt.testing.campaigns.workload import make_row

COMMITTED = (READY, CLAIMED, CONSUMED, EVICTED)


@dataclass
class Holdings:
    """What a store holds, by group id: group records, ledger entries, its state and cursor, and
    the durable token prefix of every sample in flight (``(group id, row index) -> Progress``)."""

    groups: dict[str, Any]
    ledger: dict[str, Any]
    state: dict[str, Any]
    cursor: int
    progress: dict[tuple[str, int], Any] = field(default_factory=dict)


def holdings(buf: ReplayBuffer) -> Holdings:
    """Every group, ledger entry, the state and the dataloader cursor of ``buf`` (its prompts)."""
    ledger = {e.group_id: e for e in buf.ledger()}
    progress = {(gid, i): p for gid in ledger for i, p in buf.progress(gid).items()}
    return Holdings({g.group_id: g for g in buf.groups()}, ledger, buf.state(), int(buf.dataloader_state() or b"0"),
                    progress)


def check_buffer(buf: ReplayBuffer, where: str, bad: Callable[[str], None], seen: set[bytes],
                  deep: bool = True) -> Holdings:
    """Verify ``buf``, check exactly-once prompts and that every stored row is the row its producer
    generated (``seen`` holds digests of rows already compared: a stored row never changes)."""
    report = buf.store.read(lambda t: check(t, deep=deep))
    for problem in report.problems[:20]:
        bad(f"{where}: verifier: {problem}")
    snap = holdings(buf)
    held = sorted([g.prompt_idx for g in snap.groups.values()] + [e.prompt_idx for e in snap.ledger.values()])
    if held != list(range(snap.cursor)):
        bad(f"{where}: prompts held are not exactly 0..{snap.cursor - 1} once each "
            f"(missing {sorted(set(range(snap.cursor)) - set(held))[:10]}, "
            f"extra {[i for i in held if i >= snap.cursor][:10]}, {len(held) - len(set(held))} duplicated)")
    for key, value in buf.store.read(lambda t: list(t.iter_prefix("rows", b""))):
        digest = hashlib.blake2b(key + b"\0" + value, digest_size=16).digest()
        if digest in seen:
            continue
        seen.add(digest)
        gid, index = key[:-5].decode(), int.from_bytes(key[-4:], "big")
        record = codec.decode(value, f"rows/{gid}_g{index}")
        want = make_row(gid, index)
        if set(record.arrays) != set(want) or not all(np.array_equal(record.arrays[k], v) for k, v in want.items()):
            bad(f"{where}: row {gid}_g{index} is not the row its producer generated")
    for (gid, index), got in snap.progress.items():
        want = make_row(gid, index)
        if not (np.array_equal(got.tokens.numpy(), want["input_ids"][:got.length])
                and np.array_equal(got.logprobs.numpy(), want["logprobs"][:got.length])):
            bad(f"{where}: the durable prefix of {gid}_g{index} is not its producer's first {got.length} tokens")
    return snap


def check_history(ops: list[dict[str, Any]], snap: Holdings) -> list[str]:
    """The acknowledged operations in ``ops`` (an :class:`OpLog`) that ``snap`` does not reflect,
    as violation messages (empty when the store kept every promise)."""
    found: list[str] = []
    bad = found.append
    selected: dict[int, list[str]] = {}
    for op in ops:
        kind = op["op"]
        if kind == "start":
            selected = {}  # a new child: claims of the previous one may have been returned by recovery
        elif kind == "admit":
            for gid, idx in zip(op["gids"], op["idx"], strict=True):
                rec = snap.groups.get(gid) or snap.ledger.get(gid)
                if rec is None or rec.prompt_idx != idx:
                    bad(f"admitted prompt {idx} ({gid}) is neither a group nor a ledger entry")
            if snap.cursor < op["cursor"]:
                bad(f"dataloader cursor {snap.cursor} is behind the acknowledged {op['cursor']}")
        elif kind == "commit":
            group, entry = snap.groups.get(op["gid"]), snap.ledger.get(op["gid"])
            if op["ready"]:
                if group is None or group.state not in COMMITTED or group.digest != op["digest"]:
                    bad(f"acknowledged commit of {op['gid']} (digest {op['digest']}) is not a committed group "
                        f"with that digest: {group}")
            elif not ((group is not None and group.state in (*COMMITTED, ABORTED))
                      or (entry is not None and op["index"] in entry.siblings)):
                bad(f"acknowledged sample {op['gid']}_g{op['index']} is lost")
        elif kind == "progress":
            group, entry = snap.groups.get(op["gid"]), snap.ledger.get(op["gid"])
            held = snap.progress.get((op["gid"], op["index"]))
            if entry is not None and op["index"] not in entry.siblings and (held is None or held.length < op["end"]):
                bad(f"acknowledged progress of {op['gid']}_g{op['index']} up to token {op['end']} is lost (the durable "
                    f"prefix holds {0 if held is None else held.length})")
            elif entry is None and (group is None or group.state not in (*COMMITTED, ABORTED)):
                bad(f"acknowledged progress of {op['gid']}_g{op['index']}: the prompt is neither in flight nor "
                    "committed")
        elif kind == "select":
            selected[op["step"]] = op["gids"]
            for gid in op["gids"]:
                if gid not in snap.groups or snap.groups[gid].state not in COMMITTED:
                    bad(f"selected group {gid} is not a committed group")
        elif kind == "finish":
            if snap.state["trainer_version"] < op["version"]:
                bad(f"trainer_version {snap.state['trainer_version']} is behind the acknowledged {op['version']}")
            for gid in selected.pop(op["version"] - 1, []):
                group = snap.groups.get(gid)
                if group is None or group.state != CONSUMED or group.consumed_step != op["version"] - 1:
                    bad(f"group {gid} trained in acknowledged step {op['version'] - 1} is not consumed by it: {group}")
        elif kind == "evict":
            for gid in op["gids"]:
                if gid not in snap.groups or snap.groups[gid].state != EVICTED:
                    bad(f"acknowledged eviction of {gid} did not stick")
        elif kind == "abort":
            if op["gid"] not in snap.groups or snap.groups[op["gid"]].state != ABORTED:
                bad(f"acknowledged abort of {op['gid']} did not stick")
        elif kind == "violation":
            bad(f"the workload reported: {op['what']}")
    return found


def compare_checkpoint(snap: Holdings, live: Holdings, name: str, bad: Callable[[str], None]) -> None:
    """Report (to ``bad``) what the restored checkpoint ``snap`` holds that the live store ``live``
    of the same run contradicts: a committed group not committed live with the same digest, a
    ledger entry unknown live, a trainer version ahead of the live one."""
    for gid, group in snap.groups.items():
        now = live.groups.get(gid)
        if group.state in COMMITTED and (now is None or now.state not in COMMITTED or now.digest != group.digest):
            bad(f"group {gid} committed in checkpoint {name} is not committed live")
    for gid in snap.ledger:
        if gid not in live.groups and gid not in live.ledger:
            bad(f"ledger entry {gid} of checkpoint {name} is unknown live")
    if snap.state["trainer_version"] > live.state["trainer_version"]:
        bad(f"checkpoint {name} is ahead of the live store's trainer version")


@dataclass
class WorkloadFindings(Findings):
    """The findings of a campaign that checks a workload's log: how many operations it checked
    (``operation_kinds``: how many of each kind: admit, commit, progress, select, ...), and how
    many acknowledged commits each commit path made (``group``, ``sample``, ``encoded``, ``many``)
    with the ``commit_many`` items refused as they had to be (``refused``), so a test can assert
    every path ran."""

    operations_checked: int = 0
    commit_paths: dict[str, int] = field(default_factory=dict)
    operation_kinds: dict[str, int] = field(default_factory=dict)

    def count(self, ops: list[dict[str, Any]]) -> None:
        """Add the checked operations ``ops`` (each counted once) to the figures."""
        self.operations_checked += len(ops)
        kinds = Counter(self.operation_kinds)
        kinds.update(op["op"] for op in ops)
        self.operation_kinds = dict(kinds)
        counts = Counter(self.commit_paths)
        counts.update(op.get("via", "group") for op in ops if op["op"] == "commit")
        counts["refused"] += sum(op["op"] == "refused" for op in ops)
        self.commit_paths = dict(counts)
