"""The kill campaign's replicated side (issue 44; :func:`run_replicated_campaign`,
``python -m kvckpt.testing.campaigns.campaign replicated --kills N --level L``): SIGKILL the primary or
the standby of a replicated value store between any two operations, and check every promise after each kill.

Two children run at once, each forked from the campaigns' fork server
(:func:`~kvckpt.testing.campaigns.harness.fork_server`):

* **the primary** writes operation ``n`` (:func:`operation`: puts and deletes drawn from ``seed`` and ``n``
  alone, one write transaction, so one log record: its sequence is ``n + 1``), waits at ``remote_durable``
  until the standby applied it, then appends ``n`` to its acknowledgement file (every ``n`` in that file was
  acknowledged at the level), and trims its log to what the standby applied;
* **the standby** reads the primary's log from its file (read-only) and applies it in batches, one durable
  transaction each (:meth:`kvckpt.Standby.apply`).

The parent kills one of them at a random moment (which one at random), lets the other run alone a little
(at ``async`` the primary goes on without its standby; at ``remote_durable`` it waits), kills it too, then
checks, in its own process (:func:`check_pair`):

1. the acknowledged operations are in order, each once, the last of them ``A - 1`` committed on the primary (its
   last sequence ``L >= A``; an operation committed and killed before its acknowledgement is not one);
2. **the standby's state equals the primary's at the standby's applied sequence ``S``**: the standby's
   records are exactly :func:`model` ``(S)`` (the state after operations ``0 .. S-1``, what the primary held
   at sequence ``S``), and the primary's are :func:`model` ``(L)``;
3. at ``remote_durable`` ``S >= A``: nothing acknowledged is missing on the standby; at ``async`` the
   acknowledged operations it lacks (``A - S``) are counted (``async_unapplied``, the most at any kill);
4. **a promotion keeps everything acknowledged at the level**: a copy of the standby is promoted
   (:func:`kvckpt.promote_value_store`), holds :func:`model` ``(S)``, verifies, is at the next epoch, refuses
   the old primary's records after ``S`` (``NotStandby``: fenced) and takes a write as sequence ``S + 1``;
5. the standby catches up from the primary's log (``S + 1 .. L``) and ``verify --against``
   (:func:`kvckpt.durability.replication.compare_replicas`) finds both files' table digests equal at the
   same sequence.

Then both children start again on the same files: the campaign is one chain of crashes. A CI slice runs
in seconds (``tests/campaigns/test_replicated_campaign.py``); ``--kills 500`` is the long run.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from kvckpt import Standby, ValueStore, codec, enable_replication, promote_value_store, replication_status, trim_log
from kvckpt.durability.replication import compare_replicas, install_standby, snapshot_for_standby
from kvckpt.durability.safe_open import open_readonly, verify_path
from kvckpt.errors import KvckptError, NotStandby
from kvckpt.storage import replog
from kvckpt.storage.store import Store
from kvckpt.testing.campaigns.harness import CampaignRun, Findings, fork_server
from kvckpt.values import records

ASYNC, REMOTE_DURABLE = "async", "remote_durable"
#: The levels the campaign runs: the primary acknowledges after its own commit, or once the standby applied.
LEVELS = (ASYNC, REMOTE_DURABLE)
PRIMARY_FILE, STANDBY_FILE, ACKS_FILE = "primary.kv", "standby.kv", "acks"
#: Keys the operations draw from (small, so deletes and overwrites hit live keys).
KEYS = 48
#: Log records the standby applies per transaction at most.
BATCH = 8
#: The map of a child's read-only handle of the other's file: past anything a campaign writes, so the other
#: side's growth never makes it stale (a reader maps only what a file uses when no writer holds it).
READER_MAP = 1 << 34


@dataclass
class ReplicatedResult(Findings):
    """What a replicated kill campaign did and found; ``violations`` is empty when every promise held."""

    level: str = REMOTE_DURABLE
    kills: int = 0
    primary_kills: int = 0
    standby_kills: int = 0
    acknowledged: int = 0
    promotions: int = 0
    caught_up: int = 0
    async_unapplied: int = 0

    def summary(self) -> str:
        """One line: the level, kills of each side, operations acknowledged, promotions checked, violations."""
        return (f"replicated campaign at {self.level}: {self.kills} kills ({self.primary_kills} primary, "
                f"{self.standby_kills} standby), {self.acknowledged} operations acknowledged, {self.promotions} "
                f"promotions checked, {self.caught_up} catch-ups verified equal, most acknowledged not yet on the "
                f"standby at a kill {self.async_unapplied}, {len(self.violations)} violations in {self.seconds:.1f}s")


def operation(seed: int, n: int) -> tuple[list[str], list[bytes], list[str]]:
    """Operation ``n`` of the campaign of ``seed``: ``(keys, values, deletes)`` for one
    :meth:`kvckpt.ValueStore.write`, at least one put (so it always appends one log record)."""
    rng = random.Random(f"replicated/{seed}/{n}")
    keys = sorted({f"k{rng.randrange(KEYS)}" for _ in range(rng.randint(1, 3))})
    deletes = sorted({f"k{rng.randrange(KEYS)}" for _ in range(rng.randint(0, 2))} - set(keys))
    values = [codec.encode({"v": np.frombuffer(rng.randbytes(rng.randint(1, 1500)), np.uint8)},
                           {"k": key, "w": str(n), "t": "bytes"}, 0) for key in keys]
    return keys, values, deletes


def model(seed: int, n: int) -> dict[str, bytes]:
    """The records a value store holds after operations ``0 .. n-1`` (its state at sequence ``n``)."""
    state: dict[str, bytes] = {}
    for i in range(n):
        keys, values, deletes = operation(seed, i)
        state.update(zip(keys, values, strict=True))
        for key in deletes:
            state.pop(key, None)
    return state


def held(path: str) -> tuple[dict[str, bytes], dict[str, Any] | None]:
    """The records of the value store at ``path`` and its replication status, from one snapshot."""
    with open_readonly(path) as store:
        def read(txn: Any) -> tuple[dict[str, bytes], dict[str, Any] | None]:
            return {k: txn.get("rows", records.store_key(k)) for k in records.keys(txn)}, replog.describe(txn)
        return store.read(read)


def log_after(store: Store, after: int, limit: int) -> list[bytes]:
    """Up to ``limit`` consecutive log records the primary's file keeps after sequence ``after``, in order."""
    def read(txn: Any) -> list[bytes]:
        out: list[bytes] = []
        for key, value in txn.iter_prefix("replog", replog.RECORD_PREFIX, replog.record_key(after + 1)):
            if key != replog.record_key(after + 1 + len(out)) or len(out) == limit:
                break
            out.append(value)
        return out
    return store.read(read)


def primary_records(path: str, after: int, limit: int) -> list[bytes]:
    """:func:`log_after` of the primary's file at ``path``, opened untrusted (read-only, checked first)."""
    with open_readonly(path) as store:
        return log_after(store, after, limit)


def setup(root: str) -> None:
    """A replicated value store primary with nothing written and its standby installed from a snapshot."""
    values = ValueStore(os.path.join(root, PRIMARY_FILE))
    try:
        enable_replication(values, max_records=1 << 30)  # the campaign trims to the standby's applied sequence
        snapshot_for_standby(values.store, os.path.join(root, "snapshot.kv")).wait()
    finally:
        values.close()
    install_standby(os.path.join(root, "snapshot.kv"), os.path.join(root, STANDBY_FILE))
    os.remove(os.path.join(root, "snapshot.kv"))


def primary_child(root: str, seed: int, level: str) -> None:
    """The primary's process: operations from where its file is, acknowledged at ``level`` (runs until killed)."""
    values = ValueStore(os.path.join(root, PRIMARY_FILE))
    standby = Store(os.path.join(root, STANDBY_FILE), readonly=True, map_size=READER_MAP)

    def applied() -> int:
        return standby.read(replog.describe)["last"]

    acks = os.open(os.path.join(root, ACKS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    n = replication_status(values)["last"]
    while True:
        keys, vals, deletes = operation(seed, n)
        values.write(keys, vals, deletes)
        if level == REMOTE_DURABLE:
            while applied() < n + 1:
                time.sleep(0.001)
        os.write(acks, b"%d\n" % n)
        n += 1
        if n % 16 == 0:
            trim_log(values, min(applied(), n))


def standby_child(root: str) -> None:
    """The standby's process: applies the primary's log from its file, one transaction per batch (until killed)."""
    primary = Store(os.path.join(root, PRIMARY_FILE), readonly=True, map_size=READER_MAP)
    with Standby(os.path.join(root, STANDBY_FILE)) as standby:
        while True:
            batch = log_after(primary, standby.applied, BATCH)
            if batch:
                standby.apply(batch)
            else:
                time.sleep(0.001)


def read_acks(root: str) -> list[int]:
    """The acknowledged operations, in order (a line cut by the kill is not one)."""
    try:
        with open(os.path.join(root, ACKS_FILE), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    return [int(line) for line in data.split(b"\n")[:-1]]


def check_pair(root: str, seed: int, level: str, result: ReplicatedResult, bad: Callable[[str], None]) -> None:
    """Check every promise on the two files after a kill (see the module docstring), then catch the standby up."""
    acks = read_acks(root)
    if any(b <= a for a, b in pairwise(acks)):  # a gap is an operation that committed unacknowledged
        bad(f"the acknowledged operations are not in order, each once: {acks[:20]}")
    acked = acks[-1] + 1 if acks else 0  # every operation through the last acknowledged one committed before it
    result.acknowledged = len(acks)
    primary, pstatus = held(os.path.join(root, PRIMARY_FILE))
    standby, sstatus = held(os.path.join(root, STANDBY_FILE))
    last, applied = pstatus["last"], sstatus["applied"]
    if last < acked:
        bad(f"operation {acked - 1} was acknowledged but the primary's last sequence is {last}")
    if applied > last:
        bad(f"the standby applied sequence {applied}, past the primary's last {last}")
    if primary != model(seed, last):
        bad(f"the primary's records are not the state after its {last} operations")
    if standby != model(seed, applied):
        bad(f"the standby's records are not the primary's state at the standby's applied sequence {applied}")
    if level == REMOTE_DURABLE and applied < acked:
        bad(f"{acked - applied} operations acknowledged at {level} are not on the standby (applied {applied})")
    result.async_unapplied = max(result.async_unapplied, acked - applied)
    check_promotion(root, seed, applied, last, sstatus["epoch"], bad)
    result.promotions += 1
    catch_up(root, bad)
    result.caught_up += 1


def check_promotion(root: str, seed: int, applied: int, last: int, epoch: int, bad: Callable[[str], None]) -> None:
    """Promote a copy of the standby: it holds the state at ``applied``, verifies, is at the next epoch, refuses
    the old primary's later records and takes a write as the next sequence."""
    copy = os.path.join(root, "promoted.kv")
    shutil.copyfile(os.path.join(root, STANDBY_FILE), copy)
    late = primary_records(os.path.join(root, PRIMARY_FILE), applied, 4)
    try:
        values = promote_value_store(copy)
        try:
            status = replication_status(values)
            if status["epoch"] != epoch + 1 or status["last"] != applied:
                bad(f"the promoted standby is at epoch {status['epoch']}, sequence {status['last']}; expected "
                    f"{epoch + 1}, {applied}")
            keys, vals, deletes = operation(seed, applied)
            values.write(keys, vals, deletes)
            if replication_status(values)["last"] != applied + 1:
                bad("the promoted standby's first write is not the sequence after what it applied")
        finally:
            values.close()
        if late:
            try:
                with Standby(copy) as old:
                    old.apply(late)
                bad("the promoted standby applied the old primary's records")
            except NotStandby:
                pass
        promoted, _ = held(copy)
        if promoted != model(seed, applied + 1):
            bad(f"the promoted standby does not hold the state at {applied} and its own write")
        report = verify_path(copy)
        if not report.ok:
            bad(f"the promoted standby fails verification: {report.problems[:3]}")
    except KvckptError as exc:
        bad(f"promoting the standby raised {type(exc).__name__}: {exc}")
    finally:
        os.remove(copy)


def catch_up(root: str, bad: Callable[[str], None]) -> None:
    """Apply the primary's log on the standby to its end, then compare every table's digest."""
    primary_path, standby_path = os.path.join(root, PRIMARY_FILE), os.path.join(root, STANDBY_FILE)
    with Standby(standby_path) as standby:
        while batch := primary_records(primary_path, standby.applied, 64):
            standby.apply(batch)
    report = compare_replicas(primary_path, standby_path)
    if not report["equal"]:
        bad(f"verify --against after catching up: sequences {report['this']['sequence']} and "
            f"{report['that']['sequence']}, tables differing {report['differing']}")


def run_replicated_campaign(kills: int, *, level: str = REMOTE_DURABLE, seed: int = 0, directory: str | None = None,
                            minutes: float | None = None, progress: Callable[[Any], None] | None = None,
                            ) -> ReplicatedResult:
    """Run ``kills`` kill cycles on one replicated value store pair at ``level`` (see the module docstring).

    Raises:
        ValueError: an unknown level.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; one of {', '.join(LEVELS)}")
    result = ReplicatedResult(level=level)
    rng = random.Random(seed)
    ctx = fork_server()
    with CampaignRun(result, directory, "kvckpt-replicated-", minutes=minutes, progress=progress) as run:
        setup(run.root)
        for cycle in run.cycles(kills):
            bad = run.reporter(f"kill {cycle}")
            children = {"primary": ctx.Process(target=primary_child, args=(run.root, seed, level), daemon=True),
                        "standby": ctx.Process(target=standby_child, args=(run.root,), daemon=True)}
            for child in children.values():
                child.start()
            time.sleep(rng.uniform(0.05, 0.5))
            for name, child in children.items():
                if not child.is_alive():
                    bad(f"the {name} child died on its own (exit status {child.exitcode})")
            victim = rng.choice(sorted(children))
            order = [victim, *(name for name in children if name != victim)]
            for name in order:  # the victim first; the other runs alone a moment, then dies too
                children[name].kill()
                children[name].join()
                time.sleep(rng.uniform(0, 0.1))
            result.kills += 1
            if victim == "primary":
                result.primary_kills += 1
            else:
                result.standby_kills += 1
            run.guarded("check", lambda bad=bad: check_pair(run.root, seed, level, result, bad), bad)
    return result
