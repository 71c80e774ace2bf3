"""Scenario builders and the fresh-process restore runner shared by the recovery tests.

Everything here drives the real public API (``ReplayBuffer``, ``checkpoint``, ``restore``) on real
LMDB files. The saving side builds a state the way a trainer and its producers would; the
restoring side runs in a *fresh interpreter* (``python tests/_scenarios.py MANIFEST``) that shares
nothing with it but the files, and prints what it observed as JSON for the test to judge.

Row contents are a pure function of ``(group_id, row index)`` (:func:`make_row`), so either side can
check that a restored row is bit-identical to the one that was committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvckpt import (
    BufferConfig,
    KvckptError,
    Lease,
    Prompt,
    RecoveryError,
    ReplayBuffer,
    restore,
)
from kvckpt.durability.verify import check
from kvckpt.samplers import BufferView
from kvckpt.storage.store import TABLES

N = 2  #: rows per group (E.1: n = 2 rollouts per group)
PER_STEP = 3  #: groups per training step (E.1: 3 groups per step)
CAPACITY = 64  #: E.1's capacity
SAMPLERS = ("in_order", "weight_fifo", "windowed", "ready_first")
SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "total_reward": ("float32", "row")}
HERE = os.path.abspath(__file__)
CHILD_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


class ScenarioError(AssertionError):
    """The saving side did not behave as the scenario script expects (a bug, or a wrong script)."""


# -- rows and buffers ----------------------------------------------------------------------------
def make_row(group_id: str, index: int) -> dict[str, torch.Tensor]:
    """The row a producer generates for ``{group_id}_g{index}``: deterministic, 2..7 tokens."""
    seed = zlib.crc32(f"{group_id}_g{index}".encode())
    length = 2 + seed % 6
    base = seed % 50_000
    return {"input_ids": torch.arange(base, base + length, dtype=torch.int64),
            "generation_logprobs": -torch.arange(1, length + 1, dtype=torch.float32) / (1 + seed % 7),
            "total_reward": torch.tensor(float(seed % 11) / 10, dtype=torch.float32)}


def rows_equal(group_id: str, index: int, row: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``row`` is bit-identical to :func:`make_row` of the same identity."""
    want = make_row(group_id, index)
    return set(row) == set(want) and all(torch.equal(row[k], want[k]) for k in want)


def sampler_config(name: str, lag: int) -> dict[str, Any]:
    """E.1's ``lag`` feeds ``max_lookahead_versions`` (in_order) or ``max_staleness_versions``."""
    key = "max_lookahead_versions" if name == "in_order" else "max_staleness_versions"
    return {"name": name, key: lag}


def new_buffer(path: str, sampler: str | Mapping[str, Any], *, lag: int = 1, capacity: int = CAPACITY,
               **kwargs: Any) -> ReplayBuffer:
    """A fresh buffer with the shared schema, n = 2 and 3 groups per step."""
    config = sampler_config(sampler, lag) if isinstance(sampler, str) else dict(sampler)
    return ReplayBuffer.create(path, BufferConfig(group_size=N, schema=SCHEMA, sampler=config,
                                                  max_buffered_rollouts=capacity, groups_per_step=PER_STEP,
                                                  **kwargs))


def prompt_idx(group_id: str) -> int:
    """Dataset index of a scenario prompt: ``gNN`` -> NN, filler ``fS-J`` -> 1000 + 10 S + J."""
    if group_id.startswith("g"):
        return int(group_id[1:])
    step, j = group_id[1:].split("-")
    return 1000 + 10 * int(step) + int(j)


def fillers(step: int) -> list[str]:
    """Ids of the filler prompts that make up the batch of ``step`` (warm-up history)."""
    return [f"f{step}-{j}" for j in range(PER_STEP)]


def _ids(gids: str | Iterable[str]) -> list[str]:
    return gids.split() if isinstance(gids, str) else list(gids)


class Driver:
    """Plays trainer and producers against one buffer through its public API only.

    Every call is checked against what the script expects (:class:`ScenarioError` otherwise), and
    ``ack`` (if given) is called after each acknowledged operation, as a crash log would be.
    """

    def __init__(self, buf: ReplayBuffer, ack: Callable[..., None] | None = None) -> None:
        self.buf = buf
        self.leases: dict[str, Lease] = {}
        self._ack = ack or (lambda **op: None)

    @property
    def version(self) -> int:
        return self.buf.trainer_version

    def admit(self, gids: str | Iterable[str], *, target: int | None = None) -> list[Lease]:
        """One dataloader batch (dataloader state ``after=<last id>``); ``target`` checks in_order's stamp."""
        ids = _ids(gids)
        state = f"after={ids[-1]}"
        leases = self.buf.admit([Prompt(prompt_idx=prompt_idx(g), group_id=g) for g in ids],
                                dataloader_state=state.encode(), timeout=0)
        if target is not None and self.buf.sampler.stamps_target_step and leases[0].target_step != target:
            raise ScenarioError(f"{ids} were stamped for step {leases[0].target_step}, the script expects {target}")
        self.leases.update((lease.group_id, lease) for lease in leases)
        self._ack(op="admit", gids=ids, dataloader=state, attempt=leases[0].attempt,
                  target=leases[0].target_step, version=self.version)
        return leases

    def commit(self, gids: str | Iterable[str], done: int = N) -> None:
        """Commit ``done`` rows of each group: the whole group at once, or sample by sample."""
        for gid in _ids(gids):
            lease = self.leases[gid]
            if done == N:
                if not self.buf.commit_group(lease, [make_row(gid, i) for i in range(N)]).ready:
                    raise ScenarioError(f"whole-group commit of {gid} did not make it ready")
                self._ack(op="commit", gid=gid)
                continue
            for i in range(done):
                self.buf.commit_sample(lease, i, make_row(gid, i))
                self._ack(op="sample", gid=gid, index=i)

    def select(self, expected: list[str]) -> None:
        """Claim exactly ``expected`` for the current step (streaming: at least one group)."""
        got = self.buf.select(1, PER_STEP).group_ids
        if got != expected:
            raise ScenarioError(f"step {self.version} selected {got}, the script expects {expected}")
        self._ack(op="select", step=self.version, gids=got)

    def step(self, expected: list[str]) -> None:
        """Train one step on exactly ``expected`` and close it."""
        self.select(expected)
        self.buf.read_batch(expected)
        self.buf.finish_step()
        self._ack(op="finish", version=self.version)

    def filler_step(self) -> None:
        """A whole step trained on fillers admitted at the current version (lag-0 history)."""
        ids = fillers(self.version)
        self.admit(ids, target=self.version)
        self.commit(ids)
        self.step(ids)

    def warmup(self, steps: int) -> None:
        """``steps`` filler steps from an empty buffer: trainer version ``steps``."""
        for _ in range(steps):
            self.filler_step()

    def progress(self, done: Mapping[str, int]) -> None:
        """Per-group number of generated rows (0 = nothing yet, N = complete)."""
        for gid, count in done.items():
            if count:
                self.commit([gid], count)


# -- the E.1 round-trip matrix -------------------------------------------------------------------
@dataclass(frozen=True)
class Expect:
    """What a restored buffer must hold and do, for one scenario under one sampler.

    ``ready`` maps ready group -> ``start_weight``; ``targets`` the in_order ``target_step`` of every
    outstanding scenario group (other samplers stamp none); ``leases`` the rows each redispatched
    group still misses; ``gone`` deliberately discarded groups -> their state. ``eligible_now`` is
    the restored sampler's choice before anything is regenerated; ``evicted`` the first ``evict``
    after the redispatched groups complete; ``steps`` what each following step selects.
    """

    version: int
    dispatch_index: int
    dataloader: str
    ready: dict[str, int]
    targets: dict[str, int]
    eligible_now: list[str]
    steps: list[list[str]]
    leases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gone: dict[str, str] = field(default_factory=dict)
    evicted: list[str] = field(default_factory=list)
    returned: int = 0


def _lag1_next_step(d: Driver, done: Mapping[str, int]) -> None:
    # kvckpt has one "current" version (trainer_version) for every sampler, so weights follow the
    # trainer: a batch admitted one step ahead (lookahead 1) carries the weights of the version it
    # was admitted at. NeMo's table writes (w0, w1) for the two batches; here they are (w3, w4).
    d.warmup(3)
    d.admit(fillers(3), target=3)
    d.admit("g09 g10 g11", target=4)
    d.commit(fillers(3))
    d.step(fillers(3))
    d.admit("g12 g13 g14", target=5)
    d.commit("g09 g10 g11")
    d.step(["g09", "g10", "g11"])
    d.progress(done)


def _lag0_current_step(d: Driver, done: Mapping[str, int]) -> None:
    d.warmup(4)
    d.admit("g09 g10 g11", target=4)
    d.commit("g09 g10 g11")
    d.step(["g09", "g10", "g11"])
    d.admit("g12 g13 g14", target=5)
    d.progress(done)


def _lag2_two_batches(d: Driver, done: Mapping[str, int]) -> None:
    d.warmup(2)
    d.admit(fillers(2), target=2)
    d.admit(fillers(3), target=3)
    d.admit("g09 g10 g11", target=4)
    d.commit(fillers(2))
    d.step(fillers(2))
    d.admit("g12 g13 g14", target=5)
    d.commit(fillers(3))
    d.step(fillers(3))
    d.admit("g15 g16 g17", target=6)
    d.commit("g09 g10 g11")
    d.step(["g09", "g10", "g11"])
    d.progress(done)


def _evicted_group(d: Driver) -> None:
    # NeMo removes the committed g10 by hand (remove_group); kvckpt's deliberate discard of a ready
    # group is evict(group_ids), the same for every sampler. Step 4 then trains g09 and g11.
    d.warmup(3)
    d.admit(fillers(3), target=3)
    d.admit("g09 g10 g11", target=4)
    d.commit(fillers(3))
    d.step(fillers(3))
    d.admit("g12 g13 g14", target=5)
    d.commit("g09 g10 g11")
    if d.buf.evict(["g10"]) != ["g10"]:
        raise ScenarioError("evict(['g10']) should discard exactly g10")
    d.step(["g09", "g11"])
    d.progress({"g12": 1, "g13": 2})


def _hole(d: Driver) -> None:
    # "13 trained ahead of unfinished 12": streaming selection claimed the only ready group of
    # step 5, and the checkpoint lands mid-step. kvckpt checkpoints can be taken mid-step: the
    # model checkpoint of version 5 has not trained on g13, so restore hands it back (ready, in its
    # original dispatch position, stamps untouched).
    _lag1_next_step(d, {"g12": 1, "g13": 2})
    d.select(["g13"])


def _stalled(d: Driver, late: str, early_rows: int, late_rows: int, batch: str) -> None:
    # The step-1 batch is {f1-0, f1-1, late}; ``late`` generates ``early_rows`` rows and stalls while
    # the trainer runs steps 1..7 on fillers (step 1 closes short); ``late_rows`` more land at the
    # end. ``batch`` is admitted at version 7 for step 8 (weights 7). The trainer never calls
    # abort_stale_inflight here (it is windowed's only; NeMo's table keeps the stalled group too).
    d.admit(fillers(0), target=0)
    d.admit(["f1-0", "f1-1", late], target=1)
    d.commit([late], early_rows)
    d.commit(fillers(0))
    d.step(fillers(0))
    d.commit(["f1-0", "f1-1"])
    d.step(["f1-0", "f1-1"])
    while d.version < 7:
        d.filler_step()
    d.admit(fillers(7), target=7)
    d.admit(batch, target=8)
    d.commit(fillers(7))
    d.step(fillers(7))
    d.commit(batch)
    d.commit([late], late_rows)


def _per_sampler(default: Any, **overrides: Any) -> dict[str, Any]:
    return {name: overrides.get(name, default) for name in SAMPLERS}


@dataclass(frozen=True)
class Scenario:
    """One row of E.1: how to build it, its lag, and the expectation per sampler."""

    name: str
    lag: int
    build: Callable[[Driver], None]
    expect: dict[str, Expect]


def _same(**kwargs: Any) -> dict[str, Expect]:
    return _per_sampler(Expect(**kwargs))


_T5 = {"g12": 5, "g13": 5, "g14": 5}
_PARTIAL = {"g12": (1,), "g14": (0, 1)}
_NEXT = [["g12", "g13", "g14"]]

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("lag1-next-step-complete", 1, lambda d: _lag1_next_step(d, {"g12": 2, "g13": 2, "g14": 2}),
             _same(version=5, dispatch_index=5, dataloader="after=g14", ready={"g12": 4, "g13": 4, "g14": 4},
                   targets=_T5, eligible_now=["g12", "g13", "g14"], steps=_NEXT)),
    Scenario("lag0-current-step-complete", 0, lambda d: _lag0_current_step(d, {"g12": 2, "g13": 2, "g14": 2}),
             _same(version=5, dispatch_index=5, dataloader="after=g14", ready={"g12": 5, "g13": 5, "g14": 5},
                   targets=_T5, eligible_now=["g12", "g13", "g14"], steps=_NEXT)),
    Scenario("lag1-next-step-partly-generated", 1, lambda d: _lag1_next_step(d, {"g12": 1, "g13": 2}),
             _same(version=5, dispatch_index=5, dataloader="after=g14", ready={"g13": 4}, targets=_T5,
                   leases=_PARTIAL, eligible_now=["g13"], steps=_NEXT)),
    Scenario("lag0-current-step-partly-generated", 0, lambda d: _lag0_current_step(d, {"g12": 1, "g13": 2}),
             _same(version=5, dispatch_index=5, dataloader="after=g14", ready={"g13": 5}, targets=_T5,
                   leases=_PARTIAL, eligible_now=["g13"], steps=_NEXT)),
    Scenario("lag2-two-batches-in-flight", 2,
             lambda d: _lag2_two_batches(d, {"g12": 1, "g13": 2, "g15": 2, "g16": 1}), {
        name: Expect(version=5, dispatch_index=6, dataloader="after=g17", ready={"g13": 3, "g15": 4},
                     targets={**_T5, "g15": 6, "g16": 6, "g17": 6},
                     leases={**_PARTIAL, "g16": (1,), "g17": (0, 1)},
                     # windowed (W=2) and ready_first see both ready groups; weight_fifo waits for
                     # weight 3 (g12, g14 still generating); in_order wants step 5 only.
                     eligible_now=["g13", "g15"] if name in ("windowed", "ready_first") else ["g13"],
                     steps=[["g12", "g13", "g14"], ["g15", "g16", "g17"]])
        for name in SAMPLERS}),
    # Not in NeMo's table: the older batch is still generating while the younger one is complete.
    # The restored weight_fifo must wait for weight 3 (in-flight groups count), in_order for step 5.
    Scenario("lag2-older-batch-still-generating", 2,
             lambda d: _lag2_two_batches(d, {"g12": 1, "g15": 2, "g16": 2, "g17": 2}), {
        name: Expect(version=5, dispatch_index=6, dataloader="after=g17", ready={"g15": 4, "g16": 4, "g17": 4},
                     targets={**_T5, "g15": 6, "g16": 6, "g17": 6}, leases={"g12": (1,), "g13": (0, 1), "g14": (0, 1)},
                     eligible_now=["g15", "g16", "g17"] if name in ("windowed", "ready_first") else [],
                     steps=[["g12", "g13", "g14"], ["g15", "g16", "g17"]])
        for name in SAMPLERS}),
    Scenario("lag1-with-an-evicted-group", 1, _evicted_group, {
        name: Expect(version=5, dispatch_index=5, dataloader="after=g14", ready={"g13": 4}, targets=_T5,
                     leases=_PARTIAL, gone={"g10": "evicted"}, eligible_now=["g13"], steps=_NEXT)
        for name in SAMPLERS}),
    Scenario("trained-what-was-ready-leaving-a-hole", 1, _hole,
             _same(version=5, dispatch_index=5, dataloader="after=g14", ready={"g13": 4}, targets=_T5,
                   leases=_PARTIAL, eligible_now=["g13"], steps=_NEXT, returned=1)),
    # Weight gap 0 vs 7: restore keeps g09 (no staleness on load); the first evict drops it, except
    # under ready_first, which has no lower bound and trains it first.
    Scenario("stale-only", 1, lambda d: _stalled(d, "g09", 0, 2, "g10"), {
        name: Expect(version=8, dispatch_index=8, dataloader="after=g10", ready={"g09": 0, "g10": 7},
                     targets={"g09": 1, "g10": 8},
                     eligible_now=["g09", "g10"] if name == "ready_first" else ["g10"],
                     evicted=[] if name == "ready_first" else ["g09"],
                     steps=[["g09", "g10"]] if name == "ready_first" else [["g10"]])
        for name in SAMPLERS}),
    Scenario("long-stalled-partly-generated", 1, lambda d: _stalled(d, "g12", 1, 0, "g13 g14 g15"), {
        name: Expect(version=8, dispatch_index=8, dataloader="after=g15", ready={"g13": 7, "g14": 7, "g15": 7},
                     targets={"g12": 1, "g13": 8, "g14": 8, "g15": 8}, leases={"g12": (1,)},
                     eligible_now=["g13", "g14", "g15"],
                     evicted=[] if name == "ready_first" else ["g12"],
                     steps=[["g12", "g13", "g14"], ["g15"]] if name == "ready_first" else [["g13", "g14", "g15"]])
        for name in SAMPLERS}),
)


def saved_view(buf: ReplayBuffer) -> dict[str, Any]:
    """What the saving side holds, as JSON: groups and ledger by id, cursors, dataloader state."""
    st = buf.state()
    dl = buf.dataloader_state()
    return json.loads(json.dumps({"groups": {g.group_id: g.to_dict() for g in buf.groups()},
            "ledger": {e.group_id: e.to_dict() for e in buf.ledger()},
            "trainer_version": st["trainer_version"], "dispatch_index": st["dispatch_index"],
            "admitted": st["counters"]["admitted"], "dataloader": None if dl is None else dl.decode(),
            "shortfall": {str(k): v for k, v in buf.batch_shortfall().items()}}))


def build_scenario(directory: str, sampler: str, sc: Scenario) -> dict[str, Any]:
    """Build ``sc`` under ``sampler``, checkpoint it to ``{directory}/{name}.kvckpt`` and return the
    saved view.

    After the checkpoint is stamped, the live buffer keeps going while the copy runs (the old
    workers finish their groups, the trainer claims what it can): none of that may reach the file.
    """
    with new_buffer(os.path.join(directory, f"{sc.name}.live-src"), sampler, lag=sc.lag) as buf:
        driver = Driver(buf)
        sc.build(driver)
        saved = saved_view(buf)
        handle = buf.checkpoint(os.path.join(directory, f"{sc.name}.kvckpt"), {"scenario": sc.name})
        for entry in buf.ledger():
            lease = driver.leases[entry.group_id]
            buf.commit_group(lease, {i: make_row(lease.group_id, i) for i in lease.missing
                                     if i not in entry.siblings})
        buf.select(1, PER_STEP)
        handle.wait()
    return saved


def build_matrix(root: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Every scenario under every sampler, in ``{root}/{sampler}/``; saved views by sampler, then name.

    The stores are built side by side on threads: the work is fsync-bound and fsync releases the GIL.
    """
    from concurrent.futures import ThreadPoolExecutor

    cases = [(sampler, sc) for sampler in SAMPLERS for sc in SCENARIOS]
    for sampler in SAMPLERS:
        os.makedirs(os.path.join(root, sampler), exist_ok=True)
    with ThreadPoolExecutor(12) as pool:
        views = list(pool.map(lambda c: build_scenario(os.path.join(root, c[0]), c[0], c[1]), cases))
    saved: dict[str, dict[str, dict[str, Any]]] = {sampler: {} for sampler in SAMPLERS}
    for (sampler, sc), view in zip(cases, views, strict=True):
        saved[sampler][sc.name] = view
    return saved


# -- the restoring side (runs in a fresh interpreter) --------------------------------------------
def fingerprint(buf: ReplayBuffer) -> str:
    """A hash of every key and value of every table: equal iff nothing was written."""
    def txn_fn(txn: Any) -> str:
        h = hashlib.sha256()
        for table in TABLES:
            for key, value in txn.iter_prefix(table, b""):
                h.update(table.encode() + b"\0" + key + b"\0" + value)
        return h.hexdigest()
    return buf.store.read(txn_fn)


def file_sha256(path: str) -> str | None:
    """The SHA-256 of a file's bytes, or ``None`` if there is no file."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def observe(buf: ReplayBuffer, plan: Any) -> dict[str, Any]:
    """Everything a test asserts about a freshly restored or recovered buffer, as JSON."""
    st = buf.state()
    stored = [g.group_id for g in buf.groups(("ready", "claimed", "consumed")) if g.rows_stored]
    rows: dict[str, dict[str, Any]] = {gid: {"ids": [], "equal": True} for gid in stored}
    if stored:
        batch = buf.read_batch(stored, layout="list")
        for gid, index, row in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True):
            rows[gid]["ids"].append(f"{gid}_g{index}")
            rows[gid]["equal"] &= rows_equal(gid, index, row)
    report = plan.report()
    return {"plan": {k: v for k, v in report.items() if not k.endswith("_seconds")},
            "leases": [lease.to_dict() for lease in plan.leases],
            "trainer_state": plan.trainer_state,
            "dataloader": None if plan.dataloader_state is None else plan.dataloader_state.decode(),
            "state": {k: st[k] for k in ("trainer_version", "dispatch_index", "weight_version", "drop_floor",
                                         "durable", "inflight", "ready", "claimed", "counters")},
            "groups": {g.group_id: g.to_dict() for g in buf.groups()},
            "ledger": {e.group_id: e.to_dict() for e in buf.ledger()},
            "shortfall": {str(k): v for k, v in buf.batch_shortfall().items()},
            "rows": rows}


def eligible_now(buf: ReplayBuffer) -> list[str]:
    """What the restored sampler would hand out now, without claiming anything."""
    version = buf.trainer_version
    return buf.store.read(lambda txn: list(buf.sampler.eligible(BufferView(txn), version)))


def complete(buf: ReplayBuffer, leases: Iterable[Lease]) -> list[bool]:
    """Redispatch: generate exactly the missing rows of each lease and commit them."""
    return [buf.commit_group(lease, [make_row(lease.group_id, i) for i in lease.missing]).ready
            for lease in leases]


def train(buf: ReplayBuffer, min_groups: int = 1, max_steps: int = 6) -> list[dict[str, Any]]:
    """The trainer's loop: select, read, finish, until nothing is selectable."""
    steps = []
    for _ in range(max_steps):
        sel = buf.select(min_groups, PER_STEP)
        if not sel:
            break
        batch = buf.read_batch(sel, layout="list")
        equal = all(rows_equal(g, i, r) for g, i, r in zip(batch.group_ids, batch.row_indices, batch.rows,
                                                           strict=True))
        steps.append({"step": sel.step, "gids": sel.group_ids, "rows_equal": equal,
                      "rows": len(batch.rows)})
        buf.finish_step()
    return steps


def zombie_commits(buf: ReplayBuffer, leases: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Commit under leases from before the restore (one row when siblings exist, else the group)."""
    before = fingerprint(buf)
    results = []
    for doc in leases:
        lease = Lease.from_dict(doc)
        gid = lease.group_id
        try:
            if 0 < len(lease.missing) < N:
                buf.commit_sample(lease, lease.missing[0], make_row(gid, lease.missing[0]))
            else:
                buf.commit_group(lease, [make_row(gid, i) for i in range(N)])
            results.append("accepted")
        except KvckptError as exc:
            results.append(type(exc).__name__)
    return {"results": results, "unchanged": fingerprint(buf) == before}


def read_each(buf: ReplayBuffer) -> dict[str, str]:
    """``read_batch`` of every group with rows, one at a time: ``"ok"`` when its rows are exactly
    what the workload wrote, else the error class and message."""
    out = {}
    for group in buf.groups():
        if not group.rows_stored:
            continue
        gid = group.group_id
        try:
            batch = buf.read_batch([gid], layout="list")
        except KvckptError as exc:
            out[gid] = f"{type(exc).__name__}: {exc}"
            continue
        same = all(rows_equal(g, i, r) for g, i, r in zip(batch.group_ids, batch.row_indices, batch.rows, strict=True))
        out[gid] = "ok" if same else "wrong data"
    return out


def probe_admission(buf: ReplayBuffer) -> Any:
    """The next admission's stamp (``target_step``), or the name of the error that refused it."""
    try:
        [lease] = buf.admit([Prompt(prompt_idx=10**6, group_id="probe")], timeout=0)
    except KvckptError as exc:
        return type(exc).__name__
    return lease.target_step


def run_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """Restore one checkpoint file as ``job`` says and report what a trainer would see and do."""
    try:
        buf, plan = restore(job["ckpt"], job["live"], sampler=job.get("sampler"),
                            max_buffered_rollouts=job.get("capacity"), overwrite=job.get("overwrite", False))
    except KvckptError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "live_exists": os.path.exists(job["live"]),
                "live_sha256": file_sha256(job["live"])}
    with buf:
        if job.get("read"):  # a file with damaged rows: what each group's read gives, nothing else
            return {"read": read_each(buf)}
        out = observe(buf, plan)
        out["eligible_now"] = eligible_now(buf)
        if job.get("zombies"):
            out["zombies"] = zombie_commits(buf, job["zombies"])
        if job.get("probe"):
            out["probe"] = probe_admission(buf)
        if job.get("complete"):
            out["completed"] = complete(buf, plan.leases)
        if job.get("evict"):
            out["evicted"] = buf.evict()
        if job.get("train"):
            out["steps"] = train(buf, job.get("min_groups", 1))
        out["verify"] = [str(p) for p in buf.store.read(check).problems]
    return out


def run_fresh(jobs: list[dict[str, Any]], directory: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``jobs`` in one fresh interpreter and return its results (one per job)."""
    manifest = os.path.join(directory, f"manifest-{os.getpid()}-{id(jobs)}.json")
    with open(manifest, "w") as f:
        json.dump(jobs, f)
    proc = subprocess.run([sys.executable, HERE, "jobs", manifest], capture_output=True, text=True,
                          timeout=timeout, env=CHILD_ENV)
    if proc.returncode != 0:
        raise AssertionError(f"restore process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


# -- live-store crash workload (runs in a child that kills itself) -------------------------------
LIVE_K = 4  #: the model checkpoint the trainer resumes from
LIVE_CHECKPOINTS = (2, 4)  #: versions checkpointed between steps (and 6, mid-step, before the kill)
LIVE_KILL_AFTER = 3  #: acknowledged producer rows of the last batch before the SIGKILL


def batch_ids(step: int) -> list[str]:
    """Group ids of the live workload's batch for ``step``."""
    return [f"b{step}-{j}" for j in range(PER_STEP)]


def live_workload(store: str, log_path: str, ckpt_dir: str) -> None:
    """in_order, lookahead 1: train steps 0..5 (checkpoints at versions 2 and 4), then at version 6
    claim step 6's batch, checkpoint mid-step, let a producer thread commit step 7's rows one by
    one and SIGKILL this process once ``LIVE_KILL_AFTER`` of them are acknowledged.

    Every acknowledged operation is appended to ``log_path`` and fsync'd before the next one.
    """
    import signal

    log = open(log_path, "a")  # noqa: SIM115 - lives until the kill
    lock = threading.Lock()

    def ack(**op: Any) -> None:
        with lock:
            log.write(json.dumps(op) + "\n")
            log.flush()
            os.fsync(log.fileno())

    buf = new_buffer(store, "in_order", lag=1)
    d = Driver(buf, ack)

    def admit(step: int) -> None:
        ids = batch_ids(step)
        leases = buf.admit([Prompt(prompt_idx=100 * step + j, group_id=g) for j, g in enumerate(ids)],
                           dataloader_state=f"after={ids[-1]}".encode(), timeout=0)
        d.leases.update((lease.group_id, lease) for lease in leases)
        ack(op="admit", gids=ids, dataloader=f"after={ids[-1]}", target=leases[0].target_step,
            attempt=leases[0].attempt, leases=[lease.to_dict() for lease in leases])

    def generate(step: int) -> None:
        first, second, third = batch_ids(step)
        d.commit([first])
        d.commit([second], 1)
        buf.commit_sample(d.leases[second], 1, make_row(second, 1))
        ack(op="sample", gid=second, index=1)
        d.commit([third])

    admit(0)
    while d.version < 6:
        admit(d.version + 1)
        generate(d.version)
        d.step(batch_ids(d.version))
        if d.version in LIVE_CHECKPOINTS:
            buf.checkpoint(os.path.join(ckpt_dir, f"step{d.version}.kvckpt"), {"step": d.version}).wait()
            ack(op="checkpoint", version=d.version)
    admit(7)
    generate(6)
    d.select(batch_ids(6))
    buf.checkpoint(os.path.join(ckpt_dir, "step6.kvckpt"), {"step": 6}).wait()
    ack(op="checkpoint", version=6)
    acked = threading.Semaphore(0)

    def producer() -> None:
        for gid in batch_ids(7):
            for i in range(N):
                buf.commit_sample(d.leases[gid], i, make_row(gid, i))
                ack(op="sample", gid=gid, index=i)
                acked.release()

    threading.Thread(target=producer, daemon=True).start()
    for _ in range(LIVE_KILL_AFTER):
        acked.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def live_recover(store: str, resume: int, too_old: int, zombies: list[dict[str, Any]]) -> dict[str, Any]:
    """Reopen the crashed live store, try a rollback past the drop floor, then recover to ``resume``
    and replay: what a restarted trainer does with a model checkpoint of version ``resume``."""
    from kvckpt.durability.safe_open import verify_path

    out: dict[str, Any] = {"verify_before": [str(p) for p in verify_path(store, deep=True).problems]}
    with ReplayBuffer.open(store) as buf:
        before = fingerprint(buf)
        try:
            buf.recover(too_old)
            out["too_old"] = {"error": None}
        except RecoveryError as exc:
            out["too_old"] = {"error": type(exc).__name__, "message": str(exc)}
        out["too_old"]["unchanged"] = fingerprint(buf) == before
        plan = buf.recover(resume)
        out.update(observe(buf, plan))
        out["zombies"] = zombie_commits(buf, zombies)
        out["completed"] = complete(buf, plan.leases)
        out["steps"] = []
        while step := train(buf, min_groups=PER_STEP, max_steps=1):
            st = buf.state()
            out["steps"].append({**step[0], "drop_floor": st["drop_floor"], "durable": st["durable"]})
        out["after"] = {g.group_id: [g.state, g.rows_stored] for g in buf.groups()}
        out["verify"] = [str(p) for p in buf.store.read(check).problems]
    return out


def recover_again(store: str, resume: int, ckpt: str, restored: str) -> dict[str, Any]:
    """Crash, ``recover(resume)``, checkpoint, crash again before training: recover the live store
    again and restore the checkpoint. Each attempt reports its plan's changes or its error."""
    def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
        try:
            buf, plan = fn()
        except KvckptError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        with buf:
            return {"changes": plan.changes, "ready": buf.state()["ready"], "verify": [
                str(p) for p in buf.store.read(check).problems]}

    def live() -> tuple[ReplayBuffer, Any]:
        buf = ReplayBuffer.open(store)
        return buf, buf.recover(resume)

    first = attempt(live)
    with ReplayBuffer.open(store) as buf:
        buf.checkpoint(ckpt).wait()
    return {"first": first, "second": attempt(live), "restore": attempt(lambda: restore(ckpt, restored))}


def main(argv: list[str]) -> None:
    """Child entry points: ``jobs MANIFEST``, ``live-workload STORE LOG DIR``, and
    ``live-recover STORE RESUME TOO_OLD ZOMBIES_JSON STORE2 RESUME2`` (``STORE2`` goes through
    :func:`recover_again`)."""
    if argv[0] == "jobs":
        with open(argv[1]) as f:
            jobs = json.load(f)
        json.dump([run_job(job) for job in jobs], sys.stdout)
    elif argv[0] == "live-workload":
        live_workload(*argv[1:4])
    elif argv[0] == "live-recover":
        with open(argv[4]) as f:
            zombies = json.load(f)
        out = live_recover(argv[1], int(argv[2]), int(argv[3]), zombies)
        out["recover_again"] = recover_again(argv[5], int(argv[6]), f"{argv[5]}.kvckpt", f"{argv[5]}.restored")
        json.dump(out, sys.stdout)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
