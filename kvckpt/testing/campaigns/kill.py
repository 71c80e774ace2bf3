"""The crash campaign (:func:`run_crash_campaign`, ``python -m kvckpt.testing.campaigns.campaign --kills N``):
SIGKILL a live workload again and again and check every promise after each kill.

A child process runs the :mod:`~kvckpt.testing.campaigns.workload` on a live store (it never imports torch;
it is forked from a fork server, itself a fresh interpreter that never opened a store, or with
``--exec`` started as a fresh interpreter every time). After each call returns, the child appends
the operation to an fsynced JSON-lines log: the log holds only *acknowledged* operations. The
parent SIGKILLs the child at a random moment, then, in its own process:

1. verifies the live store and replays the log against it (:mod:`kvckpt.testing.campaigns.history`): every
   acknowledged admission is a group or a ledger entry with its prompt, every acknowledged commit
   (group, sample, edge-encoded or ``commit_many``) is a committed group with the acknowledged
   digest (or, for a single sample, a recorded sibling), acknowledged evictions, aborts and
   finished steps stuck; the prompts held are exactly ``0 .. cursor-1``, each once; every stored
   row is byte-for-byte the row its producer generated;
2. checks every checkpoint file under a final name (:func:`kvckpt.durability.safe_open.verify_untrusted`)
   and restores the newest into a scratch path: it verifies, holds each prompt below its own
   cursor exactly once, and everything it holds as committed is committed in the live store with
   the same digest;
3. checks the value store beside it against its logged operations and loads every value-store
   checkpoint (:func:`kvckpt.testing.campaigns.values_workload.check_values`);
4. runs the check of each side workload an integration plugged in (:mod:`kvckpt.testing.campaigns.sides`);
5. recovers the live store (:meth:`ReplayBuffer.recover`; sometimes the next child does it) and
   lets the next child resume the workload on it, so a campaign is a chain of crashes.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvckpt import ReplayBuffer, restore
from kvckpt.durability.safe_open import verify_untrusted
from kvckpt.testing.campaigns.harness import CampaignRun, fork_server, tally
from kvckpt.testing.campaigns.history import Holdings, WorkloadFindings, check_buffer, check_history, compare_checkpoint
from kvckpt.testing.campaigns.sides import load_side
from kvckpt.testing.campaigns.values_workload import check_values
from kvckpt.testing.campaigns.workload import CHECKPOINT_GLOB, SAMPLERS, OpLog, read_log, run_workload, workload_config


@dataclass
class CampaignResult(WorkloadFindings):
    """What a crash campaign did and found; ``violations`` is empty when every promise held."""

    kills: int = 0
    checkpoints_verified: int = 0
    checkpoints_restored: int = 0
    recoveries: int = 0

    def summary(self) -> str:
        """The one-line summary the CLI prints."""
        return (f"crash campaign: kills {self.kills}, operations checked {self.operations_checked}, "
                f"checkpoints verified {self.checkpoints_verified} (restored {self.checkpoints_restored}), "
                f"recoveries {self.recoveries}, commits ({tally(self.commit_paths)}), "
                f"operations ({tally(self.operation_kinds)}), "
                f"violations found {len(self.violations)}, {self.seconds:.0f}s")


def child_main(run: str, seed: int, recover_first: bool, ready: Callable[[], None],
               sides: Sequence[str] = ()) -> None:
    """The workload of one child on the chain directory ``run`` (and each side workload of ``sides``,
    :mod:`kvckpt.testing.campaigns.sides`); calls ``ready`` once it runs."""
    buf = ReplayBuffer.open(os.path.join(run, "live.kv"))
    log = OpLog(os.path.join(run, "ops.jsonl"))
    for side in sides:
        load_side(side).start(run, log, seed)
    ckdir = os.path.join(run, "ckpt")
    if recover_first:
        plan = buf.recover()
        log.append(op="recovered", leases=[lease.group_id for lease in plan.leases])
    run_workload(buf, log, ckdir, seed, ready)


def _forked_child(run: str, seed: int, recover_first: bool, ready: Any, sides: Sequence[str]) -> None:
    """Entry of a child forked by the fork server: stderr to the chain's file, readiness on a pipe."""
    fd = os.open(os.path.join(run, "child.stderr"), os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    try:
        child_main(run, seed, recover_first, lambda: ready.send(True), sides)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


@dataclass
class Chain:
    """One live store that successive children crash on."""

    run: str
    ops_counted: int = 0
    recovered: bool = True  # a fresh store needs no recovery
    verified: set[str] = field(default_factory=set)
    sides: tuple[str, ...] = ()  #: the side workloads' modules (kvckpt.testing.campaigns.sides)
    rows_seen: set[bytes] = field(default_factory=set)

    @property
    def store(self) -> str:
        """The live store's path."""
        return os.path.join(self.run, "live.kv")

    @classmethod
    def start(cls, run: str, sampler: dict[str, Any], sides: Sequence[str] = ()) -> Chain:
        """A fresh chain directory ``run`` with a new store under ``sampler`` (and the side workloads ``sides``)."""
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(os.path.join(run, "ckpt"))
        ReplayBuffer.create(os.path.join(run, "live.kv"), workload_config(sampler)).close()
        return cls(run, sides=tuple(sides))


def _check_checkpoints(chain: Chain, ops: list[dict[str, Any]], live: Holdings, result: CampaignResult,
                       bad: Callable[[str], None]) -> None:
    """Every file under a final name is a complete, valid checkpoint (each is checked once: it is
    immutable); the newest restores into a state consistent with the live store."""
    ckdir = os.path.join(chain.run, "ckpt")
    files = sorted(glob.glob(os.path.join(ckdir, CHECKPOINT_GLOB)))
    logged = [op["path"] for op in ops if op["op"] == "ckpt"]
    if logged and logged[-1] not in files:
        bad(f"acknowledged checkpoint {logged[-1]} is missing")
    for path in files[:-1]:
        if path not in chain.verified:
            report = verify_untrusted(path)
            chain.verified.add(path)
            result.checkpoints_verified += 1
            for problem in report.problems[:5]:
                bad(f"checkpoint {os.path.basename(path)}: {problem}")
    if files and files[-1] not in chain.verified:
        chain.verified.add(files[-1])
        buf, _ = restore(files[-1], os.path.join(chain.run, "scratch.kv"), overwrite=True)  # verifies it first
        try:
            snap = check_buffer(buf, f"restored {os.path.basename(files[-1])}", bad, chain.rows_seen, deep=False)
        finally:
            buf.close()
        result.checkpoints_verified += 1
        result.checkpoints_restored += 1
        compare_checkpoint(snap, live, os.path.basename(files[-1]), bad)
    for partial in glob.glob(os.path.join(ckdir, "*.partial")):
        os.unlink(partial)  # a copy the kill interrupted; never under a final name


def _check_after_kill(chain: Chain, result: CampaignResult, recover: bool, bad: Callable[[str], None]) -> None:
    ops = read_log(os.path.join(chain.run, "ops.jsonl"))
    buf = ReplayBuffer.open(chain.store)
    try:
        snap = check_buffer(buf, "live store", bad, chain.rows_seen)
        for violation in check_history(ops, snap):
            bad(violation)
        result.count(ops[chain.ops_counted:])
        chain.ops_counted = len(ops)
        _check_checkpoints(chain, ops, snap, result, bad)
        loaded = check_values(chain.run, ops, chain.run, bad, chain.verified)
        result.checkpoints_verified += loaded
        result.checkpoints_restored += loaded
        for side in chain.sides:
            loaded = load_side(side).check(chain.run, ops, chain.run, bad)
            result.checkpoints_verified += loaded
            result.checkpoints_restored += loaded
        if recover:
            plan = buf.recover()
            result.recoveries += 1
            if {lease.group_id: lease.attempt for lease in plan.leases} != \
                    {gid: e.attempt + 1 for gid, e in snap.ledger.items()}:
                bad("recovery did not hand back every ledger entry exactly once with a bumped attempt")
            check_buffer(buf, "recovered live store", bad, chain.rows_seen, deep=False)
        chain.recovered = recover
    finally:
        buf.close()


def run_child(chain: Chain, seed: int, rng: random.Random, max_delay: float, fresh: bool) -> tuple[int, str]:
    """Start a child on ``chain``, SIGKILL it after a random delay; return its exit status and stderr.

    The child recovers the store itself when the parent did not after the previous kill. ``fresh``
    starts it as ``python -m kvckpt.testing.campaigns.campaign child`` (a new interpreter each time, about 0.4 s);
    otherwise the fork server forks it.
    """
    errpath = os.path.join(chain.run, "child.stderr")
    open(errpath, "wb").close()  # here, not in the child: a kill may land before the child runs a line
    if fresh:
        cmd = [sys.executable, "-m", "kvckpt.testing.campaigns.campaign", "child", chain.run, "--seed", str(seed)]
        if not chain.recovered:
            cmd.append("--recover")
        cmd += [arg for side in chain.sides for arg in ("--side", side)]
        with open(errpath, "ab") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        channel, pid = proc.stdout, proc.pid

        def wait_ready(timeout: float) -> None:
            if select.select([channel], [], [], timeout)[0]:
                channel.readline()

        def reap() -> int:
            return proc.wait()
    else:
        server = fork_server(chain.sides)
        channel, sender = server.Pipe(duplex=False)
        child = server.Process(target=_forked_child, args=(chain.run, seed, not chain.recovered, sender, chain.sides))
        child.start()
        sender.close()
        pid = child.pid

        def wait_ready(timeout: float) -> None:
            channel.poll(timeout)

        def reap() -> int:
            child.join()
            return child.exitcode
    try:
        if rng.random() < 0.1:  # kill during start-up, open or recovery
            time.sleep(rng.random() * 0.2)
        else:
            wait_ready(30)
            time.sleep(rng.random() * max_delay)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        status = reap()
    finally:
        channel.close()
    with open(errpath, "rb") as f:
        return status, f.read().decode(errors="replace")[-2000:]


def run_crash_campaign(kills: int, *, seed: int = 0, directory: str | None = None, chain: int = 25,
                       max_delay: float = 0.5, fresh_interpreter: bool = False, minutes: float | None = None,
                       progress: Callable[[CampaignResult], None] | None = None,
                       sides: Sequence[str] = ()) -> CampaignResult:
    """SIGKILL a live workload ``kills`` times and check every promise after each kill.

    Args:
        kills: number of kill cycles.
        seed: makes the kill times, the workload's choices and the sampler order reproducible
            (thread interleavings are not).
        directory: where the stores, logs and checkpoints go (a temporary directory, removed
            afterwards, by default).
        chain: kills on the same live store before starting a fresh one (the sampler rotates
            through all four built-ins per chain). Defaults to 25.
        max_delay: longest wait (seconds) between the child's readiness and its kill.
        fresh_interpreter: start every child as a new ``python`` process instead of forking it
            from a fork server (slower start, same workload). Defaults to False.
        minutes: start no kill cycle after this many minutes (``result.kills`` says how many ran).
        progress: called after every kill with the running result.
        sides: modules of side workloads an integration plugs in (:mod:`kvckpt.testing.campaigns.sides`): each child
            runs them beside the buffer's workload and each kill checks them.
    """
    rng = random.Random(seed)
    result = CampaignResult()
    current: Chain | None = None
    clean = 0  # violations so far: a chain that added none is deleted when the campaign owns it
    with CampaignRun(result, directory, "kvckpt-campaign-", minutes=minutes, progress=progress) as run:
        for k in run.cycles(kills):
            if k % chain == 0:
                if run.owned and current is not None and len(result.violations) == clean:
                    shutil.rmtree(current.run, ignore_errors=True)
                clean = len(result.violations)
                current = Chain.start(os.path.join(run.root, f"chain-{k // chain:05d}"),
                                      SAMPLERS[(k // chain + seed) % len(SAMPLERS)], sides)
            bad = run.reporter(f"kill {k} ({os.path.basename(current.run)})")

            def cycle(chain: Chain = current, bad: Callable[[str], None] = bad) -> None:
                status, stderr = run_child(chain, rng.randrange(1 << 30), rng, max_delay, fresh_interpreter)
                if status != -signal.SIGKILL:
                    bad(f"child exited by itself with status {status}: {stderr}")
                _check_after_kill(chain, result, rng.random() < 0.7, bad)

            run.guarded("kill cycle", cycle, bad)
            result.kills += 1
    return result
