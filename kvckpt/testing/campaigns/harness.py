"""What every campaign of :mod:`kvckpt.testing` does the same way: its scratch directory and clock,
its cycle loop (time limit, progress, a harness crash recorded as a finding), the fork server its
children come from, and how its command line reports."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Findings:
    """What every campaign's result carries: ``violations`` is empty when every promise held."""

    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    directory: str | None = None  #: the campaign's files, kept when given or when a violation was found

    def summary(self) -> str:
        """One line: what the campaign did and found (each campaign's result says it)."""
        raise NotImplementedError


def tally(counts: Mapping[str, int]) -> str:
    """``counts`` as ``"name count, ..."`` in name order, for a summary line."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


class CampaignRun:
    """One campaign's directory and clock, used as a context manager around the whole campaign.

    The root is ``directory`` when given (kept), else a fresh temporary directory (under ``parent``
    when given) that is removed at the end unless a violation was found; at the end
    ``result.seconds`` is the campaign's duration and ``result.directory`` says where the kept
    files are.
    """

    def __init__(self, result: Findings, directory: str | None, prefix: str, *, parent: str | None = None,
                 minutes: float | None = None, progress: Callable[[Any], None] | None = None) -> None:
        self.result, self.minutes, self.progress = result, minutes, progress
        self.owned = directory is None
        self.root = tempfile.mkdtemp(prefix=prefix, dir=parent) if self.owned else os.path.abspath(directory)
        os.makedirs(self.root, exist_ok=True)
        self.t0 = time.perf_counter()

    def __enter__(self) -> CampaignRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.result.seconds = self.elapsed()
        if self.owned and not self.result.violations:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            self.result.directory = self.root

    def elapsed(self) -> float:
        """Seconds since the campaign started."""
        return time.perf_counter() - self.t0

    def out_of_time(self) -> bool:
        """True once ``minutes`` have passed: start nothing new."""
        return self.minutes is not None and self.elapsed() > self.minutes * 60

    def cycles(self, count: int) -> Iterator[int]:
        """``0 .. count-1`` until :meth:`out_of_time`; after each cycle the result's clock is updated
        and ``progress`` is called with it."""
        for k in range(count):
            if self.out_of_time():
                return
            yield k
            self.tick()

    def tick(self) -> None:
        """Update the result's clock and report progress (after each cycle or case)."""
        self.result.seconds = self.elapsed()
        if self.progress is not None:
            self.progress(self.result)

    def reporter(self, where: str) -> Callable[[str], None]:
        """A ``bad(message)`` that records ``where: message`` as a violation."""
        def bad(message: str) -> None:
            self.result.violations.append(f"{where}: {message}")
        return bad

    def guarded(self, what: str, cycle: Callable[[], None], bad: Callable[[str], None]) -> None:
        """Run ``cycle()``; an exception of the harness itself is a finding (reported to ``bad``),
        not a reason to stop the campaign."""
        try:
            cycle()
        except Exception as exc:
            bad(f"the {what} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")


def start_writer(name: str, step: Callable[[], None], rng: random.Random,
                 first: Callable[[], None] | None = None) -> None:
    """Start the daemon thread ``name`` of a campaign child's writer: ``first()`` (when given), then ``step()``
    with a random pause of up to 20 ms after each (a share of the disk that leaves the buffer its pace), until
    the process dies (the campaign kills it); any error prints its traceback and ends the process (status 3)."""
    def run() -> None:
        try:
            if first is not None:
                first()
            while True:
                step()
                time.sleep(rng.random() * 0.02)
        except BaseException:
            traceback.print_exc()
            os._exit(3)

    threading.Thread(target=run, name=name, daemon=True).start()


_FORK_SERVER: Any = None


def fork_server(preload: Sequence[str] = ()) -> Any:
    """A multiprocessing fork-server context whose server (a fresh interpreter) preloads the
    campaigns' modules and never opens a store, so each child forks in milliseconds with no LMDB
    state inherited.

    ``preload``: more modules the server imports when this call is the first (a campaign's side workloads,
    :mod:`kvckpt.testing.campaigns.sides`, whose imports can take seconds); a server made earlier keeps its list, and
    a child then imports them itself (slower, the same workload)."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        _FORK_SERVER = multiprocessing.get_context("forkserver")
        # mfusepy: kvckpt.testing.campaigns.powerfs; torch: ReplayBuffer.progress returns tensors, and a child
        # importing it itself spends seconds of its short life doing so. The server skips a preload
        # that raises ImportError and dies of any other error, so mfusepy, which raises OSError
        # where it finds no libfuse, is preloaded only where it imports.
        fuse = ["mfusepy"] if _imports("mfusepy") else []
        _FORK_SERVER.set_forkserver_preload(["__main__", "kvckpt.testing.campaigns.kill",
                                             "kvckpt.testing.campaigns.powercut", *fuse, "torch", *preload])
    return _FORK_SERVER


def _imports(module: str) -> bool:
    """Whether ``module`` imports in this process (any error it raises: False)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def in_fresh_process(target: Callable[..., None], *args: Any, timeout: float = 300.0) -> Any:
    """Run ``target(*args, conn)`` in a process forked from the fork server; return what it sent."""
    ctx = fork_server()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, send), daemon=True)
    proc.start()
    send.close()
    deadline = time.monotonic() + timeout
    try:
        while not recv.poll(0.05):
            if not proc.is_alive() and not recv.poll(0):
                raise RuntimeError(f"{target.__name__} died without an answer (exit status {proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.__name__} sent nothing within {timeout}s")
        return recv.recv()
    finally:
        proc.kill()
        proc.join()
        recv.close()


def every(n: int, count: Callable[[Any], int]) -> Callable[[Any], None]:
    """A ``progress`` callback printing the summary to stderr when ``count(result)`` is a multiple of ``n``."""
    def report(result: Any) -> None:
        if count(result) % n == 0:
            print(result.summary(), file=sys.stderr, flush=True)
    return report


def report(result: Findings) -> int:
    """Print a finished campaign's violations (the first 50), where its files are and its summary;
    return the exit status: 1 when a violation was found, else 0."""
    for violation in result.violations[:50]:
        print("VIOLATION", violation)
    if result.violations:
        print(f"files kept in {result.directory}")
    print(result.summary(), flush=True)
    return 1 if result.violations else 0
