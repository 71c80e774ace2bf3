"""Power-loss campaign: cut the power under a live kvckpt workload, many times, and check every
promise on the disk image that survives.

``python -m kvckpt.testing.campaigns.powercut --cuts N`` (or ``python -m kvckpt.testing.campaigns.campaign powercut``).
Each cut:

1. mounts a :mod:`~kvckpt.testing.campaigns.powerfs` filesystem over the previous cut's surviving image (a
   chain starts from an empty one), and starts a child process (forked from a fork server that
   never opened a store) that creates a store, recovers it, reopens it as it is, or restores its
   newest checkpoint into a new run directory, then runs the crash campaign's workload on it
   (:func:`kvckpt.testing.campaigns.workload.run_workload`: admit, commit_group, commit_sample, edge-encoded
   commit_encoded, commit_many batches with a refused item, select, finish_step, evict, abort,
   redispatch, background checkpoints racing commits). The child sends
   each *acknowledged* operation down a pipe to the parent, outside the mount;
2. at a random moment cuts the power (``strict``: only what was made durable survives;
   ``random``: also a random subset of unsynced pages and a random prefix of unsynced directory
   operations), SIGKILLs the child and unmounts;
3. checks the image in another fresh process (:func:`kvckpt.testing.campaigns.image_check.check_image`).

Side workloads (:mod:`kvckpt.testing.campaigns.sides`, ``sides=[...]``, ``--side MODULE``) run in each child on the
mounted run directory beside the buffer's; the image check runs each side's check on the surviving image.

:data:`BREAKAGES` names deliberately broken configurations (LMDB without ``sync``/``metasync``; a
checkpoint renamed without fsyncing the file and its directory): a campaign run with one must
report violations, which is how the campaign shows it can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt import ReplayBuffer, restore
from kvckpt.storage.store import fsync_dir
from kvckpt.testing.campaigns import powerfs
from kvckpt.testing.campaigns.harness import CampaignRun, every, fork_server, in_fresh_process, report, tally
from kvckpt.testing.campaigns.history import WorkloadFindings
from kvckpt.testing.campaigns.image_check import checker
from kvckpt.testing.campaigns.sides import load_side
from kvckpt.testing.campaigns.values_workload import is_value_op
from kvckpt.testing.campaigns.workload import CHECKPOINT_GLOB, SAMPLERS, run_workload, workload_config

#: Deliberately broken durability, applied in the child before it opens anything.
BREAKAGES = ("lmdb-nosync", "checkpoint-nofsync")
CUT_MODES = ("strict", "random")


@dataclass
class PowercutResult(WorkloadFindings):
    """What a power-cut campaign did and found; ``violations`` is empty when every promise held."""

    cuts: int = 0
    checkpoints_restored: int = 0
    starts: dict[str, int] = field(default_factory=dict)  #: how children began: create/recover/open/restore
    modes: dict[str, int] = field(default_factory=dict)  #: cuts per mode
    pages_kept: int = 0  #: unsynced pages ``random`` cuts kept
    ops_kept: int = 0  #: unsynced directory operations ``random`` cuts kept

    def summary(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"power-cut campaign: cuts {self.cuts} ({tally(self.modes)}), operations checked "
                f"{self.operations_checked}, checkpoints restored {self.checkpoints_restored}, starts "
                f"({tally(self.starts)}), unsynced pages / directory operations kept by random cuts "
                f"{self.pages_kept} / {self.ops_kept}, commits ({tally(self.commit_paths)}), "
                f"operations ({tally(self.operation_kinds)}), "
                f"violations found {len(self.violations)}, {self.seconds:.0f}s")


class PipeLog:
    """The child's side channel: each acknowledged operation is sent to the parent as one message
    before :meth:`append` returns (the parent holds it in memory, outside the mounted filesystem)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def append(self, **op: Any) -> None:
        """Send one operation."""
        data = json.dumps(op, separators=(",", ":")).encode()
        with self._lock:
            self._conn.send_bytes(data)


def _make_run(mount: str, timeline: str) -> str:
    """The harness's own directories for a run, made durable (that is the harness's job, not kvckpt's;
    the store's own entry in ``run`` is kvckpt's)."""
    run = os.path.join(mount, timeline)
    os.makedirs(os.path.join(run, "ckpt"))
    fsync_dir(run)
    fsync_dir(mount)
    return run


def _apply_breakage(breakage: str | None) -> None:
    """Break durability on purpose in this (child) process."""
    if breakage is None:
        return
    if breakage == "lmdb-nosync":
        import lmdb

        real_open = lmdb.open

        def open_without_sync(*args: Any, **kwargs: Any) -> Any:
            return real_open(*args, **{**kwargs, "sync": False, "metasync": False})

        lmdb.open = open_without_sync
    elif breakage == "checkpoint-nofsync":  # the checkpoint module's fsyncs (its os, its fsync helpers) do nothing
        checkpoint = importlib.import_module("kvckpt.durability.checkpoint")  # the module, not the function
        unsynced = types.ModuleType("os")
        unsynced.__dict__.update(os.__dict__)
        unsynced.fsync = lambda fd: None
        checkpoint.os = unsynced
        for name in ("fsync_file", "fsync_dir", "_fsync_file", "_fsync_dir"):
            if hasattr(checkpoint, name):
                setattr(checkpoint, name, lambda path: None)
    else:
        raise ValueError(f"unknown breakage {breakage!r} (one of {', '.join(BREAKAGES)})")


def _child(mount: str, timeline: str, start: str, source: str | None, sampler: dict[str, Any], seed: int,
           breakage: str | None, sides: Sequence[str], conn: Any, errpath: str) -> None:
    """The workload on the mounted filesystem; ``start`` says how it opens the store. Each side workload of
    ``sides`` starts once the run is acknowledged (its operations then follow the run's ``created`` or
    ``restored``, which is where the parent's record of a run begins)."""
    fd = os.open(errpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    try:
        _apply_breakage(breakage)
        log = PipeLog(conn)
        run = os.path.join(mount, timeline)
        live = os.path.join(run, "live.kv")
        if start == "create":
            _make_run(mount, timeline)
            buf = ReplayBuffer.create(live, workload_config(sampler))
            log.append(op="created", timeline=timeline)
        elif start == "restore":
            _make_run(mount, timeline)
            buf, plan = restore(source, live)
            st = buf.state()
            log.append(op="restored", timeline=timeline, source=os.path.relpath(source, mount),
                       cursor=int(buf.dataloader_state() or b"0"), version=st["trainer_version"],
                       leases=[lease.group_id for lease in plan.leases])
        else:
            buf = ReplayBuffer.open(live)
            if start == "recover":
                plan = buf.recover()
                log.append(op="recovered", leases=[lease.group_id for lease in plan.leases])
        for side in sides:
            load_side(side).start(run, log, seed)
        run_workload(buf, log, os.path.join(run, "ckpt"), seed, lambda: None)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


# -- the parent ------------------------------------------------------------------------------------


@dataclass
class _Run:
    """The chain's state between cuts: the image on disk and the run acknowledged as current."""

    image: str
    timeline: str | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    restored: dict[str, str] = field(default_factory=dict)  #: checkpoint name -> digest of bytes that restored
    rows_seen: set[bytes] = field(default_factory=set)  #: rows already compared with their producer's


def _collect(conn: Any, into: list[bytes]) -> None:
    with contextlib.suppress(EOFError, OSError):
        while True:
            into.append(conn.recv_bytes())


def _one_cut(k: int, root: str, chain: _Run, sampler: dict[str, Any], rng: random.Random, max_delay: float,
             min_ops: int, breakage: str | None, modes: tuple[str, ...], sides: Sequence[str],
             result: PowercutResult, bad: Callable[[str], None]) -> None:
    mnt, image = os.path.join(root, "mnt"), os.path.join(root, f"image-{k:06d}")
    if chain.timeline is None:
        start, source = "create", None
    else:
        ckpts = sorted(glob.glob(os.path.join(chain.image, chain.timeline, "ckpt", CHECKPOINT_GLOB)))
        start = rng.choices(("recover", "open", "restore"), (0.6, 0.25, 0.15 if ckpts else 0))[0]
        source = os.path.join(mnt, chain.timeline, "ckpt", os.path.basename(ckpts[-1])) if start == "restore" else None
    timeline = chain.timeline if start in ("recover", "open") else f"run-{k:06d}"
    result.starts[start] = result.starts.get(start, 0) + 1
    mode = rng.choice(modes)
    result.modes[mode] = result.modes.get(mode, 0) + 1
    errpath = os.path.join(root, "child.stderr")
    open(errpath, "wb").close()
    ctx = fork_server(sides)
    fs = powerfs.mount(chain.image, mnt, ctx)
    messages: list[bytes] = []
    try:
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(mnt, timeline, start, source, sampler, rng.randrange(1 << 30),
                                                 breakage, sides, send, errpath), daemon=True)
        child.start()
        send.close()
        reader = threading.Thread(target=_collect, args=(recv, messages), daemon=True)
        reader.start()
        if rng.random() < 0.15:  # cut during start-up: create, restore, recovery
            time.sleep(rng.random() * 0.3)
        else:
            deadline = time.monotonic() + 60
            while not any(m.startswith(b'{"op":"start"') for m in messages) and child.is_alive() \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            started = len(messages)
            while (sum(not is_value_op(m) for m in messages[started:]) < min_ops and child.is_alive()
                   and time.monotonic() < deadline):  # the buffer's operations: the value store's come faster
                time.sleep(0.01)
            time.sleep(rng.random() * max_delay)
        before_cut = len(messages)
        if not child.is_alive():
            with open(errpath, "rb") as f:
                bad(f"the child exited by itself (status {child.exitcode}) before the cut: "
                    f"{f.read().decode(errors='replace')[-1500:]}")
        report = fs.cut(image, mode, rng.randrange(1 << 30))
        result.pages_kept += report.pages_kept
        result.ops_kept += report.ops_kept
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        child.join()
        reader.join(30)
        recv.close()
    finally:
        fs.unmount()
    shutil.rmtree(chain.image)
    chain.image = image
    ops = [json.loads(m) for m in messages]
    for op in ops[:before_cut]:  # the workload's own findings; after the cut, failures are expected
        if op["op"] == "violation":
            bad(f"the workload reported before the cut: {op['what']}")
    ops = [op for op in ops if op["op"] != "violation"]
    for i, op in enumerate(ops):
        if op["op"] in ("created", "restored"):
            chain.timeline, chain.ops, chain.restored = op["timeline"], [], {}
            ops = ops[i:]
            break
    chain.ops.extend(ops)
    if chain.timeline is None:
        return  # the cut beat the first create: nothing was acknowledged
    scratch = os.path.join(root, "scratch")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    outcome = in_fresh_process(checker, image, chain.timeline, chain.ops, scratch, chain.restored, chain.rows_seen,
                               sides)
    chain.restored, chain.rows_seen = outcome["restored"], outcome["rows_seen"]
    result.count(ops)
    result.checkpoints_restored += outcome["checkpoints_restored"]
    for violation in outcome["violations"]:
        bad(violation)
    if outcome["violations"]:  # keep the evidence; a damaged run would only repeat its finding
        shutil.copytree(image, os.path.join(root, f"violation-{k:06d}"))
        chain.timeline, chain.ops, chain.restored, chain.rows_seen = None, [], {}, set()
        return
    tidy_image(image, chain.timeline, chain.ops, sides)


def tidy_image(image: str, timeline: str, ops: list[dict[str, Any]], sides: Sequence[str]) -> None:
    """Between power cycles, delete what no promise covers: runs other than the current one,
    checkpoint copies a cut interrupted (never under a final name) and what each side's ``tidy`` names."""
    for entry in os.listdir(image):
        if entry != timeline:
            shutil.rmtree(os.path.join(image, entry), ignore_errors=True)
    for partial in glob.glob(os.path.join(image, timeline, "ckpt", "*.partial")):
        os.unlink(partial)
    for tidy in [load_side(side).tidy for side in sides]:
        if tidy is not None:
            tidy(os.path.join(image, timeline), ops)


def run_powercut_campaign(cuts: int, *, seed: int = 0, directory: str | None = None, chain: int = 10,
                          max_delay: float = 1.0, min_ops: int = 0, breakage: str | None = None,
                          modes: tuple[str, ...] = CUT_MODES, existing_store: bool = False,
                          minutes: float | None = None,
                          progress: Callable[[PowercutResult], None] | None = None,
                          sides: Sequence[str] = ()) -> PowercutResult:
    """Cut the power under a live workload ``cuts`` times and check every promise after each cut.

    Args:
        cuts: number of power cuts.
        seed: makes the cut times, modes, start kinds and the workload's choices reproducible
            (thread interleavings are not).
        directory: where images, mounts and logs go (by default a temporary directory, in
            ``/dev/shm`` where it exists: the disk is simulated, so real fsyncs are only cost;
            removed afterwards unless a violation was found).
        chain: cuts on one chain of images before starting from an empty disk again (the sampler
            rotates through all four built-ins per chain). Defaults to 10.
        max_delay: longest wait (seconds) between the workload's start and the cut. Defaults to 1.
        min_ops: operations the workload logs after its start before the wait for the cut begins
            (cuts during start-up excepted), so a slow machine still checks a known number of
            operations per cut: the buffer's and the sides', not the value store's. Defaults to 0.
        breakage: one of :data:`BREAKAGES` to break durability on purpose (the campaign must then
            report violations). Defaults to None.
        modes: the cut modes drawn from, each cut at random (see :meth:`powerfs.PowerFS.cut`).
            Defaults to both, ``strict`` and ``random``.
        existing_store: start each chain from a store created on the image before the first
            power-on (so durable by construction) instead of creating it under power cuts; tests
            about other durability use it so a create bug cannot mask theirs. Defaults to False.
        minutes: start no cut after this many minutes (``result.cuts`` says how many ran).
        progress: called after every cut with the running result.
        sides: modules of side workloads an integration plugs in (:mod:`kvckpt.testing.campaigns.sides`): each child
            runs them on the mounted run directory beside the buffer's workload, and each cut's image check
            runs their checks on the surviving image.

    Raises:
        RuntimeError: powerfs cannot run here (:func:`kvckpt.testing.campaigns.powerfs.unavailable` says why).
    """
    why = powerfs.unavailable()
    if why is not None:
        raise RuntimeError(f"the power-cut campaign cannot run here: {why}")
    if breakage is not None and breakage not in BREAKAGES:
        raise ValueError(f"unknown breakage {breakage!r} (one of {', '.join(BREAKAGES)})")
    if not modes or set(modes) - set(CUT_MODES):
        raise ValueError(f"modes must be drawn from {CUT_MODES}, not {modes!r}")
    rng = random.Random(seed)
    result = PowercutResult()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    current: _Run | None = None
    with CampaignRun(result, directory, "kvckpt-powercut-", parent=shm, minutes=minutes, progress=progress) as run:
        for k in run.cycles(cuts):
            if k % chain == 0:
                if current is not None:
                    shutil.rmtree(current.image, ignore_errors=True)
                current = _Run(os.path.join(run.root, f"image-start-{k:06d}"))
                os.makedirs(current.image)
            sampler = SAMPLERS[(k // chain + seed) % len(SAMPLERS)]
            if existing_store and current.timeline is None:
                current.timeline = f"run-start-{k:06d}"
                os.makedirs(os.path.join(current.image, current.timeline, "ckpt"))
                ReplayBuffer.create(os.path.join(current.image, current.timeline, "live.kv"),
                                    workload_config(sampler)).close()
            bad = run.reporter(f"cut {k}")
            run.guarded("cut cycle", functools.partial(_one_cut, k, run.root, current, sampler, rng, max_delay,
                                                        min_ops, breakage, modes, tuple(sides), result, bad), bad)
            result.cuts += 1
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m kvckpt.testing.campaigns.powercut --cuts N [--soak] [--break KIND] [--side MODULE]``; exits 1 when a
    violation was found, 2 when powerfs cannot run here."""
    parser = argparse.ArgumentParser(prog="python -m kvckpt.testing.campaigns.powercut")
    parser.add_argument("--cuts", type=int, default=100)
    parser.add_argument("--soak", action="store_true", help="the soak size: 2000 cuts (overrides --cuts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain", type=int, default=10, help="cuts per chain of images before an empty disk")
    parser.add_argument("--max-delay", type=float, default=1.0, help="longest wait before a cut (seconds)")
    parser.add_argument("--min-ops", type=int, default=0,
                        help="operations the workload logs before the wait for a cut begins")
    parser.add_argument("--break", dest="breakage", choices=BREAKAGES, default=None,
                        help="break durability on purpose: the campaign must find violations")
    parser.add_argument("--existing-store", action="store_true",
                        help="start each chain from a store created before the first power-on")
    parser.add_argument("--mode", choices=CUT_MODES, default=None, help="only this cut mode (default: both)")
    parser.add_argument("--dir", default=None, help="keep the campaign's files here (default: a temp dir)")
    parser.add_argument("--minutes", type=float, default=None, help="start no cut after this long")
    parser.add_argument("--side", action="append", default=[],
                        help="module of a side workload to run and check too (kvckpt.testing.campaigns.sides)")
    opts = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind, so the mount is detached
    why = powerfs.unavailable()
    if why is not None:
        print(f"power-cut campaign skipped: {why}", file=sys.stderr)
        return 2
    result = run_powercut_campaign(2000 if opts.soak else opts.cuts, seed=opts.seed, directory=opts.dir,
                                   chain=opts.chain, max_delay=opts.max_delay, min_ops=opts.min_ops,
                                   breakage=opts.breakage,
                                   modes=(opts.mode,) if opts.mode else CUT_MODES,
                                   existing_store=opts.existing_store, minutes=opts.minutes,
                                   progress=every(50, lambda r: r.cuts), sides=opts.side)
    return report(result)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
